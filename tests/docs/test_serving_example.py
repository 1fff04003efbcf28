"""docs/serving_example.py runs: concurrent sessions through every phase, bit-exact outputs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "serving_example.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hylinker_serving_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def test_serving_example_restores_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    example = _load_example()
    run = await example.main_async("kimi_linear", sessions=2, turns=1)
    assert run.problems == []
    out = capsys.readouterr().out
    assert "replica B" in out
    for chat in run.chats:
        first, last = chat.completions
        assert first.cached_tokens == 0
        # replica B has an empty device tree: the second turn's prefix comes from the store,
        # exactly the checkpoint the first turn donated (its length rounded down to the grid)
        assert last.device_tokens == 0
        assert last.restored_tokens == len(first.prompt) // 64 * 64 > 0
        assert last.prompt[: len(first.prompt)] == first.prompt

    # the check is not vacuous: a one-ulp change to a restored logprob is caught
    chat = run.chats[0]
    bad = chat.completions[-1]
    bad.logprobs = bad.logprobs.clone()
    bad.logprobs[0, 0] = torch.nextafter(bad.logprobs[0, 0], torch.tensor(0.0))
    problems = example.check_against_recompute(run.engine, [chat])
    assert problems == [f"{bad.request_id}: prompt logprobs differ"]
