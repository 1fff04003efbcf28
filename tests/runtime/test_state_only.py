"""A state-only layout (a purely recurrent model, Mamba2): no FULL pool, no draft.

The tree still pages the tokens (page keys, rows as page accounting); the store holds only
MAMBA states at grid boundaries; lookup, load, commit and offload run with no KV object at
all. Layout: page 4, chunk 8, grid 8 (2 pages), two layers with conv + temporal states.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from hylinker.components.keys import object_key, page_keys
from hylinker.components.layout import LayoutError, MambaLayerSpec, ModelLayout, PoolKind
from hylinker.components.pool_view import PoolSet, PoolViewError, stacked_kv_view, state_view
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker, deployment_seed
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import GatedStore, synthetic_prefill

MAMBA = [MambaLayerSpec(0, (3, 8), torch.float32, (2, 4, 4), torch.float32),
         MambaLayerSpec(1, (3, 8), torch.bfloat16)]
_ids = itertools.count()


def state_only(**over: Any) -> ModelLayout:
    kw: dict[str, Any] = {"page_size": 4, "chunk_size": 8, "full_layers": [], "mamba_layers": MAMBA}
    kw.update(over)
    return ModelLayout.create(**kw)


LAYOUT = state_only()


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


def okey(tokens: np.ndarray, page: int) -> str:
    keys = page_keys(tokens, LAYOUT.page_size, deployment_seed(LAYOUT), max_pages=page + 1)
    return object_key(keys[page], PoolKind.MAMBA, LAYOUT)


# ---- the layout ---------------------------------------------------------------------------
def test_state_only_geometry() -> None:
    assert LAYOUT.state_only and LAYOUT.is_hybrid
    assert LAYOUT.pools == (PoolKind.MAMBA,)
    assert LAYOUT.kv_row_shape == () and LAYOUT.kv_row_bytes == 0 and LAYOUT.draft_row_bytes == 0
    assert LAYOUT.grid == 8
    assert LAYOUT.payload_bytes(PoolKind.MAMBA) == LAYOUT.mamba_state_bytes == (
        3 * 8 * 4 + 2 * 4 * 4 * 4 + 3 * 8 * 2)
    # the (absent) KV dtype never changes the fingerprint; the states do
    assert state_only(kv_dtype="float16").fingerprint == LAYOUT.fingerprint
    assert state_only(mamba_layers=MAMBA[:1]).fingerprint != LAYOUT.fingerprint
    with_kv = ModelLayout.create(page_size=4, chunk_size=8, full_layers=[2], kv_row_shape=[4],
                                 mamba_layers=MAMBA)
    assert not with_kv.state_only and with_kv.fingerprint != LAYOUT.fingerprint


@pytest.mark.parametrize(("over", "message"), [
    ({"mamba_layers": []}, "full_layers and mamba_layers are both empty"),
    ({"kv_row_shape": [8]}, "state-only layout holds no KV rows"),
    ({"draft_layers": 1, "draft_row_shape": [4]}, "draft_layers=1 must lie in [0, 0]"),
    ({"full_layers": [2]}, "kv_row_shape is required"),
    ({"page_size": 100, "chunk_size": 64}, "page_size=100 and chunk_size=64"),
])
def test_bad_state_only_layouts_are_refused(over: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError) as info:
        state_only(**over)
    assert message in str(info.value)


def test_a_state_only_pool_set_has_no_kv_view() -> None:
    pools = HybridPools(LAYOUT, kv_pages=4, mamba_slots=2)
    assert pools.kv.tensor.numel() == 0 and pools.kv.capacity_rows == 16  # page accounting only
    views = pools.views()
    assert set(views) == {PoolKind.MAMBA} and views.page_size is None
    conv = [torch.zeros(2, 3, 8)]
    with pytest.raises(PoolViewError, match="needs a FULL"):
        PoolSet([stacked_kv_view(torch.zeros(1, 16, 4), layer_ids=[0], page_size=4,
                                 kind=PoolKind.DRAFT), state_view([conv], [None], layer_ids=[0])])
    with pytest.raises(PoolViewError, match="at least one view"):
        PoolSet([])


# ---- the runtime ----------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def linker_on(inner: EmbeddedStore, store: Any = None, *, kv_pages: int = 64,
                    slots: int = 16) -> AsyncIterator[tuple[Linker, SyntheticContent]]:
    pools = HybridPools(LAYOUT, kv_pages=kv_pages, mamba_slots=slots)
    linker = Linker(LAYOUT, pools, store if store is not None else inner,
                    LinkerConfig(staging_bytes_per_pool=1 << 16))
    async with linker:
        yield linker, SyntheticContent(pools)
        await linker.drain()
        linker.check_idle()
    linker.flush_device()
    pools.check_idle()


async def donate(linker: Linker, content: SyntheticContent, tokens: np.ndarray) -> int:
    req = linker.request(f"donor{next(_ids)}", tokens)
    await linker.lookup(req)
    load = await linker.load(req)
    if load is not None:
        await linker.commit(load)
    depth = await synthetic_prefill(linker, content, req)
    await linker.release(req)
    await linker.drain()
    return depth


async def test_the_store_holds_only_states_and_a_restore_brings_them_back() -> None:
    p = prompt(49)
    inner = EmbeddedStore(8 << 20)
    gated = GatedStore(inner)
    async with linker_on(inner, gated) as (linker, content):
        assert await donate(linker, content, p[:17]) == 16
        assert await donate(linker, content, p) == 48
        written = sorted(k for call in gated.keys["put"] for k in call)
        assert written == sorted([okey(p, 3), okey(p, 11)])  # two states, no page object
        assert inner.statistics().objects == 2
        linker.flush_device()
        req = linker.request("again", p)
        hit = await linker.lookup(req)
        assert (hit.device_tokens, hit.store_tokens) == (0, 48)
        load = await linker.load(req)
        assert load is not None and set(load.keys) == {PoolKind.MAMBA}
        assert await linker.commit(load) == 48
        assert req.prefix_tokens == 48 and content.prefix_problems(linker, req) == []
        st = linker.statistics()
        assert (st.commits, st.store_hit_tokens, st.verify_failures) == (1, 48, 0)
        await linker.release(req)
        # restored on the device: a device hit now, and nothing is written back
        req = linker.request("device", p)
        hit = await linker.lookup(req)
        assert (hit.device_tokens, hit.store_tokens) == (48, 0)
        await linker.release(req)


@pytest.mark.parametrize(("missing", "want"), [
    ((), 48),
    ((11,), 16),  # the state at 48 is gone: fall back to the one at 16
    ((3,), 48),  # only the boundary's own state matters, no page below it
    ((3, 11), 0),
])
async def test_lookup_takes_the_deepest_state_the_store_holds(missing: Sequence[int], want: int) -> None:
    p = prompt(49, seed=1)
    inner = EmbeddedStore(8 << 20)
    async with linker_on(inner) as (linker, content):
        await donate(linker, content, p[:17])
        await donate(linker, content, p)
        linker.flush_device()
        assert await inner.remove([okey(p, page) for page in missing]) == len(missing)
        req = linker.request("r", p)
        hit = await linker.lookup(req)
        assert (hit.device_tokens, hit.store_tokens) == (0, want)
        if want:
            load = await linker.load(req)
            assert load is not None and await linker.commit(load) == want
            assert content.prefix_problems(linker, req) == []
        else:
            assert await linker.load(req) is None
        await linker.release(req)


async def test_a_corrupt_state_falls_back_or_recomputes() -> None:
    p = prompt(49, seed=2)
    inner = EmbeddedStore(8 << 20)
    async with linker_on(inner) as (linker, content):
        await donate(linker, content, p[:17])
        await donate(linker, content, p)
    # every object corrupt: the deepest state and its fallback both fail, nothing is kept
    store = FaultyStore(inner, FaultPlan(corrupt=1.0), seed=3)
    async with linker_on(inner, store) as (linker, content):
        req = linker.request("r", p)
        assert (await linker.lookup(req)).store_tokens == 48
        load = await linker.load(req)
        assert load is not None and [b for b, _ in load.states] == [4, 12]
        assert await linker.commit(load) == 0
        st = linker.statistics()
        assert (st.dropped_loads, st.store_hit_tokens) == (1, 0) and st.verify_failures == 2
        assert await synthetic_prefill(linker, content, req) == 48  # recomputes, donates again
        assert content.prefix_problems(linker, req) == []
        await linker.release(req)
