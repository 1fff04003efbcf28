"""The phase contracts of docs/design/phases.md §2, one test (or a few) per rule, on the embedded store.

Layout: page P = 4 tokens, chunk C = 8, so the grid G = 8 tokens (2 pages). Every test ends
with the idle-pool invariant: no request open, nothing locked, the tree agrees with the
allocators, and after a flush every row and slot is free.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import pytest

from hylinker.components.keys import object_key, page_keys
from hylinker.components.layout import ModelLayout, PoolKind
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker, LookupResult, PhaseError, Request
from hylinker.stores.base import Store
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import GatedStore, small_hybrid_layout, synthetic_prefill, wait_until

LAYOUT = small_hybrid_layout()
P = LAYOUT.page_size
ALL_POOLS = set(LAYOUT.pools)
_ids = itertools.count()
SMALL = 1 << 16  # staging bytes per pool actor: a few objects per batch


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


def okey(tokens: np.ndarray, page: int, kind: PoolKind, layout: ModelLayout = LAYOUT) -> str:
    from hylinker.runtime.linker.facade import deployment_seed

    keys = page_keys(tokens, layout.page_size, deployment_seed(layout), max_pages=page + 1)
    return object_key(keys[page], kind, layout)


@attrs.define
class Env:
    linker: Linker
    pools: HybridPools
    store: GatedStore
    inner: EmbeddedStore
    content: SyntheticContent


@contextlib.asynccontextmanager
async def harness(*, kv_pages: int = 64, slots: int = 16, config: LinkerConfig | None = None,
                  layout: ModelLayout = LAYOUT, inner: EmbeddedStore | None = None,
                  wrap: Any = None) -> AsyncIterator[Env]:
    """A running linker over a GatedStore; checks the idle-pool invariant at the end."""
    inner = inner if inner is not None else EmbeddedStore(8 << 20)
    base: Store = wrap(inner) if wrap is not None else inner
    store = GatedStore(base)
    pools = HybridPools(layout, kv_pages=kv_pages, mamba_slots=slots)
    linker = Linker(layout, pools, store, config or LinkerConfig(staging_bytes_per_pool=SMALL))
    async with linker:
        yield Env(linker, pools, store, inner, SyntheticContent(pools))
        store.open()
        await linker.drain()
        linker.check_idle()
    linker.check_idle()
    linker.flush_device()
    pools.check_idle()


async def donate(env: Env, tokens: np.ndarray, *, offload: bool | None = None) -> int:
    """A whole request: lookup, restore what the store has, prefill, insert, release, drain."""
    lk = env.linker
    req = lk.request(f"donor{next(_ids)}", tokens)
    await lk.lookup(req)
    load = await lk.load(req)
    if load is not None:
        await lk.commit(load)
    depth = await synthetic_prefill(lk, env.content, req, offload=offload)
    await lk.release(req)
    await lk.drain()
    return depth


async def open_request(env: Env, tokens: np.ndarray) -> tuple[Request, LookupResult]:
    req = env.linker.request(f"r{next(_ids)}", tokens)
    return req, await env.linker.lookup(req)


def exists_keys(store: GatedStore) -> list[str]:
    return store.keys["exists"][-1]


# ---- LOOKUP ------------------------------------------------------------------------------------


async def test_lookup_hashes_only_whole_pages_after_the_device_hit() -> None:
    p = prompt(53)
    async with harness() as env:
        assert await donate(env, p[:41]) == 40  # pages 0..9 on the device
        req, hit = await open_request(env, p)  # 53 tokens: 13 whole pages, ceiling 48
        assert (hit.device_tokens, hit.store_tokens) == (40, 0)
        probed = exists_keys(env.store)
        want = [okey(p, 10, PoolKind.FULL), okey(p, 11, PoolKind.FULL),
                okey(p, 11, PoolKind.MAMBA),  # only the page that ends a grid boundary
                okey(p, 10, PoolKind.DRAFT), okey(p, 11, PoolKind.DRAFT)]
        assert sorted(probed) == sorted(want)  # nothing below the hit, nothing past L-1
        await env.linker.release(req)

        calls = env.store.calls["exists"]
        req, hit = await open_request(env, p[:41])  # ceiling 40 = the device hit: no probe
        assert (hit.device_tokens, hit.store_tokens) == (40, 0)
        assert env.store.calls["exists"] == calls
        await env.linker.release(req)


async def test_lookup_ceiling_keeps_one_token_to_forward() -> None:
    p = prompt(60, seed=1)
    async with harness() as env:
        assert await donate(env, p[:41]) == 40  # states at 40 and 48
        assert await donate(env, p[:49]) == 48
        env.linker.flush_device()
        for n, want in ((47, 40), (48, 40), (49, 48), (50, 48), (56, 48), (57, 48)):
            req, hit = await open_request(env, p[:n])
            assert (hit.device_tokens, hit.store_tokens) == (0, want), n
            assert hit.total_tokens <= n - 1
            await env.linker.release(req)

        # restored to the device as one node ending at 48: a 48-token prompt cannot use it
        req, _ = await open_request(env, p[:49])
        load = await env.linker.load(req)
        assert load is not None and await env.linker.commit(load) == 48
        await env.linker.release(req)
        req, hit = await open_request(env, p[:48])
        assert (hit.device_tokens, hit.store_tokens) == (0, 40)
        await env.linker.release(req)


@pytest.mark.parametrize(("missing", "want"), [
    ((), 48),
    ((("mamba", 11),), 16),  # the state at 48 is gone: fall back to 16, never clamp to 48
    ((("mamba", 3),), 48),  # a state is needed only at the boundary itself
    ((("mamba", 3), ("mamba", 11)), 0),
    ((("draft", 1),), 0),  # draft missing: no hit
    ((("draft", 6),), 16),
    ((("kv", 0),), 0),
    ((("kv", 6),), 16),  # the state at 48 exists but its KV cannot be loaded
    ((("kv", 10), ("mamba", 11)), 16),  # KV reaches 40, but 40 has no state: 16
])
async def test_lookup_fails_closed_and_takes_the_largest_restorable_boundary(
        missing: Sequence[tuple[str, int]], want: int) -> None:
    p = prompt(49, seed=2)
    async with harness() as env:
        await donate(env, p[:17])  # state at 16
        await donate(env, p[:49])  # KV pages 0..11, state at 48
        env.linker.flush_device()
        assert await env.inner.remove([okey(p, page, PoolKind(kind)) for kind, page in missing]) \
            == len(missing)
        req, hit = await open_request(env, p)
        assert (hit.device_tokens, hit.store_tokens) == (0, want)
        if want:  # what lookup promised can be restored
            load = await env.linker.load(req)
            assert load is not None and await load.wait()
            assert await env.linker.commit(load) == want
            assert env.content.prefix_problems(env.linker, req) == []
        await env.linker.release(req)


async def test_lookup_store_error_is_a_miss() -> None:
    p = prompt(49, seed=3)
    plan = FaultPlan(unavailable=1.0)
    async with harness() as env:
        await donate(env, p)
    inner = env.inner
    async with harness(inner=inner, wrap=lambda s: FaultyStore(s, plan)) as env2:
        req, hit = await open_request(env2, p)
        assert hit.store_tokens == 0
        assert await env2.linker.load(req) is None
        await env2.linker.release(req)


# ---- LOAD --------------------------------------------------------------------------------------


async def test_load_evicts_device_prefixes_when_short() -> None:
    p, q = prompt(49, seed=4), prompt(33, seed=5)
    async with harness(kv_pages=16, slots=4) as env:
        await donate(env, q)  # 8 pages + a state at 32 in the store
        env.linker.flush_device()
        await donate(env, p)  # 12 pages (+1 partial, freed) on the device, unlocked
        assert env.pools.kv.num_free_pages == 4
        req, hit = await open_request(env, q)
        assert hit.store_tokens == 32
        load = await env.linker.load(req)
        assert load is not None, "load must evict the unlocked prefix to make room"
        assert await env.linker.commit(load) == 32
        assert env.content.prefix_problems(env.linker, req) == []
        await env.linker.release(req)
        assert env.linker.tree.tree.statistics().pages == 8


async def test_failed_row_allocation_is_a_plain_miss_and_leaks_nothing() -> None:
    p, q = prompt(49, seed=6), prompt(33, seed=7)
    async with harness(kv_pages=16, slots=4) as env:
        await donate(env, q)
        env.linker.flush_device()
        holder, _ = await open_request(env, p)
        await synthetic_prefill(env.linker, env.content, holder)  # 13 pages, locked
        await env.linker.drain()
        req, hit = await open_request(env, q)
        assert hit.store_tokens == 32
        free_pages, free_slots = env.pools.kv.num_free_pages, env.pools.mamba.num_free  # type: ignore[union-attr]
        assert await env.linker.load(req) is None  # no exception: the request recomputes
        assert (env.pools.kv.num_free_pages, env.pools.mamba.num_free) == (free_pages, free_slots)  # type: ignore[union-attr]
        st = env.linker.statistics()
        assert (st.loads, st.load_misses, st.commits) == (1, 1, 0)
        await env.linker.release(req)
        await env.linker.release(holder)


async def test_failed_slot_allocation_aborts_the_rows_it_took() -> None:
    p, q = prompt(49, seed=8), prompt(33, seed=9)
    async with harness(kv_pages=64, slots=2) as env:
        await donate(env, q)
        env.linker.flush_device()
        holder, _ = await open_request(env, p)
        await synthetic_prefill(env.linker, env.content, holder)  # node state + working: 2 slots
        await env.linker.drain()
        assert env.pools.mamba is not None and env.pools.mamba.num_free == 0
        req, _ = await open_request(env, q)
        free_pages = env.pools.kv.num_free_pages
        assert await env.linker.load(req) is None
        assert env.pools.kv.num_free_pages == free_pages
        assert env.linker.statistics().load_misses == 1
        await env.linker.release(req)
        await env.linker.release(holder)


async def test_wait_layer_gives_layerwise_readiness() -> None:
    p = prompt(41, seed=10)
    async with harness() as env:
        await donate(env, p)
        env.linker.flush_device()
        env.store.hold(puts=False, gets=True)
        req, hit = await open_request(env, p)
        load = await env.linker.load(req)
        assert load is not None
        with pytest.raises(KeyError):
            await load.wait_layer(7)
        ready: list[int] = []

        async def waiter(layer: int) -> None:
            assert await load.wait_layer(layer)  # True: the layer's data landed
            ready.append(layer)

        # layers fed by each pool: KV 1, 3; draft 1 (rides with full layer 1); states 0, 2
        feeds = {"kv": {1, 3}, "draft": {1}, "mamba": {0, 2}}
        async with anyio.create_task_group() as tg:
            for layer in (0, 1, 2, 3):
                tg.start_soon(waiter, layer)
            await env.store.wait_held(3)  # one read per pool, all held
            for _ in range(20):
                await anyio.sleep(0)
            assert ready == []  # nothing landed yet
            held_pools = [call[0].split(":")[1] for call in env.store.keys["get"][-3:]]
            landed: set[str] = set()
            for pool in held_pools:  # let the reads through one pool at a time
                env.store.release(1)
                landed.add(pool)
                done = set().union(*(feeds[p] for p in landed))
                # a layer is ready exactly when every pool feeding it has landed
                expected = {layer for layer in done
                            if all(p in landed for p, ls in feeds.items() if layer in ls)}
                with anyio.fail_after(5):
                    while set(ready) != expected:
                        await anyio.sleep(0.001)
                for _ in range(20):
                    await anyio.sleep(0)
                assert set(ready) == expected, (pool, ready)
        assert sorted(ready) == [0, 1, 2, 3]
        assert await env.linker.commit(load) == hit.store_tokens == 40
        assert env.content.prefix_problems(env.linker, req) == []
        await env.linker.release(req)


@pytest.mark.parametrize("failure", ["removed", "failed_reads"])
async def test_wait_layer_never_hangs_when_the_load_fails(failure: str) -> None:
    p = prompt(41, seed=11)
    async with harness() as env:
        await donate(env, p)
        env.linker.flush_device()
        req, hit = await open_request(env, p)
        assert hit.store_tokens == 40
        if failure == "removed":  # vanished between lookup and load
            await env.inner.remove([okey(p, 5, PoolKind.FULL), okey(p, 2, PoolKind.DRAFT)])
        else:
            env.store.fail_gets = True
        load = await env.linker.load(req)
        assert load is not None
        with anyio.fail_after(5):
            landed = [await load.wait_layer(layer) for layer in (0, 1, 2, 3)]
            assert await load.wait() is False
        # states (layers 0, 2) landed whole unless every get failed; KV/draft layers did not
        assert landed == ([True, False, True, False] if failure == "removed" else [False] * 4)
        assert await env.linker.commit(load) == 0  # dropped: recompute
        st = env.linker.statistics()
        assert (st.commits, st.dropped_loads, st.store_hit_tokens) == (0, 1, 0)
        assert req.prefix_tokens == 0
        assert await synthetic_prefill(env.linker, env.content, req) == 40  # recomputed
        await env.linker.release(req)


# ---- COMMIT ------------------------------------------------------------------------------------


async def test_concurrent_restores_of_one_prefix_free_the_loser_once() -> None:
    p = prompt(49, seed=12)
    async with harness(slots=6) as env:
        await donate(env, p)
        env.linker.flush_device()
        mamba = env.pools.mamba
        assert mamba is not None
        a, ha = await open_request(env, p)
        b, hb = await open_request(env, p)
        assert ha.store_tokens == hb.store_tokens == 48
        la, lb = await env.linker.load(a), await env.linker.load(b)
        assert la is not None and lb is not None and la.slot != lb.slot
        assert mamba.num_free == 4 and env.pools.kv.num_free_pages == 64 - 24
        assert await env.linker.commit(la) == 48
        assert await env.linker.commit(lb) == 48
        # the second's rows and slot went back, exactly once
        assert env.pools.kv.num_free_pages == 64 - 12
        assert mamba.num_free == 5
        assert lb.slot is not None and not mamba.slots.is_allocated(lb.slot)
        assert a.node is b.node and a.state_source == b.state_source == la.slot
        # copy-on-write: each working state starts as the node's state, in its own slot
        key = page_keys(p, P, a.seed, max_pages=12)[-1]
        wa, wb = env.linker.working_slot(a), env.linker.working_slot(b)
        assert len({wa, wb, la.slot}) == 3
        assert env.content.state_matches(key, wa) and env.content.state_matches(key, wb)
        for t in mamba.tensors():
            t[wa] += 1  # the forward writes its own state
        assert la.slot is not None and env.content.state_matches(key, la.slot)
        assert env.content.prefix_problems(env.linker, a) == []
        await env.linker.release(a)
        await env.linker.release(b)
        env.linker.flush_device()
        s = mamba.slots.statistics()
        assert s.free == s.capacity and s.allocs == s.frees  # never one more free


async def test_device_insert_between_load_and_commit_wins() -> None:
    """Another request computes and inserts the prefix while this one restores it: the restore
    keeps nothing of its own (rows and slot freed once) and stands on the device's node."""
    p = prompt(49, seed=13)
    async with harness() as env:
        await donate(env, p)
        env.linker.flush_device()
        mamba = env.pools.mamba
        assert mamba is not None
        req, _ = await open_request(env, p)
        load = await env.linker.load(req)
        assert load is not None
        other, _ = await open_request(env, p)  # never loads: computes on the device
        assert await synthetic_prefill(env.linker, env.content, other) == 48
        await env.linker.release(other)
        free = (env.pools.kv.num_free_pages, mamba.num_free)
        assert await env.linker.commit(load) == 48
        assert (env.pools.kv.num_free_pages, mamba.num_free) == (free[0] + 12, free[1] + 1)
        assert req.node is other.node
        assert env.content.prefix_problems(env.linker, req) == []
        await env.linker.release(req)


