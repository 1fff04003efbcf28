"""The data plane over borrowed pools: round trips, probe, per-layer readiness, cancellation,
quiescing, bad input, lying stores, and the synchronous facade."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import attrs
import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, PoolViewError, kv_view, state_view
from hylinker.integrations.sglang.loads import LoadBatch, LoadBatchHooks
from hylinker.runtime.dataplane.device import CudaCopies
from hylinker.runtime.dataplane.events import record_fence
from hylinker.runtime.dataplane.plane import (
    DataPlane,
    DataPlaneClosedError,
    DataPlaneConfig,
    Transfer,
    group_key,
)
from hylinker.runtime.dataplane.sync_plane import SyncDataPlane
from hylinker.runtime.dataplane.tickets import TransferOutcome
from hylinker.stores.base import GetResult, Outcome, Store, StoreCapabilities, StoreStatistics
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.fakes import FakeDeviceEvent, GatedStore

P = 4
ROWS = 64
SLOTS = 6
FULL_IDS = [0, 2, 4, 6]
MAMBA_IDS = [1, 3]


class EnginePools:
    """What an engine owns: per-layer MHA K/V buffers, SGLang-style stacked state tensors,
    a draft KV on the same rows."""

    def __init__(self, seed: int, device: str = "cpu") -> None:
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            t = torch.empty(*shape, dtype=dtype)
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g,
                                                    dtype=torch.uint8))
            return t.to(device)

        self.k = [rnd(ROWS, 2, 8, dtype=torch.bfloat16) for _ in FULL_IDS]
        self.v = [rnd(ROWS, 2, 8, dtype=torch.bfloat16) for _ in FULL_IDS]
        self.conv = [rnd(len(MAMBA_IDS), SLOTS, 3, 4, dtype=torch.bfloat16)]
        self.temporal = rnd(len(MAMBA_IDS), SLOTS, 2, 4, 4, dtype=torch.float32)
        self.draft = [rnd(ROWS, 16, dtype=torch.float16)]

    def views(self) -> PoolSet:
        return PoolSet([
            kv_view(self.k, self.v, layer_ids=FULL_IDS, page_size=P),
            state_view(self.conv, self.temporal, layer_ids=MAMBA_IDS),
            kv_view(self.draft, layer_ids=[FULL_IDS[-1]], page_size=P, kind=PoolKind.DRAFT),
        ])

    def rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        r = rows.reshape(-1)
        return [t[r].view(torch.uint8).clone() for t in (*self.k, *self.v, *self.draft)]

    def slot(self, slot: int) -> list[torch.Tensor]:
        return [t[:, slot].view(torch.uint8).clone() for t in (*self.conv, self.temporal)]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (*self.k, *self.v, *self.draft, *self.conv, self.temporal)]


def pages(*ids: int) -> torch.Tensor:
    return torch.tensor(ids)[:, None] * P + torch.arange(P)


def kv_rows(engine: EnginePools, page: int) -> list[torch.Tensor]:
    """The K and V rows of one page (what a FULL transfer moves; the draft rows are not in it)."""
    return engine.rows(pages(page))[:2 * len(FULL_IDS)]


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


def transfers(prefix: str, rows: torch.Tensor, slot: int | None) -> list[Transfer]:
    n = rows.shape[0]
    out = [Transfer(PoolKind.FULL, keys(prefix + "k", n), rows),
           Transfer(PoolKind.DRAFT, keys(prefix + "d", n), rows)]
    if slot is not None:
        out.append(Transfer(PoolKind.MAMBA, [prefix + "s"], [[slot]]))
    return out


def plane(engine: EnginePools, store: Store, groups: int = 1, *, in_place: bool = True) -> DataPlane:
    return DataPlane(engine.views(), store, DataPlaneConfig(layer_groups=groups, in_place=in_place,
                                                           in_place_min_bytes=0),
                     namespace="test")


@contextlib.asynccontextmanager
async def opened_on_exit(gated: GatedStore) -> AsyncIterator[None]:
    """Open the gate when the block ends, so a failed assertion cannot leave the plane's
    close waiting on a held store call."""
    try:
        yield
    finally:
        gated.open()


@pytest.fixture
async def store() -> AsyncIterator[EmbeddedStore]:
    s = EmbeddedStore(16 << 20)
    yield s
    await s.close()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place-put", "staged-put"])
@pytest.mark.parametrize("groups", [1, 2, 4])
async def test_offload_then_load_restores_exactly_the_named_rows(store: EmbeddedStore, groups: int,
                                                                 in_place: bool) -> None:
    a, b = EnginePools(1), EnginePools(2)
    src_rows, dst_rows = pages(3, 0, 9), pages(1, 12, 5)
    want_rows, want_slot = a.rows(src_rows), a.slot(4)
    # one path writes, the other reads: in place and staged objects are the same bytes
    async with plane(a, store, groups, in_place=in_place) as dp:
        assert all(actor.arena.scatter is in_place for actor in dp.actors.values())
        done = await dp.offload(transfers("x", src_rows, 4))
        out = await done.wait()
        assert out.ok and out.objects[PoolKind.FULL] == [True] * 3
    before = b.snapshot()
    async with plane(b, store, groups, in_place=not in_place) as dp:
        present = await dp.exists({PoolKind.FULL: [*keys("xk", 3), "nope"], PoolKind.MAMBA: ["xs"]})
        assert present == {PoolKind.FULL: [True, True, True, False], PoolKind.MAMBA: [True]}
        ticket = await dp.load(transfers("x", dst_rows, 2))
        out = await ticket.wait()
        assert out.ok and not out.cancelled
        assert all([await ticket.wait_layer(layer) for layer in ticket.layer_ids])
    assert all(torch.equal(x, y) for x, y in zip(b.rows(dst_rows), want_rows))
    assert all(torch.equal(x, y) for x, y in zip(b.slot(2), want_slot))
    # nothing else changed
    after = b.snapshot()
    touched_rows = dst_rows.reshape(-1)
    for old, new in zip(before, after):
        if new.shape[0] == ROWS:
            keep = torch.ones(ROWS, dtype=torch.bool)
            keep[touched_rows] = False
            assert torch.equal(old[keep].view(torch.uint8), new[keep].view(torch.uint8))
        else:  # stacked state [L, slots, ...]
            keep_s = [s for s in range(SLOTS) if s != 2]
            assert torch.equal(old[:, keep_s].view(torch.uint8), new[:, keep_s].view(torch.uint8))
    if groups > 1:  # one object per layer group
        assert await store.exists([group_key("xk-0", 0, groups), "xk-0"]) == [True, False]


async def test_layer_zero_is_usable_while_later_layers_are_held_back(store: EmbeddedStore) -> None:
    a, b = EnginePools(1), EnginePools(2)
    rows = pages(0, 1)
    async with plane(a, store, 2) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, keys("k", 2), rows)])).wait()).ok
    gated = GatedStore(store, hold_gets=True)
    async with plane(b, gated, 2) as dp, opened_on_exit(gated):
        ticket = await dp.load([Transfer(PoolKind.FULL, keys("k", 2), pages(4, 5))])
        with anyio.fail_after(5):
            await gated.wait_held(1)
            assert gated.release(1) == 1  # the first layer group's get only
            assert await ticket.wait_layer(0) is True
            assert await ticket.wait_layer(2) is True  # layers 0 and 2 are group 0
            await gated.wait_held(1)  # group 1 (layers 4, 6) is still at the gate
        assert not ticket.done
        late = [b.k[2][16:24].view(torch.uint8).clone(), b.k[3][16:24].view(torch.uint8).clone()]
        assert torch.equal(late[0], EnginePools(2).k[2][16:24].view(torch.uint8))  # not landed yet
        gated.open()
        with anyio.fail_after(5):
            assert (await ticket.wait()).ok
            assert await ticket.wait_layer(6) is True
    assert torch.equal(b.k[3][16:24].view(torch.uint8), a.k[3][0:8].view(torch.uint8))


async def test_cancel_before_start_never_touches_rows(store: EmbeddedStore) -> None:
    a, b = EnginePools(1), EnginePools(2)
    async with plane(a, store) as dp:
        assert (await (await dp.offload(transfers("c", pages(0, 1), 0))).wait()).ok
    gated = GatedStore(store, hold_gets=True)
    before = b.snapshot()
    async with plane(b, gated) as dp, opened_on_exit(gated):
        first = await dp.load([Transfer(PoolKind.FULL, keys("ck", 2), pages(2, 3))])
        second = await dp.load([Transfer(PoolKind.FULL, keys("ck", 2), pages(6, 7))])
        with anyio.fail_after(5):
            await gated.wait_held(1)
        assert first.started and not first.cancel()  # running: it goes on
        assert not second.started and second.cancel()
        assert not second.cancel()  # once
        gated.open()
        with anyio.fail_after(5):
            assert (await first.wait()).ok
            out = await second.wait()
            assert out.cancelled and not out.ok and out.faults == {"cancelled": 2}
            assert [await second.wait_layer(layer) for layer in second.layer_ids] == [False] * 4
        assert dp.statistics().loads_cancelled == 1
    after = b.snapshot()
    for t_old, t_new in zip(before, after):
        if t_new.shape[0] == ROWS:
            assert torch.equal(t_old[24:32].view(torch.uint8), t_new[24:32].view(torch.uint8))
        else:
            assert torch.equal(t_old[:, 5].view(torch.uint8), t_new[:, 5].view(torch.uint8))


async def test_close_quiesces_in_flight_transfers(store: EmbeddedStore) -> None:
    a = EnginePools(1)
    async with plane(a, store) as dp:
        assert (await (await dp.offload(transfers("q", pages(0, 1), 0))).wait()).ok
    gated = GatedStore(store, hold_gets=True)
    dp = plane(EnginePools(2), gated)
    async with dp:
        running = await dp.load([Transfer(PoolKind.FULL, keys("qk", 2), pages(2, 3))])
        queued = await dp.load([Transfer(PoolKind.FULL, keys("qk", 2), pages(4, 5))])
        with anyio.fail_after(5):
            await gated.wait_held(1)
        closed = anyio.Event()

        async def close() -> None:
            await dp.close()
            closed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            await anyio.sleep(0.05)
            assert not closed.is_set()  # waits for the running load
            assert queued.done and (await queued.wait()).cancelled  # the queued one never starts
            with pytest.raises(DataPlaneClosedError):
                await dp.load([Transfer(PoolKind.FULL, keys("qk", 1), pages(9))])
            gated.open()
        assert closed.is_set() and (await running.wait()).ok


async def test_an_offload_reads_rows_only_after_its_fence(store: EmbeddedStore) -> None:
    a = EnginePools(1)
    fence = FakeDeviceEvent(polls=None)
    async with plane(a, store) as dp:
        ticket = await dp.offload([Transfer(PoolKind.FULL, ["f"], pages(0))], fence=fence)
        await anyio.sleep(0.02)
        assert not ticket.done
        for t in a.k:  # the forward writes the rows, then the event completes
            t[0:4].fill_(3.0)
        fence.set()
        assert (await ticket.wait()).ok
    b = EnginePools(2)
    async with plane(b, store) as dp:
        assert (await (await dp.load([Transfer(PoolKind.FULL, ["f"], pages(1))])).wait()).ok
    assert all(bool((t[4:8] == 3.0).all()) for t in b.k)


@pytest.mark.parametrize("verify_all", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
async def test_a_load_writes_rows_only_after_its_fence(store: EmbeddedStore, verify_all: bool,
                                                       in_place: bool) -> None:
    """The rows a load reuses may still be read by the engine's stream: nothing lands in them
    before the load's fence completed, then the stored bytes do."""
    a = EnginePools(1)
    async with plane(a, store, in_place=in_place) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, ["lf"], pages(0))])).wait()).ok
    b = EnginePools(2)
    before = b.rows(pages(1))
    fence = FakeDeviceEvent(polls=None)
    async with plane(b, store, in_place=in_place) as dp:
        ticket = await dp.load([Transfer(PoolKind.FULL, ["lf"], pages(1))], verify_all=verify_all, fence=fence)
        await anyio.sleep(0.05)
        assert not ticket.done
        assert all(torch.equal(x, y) for x, y in zip(b.rows(pages(1)), before))
        fence.set()
        assert (await ticket.wait()).ok
    assert all(torch.equal(x, y) for x, y in zip(kv_rows(b, 1), kv_rows(a, 0)))


