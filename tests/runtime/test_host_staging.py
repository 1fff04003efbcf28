"""The two-stage offload on the data plane (docs/design/host-staging.md §4e): rows free once
copied into host staging, the store's answer still the ticket's, the byte budget, bad budgets,
failed puts and dropped frames. Real CPU pools of 1, 2 and 8 layers, pages of 1 and 64 rows."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view, state_view
from hylinker.runtime.dataplane.host_staging import HostStagingFullError, derive_budget
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.stores.base import Store
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.fakes import FakeDeviceCopies, FakeDeviceEvent, GatedStore

SHAPES = [(1, 1), (2, 64), (8, 64), (8, 1)]  # (KV layers, rows per page)


class Pools:
    """Host KV (``layers`` layers, ``page`` rows a page) and a state pool, random bytes."""

    def __init__(self, layers: int, page: int, pages: int = 8, slots: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.page = page
        self.k = [torch.randint(0, 256, (pages * page, 2, 8), generator=g, dtype=torch.uint8) for _ in range(layers)]
        self.v = [torch.randint(0, 256, (pages * page, 2, 8), generator=g, dtype=torch.uint8) for _ in range(layers)]
        self.conv = [torch.randint(0, 256, (1, slots, 3, 4), generator=g, dtype=torch.uint8)]
        self.temporal = torch.randint(0, 256, (1, slots, 2, 4), generator=g, dtype=torch.uint8)
        self.layer_ids = list(range(layers))

    def views(self) -> PoolSet:
        return PoolSet([kv_view(self.k, self.v, layer_ids=self.layer_ids, page_size=self.page),
                        state_view(self.conv, self.temporal, layer_ids=[len(self.layer_ids)])])

    def rows(self, page: int) -> torch.Tensor:
        return torch.arange(page * self.page, (page + 1) * self.page)

    def page_bytes(self, page: int) -> list[torch.Tensor]:
        r = self.rows(page)
        return [t[r].clone() for t in (*self.k, *self.v)]


def staged(budget: int | None = None, **kw: Any) -> DataPlaneConfig:
    return DataPlaneConfig(two_stage_offload=True, host_staging_bytes=budget, staging_bytes_per_pool=1 << 16, **kw)


@contextlib.asynccontextmanager
async def plane(pools: Pools, store: Store, config: DataPlaneConfig) -> AsyncIterator[DataPlane]:
    async with DataPlane(pools.views(), store, config, namespace=b"two-stage") as dp:
        yield dp
    assert dp.host_staging is None or dp.host_staging.used == 0, "budget bytes leaked"
    region = None if dp.host_staging is None else dp.host_staging.region
    assert region is None or region.taken_bytes == 0, "host staging extents never given back"


def kv(keys: list[str], pools: Pools, pages: list[int]) -> Transfer:
    return Transfer(PoolKind.FULL, keys, torch.stack([pools.rows(p) for p in pages]))


@pytest.mark.parametrize(("layers", "page"), SHAPES)
async def test_rows_are_free_once_copied_and_the_restore_is_byte_exact(layers: int, page: int) -> None:
    pools = Pools(layers, page)
    store = GatedStore(EmbeddedStore(64 << 20))
    before = [pools.page_bytes(p) for p in range(3)]
    async with plane(pools, store, staged()) as dp:
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a", "b", "c"], pools, [0, 1, 2]),
                                   Transfer(PoolKind.MAMBA, ["s"], [1])])
        with anyio.fail_after(10):
            await ticket.copied()  # stage 1 ended while the put is held at the gate
        await store.wait_held(1)
        assert not ticket.done and ticket.two_stage
        assert dp.host_staging is not None and dp.host_staging.used > 0
        state = [pools.conv[0][:, 1].clone(), pools.temporal[:, 1].clone()]
        for t in (*pools.k, *pools.v, *pools.conv, pools.temporal):  # the engine reuses the rows
            t.fill_(0xAB)
        store.open()
        outcome = await ticket.wait()
        assert outcome.ok and all(outcome.objects[PoolKind.FULL]) and outcome.objects[PoolKind.MAMBA] == [True]
        assert dp.host_staging.used == 0
        back = await dp.load([kv(["a", "b", "c"], pools, [5, 6, 7]), Transfer(PoolKind.MAMBA, ["s"], [3])])
        assert (await back.wait()).ok
    for i, p in enumerate((5, 6, 7)):
        for want, got in zip(before[i], pools.page_bytes(p), strict=True):
            assert torch.equal(want, got)  # the bytes of the offload's time, not the 0xAB after it
    assert torch.equal(state[0], pools.conv[0][:, 3]) and torch.equal(state[1], pools.temporal[:, 3])


async def test_one_stage_keeps_reading_until_the_store_answers() -> None:
    pools = Pools(2, 4)
    store = GatedStore(EmbeddedStore(8 << 20))
    async with plane(pools, store, DataPlaneConfig(staging_bytes_per_pool=1 << 16)) as dp:
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a"], pools, [0])])
        await store.wait_held(1)
        assert not ticket.two_stage and dp.host_staging is None
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await ticket.copied()
        store.open()
        assert (await ticket.wait()).ok
        await ticket.copied()


async def test_a_full_budget_refuses_and_counts_and_frees_when_the_store_answers() -> None:
    pools = Pools(2, 4)
    store = GatedStore(EmbeddedStore(8 << 20))
    probe = DataPlane(pools.views(), store, staged())
    one_page = probe.actors[PoolKind.FULL].drain.frame_bytes(1)
    smallest = one_page + probe.actors[PoolKind.MAMBA].drain.frame_bytes(1)
    async with plane(pools, store, staged(budget=2 * one_page + smallest)) as dp:
        store.hold(puts=True)
        first = await dp.offload([kv(["a", "b"], pools, [0, 1])])
        with anyio.fail_after(10):
            await first.copied()
        with pytest.raises(HostStagingFullError):
            dp.prepare_offload([kv(["c", "d"], pools, [2, 3])])
        assert dp.statistics().offloads_refused_staging == 1
        assert dp.statistics().offloads == 1  # the refused one was never submitted
        second = await dp.offload([kv(["c"], pools, [2])])  # what still fits is taken
        store.open()
        assert (await first.wait()).ok and (await second.wait()).ok
        assert dp.host_staging is not None and dp.host_staging.used == 0
        third = await dp.offload([kv(["c", "d"], pools, [2, 3])])  # room again
        assert (await third.wait()).ok


async def test_a_failed_put_ends_the_ticket_failed_and_releases_the_frames() -> None:
    pools = Pools(8, 1)
    store = GatedStore(EmbeddedStore(8 << 20))
    async with plane(pools, store, staged()) as dp:
        store.fail_puts = True
        ticket = await dp.offload([kv(["a", "b"], pools, [0, 1])])
        outcome = await ticket.wait()
        assert not outcome.ok and outcome.objects[PoolKind.FULL] == [False, False]
        assert dp.host_staging is not None and dp.host_staging.used == 0
        assert (await dp.exists({PoolKind.FULL: ["a", "b"]}))[PoolKind.FULL] == [False, False]


async def test_dropped_frames_end_failed_and_are_counted() -> None:
    pools = Pools(2, 64)
    store = GatedStore(EmbeddedStore(64 << 20))
    async with plane(pools, store, staged()) as dp:
        store.hold(puts=True)
        first = await dp.offload([kv(["a"], pools, [0])])
        second = await dp.offload([kv(["b", "c"], pools, [1, 2])])
        await store.wait_held(1)  # the first is at the store; the second waits in staging
        with anyio.fail_after(10):
            await second.copied()
        dp.drop_staged()
        store.open()
        assert (await first.wait()).ok
        out = await second.wait()
        assert not out.ok and out.objects[PoolKind.FULL] == [False, False]
        assert dp.host_staging is not None and dp.host_staging.dropped_objects == 2
        assert dp.host_staging.used == 0
        assert (await dp.exists({PoolKind.FULL: ["a", "b", "c"]}))[PoolKind.FULL] == [True, False, False]


@pytest.mark.parametrize("bad", [0, -1, 1.5, math.nan, True, "1G"])
def test_a_bad_budget_is_an_error_naming_the_field(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"DataPlaneConfig\.host_staging_bytes"):
        staged(budget=bad)
    with pytest.raises(ValueError, match=r"LinkerConfig\.host_staging_bytes"):
        LinkerConfig(host_staging_bytes=bad)


def test_a_budget_below_one_object_of_every_pool_or_above_the_host_is_refused() -> None:
    pools = Pools(2, 64)
    store = EmbeddedStore(8 << 20)
    with pytest.raises(ValueError, match="one object of every pool"):
        DataPlane(pools.views(), store, staged(budget=100))
    with pytest.raises(ValueError, match="physical memory"):
        staged(budget=1 << 62)


def test_the_default_budget_is_twice_the_pools_capped_and_at_least_one_offload() -> None:
    assert derive_budget(100, 10, physical=10_000) == 200
    assert derive_budget(100, 10, physical=400) == 100  # a quarter of the host
    assert derive_budget(100, 150, physical=400) == 150  # at least one object of every pool
    pools = Pools(2, 4)
    dp = DataPlane(pools.views(), EmbeddedStore(8 << 20), staged())
    assert dp.host_staging is not None
    views = pools.views()
    want = sum(2 * (v.capacity // v.unit) * dp.actors[k].arena.stride for k, v in views.items())
    assert dp.host_staging.capacity == min(want, derive_budget(want, 0))


async def test_on_a_device_pool_the_rows_are_free_only_once_the_device_copy_completed() -> None:
    pools = Pools(2, 4)
    store = GatedStore(EmbeddedStore(8 << 20))
    fake = FakeDeviceCopies()
    fence = FakeDeviceEvent(polls=None)
    before = pools.page_bytes(1)
    # at integrity "header" a device pool moves through host frames (at "checksum" it is summed
    # on the device, device_transfers.py, and stays one stage)
    async with DataPlane(pools.views(), store, staged(integrity="header"), copies={PoolKind.FULL: fake}) as dp:
        assert not dp.actors[PoolKind.FULL].device.takes(dp._jobs([kv(["x"], pools, [0])], None, "")[0][0][2])
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a"], pools, [1])], fence=fence)
        await anyio.sleep(0.02)
        assert fake.log == []  # the forward's fence first
        fence.set()
        with anyio.fail_after(5):
            while not fake.events:
                await anyio.sleep(0.001)
        await anyio.sleep(0.02)
        assert not ticket._copied.is_set()  # the copy into host frames has not completed
        assert store.calls["put"] == 0  # nothing sealed, nothing put
        fake.complete()
        with anyio.fail_after(5):
            await ticket.copied()
        for t in (*pools.k, *pools.v):
            t.fill_(0x5A)  # the rows are reused before the store answered
        store.open()
        with anyio.fail_after(5):
            assert (await ticket.wait()).ok
        back = await dp.load([kv(["a"], pools, [3])])
        fake.auto = True
        fake.complete()
        with anyio.fail_after(5):
            assert (await back.wait()).ok
    for want, got in zip(before, pools.page_bytes(3), strict=True):
        assert torch.equal(want, got)


async def test_a_failed_fence_fails_the_offload_and_copies_nothing() -> None:
    pools = Pools(1, 1)
    store = GatedStore(EmbeddedStore(8 << 20))
    fence = FakeDeviceEvent(polls=None)
    async with plane(pools, store, staged()) as dp:
        ticket = await dp.offload([kv(["a"], pools, [0])], fence=fence)
        fence.fail(RuntimeError("device lost"))
        with anyio.fail_after(5):
            out = await ticket.wait()
        await ticket.copied()  # ended: the rows are no longer read
        assert not out.ok and out.objects[PoolKind.FULL] == [False] and sum(out.faults.values()) == 1
        assert store.calls["put"] == 0