async def test_commit_drops_corrupt_data_and_the_request_recomputes() -> None:
    p = prompt(49, seed=14)
    inner = EmbeddedStore(8 << 20)
    async with harness(inner=inner) as env:
        await donate(env, p)
    corrupt = FaultPlan(corrupt=1.0)
    async with harness(inner=inner, wrap=lambda s: FaultyStore(s, corrupt, seed=3)) as env:
        req, hit = await open_request(env, p)
        assert hit.store_tokens == 48
        load = await env.linker.load(req)
        assert load is not None
        assert await env.linker.commit(load) == 0
        st = env.linker.statistics()
        assert (st.commits, st.dropped_loads, st.store_hit_tokens) == (0, 1, 0)
        assert st.verify_failures > 0 and st.verifications >= st.verify_failures
        assert sum(a.verify_failures for a in env.linker.pool_statistics().values()) > 0
        assert await synthetic_prefill(env.linker, env.content, req) == 48
        assert env.content.prefix_problems(env.linker, req) == []
        await env.linker.release(req)


async def test_commit_drops_a_load_whose_key_vanished_after_lookup() -> None:
    p = prompt(49, seed=15)
    async with harness() as env:
        await donate(env, p)
        env.linker.flush_device()
        req, hit = await open_request(env, p)
        assert hit.store_tokens == 48
        await env.inner.remove([okey(p, 11, PoolKind.MAMBA)])
        load = await env.linker.load(req)
        assert load is not None
        assert await env.linker.commit(load) == 0
        st = env.linker.statistics()
        assert (st.commits, st.dropped_loads, st.verify_failures) == (0, 1, 0)
        assert env.linker.pool_statistics()["mamba"].load_misses == 1
        await env.linker.release(req)


