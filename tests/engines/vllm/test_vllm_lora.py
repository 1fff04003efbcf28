"""LoRA adapters end to end with real forwards in vLLM's default process model (embedded store,
the README's settings, prefix caching on, an explicit block size): a tiny random-weight dense
Qwen3 (attention only: vLLM's CPU build runs LoRA there, not on its MoE models) and two random
PEFT adapters on the attention projections.

One engine with the connector: the prompt under adapter 1, ``reset_prefix_cache()``, then the
prompt with no adapter and under adapter 2 (0 tokens from the store, each identical to a
recompute with what it asked for), then under adapter 1 again (the positive control: its blocks
come back from the store, identical to a recompute under adapter 1). One engine without any cache
computes the three references.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from conftest import run_engine, worker_statistics

from hylinker.tests.support.tiny_qwen3 import (
    BLOCK_SIZE,
    LORA_RANK,
    build_tiny_qwen3,
    write_random_lora,
)

pytestmark = pytest.mark.slow
PROMPT_TOKENS = 600
RESTORED = (PROMPT_TOKENS // BLOCK_SIZE) * BLOCK_SIZE  # the whole blocks below the prompt's end: 512


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    """The tiny Qwen3 and two adapters, as the runner's ``lora`` step fields."""
    root = tmp_path_factory.mktemp("tiny-qwen3-lora")
    model = build_tiny_qwen3(root / "model")
    adapters = {name: {"name": name, "id": i + 1, "path": str(write_random_lora(root / name, seed=i + 1))}
                for i, name in enumerate(("a1", "a2"))}
    return model, adapters


def same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]  # bit-exact: ids and float values of the top 3


def test_lora_other_adapters_recompute_the_same_adapter_restores(
        lora_model: tuple[Path, dict[str, dict[str, Any]]], tmp_path: Path) -> None:
    model, lora = lora_model
    rng = random.Random(3)
    prompt = [rng.randrange(10, 300) for _ in range(PROMPT_TOKENS)]

    def gen(adapter: str | None) -> dict[str, Any]:
        return {"op": "generate", "prompt": prompt, **({"lora": lora[adapter]} if adapter else {})}

    ref = run_engine(model, None, [gen(None), gen("a1"), gen("a2")], tmp_path / "reference.log",
                     in_process=False, block_size=BLOCK_SIZE, max_lora_rank=LORA_RANK)
    base, ref_a1, ref_a2 = ref
    # the adapters change the model's output, otherwise nothing below could tell them apart
    assert ref_a1["logprobs"] != base["logprobs"] and ref_a2["logprobs"] != base["logprobs"]
    assert ref_a1["logprobs"] != ref_a2["logprobs"]

    log = tmp_path / "engine.log"
    r = run_engine(model, {"store": "embedded"}, [gen("a1"), {"op": "reset"}, gen(None), gen("a2"), gen("a1")],
                   log, in_process=False, block_size=BLOCK_SIZE, max_lora_rank=LORA_RANK)
    first_a1, _reset, plain, a2, a1_again = r
    assert first_a1["cached"] == 0
    same_output(first_a1, ref_a1)
    assert plain["cached"] == 0  # adapter 1's blocks are in the store, keyed apart from the base model's
    same_output(plain, base)
    assert a2["cached"] == 0
    same_output(a2, ref_a2)
    # the positive control: vLLM's own cache holds only the base model's and adapter 2's blocks
    # since the reset, so adapter 1's come from the store
    assert a1_again["cached"] == RESTORED
    same_output(a1_again, ref_a1)
    stats = worker_statistics(log)[0]
    assert stats["loads"] == stats["loads_ok"] == 1  # one load, for adapter 1's second request
    assert stats["objects_loaded"] == RESTORED // BLOCK_SIZE
    assert stats["loads_failed"] == 0
