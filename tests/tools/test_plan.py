"""``hylinker plan`` against the stress run it predicts (issue 44, item 4).

Tolerance: 0.06 of hit rate, absolute. The model replays one request at a time through LRU
page and state caches; the stress run overlaps requests, evicts the device tree by nodes and
donates branch-point states (tools/plan.py's docstring lists what it leaves out)."""

from __future__ import annotations

import json
from pathlib import Path

from hylinker.tools.cli import main

TOLERANCE = 0.06
WORKLOAD = ["--workload-param", "sessions_per_hour=120", "--synthetic-scale", "0.05", "--requests", "300"]


def test_the_prediction_matches_a_stress_run_at_two_store_sizes(tmp_path: Path) -> None:
    plan_json = tmp_path / "plan.json"
    sizes_mb = (12, 512)
    rc = main(["plan", *WORKLOAD, "--store-gib", ",".join(str(m / 1024) for m in sizes_mb), "--tp", "1",
               "--kv-pages", "1024", "--mamba-slots", "48", "--concurrency", "4", "--json", str(plan_json)])
    assert rc == 0
    predicted = {(r["store_bytes"] >> 20, r["touch"]): r for r in json.loads(plan_json.read_text())}
    for mb in sizes_mb:
        out = tmp_path / f"stress{mb}.json"
        rc = main(["stress", "--no-progress", "--workload", "production", *WORKLOAD, "--store-capacity-mb", str(mb),
                   "--kv-pages", "1024", "--mamba-slots", "48", "--concurrency", "4", "--json", str(out)])
        s = json.loads(out.read_text())
        assert rc == 0 and s["restore_mismatches"] == 0
        p = predicted[(mb, True)]
        assert abs(p["hit_rate"] - s["hit_rate"]) <= TOLERANCE, (mb, p["hit_rate"], s["hit_rate"])
    assert predicted[(12, True)]["fill_s"] is not None and predicted[(512, True)]["fill_s"] is None