async def test_commit_refuses_after_the_request_took_rows_or_a_working_state() -> None:
    p = prompt(41, seed=16)
    async with harness() as env:
        await donate(env, p)
        env.linker.flush_device()
        req, _ = await open_request(env, p)
        load = await env.linker.load(req)
        assert load is not None
        env.linker.working_slot(req)
        with pytest.raises(PhaseError):
            await env.linker.commit(load)  # the working state would miss the prefix's state
        await env.linker.release(req)  # aborts the load

        req, _ = await open_request(env, p)
        load = await env.linker.load(req)
        assert load is not None
        env.linker.extend(req, len(p))
        with pytest.raises(PhaseError):
            await env.linker.commit(load)
        await env.linker.abort(load)
        await env.linker.release(req)
        assert env.linker.statistics().aborts == 2


# ---- ABORT -------------------------------------------------------------------------------------


async def test_abort_releases_the_load_only_before_insert() -> None:
    p = prompt(41, seed=17)
    async with harness() as env:
        await donate(env, p)
        env.linker.flush_device()
        free = env.pools.kv.num_free_pages
        req, _ = await open_request(env, p)
        load = await env.linker.load(req)
        assert load is not None
        await env.linker.abort(load)
        assert env.pools.kv.num_free_pages == free
        with pytest.raises(PhaseError):
            await env.linker.commit(load)
        with pytest.raises(PhaseError):
            await env.linker.abort(load)
        assert await synthetic_prefill(env.linker, env.content, req) == 40
        await env.linker.release(req)
        await env.linker.drain()
        env.linker.flush_device()

        req, _ = await open_request(env, p)
        load = await env.linker.load(req)
        assert load is not None and await env.linker.commit(load) == 40
        with pytest.raises(PhaseError):
            await env.linker.abort(load)  # inserted: the tree owns it now
        await env.linker.release(req)
        assert env.linker.statistics().aborts == 1


