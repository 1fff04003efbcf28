"""``hylinker study``: the stress tool's studies, run side by side and reported as tables.

* ``sweep``: hit rate against ``bound_hit_rate`` as the store's capacity shrinks, with TOUCH on
  and off, on the same requests.
* ``admission``: the checkpoint admission policies (:mod:`hylinker.components.admission`):
  end of prefill (``end``), Marconi's branch points and last whole block (``marconi``), those
  plus budgeted speculative states (``speculative``), every grid boundary (``grid``).
* ``eviction``: the device cache's eviction order (:mod:`hylinker.components.eviction`):
  ``lru`` against Marconi's FLOP-aware weighting (``flop``).

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
from .report import LOSS_COLUMNS, format_table, stress_row
from .stress.cli import (
    add_geometry_arguments,
    add_restore_cost_arguments,
    add_store_arguments,
    add_workload_arguments,
)
from .stress.run import POLICIES, load_workload, run_stress
from .traces import mooncake_trace

HELP = "studies on the stress tool: store-capacity sweep (touch on/off), checkpoint admission, eviction"

STUDIES = ("sweep", "admission", "eviction")
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


def _capacities(text: str) -> list[int]:
    positive = int_at_least(1)
    try:
        return [positive(c) for c in text.split(",")]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"comma-separated MiB, each {exc}") from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", choices=STUDIES, help="which study")
    st = parser.add_argument_group("study")
    st.add_argument("--capacities-mb", type=_capacities, default=[2048, 512, 256, 128, 64], metavar="MIB,...",
                    help="sweep: store capacities, comma separated (default: 2048,512,256,128,64)")
    st.add_argument("--policies", type=_names(POLICIES), default=list(POLICIES), metavar="NAME,...",
                    help=f"admission: policies to compare (default: {','.join(POLICIES)})")
    st.add_argument("--evictions", type=_names(EVICTION_POLICIES), default=list(EVICTION_POLICIES),
                    metavar="NAME,...", help=f"eviction: orders to compare (default: {','.join(EVICTION_POLICIES)})")
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


def run(args: argparse.Namespace) -> int:
    if args.trace is None and args.study == "sweep":
        args.trace = mooncake_trace()
    requests = load_workload(args)
    if not requests:
        raise UsageError("the workload is empty")
    args.no_progress = True
    variants = _variants(args)
    rows: list[dict[str, Any]] = []
    for n, variant in enumerate(variants, start=1):
        for key, value in variant.items():
            setattr(args, key, value)
        t0 = time.perf_counter()
        s = anyio.run(run_stress, args, requests).summary
        label = {("capacity_mb" if k == "store_capacity_mb" else k): v for k, v in variant.items()}
        rows.append(stress_row(s, **label))
        settings = ", ".join(f"{k}={v}" for k, v in label.items())
        print(f"study {args.study}: {n}/{len(variants)} ({settings}) ran in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    source = str(args.trace) if args.trace else "synthetic agentic"
    bound = rows[0]["bound_hit_rate"]
    print(f"== {args.study}: {len(requests):,} requests of {Path(source).name}, preset {args.preset}, "
          f"infinite-cache bound {bound:.4f}")
    print(format_study(args.study, rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"study": args.study, "source": source, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    if args.plot is not None:
        from .plots import plot_study

        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_study(str(args.plot), args.study, rows,
                   title=f"hylinker study {args.study}: {len(requests):,} requests of {Path(source).name}, "
                         f"preset {args.preset}")
        print(f"wrote {args.plot}")
    return 0
