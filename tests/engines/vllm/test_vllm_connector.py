"""HylinkerConnector in vLLM 0.32's CPU build: real forwards, the real scheduler, real stores.

The model is a tiny random-weight qwen3_next (Gated DeltaNet + attention, bf16), block size
384: vLLM checkpoints the recurrent state of a 1,306-token prompt at 1,152 tokens, so a restore
covers 1,152 tokens (3 attention blocks and the 3 state groups' states at that boundary).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import run_engine

from hylinker.stores.mooncake_master import MooncakeMaster

pytestmark = pytest.mark.slow
RESTORED = 1152  # tokens restored for the 1,306-token prompt


def same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]  # bit-exact: ids and float values of the top 3


def gen(prompt: list[int]) -> dict[str, Any]:
    return {"op": "generate", "prompt": prompt}


RESET = {"op": "reset"}
STATS = {"op": "stats"}


def test_restore_equals_recompute_and_a_second_engine_restores_from_the_shared_store(
        model_dir: Path, prompts: dict[str, list[int]], reference: dict[str, dict[str, Any]],
        mooncake: tuple[MooncakeMaster, subprocess.Popen[str]], tmp_path: Path) -> None:
    master, _seg = mooncake
    extra = {"store": "mooncake", "master": master.address, "segment_mb": 0}
    short, long = prompts["short"], prompts["long"]
    # engine 1: computes and stores; after vLLM's own cache is reset it restores from the store,
    # and an extended prompt restores from the shorter prompt's state
    r = run_engine(model_dir, extra, [gen(short), RESET, gen(short), RESET, gen(long), STATS],
                   tmp_path / "engine1.log")
    cold, warm, extended, stats = r[0], r[2], r[4], r[5]["stats"]
    assert cold["cached"] == 0
    same_output(cold, reference["short"])
    assert warm["cached"] == RESTORED
    same_output(warm, reference["short"])
    assert extended["cached"] == RESTORED
    same_output(extended, reference["long"])
    assert stats["loads_ok"] == 2 and stats["loads_failed"] == 0
    assert stats["state_saves_planned"] >= 3 and stats["saves_failed"] == 0
    # engine 2, another process: restores what engine 1 stored; then the master dies: the
    # connector falls back to recompute with the same output
    r = run_engine(model_dir, extra, [gen(short), RESET, {"op": "kill", "pid": master.pid}, gen(short), STATS],
                   tmp_path / "engine2.log")
    first, after_kill, stats = r[0], r[3], r[4]["stats"]
    assert first["cached"] == RESTORED
    same_output(first, reference["short"])
    assert after_kill["cached"] == 0
    same_output(after_kill, reference["short"])
    assert stats["loads_ok"] == 1 and stats["lookup_errors"] >= 1


def test_corrupt_objects_fall_back_to_recompute(model_dir: Path, prompts: dict[str, list[int]],
                                                reference: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    # every object is stored with one byte flipped: the load is attempted, fails verification,
    # and the request recomputes (never runs on the damaged state)
    extra = {"store": "embedded", "capacity_mb": 64, "faults": "corrupt=1"}
    short = prompts["short"]
    r = run_engine(model_dir, extra, [gen(short), RESET, gen(short), gen(short), STATS], tmp_path / "engine.log")
    cold, damaged, again, stats = r[0], r[2], r[3], r[4]["stats"]
    same_output(cold, reference["short"])
    same_output(damaged, reference["short"])
    same_output(again, reference["short"])
    assert damaged["cached"] == 0
    assert stats["loads_failed"] == 1 and stats["loads_ok"] == 0  # not retried on the damaged prefix
    assert stats["objects_removed"] >= 1  # the damaged objects left the store
    assert again["cached"] == RESTORED  # vLLM's own cache holds the recomputed prefix
