"""A load that finds no free pages waits for them instead of recomputing (issue 52, item 2).

Layout: page P = 4 tokens, chunk C = 8, grid G = 8 tokens (2 pages). The pages a load needs are
held by an offload the store has not acknowledged (the gate holds its put) or by another open
request; the load waits while someone besides waiters may give pages back, at most
``LinkerConfig.load_wait_s``, and never while holding what it would allocate.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np

from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker, LoadHandle, Request
from hylinker.runtime.linker.statistics import linker_figures
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import GatedStore, small_hybrid_layout, synthetic_prefill, wait_until

LAYOUT = small_hybrid_layout()
_ids = itertools.count()


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


@contextlib.asynccontextmanager
async def running(kv_pages: int, inner: EmbeddedStore, **config: Any) -> AsyncIterator[
        tuple[Linker, GatedStore, SyntheticContent]]:
    """A linker over a gate on ``inner``; every row, slot and lock is back at the end."""
    store = GatedStore(inner)
    pools = HybridPools(LAYOUT, kv_pages=kv_pages, mamba_slots=16)
    async with Linker(LAYOUT, pools, store, LinkerConfig(staging_bytes_per_pool=1 << 16, **config)) as lk:
        yield lk, store, SyntheticContent(pools)
        store.open()
        await lk.drain()
        lk.check_idle()
    assert lk.leaked() == (0, 0)
    lk.flush_device()
    pools.check_idle()


async def hold_pages(lk: Linker, content: SyntheticContent, tokens: np.ndarray) -> Request:
    """An open request that prefilled ``tokens``: its pages stay locked until it is released."""
    req = lk.request(f"holder{next(_ids)}", tokens)
    await lk.lookup(req)
    await synthetic_prefill(lk, content, req)
    return req


async def donate(lk: Linker, content: SyntheticContent, tokens: np.ndarray) -> None:
    """Prefill ``tokens`` (offloaded), release, wait for the store, forget the device copy."""
    await lk.release(await hold_pages(lk, content, tokens))
    await lk.drain()
    lk.flush_device()


async def behind_a_holder(lk: Linker, content: SyntheticContent, seed: int) -> tuple[Request, Request]:
    """(holder, waiter): 8 pages of the waiter's prompt in the store, 13 of the 16 device pages
    held by an open request that prefilled another prompt."""
    q = prompt(33, seed=seed)
    await donate(lk, content, q)
    holder = await hold_pages(lk, content, prompt(49, seed=seed + 1))
    await lk.drain()
    req = lk.request(f"waiter{next(_ids)}", q)
    assert (await lk.lookup(req)).store_tokens == 32
    return holder, req


@contextlib.asynccontextmanager
async def waiting(lk: Linker, req: Request) -> AsyncIterator[list[LoadHandle | None]]:
    """Start ``req``'s load; inside, it is waiting for pages; after, it has returned (into the list)."""
    got: list[LoadHandle | None] = []

    async def load() -> None:
        got.append(await lk.load(req))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            await wait_until(lambda: lk.statistics().load_waits == 1)
            yield got


async def test_a_load_waits_for_pages_an_offload_in_flight_holds() -> None:
    q, h = prompt(33, seed=1), prompt(49, seed=2)
    async with running(16, EmbeddedStore(8 << 20)) as (lk, store, content):
        await donate(lk, content, q)  # 8 pages of q in the store
        store.hold(puts=True)
        holder = await hold_pages(lk, content, h)  # 12 pages in the tree, locked by its offload
        await lk.release(holder)
        assert lk.offloads.in_flight == 1 and lk.pools.kv.num_free_pages == 4
        req = lk.request("waiter", q)
        assert (await lk.lookup(req)).store_tokens == 32
        async with waiting(lk, req) as got:
            assert got == []  # still waiting: the offload holds the pages
            store.open()  # the store acknowledges: the offload's pages come back
        handle = got[0]
        assert handle is not None  # before: None at once (a miss, the prefix recomputed)
        assert await lk.commit(handle) == 32
        st = lk.statistics()
        assert (st.load_waits, st.load_waits_recomputed, st.load_misses) == (1, 0, 0)
        assert linker_figures(st, 0)[("load_waits", "served")] == 1
        await lk.release(req)


