"""Isolation keys end to end: the reference hybrid (Qwen3-Next: GQA + Gated DeltaNet, real
forwards) through a real Linker on the embedded store.

A prefix donated under one request's keys (salt, adapter, multimodal span) gives a request
under other keys 0 device and 0 store tokens of it (a multimodal span: only the pages before
it), and each negative has its positive control: the same keys, after the device tree is
flushed, come back from the store with logprobs bit-identical to a recompute.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hylinker import HybridPools, Linker, ModelLayout, MultimodalSpan, PoolKind
from hylinker.components.keys import as_tokens, object_keys, page_keys, request_seed
from hylinker.components.mamba import restorable_ceiling
from hylinker.runtime.linker.facade import deployment_seed
from hylinker.stores.base import Store
from hylinker.stores.embedded import EmbeddedStore
from hylinker.tools.harness.reference import ExtendResult, ReferenceEngine, build_model
from hylinker.tools.harness.reference.runtime_engine import LinkedEngine, PrefillResult

PAGE = 16
PROMPT_LEN = 250  # ceiling 192 on the 64-token grid
IMAGE = (100, 140)  # placeholder tokens of the prompt's "image": pages 6..8
SHORT = 80  # a prefix ending before the image: its prefill donates a state at 64


class Ref:
    def __init__(self) -> None:
        self.engine = ReferenceEngine(build_model("qwen3_next", seed=0), chunk_tokens=64)
        self.layout = self.engine.layout(page_size=PAGE)
        gen = torch.Generator().manual_seed(99)
        self.prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=gen).tolist()
        self.ref: ExtendResult = self.engine.extend(self.engine.new_sequence(), self.prompt)


@pytest.fixture(scope="module")
def ref() -> Ref:
    return Ref()


def _identical(got: PrefillResult, ref: ExtendResult) -> None:
    assert torch.equal(got.logprobs, ref.logprobs[got.cached_tokens:])


async def _flush(linker: Linker, pools: HybridPools) -> None:
    await linker.drain()
    linker.check_idle()
    linker.flush_device()
    pools.check_idle()


def _image(h: bytes) -> tuple[MultimodalSpan]:
    return (MultimodalSpan(*IMAGE, h),)


def _objects(layout: ModelLayout, prompt: list[int], kw: dict[str, Any]) -> list[str]:
    """The KV object keys a request under ``kw`` stores for the prompt's restorable pages."""
    seed = request_seed(deployment_seed(layout), salt=kw.get("salt"), adapter=kw.get("adapter"))
    pages = restorable_ceiling(len(prompt), layout.grid) // PAGE
    return object_keys(page_keys(as_tokens(prompt), PAGE, seed, max_pages=pages), PoolKind.FULL, layout)


