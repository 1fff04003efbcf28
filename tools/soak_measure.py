"""What a soak samples, how it decides that something grew, and its table and plot.

Every few seconds (:class:`Sampler`) the process's resident memory, its Python heap
(``tracemalloc``'s traced bytes when tracing, else the interpreter's allocated blocks), its
threads and open descriptors, and what the front reports (asyncio tasks, pool occupancy, store
objects, the eviction memory's bytes) are sampled against time. After the warm-up, a metric
*grew* when the median of the last fifth of the samples exceeds the median of the first fifth by
more than its tolerance (:data:`TOLERANCES`; a front adds its own: asyncio tasks beyond what it
has in flight, pages and locks that its work in flight does not account for, the eviction
memory's budget); a metric without a tolerance is plotted, not checked. The samples are the
only history: a long soak halves them (every other one dropped) when they reach
:data:`MAX_SAMPLES`, so a soak of weeks stays flat itself.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

MIB = 1 << 20
#: samples kept at most (then every other one is dropped: the history stays bounded)
MAX_SAMPLES = 2048
#: the share of the post-warm-up samples whose median is compared, first against last
WINDOW = 0.2


@attrs.frozen
class Tolerance:
    """A metric may grow by ``absolute`` plus ``share`` of its first-window median."""

    absolute: float
    share: float = 0.0
    unit: str = ""

    def allowed(self, first: float) -> float:
        return self.absolute + self.share * abs(first)

    def describe(self) -> str:
        parts = [f"{self.absolute:g}{self.unit}"] if self.absolute or not self.share else []
        if self.share:
            parts.append(f"{self.share:.0%}")
        return " + ".join(parts)


#: the stated tolerances: resident memory within 16 MiB (issue 53), threads and descriptors flat
TOLERANCES: dict[str, Tolerance] = {
    "rss_mib": Tolerance(16.0, unit=" MiB"),
    "heap_mib": Tolerance(16.0, unit=" MiB"),  # tracemalloc's traced bytes (--tracemalloc)
    "heap_kblocks": Tolerance(0.0, 0.05),  # the interpreter's allocated blocks, thousands
    "threads": Tolerance(0.0),
    "fds": Tolerance(0.0),
    "tasks": Tolerance(0.0),
}


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


@functools.cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once; None where the C library has none."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)


def _malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: free memory the allocator holds goes back to the system.
    False where the C library has none."""
    trim = _libc_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def malloc_trim_released_mib() -> float:
    """Resident memory given back by glibc's ``malloc_trim(0)`` (MiB): memory the allocator held
    free, not live objects. 0.0 where the C library has no ``malloc_trim``."""
    before = resident_mib()
    return before - resident_mib() if _malloc_trim() else 0.0


def thread_names() -> dict[str, int]:
    """The Python threads by name, digits dropped (``ThreadPoolExecutor-3_1`` counts as
    ``ThreadPoolExecutor-_``): tells a pool that grew to its bound from a thread per event."""
    import re
    import threading

    out: dict[str, int] = {}
    for t in threading.enumerate():
        name = re.sub(r"\d+", "", t.name)
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def os_threads() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return threading.active_count()  # pragma: no cover - every Linux has the line


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@attrs.define
class Sample:
    t_s: float
    done: int  # requests (or iterations) finished so far
    values: dict[str, float]


class Sampler:
    """Samples the process and the front every ``interval_s``; the front calls :meth:`due` and
    :meth:`take` from its own loop (no sampling thread: it would be a thread to count)."""

    def __init__(self, interval_s: float, *, trace_heap: bool = False, trim: bool = False) -> None:
        self.interval_s = interval_s
        self.trace_heap = trace_heap
        self.trim = trim  # malloc_trim before each sample: resident memory counts live objects
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self._next = self.t0
        self._snapshot: tracemalloc.Snapshot | None = None
        self.heap_top: list[str] = []  # tracemalloc's top growth by file, warm-up to the end
        if trace_heap:
            tracemalloc.start()

    def start_clock(self) -> None:
        """Time starts now (a front that spent its first seconds importing an engine)."""
        self.t0 = self._next = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def take(self, done: int, front: Mapping[str, float]) -> Sample:
        now = time.monotonic()
        self._next = now + self.interval_s
        if self.trim:
            _malloc_trim()
        values = {"rss_mib": resident_mib(), "threads": float(os_threads()), "fds": float(open_descriptors())}
        if self.trace_heap:
            values["heap_mib"] = tracemalloc.get_traced_memory()[0] / MIB
        else:
            values["heap_kblocks"] = sys.getallocatedblocks() / 1000
        values.update(front)
        sample = Sample(now - self.t0, done, values)
        self.samples.append(sample)
        if len(self.samples) >= MAX_SAMPLES:
            self.samples = self.samples[::2]
        return sample

    def warmed_up(self) -> None:
        """The warm-up ended: the heap's growth by file is measured from here."""
        if self.trace_heap:
            self._snapshot = tracemalloc.take_snapshot()

    def finish(self, top: int = 10) -> None:
        if self.trace_heap and self._snapshot is not None:
            stats = tracemalloc.take_snapshot().compare_to(self._snapshot, "filename")
            self.heap_top = [f"{s.size_diff / 1024:+.1f} KiB in {s.count_diff:+d} blocks  {s.traceback[0].filename}"
                             for s in stats[:top]]
            tracemalloc.stop()


