"""The model side of the correctness oracle: a restored boundary continues bit-exactly.

Tiny random-weight transformers hybrids (Kimi Linear: MLA + KDA; Qwen3-Next: GQA + GDN) run a
grid-chunked prefill; the state at a boundary goes through hylinker-shaped pools and back,
and the continued forward must give the very same logprobs as the run that never stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hylinker.components.layout import LayoutError
from hylinker.tools.harness.reference import (
    BoundaryState,
    LinearStateMode,
    ReferenceEngine,
    UnsupportedModelError,
    allocate_pools,
    build_draft_model,
    build_model,
    chunk_schedule,
    kl_divergence,
    layout_for,
    max_abs_diff,
    read_boundary,
    tiny_config,
    write_boundary,
)

PROMPT_LEN = 250
BOUNDARY = 128
LATER = 192
DECODE = 4
PAGE = 16
ARCHS = ["kimi_linear", "qwen3_next"]


@dataclass
class Uninterrupted:
    engine: ReferenceEngine
    prompt: list[int]
    state: BoundaryState
    later: BoundaryState  # the state at LATER, exported by the same uninterrupted run
    state_copy: BoundaryState
    logprobs: torch.Tensor  # positions BOUNDARY.. of the prompt, then the decode steps
    draft_logprobs: torch.Tensor  # positions BOUNDARY.. of the prompt
    decoded: list[int]


def _clone(s: BoundaryState) -> BoundaryState:
    return BoundaryState(
        s.length, s.kv.clone(),
        None if s.conv is None else tuple(c.clone() for c in s.conv),
        None if s.temporal is None else tuple(None if t is None else t.clone() for t in s.temporal),
        None if s.draft is None else s.draft.clone())


@pytest.fixture(scope="module", params=ARCHS)
def run(request: pytest.FixtureRequest) -> Uninterrupted:
    arch = request.param
    engine = ReferenceEngine(build_model(arch, seed=0), build_draft_model(seed=1), chunk_tokens=64)
    gen = torch.Generator().manual_seed(1234)
    prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=gen).tolist()
    seq = engine.new_sequence()
    res = engine.extend(seq, prompt, export_at=[BOUNDARY, LATER])
    state = res.states[BOUNDARY]
    copy = _clone(state)
    decoded, dec_lp = engine.decode_greedy(seq, DECODE)
    assert res.draft_logprobs is not None
    return Uninterrupted(engine, prompt, state, res.states[LATER], copy,
                         torch.cat([res.logprobs[BOUNDARY:], dec_lp]),
                         res.draft_logprobs[BOUNDARY:], decoded)


def _through_pools(u: Uninterrupted, *, split: bool = False) -> BoundaryState:
    """Write the boundary state into fresh (NaN-poisoned) pools at scattered rows, read it back."""
    layout = u.engine.layout(page_size=PAGE)
    pools = allocate_pools(layout, capacity_tokens=512, slots=4, fill=float("nan"))
    rows = torch.randperm(512, generator=torch.Generator().manual_seed(7))[:BOUNDARY]
    if split:  # page-run writes: the first pages with no slot, the last page with the state
        write_boundary(pools, rows[:BOUNDARY - PAGE], None, u.state)
        write_boundary(pools, rows[BOUNDARY - PAGE:], 2, u.state, token_start=BOUNDARY - PAGE)
    else:
        write_boundary(pools, rows, 2, u.state)
    return read_boundary(pools, rows, 2)


def _continue(u: Uninterrupted, state: BoundaryState, linear_state: LinearStateMode = "load"
              ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    seq = u.engine.restore(state, u.prompt[:BOUNDARY], linear_state=linear_state)
    res = u.engine.extend(seq, u.prompt[BOUNDARY:], export_at=[LATER])
    if linear_state == "load":  # a restored sequence donates the very state a fresh run would
        _assert_same_state(res.states[LATER], u.later)
    decoded, dec_lp = u.engine.decode_greedy(seq, DECODE)
    assert res.draft_logprobs is not None
    return torch.cat([res.logprobs, dec_lp]), res.draft_logprobs, decoded


def _assert_same_state(a: BoundaryState, b: BoundaryState) -> None:
    assert a.length == b.length
    assert torch.equal(a.kv, b.kv)
    assert a.draft is not None and b.draft is not None and torch.equal(a.draft, b.draft)
    assert a.conv is not None and b.conv is not None
    assert all(torch.equal(x, y) for x, y in zip(a.conv, b.conv, strict=True))
    assert a.temporal is not None and b.temporal is not None
    assert all(x is not None and y is not None and torch.equal(x, y)
               for x, y in zip(a.temporal, b.temporal, strict=True))


def _next_chunk(u: Uninterrupted, state: BoundaryState, linear_state: LinearStateMode = "load"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Negative controls only need the first chunk after the boundary."""
    seq = u.engine.restore(state, linear_state=linear_state)
    res = u.engine.extend(seq, u.prompt[BOUNDARY:BOUNDARY + 64])
    assert res.draft_logprobs is not None
    return res.logprobs, res.draft_logprobs