async def test_a_failing_load_fence_fails_the_load_and_writes_nothing(store: EmbeddedStore) -> None:
    a = EnginePools(1)
    async with plane(a, store) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, ["lg"], pages(0))])).wait()).ok
    b = EnginePools(2)
    before = b.rows(pages(1))
    async with plane(b, store) as dp:
        out = await (await dp.load([Transfer(PoolKind.FULL, ["lg"], pages(1))],
                                   fence=FakeDeviceEvent(error="boom"))).wait()
        assert not out.ok and out.faults == {"fence": 1}
        assert (await (await dp.load([Transfer(PoolKind.FULL, ["lg"], pages(2))])).wait()).ok
    assert all(torch.equal(x, y) for x, y in zip(b.rows(pages(1)), before))


def test_the_sync_facade_starts_held_loads_behind_a_fence() -> None:
    b = EnginePools(2)
    source = kv_rows(b, 0)
    before = kv_rows(b, 1)
    fence = FakeDeviceEvent(polls=None)
    with SyncDataPlane(b.views(), lambda: EmbeddedStore(16 << 20), namespace="t") as dp:
        assert dp.offload([Transfer(PoolKind.FULL, ["sf"], pages(0))]).result(10).ok
        load = dp.load([Transfer(PoolKind.FULL, ["sf"], pages(1))], start=False, verify_all=True)
        dp.start(load, fence=fence)
        with pytest.raises(concurrent.futures.TimeoutError):
            load.result.result(0.1)
        assert all(torch.equal(x, y) for x, y in zip(kv_rows(b, 1), before))
        fence.set()
        assert load.result.result(10).ok
    assert all(torch.equal(x, y) for x, y in zip(kv_rows(b, 1), source))


