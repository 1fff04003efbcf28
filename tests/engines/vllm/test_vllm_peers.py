"""``hylinker bench-vllm-peers`` runs as written, small: vLLM's own MooncakeStoreConnector, hylinker's
connector and the no-connector baseline on the same prompts; both connectors restore every request
exactly (logprobs equal to the baseline's recompute), to the boundary below the prompt, with no save
or load lost. Structure and exactness only, never its timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def test_the_peers_benchmark_compares_both_connectors_exactly(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    run = subprocess.run([sys.executable, "-m", "hylinker", "bench-vllm-peers", "--sizes", "1536", "--rounds", "1",
                          "--repeats", "2", "--decode-tokens", "4", "--integrity", "checksum,header",
                          "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    data = json.loads(out.read_text())
    assert data["configs"] == ["vllm_mooncake", "hylinker", "baseline", "hylinker_header"]
    assert sorted(data["orders"][0]) == sorted(data["configs"])
    assert data["host"]["memcpy_gbps"] > 0 and data["host"]["cores"] >= 1
    (row,) = data["ttft"]
    assert row["tokens"] == 1536
    for connector in ("vllm_mooncake", "hylinker", "hylinker_header"):
        # the block-384 grid: the state checkpoint below a 1,536-token prompt is at 1,152
        assert row[connector]["cached"] == [1152], connector
        found = data["findings"][connector]
        assert found["restores_compared"] == 3 and found["misses_compared"] == 2  # 2 restores + 1 check
        assert found["wrong_restores"] == 0 and found["wrong_misses"] == 0 and found["short_restores"] == 0
        assert set(data["losses"][connector].values()) == {0}, data["losses"][connector]
        assert len(data["samples"][connector]["restore:1536"]) == 2
        assert data["decode"][connector]["steps"] > 0
    assert row["baseline"]["cached"] == [0]  # the reference recomputes
    assert data["connector_stats"]["hylinker"][0]["loads_ok"] >= 3
    assert data["connector_stats"]["hylinker_header"][0]["loads_ok"] >= 3
    assert set(row["restore_speedup_over_vllm"]) == {"hylinker", "hylinker_header"}
    assert data["connector_stats"]["vllm_mooncake"][0]["save_put_count"] > 0  # its stats were kept
    assert "vLLM MooncakeStoreConnector" in run.stdout and "HylinkerConnector (checksum)" in run.stdout
    assert "HylinkerConnector (header)" in run.stdout


def test_every_restore_of_vllms_connector_follows_a_reset_that_took(tmp_path: Path) -> None:
    """vLLM's MooncakeStoreConnector holds a restored request's blocks until a later engine step,
    and vLLM refuses a prefix-cache reset while a block is held: the runner's reset then runs a
    short request and resets again, so the next "restore" loads from the store instead of hitting
    vLLM's own prefix cache (which made its restores look 1.5x faster than they are)."""
    import argparse
    import random

    from hylinker.tools.bench.vllm_peers import _engine
    from hylinker.tools.harness.tiny_qwen3_next import build_tiny_qwen3_next

    model = build_tiny_qwen3_next(tmp_path / "model")
    rng = random.Random(7)
    prompt = [rng.randrange(10, 300) for _ in range(1536)]
    steps: list[dict[str, Any]] = [{"op": "ttft", "prompt": prompt}, {"op": "sleep", "s": 0.5}]
    for _ in range(3):
        steps += [{"op": "reset"}, {"op": "ttft", "prompt": prompt}]
    args = argparse.Namespace(size_list=[1536], tp=1, segment_mib=256, local_buffer_mib=64, integrity="checksum",
                              before=None)
    (tmp_path / "vllm_mooncake").mkdir()
    rows = _engine("vllm_mooncake", model, steps, tmp_path / "vllm_mooncake", args, 384)
    resets = [r for r in rows if r["op"] == "reset"]
    assert len(resets) == 3 and all(r["ok"] for r in resets), resets
    restores = [r for r in rows if r["op"] == "ttft"][1:]
    assert [r["cached"] for r in restores] == [1152] * 3