def test_restored_boundary_continues_bit_exactly(run: Uninterrupted) -> None:
    restored = _through_pools(run)
    logprobs, draft_logprobs, decoded = _continue(run, restored)
    assert logprobs.shape == run.logprobs.shape == (PROMPT_LEN - BOUNDARY + DECODE, 512)
    assert max_abs_diff(logprobs, run.logprobs) == 0.0
    assert torch.equal(logprobs, run.logprobs)
    assert kl_divergence(run.logprobs, logprobs) == 0.0
    assert decoded == run.decoded
    # (c) the draft model's KV restored likewise
    assert torch.equal(draft_logprobs, run.draft_logprobs)


def test_page_run_writes_read_back_the_same_state(run: Uninterrupted) -> None:
    _assert_same_state(_through_pools(run), run.state)
    _assert_same_state(_through_pools(run, split=True), run.state)


def test_export_is_a_snapshot(run: Uninterrupted) -> None:
    """The run kept going after the export; the exported tensors must not have moved."""
    _assert_same_state(run.state, run.state_copy)


@pytest.mark.parametrize("mode", ["zero", "skip"])
def test_missing_recurrent_state_is_caught(run: Uninterrupted, mode: LinearStateMode) -> None:
    restored = _through_pools(run)
    logprobs, _ = _next_chunk(run, restored, linear_state=mode)
    assert max_abs_diff(logprobs, run.logprobs[:64]) > 0.0
    assert kl_divergence(run.logprobs[:64], logprobs) > 0.0


def test_stale_conv_state_is_caught(run: Uninterrupted) -> None:
    restored = _through_pools(run)
    assert restored.conv is not None
    bad = BoundaryState(restored.length, restored.kv,
                        tuple(torch.zeros_like(c) for c in restored.conv),
                        restored.temporal, restored.draft)
    logprobs, _ = _next_chunk(run, bad)
    assert kl_divergence(run.logprobs[:64], logprobs) > 0.0


def test_corrupted_kv_and_draft_rows_are_caught(run: Uninterrupted) -> None:
    restored = _through_pools(run)
    assert restored.draft is not None
    kv, draft = restored.kv.clone(), restored.draft.clone()
    kv[:, 5] += 0.5
    draft[:, 5] += 0.5
    bad = BoundaryState(restored.length, kv, restored.conv, restored.temporal, draft)
    logprobs, draft_logprobs = _next_chunk(run, bad)
    assert kl_divergence(run.logprobs[:64], logprobs) > 0.0
    assert kl_divergence(run.draft_logprobs[:64], draft_logprobs) > 0.0