async def _tenants(ref: Ref, store: Store) -> None:
    """A prefix donated under (salt A, adapter L1) is served to that pair alone: 0 device and 0
    store tokens for another salt, no salt, another adapter, no adapter."""
    ceiling = restorable_ceiling(PROMPT_LEN, ref.layout.grid)
    run = uuid.uuid4().hex[:8]  # a shared Mooncake master outlives one test
    owner: dict[str, Any] = {"salt": f"tenant-a-{run}", "adapter": "lora-1"}
    others: list[dict[str, Any]] = [
        {"salt": f"tenant-b-{run}", "adapter": "lora-1"}, {"adapter": "lora-1"},
        {"salt": owner["salt"], "adapter": "lora-2"}, {"salt": owner["salt"]}, {},
    ]
    pools = HybridPools(ref.layout, kv_pages=64, mamba_slots=8)
    async with Linker(ref.layout, pools, store) as linker:
        served = LinkedEngine(ref.engine, linker)
        r1 = await served.prefill("owner", ref.prompt, **owner)
        assert (r1.device_tokens, r1.store_tokens) == (0, 0)
        _identical(r1, ref.ref)
        await linker.drain()
        mine = _objects(ref.layout, ref.prompt, owner)
        assert all(await store.exists(mine))
        # the owner's prefix is on the device and in the store: nobody else matches either
        for where in ("device", "store"):
            for i, kw in enumerate(others):
                r = await served.prefill(f"{where}-{i}", ref.prompt, donate=False, **kw)
                assert (r.device_tokens, r.store_tokens, r.restored_tokens) == (0, 0, 0), (where, kw)
                _identical(r, ref.ref)
            if where == "device":
                # positive control on the device: the owner's keys match there
                again = await served.prefill("owner-device", ref.prompt, donate=False, **owner)
                assert again.device_tokens == ceiling
                _identical(again, ref.ref)
                await _flush(linker, pools)
        assert linker.statistics().store_hit_tokens == 0
        # another tenant's own prefill stores its own objects, none of them the owner's
        theirs = _objects(ref.layout, ref.prompt, others[0])
        assert not set(theirs) & set(mine) and not any(await store.exists(theirs))
        await served.prefill("tenant-b", ref.prompt, **others[0])
        await linker.drain()
        assert all(await store.exists(theirs))
        await _flush(linker, pools)
        # positive control: the owner's keys, device flushed, come back from the store
        r2 = await served.prefill("owner-store", ref.prompt, **owner)
        assert r2.device_tokens == 0 and r2.restored_tokens == r2.cached_tokens == ceiling
        _identical(r2, ref.ref)
        await _flush(linker, pools)
        assert linker.statistics().store_hit_tokens == ceiling


async def test_tenants_and_adapters_never_share_a_prefix(ref: Ref) -> None:
    store = EmbeddedStore(64 << 20)
    try:
        await _tenants(ref, store)
    finally:
        await store.close()


@pytest.mark.mooncake
async def test_tenants_and_adapters_never_share_a_prefix_on_mooncake(ref: Ref, mooncake_store: Store) -> None:
    await _tenants(ref, mooncake_store)


async def test_another_image_shares_only_the_pages_before_it(ref: Ref) -> None:
    """The same placeholder tokens with another image hash: none of the pages from the image on
    match (device or store); the prefix before the image does (the state at 64), and the
    same image after a flush restores everything."""
    grid = ref.layout.grid
    ceiling = restorable_ceiling(PROMPT_LEN, grid)
    store = EmbeddedStore(64 << 20)
    pools = HybridPools(ref.layout, kv_pages=64, mamba_slots=8)
    try:
        async with Linker(ref.layout, pools, store) as linker:
            served = LinkedEngine(ref.engine, linker)
            short = await served.prefill("text-only", ref.prompt[:SHORT])  # donates a state at 64
            assert short.checkpoints == (64,)
            r1 = await served.prefill("image-1", ref.prompt, multimodal=_image(b"pixels-1"))
            assert r1.device_tokens == 64  # the text before the image, from the device
            _identical(r1, ref.ref)
            await linker.drain()
            for where in ("device", "store"):
                r = await served.prefill(f"image-2-{where}", ref.prompt, donate=False,
                                         multimodal=_image(b"pixels-2"))
                # only the 64 text tokens before the image: nothing of image 1's pages
                assert r.cached_tokens == 64 and r.device_tokens + r.store_tokens == 64, where
                _identical(r, ref.ref)
                if where == "device":
                    assert r.device_tokens == 64
                    await _flush(linker, pools)
                else:
                    assert r.restored_tokens == 64
                    await _flush(linker, pools)
            # positive control: the same image after the flush comes back whole from the store
            r2 = await served.prefill("image-1-again", ref.prompt, multimodal=_image(b"pixels-1"))
            assert r2.device_tokens == 0 and r2.restored_tokens == r2.cached_tokens == ceiling
            _identical(r2, ref.ref)
            await _flush(linker, pools)
            assert linker.statistics().store_hit_tokens == 64 + ceiling
    finally:
        await store.close()
