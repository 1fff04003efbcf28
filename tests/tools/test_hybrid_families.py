"""Every transformers model type with a recurrent-state cache layer, through ``hylinker demo``.

The list comes from the installed transformers (:func:`recurrent_model_types`), not from us.
Each type either restores bit-exactly through ``hylinker demo --arch T`` (KL = 0 on every turn,
every negative control above its margin: ``tools/demo_controls.py``) or is refused with a clear
error. Refusals caused by a
transformers defect are each backed by a test below that shows the defect and fails once
transformers fixes it; the others are limits of hylinker's layout, named in the message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

pytest.importorskip("transformers")

from hylinker.tools.cli import main
from hylinker.tools.demo_controls import MARGIN
from hylinker.tools.harness.reference import UnsupportedModelError, build_model
from hylinker.tools.harness.reference.engine import _forward, _new_cache, cache_geometry
from hylinker.tools.harness.reference.models import RECURRENT_LAYER_KINDS, recurrent_model_types

PASS = "restores bit-exactly"
# transformers defects (each has a test below that fails once it is fixed)
STATE_IGNORED = "ignores the recurrent state held in its cache"
OWN_CACHE = "uses cache of its own"
STATE_OUTSIDE_CACHE = "left empty after a forward"
NO_CAUSAL_LM = "no causal-LM class"

UPSTREAM = {STATE_IGNORED, OWN_CACHE, STATE_OUTSIDE_CACHE, NO_CAUSAL_LM}

# What each model type of transformers 5.24 does. A type missing here (a new transformers)
# still runs below; it must restore exactly or be refused cleanly, and then be added here.
EXPECTED: dict[str, str] = {
    "bailing_hybrid": PASS,
    "bamba": PASS,
    "falcon_h1": PASS,
    "falcon_mamba": STATE_IGNORED,
    "glm5_next_text": NO_CAUSAL_LM,
    "granitemoehybrid": PASS,
    "inkling2_loop_text": PASS,
    "inkling2_text": PASS,
    "inkling_text": PASS,
    "jamba": STATE_IGNORED,
    "kimi_linear": PASS,
    "lara_mini": PASS,
    "lfm2": PASS,
    "lfm2_moe": PASS,
    "lfm3": PASS,
    "lfm3_vl_vision": NO_CAUSAL_LM,
    "mamba": STATE_IGNORED,
    "mamba2": PASS,
    "minimax": OWN_CACHE,
    "nemotron_h": PASS,
    "olmo_hybrid": PASS,
    "qwen3_5_moe_text": PASS,
    "qwen3_5_text": PASS,
    "qwen3_next": PASS,
    "qwen4_exp_text": PASS,
    "recurrent_gemma": STATE_OUTSIDE_CACHE,
    "zamba": STATE_IGNORED,
    "zamba2": PASS,
    "zaya": PASS,
}


def _types() -> list[str]:
    return list(recurrent_model_types())


def test_model_types_come_from_the_library() -> None:
    from transformers import CONFIG_MAPPING
    from transformers.cache_utils import get_layer_types_and_kwargs

    from hylinker.tools.harness.reference.models import _LAYER_PATTERN

    types = recurrent_model_types()
    assert list(types) == sorted(set(types))
    assert {"kimi_linear", "qwen3_next", "nemotron_h", "falcon_h1", "lfm3", "lfm2"} <= set(types)
    for t in types:  # each one's default decoder, or its checkpoints' pattern, has a recurrent kind
        kinds, _ = get_layer_types_and_kwargs(CONFIG_MAPPING[t]().get_text_config(decoder=True))
        if not RECURRENT_LAYER_KINDS & set(kinds):
            assert t in ("lfm2", "lfm2_moe"), t  # attention on every layer by default
            pattern: dict[str, Any] = {"num_hidden_layers": len(_LAYER_PATTERN[t]["layer_types"]),
                                       **_LAYER_PATTERN[t]}
            config_class: Any = CONFIG_MAPPING[t]
            kinds, _ = get_layer_types_and_kwargs(config_class(**pattern))
        assert RECURRENT_LAYER_KINDS & set(kinds), t
    # multimodal wrappers appear as their text model, once
    assert "qwen3_5" not in types and "qwen3_5_text" in types
    # the pinned outcomes cover exactly the library's list (a new type must be looked at)
    assert set(EXPECTED) == set(types)


@pytest.mark.slow
@pytest.mark.parametrize("arch", _types())
def test_demo_restores_exactly_or_refuses(arch: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.json"
    rc = main(["demo", "--arch", arch, "--turns", "2", "--system-tokens", "64",
               "--json", str(out)])
    captured = capsys.readouterr()
    expected = EXPECTED.get(arch)
    if rc == 0:
        report = json.loads(out.read_text())
        assert report["passed"] and report["arch"] == arch
        first, second = report["turns"]
        assert first["restored_tokens"] == 0
        assert second["restored_tokens"] == second["expected_restored_tokens"] > 0
        assert all(t["kl"] == 0.0 and t["max_abs_logprob_diff"] == 0.0 for t in report["turns"])
        controls = report["negative_controls"]
        assert controls and controls[0]["name"] == "state"
        for c in controls:  # each control moved the output by more than its margin
            assert c["detected"] and c["restored_tokens"] > 0, c
            assert c["kl"] >= MARGIN.kl and c["max_abs_logprob_diff"] >= MARGIN.max_abs_logprob_diff, c
        assert expected in (PASS, None), f"{arch} now restores exactly: update EXPECTED"
        return
    assert rc == 2, captured.out[-2000:] + captured.err[-2000:]
    assert captured.err.startswith("hylinker demo: ") and arch in captured.err
    assert expected is not None and expected != PASS, f"{arch} refused: {captured.err}"
    assert expected in captured.err, captured.err


def test_demo_refuses_a_model_without_recurrent_layers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--arch", "llama", "--turns", "1"]) == 2
    assert "no layer holds a recurrent state" in capsys.readouterr().err


# ---- the transformers defects behind refusals ------------------------------------------
def _types_for(reason: str) -> list[str]:
    return sorted(t for t, why in EXPECTED.items() if why == reason)


def test_every_upstream_reason_has_its_demonstration() -> None:
    demonstrated = {STATE_IGNORED, OWN_CACHE, STATE_OUTSIDE_CACHE, NO_CAUSAL_LM}
    assert {why for why in EXPECTED.values() if why in UPSTREAM} <= demonstrated


@pytest.mark.parametrize("arch", _types_for(STATE_IGNORED))
def test_mamba1_torch_path_ignores_the_cached_state(arch: str) -> None:
    # 64 + 64 tokens through one cache, once as is and once with every recurrent state zeroed
    # between the two forwards: the second forward gives the very same logprobs, so the state
    # is never read, and they differ from the 128 tokens in one forward (the chunked prefill
    # is not the model's function). Fails once transformers honours the state.
    model = build_model(arch, seed=0)
    ids = torch.randint(3, 512, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    recurrent = _recurrent_layers(model)
    assert recurrent

    def second_half(zero: bool) -> torch.Tensor:
        cache = _new_cache(model)
        _forward(model, cache, ids[:64], 0)
        if zero:
            for i in recurrent:
                state = cache.get_recurrent_state(i)
                assert state is not None and state.abs().sum() > 0
                state.zero_()
        return _forward(model, cache, ids[64:], 64)

    kept, zeroed = second_half(False), second_half(True)
    assert torch.equal(kept, zeroed)
    whole = _forward(model, _new_cache(model), ids, 0)[64:]
    assert not torch.equal(kept, whole)
    with pytest.raises(UnsupportedModelError, match=STATE_IGNORED):
        cache_geometry(model)


def _recurrent_layers(model: torch.nn.Module) -> list[int]:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    cache = _new_cache(model)
    return [i for i, layer in enumerate(cache.layers)
            if isinstance(layer, LinearAttentionCacheLayerMixin)]


@pytest.mark.parametrize("arch", _types_for(OWN_CACHE))
def test_model_refuses_the_standard_cache(arch: str) -> None:
    # its forward accepts only its own cache class, which keeps the linear states in a plain
    # list outside the Cache layer API
    model = build_model(arch, seed=0)
    with pytest.raises(ValueError, match=OWN_CACHE):
        _forward(model, _new_cache(model), [3, 4], 0)


@pytest.mark.parametrize("arch", _types_for(STATE_OUTSIDE_CACHE))
def test_recurrent_state_lives_outside_the_cache(arch: str) -> None:
    # the cache declares recurrent layers, but after a forward they are still empty: the
    # model keeps its states in its modules, where no cache API reaches them
    model = build_model(arch, seed=0)
    recurrent = _recurrent_layers(model)
    assert recurrent
    cache = _new_cache(model)
    _forward(model, cache, list(range(3, 19)), 0)
    for i in recurrent:
        assert cache.get_conv_state(i) is None and cache.get_recurrent_state(i) is None


@pytest.mark.parametrize("arch", _types_for(NO_CAUSAL_LM))
def test_no_causal_lm_class(arch: str) -> None:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        AutoModelForCausalLM.from_config(CONFIG_MAPPING[arch]())
    with pytest.raises(UnsupportedModelError, match=NO_CAUSAL_LM):
        build_model(arch, seed=0)


# ---- layer kinds the fast suite exercises through the runtime ---------------------------
async def _demo(engine: object, turns: int = 3) -> dict[str, object]:
    from hylinker.stores.embedded import EmbeddedStore
    from hylinker.tools.demo import ConversationShape, run_demo

    lines: list[str] = []
    store = EmbeddedStore(64 << 20)
    try:
        report = await run_demo("", ConversationShape(100, (60, 90), 3, turns), store=store,
                                engine=engine, warmup=False, out=lines.append)
    finally:
        await store.close()
    assert report["passed"], "\n".join(lines)
    return report


async def test_conv_only_layers_restore_exactly() -> None:
    # LFM2: short-conv layers (one conv state each, no recurrent state) and attention layers.
    # Its config defaults to attention on every layer; the tiny one has the checkpoints' mix
    from hylinker.tools.harness.reference import ReferenceEngine, build_draft_model

    engine = ReferenceEngine(build_model("lfm2", seed=0), build_draft_model(seed=1), chunk_tokens=64)
    g = engine.geometry
    assert len(g.linear) == 3 and all(s.temporal_shape is None for s in g.linear)
    assert g.full_layers == (3,)
    report = await _demo(engine, turns=2)
    controls = report["negative_controls"]
    assert isinstance(controls, list) and [c["name"] for c in controls] == ["state"]
    assert controls[0]["detected"]


async def test_sliding_window_layers_restore_past_their_window() -> None:
    # a 48-token window: every restore lies far past it, so the rows of tokens that left the
    # window are exported as zeros and must never matter
    from hylinker.tools.harness.reference import ReferenceEngine, build_draft_model

    engine = ReferenceEngine(build_model("lara_mini", seed=0, sliding_window=48),
                             build_draft_model(seed=1), chunk_tokens=64)
    assert 48 in engine.geometry.kv_windows and None in engine.geometry.kv_windows
    report = await _demo(engine)
    turns = report["turns"]
    assert isinstance(turns, list) and all(t["restored_tokens"] > 48 for t in turns[1:])


async def test_layers_with_both_kv_and_a_state_restore_exactly() -> None:
    from hylinker.tools.harness.reference import ReferenceEngine, build_draft_model

    engine = ReferenceEngine(build_model("falcon_h1", seed=0), build_draft_model(seed=1),
                             chunk_tokens=64)
    g = engine.geometry
    assert g.both_layers == g.full_layers == tuple(range(g.num_layers))
    layout = engine.layout(page_size=16)
    assert set(layout.full_layers) == {s.layer_id for s in layout.mamba_layers}
    await _demo(engine, turns=2)


async def test_a_purely_recurrent_model_restores_through_a_state_only_layout() -> None:
    # Mamba2 has no attention layer: no KV rows, no draft to ride on them. Its multi-token
    # forward honours the cached state (unlike the Mamba1 torch path above), so the layout is
    # state-only: the tree pages the tokens, the store holds only MAMBA states
    from hylinker.components.layout import PoolKind
    from hylinker.tools.harness.reference import ReferenceEngine, build_draft_model

    model = build_model("mamba2", seed=0)
    ids = torch.randint(3, 512, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    recurrent = _recurrent_layers(model)
    assert recurrent and len(recurrent) == len(_new_cache(model).layers)

    def second_half(zero: bool) -> torch.Tensor:
        cache = _new_cache(model)
        _forward(model, cache, ids[:64], 0)
        if zero:
            for i in recurrent:
                cache.get_recurrent_state(i).zero_()
        return _forward(model, cache, ids[64:], 64)

    assert not torch.equal(second_half(False), second_half(True))  # the state is read
    with pytest.raises(UnsupportedModelError, match="has none"):
        ReferenceEngine(model, build_draft_model(seed=1), chunk_tokens=64)
    engine = ReferenceEngine(model, None, chunk_tokens=64)
    g = engine.geometry
    assert g.kv is None and not g.full_layers and len(g.linear) == g.num_layers
    layout = engine.layout(page_size=16)
    assert layout.state_only and layout.pools == (PoolKind.MAMBA,)
    report = await _demo(engine, turns=2)
    turns = report["turns"]
    assert isinstance(turns, list) and turns[1]["restored_tokens"] > 0


def test_indexer_keys_travel_on_the_kv_rows_and_decide_the_continuation() -> None:
    # Qwen4-Exp's indexed (QSA) attention caches one indexer key per token beside K/V and,
    # on its first indexed layer, the 3-D position history its indexer reads. The keys ride
    # on the layer's KV row (K ‖ V ‖ indexer key); the history is rebuilt from the positions
    from types import SimpleNamespace

    from hylinker.tools.harness.reference import ReferenceEngine
    from hylinker.tools.harness.reference.engine import _position_history

    engine = ReferenceEngine(build_model("qwen4_exp_text", seed=0), None, chunk_tokens=64)
    g = engine.geometry
    assert g.kv is not None and g.kv.indexer_dim == 32 and g.full_layers == (3,)
    assert g.kv.row_shape == (2 * 2 * 32 + 32,)
    assert g.position_history_layers == (3,) and g.position_history_dims == 3
    ids = torch.randint(3, 512, (96,), generator=torch.Generator().manual_seed(2)).tolist()
    seq = engine.new_sequence()
    engine.extend(seq, ids[:64])
    state = engine.export(seq)
    restored = engine.restore(state, ids[:64])
    held, got = seq.cache.layers[3], restored.cache.layers[3]
    assert torch.equal(got.indexer_keys, held.indexer_keys)
    assert torch.equal(got.indexer_position_ids, held.indexer_position_ids)
    want = engine.extend(seq, ids[64:]).logprobs
    assert torch.equal(engine.extend(restored, ids[64:]).logprobs, want)
    # the same state with its indexer keys zeroed: the indexer picks other blocks (a budget of
    # 16 of 64+ tokens), so the continuation changes
    kv = state.kv.clone()
    kv[..., -32:] = 0
    blind = engine.restore(attrs.evolve(state, kv=kv), ids[:64])
    assert not torch.equal(engine.extend(blind, ids[64:]).logprobs, want)
    # a history that is not the tokens' positions (a multimodal prompt's) cannot be rebuilt
    history = torch.arange(4).view(1, 1, 4).expand(3, 1, 4).clone()
    history[1] += 7
    cache = SimpleNamespace(layers=[SimpleNamespace(indexer_position_ids=history)])
    with pytest.raises(UnsupportedModelError, match="not the tokens' positions"):
        _position_history("m", cache, 4)


def test_several_conv_states_travel_as_one_conv_tensor() -> None:
    # Inkling keeps 4 conv states per layer (two wide, two narrow); one MAMBA slot carries
    # them concatenated along the channel axis, and a restore splits them back, each state
    # bit for bit, so the continuation equals the uninterrupted run
    from hylinker.tools.harness.reference import ReferenceEngine

    engine = ReferenceEngine(build_model("inkling_text", seed=0), None, chunk_tokens=64)
    g = engine.geometry
    assert g.linear and all(s.conv_states == 4 and s.temporal_shape is None for s in g.linear)
    spec = g.linear[0]
    assert len(set(spec.conv_channels)) == 2 and spec.conv_shape[0] == sum(spec.conv_channels)
    layout = engine.layout(page_size=16)
    assert [m.conv_shape for m in layout.mamba_layers] == [s.conv_shape for s in g.linear]
    ids = torch.randint(3, 512, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = engine.new_sequence()
    engine.extend(seq, ids[:64])
    state = engine.export(seq)
    assert state.conv is not None and state.conv[0].shape == spec.conv_shape
    restored = engine.restore(state, ids[:64])
    for s in g.linear:
        for k in range(s.conv_states):
            assert torch.equal(restored.cache.get_conv_state(s.layer_id, k),
                               seq.cache.get_conv_state(s.layer_id, k))
    assert torch.equal(engine.extend(restored, ids[64:]).logprobs,
                       engine.extend(seq, ids[64:]).logprobs)
    zeroed = engine.restore(state, ids[:64], linear_state="zero")
    assert not torch.equal(engine.extend(zeroed, ids[64:]).logprobs,
                           engine.extend(engine.restore(state, ids[:64]), ids[64:]).logprobs)


def test_conv_states_that_cannot_be_concatenated_are_refused() -> None:
    from types import SimpleNamespace

    from hylinker.tools.harness.reference.geometry import _several_conv_states

    def layer(second: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(conv_states={0: torch.zeros(1, 8, 4), 1: second},
                               recurrent_states={0: None, 1: None}, conv_kernel_size={0: 4, 1: 4})

    assert _several_conv_states("m", 0, layer(torch.zeros(1, 2, 4)), 2).conv_shape == (10, 4)
    with pytest.raises(UnsupportedModelError, match="differ in kernel window"):
        _several_conv_states("m", 0, layer(torch.zeros(1, 2, 4, dtype=torch.bfloat16)), 2)
    with pytest.raises(UnsupportedModelError, match="differ in kernel window"):
        _several_conv_states("m", 0, layer(torch.zeros(1, 2, 3)), 2)
