"""Host buffers that hylinker's own threads fill without starting an OpenMP team.

torch's CPU ops (a ``fill_``, ``zeros``, a large ``copy_``) run an OpenMP parallel region in
the calling thread: the first one on a thread starts a team of ``torch.get_num_threads()``
threads for that thread, and the team lives as long as the thread. In an engine's process that
is a second team beside the one its forward runs on, and GNU OpenMP (libgomp, torch's CPU
runtime) then manages more threads than the host has cores and switches every team to its
throttled wait: a worker spins 100 rounds instead of ~300,000 before it sleeps, so every
parallel region of the engine's forward pays a futex wake. On a 2-core host with vLLM's CPU
build that made a decode step 1.7x as long and a 4 K-token prefill ~1.4x (docs/figures.md,
"Where the miss's time went"). So a buffer created or cleared on the store's loop, a copy
worker or an anyio worker thread is filled here, through NumPy, which runs in the calling
thread alone.
"""

from __future__ import annotations

import torch


def zeroed(nbytes: int) -> torch.Tensor:
    """A new host ``uint8`` tensor of ``nbytes`` zero bytes, filled without OpenMP."""
    return zero_fill(torch.empty(nbytes, dtype=torch.uint8))


def zero_fill(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` (a contiguous host ``uint8`` tensor, pinned or not) set to zeros without OpenMP; returns it."""
    buf.numpy().fill(0)
    return buf


__all__ = ["zero_fill", "zeroed"]