# ---- OFFLOAD -----------------------------------------------------------------------------------


async def test_offload_writes_ancestors_first_and_locks_until_acknowledged() -> None:
    p = prompt(49, seed=18)
    # one stage (in two stages the locks drop at the copy: tests/runtime/test_two_stage_linker.py)
    async with harness(config=LinkerConfig(staging_bytes_per_pool=SMALL, two_stage_offload=False)) as env:
        await donate(env, p[:17], offload=False)  # A = pages 0..3, not stored
        env.store.hold(puts=True)
        req, hit = await open_request(env, p)
        assert hit.device_tokens == 16
        assert await synthetic_prefill(env.linker, env.content, req) == 48
        node_b = req.node
        node_a = node_b.parent
        assert node_a is not None and node_a.end_page == 4
        await env.linker.release(req)
        await env.store.wait_held(3)
        # the offload holds both nodes until the store answers
        assert set(env.linker.tree.tree.locked_nodes()) == {node_a, node_b}
        assert set(node_b.pending) == ALL_POOLS and set(node_a.pending) == ALL_POOLS
        puts = {call[0].split(":")[1]: call for call in env.store.keys["put"]}
        assert puts["kv"] == [okey(p, i, PoolKind.FULL) for i in range(12)]
        assert puts["draft"] == [okey(p, i, PoolKind.DRAFT) for i in range(12)]
        assert puts["mamba"] == [okey(p, 3, PoolKind.MAMBA), okey(p, 11, PoolKind.MAMBA)]
        env.store.open()
        await env.linker.drain()
        assert env.linker.tree.tree.locked_nodes() == []
        assert node_a.stored == node_b.stored == ALL_POOLS
        assert not node_a.pending and not node_b.pending


