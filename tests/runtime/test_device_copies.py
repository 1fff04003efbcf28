"""Device correctness with fakes: copies on the actor's copy stream, fences before reads,
"landed" only after the device copies completed. The ``cuda`` tests run the real path when a
GPU is present and skip cleanly otherwise."""

from __future__ import annotations

import anyio
import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view, state_view
from hylinker.runtime.dataplane.device import CudaCopies, DeviceCopies, copies_for
from hylinker.runtime.dataplane.plane import DataPlane, Transfer
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.fakes import FakeDeviceCopies, FakeDeviceEvent, GatedStore

P = 4
LAYERS = [0, 1, 2]


def pools(seed: int, device: str = "cpu") -> tuple[list[torch.Tensor], torch.Tensor, PoolSet]:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randint(0, 100, (32, 8), generator=g).to(torch.float32).to(device) for _ in LAYERS]
    temporal = torch.randint(0, 100, (2, 4, 3, 3), generator=g).to(torch.float32).to(device)
    conv = torch.randint(0, 100, (2, 4, 5), generator=g).to(torch.bfloat16).to(device)
    views = PoolSet([kv_view(k, layer_ids=LAYERS, page_size=P),
                     state_view([conv], temporal, layer_ids=[5, 6])])
    return k, temporal, views


def pages(*ids: int) -> torch.Tensor:
    return torch.tensor(ids)[:, None] * P + torch.arange(P)


def test_fake_copies_satisfy_the_protocol() -> None:
    assert isinstance(FakeDeviceCopies(), DeviceCopies)
    assert copies_for(torch.device("cpu")) is None
    with pytest.raises(ValueError):
        CudaCopies(torch.device("cpu"))


async def test_an_offload_reads_staging_only_after_the_device_copy() -> None:
    store = EmbeddedStore(8 << 20)
    gated = GatedStore(store)
    k, _, views = pools(1)
    fake = FakeDeviceCopies()
    fence = FakeDeviceEvent(polls=None)
    async with DataPlane(views, gated, copies={PoolKind.FULL: fake}) as dp:
        assert not dp.actors[PoolKind.FULL].arena.scatter  # device pools move through staging
        ticket = await dp.offload([Transfer(PoolKind.FULL, ["a", "b"], pages(1, 2))], fence=fence)
        await anyio.sleep(0.02)
        assert fake.log == []  # the engine's fence first: no copy was even queued
        fence.set()
        with anyio.fail_after(5):
            while not fake.events:
                await anyio.sleep(0.001)
        await anyio.sleep(0.02)
        assert gated.calls["put"] == 0  # the D2H copy has not completed: nothing sealed or put
        assert fake.log == ["stream", "record"] and fake.on_stream_ops == 1
        fake.complete()
        with anyio.fail_after(5):
            assert (await ticket.wait()).ok
    # what was stored is what the rows held
    k2, _, views2 = pools(2)
    async with DataPlane(views2, store, copies={PoolKind.FULL: FakeDeviceCopies(auto=True)}) as dp:
        assert (await (await dp.load([Transfer(PoolKind.FULL, ["a", "b"], pages(5, 6))])).wait()).ok
    assert all(torch.equal(a[4:12], b[20:28]) for a, b in zip(k, k2))
    await store.close()


async def test_a_load_is_landed_only_after_its_device_copies() -> None:
    store = EmbeddedStore(8 << 20)
    k, temporal, views = pools(1)
    async with DataPlane(views, store) as dp:
        done = await dp.offload([Transfer(PoolKind.FULL, ["a"], pages(0)), Transfer(PoolKind.MAMBA, ["s"], [[1]])])
        assert (await done.wait()).ok
    k2, temporal2, views2 = pools(2)
    fakes = {PoolKind.FULL: FakeDeviceCopies(), PoolKind.MAMBA: FakeDeviceCopies()}
    async with DataPlane(views2, store, copies=dict(fakes)) as dp:
        ticket = await dp.load([Transfer(PoolKind.FULL, ["a"], pages(3)), Transfer(PoolKind.MAMBA, ["s"], [[2]])])
        with anyio.fail_after(5):
            while any(not f.events for f in fakes.values()):
                await anyio.sleep(0.001)
        await anyio.sleep(0.02)
        # the bytes were scattered (the fake copies at once) but the events are pending:
        # nothing is reported landed, no waiter is released
        assert not ticket.done
        settled: list[tuple[int, bool]] = []
        ticket.add_layer_callback(lambda layer, landed: settled.append((layer, landed)))
        assert settled == []
        fakes[PoolKind.MAMBA].complete()
        with anyio.fail_after(5):
            assert await ticket.wait_layer(5) and await ticket.wait_layer(6)
        assert not ticket.done and sorted(settled) == [(5, True), (6, True)]
        fakes[PoolKind.FULL].complete()
        with anyio.fail_after(5):
            assert (await ticket.wait()).ok
    assert all(torch.equal(a[0:4], b[12:16]) for a, b in zip(k, k2))
    assert torch.equal(temporal[:, 1], temporal2[:, 2])
    await store.close()


async def test_a_failing_device_event_fails_the_load_and_releases_waiters() -> None:
    store = EmbeddedStore(8 << 20)
    _, _, views = pools(1)
    async with DataPlane(views, store) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, ["a"], pages(0))])).wait()).ok
    fake = FakeDeviceCopies()
    _, _, views2 = pools(2)
    async with DataPlane(views2, store, copies={PoolKind.FULL: fake}) as dp:
        ticket = await dp.load([Transfer(PoolKind.FULL, ["a"], pages(3))])
        with anyio.fail_after(5):
            while not fake.events:
                await anyio.sleep(0.001)
        fake.events[0].fail("device lost")
        with anyio.fail_after(5):
            out = await ticket.wait()
            assert not out.ok and [await ticket.wait_layer(layer) for layer in LAYERS] == [False] * 3
    await store.close()


@pytest.mark.cuda
async def test_cuda_round_trip_on_a_copy_stream() -> None:
    """The real device path: CUDA pools, a copy stream per actor, pinned staging."""
    store = EmbeddedStore(8 << 20)
    k, temporal, views = pools(1, "cuda")
    async with DataPlane(views, store) as dp:
        assert all(isinstance(a.copies, CudaCopies) for a in dp.actors.values())
        assert all(a.arena.arenas["load"].is_pinned() for a in dp.actors.values())
        fence = torch.cuda.Event()
        fence.record(torch.cuda.current_stream())
        done = await dp.offload([Transfer(PoolKind.FULL, ["a", "b"], pages(1, 2)),
                                 Transfer(PoolKind.MAMBA, ["s"], [[1]])], fence=fence)
        assert (await done.wait()).ok
    k2, temporal2, views2 = pools(2, "cuda")
    async with DataPlane(views2, store) as dp:
        ticket = await dp.load([Transfer(PoolKind.FULL, ["a", "b"], pages(6, 7)),
                                Transfer(PoolKind.MAMBA, ["s"], [[3]])])
        assert (await ticket.wait()).ok
        # landed means the copies completed: the compute stream reads without waiting
        assert all(torch.equal(a[4:12], b[24:32]) for a, b in zip(k, k2))
        assert torch.equal(temporal[:, 1], temporal2[:, 3])
    await store.close()
