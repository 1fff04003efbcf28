"""HylinkerConnector at tensor parallel size 2 on vLLM's CPU build (two worker processes, vLLM's
default process model): every rank saves and loads its own shard under keys that carry its rank;
a hit needs every rank's objects; one rank's damaged object makes the request recompute on both
ranks; a second engine restores what the first stored in a shared Mooncake store."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import run_engine, worker_statistics
from test_vllm_connector import RESET, RESTORED, gen, same_output

from hylinker.stores.mooncake_master import MooncakeMaster

pytestmark = pytest.mark.slow
TP = 2


@pytest.fixture(scope="module")
def reference_tp2(model_dir: Path, prompts: dict[str, list[int]],
                  tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Greedy tokens and logprobs of a TP 2 engine with no connector and no prefix cache."""
    log = tmp_path_factory.mktemp("logs") / "reference-tp2.log"
    return run_engine(model_dir, None, [gen(prompts["short"])], log, in_process=False, tp=TP)[0]


def test_tp2_embedded_restores_every_ranks_shard(model_dir: Path, prompts: dict[str, list[int]],
                                                 reference_tp2: dict[str, Any], tmp_path: Path) -> None:
    short = prompts["short"]
    log = tmp_path / "engine.log"
    r = run_engine(model_dir, {"store": "embedded"}, [gen(short), RESET, gen(short)], log, in_process=False, tp=TP)
    cold, warm = r[0], r[2]
    assert cold["cached"] == 0
    same_output(cold, reference_tp2)
    assert warm["cached"] == RESTORED
    same_output(warm, reference_tp2)
    stats = worker_statistics(log)
    assert set(stats) == {0, 1}, log.read_text()[-3000:]
    for rank in (0, 1):  # each rank saved and loaded its own shard
        assert stats[rank]["loads_ok"] == 1 and stats[rank]["loads_failed"] == 0
        assert stats[rank]["objects_saved"] >= 6


def test_tp2_one_ranks_damaged_object_recomputes_on_every_rank(
        model_dir: Path, prompts: dict[str, list[int]], reference_tp2: dict[str, Any], tmp_path: Path) -> None:
    short = prompts["short"]
    log = tmp_path / "engine.log"
    extra = {"store": "embedded", "faults": "corrupt=1", "fault_rank": 1}  # rank 1's objects only
    r = run_engine(model_dir, extra, [gen(short), RESET, gen(short), gen(short)], log, in_process=False, tp=TP)
    cold, damaged, again = r[0], r[2], r[3]
    same_output(cold, reference_tp2)
    assert damaged["cached"] == 0  # rank 0 restored, rank 1 failed: vLLM recomputed both
    same_output(damaged, reference_tp2)
    same_output(again, reference_tp2)
    stats = worker_statistics(log)
    assert set(stats) == {0, 1}, log.read_text()[-3000:]
    assert stats[0]["loads_ok"] == 1 and stats[0]["loads_failed"] == 0
    assert stats[1]["loads_ok"] == 0 and stats[1]["loads_failed"] == 1
    assert stats[1]["objects_removed"] >= 1 and stats[0]["objects_removed"] == 0


def test_tp2_second_engine_restores_from_a_shared_mooncake_store(
        model_dir: Path, prompts: dict[str, list[int]], reference_tp2: dict[str, Any],
        mooncake: tuple[MooncakeMaster, subprocess.Popen[str]], tmp_path: Path) -> None:
    master, _seg = mooncake
    extra = {"store": "mooncake", "master": master.address, "segment_mb": 0}
    short = prompts["short"]
    first = run_engine(model_dir, extra, [gen(short)], tmp_path / "engine1.log", in_process=False, tp=TP)[0]
    assert first["cached"] == 0
    same_output(first, reference_tp2)
    log = tmp_path / "engine2.log"
    second = run_engine(model_dir, extra, [gen(short)], log, in_process=False, tp=TP)[0]
    assert second["cached"] == RESTORED  # another process: every rank's shard came from the store
    same_output(second, reference_tp2)
    stats = worker_statistics(log)
    assert {r: s["loads_ok"] for r, s in stats.items()} == {0: 1, 1: 1}
