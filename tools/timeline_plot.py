"""The PNG of ``hylinker trace --png``: a window of requests and the pool actors under them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .plots import _import_matplotlib

if TYPE_CHECKING:  # the timeline module imports this one when it draws
    from .timeline import Slice, Timeline

PHASE_COLORS = {"lookup": "tab:purple", "load": "tab:orange", "engine": "tab:blue", "offload": "tab:green"}
JOB_COLOR = {"load": "tab:orange", "offload": "tab:green"}
STORE_COLOR = "tab:red"


def plot_window(path: str, tl: Timeline, rids: list[str], *, title: str, phases: Sequence[str]) -> Any:
    """One row per request of ``rids`` (its phases as bars, instants as ticks) and, below, one
    row per pool track with the jobs and store calls inside the requests' time span."""
    figure_cls, canvas_cls = _import_matplotlib()
    lo = min(s.start for rid in rids for s in tl.requests[rid])
    hi = max(s.end for rid in rids for s in tl.requests[rid])
    pool_rows = [(track, [s for s in tl.pools[track] if s.end >= lo and s.start <= hi]) for track in sorted(tl.pools)]
    pool_rows = [(track, slices) for track, slices in pool_rows if slices]
    rows = len(rids) + len(pool_rows)
    fig = figure_cls(figsize=(12, 1.2 + 0.32 * rows), layout="constrained")
    canvas_cls(fig)
    ax = fig.subplots()
    ms = 1e-3

    def bars(y: int, slices: list[Slice], color: Any, height: float = 0.6) -> None:
        spans = [((s.start - lo) * ms, max((s.end - s.start) * ms, 1e-3)) for s in slices if s.end > s.start]
        if spans:
            ax.broken_barh(spans, (y - height / 2, height), facecolors=color, edgecolor="none")

    labels: list[str] = []
    for y, rid in enumerate(rids):
        slices = tl.requests[rid]
        whole = [s for s in slices if s.name == "request"]
        bars(y, whole, "0.88", 0.8)
        for phase in phases:
            bars(y, [s for s in slices if s.name == phase], PHASE_COLORS[phase])
        ticks = [(s.start - lo) * ms for s in slices if s.end == s.start]
        ax.plot(ticks, [y] * len(ticks), "|", color="black", markersize=8)
        labels.append(rid)
    for i, (track, slices) in enumerate(pool_rows):
        y = len(rids) + i
        color = STORE_COLOR if " store " in track else JOB_COLOR.get(track.split()[-1], "tab:gray")
        bars(y, slices, color, 0.5)
        labels.append(track)
    ax.set_yticks(range(rows), labels, fontsize=7)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(0, (hi - lo) * ms * 1.01)
    ax.set_xlabel(f"ms since the window's first event (+{lo * ms:,.1f} ms into the trace)")
    ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items()]
    handles += [Patch(color="0.88", label="request"), Patch(color=STORE_COLOR, label="store call")]
    fig.legend(handles=handles, loc="outside lower center", ncol=6, frameon=False)
    ax.set_title(title)
    fig.savefig(path, dpi=110)
    return fig


__all__ = ["plot_window"]
