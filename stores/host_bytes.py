"""Host buffers that hylinker's own threads fill without starting an OpenMP team.

torch's CPU ops (a ``fill_``, ``zeros``, a large ``copy_``) run an OpenMP parallel region in
the calling thread: the first one on a thread starts a team of ``torch.get_num_threads()``
threads for that thread, and the team lives as long as the thread. In an engine's process that
is a second team beside the one its forward runs on, and GNU OpenMP (libgomp, torch's CPU
runtime) then manages more threads than the host has cores and switches every team to its
throttled wait: a worker spins 100 rounds instead of ~300,000 before it sleeps, so every
parallel region of the engine's forward pays a futex wake. On a 2-core host with vLLM's CPU
build that made a decode step 1.7x as long and a 4 K-token prefill ~1.4x (docs/figures/vllm-peers.md). So a buffer created or cleared on the store's loop, a copy
worker or an anyio worker thread is filled here, through NumPy, which runs in the calling
thread alone.

The same holds for any torch op of more than ~32,768 elements (a ``copy_``, an
``index_copy_``) on those threads: a load's copies into the pools, a bounce-buffer copy.
:func:`one_openmp_thread` caps the calling thread's OpenMP width at one, so torch runs such an
op in that thread alone and starts no team; hylinker calls it on the threads it owns (its copy
workers, its portal loop threads, the Mooncake client's call threads), never on the caller's.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable

import numpy as np
import torch


def zeroed(nbytes: int) -> torch.Tensor:
    """A new host ``uint8`` tensor of ``nbytes`` zero bytes, filled without OpenMP."""
    return zero_fill(torch.empty(nbytes, dtype=torch.uint8))


def zero_fill(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` (a contiguous host ``uint8`` tensor, pinned or not) set to zeros without OpenMP; returns it."""
    buf.numpy().fill(0)
    return buf


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy host ``uint8`` tensor ``src`` into ``dst`` (same shape) through NumPy: a memcpy in the
    calling thread, no OpenMP region. On the engine's own thread too: torch's ``copy_`` of a page
    (over ~32,768 bytes) runs a parallel region on the engine's team, whose barrier waits for every
    team thread; on a loaded host each such wake-up can cost a scheduling quantum (a miss's
    13 page copies into staging took 62 ms at load average 10, 0.3 ms through NumPy)."""
    np.copyto(dst.numpy(), src.numpy())


_OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")
_capped = threading.local()


@functools.cache
def _omp_set_num_threads() -> Callable[[int], object] | None:
    """The loaded OpenMP runtime's ``omp_set_num_threads`` (the one torch uses), or None."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(_OPENMP_RUNTIMES) and ".so" in name:
            try:
                return ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                continue
    return None


def one_openmp_thread() -> None:
    """Cap the calling thread's torch CPU ops at one OpenMP thread (no team). Idempotent.

    Call it only on a thread hylinker owns. The cap is the OpenMP runtime's per-thread setting,
    so the engine's threads keep their width; ``torch.set_num_threads`` would not do, since it
    also changes the width every thread that starts later takes. torch sets a thread's width on
    its first use in that thread, so that is done first, then capped."""
    if getattr(_capped, "done", False):
        return
    _capped.done = True
    torch.get_num_threads()
    setter = _omp_set_num_threads()
    if setter is not None:
        setter(1)


__all__ = ["one_openmp_thread", "zero_fill", "zeroed"]
