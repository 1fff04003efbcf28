"""Device fences as awaitables (docs/design/phases.md §3): polling never blocks the event loop, a
failed fence is an error (FenceError), and an offload whose fence fails reports a failure and
unlocks what it locked."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pools import HybridPools
from hylinker.runtime.dataplane.events import DeviceEvent, FenceError, record_fence, wait_fence
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import (
    FakeDeviceEvent,
    GatedStore,
    small_hybrid_layout,
    synthetic_prefill,
)

LAYOUT = small_hybrid_layout()
CONFIG = LinkerConfig(staging_bytes_per_pool=1 << 16)


def test_fake_event_follows_the_protocol() -> None:
    ev = FakeDeviceEvent(polls=2)
    assert isinstance(ev, DeviceEvent)
    assert [ev.query(), ev.query(), ev.query()] == [False, False, True]
    never = FakeDeviceEvent(polls=None)
    assert not any(never.query() for _ in range(50))
    never.set()
    assert never.query() and never.done
    bad = FakeDeviceEvent(polls=0, error="ECC error")
    with pytest.raises(RuntimeError, match="ECC"):
        bad.query()
    with pytest.raises(ValueError):
        FakeDeviceEvent(polls=-1)


async def test_polling_a_fence_lets_other_tasks_run() -> None:
    ev = FakeDeviceEvent(polls=8)
    ticks = 0
    stop = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await wait_fence(ev)
        seen = ticks
        stop.set()
    assert ev.queries == 9
    assert seen > 0  # the loop kept serving while the fence was pending


async def test_a_fence_completes_when_set_from_another_task() -> None:
    ev = FakeDeviceEvent(polls=None)
    done = anyio.Event()

    async def waiter() -> None:
        await wait_fence(ev)
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        for _ in range(20):
            await anyio.sleep(0)
        assert not done.is_set()
        ev.set()
    assert done.is_set()
    await wait_fence(None)  # CPU work: already complete


async def test_a_failing_fence_is_an_error_not_a_miss() -> None:
    with pytest.raises(FenceError, match="device fence failed"):
        await wait_fence(FakeDeviceEvent(error="illegal address"))
    late = FakeDeviceEvent(polls=None)

    async def fail_soon() -> None:
        await anyio.sleep(0.001)
        late.fail(RuntimeError("launch failure"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(fail_soon)
        with pytest.raises(FenceError) as info:
            await wait_fence(late)
    assert isinstance(info.value.__cause__, RuntimeError)
    # a fence that never completes is an error too, not a stalled pool
    with pytest.raises(FenceError, match="still pending"):
        await wait_fence(FakeDeviceEvent(polls=None), timeout_s=0.01)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


async def test_an_offload_waits_for_its_fence() -> None:
    pools = HybridPools(LAYOUT, kv_pages=64, mamba_slots=8)
    store = GatedStore(EmbeddedStore(8 << 20))
    content = SyntheticContent(pools)
    fence = FakeDeviceEvent(polls=None)
    async with Linker(LAYOUT, pools, store, CONFIG) as lk:
        req = lk.request("a", prompt(17, 1))
        await lk.lookup(req)
        await synthetic_prefill(lk, content, req, fence=fence)
        await lk.release(req)
        for _ in range(50):
            await anyio.sleep(0)
        assert store.calls["put"] == 0 and fence.queries > 0  # the forward is not done yet
        node = next(iter(lk.tree.tree.root.children.values()))
        assert node.lock > 0 and set(node.pending) == set(LAYOUT.pools)
        fence.set()
        await lk.drain()
        assert store.calls["put"] == 3 and node.stored == set(LAYOUT.pools) and node.lock == 0
        lk.check_idle()
    lk.flush_device()
    pools.check_idle()


async def test_an_offload_with_a_failing_fence_reports_failure_and_unlocks() -> None:
    pools = HybridPools(LAYOUT, kv_pages=64, mamba_slots=8)
    store = GatedStore(EmbeddedStore(8 << 20))
    content = SyntheticContent(pools)
    p = prompt(33, 2)
    async with Linker(LAYOUT, pools, store, CONFIG) as lk:
        req = lk.request("a", p[:17])
        await lk.lookup(req)
        await synthetic_prefill(lk, content, req, fence=FakeDeviceEvent(polls=3, error="xid 79"))
        await lk.release(req)
        await lk.drain()
        node = next(iter(lk.tree.tree.root.children.values()))
        assert store.calls["put"] == 0  # nothing written from rows the device may not have
        assert node.lock == 0 and not node.pending and node.stored == set()
        assert lk.statistics().offload_failures == 1
        for stats in lk.pool_statistics().values():
            assert (stats.offload_queue.failed, stats.offload_queue.depth) == (1, 0)
        assert lk.pool_statistics()["mamba"].pending_states == 0
        lk.check_idle()

        req = lk.request("b", p)  # the next insert under it writes the node again
        await lk.lookup(req)
        await synthetic_prefill(lk, content, req)
        await lk.release(req)
        await lk.drain()
        assert node.stored == set(LAYOUT.pools)
        assert [len(c) for c in store.keys["put"] if ":kv:" in c[0]] == [8]
        assert lk.statistics().offload_failures == 1
        lk.check_idle()
    lk.flush_device()
    pools.check_idle()


def test_a_cpu_device_has_no_fence() -> None:
    assert record_fence(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_cuda_event_is_awaited_without_blocking() -> None:
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device)
    for _ in range(8):
        a = a @ a / 2048.0
    fence = record_fence(device)
    assert fence is not None and isinstance(fence, DeviceEvent)
    ticks = 0
    stop = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await wait_fence(fence)
        stop.set()
    assert fence.query()
    assert torch.isfinite(a).all()

    # an offload from device pools waits for the forward's event, then the data round-trips
    pools = HybridPools(LAYOUT, kv_pages=64, mamba_slots=8, device=device)
    store = EmbeddedStore(8 << 20)
    content_pools = pools
    content = SyntheticContent(content_pools)
    p = prompt(17, 3)
    async with Linker(LAYOUT, pools, store, CONFIG) as lk:
        req = lk.request("a", p)
        await lk.lookup(req)
        await synthetic_prefill(lk, content, req, fence=record_fence(device))
        await lk.release(req)
        await lk.drain()
        lk.flush_device()
        req = lk.request("b", p)
        hit = await lk.lookup(req)
        assert hit.store_tokens == 16
        load = await lk.load(req)
        assert load is not None and await lk.commit(load) == 16
        assert content.prefix_problems(lk, req) == []
        await lk.release(req)
        lk.check_idle()
    lk.flush_device()
    pools.check_idle()
    assert PoolKind.MAMBA in LAYOUT.pools

