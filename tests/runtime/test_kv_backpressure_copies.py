"""The KV backpressure rule in two stages (docs/design/phases.md §3, `offloads_waited_kv`): an
offload the rule would skip while copies into host staging are in flight waits for them instead
(the store's pace does not matter, the locks last one copy), and the rule still keeps `extend`
alive when the copies themselves do not finish (then it skips, counted). Real objects:
HybridPools, the embedded store behind a gate, device fences that complete when told."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator

import anyio
import attrs
import numpy as np
import pytest

from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.runtime.linker.tree_writer import PoolExhaustedError
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import (
    FakeDeviceEvent,
    GatedStore,
    small_hybrid_layout,
    synthetic_prefill,
    wait_until,
)

LAYOUT = small_hybrid_layout()
PAGE = LAYOUT.page_size
_ids = itertools.count()
CONFIG = LinkerConfig(staging_bytes_per_pool=1 << 16, resilience=None, mamba_backpressure=False,
                      close_timeout_s=0.05)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


@attrs.define
class Env:
    linker: Linker
    store: GatedStore
    content: SyntheticContent
    fences: list[FakeDeviceEvent]


@contextlib.asynccontextmanager
async def harness(config: LinkerConfig, *, kv_pages: int = 64) -> AsyncIterator[Env]:
    store = GatedStore(EmbeddedStore(8 << 20))
    pools = HybridPools(LAYOUT, kv_pages=kv_pages, mamba_slots=16)
    linker = Linker(LAYOUT, pools, store, config)
    env = Env(linker, store, SyntheticContent(pools), [])
    async with linker:
        try:
            yield env
        finally:  # a failing test never waits for a fence or at the gate in close()
            for fence in env.fences:
                fence.set()
            store.open()
        await linker.drain()
        linker.check_idle()
    linker.flush_device()
    pools.check_idle()


async def prefill(env: Env, tokens: np.ndarray, *, held: bool) -> int:
    """One request: look up, prefill, insert (its offload's copy waits for a fence that stays
    open until set when ``held``), release. Returns the inserted depth."""
    fence = FakeDeviceEvent(None if held else 0)
    env.fences.append(fence)
    req = env.linker.request(f"r{next(_ids)}", tokens)
    await env.linker.lookup(req)
    try:
        return await synthetic_prefill(env.linker, env.content, req, fence=fence)
    finally:
        await env.linker.release(req)


async def test_an_offload_past_the_copy_backlog_waits_for_the_copy_not_the_store() -> None:
    """A slow store (puts held) and a pool short of headroom: the second offload finds the
    first one's copy still in flight (its fence open) past the share, waits for it, and is sent
    once it ended: nothing skipped, both reach the store when it answers."""
    async with harness(attrs.evolve(CONFIG, kv_backpressure_wait_s=30.0)) as env:
        lk = env.linker
        env.store.hold(puts=True)
        holder = lk.request("holder", prompt(161, seed=1))
        await lk.lookup(holder)
        lk.extend(holder, 160)  # 40 of the 64 pages held by a running request: the reserve is 40
        assert await prefill(env, prompt(65, seed=2), held=True) == 64  # 16 pages, copy pending
        assert lk.offloads.locked_pages == 16 > CONFIG.kv_backpressure_share * 64
        done = anyio.Event()
        depth = [0]

        async def second() -> None:  # 8 pages: the last of the headroom
            depth[0] = await prefill(env, prompt(32, seed=3), held=False)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await wait_until(lambda: lk.statistics().offloads_waited_kv == 1)
            await anyio.sleep(0.05)
            assert not done.is_set()  # waits for the copy, not skipped
            env.fences[0].set()  # the first copy ends: its pages come back
            with anyio.fail_after(10):
                await done.wait()
        stats = lk.statistics()
        assert stats.offloads_skipped_kv == 0 and stats.offloads == 2
        env.store.open()
        await lk.drain()
        assert depth[0] > 0 and lk.statistics().stored_tokens == 64 + depth[0]
        await lk.release(holder)


@pytest.mark.parametrize("share", [1.0, LinkerConfig().kv_backpressure_share])
async def test_copies_that_do_not_finish_still_cannot_make_extend_fail(share: float) -> None:
    """Every copy waits on a fence that stays open: without the rule (share 1.0) the offloads'
    locks take the pool and extend fails; with it, an offload past the share waits its limit,
    then is skipped (counted), and every extend succeeds."""
    config = attrs.evolve(CONFIG, kv_backpressure_share=share, kv_backpressure_wait_s=0.02)
    failures = 0
    async with harness(config) as env:
        for i in range(12):
            try:
                await prefill(env, prompt(65, seed=100 + i), held=True)  # 16 pages each
            except PoolExhaustedError:
                failures += 1
        stats = env.linker.statistics()
    if share == 1.0:
        assert failures > 0 and stats.offloads_skipped_kv == 0
    else:
        assert failures == 0 and stats.offloads_skipped_kv > 0
        assert stats.offloads_waited_kv >= stats.offloads_skipped_kv  # each skip waited first