def test_sync_plane_statistics_are_a_frozen_snapshot_counting_each_outcome_once() -> None:
    a = EnginePools(1)
    with SyncDataPlane(a.views(), lambda: EmbeddedStore(16 << 20), namespace="t") as dp:
        before = dp.statistics()
        assert dp.offload([Transfer(PoolKind.FULL, ["s1"], pages(0))]).result(10).ok
        assert dp.load([Transfer(PoolKind.FULL, ["s1"], pages(1))]).result.result(10).ok
        assert not dp.load([Transfer(PoolKind.FULL, ["absent"], pages(1))]).result.result(10).ok
        after = dp.statistics()
        assert before.loads == before.offloads == 0  # the earlier snapshot did not move
        assert (after.offloads, after.offloads_ok, after.offloads_failed) == (1, 1, 0)
        assert (after.loads, after.loads_ok, after.loads_failed, after.loads_cancelled) == (2, 1, 1, 0)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            after.loads = 0  # type: ignore[misc]


class BatchEvents:
    """What a LoadBatch told its owner, from the plane's thread."""

    def __init__(self, loads: int) -> None:
        self.completed: list[tuple[int, int]] = []
        self.landed: list[list[str]] = []
        self.ended: list[tuple[int, bool, list[str]]] = []
        self.seconds: list[float] = []
        self._left = loads
        self.all_ended = threading.Event()

    def hooks(self) -> LoadBatchHooks:
        return LoadBatchHooks(complete=lambda i, layer: self.completed.append((i, layer)),
                              landed=self.landed.append, ended=self.end, observe_seconds=self.seconds.append)

    def end(self, index: int, outcome: TransferOutcome | None, keys: list[str]) -> None:
        self.ended.append((index, outcome is not None and outcome.ok, keys))
        self._left -= 1
        if self._left == 0:
            self.all_ended.set()


@pytest.mark.parametrize("second_present", [True, False])
def test_sglang_load_batch_completes_a_layer_once_every_load_landed_it(second_present: bool) -> None:
    """SGLang's layer counter sees a layer complete only when every load of the batch landed it
    (two requests' loads feed the same KV layers); a batch with one load that misses never
    completes that load's layers, never reports the batch landed, and ends failed for that load
    (the plugin then fails the counter index)."""
    a = EnginePools(1)
    with SyncDataPlane(a.views(), lambda: EmbeddedStore(16 << 20), namespace="t") as dp:
        assert dp.offload([Transfer(PoolKind.FULL, keys("b", 2), pages(0, 1)),
                           Transfer(PoolKind.MAMBA, ["bs"], [[0]])]).result(10).ok
        if second_present:
            assert dp.offload([Transfer(PoolKind.FULL, keys("c", 1), pages(4))]).result(10).ok
        first = dp.load([Transfer(PoolKind.FULL, keys("b", 2), pages(2, 3)),
                         Transfer(PoolKind.MAMBA, ["bs"], [[1]])], start=False)
        second = dp.load([Transfer(PoolKind.FULL, keys("c", 1), pages(5))], start=False)
        seen = BatchEvents(2)
        batch = [(first, [*keys("b", 2), "bs"]), (second, keys("c", 1))]
        LoadBatch(seen.hooks(), 7, 1 + max(FULL_IDS + MAMBA_IDS), batch)
        assert seen.completed == [(7, 5)] and not seen.landed  # only the layer no load feeds
        dp.start(first, second)
        assert seen.all_ended.wait(10)
    assert sorted(ok for _, ok, _ in seen.ended) == ([True, True] if second_present else [False, True])
    done = {layer for _, layer in seen.completed}
    if second_present:
        assert done == set(range(7)) and seen.landed == [[*keys("b", 2), "bs", *keys("c", 1)]]
    else:  # the state layers only the first load fed are complete; the shared KV layers are not
        assert done == {5, *MAMBA_IDS} and seen.landed == []
    assert len(seen.seconds) == 2


async def test_a_failing_fence_fails_the_offload_not_the_plane(store: EmbeddedStore) -> None:
    a = EnginePools(1)
    async with plane(a, store) as dp:
        bad = await dp.offload([Transfer(PoolKind.FULL, ["g"], pages(0))], fence=FakeDeviceEvent(error="boom"))
        out = await bad.wait()
        assert not out.ok and out.faults == {"fence": 1}
        assert (await (await dp.offload([Transfer(PoolKind.FULL, ["h"], pages(0))])).wait()).ok
        assert dp.statistics().offloads_failed == 1


@pytest.mark.parametrize("case", ["count", "two_for_one_pool", "repeated_rows", "out_of_range",
                                  "repeated_keys", "unknown_pool", "one_string", "not_a_transfer"])