async def test_offloads_get_exactly_one_result_each_in_fifo_order() -> None:
    async with harness() as env:
        order: dict[PoolKind, list[int]] = {k: [] for k in LAYOUT.pools}
        submitted: dict[PoolKind, list[int]] = {k: [] for k in LAYOUT.pools}
        for kind, actor in env.linker.actors.items():
            original = actor.submit_offload

            async def submit(job: Any, kind: PoolKind = kind, original: Any = original) -> None:
                jid = len(submitted[kind])
                submitted[kind].append(jid)
                settle_set, settle_fail = job.completion.set, job.completion.fail

                def on_set(value: Any, jid: int = jid) -> None:
                    order[kind].append(jid)
                    settle_set(value)

                def on_fail(error: BaseException, jid: int = jid) -> None:
                    order[kind].append(jid)
                    settle_fail(error)

                job.completion.set, job.completion.fail = on_set, on_fail
                await original(job)

            actor.submit_offload = submit  # type: ignore[method-assign]
        env.store.hold(puts=True)
        prompts = [prompt(17, seed=100 + i) for i in range(4)]
        for tokens in prompts:
            req, _ = await open_request(env, tokens)
            await synthetic_prefill(env.linker, env.content, req)
            await env.linker.release(req)
        await env.store.wait_held(3)
        while env.store.held:
            env.store.release(1)
            await anyio.sleep(0.001)
        env.store.open()
        await env.linker.drain()
        for kind in LAYOUT.pools:
            assert order[kind] == submitted[kind] == [0, 1, 2, 3]
            q = env.linker.pool_statistics()[kind.value].offload_queue
            assert (q.completed, q.failed, q.depth) == (4, 0, 0)
        kv_calls = [c for c in env.store.keys["put"] if ":kv:" in c[0]]
        assert kv_calls == [[okey(t, i, PoolKind.FULL) for i in range(4)] for t in prompts]
        assert env.linker.statistics().offloads == 4


