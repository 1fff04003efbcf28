"""Restores from draining frames (docs/design/host-staging.md §4e): while a two-stage offload's
frames wait for the store, the probe finds them and a load copies them from there, verified and
pinned. Real CPU pools of 1, 2 and 8 layers, pages of 1 and 64 rows, an embedded store behind a
gate that holds puts (the frames stay draining)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import torch
from test_host_staging import SHAPES, Pools, kv, plane, staged

from hylinker.components.layout import PoolKind
from hylinker.runtime.dataplane.frame_index import FrameIndex
from hylinker.runtime.dataplane.host_staging import HostStaging
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer
from hylinker.stores import framing
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.fakes import FakeDeviceEvent, GatedStore


@contextlib.asynccontextmanager
async def gated(pools: Pools, store: GatedStore, config: DataPlaneConfig) -> AsyncIterator[DataPlane]:
    """:func:`plane`, its store's gate opened before it closes (a failing test never hangs there)."""
    async with plane(pools, store, config) as dp:
        try:
            yield dp
        finally:
            store.open()


def index_of(dp: DataPlane, pool: PoolKind = PoolKind.FULL) -> FrameIndex:
    index = dp.actors[pool].frames
    assert index is not None
    return index


@pytest.mark.parametrize("verify_all", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(("layers", "page"), SHAPES)
async def test_a_draining_object_is_found_and_restored_byte_exact_from_its_frame(
        layers: int, page: int, groups: int, verify_all: bool) -> None:
    """``verify_all``: a held load copies the frames into its private frames, verified there."""
    if groups > layers:
        pytest.skip("one layer: one group")
    pools = Pools(layers, page)
    store = GatedStore(EmbeddedStore(64 << 20))
    before = [pools.page_bytes(p) for p in range(3)]
    async with gated(pools, store, staged(layer_groups=groups)) as dp:
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a", "b", "c"], pools, [0, 1, 2])])
        with anyio.fail_after(10):
            await ticket.copied()
        for t in (*pools.k, *pools.v):  # the device reused the rows: only staging holds the bytes
            t.fill_(0xAB)
        present = await dp.exists({PoolKind.FULL: ["a", "b", "c", "d"]})
        assert present[PoolKind.FULL] == [True, True, True, False]
        back = await dp.load([kv(["a", "b", "c"], pools, [5, 6, 7])], verify_all=verify_all)
        with anyio.fail_after(10):
            assert (await back.wait()).ok
        assert back.from_staging == 3 * groups
        assert store.calls["get"] == 0  # nothing came from the store: it has nothing yet
        stats = dp.pool_statistics()["kv"]
        assert stats.staging_restores == 3 * groups and stats.objects_loaded == 3 * groups
        assert not ticket.done  # the put is still held: the frames were still draining
        store.open()
        assert (await ticket.wait()).ok
        assert len(index_of(dp)) == 0  # the store answered: the frames left the index
    for i, p in enumerate((5, 6, 7)):
        for want, got in zip(before[i], pools.page_bytes(p), strict=True):
            assert torch.equal(want, got)


async def test_a_load_takes_what_staging_holds_and_the_rest_from_the_store() -> None:
    pools = Pools(2, 64)
    store = GatedStore(EmbeddedStore(64 << 20))
    before = [pools.page_bytes(p) for p in range(2)]
    async with gated(pools, store, staged()) as dp:
        assert (await (await dp.offload([kv(["z"], pools, [0])])).wait()).ok  # stored
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a"], pools, [1])])
        with anyio.fail_after(10):
            await ticket.copied()
        back = await dp.load([kv(["z", "a", "missing"], pools, [4, 5, 6])])
        out = await back.wait()
        assert out.objects[PoolKind.FULL] == [True, True, False]
        assert dp.pool_statistics()["kv"].staging_restores == 1
        store.open()
        await ticket.wait()
    for want, got in zip(before[0], pools.page_bytes(4), strict=True):
        assert torch.equal(want, got)
    for want, got in zip(before[1], pools.page_bytes(5), strict=True):
        assert torch.equal(want, got)


@pytest.mark.parametrize("verify_all", [False, True])
@pytest.mark.parametrize(("layers", "page"), [(1, 1), (8, 64)])
async def test_a_frame_that_fails_verification_is_dropped_and_the_load_falls_back_to_the_store(
        layers: int, page: int, verify_all: bool) -> None:
    """``verify_all``: the held load fails whole (b is nowhere) and a later one reads a from the store."""
    pools = Pools(layers, page)
    store = GatedStore(EmbeddedStore(64 << 20))
    before = pools.page_bytes(0)
    async with gated(pools, store, staged()) as dp:
        assert (await (await dp.offload([kv(["a"], pools, [0])])).wait()).ok  # the store has a
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a", "b"], pools, [0, 1])])  # a again, and b: draining
        with anyio.fail_after(10):
            await ticket.copied()
        index = index_of(dp)
        for key in ("a", "b"):  # both frames are damaged in host memory
            ((frames, row),) = index._by_key[key]
            frames.grid[row, framing.HEADER_BYTES] ^= 0xFF
        back = await dp.load([kv(["a", "b"], pools, [4, 5])], verify_all=verify_all)
        out = await back.wait()
        # a: from the store, verified; b: the store has none yet, a miss (the caller recomputes)
        assert out.objects[PoolKind.FULL] == [True, False] and not out.ok
        stats = dp.pool_statistics()["kv"]
        assert stats.staging_verify_failures == 2 and stats.staging_restores == 0
        assert not index.holds("a") and not index.holds("b")  # never read again
        assert (await dp.exists({PoolKind.FULL: ["b"]}))[PoolKind.FULL] == [False]
        if verify_all:  # the failed held load wrote no row; a's own load lands it from the store
            assert (await (await dp.load([kv(["a"], pools, [4])], verify_all=True)).wait()).ok
        store.open()
        await ticket.wait()
    for want, got in zip(before, pools.page_bytes(4), strict=True):
        assert torch.equal(want, got)


async def test_a_pinned_frame_keeps_its_budget_bytes_until_the_last_reader_unpins() -> None:
    pools = Pools(2, 4)
    store = GatedStore(EmbeddedStore(8 << 20))
    async with gated(pools, store, staged()) as dp:
        staging = dp.host_staging
        assert staging is not None
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a", "b"], pools, [0, 1])])
        with anyio.fail_after(10):
            await ticket.copied()
        index = index_of(dp)
        first, second = index.pin(["a"]), index.pin(["a", "b"])
        frames = first[0][1]
        assert frames.readers == 3
        store.open()
        assert (await ticket.wait()).ok  # the store answered while readers hold the frames
        assert not index.holds("a") and frames.retired
        assert staging.used == dp.actors[PoolKind.FULL].drain.frame_bytes(2)  # not freed under them
        for _i, f, _row in first:
            index.unpin(f)
        assert staging.used > 0
        for _i, f, _row in second:
            index.unpin(f)
        assert staging.used == 0


async def test_a_copy_that_fails_releases_its_pins_and_the_load_fails_cleanly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pools = Pools(2, 64)
    store = GatedStore(EmbeddedStore(64 << 20))
    async with gated(pools, store, staged()) as dp:
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a"], pools, [0])])
        with anyio.fail_after(10):
            await ticket.copied()
        codec = dp.actors[PoolKind.FULL].arena.codecs[0]

        def broken(*_args: object, **_kw: object) -> None:
            raise RuntimeError("the copy was cut short")

        monkeypatch.setattr(codec, "scatter", broken)
        back = await dp.load([kv(["a"], pools, [4])])
        with anyio.fail_after(10):
            out = await back.wait()
        assert not out.ok
        ((held, _row),) = index_of(dp)._by_key["a"]
        assert held.readers == 0
        store.open()
        assert (await ticket.wait()).ok


async def test_a_load_cancelled_while_it_copies_releases_its_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    pools = Pools(2, 64)
    store = GatedStore(EmbeddedStore(64 << 20))
    async with gated(pools, store, staged(inline_copy_bytes=1)) as dp:  # the copy runs in a thread
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a"], pools, [0])])
        with anyio.fail_after(10):
            await ticket.copied()
        codec = dp.actors[PoolKind.FULL].arena.codecs[0]
        scatter = codec.scatter
        entered, go = anyio.Event(), threading.Event()
        token = anyio.lowlevel.current_token()

        def slow(*args: object, **kw: object) -> None:
            anyio.from_thread.run_sync(entered.set, token=token)
            go.wait(10)
            scatter(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(codec, "scatter", slow)
        back = await dp.load([kv(["a"], pools, [4])])
        with anyio.fail_after(10):
            await entered.wait()
        assert index_of(dp)._by_key["a"][0][0].readers == 1
        back.cancel()  # too late to cancel: it ends with its result, its pin released
        go.set()
        with anyio.fail_after(10):
            await back.wait()
        assert index_of(dp)._by_key["a"][0][0].readers == 0
        store.open()
        assert (await ticket.wait()).ok


async def test_close_with_pinned_frames_does_not_hang_and_leaks_nothing() -> None:
    pools = Pools(1, 1)
    store = GatedStore(EmbeddedStore(8 << 20))
    dp = DataPlane(pools.views(), store, staged(), namespace=b"two-stage")
    async with dp:
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a"], pools, [0])])
        with anyio.fail_after(10):
            await ticket.copied()
        index = index_of(dp)
        pinned = index.pin(["a"])
        store.open()
        with anyio.fail_after(10):
            await dp.close()
    assert dp.host_staging is not None and dp.host_staging.used > 0  # still read: still charged
    for _i, f, _row in pinned:
        index.unpin(f)
    assert dp.host_staging.used == 0


async def test_a_store_that_fails_while_frames_drain_leaves_nothing_restorable() -> None:
    pools = Pools(2, 4)
    store = GatedStore(EmbeddedStore(8 << 20))
    async with gated(pools, store, staged()) as dp:
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a", "b"], pools, [0, 1])])
        with anyio.fail_after(10):
            await ticket.copied()
        assert (await dp.exists({PoolKind.FULL: ["a", "b"]}))[PoolKind.FULL] == [True, True]
        store.fail_puts = True
        store.open()
        out = await ticket.wait()
        assert not out.ok and out.objects[PoolKind.FULL] == [False, False]  # never marked stored
        assert len(index_of(dp)) == 0
        assert (await dp.exists({PoolKind.FULL: ["a", "b"]}))[PoolKind.FULL] == [False, False]
        back = await dp.load([kv(["a"], pools, [4])])
        assert not (await back.wait()).ok


async def test_nothing_is_indexed_before_it_is_sealed_or_in_one_stage() -> None:
    pools = Pools(2, 4)
    store = GatedStore(EmbeddedStore(8 << 20))
    async with gated(pools, store, staged()) as dp:
        fence = FakeDeviceEvent(polls=None)
        ticket = await dp.offload([kv(["a"], pools, [0])], fence=fence)
        await anyio.sleep(0.02)
        assert not index_of(dp).holds("a")  # not copied, not sealed: not restorable
        assert (await dp.exists({PoolKind.FULL: ["a"]}))[PoolKind.FULL] == [False]
        fence.set()
        assert (await ticket.wait()).ok
    async with gated(pools, store, DataPlaneConfig(staging_bytes_per_pool=1 << 16)) as dp:
        assert dp.actors[PoolKind.FULL].frames is None


@pytest.mark.parametrize("two_stage", [True, False])
async def test_a_state_is_pending_until_the_store_answers_unless_its_frame_is_indexed(two_stage: bool) -> None:
    pools = Pools(2, 4)
    store = GatedStore(EmbeddedStore(8 << 20))
    state = [pools.conv[0][:, 1].clone(), pools.temporal[:, 1].clone()]
    config = staged() if two_stage else DataPlaneConfig(staging_bytes_per_pool=1 << 16)
    async with gated(pools, store, config) as dp:
        store.hold(puts=True)
        ticket = await dp.offload([Transfer(PoolKind.MAMBA, ["s"], [1])])
        await store.wait_held(1)  # two stages: copied into its frame before the put
        assert ticket.in_frames(PoolKind.MAMBA) is two_stage and not ticket.done
        assert dp.backpressure().pending_states == (0 if two_stage else 1)
        if two_stage:  # restorable from its frame: not pending, and restored from there
            pools.conv[0].fill_(0x11)
            pools.temporal.fill_(0x11)
            back = await dp.load([Transfer(PoolKind.MAMBA, ["s"], [3])])
            assert (await back.wait()).ok and back.from_staging == 1
        store.open()
        assert (await ticket.wait()).ok
        assert dp.backpressure().pending_states == 0
    if two_stage:
        assert torch.equal(state[0], pools.conv[0][:, 3]) and torch.equal(state[1], pools.temporal[:, 3])


def test_a_key_staged_by_two_jobs_stays_readable_until_both_frames_retire() -> None:
    """Two draining jobs hold the same key: the older frame's retirement leaves the newer
    one readable (a miss here would send a restorable prefix back to recompute)."""
    index = FrameIndex(HostStaging(1 << 20))
    grid = torch.zeros((2, 16), dtype=torch.uint8)
    older = index.add(["a", "b"], grid, 16, 32)
    newer = index.add(["c", "a"], grid.clone(), 16, 32)
    assert index.pin(["a"])[0][1:] == (older, 0)  # read from the older frame first
    index.unpin(older)
    index.retire(older)
    assert index.holds("a") and not index.holds("b")
    (_i, frames, row), = index.pin(["a"])
    assert (frames, row) == (newer, 1)
    index.unpin(frames)
    index.drop("a", newer)  # the newer copy failed verification: gone, counted once
    assert not index.holds("a") and index.holds("c") and index.dropped == 1
    index.retire(newer)
    assert len(index) == 0