async def test_bad_submissions_raise_before_anything_moves(store: EmbeddedStore, case: str) -> None:
    a = EnginePools(1)
    cases: dict[str, list[Transfer]] = {
        "count": [Transfer(PoolKind.FULL, keys("b", 3), pages(0, 1))],
        "two_for_one_pool": [Transfer(PoolKind.FULL, ["b"], pages(0)), Transfer(PoolKind.FULL, ["c"], pages(1))],
        "repeated_rows": [Transfer(PoolKind.FULL, keys("b", 2), torch.cat([pages(0), pages(0)]))],
        "out_of_range": [Transfer(PoolKind.MAMBA, ["s"], [[SLOTS]])],
        "repeated_keys": [Transfer(PoolKind.FULL, ["b", "b"], pages(0, 1))],
        "unknown_pool": [Transfer(PoolKind.MAMBA, ["s"], [[0]])],
        "one_string": [Transfer(PoolKind.FULL, "b", pages(0))],
        "not_a_transfer": [(PoolKind.FULL, ["b"], pages(0))],  # type: ignore[list-item]
    }
    bad = cases[case]
    views = a.views() if case != "unknown_pool" else PoolSet([a.views()[PoolKind.FULL]])
    async with DataPlane(views, store) as dp:
        for submit in (dp.load, dp.offload):
            with pytest.raises((PoolViewError, TypeError)):
                await submit(bad)
        assert dp.statistics().loads == dp.statistics().offloads == 0
    assert store.statistics().puts == 0


