"""``hylinker study``: the stress tool's studies, run side by side and reported as tables.

* ``sweep``: hit rate against ``bound_hit_rate`` as the store's capacity shrinks, with TOUCH on
  and off, on the same requests.
* ``admission``: the checkpoint admission policies (:mod:`hylinker.components.admission`):
  end of prefill (``end``), Marconi's branch points and last whole block (``marconi``), those
  plus budgeted speculative states (``speculative``), every grid boundary (``grid``).
* ``eviction``: the device cache's eviction order (:mod:`hylinker.components.eviction`):
  ``lru`` against Marconi's FLOP-aware weighting (``flop``).

Every row shows the hit rate beside its bound, stored bytes per hit token, states stored and
every loss column. These are benchmarks: they print and save figures, they assert nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import anyio

from ..components.eviction import EVICTION_POLICIES
from .report import format_table, stress_row
from .stress import POLICIES, load_workload, run_stress
from .stress_cli import configure as configure_stress
from .traces import mooncake_trace

HELP = "studies on the stress tool: store-capacity sweep (touch on/off), checkpoint admission, eviction"

STUDIES = ("sweep", "admission", "eviction")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", choices=STUDIES)
    parser.add_argument("--capacities-mb", default="2048,512,256,128,64",
                        help="store capacities for the sweep, comma separated")
    parser.add_argument("--policies", default=",".join(POLICIES), help="admission policies to compare")
    parser.add_argument("--evictions", default=",".join(EVICTION_POLICIES), help="eviction policies to compare")
    parser.add_argument("--study-json", type=Path, default=None, help="write the study's rows here")
    configure_stress(parser)


def _variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The settings each row of the study runs with."""
    if args.study == "sweep":
        return [{"store_capacity_mb": int(c), "touch": touch}
                for c in args.capacities_mb.split(",") for touch in (True, False)]
    if args.study == "admission":
        return [{"policy": p} for p in args.policies.split(",")]
    return [{"eviction": e} for e in args.evictions.split(",")]


def run(args: argparse.Namespace) -> int:
    if args.trace is None and args.study == "sweep":
        args.trace = mooncake_trace()
    requests = load_workload(args)
    args.no_progress = True
    rows: list[dict[str, Any]] = []
    for variant in _variants(args):
        for key, value in variant.items():
            setattr(args, key, value)
        s = anyio.run(run_stress, args, requests).summary
        label = {("capacity_mb" if k == "store_capacity_mb" else k): v for k, v in variant.items()}
        rows.append(stress_row(s, **label))
        print(format_table([rows[-1]]), flush=True)
    source = str(args.trace) if args.trace else f"synthetic agentic, {len(requests)} requests"
    print(f"\n== {args.study} on {source} ({len(requests)} requests, preset {args.preset})")
    print(format_table(rows))
    if args.study_json is not None:
        args.study_json.parent.mkdir(parents=True, exist_ok=True)
        args.study_json.write_text(json.dumps({"study": args.study, "source": source, "rows": rows}, indent=2))
        print(f"wrote {args.study_json}")
    return 0