def test_layout_describes_the_pools(run: Uninterrupted) -> None:
    engine = run.engine
    layout = engine.layout(page_size=PAGE)
    g = engine.geometry
    assert layout.full_layers == g.full_layers == (3,)
    assert [s.layer_id for s in layout.mamba_layers] == [0, 1, 2]
    assert layout.grid == 64
    assert layout.kv_row_shape == tuple(run.state.kv.shape[2:])
    assert run.state.kv.shape[:2] == (1, BOUNDARY)
    assert run.state.conv is not None and run.state.temporal is not None
    for spec, c, t in zip(layout.mamba_layers, run.state.conv, run.state.temporal, strict=True):
        assert (spec.conv_shape, spec.conv_dtype) == (tuple(c.shape), c.dtype)
        assert t is not None and (spec.temporal_shape, spec.temporal_dtype) == (tuple(t.shape), t.dtype)
        assert spec.temporal_dtype == torch.float32
    assert layout.draft_layers == 1
    assert run.state.draft is not None
    assert layout.draft_row_shape == tuple(run.state.draft.shape[2:]) == (2, 2, 16)
    if g.model_type == "kimi_linear":  # MLA: the latent (kv_lora_rank) + shared rope key
        assert layout.kv_row_shape == (1, 32 + 16)
    else:  # GQA: K stacked on V
        assert layout.kv_row_shape == (2, 2, 32)


def test_draft_with_more_layers_than_full_attention_is_refused() -> None:
    model = build_model("qwen3_next", seed=0)
    with pytest.raises(UnsupportedModelError, match="draft model has 2 attention layers"):
        layout_for(model, build_draft_model(seed=1, num_layers=2), page_size=PAGE)
    # two full-attention layers can carry it
    model8 = build_model("qwen3_next", seed=0, num_hidden_layers=8)
    layout = layout_for(model8, build_draft_model(seed=1, num_layers=2), page_size=PAGE)
    assert layout.full_layers == (3, 7) and layout.draft_layers == 2


def test_chunk_schedule_is_absolute() -> None:
    assert chunk_schedule(0, 250, 64) == [(0, 64), (64, 128), (128, 192), (192, 250)]
    assert chunk_schedule(128, 250, 64) == [(128, 192), (192, 250)]
    assert chunk_schedule(100, 130, 64) == [(100, 128), (128, 130)]
    assert chunk_schedule(5, 5, 64) == []
    with pytest.raises(ValueError):
        chunk_schedule(10, 5, 64)


def test_bad_input_is_refused(run: Uninterrupted) -> None:
    engine = run.engine
    with pytest.raises(ValueError, match="not chunk ends"):
        engine.extend(engine.new_sequence(), run.prompt[:100], export_at=[50])
    with pytest.raises(ValueError, match="empty"):
        engine.export(engine.new_sequence())
    layout = engine.layout(page_size=PAGE)
    pools = allocate_pools(layout, capacity_tokens=256, slots=2)
    rows = torch.arange(BOUNDARY)
    no_slot = read_boundary(pools, rows, None)
    with pytest.raises(ValueError, match="no linear-attention part"):
        engine.restore(no_slot)
    with pytest.raises(IndexError):
        write_boundary(pools, rows, 5, run.state)
    with pytest.raises(IndexError):
        write_boundary(pools, rows + 200, None, run.state)
    with pytest.raises(ValueError, match="outside the state"):
        write_boundary(pools, torch.arange(BOUNDARY + 1), None, run.state)
    bf16 = allocate_pools(layout, 256, 2)
    bf16 = type(bf16)(bf16.kv.to(torch.bfloat16), bf16.conv, bf16.temporal, bf16.draft)
    with pytest.raises(ValueError, match="dtype"):
        write_boundary(bf16, rows, None, run.state)
    with pytest.raises(ValueError, match="grid"):
        ReferenceEngine(engine.model, chunk_tokens=48).layout(page_size=PAGE)


def test_unknown_arch_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="unknown transformers model type"):
        tiny_config("no_such_model")
    # Qwen4-Exp's default config leaves its QSA indexer unset, and the model cannot be built so
    unset: dict[str, Any] = dict.fromkeys(("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
                           "indexer_budget", "indexer_compress_ratio"))
    with pytest.raises(UnsupportedModelError, match="cannot build a tiny 'qwen4_exp_text' causal LM"):
        build_model("qwen4_exp_text", seed=0, **unset)


def test_same_seed_same_weights() -> None:
    a, b = build_model("qwen3_next", seed=3), build_model("qwen3_next", seed=3)
    c = build_model("qwen3_next", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_layout_error_for_incompatible_page() -> None:
    model = build_model("qwen3_next", seed=0)
    with pytest.raises(LayoutError):
        layout_for(model, None, page_size=100)