class _Forwarding:
    """Forwards every call of the store protocol to ``inner``; test wrappers override some."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    @property
    def capabilities(self) -> StoreCapabilities:
        return self.inner.capabilities

    def register(self, region: torch.Tensor) -> None:
        self.inner.register(region)

    def unregister(self, region: torch.Tensor) -> None:
        self.inner.unregister(region)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.exists(keys)

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        return await self.inner.put(keys, buffers)

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        return await self.inner.get(keys, buffers)

    async def touch(self, keys: Sequence[str]) -> None:
        await self.inner.touch(keys)

    async def remove(self, keys: Sequence[str]) -> int:
        return await self.inner.remove(keys)

    def statistics(self) -> StoreStatistics:
        return self.inner.statistics()

    async def close(self) -> None:
        await self.inner.close()


class ShortStore(_Forwarding):
    """A store that answers every batch with one result too few (a protocol breach)."""

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return (await self.inner.exists(keys))[:-1]

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        return (await self.inner.put(keys, buffers))[:-1]

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        return (await self.inner.get(keys, buffers))[:-1]


async def test_a_store_that_answers_the_wrong_count_fails_the_transfer(store: EmbeddedStore) -> None:
    a = EnginePools(1)
    async with plane(a, store) as dp:
        assert (await (await dp.offload(transfers("w", pages(0, 1), 0))).wait()).ok
    b = EnginePools(2)
    async with plane(b, ShortStore(store)) as dp:
        assert await dp.exists({PoolKind.FULL: keys("wk", 2)}) == {PoolKind.FULL: [False, False]}
        assert dp.statistics().exists_errors == 1
        with anyio.fail_after(5):
            out = await (await dp.load(transfers("w", pages(2, 3), 1))).wait()
        assert not out.ok and out.faults.get("failed") == 5
        put = await (await dp.offload([Transfer(PoolKind.FULL, ["new"], pages(0))])).wait()
        assert not put.ok


async def test_a_corrupted_object_is_reported_and_other_layers_are_not_claimed(store: EmbeddedStore) -> None:
    a = EnginePools(1)
    async with plane(a, store) as dp:
        assert (await (await dp.offload(transfers("z", pages(0, 1), 0))).wait()).ok
    # another geometry under the same key: rejected by the header, never reported landed
    await store.remove(["zk-1"])
    other = EnginePools(3)
    views = PoolSet([kv_view(other.k, layer_ids=FULL_IDS, page_size=P)])  # K only: other bytes
    async with DataPlane(views, store, namespace="other") as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, ["zk-1"], pages(0))])).wait()).ok
    b = EnginePools(2)
    async with plane(b, store) as dp:
        ticket = await dp.load(transfers("z", pages(2, 3), 1))
        out = await ticket.wait()
        assert not out.ok and out.objects[PoolKind.FULL] == [True, False]
        assert sum(out.faults.values()) == 1
        assert [await ticket.wait_layer(layer) for layer in FULL_IDS] == [False] * 4
        assert await ticket.wait_layer(MAMBA_IDS[0]) is True  # its own pool landed verified


def test_sync_facade_from_threads() -> None:
    a, b = EnginePools(1), EnginePools(2)
    with SyncDataPlane(a.views(), lambda: EmbeddedStore(16 << 20), namespace="t", completion_fifo=True) as src:
        futs = [src.offload(transfers(f"s{i}", pages(i), i)) for i in range(4)]
        for f in futs:
            assert f.result(timeout=10).ok
        assert src.num_completed_offloads() == 4
        popped = src.pop_completed_offloads()
        assert [o.ok for o in popped] == [True] * 4 and src.pop_completed_offloads() == []
        present = src.exists({PoolKind.FULL: ["s0k-0", "zz"]}).result(timeout=10)
        assert present[PoolKind.FULL] == [True, False]
        # a synchronous scheduler loading from several threads at once
        results: dict[int, bool] = {}

        def load(i: int) -> None:
            handle = src.load(transfers(f"s{i}", pages(8 + i), i))
            assert all(handle.wait_layer(layer, timeout=10) for layer in handle.layer_ids)
            results[i] = handle.result.result(timeout=10).ok

        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert results == {i: True for i in range(4)}
        assert all(torch.equal(x, y) for x, y in zip(a.rows(pages(8 + 3)), a.rows(pages(3))))
        src.reset()
        with pytest.raises(KeyError):
            src.load(transfers("s0", pages(9), 0)).layer(99)
    with pytest.raises(DataPlaneClosedError):
        src.offload(transfers("late", pages(0), 0))
    del b


def test_sync_facade_hands_work_to_a_busy_loop_without_waiting_for_it() -> None:
    """A scheduler thread queues offloads and starts held loads while the loop thread is busy:
    the calls return at once, and the work runs in submission order once the loop is free."""
    a = EnginePools(1)
    with SyncDataPlane(a.views(), lambda: EmbeddedStore(16 << 20), namespace="t", completion_fifo=True) as dp:
        assert dp.offload(transfers("w", pages(0), 0)).result(timeout=10).ok
        held = dp.load(transfers("w", pages(5), 1), start=False)
        gate = threading.Event()

        async def busy() -> None:
            gate.wait(10)  # the loop thread does nothing else until the gate opens

        dp._portal.start_task_soon(busy)
        try:
            done = threading.Event()
            futures: list[concurrent.futures.Future[Any]] = []

            def scheduler() -> None:
                futures.extend(dp.offload(transfers(f"q{i}", pages(i), i)) for i in range(3))
                dp.start(held)
                done.set()

            threading.Thread(target=scheduler, daemon=True).start()
            assert done.wait(2), "the facade waited for a busy loop thread"
            assert not any(f.done() for f in futures) and not held.result.done()
        finally:
            gate.set()
        assert [f.result(timeout=10).ok for f in futures] == [True] * 3
        assert held.result.result(timeout=10).ok
        assert all(held.layer(layer).result(timeout=10) for layer in held.layer_ids)
        assert all(torch.equal(x, y) for x, y in zip(a.rows(pages(5)), a.rows(pages(0))))
        assert [o.ok for o in dp.pop_completed_offloads()] == [True] * 4


def test_sync_facade_cancel_and_close_with_transfers_in_flight() -> None:
    a = EnginePools(1)
    held: list[GatedStore] = []

    def factory() -> Store:
        g = GatedStore(EmbeddedStore(16 << 20), hold_gets=True)
        held.append(g)
        return g

    dp = SyncDataPlane(a.views(), factory)
    try:
        assert dp.offload([Transfer(PoolKind.FULL, ["c0"], pages(0))]).result(timeout=10).ok
        running = dp.load([Transfer(PoolKind.FULL, ["c0"], pages(1))])
        queued = dp.load([Transfer(PoolKind.FULL, ["c0"], pages(2))])
        dp._portal.call(held[0].wait_held, 1)
        assert not dp.cancel(running)
        assert dp.cancel(queued)
        out = queued.result.result(timeout=10)
        assert out.cancelled and queued.layer(0).result(timeout=10) is False
        closer = concurrent.futures.ThreadPoolExecutor(1).submit(dp.close)
        with pytest.raises(concurrent.futures.TimeoutError):
            closer.result(timeout=0.1)  # waits for the running load
        dp._portal.call(held[0].open)
        closer.result(timeout=10)
        assert running.result.result(timeout=1).ok
    finally:
        dp.close()


@pytest.mark.parametrize("fault", ["flip_payload", "torn", "other_key"])
async def test_in_place_loads_verify_the_landed_rows(store: EmbeddedStore, fault: str) -> None:
    a = EnginePools(1)
    async with plane(a, store) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, ["v0", "v1"], pages(0, 1))])).wait()).ok
    size = a.views()[PoolKind.FULL].payload_bytes + 64
    frame = torch.zeros(size, dtype=torch.uint8)
    assert (await store.get(["v1"], [frame]))[0].outcome is Outcome.OK
    await store.remove(["v1"])
    if fault == "flip_payload":
        frame[64 + size // 3] ^= 0x10
        await store.put(["v1"], [frame])
    elif fault == "torn":
        await store.put(["v1"], [frame[: size - 100].clone()])
    else:  # a valid object, filed under another key
        other = torch.zeros(size, dtype=torch.uint8)
        assert (await store.get(["v0"], [other]))[0].outcome is Outcome.OK
        await store.put(["v1"], [other])
    b = EnginePools(2)
    async with plane(b, store) as dp:
        assert all(actor.arena.scatter for actor in dp.actors.values())
        ticket = await dp.load([Transfer(PoolKind.FULL, ["v0", "v1"], pages(2, 3))])
        out = await ticket.wait()
        assert not out.ok and out.objects[PoolKind.FULL] == [True, False]
        assert out.faults == {{"flip_payload": "bad_checksum", "torn": "truncated",
                               "other_key": "other_key"}[fault]: 1}
        assert [await ticket.wait_layer(layer) for layer in FULL_IDS] == [False] * 4
        assert dp.pool_statistics()["kv"].verify_failures == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
@pytest.mark.parametrize("groups", [1, 3])
async def test_linker_restores_exactly_through_the_data_plane(groups: int, in_place: bool, device: str) -> None:
    """The Linker is a client of the same data plane: restore is byte-exact with layer groups
    and on either path, and every layer of the load is reported landed; on CUDA pools through
    the device path (copy streams, pinned staging, the donation fenced on the engine's stream)."""
    import numpy as np

    from hylinker.components.pools import HybridPools
    from hylinker.runtime.linker.config import LinkerConfig
    from hylinker.runtime.linker.facade import Linker
    from hylinker.testing.content import SyntheticContent
    from hylinker.testing.fakes import small_hybrid_layout, synthetic_prefill

    layout = small_hybrid_layout()
    store = EmbeddedStore(8 << 20)
    pools = HybridPools(layout, kv_pages=64, mamba_slots=16, device=device)
    content = SyntheticContent(pools)
    tokens = np.random.default_rng(3).integers(1, 30000, size=41).astype(np.int32)
    async with Linker(layout, pools, store, LinkerConfig(layer_groups=groups, in_place=in_place,
                                                                   in_place_min_bytes=0)) as lk:
        if device == "cuda":  # device pools move through pinned staging on copy streams
            assert all(isinstance(a.copies, CudaCopies) and not a.arena.scatter for a in lk.actors.values())
        else:
            assert all(a.arena.scatter is in_place for a in lk.actors.values())
        req = lk.request("donor", tokens)
        await lk.lookup(req)
        assert await synthetic_prefill(lk, content, req, fence=record_fence(torch.device(device))) > 0
        await lk.release(req)
        await lk.drain()
        lk.flush_device()
        req = lk.request("again", tokens)
        hit = await lk.lookup(req)
        assert hit.store_tokens == 40
        load = await lk.load(req)
        assert load is not None
        assert load.ticket is not None
        assert all([await load.wait_layer(layer) for layer in load.ticket.layer_ids])
        assert await lk.commit(load) == 40
        assert content.prefix_problems(lk, req) == []
        await lk.release(req)
        await lk.drain()
        lk.check_idle()
    if groups > 1:
        assert any("|g1of2" in k for k in store.lru_keys())  # 2 layers per pool: 2 groups
    await store.close()


def test_sync_facade_held_loads_start_in_order_or_cancel_untouched() -> None:
    a = EnginePools(1)
    with SyncDataPlane(a.views(), lambda: EmbeddedStore(16 << 20)) as dp:
        assert dp.offload([Transfer(PoolKind.FULL, ["h0", "h1"], pages(0, 1))]).result(timeout=10).ok
        before = a.rows(pages(4))
        held = dp.load([Transfer(PoolKind.FULL, ["h0"], pages(4))], start=False)
        kept = dp.load([Transfer(PoolKind.FULL, ["h1"], pages(5))], start=False)
        with pytest.raises(concurrent.futures.TimeoutError):
            kept.result.result(timeout=0.05)  # held: nothing moves until start
        assert dp.cancel(held) and not dp.cancel(held)
        out = held.result.result(timeout=1)
        assert out.cancelled and held.layer(0).result(timeout=1) is False
        dp.start(kept, held)  # starting a cancelled load is a no-op
        assert kept.result.result(timeout=10).ok
        assert all(kept.layer(layer).result(timeout=1) for layer in FULL_IDS)
        assert all(torch.equal(x, y) for x, y in zip(a.rows(pages(4)), before))  # never written
        assert dp.statistics().loads_cancelled == 1


class PartsCountingStore(EmbeddedStore):
    """The embedded store, counting the objects it moved in place (``put_parts``/``get_parts``,
    or ``put_sealed``/``get_checked`` straight from / into pool rows)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.in_place: list[str] = []

    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        self.in_place.extend(keys)
        return await super().put_parts(keys, parts)

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        self.in_place.extend(keys)
        return await super().get_parts(keys, parts)

    # staged objects come through these too, as header ‖ payload of one staging frame
    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        self.in_place.extend(k for k, p in zip(keys, parts) if not _one_frame(p))
        return await super().put_sealed(keys, parts)

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        self.in_place.extend(k for k, p in zip(keys, parts) if not _one_frame(p))
        return await super().get_checked(keys, parts)


def _one_frame(parts: Sequence[torch.Tensor]) -> bool:
    """Whether an object's parts are one staging frame (payload right after its header)."""
    return len(parts) == 2 and parts[1].data_ptr() == parts[0].data_ptr() + parts[0].numel()


@pytest.mark.parametrize("put_min, get_min", [("at", "above"), ("above", "at")])
async def test_in_place_only_from_the_configured_object_size(put_min: str, get_min: str) -> None:
    """``in_place_min_bytes`` picks the path per pool from its object size: objects that reach
    it move in place, smaller ones are staged, and either way the same bytes come back."""
    store = PartsCountingStore(16 << 20)
    a, b = EnginePools(1), EnginePools(2)
    full = a.views()[PoolKind.FULL].payload_bytes
    assert full > max(a.views()[k].payload_bytes for k in (PoolKind.DRAFT, PoolKind.MAMBA))
    minimum = {"at": full, "above": full + 1}
    src_rows, dst_rows = pages(3, 0, 9), pages(1, 12, 5)
    want_rows, want_slot = a.rows(src_rows), a.slot(4)

    def sized(engine: EnginePools, which: str) -> DataPlane:
        return DataPlane(engine.views(), store, DataPlaneConfig(in_place_min_bytes=minimum[which]),
                         namespace="test")

    def moved(which: str) -> dict[PoolKind, list[bool]]:
        return {k: [which == "at" and k is PoolKind.FULL] for k in (PoolKind.FULL, PoolKind.DRAFT,
                                                                    PoolKind.MAMBA)}

    try:
        async with sized(a, put_min) as dp:
            assert {k: act.arena.in_place_groups for k, act in dp.actors.items()} == moved(put_min)
            assert (await (await dp.offload(transfers("x", src_rows, 4))).wait()).ok
        # only the big pool's objects, and only when they reach the minimum
        assert len(store.in_place) == (3 if put_min == "at" else 0)
        assert all(k.endswith(tuple(keys("xk", 3))) for k in store.in_place)
        store.in_place.clear()
        async with sized(b, get_min) as dp:
            assert {k: act.arena.in_place_groups for k, act in dp.actors.items()} == moved(get_min)
            assert (await (await dp.load(transfers("x", dst_rows, 2))).wait()).ok
        assert len(store.in_place) == (3 if get_min == "at" else 0)
    finally:
        await store.close()
    assert all(torch.equal(x, y) for x, y in zip(b.rows(dst_rows), want_rows))
    assert all(torch.equal(x, y) for x, y in zip(b.slot(2), want_slot))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_in_place_min_bytes_is_a_non_negative_int(bad: object) -> None:
    from hylinker.runtime.linker.config import LinkerConfig

    with pytest.raises(ValueError, match="in_place_min_bytes"):
        DataPlaneConfig(in_place_min_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="in_place_min_bytes"):
        LinkerConfig(in_place_min_bytes=bad)  # type: ignore[arg-type]


# ---- verify all, then land (load(..., verify_all=True)): no row written until every object
# of the load verified; a failed one writes no row at all


async def flip_a_payload_bit(store: Store, key: str, payload_bytes: int) -> None:
    """Rewrite ``key`` with one payload bit flipped: an object damaged at rest."""
    frame = torch.zeros(payload_bytes + 64, dtype=torch.uint8)
    await store.get([key], [frame])
    await store.remove([key])
    frame[-5] ^= 0x40
    await store.put([key], [frame])


def unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(before, after))


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
@pytest.mark.parametrize("groups", [1, 2])
async def test_verified_load_lands_every_row_exactly(groups: int, in_place: bool) -> None:
    store = PartsCountingStore(16 << 20)
    a, b = EnginePools(1), EnginePools(2)
    async with plane(a, store, groups, in_place=False) as dp:
        assert (await (await dp.offload(transfers("x", pages(3, 0, 9), 4))).wait()).ok
    async with plane(b, store, groups, in_place=in_place) as dp:
        ticket = await dp.load(transfers("x", pages(1, 12, 5), 2), verify_all=True)
        out = await ticket.wait()
        assert out.ok and all([await ticket.wait_layer(layer) for layer in ticket.layer_ids])
    assert bool(store.in_place) is in_place  # either path, the same bytes
    assert all(torch.equal(x, y) for x, y in zip(b.rows(pages(1, 12, 5)), a.rows(pages(3, 0, 9))))
    assert all(torch.equal(x, y) for x, y in zip(b.slot(2), a.slot(4)))
    await store.close()


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in-place"])
async def test_one_bad_object_fails_the_load_before_any_layer(in_place: bool) -> None:
    store = EmbeddedStore(16 << 20)
    a, b = EnginePools(1), EnginePools(2)
    async with plane(a, store) as dp:
        assert (await (await dp.offload(transfers("z", pages(0, 1), 0))).wait()).ok
    await flip_a_payload_bit(store, "zk-1", a.views()[PoolKind.FULL].payload_bytes)
    before = b.snapshot()
    settled: list[tuple[int, bool]] = []
    async with plane(b, store, in_place=in_place) as dp:
        ticket = await dp.load(transfers("z", pages(2, 3), 1), verify_all=True)
        ticket.add_layer_callback(lambda layer, landed: settled.append((layer, landed)))
        out = await ticket.wait()
        assert not out.ok and out.faults == {"bad_checksum": 1}
        # which objects verified (none is reported landed): the caller removes only the bad one
        assert out.objects[PoolKind.FULL] == [True, False] and out.objects[PoolKind.MAMBA] == [True]
        assert settled and all(not landed for _, landed in settled)
        assert [await ticket.wait_layer(layer) for layer in [*FULL_IDS, *MAMBA_IDS]] == [False] * 6
    if in_place:  # the store wrote the rows it moved in place; never reported, so never used
        assert not unchanged(before, b.snapshot())
        return
    assert unchanged(before, b.snapshot())  # staged: the good KV page, the draft and the state too
    # the default (land as verified) writes the good pool's rows: what verify_all prevents
    async with plane(b, store, in_place=False) as dp:
        out = await (await dp.load(transfers("z", pages(2, 3), 1))).wait()
        assert not out.ok
    assert not unchanged(before, b.snapshot())
    await store.close()


