"""HylinkerConnector at tensor parallel size 2 on vLLM's CPU build (two worker processes, vLLM's
default process model): every rank saves and loads its own shard under keys that carry its rank;
a hit needs every rank's objects; one rank's damaged object, or one rank's store dying mid-run,
makes the request recompute on both ranks; a second engine restores what the first stored in a
shared Mooncake store, where the replicated attention pages (one KV head on two ranks) are
written once, by rank 0."""

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
BLOCK = 384
STATE_GROUPS = 3  # the tiny model's three Gated DeltaNet layers, one KV cache group each


@pytest.fixture(scope="module")
def reference_tp2(model_dir: Path, prompts: dict[str, list[int]],
                  tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Greedy tokens and logprobs of a TP 2 engine with no connector and no prefix cache, per prompt."""
    log = tmp_path_factory.mktemp("logs") / "reference-tp2.log"
    out = run_engine(model_dir, None, [gen(prompts["short"]), gen(prompts["long"])], log, in_process=False, tp=TP)
    return {"short": out[0], "long": out[1]}


def test_tp2_embedded_restores_every_ranks_shard(model_dir: Path, prompts: dict[str, list[int]],
                                                 reference_tp2: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    short = prompts["short"]
    log = tmp_path / "engine.log"
    r = run_engine(model_dir, {"store": "embedded"}, [gen(short), RESET, gen(short)], log, in_process=False, tp=TP)
    cold, warm = r[0], r[2]
    assert cold["cached"] == 0
    same_output(cold, reference_tp2["short"])
    assert warm["cached"] == RESTORED
    same_output(warm, reference_tp2["short"])
    stats = worker_statistics(log)
    assert set(stats) == {0, 1}, log.read_text()[-3000:]
    for rank in (0, 1):  # each rank saved and loaded its own shard
        assert stats[rank]["loads_ok"] == 1 and stats[rank]["loads_failed"] == 0
        assert stats[rank]["objects_saved"] >= 6


def test_tp2_one_ranks_damaged_object_recomputes_on_every_rank(
        model_dir: Path, prompts: dict[str, list[int]], reference_tp2: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    short = prompts["short"]
    log = tmp_path / "engine.log"
    extra = {"store": "embedded", "faults": "corrupt=1", "fault_rank": 1}  # rank 1's objects only
    r = run_engine(model_dir, extra, [gen(short), RESET, gen(short), gen(short)], log, in_process=False, tp=TP)
    cold, damaged, again = r[0], r[2], r[3]
    same_output(cold, reference_tp2["short"])
    assert damaged["cached"] == 0  # rank 0 restored, rank 1 failed: vLLM recomputed both
    same_output(damaged, reference_tp2["short"])
    same_output(again, reference_tp2["short"])
    stats = worker_statistics(log)
    assert set(stats) == {0, 1}, log.read_text()[-3000:]
    assert stats[0]["loads_ok"] == 1 and stats[0]["loads_failed"] == 0
    assert stats[1]["loads_ok"] == 0 and stats[1]["loads_failed"] == 1
    assert stats[1]["objects_removed"] >= 1 and stats[0]["objects_removed"] == 0


def test_tp2_second_engine_restores_from_a_shared_mooncake_store(
        model_dir: Path, prompts: dict[str, list[int]], reference_tp2: dict[str, dict[str, Any]],
        mooncake: tuple[MooncakeMaster, subprocess.Popen[str]], tmp_path: Path) -> None:
    master, _seg = mooncake
    extra = {"store": "mooncake", "master": master.address, "segment_mb": 0}
    short = prompts["short"]
    first = run_engine(model_dir, extra, [gen(short)], tmp_path / "engine1.log", in_process=False, tp=TP)[0]
    assert first["cached"] == 0
    same_output(first, reference_tp2["short"])
    # one KV head on two ranks: vLLM replicates the attention pages, rank 0 alone writes them;
    # each rank writes its own shard of the 3 state groups' state at 1,152 tokens
    saved = {r: s["objects_saved"] for r, s in worker_statistics(tmp_path / "engine1.log").items()}
    assert saved == {0: RESTORED // BLOCK + STATE_GROUPS, 1: STATE_GROUPS}
    log = tmp_path / "engine2.log"
    second = run_engine(model_dir, extra, [gen(short)], log, in_process=False, tp=TP)[0]
    assert second["cached"] == RESTORED  # another process: every rank's shard came from the store,
    # rank 1's attention pages from rank 0's copy
    same_output(second, reference_tp2["short"])
    stats = worker_statistics(log)
    assert {r: s["loads_ok"] for r, s in stats.items()} == {0: 1, 1: 1}




def dies_at(call: int) -> str:
    """A fault plan: the store answers its first ``call - 1`` calls and raises
    StoreUnavailableError on every call from then on."""
    return f"fail_calls={call}-1000000000,scheduled=unavailable"


def _rank_dies_mid_run(model_dir: Path, prompts: dict[str, list[int]], reference_tp2: dict[str, dict[str, Any]],
                       extra: dict[str, Any], log: Path, *, loads: int) -> None:
    """Cold request (both ranks store), rank 1's store dies, then: a hit the scheduler still
    believes in (rank 0 restores, rank 1 cannot), a repeat, and a new prompt twice. Every output
    equals the TP 2 reference; vLLM recomputed wherever rank 1 could not load. ``loads``: the
    restores the scheduler offers after the death (each one ok on rank 0, failed on rank 1)."""
    short, long = prompts["short"], prompts["long"]
    steps = [gen(short), RESET, gen(short), gen(short), RESET, gen(long), RESET, gen(long)]
    r = run_engine(model_dir, extra, steps, log, in_process=False, tp=TP)
    cold, dead, repeat, new, new_again = r[0], r[2], r[3], r[5], r[7]
    assert cold["cached"] == 0
    assert dead["cached"] == 0  # rank 0 restored, rank 1's store is gone: both recomputed
    assert repeat["cached"] == RESTORED  # vLLM's own prefix cache of the recompute: the engine serves on
    assert new["cached"] == 0 and new_again["cached"] == 0  # rank 1 stores nothing: no hit is offered
    for out in (cold, dead, repeat):
        same_output(out, reference_tp2["short"])
    for out in (new, new_again):
        same_output(out, reference_tp2["long"])
    stats = worker_statistics(log)
    assert set(stats) == {0, 1}, log.read_text()[-3000:]
    assert stats[0]["loads_ok"] == loads and stats[0]["loads_failed"] == 0
    assert stats[1]["loads_ok"] == 0 and stats[1]["loads_failed"] == loads
    assert stats[1]["saves_failed"] >= 1 and stats[0]["saves_failed"] == 0
    # the store died after the cold request's saves: rank 1 holds those, rank 0 also the new prompt's
    assert 0 < stats[1]["objects_saved"] < stats[0]["objects_saved"]


def test_tp2_one_ranks_embedded_store_dies_mid_run(
        model_dir: Path, prompts: dict[str, list[int]], reference_tp2: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """Rank 1 reports the objects it could not load as gone, so after one failed load the index
    offers no hit on them again."""
    extra = {"store": "embedded", "faults": dies_at(3), "fault_rank": 1}  # after the cold saves: a put per pool
    _rank_dies_mid_run(model_dir, prompts, reference_tp2, extra, tmp_path / "engine.log", loads=1)


def test_tp2_one_ranks_mooncake_client_dies_mid_run(
        model_dir: Path, prompts: dict[str, list[int]], reference_tp2: dict[str, dict[str, Any]],
        mooncake: tuple[MooncakeMaster, subprocess.Popen[str]], tmp_path: Path) -> None:
    """The shared store still holds rank 1's objects, so the scheduler's probe keeps offering the
    short prompt's prefix (the dead client cannot remove them); rank 1 cannot read them and each
    of the three requests that restore it recomputes on both ranks."""
    master, _seg = mooncake
    # rank 1 writes only its states (rank 0 writes the replicated attention pages): one put, then dead
    extra = {"store": "mooncake", "master": master.address, "segment_mb": 0, "faults": dies_at(2), "fault_rank": 1}
    _rank_dies_mid_run(model_dir, prompts, reference_tp2, extra, tmp_path / "engine.log", loads=3)
