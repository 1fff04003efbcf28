"""``hylinker study``: the stress tool's studies, run side by side and reported as tables.

* ``sweep``: hit rate against ``bound_hit_rate`` as the store's capacity shrinks, with TOUCH on
  and off, on the same requests.
* ``admission``: the checkpoint admission policies (:mod:`hylinker.components.admission`):
  end of prefill (``end``), Marconi's branch points and last whole block (``marconi``), those
  plus budgeted speculative states (``speculative``), every grid boundary (``grid``).
* ``eviction``: the device cache's eviction order (:mod:`hylinker.components.eviction`):
  ``lru`` against Marconi's FLOP-aware weighting (``flop``).
* ``device-pool``: the hit rate against the device KV pool's size, with the losses a tight
  pool causes (:mod:`hylinker.tools.pool_sweep`), on the synthetic workload and the Mooncake
  conversation trace, over several seeds.

Every row shows the hit rate (device and store hits) against the bound, what the store held
for it and every loss column that is not zero in some row, in tables that fit 100 columns;
``--json`` writes every row with every column, ``--plot`` draws them. These are benchmarks:
they print and save figures, they assert nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from ..components.eviction import EVICTION_POLICIES
from .arguments import UsageError, int_at_least, nearest
from .pool_sweep import DEFAULT_KV_PAGES, LOSSES, WORKLOADS, plot_pool_sweep, points, pool_row
from .report import LOSS_COLUMNS, format_table, stress_row
from .stress.cli import (
    add_geometry_arguments,
    add_restore_cost_arguments,
    add_store_arguments,
    add_workload_arguments,
)
from .stress.run import POLICIES, load_workload, run_stress
from .traces import mooncake_trace

HELP = ("studies on the stress tool: store-capacity sweep (touch on/off), checkpoint admission, eviction, "
        "device-pool size")

STUDIES = ("sweep", "admission", "eviction", "device-pool")
#: the widest line a study prints
WIDTH = 100
#: what every study's main table shows beside its variant (row key, header); the bound is the
#: same for every row (the same requests) and is printed above the table
MAIN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("hit_rate", "hit"),
    ("of_bound", "of bound"),
    ("device_hit_tokens", "device tok"),
    ("store_hit_tokens", "store tok"),
    ("stored_mb", "stored MiB"),
    ("stored_bytes_per_hit_token", "B/hit tok"),
    ("store_evictions", "evictions"),
    ("seconds", "s"),
)
#: (row key, header) of each study's variant
VARIANT_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "sweep": (("capacity_mb", "store MiB"), ("touch", "touch")),
    "admission": (("policy", "policy"),),
    "eviction": (("eviction", "eviction"),),
    "device-pool": (("workload", "workload"), ("kv_pages", "KV pages"), ("seed", "seed")),
}


def _names(choices: tuple[str, ...]) -> Any:
    def check(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if not names or unknown:
            hint = nearest(unknown[0], choices) if unknown else ""
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}, got {text!r}{hint}")
        return names

    check.__name__ = "names"
    return check


def _positive_list(unit: str) -> Any:
    """A parser of comma-separated positive integers (``unit`` names them in the error)."""
    positive = int_at_least(1)

    def check(text: str) -> list[int]:
        try:
            return [positive(c) for c in text.split(",")]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"comma-separated {unit}, each {exc}") from None

    check.__name__ = "list"
    return check


_capacities = _positive_list("MiB")
def _pool_sizes(text: str) -> list[int | None]:
    """device-pool: page counts, or ``derived`` (None: the stress tool's pools for the workload)."""
    sizes: list[int | None] = []
    for part in text.split(","):
        sizes.extend([None] if part.strip() == "derived" else _positive_list("page counts or derived")(part))
    return sizes


def _seeds(text: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", choices=STUDIES, help="which study")
    st = parser.add_argument_group("study")
    st.add_argument("--capacities-mb", type=_capacities, default=[2048, 512, 256, 128, 64], metavar="MIB,...",
                    help="sweep: store capacities, comma separated (default: 2048,512,256,128,64)")
    st.add_argument("--policies", type=_names(POLICIES), default=list(POLICIES), metavar="NAME,...",
                    help=f"admission: policies to compare (default: {','.join(POLICIES)})")
    st.add_argument("--evictions", type=_names(EVICTION_POLICIES), default=list(EVICTION_POLICIES),
                    metavar="NAME,...", help=f"eviction: orders to compare (default: {','.join(EVICTION_POLICIES)})")
    st.add_argument("--kv-pages-list", type=_pool_sizes, default=list(DEFAULT_KV_PAGES), metavar="N,...",
                    help="device-pool: device KV pool sizes in pages, or derived (the stress tool's "
                         f"pools for the workload) (default: {','.join(map(str, DEFAULT_KV_PAGES))})")
    st.add_argument("--seeds", type=_seeds, default=[0], metavar="N,...",
                    help="device-pool: a run per seed at each point (default: 0)")
    st.add_argument("--workloads", type=_names(WORKLOADS), default=list(WORKLOADS), metavar="NAME,...",
                    help="device-pool: agentic (the stress default) and/or mooncake (the conversation "
                         f"trace); --trace replaces mooncake's file (default: {','.join(WORKLOADS)})")
    add_workload_arguments(parser)
    parser._option_string_actions["--trace"].help = (
        "Mooncake-format JSONL trace (default: sweep the Mooncake conversation trace, "
        "the other studies the synthetic agentic workload)")
    add_geometry_arguments(parser)
    add_store_arguments(parser)
    add_restore_cost_arguments(parser)
    o = parser.add_argument_group("output")
    o.add_argument("--json", "--study-json", dest="json", type=Path, default=None,
                   help="write the study's rows (every column) as JSON here")
    o.add_argument("--plot", type=Path, default=None, help="write a PNG of the study's rows")


def _variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The settings each row of the study runs with."""
    if args.study == "sweep":
        return [{"store_capacity_mb": c, "touch": touch} for c in args.capacities_mb for touch in (True, False)]
    if args.study == "admission":
        return [{"policy": p} for p in args.policies]
    if args.study == "device-pool":
        return [{"workload": w, "kv_pages": k, "seed": seed}
                for w in args.workloads for k in args.kv_pages_list for seed in args.seeds]
    return [{"eviction": e} for e in args.evictions]


def format_study(study: str, rows: list[dict[str, Any]], width: int = WIDTH) -> str:
    """The study's rows as tables no wider than ``width``: hit rates and stored bytes, then the
    loss columns that are not zero in some row, then wrong restores and leaks."""
    variant = list(VARIANT_COLUMNS[study])
    out = [format_table(rows, [*variant, *MAIN_COLUMNS], width=width, keep=len(variant))]
    losses = [(k, h) for k, h in LOSS_COLUMNS if any(r.get(k) for r in rows)]
    if losses:
        out += ["", "losses (the columns not zero in some row):",
                format_table(rows, [*variant, *losses], width=width, keep=len(variant))]
    else:
        out += ["", "losses: none in any row"]
    unsafe = [r for r in rows if r["mismatches"] or r["leaks"]]
    out.append("wrong restores / leaks: " + ("0 / 0 in every row" if not unsafe else "; ".join(
        f"{', '.join(str(r[k]) for k, _ in variant)}: {r['mismatches']} / {r['leaks']}" for r in unsafe)))
    return "\n".join(out)


def _apply(args: argparse.Namespace, variant: dict[str, Any], trace: Path | None) -> None:
    """Set the stress arguments of one row (device-pool: ``workload`` picks the trace)."""
    if args.study != "device-pool":
        for key, value in variant.items():
            setattr(args, key, value)
        return
    args.kv_pages, args.seed = variant["kv_pages"], variant["seed"]
    args.trace = (trace or mooncake_trace()) if variant["workload"] == "mooncake" else None


def _source(args: argparse.Namespace) -> str:
    return Path(args.trace).name if args.trace else "synthetic agentic"


def format_points(rows: list[dict[str, Any]], width: int = WIDTH) -> str:
    """device-pool: a line per (workload, KV pages), of bound over the seeds and every loss."""
    columns = [("workload", "workload"), ("kv_pages", "KV pages"), ("runs", "runs"), ("of_bound", "of bound"),
               ("of_bound_min", "min"), ("of_bound_max", "max"), ("of_bound_fit", "fit"), *LOSSES]
    return format_table(points(rows), columns, width=width, keep=2)


def run(args: argparse.Namespace) -> int:
    if args.trace is None and args.study == "sweep":
        args.trace = mooncake_trace()
    trace = args.trace
    args.no_progress = True
    variants = _variants(args)
    rows: list[dict[str, Any]] = []
    workloads: dict[tuple[str, int], list[Any]] = {}  # (source, seed) -> its requests
    bounds: dict[str, float] = {}
    for n, variant in enumerate(variants, start=1):
        _apply(args, variant, trace)
        key = (_source(args), args.seed if not args.trace else 0)  # a trace's requests are the seed's
        if key not in workloads:
            workloads[key] = load_workload(args)
            if not workloads[key]:
                raise UsageError(f"the workload is empty ({key[0]})")
        t0 = time.perf_counter()
        s = anyio.run(run_stress, args, workloads[key]).summary
        label = {("capacity_mb" if k == "store_capacity_mb" else k): v for k, v in variant.items()}
        if "kv_pages" in label:  # derived: the size the run chose
            label["kv_pages"] = s["kv_pages"]
        row = stress_row(s, **label)
        rows.append(pool_row(s, row) if args.study == "device-pool" else row)
        bounds.setdefault(f"{len(workloads[key]):,} requests of {key[0]}", row["bound_hit_rate"])
        settings = ", ".join(f"{k}={v}" for k, v in label.items())
        print(f"study {args.study}: {n}/{len(variants)} ({settings}) ran in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    for what, b in bounds.items():  # a line per workload: several make one line too wide
        print(f"== {args.study} ({args.preset}): {what}, infinite-cache bound {b:.4f}")
    print(format_study(args.study, rows))
    if args.study == "device-pool":
        print("\nper point (of bound over the seeds; losses: means per run):")
        print(format_points(rows))
    source = ", ".join(sorted({w for w, _ in workloads}))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out: dict[str, Any] = {"study": args.study, "source": source, "rows": rows}
        if args.study == "device-pool":
            out["points"] = points(rows)
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        requests = ", ".join(bounds)
        title = f"hylinker study {args.study}: {requests}, preset {args.preset}"
        if args.study == "device-pool":
            plot_pool_sweep(str(args.plot), rows, title=title)
        else:
            from .plots import plot_study

            plot_study(str(args.plot), args.study, rows, title=title)
        print(f"wrote {args.plot}")
    return 0
