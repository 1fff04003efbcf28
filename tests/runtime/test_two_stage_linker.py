"""The Linker's two-stage offload (docs/design/host-staging.md §4e): a node's device pages are
unlocked once copied into host staging, it is marked stored only at the store's answer, a
failed put leaves it unstored, a full budget skips and counts, close drops and counts, and the
offload's restore after the device evicted it is byte-exact. Real objects: HybridPools, the
embedded store behind a gate; every test ends with the idle-pool invariant and no budget bytes."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator

import anyio
import attrs
import numpy as np

from hylinker.components.layout import PoolKind
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import GatedStore, small_hybrid_layout, synthetic_prefill, wait_until

LAYOUT = small_hybrid_layout()
ALL_POOLS = set(LAYOUT.pools)
_ids = itertools.count()


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


@attrs.define
class Env:
    linker: Linker
    pools: HybridPools
    store: GatedStore
    content: SyntheticContent


@contextlib.asynccontextmanager
async def harness(config: LinkerConfig | None = None, *, kv_pages: int = 64) -> AsyncIterator[Env]:
    store = GatedStore(EmbeddedStore(8 << 20))
    pools = HybridPools(LAYOUT, kv_pages=kv_pages, mamba_slots=16)
    linker = Linker(LAYOUT, pools, store, config or LinkerConfig(staging_bytes_per_pool=1 << 16, resilience=None))
    async with linker:
        try:
            yield Env(linker, pools, store, SyntheticContent(pools))
        finally:
            store.open()  # a failing test never waits at the gate in close()
        await linker.drain()
        linker.check_idle()
    linker.check_idle()
    staging = linker.data.host_staging
    assert staging is not None and staging.used == 0, "host staging bytes leaked"
    linker.flush_device()
    pools.check_idle()


async def insert_prompt(env: Env, tokens: np.ndarray) -> int:
    req = env.linker.request(f"r{next(_ids)}", tokens)
    await env.linker.lookup(req)
    depth = await synthetic_prefill(env.linker, env.content, req)
    await env.linker.release(req)
    return depth


async def evict_while_draining(env: Env, p: np.ndarray) -> None:
    """Insert ``p[:41]`` (40 tokens) with the store's puts held, then let the device drop the
    prefix once copied, while the store still drains it."""
    env.store.hold(puts=True)
    assert await insert_prompt(env, p[:41]) == 40
    await wait_until(lambda: env.linker.tree.locked_nodes() == [])
    env.linker.flush_device()
    assert env.linker.tree.root.children == {}


async def test_pages_unlock_at_the_copy_and_stored_waits_for_the_ack() -> None:
    async with harness() as env:
        env.store.hold(puts=True)
        assert await insert_prompt(env, prompt(41)) == 40
        await env.store.wait_held(1)
        node = next(iter(env.linker.tree.root.children.values()))
        # copied: the node's pages are free for eviction though the store has not answered
        await wait_until(lambda: env.linker.tree.locked_nodes() == [])
        assert env.linker.offloads.locked_pages == 0 and env.linker.offloads.in_flight == 1
        assert node.stored == set() and set(node.pending) == ALL_POOLS  # not stored, not re-planned
        env.store.open()
        await env.linker.drain()
        assert node.stored == ALL_POOLS and not node.pending
        assert env.linker.statistics().stored_tokens == 40


async def test_a_failed_put_leaves_the_node_unstored() -> None:
    async with harness() as env:
        env.store.fail_puts = ":kv:"
        assert await insert_prompt(env, prompt(41, seed=1)) == 40
        await env.linker.drain()
        node = next(iter(env.linker.tree.root.children.values()))
        assert PoolKind.FULL not in node.stored and not node.pending
        assert env.linker.statistics().offload_failures == 1
        assert env.linker.tree.locked_nodes() == []


async def test_a_full_budget_skips_the_offload_and_counts_it() -> None:
    probe = Linker(LAYOUT, HybridPools(LAYOUT, kv_pages=64, mamba_slots=16), EmbeddedStore(1 << 20))
    smallest = sum(len(probe.data.codecs[k]) * a.arena.stride for k, a in probe.data.actors.items())
    config = LinkerConfig(staging_bytes_per_pool=1 << 16, resilience=None, host_staging_bytes=smallest)
    async with harness(config) as env:
        env.store.hold(puts=True)
        await insert_prompt(env, prompt(41, seed=2))  # 10 pages: more than the budget
        stats = env.linker.statistics()
        assert stats.offloads_skipped_staging == 1 and stats.offloads_skipped_kv == 0
        assert env.linker.offloads.in_flight == 0 and env.store.calls["put"] == 0
        node = next(iter(env.linker.tree.root.children.values()))
        assert not node.pending and not node.stored  # planned again by a later insert
        figures = env.linker.metric_figures()
        assert figures["objects_skipped", "host_staging_full"] == 1


async def test_close_drops_frames_the_store_never_took_and_counts_them() -> None:
    config = LinkerConfig(staging_bytes_per_pool=1 << 16, resilience=None, close_timeout_s=0.2)
    store = GatedStore(EmbeddedStore(8 << 20))
    pools = HybridPools(LAYOUT, kv_pages=64, mamba_slots=16)
    linker = Linker(LAYOUT, pools, store, config)
    content = SyntheticContent(pools)
    async with linker:
        env = Env(linker, pools, store, content)
        store.hold(puts=True)
        await insert_prompt(env, prompt(41, seed=3))
        await insert_prompt(env, prompt(41, seed=4))  # its frames wait behind the held put
        await store.wait_held(1)
        await wait_until(lambda: linker.tree.locked_nodes() == [])  # both copied
        nodes = list(linker.tree.root.children.values())

        async def answer_late() -> None:  # the store answers the puts it holds after the timeout
            await anyio.sleep(0.4)
            store.release(store.held)

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer_late)
            with anyio.fail_after(10):
                await linker.close()
    stats = linker.statistics()
    assert stats.close_timeouts == 1
    staging = linker.data.host_staging
    assert staging is not None and staging.dropped_objects > 0 and staging.used == 0
    # the first offload's puts were at the store and were answered; the second's frames waited
    # in staging and were dropped: its node is not stored, and nothing of it reached the store
    assert len(nodes) == 2 and sum(1 for n in nodes if n.stored == ALL_POOLS) == 1
    assert sum(1 for n in nodes if not n.stored) == 1
    linker.check_idle()
    linker.flush_device()
    pools.check_idle()


async def test_a_prefix_evicted_after_its_copy_restores_byte_exact() -> None:
    p = prompt(49, seed=5)
    async with harness(kv_pages=64) as env:
        await evict_while_draining(env, p)
        env.store.open()
        await env.linker.drain()
        req = env.linker.request("again", p)
        hit = await env.linker.lookup(req)
        assert (hit.device_tokens, hit.store_tokens) == (0, 40)
        load = await env.linker.load(req)
        assert load is not None
        await env.linker.commit(load)
        rows = env.linker.tree.path_rows(req.node)
        keys = req.page_keys()[:10]
        assert env.content.pages_match(keys, rows) == []  # no page differs
        assert env.linker.statistics().verify_failures == 0
        await env.linker.release(req)


async def test_an_ancestor_of_an_offload_evicted_after_its_copy_is_settled() -> None:
    p = prompt(41, seed=6)
    async with harness() as env:
        lk = env.linker
        req = lk.request("first", p[:17])
        await lk.lookup(req)
        assert await synthetic_prefill(lk, env.content, req, offload=False) == 16  # A: pages 0..3
        await lk.release(req)
        env.store.hold(puts=True)
        assert await insert_prompt(env, p) == 40  # B: pages 4..9; the offload plans A and B
        holder = lk.request("holder", p[:17])
        assert (await lk.lookup(holder)).device_tokens == 16  # holds A
        a = holder.node
        assert a.pending  # A is in the held offload
        await wait_until(lambda: lk.tree.locked_nodes() == [a])  # copied: only the holder's lock
        tree = lk.tree.tree
        assert tree.evict_pages(6) == 6  # B, the offload's end, goes while its put is held
        assert a.children == {}
        env.store.open()
        await lk.drain()
        assert all(not n.pending for n in tree.nodes())  # nothing waits for a settlement forever
        assert a.stored == ALL_POOLS  # its objects reached the store
        await lk.release(holder)


async def test_a_stuck_store_fills_host_staging_not_the_device_pool() -> None:
    """Long prompts against a store that answers nothing: the pages are free once copied, so
    extend never fails and KV backpressure skips nothing; host staging bounds the backlog
    instead (the one-stage side is tests/runtime/test_reliability.py)."""
    config = LinkerConfig(staging_bytes_per_pool=1 << 16, resilience=None, mamba_backpressure=False,
                          close_timeout_s=0.05)
    async with harness(config, kv_pages=64) as env:
        env.store.hold(puts=True)
        staging = env.linker.data.host_staging
        assert staging is not None
        for i in range(12):
            assert await insert_prompt(env, prompt(65, seed=100 + i)) == 64  # 16 pages each
            await wait_until(lambda: env.linker.tree.locked_nodes() == [])
            assert staging.used <= staging.capacity
        stats = env.linker.statistics()
        assert stats.offloads_skipped_kv == 0
        assert stats.offloads_skipped_staging > 0  # 12 x 16 pages pass twice the 64-page pool
        assert stats.offloads == 12 and env.linker.offloads.in_flight == 12 - stats.offloads_skipped_staging


async def test_a_prefix_evicted_while_it_drains_restores_from_its_frames_and_stays_unstored() -> None:
    p = prompt(49, seed=7)
    async with harness(kv_pages=64) as env:
        await evict_while_draining(env, p)  # only host staging holds the prefix now
        req = env.linker.request("again", p)
        hit = await env.linker.lookup(req)  # the store has nothing yet: the frames answer
        assert (hit.device_tokens, hit.store_tokens) == (0, 40)
        load = await env.linker.load(req)
        assert load is not None
        assert await env.linker.commit(load) == 40
        assert env.store.calls["get"] == 0
        rows = env.linker.tree.path_rows(req.node)
        assert env.content.pages_match(req.page_keys()[:10], rows) == []  # no page differs
        stats = env.linker.statistics()
        assert stats.staging_restores > 0 and stats.verify_failures == 0
        assert env.linker.metric_figures() is not None
        # restored from frames the store has not acknowledged: not stored (offloaded again)
        assert req.node.stored == set()
        await env.linker.release(req)
        env.store.open()
        await env.linker.drain()
        assert env.linker.data.pool_statistics()["kv"].staging_frames == 0