async def test_an_offload_failure_never_clears_an_earlier_success() -> None:
    p = prompt(57, seed=19)
    async with harness() as env:
        await donate(env, p[:17])  # A: pages 0..3, stored
        tree = env.linker.tree.tree
        a = next(iter(tree.root.children.values()))
        assert a.stored == ALL_POOLS

        env.store.fail_puts = True
        await donate(env, p[:33])  # B: pages 4..7, fails
        b = next(iter(a.children.values()))
        assert b.stored == set() and not b.pending
        assert a.stored == ALL_POOLS
        assert env.linker.statistics().offload_failures == 1  # one per offload

        env.store.fail_puts = ":mamba:"  # C: pages 8..11; retries B; only states fail
        n_calls = len(env.store.keys["put"])
        await donate(env, p[:49])
        c = next(iter(b.children.values()))
        retried = [k for call in env.store.keys["put"][n_calls:] for k in call]
        assert not any(okey(p, i, kind) in retried for i in range(4) for kind in LAYOUT.pools)
        assert b.stored == c.stored == {PoolKind.FULL, PoolKind.DRAFT}
        assert a.stored == ALL_POOLS
        assert env.linker.statistics().offload_failures == 2

        env.store.fail_puts = False  # D: pages 12..13; only the missing states are retried
        n_calls = len(env.store.keys["put"])
        await donate(env, p)
        calls = {call[0].split(":")[1]: call for call in env.store.keys["put"][n_calls:]}
        assert calls["mamba"] == [okey(p, i, PoolKind.MAMBA) for i in (7, 11, 13)]
        assert calls["kv"] == [okey(p, i, PoolKind.FULL) for i in (12, 13)]
        assert a.stored == b.stored == c.stored == ALL_POOLS


