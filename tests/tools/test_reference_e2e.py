"""End to end: a prefix restored through hylinker gives bit-identical logprobs.

The tiny reference hybrid (Kimi Linear: MLA + KDA; Qwen3-Next: GQA + Gated DeltaNet) plus a
llama draft model is served through a real :class:`Linker` over a real store (embedded, and
Mooncake on a loopback master). Every round after the first flushes the device tree, so the
prefix comes back from the store: KV pages, the recurrent-state checkpoint, the draft KV.
The continuation must equal, bit for bit, a run that never left the device (same absolute
chunk schedule); a restore that skips the recurrent state must be caught (KL > 0).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers")

from hylinker.components.layout import ModelLayout
from hylinker.components.mamba import restorable_ceiling
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.facade import Linker, Request
from hylinker.stores.base import Store
from hylinker.stores.embedded import EmbeddedStore
from hylinker.tools.harness.reference import (
    BoundaryState,
    ExtendResult,
    LinearStateMode,
    ReferenceEngine,
    ReferenceSequence,
    build_draft_model,
    build_model,
    kl_divergence,
    max_abs_diff,
)
from hylinker.tools.harness.reference.runtime_engine import LinkedEngine, PrefillResult, pool_views

PAGE = 16
PROMPT_LEN = 250  # ceiling 192 on the 64-token grid; the prefill donates at 192
TURN2_NEW = 80  # new user tokens of the second turn
DECODE = 3
KV_PAGES = 96
SLOTS = 12


@dataclass
class Oracle:
    """A model, its layout, two prompts of one conversation and their uninterrupted runs."""

    arch: str
    engine: ReferenceEngine
    layout: ModelLayout
    prompt: list[int]
    ref: ExtendResult  # the whole first prompt, never cached
    ref_decoded: list[int]
    ref_decode_lp: torch.Tensor
    turn2: list[int]
    ref2: ExtendResult


_ORACLES: dict[str, Oracle] = {}


def _oracle(arch: str) -> Oracle:
    if arch in _ORACLES:
        return _ORACLES[arch]
    engine = ReferenceEngine(build_model(arch, seed=0), build_draft_model(seed=1), chunk_tokens=64)
    layout = engine.layout(page_size=PAGE)
    gen = torch.Generator().manual_seed(4321)
    prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=gen).tolist()
    seq = engine.new_sequence()
    ref = engine.extend(seq, prompt)
    decoded, dec_lp = engine.decode_greedy(seq, DECODE)
    turn2 = prompt + decoded + torch.randint(3, 512, (TURN2_NEW,), generator=gen).tolist()
    ref2 = engine.extend(engine.new_sequence(), turn2)
    _ORACLES[arch] = Oracle(arch, engine, layout, prompt, ref, decoded, dec_lp, turn2, ref2)
    return _ORACLES[arch]


@pytest.fixture(scope="module")
def kimi() -> Oracle:
    return _oracle("kimi_linear")


@pytest.fixture(scope="module")
def qwen() -> Oracle:
    return _oracle("qwen3_next")


def _assert_identical(got: PrefillResult, ref: ExtendResult) -> None:
    start = got.cached_tokens
    want = ref.logprobs[start:]
    assert got.logprobs.shape == want.shape
    assert max_abs_diff(got.logprobs, want) == 0.0
    assert kl_divergence(want, got.logprobs) == 0.0
    assert torch.equal(got.logprobs, want)
    assert got.draft_logprobs is not None and ref.draft_logprobs is not None
    assert torch.equal(got.draft_logprobs, ref.draft_logprobs[start:])


async def _settle(linker: Linker, pools: HybridPools) -> None:
    """Wait for the offloads, check nothing leaked, then flush the device tree."""
    await linker.drain()
    linker.check_idle()
    linker.flush_device()
    pools.check_idle()


async def _conversation(o: Oracle, store: Store) -> None:
    """Cold prefill, restore from the store (+ decode), negative controls, a second turn."""
    pools = HybridPools(o.layout, kv_pages=KV_PAGES, mamba_slots=SLOTS)
    ceiling = restorable_ceiling(PROMPT_LEN, o.layout.grid)
    async with Linker(o.layout, pools, store, salt=uuid.uuid4().hex) as linker:
        served = LinkedEngine(o.engine, linker)

        # round 1: nothing cached anywhere; the prefill donates its checkpoint
        r1 = await served.prefill("round1", o.prompt)
        assert (r1.device_tokens, r1.store_tokens, r1.restored_tokens) == (0, 0, 0)
        assert r1.checkpoints == (PROMPT_LEN // 64 * 64,)
        _assert_identical(r1, o.ref)
        await _settle(linker, pools)

        # round 2: the device tree is empty, the prefix comes back from the store
        r2 = await served.prefill("round2", o.prompt)
        assert r2.device_tokens == 0
        assert r2.restored_tokens == r2.cached_tokens == ceiling == 192
        _assert_identical(r2, o.ref)
        decoded, dec_lp = o.engine.decode_greedy(r2.sequence, DECODE)
        assert decoded == o.ref_decoded
        assert torch.equal(dec_lp, o.ref_decode_lp)
        await _settle(linker, pools)

        # negative controls: the KV is restored but the recurrent state is not
        for mode in ("zero", "skip"):
            neg = await served.prefill(f"neg-{mode}", o.prompt, linear_state=mode)
            assert neg.restored_tokens == ceiling and neg.checkpoints == ()
            assert kl_divergence(o.ref.logprobs[ceiling:], neg.logprobs) > 0
            assert max_abs_diff(neg.logprobs, o.ref.logprobs[ceiling:]) > 0
            await _settle(linker, pools)

        # the state slot the COMMIT handed over is wiped before the forward reads it
        wiped = _SlotWipingEngine(o.engine, linker)
        neg = await wiped.prefill("neg-slot", o.prompt, donate=False)
        assert neg.restored_tokens == ceiling and wiped.wiped
        assert kl_divergence(o.ref.logprobs[ceiling:], neg.logprobs) > 0
        await _settle(linker, pools)

        # turn 2 extends the conversation: it restores turn 1's prefix from the store
        t2 = await served.prefill("turn2", o.turn2)
        assert t2.device_tokens == 0
        assert t2.restored_tokens == r1.checkpoints[-1] == 192
        assert t2.checkpoints == (len(o.turn2) // 64 * 64,)
        _assert_identical(t2, o.ref2)
        await linker.drain()

        # and the same turn again, now straight from the device tree (no flush)
        t2b = await served.prefill("turn2-device", o.turn2)
        assert t2b.device_tokens == t2b.cached_tokens == restorable_ceiling(len(o.turn2), 64)
        assert t2b.restored_tokens == 0
        _assert_identical(t2b, o.ref2)
        await _settle(linker, pools)
        stats = linker.statistics()
        assert stats.verify_failures == 0 and stats.offload_failures == 0
        assert stats.store_hit_tokens == 5 * ceiling


class _SlotWipingEngine(LinkedEngine):
    """Zeroes the prefix node's recurrent-state slot after COMMIT (a lost state load)."""

    wiped = False

    def _restore(self, req: Request, toks: list[int], linear_state: LinearStateMode,
                 corrupt: Callable[[BoundaryState], BoundaryState] | None = None) -> ReferenceSequence:
        assert req.state_source is not None
        for t in self.views.temporal:
            assert t is not None
            t[req.state_source].zero_()
        self.wiped = True
        return super()._restore(req, toks, "load")