async def test_no_layer_is_reported_before_every_group_verified() -> None:
    store = EmbeddedStore(16 << 20)
    a, b = EnginePools(1), EnginePools(2)
    async with plane(a, store, 2) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, keys("k", 2), pages(0, 1))])).wait()).ok
    gated = GatedStore(store, hold_gets=True)
    settled: list[int] = []
    before = b.snapshot()
    async with plane(b, gated, 2) as dp, opened_on_exit(gated):  # staged: the gate has no get_parts
        ticket = await dp.load([Transfer(PoolKind.FULL, keys("k", 2), pages(4, 5))], verify_all=True)
        ticket.add_layer_callback(lambda layer, landed: settled.append(layer))
        with anyio.fail_after(5):
            await gated.wait_held(1)
            assert gated.release(1) == 1  # layer group 0 arrives and verifies
            await gated.wait_held(1)  # group 1 is at the gate
        assert settled == [] and not ticket.done  # group 0 verified, but not reported...
        assert unchanged(before, b.snapshot())  # ...nor written
        gated.open()
        with anyio.fail_after(5):
            assert (await ticket.wait()).ok
        assert sorted(settled) == FULL_IDS
    assert torch.equal(b.k[3][16:24].view(torch.uint8), a.k[3][0:8].view(torch.uint8))
    await store.close()