async def test_a_restored_prefix_is_not_written_back() -> None:
    p = prompt(49, seed=20)
    async with harness() as env:
        await donate(env, p[:17])
        env.linker.flush_device()
        n_calls = len(env.store.keys["put"])
        await donate(env, p)  # restores 16 from the store, computes 16..48
        written = [k for call in env.store.keys["put"][n_calls:] for k in call]
        assert written and not any(okey(p, i, PoolKind.FULL) in written for i in range(4))
        assert env.linker.pool_statistics()["kv"].objects_already_stored == 0


async def test_a_replicated_pool_is_written_by_rank_zero_only() -> None:
    p = prompt(49, seed=21)
    inner = EmbeddedStore(8 << 20)
    ranks = [small_hybrid_layout(tp_rank=r, tp_size=2, replicated=["mamba"]) for r in (1, 0)]
    for layout in ranks:  # rank 1 first: it must not write the state even when it is first
        async with harness(layout=layout, inner=inner) as env:
            assert await donate(env, p) == 48
            node = next(iter(env.linker.tree.tree.root.children.values()))
            # the owner writes; another rank checks the store and marks only what is there:
            # rank 1 runs first, so rank 0's state is not in the store yet
            assert node.stored == (ALL_POOLS - {PoolKind.MAMBA} if layout.tp_rank else ALL_POOLS)
            puts = env.store.put_keys()
            mamba_puts = [k for k in puts if ":mamba:" in k]
            assert mamba_puts == ([] if layout.tp_rank else [okey(p, 11, PoolKind.MAMBA, layout)])
            assert all(k.endswith(f":tp{layout.tp_rank}") for k in puts if ":mamba:" not in k)
    assert okey(p, 11, PoolKind.MAMBA, ranks[0]).endswith(":mamba:rep")
    assert inner.statistics().puts == 2 * (12 + 12) + 1
    # now the state is there: rank 1, computing the prompt again, finds it and marks it stored
    async with harness(layout=ranks[0], inner=inner,
                       config=LinkerConfig(staging_bytes_per_pool=SMALL, store_lookup=False)) as env:
        assert await donate(env, p) == 48
        node = next(iter(env.linker.tree.tree.root.children.values()))
        assert node.stored == ALL_POOLS
        assert env.linker.statistics().offloads_verified_replicas == 1
    async with harness(layout=ranks[0], inner=inner) as env:  # rank 1 restores rank 0's state
        req, hit = await open_request(env, p)
        assert hit.store_tokens == 48
        load = await env.linker.load(req)
        assert load is not None and await env.linker.commit(load) == 48
        assert env.content.prefix_problems(env.linker, req) == []
        await env.linker.release(req)


# ---- TOUCH -------------------------------------------------------------------------------------


async def test_touch_once_per_interval_with_every_page_and_the_boundary_state() -> None:
    p = prompt(50, seed=22)
    # the device hits' TOUCH alone (the offload's TOUCH of its path: tests/runtime/test_touch_on_offload.py)
    async with harness(config=LinkerConfig(touch_interval_s=5.0, touch_on_offload=False,
                                           staging_bytes_per_pool=SMALL)) as env:
        await donate(env, p[:17])  # A: 0..16
        await donate(env, p[:49])  # B: 16..48; its lookup hit A: A's first touch
        await wait_until(lambda: env.store.completed["touch"] == 1)
        tree = env.linker.tree.tree
        a = next(iter(tree.root.children.values()))
        b = next(iter(a.children.values()))
        keys_a = ([okey(p, i, PoolKind.FULL) for i in range(4)]
                  + [okey(p, i, PoolKind.DRAFT) for i in range(4)] + [okey(p, 3, PoolKind.MAMBA)])
        keys_b = ([okey(p, i, PoolKind.FULL) for i in range(12)]
                  + [okey(p, i, PoolKind.DRAFT) for i in range(12)]
                  + [okey(p, 11, PoolKind.MAMBA)])  # the boundary's state only, not 16's
        assert sorted(env.store.touched_keys()[0]) == sorted(keys_a)

        async def hit(tokens: np.ndarray) -> None:
            req, res = await open_request(env, tokens)
            assert res.device_tokens == (len(tokens) - 1) // 8 * 8
            await env.linker.release(req)

        await hit(p)
        await wait_until(lambda: env.store.completed["touch"] == 2)
        assert sorted(env.store.touched_keys()[1]) == sorted(keys_b)
        await hit(p)
        await hit(p)
        await hit(p[:20])
        for _ in range(10):
            await anyio.sleep(0)
        assert env.store.calls["touch"] == 2  # both nodes are within their interval
        b.last_touch -= 10.0  # the interval passed for B, then for A
        await hit(p)
        await hit(p[:20])
        a.last_touch -= 10.0
        await hit(p[:20])
        # B's and A's touches may share one batched call (TOUCH coalescing)
        want = set(keys_b) | set(keys_a)
        await wait_until(lambda: {k for c in env.store.touched_keys()[2:] for k in c} == want)
        assert env.store.completed["touch"] in (3, 4)
        st = env.linker.statistics()
        assert (st.touches, st.touch_keys) == (4, 2 * 25 + 2 * 9)
        assert st.touch_calls == env.store.calls["touch"]
        assert env.inner.statistics().touches == env.linker.toucher.keys_sent


