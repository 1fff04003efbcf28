"""``hylinker bench-sglang-pool`` end to end on a small workload: every mode serves every request
through SGLang's real cache, restores are byte-exact, nothing leaks, and the JSON holds the table's
figures (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from hylinker.tools.bench.sglang_pool import MODES, main, workload


def test_workload_revisits_each_conversations_history() -> None:
    reqs = workload(3, 2, 4)
    assert len(reqs) == 6 and reqs[3][:4] == reqs[0] and len(reqs[3]) == 8


def test_bench_runs_every_mode_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "pool.json"
    assert main(["--conversations", "3", "--turns", "2", "--turn-tokens", "8", "--kv-pages", "64",
                 "--put-ms", "1", "--step-ms", "0", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert "memcpy_gbps" in record["host"]
    results = {r["mode"]: r for r in record["results"]}
    assert set(results) == set(MODES)
    for r in results.values():
        assert r["requests"] == 6 and r["aborted"] == 0 and r["restore_mismatches"] == 0
        assert r["leaks"] == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}
        assert r["store_hit_tokens"] + r["device_hit_tokens"] <= 3 * 8
    assert results["two-stage"]["host_staging_capacity_bytes"] > 0
    assert results["one-stage"]["host_staging_capacity_bytes"] == 0
