"""The tools' plots (matplotlib, the ``plot`` extra, imported only when plotting).

* :func:`plot_stress`: one stress run, its device and store hit rates as stacked areas under
  the infinite-cache bound of the same finished requests, and each phase's latency CDF;
* :func:`plot_study`: a study's rows, hit rate (device and store) beside the bound per
  variant, and what the store held for it.

Legends sit below their panel, outside the data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .stress.run import HitSample

DEVICE_COLOR = "tab:blue"
STORE_COLOR = "tab:orange"
BOUND_COLOR = "black"


def _import_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "plotting needs matplotlib, which is not installed; install the 'plot' extra: "
            "pip install 'hylinker[plot]'") from exc
    return Figure, FigureCanvasAgg


def _figure(title: str | None) -> tuple[Any, Any, Any]:
    figure_cls, canvas_cls = _import_matplotlib()
    fig = figure_cls(figsize=(12, 5), layout="constrained")
    canvas_cls(fig)
    left, right = fig.subplots(1, 2)
    if title:
        fig.suptitle(title)
    return fig, left, right


def legend_below(ax: Any, columns: int = 3, fontsize: float | None = None) -> None:
    """The legend below the panel, never over the curves (the figure leaves room for it)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=columns, frameon=False, fontsize=fontsize)


def save_ttft_cdf(fig: Any, ax: Any, path: Any, title: str, *, title_size: float, columns: int,
                  bottom: float) -> None:
    """Finish a TTFT CDF panel (a log axis of seconds, fractions of requests, the legend below)
    and write the figure to ``path`` as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    log_seconds_axis(ax)
    ax.set_xlabel("time to first token, s (log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=title_size)
    legend_below(ax, columns=columns, fontsize=8)
    fig.subplots_adjust(bottom=bottom)  # room for the legend
    ax.grid(alpha=0.3)
    FigureCanvasAgg(fig).print_png(str(path))


def _finish_panel(ax: Any, xlabel: str, ylabel: str, ylim: tuple[float, float], title: str, **grid: Any) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.grid(True, alpha=0.3, **grid)


def log_seconds_axis(ax: Any) -> None:
    """A log x axis of seconds labelled 0.02, 0.05, 0.1, 0.2, ... (matplotlib's labelled minor ticks
    overlap at a figure's usual width)."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_stress(
    path: str,
    hits_over_time: Sequence[HitSample],
    latency_samples: Mapping[str, Sequence[float]],
    *,
    title: str | None = None,
) -> Any:
    """Write a PNG with two panels: the hit rate as the run goes (device and store hits as
    stacked areas, the infinite-cache bound of the same requests as a line), and the latency
    CDF of each phase.

    ``hits_over_time`` holds a :class:`~hylinker.tools.stress.run.HitSample` per finished request;
    ``latency_samples`` maps a phase name (``"lookup"``, ``"load"``, ...) to latencies in seconds
    (phases without samples are left out). Returns the figure. Raises ``ImportError`` naming
    the ``plot`` extra when matplotlib is missing.
    """
    fig, ax_hit, ax_lat = _figure(title)
    if hits_over_time:
        t = np.array([s.seconds for s in hits_over_time], dtype=np.float64)
        device = np.array([s.device for s in hits_over_time], dtype=np.float64) * 100.0
        store = np.array([s.store for s in hits_over_time], dtype=np.float64) * 100.0
        bound = np.array([s.bound for s in hits_over_time], dtype=np.float64) * 100.0
        ax_hit.stackplot(t, device, store, colors=(DEVICE_COLOR, STORE_COLOR), alpha=0.75,
                         labels=(f"device hits (end {device[-1]:.1f}%)", f"store hits (end {store[-1]:.1f}%)"))
        ax_hit.plot(t, bound, color=BOUND_COLOR, linestyle="--", linewidth=1.2,
                    label=f"infinite-cache bound (end {bound[-1]:.1f}%)")
        ax_hit.set_xlim(t[0], t[-1] if t[-1] > t[0] else t[0] + 1.0)
    else:
        ax_hit.text(0.5, 0.5, "no request finished", ha="center", va="center", transform=ax_hit.transAxes)
    _finish_panel(ax_hit, "time (s)", "% of the finished requests' prompt tokens", (0, 100), "hit rate so far")
    legend_below(ax_hit, columns=2)

    plotted = 0
    positive = True
    for phase, samples in latency_samples.items():
        arr = np.sort(np.asarray(samples, dtype=np.float64)) * 1e3
        if arr.size == 0:
            continue
        positive = positive and bool(arr[0] > 0)
        frac = np.arange(0, arr.size + 1) / arr.size
        ax_lat.step(np.concatenate([arr[:1], arr]), frac, where="post", label=f"{phase} (n={arr.size:,})")
        plotted += 1
    if plotted:
        if positive:
            ax_lat.set_xscale("log")
    else:
        ax_lat.text(0.5, 0.5, "no latency samples", ha="center", va="center", transform=ax_lat.transAxes)
    _finish_panel(ax_lat, "latency (ms)", "fraction of calls", (0, 1.0), "latency CDF per phase", which="both")
    legend_below(ax_lat)
    fig.savefig(path, format="png", dpi=100)
    return fig


