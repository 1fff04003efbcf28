"""The runtime against stores that break the protocol, shutdown races and misuse."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import numpy as np
import pytest
import torch

from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker, PhaseError
from hylinker.stores.base import GetResult, Outcome, Store, StoreCapabilities, StoreStatistics
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import GatedStore, small_hybrid_layout, synthetic_prefill

CFG = LinkerConfig(staging_bytes_per_pool=1 << 16)


class ShortAnswers:
    """A store that drops the last answer of every call of the chosen kind."""

    def __init__(self, inner: Store, short: str) -> None:
        self.inner = inner
        self.short = short

    @property
    def capabilities(self) -> StoreCapabilities:
        return self.inner.capabilities

    def register(self, region: torch.Tensor) -> None:
        self.inner.register(region)

    def unregister(self, region: torch.Tensor) -> None:
        self.inner.unregister(region)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        got = await self.inner.exists(keys)
        return got[:-1] if self.short == "exists" else got

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        got = await self.inner.put(keys, buffers)
        return got[:-1] if self.short == "put" else got

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        got = await self.inner.get(keys, buffers)
        return got[:-1] if self.short == "get" else got

    async def touch(self, keys: Sequence[str]) -> None:
        await self.inner.touch(keys)

    async def remove(self, keys: Sequence[str]) -> int:
        return await self.inner.remove(keys)

    def statistics(self) -> StoreStatistics:
        return self.inner.statistics()

    async def close(self) -> None:
        await self.inner.close()


def _tokens(seed: int, n: int = 41) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


async def _donate(store: Store, tokens: np.ndarray) -> None:
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=64, mamba_slots=16)
    async with Linker(layout, pools, store, CFG) as lk:
        async with lk.session("donor", tokens) as req:
            await lk.lookup(req)
            await synthetic_prefill(lk, SyntheticContent(pools), req)
        await lk.drain()


async def _settle_and_check(lk: Linker, pools: HybridPools) -> None:
    await lk.drain()
    lk.check_idle()
    lk.flush_device()
    pools.check_idle()


@pytest.mark.parametrize("short", ["get", "exists"])
async def test_a_store_that_answers_too_few_keys_is_a_miss_not_a_restore(short: str) -> None:
    inner = EmbeddedStore(8 << 20)
    tokens = _tokens(0)
    await _donate(inner, tokens)
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=64, mamba_slots=16)
    async with Linker(layout, pools, ShortAnswers(inner, short), CFG) as lk:
        async with lk.session("r", tokens) as req:
            hit = await lk.lookup(req)
            if short == "exists":
                assert hit.store_tokens == 0  # fail closed
            else:
                assert hit.store_tokens == 40
                load = await lk.load(req)
                assert load is not None
                assert await lk.commit(load) == 0  # dropped: the request recomputes
                assert lk.statistics().dropped_loads == 1
        await _settle_and_check(lk, pools)


async def test_a_store_that_answers_too_few_puts_marks_nothing_stored() -> None:
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=64, mamba_slots=16)
    async with Linker(layout, pools, ShortAnswers(EmbeddedStore(8 << 20), "put"), CFG) as lk:
        async with lk.session("w", _tokens(1)) as req:
            await lk.lookup(req)
            await synthetic_prefill(lk, SyntheticContent(pools), req)
        await lk.drain()
        assert lk.statistics().offload_failures == 1
        assert all(not n.stored for n in lk.tree.tree.nodes())
        await _settle_and_check(lk, pools)


async def test_close_while_a_commit_waits_keeps_one_owner_per_row() -> None:
    inner = EmbeddedStore(8 << 20)
    tokens = _tokens(2)
    await _donate(inner, tokens)
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=64, mamba_slots=16)
    store = GatedStore(inner)
    restored: list[int] = []
    async with Linker(layout, pools, store, CFG) as lk:
        req = lk.request("r", tokens)
        await lk.lookup(req)
        store.hold(puts=False, gets=True)
        load = await lk.load(req)
        assert load is not None

        async def commit() -> None:
            restored.append(await lk.commit(load))

        async with anyio.create_task_group() as tg:
            tg.start_soon(commit)
            await store.wait_held(1)
            tg.start_soon(lk.close)
            for _ in range(20):
                await anyio.sleep(0)
            store.open()
        assert restored == [40]
        lk.tree.tree.check_consistent()
        tree_pages = lk.tree.tree.statistics().pages
        assert pools.kv.pages.capacity - pools.kv.num_free_pages == tree_pages
        assert lk.statistics().aborts == 0
        lk.flush_device()
        pools.check_idle()


async def test_a_linker_that_is_not_running_refuses_work_instead_of_hanging() -> None:
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=16, mamba_slots=4)
    lk = Linker(layout, pools, EmbeddedStore(1 << 20), CFG)
    with pytest.raises(PhaseError, match="not running"):
        lk.request("early", _tokens(3))
    async with lk:
        req = lk.request("inside", _tokens(3))
        await lk.lookup(req)
        await lk.release(req)
    with pytest.raises(PhaseError, match="not running"):
        lk.request("late", _tokens(3))


async def test_insert_while_a_load_is_in_flight_is_refused() -> None:
    inner = EmbeddedStore(8 << 20)
    tokens = _tokens(4)
    await _donate(inner, tokens)
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=64, mamba_slots=16)
    async with Linker(layout, pools, inner, CFG) as lk:
        async with lk.session("r", tokens) as req:
            await lk.lookup(req)
            load = await lk.load(req)
            assert load is not None
            with pytest.raises(PhaseError, match="load is in flight"):
                await lk.insert(req, 2 * layout.page_size)
            await lk.abort(load)
        await _settle_and_check(lk, pools)




async def test_close_does_not_wait_out_a_pending_touch_batch() -> None:
    """A touch waits ``touch_batch_s`` to share a call with others; closing the linker ends that
    window at once and sends nothing more (before, close slept the whole window)."""
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=32, mamba_slots=8)
    store = GatedStore(EmbeddedStore(8 << 20))
    lk = Linker(layout, pools, store, LinkerConfig(touch_batch_s=3600.0))
    content = SyntheticContent(pools)
    with anyio.fail_after(30):
        async with lk:
            donor = lk.request("donor", _tokens(40))
            await lk.lookup(donor)
            await synthetic_prefill(lk, content, donor)
            await lk.release(donor)
            await lk.drain()
            assert lk.toucher.pending > 0  # the offload's touch waits in its batch window
    assert store.keys["touch"] == []
