"""The host a figure was measured on, in the figure's own JSON: every data-path benchmark
(``hylinker bench``, ``hylinker bench-sglang``, ``python -m hylinker.tools.lab.checksum``, ``python -m hylinker.tools.lab.hash_overlap``) writes a
``"host"`` object made here, so a ratio can be read against the machine that produced it.

``memcpy_gbps`` is measured in the run (``numpy.copyto`` of 64 MiB between two preallocated,
touched buffers, best of 5: the copy routine the embedded store uses), not looked up, because
the same machine type gives different figures under other tenants. ``load_average`` is the 1, 5
and 15 minute load average at the start; :func:`finish` adds the 1-minute figure at the end. A
load average near or above ``cores`` means the figures were taken on a busy machine.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import numpy as np


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Best-of-``repeats`` GB/s of one ``numpy.copyto`` of ``nbytes`` between touched buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # first touch outside the timing
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return round(best, 2)


def host_record() -> dict[str, Any]:
    """Cores, memcpy GB/s measured now, load average (1, 5, 15 min), machine and Python."""
    load = [round(x, 2) for x in os.getloadavg()]
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memcpy_gbps": memcpy_gbps(),
        "load_average": load,
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


def finish(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the 1-minute load average at the end of the run added."""
    return {**record, "load_average_end": round(os.getloadavg()[0], 2)}


def describe(record: dict[str, Any]) -> str:
    """One line for a benchmark's printout."""
    end = record.get("load_average_end")
    return (f"host: {record['cores']} cores ({record['usable_cores']} usable), memcpy {record['memcpy_gbps']} GB/s, "
            f"load average {record['load_average']}" + (f" -> {end}" if end is not None else ""))


__all__ = ["describe", "finish", "host_record", "memcpy_gbps"]
