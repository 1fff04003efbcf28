"""Backpressure (docs/design/phases.md §2, OFFLOAD).

1. The MAMBA rule: a checkpoint stays locked until the store acknowledges its offload, so a
   store that drains slower than prefill donates checkpoints ends up holding every state slot
   in pending offloads, and allocation dies. The rule skips an offload that carries a state
   while queued states hold >= 3/4 of the pool. The job queues are made deeper than the pool
   here (a job can carry several states, so a job bound never protects the pool by itself).
2. The latency watermark: offloads are dropped while the store-latency EMA is above the high
   watermark, and resume only below the low one (hysteresis); both are counted.
"""

from __future__ import annotations

import math

import anyio
import attrs
import numpy as np

from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.runtime.linker.statistics import LinkerStatistics
from hylinker.runtime.linker.tree_writer import PoolExhaustedError
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import (
    FakeClock,
    GatedStore,
    attach_clock,
    small_hybrid_layout,
    synthetic_prefill,
)

LAYOUT = small_hybrid_layout()
SLOTS = 120
CONCURRENCY = 8
REQUESTS_PER_TASK = 25


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


@attrs.define
class Run:
    starved: list[BaseException]
    load_misses: int
    completed: int
    max_pending_states: int
    stats: LinkerStatistics | None = None


async def donate_concurrently(config: LinkerConfig) -> Run:
    """8 request tasks, each prefilling distinct prompts that donate one checkpoint, against a
    store that lets one put/get through every 20 ms."""
    pools = HybridPools(LAYOUT, kv_pages=4096, mamba_slots=SLOTS)
    store = GatedStore(EmbeddedStore(64 << 20), drain_interval_s=0.02)
    content = SyntheticContent(pools)
    run = Run([], 0, 0, 0)
    async with Linker(LAYOUT, pools, store, config) as lk:

        async def client(task: int) -> None:
            for i in range(REQUESTS_PER_TASK):
                req = lk.request(f"t{task}-{i}", prompt(17 + 8 * (i % 3), seed=task * 1000 + i))
                try:
                    await lk.lookup(req)
                    load = await lk.load(req)
                    if load is None and req.store_pages:
                        run.load_misses += 1
                    elif load is not None:
                        await lk.commit(load)
                    await synthetic_prefill(lk, content, req)
                except PoolExhaustedError as exc:
                    run.starved.append(exc)
                    return
                finally:
                    await lk.release(req)
                run.completed += 1
                pending = lk.pool_statistics()["mamba"].pending_states
                run.max_pending_states = max(run.max_pending_states, pending)
                await anyio.sleep(0)

        async with anyio.create_task_group() as tg:
            for task in range(CONCURRENCY):
                tg.start_soon(client, task)
        store.open()  # let the backlog drain
        await lk.drain()
        lk.check_idle()
        run.stats = lk.statistics()
    lk.check_idle()
    lk.flush_device()
    pools.check_idle()
    return run


async def test_without_the_mamba_rule_the_pool_starves() -> None:
    # one stage: a state stays pending until the store answers (two stages free it at the copy)
    run = await donate_concurrently(LinkerConfig(
        mamba_backpressure=False, queue_depth=1024, staging_bytes_per_pool=1 << 16, two_stage_offload=False))
    assert run.starved or run.load_misses, "pending offloads should have locked every state slot"
    assert all("mamba slot" in str(e) for e in run.starved)
    assert run.completed < CONCURRENCY * REQUESTS_PER_TASK
    assert run.stats is not None and run.stats.offloads_skipped_mamba == 0
    assert run.max_pending_states > 0.75 * SLOTS


async def test_in_two_stages_states_free_at_the_copy_and_the_pool_does_not_starve() -> None:
    """States restorable from their host-staging frames are not pending: no rule needed."""
    run = await donate_concurrently(LinkerConfig(
        mamba_backpressure=False, queue_depth=1024, staging_bytes_per_pool=1 << 16))
    assert run.starved == [] and run.load_misses == 0
    assert run.completed == CONCURRENCY * REQUESTS_PER_TASK
    assert run.max_pending_states < SLOTS