async def test_a_wait_has_a_limit_then_the_request_recomputes() -> None:
    async with running(16, EmbeddedStore(8 << 20), load_wait_s=0.05) as (lk, _, content):
        holder, req = await behind_a_holder(lk, content, seed=3)
        free = (lk.pools.kv.num_free_pages, lk.pools.mamba.num_free)  # type: ignore[union-attr]
        with anyio.fail_after(10):
            assert await lk.load(req) is None
        assert (lk.pools.kv.num_free_pages, lk.pools.mamba.num_free) == free  # type: ignore[union-attr]
        st = lk.statistics()
        assert (st.load_waits, st.load_waits_recomputed, st.load_misses) == (1, 1, 1)
        assert linker_figures(st, 0)[("load_waits", "recomputed")] == 1
        await lk.release(req)
        await lk.release(holder)


async def test_no_wait_when_nothing_else_can_give_pages_back() -> None:
    r = prompt(65, seed=5)
    inner = EmbeddedStore(8 << 20)
    async with running(64, inner) as (lk, _, content):
        await donate(lk, content, r)  # 16 pages in the store
    async with running(12, inner, load_wait_s=30.0) as (lk, _, _):  # 16 pages never fit in 12
        req = lk.request("alone", r)
        assert (await lk.lookup(req)).store_tokens == 64
        with anyio.fail_after(5):
            assert await lk.load(req) is None
        assert (lk.statistics().load_waits, lk.statistics().load_misses) == (0, 1)
        await lk.release(req)
    async with running(20, inner, load_wait_s=30.0) as (lk, _, _):  # fits, but only this request is open
        req = lk.request("alone", r)
        await lk.lookup(req)
        with anyio.fail_after(5):
            handle = await lk.load(req)
        assert handle is not None and await lk.commit(handle) == 64
        assert lk.statistics().load_waits == 0
        await lk.release(req)


async def test_a_release_ends_the_wait_of_a_load() -> None:
    async with running(16, EmbeddedStore(8 << 20), load_wait_s=30.0) as (lk, _, content):
        holder, req = await behind_a_holder(lk, content, seed=6)
        async with waiting(lk, req) as got:
            other = lk.request("passer-by", prompt(9, seed=99))  # a release that frees
            await lk.lookup(other)  # too little wakes the waiter, which waits on
            await lk.release(other)
            await anyio.sleep(0.01)
            assert got == []
            await lk.release(holder)  # now its pages are evictable
        handle = got[0]
        assert handle is not None and await lk.commit(handle) == 32
        assert (lk.statistics().load_waits, lk.statistics().load_waits_recomputed) == (1, 0)
        await lk.release(req)


async def test_a_request_released_while_its_load_waits_takes_nothing() -> None:
    async with running(16, EmbeddedStore(8 << 20), load_wait_s=30.0) as (lk, _, content):
        holder, req = await behind_a_holder(lk, content, seed=9)
        async with waiting(lk, req) as got:
            await lk.release(req)  # the engine gave up on the request
        assert got == [None]
        assert lk.statistics().load_waits_recomputed == 1
        await lk.release(holder)


async def test_an_allocation_rolled_back_for_want_of_a_slot_wakes_no_waiter() -> None:
    """Rows taken and given back because no state slot was free free nothing new: a load waiting
    for pages is not woken by it (two waiters would otherwise wake each other in turn)."""
    async with running(16, EmbeddedStore(1 << 22)) as (lk, _, _):
        slots = []
        while (slot := lk.tree.try_alloc_slot()) is not None:
            slots.append(slot)
        woken = anyio.Event()

        async def waiter() -> None:
            await lk.tree.released()
            woken.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0)
            assert lk.restores._allocate(2) is None  # rows were free, the slot was not
            await anyio.sleep(0.01)
            assert not woken.is_set()
            lk.tree.free_slot(slots.pop())  # a real release wakes it
            with anyio.fail_after(5):
                await woken.wait()
        for slot in slots:
            lk.tree.free_slot(slot)
