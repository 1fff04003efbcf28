"""The tools' plots (matplotlib, the ``plot`` extra, imported only when plotting)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _import_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "plotting needs matplotlib, which is not installed; install the 'plot' extra: "
            "pip install 'hylinker[plot]'") from exc
    return Figure, FigureCanvasAgg


def plot_stress(
    path: str,
    hit_rate_over_time: Sequence[tuple[float, float]],
    latency_samples: Mapping[str, Sequence[float]],
    *,
    title: str | None = None,
    bound_hit_rate: float | None = None,
) -> None:
    """Write a PNG with two panels: hit rate over time, and the latency CDF of each phase.

    ``hit_rate_over_time`` holds ``(seconds since start, hit rate in [0, 1])``;
    ``latency_samples`` maps a phase name (``"lookup"``, ``"load"``, ...) to latencies in
    seconds (phases without samples are left out). ``bound_hit_rate`` draws the
    infinite-cache ceiling as a dashed line. Raises ``ImportError`` naming the ``plot`` extra
    when matplotlib is missing.
    """
    figure_cls, canvas_cls = _import_matplotlib()
    fig = figure_cls(figsize=(11, 4.2), layout="constrained")
    canvas_cls(fig)
    ax_hit, ax_lat = fig.subplots(1, 2)

    if hit_rate_over_time:
        t = np.array([p[0] for p in hit_rate_over_time], dtype=np.float64)
        h = np.array([p[1] for p in hit_rate_over_time], dtype=np.float64) * 100.0
        ax_hit.plot(t, h, label="hit rate")
    if bound_hit_rate is not None:
        ax_hit.axhline(bound_hit_rate * 100.0, linestyle="--", color="gray", label="infinite-cache bound")
    if hit_rate_over_time or bound_hit_rate is not None:
        ax_hit.legend(loc="lower right")
    ax_hit.set_xlabel("time (s)")
    ax_hit.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax_hit.set_ylim(0, 100)
    ax_hit.set_title("hit rate over time")
    ax_hit.grid(True, alpha=0.3)

    plotted = 0
    positive = True
    for phase, samples in latency_samples.items():
        arr = np.sort(np.asarray(samples, dtype=np.float64)) * 1e3
        if arr.size == 0:
            continue
        positive = positive and bool(arr[0] > 0)
        frac = np.arange(0, arr.size + 1) / arr.size
        ax_lat.step(np.concatenate([arr[:1], arr]), frac, where="post", label=f"{phase} (n={arr.size})")
        plotted += 1
    if plotted:
        if positive:
            ax_lat.set_xscale("log")
        ax_lat.legend(loc="lower right")
    else:
        ax_lat.text(0.5, 0.5, "no latency samples", ha="center", va="center", transform=ax_lat.transAxes)
    ax_lat.set_xlabel("latency (ms)")
    ax_lat.set_ylabel("fraction of calls")
    ax_lat.set_ylim(0, 1.0)
    ax_lat.set_title("latency CDF per phase")
    ax_lat.grid(True, alpha=0.3, which="both")
    if title:
        fig.suptitle(title)
    fig.savefig(path, format="png", dpi=100)