# ---- cancellation and close --------------------------------------------------------------------


@pytest.mark.parametrize("waiter", ["wait", "wait_layer", "commit"])
async def test_a_cancelled_waiter_leaks_nothing_after_release(waiter: str) -> None:
    p = prompt(41, seed=23)
    async with harness() as env:
        await donate(env, p)
        env.linker.flush_device()
        env.store.hold(puts=False, gets=True)
        req, _ = await open_request(env, p)
        load = await env.linker.load(req)
        assert load is not None

        async def wait() -> None:
            if waiter == "wait":
                await load.wait()
            elif waiter == "wait_layer":
                await load.wait_layer(3)
            else:
                await env.linker.commit(load)
            raise AssertionError("the waiter should have been cancelled")

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await env.store.wait_held(3)
            tg.cancel_scope.cancel()
        released = anyio.Event()

        async def release() -> None:
            await env.linker.release(req)
            released.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(release)
            for _ in range(10):
                await anyio.sleep(0)
            assert not released.is_set()  # release waits for the reads in flight
            env.store.open()
        assert load.finished and env.linker.statistics().aborts == 1


async def test_close_drains_offloads_before_releasing_locks() -> None:
    p = prompt(49, seed=24)
    async with harness() as env:
        lk = env.linker
        env.store.hold(puts=True)
        req, _ = await open_request(env, p)
        await synthetic_prefill(lk, env.content, req)  # the request stays open
        await env.store.wait_held(3)
        seen: list[tuple[str, int]] = []
        release = lk.release

        async def recording_release(r: Request) -> None:
            seen.append((r.id, env.store.completed["put"]))
            await release(r)

        lk.release = recording_release  # type: ignore[method-assign, assignment]
        closed = anyio.Event()

        async def close() -> None:
            await lk.close()
            closed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            for _ in range(10):
                await anyio.sleep(0)
            assert not closed.is_set() and not req.released and seen == []
            env.store.open()
        assert seen == [(req.id, 3)]  # released only after every put was answered
        assert req.released
        node = next(iter(lk.tree.tree.root.children.values()))
        assert node.stored == ALL_POOLS
        with pytest.raises(PhaseError):
            lk.request("late", p)


async def test_a_second_load_after_commit_is_a_plain_miss() -> None:
    """The store probe is relative to the prefix at lookup: once COMMIT (or an insert) moved
    the prefix, a further load must not chain the old store keys onto the new prefix."""
    p = prompt(49, seed=25)
    async with harness() as env:
        await donate(env, p[:17])  # states at 16 and 48 in the store
        await donate(env, p)
        env.linker.flush_device()
        req, hit = await open_request(env, p)
        assert hit.store_tokens == 48
        load = await env.linker.load(req)
        assert load is not None and await env.linker.commit(load) == 48
        assert await env.linker.load(req) is None
        assert req.prefix_tokens == 48
        assert env.linker.tree.tree.statistics().pages == 12
        await env.linker.release(req)

        req, hit = await open_request(env, p[:17])  # the device has no state at 16: the store
        assert (hit.device_tokens, hit.store_tokens) == (0, 16)
        await synthetic_prefill(env.linker, env.content, req)  # recompute, insert at 16
        assert await env.linker.load(req) is None
        await env.linker.release(req)
