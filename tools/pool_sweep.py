"""``hylinker study device-pool``: the hit rate against the device KV pool's size (issue 52).

A tight device pool loses hits the store could have served: an offload that keeps its pages
locked until the store acknowledges them (one stage) makes the KV backpressure rule skip offloads
(those prefixes never reach the store) and loads find no pages (they wait,
``LinkerConfig.load_wait_s``, or recompute); the two-stage offload (the default,
docs/design/host-staging.md) frees the pages once they are copied into host staging. Each point is one ``hylinker stress`` run at ``--kv-pages N`` of one workload and
seed; the table and the plot show the share of the infinite-cache bound each point reached
(``fit``: the same with the requests that can never fit the pool left out of both sides),
beside the losses that explain it: offloads skipped by KV backpressure, loads with no pages,
loads that waited for pages, and offloads skipped because host staging was full (``n/a`` for a
run without the two-stage offload's counter).

Why a study and not ``hylinker plan``: the plan is a model of two LRU caches with no concurrency
and no offload in flight, and these losses exist only because offloads and requests overlap in
time, so only a replay through the runtime measures them.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

#: the workloads the sweep runs by default: the stress tool's default (the synthetic agentic
#: workload) and the Mooncake conversation trace shipped under tools/data
WORKLOADS = ("agentic", "mooncake")
DEFAULT_KV_PAGES = (4096, 1024, 512, 256)
#: (row key, header): the losses each point shows, whether or not they are zero
LOSSES: tuple[tuple[str, str], ...] = (
    ("offloads_skipped_kv", "skip kv"),
    ("offloads_waited_kv", "kv wait"),  # not a loss: offloads that waited for copies, then went
    ("load_misses", "no pages"),
    ("load_waits", "waited"),
    ("load_waits_recomputed", "wait miss"),
    ("host_staging_full", "stg full"),
)
#: the summary key the two-stage offload counts its skips under (absent: ``n/a``)
STAGING_FULL_KEY = "offloads_skipped_staging"


def pool_row(summary: Mapping[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """``row`` (a study row of ``summary``) with the sweep's loss columns filled in."""
    row["load_waits"] = summary.get("load_waits", 0)
    row["offloads_waited_kv"] = summary.get("offloads_waited_kv", "n/a")  # absent before it existed
    row["load_waits_recomputed"] = summary.get("load_waits_recomputed", 0)
    row["host_staging_full"] = summary.get(STAGING_FULL_KEY, "n/a")
    row["of_bound_fit"] = summary.get("of_bound_fit")  # never-fit requests out of both sides
    return row


def points(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One line per (series, workload, KV pages): of-bound mean, min, max over its seeds and the
    mean of each loss. ``series`` tells runs apart that a comparison puts side by side
    (e.g. before/after a change; absent: one series)."""
    groups: dict[tuple[str, str, int], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r.get("series", "")), str(r["workload"]), int(r["kv_pages"])), []).append(r)
    out: list[dict[str, Any]] = []
    for (series, workload, kv), mine in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1], -g[0][2])):
        ratios = [float(r["of_bound"]) for r in mine if r.get("of_bound") is not None]
        point: dict[str, Any] = {"series": series, "workload": workload, "kv_pages": kv, "runs": len(mine),
                                 "of_bound": round(statistics.fmean(ratios), 3) if ratios else None,
                                 "of_bound_min": min(ratios, default=None), "of_bound_max": max(ratios, default=None)}
        fits = [float(r["of_bound_fit"]) for r in mine if r.get("of_bound_fit") is not None]
        point["of_bound_fit"] = round(statistics.fmean(fits), 3) if fits else "n/a"
        for key, _ in LOSSES:
            values = [r.get(key) for r in mine]
            numbers = [float(v) for v in values if isinstance(v, (int, float))]
            point[key] = round(statistics.fmean(numbers), 1) if numbers else "n/a"
        out.append(point)
    return out


def plot_pool_sweep(path: str, rows: Sequence[Mapping[str, Any]], *, title: str | None = None) -> Any:
    """Left: of bound (mean over seeds, the bar spans min to max) against the device pool's KV
    pages, a line per workload (and series); right: the losses per point (means). Returns the
    figure."""
    from .plots import _figure, legend_below

    fig, left, right = _figure(title)
    pts = points(rows)
    styles = ("-", "--", ":", "-.")
    series = sorted({p["series"] for p in pts})
    workloads = sorted({p["workload"] for p in pts})
    colors = ("tab:green", "tab:purple", "tab:brown", "tab:cyan")
    drawn = {"offloads_skipped_kv": ("tab:red", "offloads skipped (KV)"),
             "load_misses": ("tab:orange", "loads with no pages"), "load_waits": ("tab:blue", "loads that waited"),
             "host_staging_full": ("tab:gray", "host staging full")}
    for si, name in enumerate(series):
        for wi, workload in enumerate(workloads):
            mine = sorted((p for p in pts if p["series"] == name and p["workload"] == workload),
                          key=lambda p: p["kv_pages"])
            mine = [p for p in mine if p["of_bound"] is not None]
            if not mine:
                continue
            label = workload if not name else f"{workload}, {name}"
            x = [p["kv_pages"] for p in mine]
            y = [p["of_bound"] for p in mine]
            err = [[p["of_bound"] - p["of_bound_min"] for p in mine], [p["of_bound_max"] - p["of_bound"] for p in mine]]
            left.errorbar(x, y, yerr=err, fmt="o" + styles[si % len(styles)], color=colors[wi % len(colors)],
                          capsize=4, label=label)
            for key, (color, _) in drawn.items():
                values = [p[key] if isinstance(p[key], (int, float)) else np.nan for p in mine]
                right.plot(x, values, styles[si % len(styles)], marker="os^v"[wi % 4], color=color)
    kv_ticks = sorted({p["kv_pages"] for p in pts})
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(kv_ticks, [f"{k:,}" for k in kv_ticks])
        ax.minorticks_off()
        ax.set_xlabel("device KV pool (pages)")
        ax.grid(True, alpha=0.3)
    left.axhline(1.0, color="black", linestyle="--", linewidth=1.0, label="infinite-cache bound")
    left.set_ylabel("hit rate / infinite-cache bound")
    left.set_ylim(0, 1.08)
    left.set_title("share of the bound against the device pool")
    right.set_ylabel("count per run (mean over seeds)")
    right.set_title("losses per point")
    legend_below(left, columns=2)
    # the right panel's key: a colour per loss, a marker per workload, a line style per series
    from matplotlib.lines import Line2D

    handles: list[Any] = [Line2D([], [], color=color, label=what) for color, what in drawn.values()]
    handles += [Line2D([], [], color="black", marker="os^v"[wi % 4], linestyle="none", label=w)
            for wi, w in enumerate(workloads)]
    handles += [Line2D([], [], color="black", linestyle=cast(Any, styles[si % len(styles)]), label=name)
            for si, name in enumerate(series) if name]
    right.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False, fontsize=8)
    fig.savefig(path, format="png", dpi=100)
    return fig

__all__ = ["DEFAULT_KV_PAGES", "LOSSES", "STAGING_FULL_KEY", "WORKLOADS", "plot_pool_sweep", "points", "pool_row"]
