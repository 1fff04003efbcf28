"""``hylinker study``: the stress tool's studies, run side by side and reported as tables.

* ``sweep``: hit rate against ``bound_hit_rate`` as the store's capacity shrinks, with TOUCH on
  and off, on the same requests.
* ``admission``: where prefills donate recurrent states — only at the end of each prefill
  (``end``), also at branch points (``marconi``), or at every grid boundary (``grid``) —
  comparing stored bytes per store-hit token and the hit rate.

These are benchmarks: they print and save figures, they assert nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import anyio

from .report import format_table
from .stress import POLICIES, load_workload, run_stress
from .stress import configure as configure_stress

HELP = "studies on the stress tool: store-capacity sweep (touch on/off), checkpoint admission"

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", choices=("sweep", "admission"))
    parser.add_argument("--capacities-mb", default="2048,512,256,128,64",
                        help="store capacities for the sweep, comma separated")
    parser.add_argument("--policies", default=",".join(POLICIES), help="admission policies to compare")
    parser.add_argument("--study-json", type=Path, default=None, help="write the study's rows here")
    configure_stress(parser)


def _row(s: dict[str, Any], **extra: Any) -> dict[str, Any]:
    stored = sum(s["bytes_offloaded"].values())
    return {
        **extra,
        "hit_rate": s["hit_rate"],
        "bound_hit_rate": s["bound_hit_rate"],
        "of_bound": round(s["hit_rate"] / s["bound_hit_rate"], 3) if s["bound_hit_rate"] else None,
        "device_hit_tokens": s["device_hit_tokens"],
        "store_hit_tokens": s["store_hit_tokens"],
        "store_evictions": s["store"]["evictions"],
        "stored_mb": round(stored / (1 << 20), 1),
        "stored_bytes_per_store_hit_token": round(stored / s["store_hit_tokens"], 1) if s["store_hit_tokens"] else None,
        "checkpoints": s["checkpoints_donated"],
        "skipped": s["offloads_skipped"],
        "mismatches": s["restore_mismatches"],
        "seconds": s["seconds"],
    }


def run(args: argparse.Namespace) -> int:
    if args.trace is None and DEFAULT_TRACE.exists() and args.study == "sweep":
        args.trace = DEFAULT_TRACE
    requests = load_workload(args)
    args.no_progress = True
    rows: list[dict[str, Any]] = []
    if args.study == "sweep":
        for cap in [int(c) for c in args.capacities_mb.split(",")]:
            for touch in (True, False):
                args.store_capacity_mb = cap
                args.touch = touch
                s = anyio.run(run_stress, args, requests).summary
                rows.append(_row(s, capacity_mb=cap, touch=touch))
                print(format_table([rows[-1]]), flush=True)
    else:
        for policy in args.policies.split(","):
            args.policy = policy
            s = anyio.run(run_stress, args, requests).summary
            rows.append(_row(s, policy=policy))
            print(format_table([rows[-1]]), flush=True)
    source = str(args.trace) if args.trace else f"synthetic agentic, {len(requests)} requests"
    print(f"\n== {args.study} on {source} ({len(requests)} requests, preset {args.preset})")
    print(format_table(rows))
    if args.study_json is not None:
        args.study_json.parent.mkdir(parents=True, exist_ok=True)
        args.study_json.write_text(json.dumps({"study": args.study, "source": source, "rows": rows}, indent=2))
        print(f"wrote {args.study_json}")
    return 0
