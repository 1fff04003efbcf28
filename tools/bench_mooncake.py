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

MIB = 1 << 20


def mooncake_setups(stack: contextlib.ExitStack, segment_bytes: int) -> list[tuple[str, Callable[[int], Any]]]:
    """Start a master (and a storage process); return ``(name, factory(capacity))`` pairs."""
    from ..stores.mooncake import MooncakeConfig, MooncakeStore, import_mooncake_store
    from ..stores.mooncake_master import MooncakeMaster

    import_mooncake_store()  # a clear ImportError early if the client is missing
    master = stack.enter_context(MooncakeMaster().start())
    address = master.address

    def inproc(capacity: int) -> Any:
        return MooncakeStore.open(MooncakeConfig(master_address=address,
                                                 segment_bytes=max(capacity, segment_bytes),
                                                 local_buffer_bytes=64 * MIB))

    remote_master = stack.enter_context(MooncakeMaster().start())
    proc = subprocess.Popen(
        [sys.executable, "-m", "hylinker", "mooncake", "segment", "--master", remote_master.address,
         "--segment-mib", str(segment_bytes // MIB)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stack.callback(_stop, proc)
    _wait_for_segment(proc)

    def remote(capacity: int) -> Any:
        return MooncakeStore.open(MooncakeConfig(master_address=remote_master.address, segment_bytes=0,
                                                 local_buffer_bytes=64 * MIB))

    return [("mooncake-inproc", inproc), ("mooncake-remote", remote)]


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