async def test_embedded_store_kimi_linear(kimi: Oracle) -> None:
    store = EmbeddedStore(64 << 20)
    try:
        await _conversation(kimi, store)
    finally:
        await store.close()


@pytest.mark.mooncake
async def test_mooncake_store_kimi_linear(kimi: Oracle, mooncake_store: Store) -> None:
    await _conversation(kimi, mooncake_store)


async def test_embedded_store_qwen3_next(qwen: Oracle) -> None:
    store = EmbeddedStore(64 << 20)
    try:
        await _conversation(qwen, store)
    finally:
        await store.close()


async def test_prompt_on_the_grid_restores_its_ceiling(kimi: Oracle) -> None:
    """L a multiple of G: the checkpoint at L cannot serve the same prompt (one token must
    run), so the engine also donates at L - G; the resubmitted prompt restores that."""
    prompt = kimi.prompt[:192]
    store = EmbeddedStore(64 << 20)
    pools = HybridPools(kimi.layout, kv_pages=KV_PAGES, mamba_slots=SLOTS)
    try:
        async with Linker(kimi.layout, pools, store) as linker:
            served = LinkedEngine(kimi.engine, linker, forward_in_thread=True)
            r1 = await served.prefill("a", prompt)
            assert r1.checkpoints == (128, 192)
            await _settle(linker, pools)
            r2 = await served.prefill("b", prompt)
            assert r2.restored_tokens == restorable_ceiling(192, 64) == 128
            assert torch.equal(r2.logprobs, kimi.ref.logprobs[128:192])
            await _settle(linker, pools)
    finally:
        await store.close()