async def test_with_the_mamba_rule_the_run_completes() -> None:
    run = await donate_concurrently(LinkerConfig(  # one stage, as above: states pending to the answer
        mamba_backpressure=True, queue_depth=1024, staging_bytes_per_pool=1 << 16, two_stage_offload=False))
    assert run.starved == [] and run.load_misses == 0
    assert run.completed == CONCURRENCY * REQUESTS_PER_TASK
    assert run.stats is not None and run.stats.offloads_skipped_mamba > 0
    assert run.max_pending_states < 0.75 * SLOTS
    assert run.stats.offloads == CONCURRENCY * REQUESTS_PER_TASK  # skipped ones counted too
    assert run.stats.inserts == CONCURRENCY * REQUESTS_PER_TASK


async def test_latency_watermark_drops_above_high_and_resumes_below_low() -> None:
    pools = HybridPools(LAYOUT, kv_pages=256, mamba_slots=16)
    inner = EmbeddedStore(16 << 20)
    store = GatedStore(FaultyStore(inner, FaultPlan(latency_ms=30)))  # every call takes 30 ms
    config = LinkerConfig(latency_high_ms=10.0, latency_low_ms=2.0, store_lookup=False,
                          staging_bytes_per_pool=1 << 16)
    clock = FakeClock()
    content = SyntheticContent(pools)
    p = prompt(33, seed=1)
    async with Linker(LAYOUT, pools, store, config) as lk:
        monitor = attach_clock(lk, clock)

        async def donate(tokens: np.ndarray, name: str) -> None:
            req = lk.request(name, tokens)
            await lk.lookup(req)
            await synthetic_prefill(lk, content, req)
            await lk.release(req)
            await lk.drain()

        await donate(prompt(17, seed=2), "r1")  # three puts of >= 30 ms: EMA >= 14.6 ms
        assert monitor.dropping and monitor.ema_ms > config.latency_high_ms
        puts = store.calls["put"]

        await donate(p[:17], "r2")  # dropped: nothing reaches the store
        assert store.calls["put"] == puts
        assert lk.statistics().offloads_dropped == 1
        node_r2 = lk.tree.tree.match(_keys(lk, p[:17])).node
        assert node_r2.stored == set() and node_r2.lock == 0  # dropped, not locked

        # while dropping, the EMA halves every second of (fake) clock time
        clock.advance(math.log2(monitor.ema_ms / 6.0))  # to ~6 ms: under high, above low
        assert config.latency_low_ms < monitor.ema_ms < config.latency_high_ms
        await donate(prompt(17, seed=3), "r3")
        assert lk.statistics().offloads_dropped == 2 and store.calls["put"] == puts

        clock.advance(math.log2(6.0 / 1.0))  # ~1 ms: below low, offloads resume
        assert not monitor.should_drop()
        await donate(p, "r4")  # writes r4's node and the dropped r2 node under it
        assert lk.statistics().offloads_dropped == 2
        assert store.calls["put"] == puts + 3
        kv_call = next(c for c in store.keys["put"][-3:] if ":kv:" in c[0])
        assert len(kv_call) == 8  # pages 0..3 (r2, dropped earlier) first, then r4's 4..7
        node_r4 = lk.tree.tree.match(_keys(lk, p)).node
        assert node_r2.stored == node_r4.stored == set(LAYOUT.pools)
        st = lk.statistics()
        assert st.offloads == 4 and st.offloads_dropped == 2 and st.offload_failures == 0
        lk.check_idle()
    lk.flush_device()
    pools.check_idle()
    await inner.close()


def _keys(lk: Linker, tokens: np.ndarray) -> list[bytes]:
    from hylinker.components.keys import page_keys

    return page_keys(tokens, LAYOUT.page_size, lk.tree.tree.seed_key)
