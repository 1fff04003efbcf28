"""``hylinker bench-vllm-serving`` runs as written, small: vLLM's OpenAI server replays a few trace
conversations with each connector and with vLLM's prefix cache alone, under a device budget that
makes vLLM evict; every request served alone afterwards equals the recompute reference, the
connectors serve more of them from a cache than vLLM's own cache does, and nothing is lost.
Structure, exactness and losses only, never its timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_serving_benchmark_replays_the_trace_exactly_with_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    run = subprocess.run([sys.executable, "-m", "hylinker", "bench-vllm-serving", "--conversations", "3",
                          "--max-input", "3072", "--device-blocks", "20", "--rounds", "1", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    data = json.loads(out.read_text())
    assert data["configs"] == ["vllm_mooncake", "hylinker", "baseline"]
    assert data["workload"]["requests"] == 10 and data["reference_failed_requests"] == 0
    assert data["host"]["memcpy_gbps"] > 0
    table = data["table"]
    for config in data["configs"]:
        t = table[config]
        assert t["failed_requests"] == 0 and t["alone_failed"] == 0, (config, t)
        assert t["compared"] == 10, (config, t)
        # served alone after the load, each request equals the reference's recompute
        assert t["wrong_with_cached_prefix"] == 0 and t["wrong_without"] == 0, (config, t)
        assert len(data["rounds"][0][config]["per_request"]) == 10
        assert len(data["rounds"][0][config]["host_load"]) == 2  # the host's load beside each replay
    for connector in ("vllm_mooncake", "hylinker"):
        # what vLLM evicted comes back from the store: more requests get a cached prefix
        assert table[connector]["served_a_cached_prefix"] > table["baseline"]["served_a_cached_prefix"], table
        assert table[connector]["store_bytes"] > 0 and table[connector]["store_alloc_failures"] == 0
    assert table["baseline"]["store_bytes"] == 0 and table["baseline"]["store_hit_tokens"] == 0
    figures = data["rounds"][0]["hylinker"]["connector"]  # scraped from its vllm:hylinker_* families
    assert figures["loads_ok"] > 0 and figures["saves_ok"] > 0, figures
    losses = {k: v for k, v in figures.items() if not k.endswith("_ok")}
    assert set(losses.values()) == {0}, losses
    assert "HylinkerConnector" in run.stdout and "vLLM MooncakeStoreConnector" in run.stdout