def test_sync_facade_verify_all_missing_object_writes_nothing() -> None:
    a = EnginePools(1)
    with SyncDataPlane(a.views(), lambda: EmbeddedStore(16 << 20)) as dp:
        assert dp.offload(transfers("s", pages(0), 0)).result(timeout=10).ok
        before = a.snapshot()
        load = dp.load([Transfer(PoolKind.FULL, ["sk-0", "gone"], pages(6, 7)),
                        Transfer(PoolKind.MAMBA, ["ss"], [[3]])], verify_all=True, start=False)
        dp.start(load)
        out = load.result.result(timeout=10)
        assert not out.ok and out.faults == {"missing": 1}
        assert all(load.layer(layer).result(timeout=1) is False for layer in load.layer_ids)
        assert unchanged(before, a.snapshot())
        ok = dp.load(transfers("s", pages(6), 3), verify_all=True)
        assert ok.result.result(timeout=10).ok
        assert all(ok.layer(layer).result(timeout=1) for layer in ok.layer_ids)
        assert all(torch.equal(x, y) for x, y in zip(a.rows(pages(6)), a.rows(pages(0))))


async def test_held_arena_is_freed_once_a_verified_load_landed() -> None:
    store = EmbeddedStore(64 << 20)
    a, b = EnginePools(1), EnginePools(2)
    async with plane(a, store) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, keys("r", 8), pages(*range(8)))])).wait()).ok
    async with DataPlane(b.views(), store, namespace="test") as dp:
        actor = dp.actors[PoolKind.FULL]
        for _ in range(2):  # back to back: the arena is free again once a load landed
            out = await (await dp.load([Transfer(PoolKind.FULL, keys("r", 8), pages(*range(8, 16)))],
                                       verify_all=True)).wait()
            assert out.ok and not actor.arena.held_busy
    kv = 2 * len(FULL_IDS)  # K and V rows (no draft in this load)
    assert all(torch.equal(x, y) for x, y in zip(b.rows(pages(*range(8, 16)))[:kv], a.rows(pages(*range(8)))[:kv]))
    await store.close()


class _ShuffledScatter(_Forwarding):
    """Forwards ``inner``'s scatter calls, each after a seeded random delay, so store calls in
    flight together finish out of order; counts the most calls in flight at once. Declares no
    checksums: the runtime seals and verifies the rows itself."""

    def __init__(self, inner: EmbeddedStore, seed: int) -> None:
        import random

        super().__init__(inner)
        self.scattering = inner
        self._rng = random.Random(seed)
        self.in_flight = 0
        self.most_in_flight = 0
        self.calls = 0
        self._capabilities = StoreCapabilities(name="shuffled", touch=False, remove=True,
                                               zero_copy=False, scatter=True,
                                               checksums=isinstance(self, _ShuffledChecksums))

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._capabilities

    async def _later(self, call: Any) -> Any:
        self.in_flight += 1
        self.calls += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await anyio.sleep(self._rng.uniform(0, 0.02))
            return await call
        finally:
            self.in_flight -= 1

    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        return await self._later(self.scattering.put_parts(keys, parts))

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        return await self._later(self.scattering.get_parts(keys, parts))


class _ShuffledChecksums(_ShuffledScatter):
    """The same, for a store that checksums while it copies (the embedded store's calls)."""

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        return await self._later(self.scattering.put_sealed(keys, parts))

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        return await self._later(self.scattering.get_checked(keys, parts))


