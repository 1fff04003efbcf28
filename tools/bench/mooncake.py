"""Mooncake setups for the data-path benchmark: in-process segment, separate storage process.

* ``mooncake-inproc``: the runtime's own client contributes the segment, so puts and gets are
  memory copies inside one process (through the transfer engine).
* ``mooncake-remote``: a second process (``hylinker mooncake segment``) contributes the segment
  and the runtime's client contributes none: every byte crosses loopback TCP.

Both share one loopback master, started here and stopped when the ``ExitStack`` closes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio

MIB = 1 << 20


def mooncake_setups(stack: contextlib.ExitStack, segment_bytes: int) -> list[tuple[str, Callable[[int], Any]]]:
    """Start a master (and a storage process); return ``(name, factory(capacity))`` pairs."""
    from ...stores.mooncake import MooncakeConfig, MooncakeStore, import_mooncake_store
    from ...stores.mooncake_master import MooncakeMaster

    import_mooncake_store()  # a clear ImportError early if the client is missing
    master = stack.enter_context(MooncakeMaster().start())
    address = master.address

    def inproc(capacity: int) -> Any:
        return MooncakeStore.open(MooncakeConfig(master_address=address,
                                                 segment_bytes=max(capacity, segment_bytes),
                                                 local_buffer_bytes=64 * MIB))

    remote_master = stack.enter_context(MooncakeMaster().start())
    segment_process(stack, remote_master.address, segment_bytes)

    async def remote(capacity: int) -> Any:
        store = await MooncakeStore.open(MooncakeConfig(master_address=remote_master.address, segment_bytes=0,
                                                        local_buffer_bytes=64 * MIB))
        # the peer's segment outlives each store, and every round's keys are its own: start
        # each store on an empty segment, or later rounds find it full (puts answered FULL)
        await anyio.to_thread.run_sync(store._client.remove_all, True)
        return store

    return [("mooncake-inproc", inproc), ("mooncake-remote", remote)]


def segment_process(stack: contextlib.ExitStack, master_address: str, segment_bytes: int) -> None:
    """A storage-only process (``hylinker mooncake segment``) holding ``segment_bytes`` for the
    master at ``master_address``, mounted when this returns, stopped when ``stack`` closes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hylinker", "mooncake", "segment", "--master", master_address,
         "--segment-mib", str(segment_bytes // MIB)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stack.callback(_stop, proc)
    _wait_for_segment(proc)


def _wait_for_segment(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "mounted" in line:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the storage process exited ({proc.returncode}): {line.strip()}")
    raise RuntimeError("the storage process did not mount its segment in time")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_SEGMENT_MIN_BYTES = 512 << 20


def copy_path_setting() -> str:
    """``MC_STORE_MEMCPY`` as the benches' JSON records it (``"unset"`` when absent). It decides
    how a client writes into its own in-process segment: a local memcpy unless it is ``"0"``,
    then over loopback TCP (4-5x slower on the 2-core host of docs/figures.md). Unset, the
    0.3.13 client turns memcpy on by itself when TCP is its only transport (it logs
    "MC_STORE_MEMCPY not set, auto-detected: TCP-only environment, memcpy enabled")."""
    return os.environ.get("MC_STORE_MEMCPY", "unset")


def anonymous_mappings() -> set[tuple[int, int]]:
    """Writable anonymous mappings of this process, as (start, end) addresses."""
    out = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) == 5 and "w" in fields[1]:  # no path: anonymous
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.add((lo, hi))
    return out


def populate_new_segments(before: set[tuple[int, int]]) -> int:
    """Fault in every writable anonymous mapping of 512 MiB or more that is not in ``before``
    (the in-process segment a Mooncake client just allocated); returns the bytes populated.
    A benchmark measures steady state this way: on a virtual machine that returns free memory
    to its host, the first write to each fresh 4 KiB page costs ~10 us (0.4 GB/s). Contents are unchanged:
    populating private anonymous memory only allocates the pages a first write would."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    total = 0
    for lo, hi in sorted(anonymous_mappings() - before):
        if hi - lo >= _SEGMENT_MIN_BYTES:
            if libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")
            total += hi - lo
    return total