@attrs.frozen
class Growth:
    metric: str
    first: float
    last: float
    allowed: float
    tolerance: str

    @property
    def grew(self) -> bool:
        return self.last - self.first > self.allowed


def growth(samples: Sequence[Sample], warmup_s: float,
           tolerances: Mapping[str, Tolerance] = TOLERANCES) -> list[Growth]:
    """Each sampled metric's growth after the warm-up: last-fifth median minus first-fifth median."""
    after = [s for s in samples if s.t_s >= warmup_s]
    if len(after) < 2:
        return []
    n = max(1, round(len(after) * WINDOW))
    out: list[Growth] = []
    for metric in after[0].values:
        tol = tolerances.get(metric)
        if tol is None:
            continue
        first = statistics.median(s.values.get(metric, 0.0) for s in after[:n])
        last = statistics.median(s.values.get(metric, 0.0) for s in after[-n:])
        out.append(Growth(metric, first, last, tol.allowed(first), tol.describe()))
    return out


def table(samples: Sequence[Sample], rows: int = 12) -> str:
    """The samples (about ``rows`` of them, evenly spaced, the last included) as a text table."""
    if not samples:
        return "(no samples)"
    step = max(1, len(samples) // rows)
    picked = list(samples[::step])
    if picked[-1] is not samples[-1]:
        picked.append(samples[-1])
    names = list(samples[-1].values)
    head = ["min", "done", *names]
    lines = [head] + [[f"{s.t_s / 60:.1f}", str(s.done), *(f"{s.values.get(k, 0.0):.1f}" for k in names)]
                      for s in picked]
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in lines)


def verdict(grown: Sequence[Growth]) -> str:
    lines = [f"{'metric':>14}  {'first':>9}  {'last':>9}  {'growth':>9}  tolerance"]
    for g in grown:
        mark = "GREW" if g.grew else "flat"
        lines.append(f"{g.metric:>14}  {g.first:9.1f}  {g.last:9.1f}  {g.last - g.first:+9.1f}  "
                     f"{g.tolerance} ({g.allowed:.1f})  {mark}")
    return "\n".join(lines)


def plot(path: Path, samples: Sequence[Sample], warmup_s: float, title: str) -> None:
    """One panel per metric against minutes; the warm-up shaded."""
    from .plots import _import_matplotlib

    figure_cls, canvas_cls = _import_matplotlib()
    names = list(samples[-1].values) if samples else []
    cols = 3
    rows = max(1, -(-len(names) // cols))
    fig = figure_cls(figsize=(4.2 * cols, 2.6 * rows), layout="constrained")
    canvas_cls(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    minutes = [s.t_s / 60 for s in samples]
    for ax, name in zip(axes.flat, names):
        ax.plot(minutes, [s.values.get(name, 0.0) for s in samples], lw=1.2)
        ax.axvspan(0, warmup_s / 60, color="0.9", lw=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("minutes", fontsize=8)
        ax.tick_params(labelsize=7)
        low, high = ax.get_ylim()
        if high - low < 1:  # a flat line reads as flat, not as noise blown up
            mid = (high + low) / 2
            ax.set_ylim(mid - 1, mid + 1)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)


def report(samples: Sequence[Sample], warmup_s: float, heap_top: Sequence[str],
           summary: Mapping[str, Any], tolerances: Mapping[str, Tolerance] = TOLERANCES) -> tuple[str, bool]:
    """The soak's text report and whether anything grew."""
    grown = growth(samples, warmup_s, tolerances)
    unchecked = [m for m in samples[-1].values if m not in tolerances] if samples else []
    if not grown:  # nothing to decide on is not "flat"
        return (f"{table(samples)}\n\nfewer than 2 samples after {warmup_s:.0f} s of warm-up: "
                "growth cannot be judged (a longer run, or a shorter --warmup-s)"), True
    parts = [table(samples), "", f"growth after {warmup_s:.0f} s of warm-up "
             f"(median of the last {WINDOW:.0%} of samples minus the first {WINDOW:.0%}):", verdict(grown),
             f"not checked (bounded by construction, filling during the run): {', '.join(unchecked)}"]
    if heap_top:
        parts += ["", "tracemalloc, top growth by file since the warm-up:", *heap_top]
    parts += ["", "  ".join(f"{k}={v}" for k, v in summary.items())]
    return "\n".join(parts), any(g.grew for g in grown)


Probe = Callable[[], dict[str, float]]

__all__ = ["MAX_SAMPLES", "TOLERANCES", "Growth", "Probe", "Sample", "Sampler", "Tolerance", "growth",
           "open_descriptors", "os_threads", "plot", "report", "resident_mib", "table"]