@pytest.mark.parametrize("checksums", [True, False], ids=["store-checksums", "runtime-checksums"])
async def test_in_place_sub_batches_in_flight_together_keep_each_header_with_its_rows(
        checksums: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """In place, two store calls run at once and the header slots rotate: with one or two
    objects per call and calls finishing out of order, every object still lands in its own
    rows under its own header, and never more than two calls are in flight."""
    from hylinker.runtime.dataplane import in_place
    from hylinker.stores.base import supports_checksums

    a, b = EnginePools(1), EnginePools(2)
    src, dst = pages(*range(14)), pages(*range(15, 1, -1))
    stride = -(-(a.views()[PoolKind.FULL].payload_bytes + 64) // 64) * 64
    monkeypatch.setattr(in_place, "IN_PLACE_CALL_BYTES", 2 * stride)  # at most 2 objects per call
    cls = _ShuffledChecksums if checksums else _ShuffledScatter
    store = cls(EmbeddedStore(16 << 20), seed=7)
    assert supports_checksums(store) is checksums
    cfg = DataPlaneConfig(in_place_min_bytes=0)
    kv = 2 * len(FULL_IDS)  # K and V of each layer (a FULL transfer does not move the draft)
    want = a.rows(src)[:kv]
    async with DataPlane(a.views(), store, cfg, namespace="test") as dp:
        out = await (await dp.offload([Transfer(PoolKind.FULL, keys("o", 14), src)])).wait()
        assert out.ok
    puts = store.calls
    assert puts >= 5 and store.most_in_flight == 2
    store.most_in_flight = 0
    async with DataPlane(b.views(), store, cfg, namespace="test") as dp:
        assert all(actor.arena.scatter for actor in dp.actors.values())
        out = await (await dp.load([Transfer(PoolKind.FULL, keys("o", 14), dst)])).wait()
        assert out.ok
    assert store.calls - puts >= 5 and store.most_in_flight == 2
    assert all(torch.equal(x, y) for x, y in zip(b.rows(dst)[:kv], want, strict=True))


@pytest.mark.parametrize(("n", "per"), [(1, 1), (48, 31), (256, 32), (7, 100), (100, 3)])
def test_hashed_sub_batches_ramp_up_and_cover_every_object_once(n: int, per: int) -> None:
    """Over a store that does not checksum, in-place sub-batches start at ``per/8`` objects
    and double up to ``per``: the first store call waits only for a small hash."""
    from hylinker.runtime.dataplane.in_place import _ramped

    batches = _ramped(n, per)
    assert [i for lo, hi in batches for i in range(lo, hi)] == list(range(n))
    sizes = [hi - lo for lo, hi in batches]
    assert max(sizes) <= per and sizes[0] <= max(1, -(-per // 8))
    assert all(b <= 2 * a for a, b in itertools.pairwise(sizes))


# ---- the verify-all arena grows to fit a load: registered once, kept for later loads


class _RegionLog(_Forwarding):
    """Forwards to ``inner``, recording the regions registered and unregistered (by address)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def register(self, region: torch.Tensor) -> None:
        self.registered.append(region.data_ptr())
        self.inner.register(region)

    def unregister(self, region: torch.Tensor) -> None:
        self.unregistered.append(region.data_ptr())
        self.inner.unregister(region)


async def _grown_loads(store: Store, *, max_bytes: int) -> tuple[_RegionLog, list[Any]]:
    """Offload 6 pages, then load 2, 4, 3 and 6 of them with verify-all through a plane whose
    held arena starts at one frame; returns the region log and the FULL actor's statistics
    after each load, every load byte-checked."""
    a, b = EnginePools(1), EnginePools(2)
    async with plane(a, store) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, keys("g", 6), pages(*range(6)))])).wait()).ok
    log = _RegionLog(store)
    frame = a.views()[PoolKind.FULL].payload_bytes + 64
    config = DataPlaneConfig(in_place=False, verify_all_staging_bytes=frame, verify_all_staging_max_bytes=max_bytes)
    stats = []
    kv = 2 * len(FULL_IDS)
    async with DataPlane(b.views(), log, config, namespace="test") as dp:
        actor = dp.actors[PoolKind.FULL]
        for n in (2, 4, 3, 6):
            dest = pages(*range(n))
            out = await (await dp.load([Transfer(PoolKind.FULL, keys("g", n), dest)], verify_all=True)).wait()
            assert out.ok and not actor.arena.held_busy
            assert all(torch.equal(x, y) for x, y in zip(b.rows(dest)[:kv], a.rows(pages(*range(n)))[:kv]))
            stats.append(actor.statistics())
    return log, stats


def _assert_grown(log: _RegionLog, stats: list[Any]) -> None:
    frame = EnginePools(0).views()[PoolKind.FULL].payload_bytes + 64
    # 2 frames: doubled from 1; 4: doubled; 3: fits; 6: doubled to 8
    assert [s.held_arena_growths for s in stats] == [1, 2, 2, 3]
    sizes = [s.held_arena_bytes for s in stats]
    assert sizes[0] >= 2 * frame and sizes[1] >= 4 * frame and sizes[2] == sizes[1] and sizes[3] >= 8 * frame
    # every arena it dropped was unregistered, and only those
    assert len(log.unregistered) == 3 and set(log.unregistered) <= set(log.registered)


async def test_a_larger_verify_all_load_grows_the_registered_arena() -> None:
    store = EmbeddedStore(64 << 20)
    _assert_grown(*await _grown_loads(store, max_bytes=1 << 30))
    await store.close()


async def test_the_grown_arena_is_what_mooncake_has_registered(mooncake_store: Store) -> None:
    from hylinker.stores.mooncake import MooncakeStore

    assert isinstance(mooncake_store, MooncakeStore)
    log, stats = await _grown_loads(mooncake_store, max_bytes=1 << 30)
    _assert_grown(log, stats)
    # the dropped arenas are gone from Mooncake's table; the plane closed, the last one stays
    # registered with the store (the store outlives the plane that lent it)
    assert not any(mooncake_store._batches.registered(ptr, 1) for ptr in log.unregistered)
    assert mooncake_store._batches.registered(log.registered[-1], stats[-1].held_arena_bytes)


async def test_a_load_over_the_arena_limit_takes_fresh_memory() -> None:
    store = EmbeddedStore(64 << 20)
    frame = EnginePools(0).views()[PoolKind.FULL].payload_bytes + 64
    log, stats = await _grown_loads(store, max_bytes=3 * frame)
    # 2 frames grows to 2; 4 is over the limit (fresh memory); 3 grows to the limit; 6 is over
    assert [s.held_arena_growths for s in stats] == [1, 1, 2, 2] and len(log.unregistered) == 2
    assert stats[-1].held_arena_bytes <= 3 * frame + 64
    await store.close()


def test_the_arena_limit_is_checked() -> None:
    with pytest.raises(ValueError, match="verify_all_staging_max_bytes"):
        DataPlaneConfig(verify_all_staging_max_bytes=-1)