def _split(row: Mapping[str, Any]) -> tuple[float, float]:
    """A study row's device and store hit rates, in % of its prompt tokens."""
    hit = row["device_hit_tokens"] + row["store_hit_tokens"]
    share = row["store_hit_tokens"] / hit if hit else 0.0
    return row["hit_rate"] * 100.0 * (1 - share), row["hit_rate"] * 100.0 * share


def plot_study(path: str, study: str, rows: Sequence[Mapping[str, Any]], *, title: str | None = None) -> Any:
    """Write a PNG of a study's rows (:func:`hylinker.tools.report.stress_row` plus the variant's
    keys). ``sweep`` (rows with ``capacity_mb`` and ``touch``): the hit rate and the store's
    share of it against the store's capacity, TOUCH on and off. Otherwise one pair of bars
    per variant (its first key): device and store hits stacked under the bound, and the bytes
    stored per hit token. Returns the figure."""
    fig, left, right = _figure(title)
    bound = rows[0]["bound_hit_rate"] * 100.0 if rows else None
    if study == "sweep":
        capacities = sorted({r["capacity_mb"] for r in rows})
        for touch, style, fill in ((True, "-", "full"), (False, "--", "none")):
            mine = sorted((r for r in rows if r["touch"] is touch), key=lambda r: r["capacity_mb"])
            if not mine:
                continue
            x = [r["capacity_mb"] for r in mine]
            device, store = zip(*(_split(r) for r in mine), strict=True)
            on = "on" if touch else "off"
            marks = {"marker": "o", "fillstyle": fill, "markersize": 7}
            left.plot(x, np.add(device, store), style, color="tab:green" if touch else "tab:purple",
                      label=f"hit rate, TOUCH {on}", **marks)
            right.plot(x, store, style, color=STORE_COLOR, label=f"store hits, TOUCH {on}", **marks)
            right.plot(x, device, style, color=DEVICE_COLOR, label=f"device hits, TOUCH {on}", **marks)
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(capacities, [f"{c:,}" for c in capacities])
            ax.minorticks_off()
            ax.set_xlabel("store capacity (MiB)")
            ax.set_ylabel("% of prompt tokens")
            ax.grid(True, alpha=0.3)
        left.set_title("hit rate against store capacity")
        right.set_title("where the hits came from")
    else:
        key = next(iter(rows[0])) if rows else study
        names = [str(r[key]) for r in rows]
        bars = np.arange(len(rows))
        device_pct = [_split(r)[0] for r in rows]
        store_pct = [_split(r)[1] for r in rows]
        left.bar(bars, device_pct, color=DEVICE_COLOR, label="device hits")
        left.bar(bars, store_pct, bottom=device_pct, color=STORE_COLOR, label="store hits")
        left.set_xticks(bars, names)
        left.set_ylabel("% of prompt tokens")
        left.set_title(f"hit rate per {key}")
        per_token = [r["stored_bytes_per_hit_token"] or 0.0 for r in rows]
        right.bar(bars, per_token, color="tab:gray")
        right.set_xticks(bars, names)
        right.set_ylabel("bytes stored per hit token")
        right.set_title(f"what the store held per hit token, per {key}")
        for ax in (left, right):
            ax.set_xlabel(key)
            ax.grid(True, axis="y", alpha=0.3)
    if bound is not None:
        left.axhline(bound, color=BOUND_COLOR, linestyle="--", linewidth=1.2,
                     label=f"infinite-cache bound ({bound:.1f}%)")
        left.set_ylim(0, max(100.0 if study != "sweep" else 0.0, bound * 1.15))
    legend_below(left, columns=2)
    legend_below(right, columns=2)
    fig.savefig(path, format="png", dpi=100)
    return fig
