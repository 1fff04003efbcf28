"""The host memory two-stage frames are cut from (``runtime/dataplane/frame_region.py``): blocks
touched and registered once, an extent per job given back once nothing reads it, never more
blocks than the host staging budget, fresh memory (counted) past it. Real CPU pools of 1, 2
and 8 layers, pages of 1 and 64 rows, the embedded store behind a gate."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
import torch
from test_frame_restore import gated
from test_host_staging import SHAPES, Pools, kv, staged

from hylinker.components.layout import PoolKind
from hylinker.runtime.dataplane.frame_region import ALIGN, FrameRegion
from hylinker.stores.base import Outcome
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.worker_threads import WorkerThreads
from hylinker.testing.fakes import GatedStore


class RegisteringStore(EmbeddedStore):
    """The embedded store, remembering what was registered and whether each put read from it."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.regions: list[tuple[int, int]] = []
        self.put_from_registered: list[bool] = []

    def register(self, region: torch.Tensor) -> None:
        super().register(region)
        self.regions.append((region.data_ptr(), region.numel()))

    def _inside(self, t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() and t.data_ptr() + t.numel() <= a + n for a, n in self.regions)

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        self.put_from_registered += [self._inside(b) for b in buffers]
        return await super().put(keys, buffers)

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        self.put_from_registered += [all(self._inside(p) for p in ps) for ps in parts]
        return await super().put_sealed(keys, parts)


class Limit:
    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


async def test_extents_are_reused_merged_and_the_limit_sends_the_rest_to_fresh_memory() -> None:
    threads = WorkerThreads(1, "test-region")
    u = 64 * ALIGN
    try:
        limit = Limit(4 * u)
        region = FrameRegion(EmbeddedStore(1 << 20), threads, limit, block_bytes=4 * u)
        a, b, c = [await region.take(u - 10) for _ in range(3)]  # rounded up to whole extents of u
        assert region.growths == 1 and region.reserved == 4 * u and region.taken_bytes == 3 * u
        assert b.data_ptr() == a.data_ptr() + u and c.data_ptr() == b.data_ptr() + u and a.numel() == u - 10
        region.give(b)
        region.give(a)  # merged with b's extent: two in one piece again
        two = await region.take(2 * u)
        assert two.data_ptr() == a.data_ptr() and two.numel() == 2 * u
        assert region.outside == 0
        fresh = await region.take(2 * u)  # one extent free, the limit reached: fresh memory
        assert region.outside == 1 and region.growths == 1 and region.taken_bytes == 3 * u
        region.give(fresh)  # not the region's: ignored
        limit.value = 8 * u  # a larger budget lets it grow again
        grown = await region.take(2 * u)
        assert region.growths == 2 and region.reserved == 8 * u
        for t in (two, c, grown):
            region.give(t)
        assert region.taken_bytes == 0
        assert all(blk.free_bytes == blk.memory.numel() and len(blk.starts) == 1 for blk in region.blocks)
    finally:
        threads.close()


@pytest.mark.parametrize(("layers", "page"), SHAPES)
async def test_frames_come_from_registered_memory_and_go_back_when_read_no_more(layers: int, page: int) -> None:
    """Every put of a draining frame reads registered memory; an extent a load pins stays
    taken after the store answered, and goes back at the last unpin."""
    pools = Pools(layers, page)
    inner = RegisteringStore(64 << 20)
    store = GatedStore(inner)
    before = [pools.page_bytes(p) for p in range(3)]
    async with gated(pools, store, staged()) as dp:
        region = dp.host_staging.region if dp.host_staging is not None else None
        assert region is not None
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a", "b", "c"], pools, [0, 1, 2])])
        with anyio.fail_after(10):
            await ticket.copied()
        assert region.taken_bytes > 0 and region.growths >= 1
        back = await dp.load([kv(["a", "b", "c"], pools, [5, 6, 7])])
        with anyio.fail_after(10):
            assert (await back.wait()).ok
        store.open()
        with anyio.fail_after(10):
            assert (await ticket.wait()).ok
        assert inner.put_from_registered and all(inner.put_from_registered)
        assert region.outside == 0
        for _ in range(3):  # the same extents serve the next jobs: no new block
            grown = region.growths
            t = await dp.offload([kv([f"n{_}a", f"n{_}b"], pools, [3, 4])])
            with anyio.fail_after(10):
                assert (await t.wait()).ok
            assert region.growths == grown
        assert region.taken_bytes == 0
    for i, p in enumerate((5, 6, 7)):
        for want, got in zip(before[i], pools.page_bytes(p), strict=True):
            assert torch.equal(want, got)


async def test_a_pinned_frame_keeps_its_extent_until_the_last_unpin() -> None:
    pools = Pools(2, 64)
    store = GatedStore(EmbeddedStore(64 << 20))
    async with gated(pools, store, staged()) as dp:
        region = dp.host_staging.region if dp.host_staging is not None else None
        index = dp.actors[PoolKind.FULL].frames
        assert region is not None and index is not None
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a", "b"], pools, [0, 1])])
        with anyio.fail_after(10):
            await ticket.copied()
        pinned = index.pin(["a"])
        taken = region.taken_bytes
        store.open()
        with anyio.fail_after(10):
            assert (await ticket.wait()).ok
        assert region.taken_bytes == taken > 0  # still read: not given back
        assert not index.holds("a")
        for _, frames, _ in pinned:
            index.unpin(frames)
        assert region.taken_bytes < taken  # the KV frames went back at the last unpin


async def test_past_the_limit_frames_are_fresh_memory_counted_and_still_exact() -> None:
    """The region may not grow past what the first job took (its limit): the second job,
    copied while the first's frames are held, gets fresh memory, counted; both restore exactly."""
    pools = Pools(2, 64)
    store = GatedStore(EmbeddedStore(64 << 20))
    before = [pools.page_bytes(p) for p in range(2)]
    async with gated(pools, store, staged()) as dp:
        region = dp.host_staging.region if dp.host_staging is not None else None
        assert region is not None
        region.block_bytes = ALIGN  # grow by exactly what a job needs
        store.hold(puts=True)
        first = await dp.offload([kv(["a"], pools, [0])])
        with anyio.fail_after(10):
            await first.copied()
        region.limit = lambda: region.reserved  # no more growth
        second = await dp.offload([kv(["b"], pools, [1])])
        with anyio.fail_after(10):
            await second.copied()
        assert region.outside >= 1
        store.open()
        with anyio.fail_after(10):
            assert (await first.wait()).ok and (await second.wait()).ok
        back = await dp.load([kv(["a", "b"], pools, [5, 6])])
        with anyio.fail_after(10):
            assert (await back.wait()).ok
        assert region.taken_bytes == 0
        assert dp.host_staging is not None and dp.host_staging.figures()["host_staging_frames_outside"] == region.outside
    for i, p in enumerate((5, 6)):
        for want, got in zip(before[i], pools.page_bytes(p), strict=True):
            assert torch.equal(want, got)
