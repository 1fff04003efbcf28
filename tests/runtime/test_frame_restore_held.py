"""Verify-all loads from draining frames (docs/design/host-staging.md §4e): a held load copies
its objects still draining in host staging into its private frames, verifies them there like a
store read, and writes no row before the whole load verified. Real CPU pools of 1, 2 and 8
layers, pages of 1 and 64 rows, an embedded store behind a gate that holds puts."""

from __future__ import annotations

import anyio
import pytest
import torch
from test_frame_restore import gated, index_of
from test_host_staging import Pools, kv, staged

from hylinker.components.layout import PoolKind
from hylinker.stores import framing
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultyStore
from hylinker.testing.fakes import GatedStore


@pytest.mark.parametrize(("layers", "page"), [(2, 64), (8, 1)])
async def test_a_verify_all_load_takes_draining_objects_from_frames_and_the_rest_from_the_store(
        layers: int, page: int) -> None:
    pools = Pools(layers, page)
    store = GatedStore(EmbeddedStore(64 << 20))
    before = [pools.page_bytes(p) for p in range(2)]
    async with gated(pools, store, staged()) as dp:
        assert (await (await dp.offload([kv(["z"], pools, [0])])).wait()).ok  # stored
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a"], pools, [1])])
        with anyio.fail_after(10):
            await ticket.copied()
        untouched = pools.page_bytes(6)
        # one object neither draining nor stored: the whole load fails and writes no row
        failed = await (await dp.load([kv(["z", "a", "missing"], pools, [4, 5, 6])], verify_all=True)).wait()
        assert not failed.ok and failed.objects[PoolKind.FULL] == [True, True, False]
        for want, got in zip(untouched, pools.page_bytes(6), strict=True):
            assert torch.equal(want, got)
        out = await (await dp.load([kv(["z", "a"], pools, [4, 5])], verify_all=True)).wait()
        assert out.ok
        assert dp.pool_statistics()["kv"].staging_restores == 2
        store.open()
        await ticket.wait()
    for i, p in enumerate((4, 5)):
        for want, got in zip(before[i], pools.page_bytes(p), strict=True):
            assert torch.equal(want, got)


@pytest.mark.parametrize("verify_all", [False, True])
@pytest.mark.parametrize(("layers", "page"), [(1, 1), (8, 64)])
async def test_frames_of_a_store_that_checksums_as_it_copies_are_restored_by_their_header(
        layers: int, page: int, verify_all: bool) -> None:
    """The default embedded store sets the checksum in its own copy: our draining frames carry
    none. They are indexed all the same, read after a header check, and a frame whose header
    names another object is dropped, never restored."""
    pools = Pools(layers, page)
    store = GatedStore(FaultyStore(EmbeddedStore(64 << 20)))  # mirrors the embedded store's sealing
    before = [pools.page_bytes(p) for p in range(3)]
    async with gated(pools, store, staged()) as dp:
        assert dp.actors[PoolKind.FULL].calls.checksums  # the store seals as it copies
        store.hold(puts=True)
        ticket = await dp.offload([kv(["a", "b", "c"], pools, [0, 1, 2])])
        with anyio.fail_after(10):
            await ticket.copied()
        for t in (*pools.k, *pools.v):
            t.fill_(0xAB)
        index = index_of(dp)
        assert (await dp.exists({PoolKind.FULL: ["a", "b", "c"]}))[PoolKind.FULL] == [True] * 3
        ((frames, row),) = index._by_key["c"]
        frames.grid[row, :framing.HEADER_BYTES] = frames.grid[row - 1, :framing.HEADER_BYTES]  # b's header
        out = await (await dp.load([kv(["a", "b", "c"], pools, [5, 6, 7])], verify_all=verify_all)).wait()
        assert out.objects[PoolKind.FULL] == [True, True, False]
        stats = dp.pool_statistics()["kv"]
        assert stats.staging_restores == 2 and stats.staging_verify_failures == 1
        assert not index.holds("c")
        store.open()
        assert (await ticket.wait()).ok
    if not verify_all:  # a verify-all load that failed writes no row
        for i, p in enumerate((5, 6)):
            for want, got in zip(before[i], pools.page_bytes(p), strict=True):
                assert torch.equal(want, got)