def test_pool_views_share_the_pool_tensors(kimi: Oracle) -> None:
    pools = HybridPools(kimi.layout, kv_pages=4, mamba_slots=2)
    views = pool_views(pools)
    assert views.kv is pools.kv.tensor
    assert pools.draft is not None and views.draft is pools.draft.tensor
    assert pools.mamba is not None
    assert all(a is b for a, b in zip(views.conv, pools.mamba.conv, strict=True))
    assert all(a is b for a, b in zip(views.temporal, pools.mamba.temporal, strict=True))


async def test_engine_and_layout_must_agree(kimi: Oracle) -> None:
    store = EmbeddedStore(1 << 20)
    pools = HybridPools(kimi.layout, kv_pages=4, mamba_slots=2)
    try:
        async with Linker(kimi.layout, pools, store) as linker:
            with pytest.raises(ValueError, match="chunk_tokens"):
                LinkedEngine(ReferenceEngine(kimi.engine.model, kimi.engine.draft_model,
                                             chunk_tokens=128), linker)
            with pytest.raises(ValueError, match="draft"):
                LinkedEngine(ReferenceEngine(kimi.engine.model), linker)
            with pytest.raises(ValueError, match="at least one token"):
                await LinkedEngine(kimi.engine, linker).prefill("empty", [])
    finally:
        await store.close()


async def test_demo_conversation_is_exact(kimi: Oracle) -> None:
    from hylinker.tools.demo import ConversationShape, run_demo

    lines: list[str] = []
    store = EmbeddedStore(64 << 20)
    try:
        report = await run_demo("kimi_linear", ConversationShape(64, (40, 60), 4, 2),
                                store=store, engine=kimi.engine, warmup=False, out=lines.append)
    finally:
        await store.close()
    assert report["passed"], "\n".join(lines)
    first, second = report["turns"]
    assert first["restored_tokens"] == 0
    assert second["restored_tokens"] == second["expected_restored_tokens"] == \
        first["prompt_tokens"] // 64 * 64 > 0
    assert all(t["max_abs_logprob_diff"] == 0.0 and t["kl"] == 0.0 for t in report["turns"])
    from hylinker.tools.demo_controls import MARGIN

    assert [c["name"] for c in report["negative_controls"]] == ["state", "recurrent state"]
    assert report["negative_control_kl"] >= MARGIN.kl
    assert report["negative_control_max_abs_logprob_diff"] >= MARGIN.max_abs_logprob_diff
    assert any("flushed before every turn" in line for line in lines)
    assert lines[-1].startswith("result: PASS")


def test_demo_cli_options(capsys: pytest.CaptureFixture[str]) -> None:
    from hylinker.tools.cli import build_parser, main

    args = build_parser().parse_args(
        ["demo", "--arch", "qwen3_next", "--store", "mooncake", "--large", "--turns", "2",
         "--json", "out.json"])
    assert (args.arch, args.store, args.large, args.turns, args.json) == (
        "qwen3_next", "mooncake", True, 2, "out.json")
    with pytest.raises(SystemExit) as stopped:  # argparse's one line, exit 2
        main(["demo", "--turns", "0"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--turns" in err and "must be at least 1" in err and len(err.strip().splitlines()) <= 2
