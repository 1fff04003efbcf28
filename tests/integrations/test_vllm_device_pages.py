"""The vLLM connector's device path (``integrations/vllm/device_pages.py``).

On CPU: the connector's own ``PageTransfers`` over CPU tensors standing in for device memory,
with the test kit's fake copy engine and events, so the ordering rules hold everywhere: a save is
copied on the copy stream after the forward's fence, the engine's stream waits for that copy,
nothing is written to the store before the copy's event completed; a load writes no row before
its fence and is reported only after its copies completed. The ``cuda`` tests build ``RawPages``
from CUDA tensors laid out as vLLM allocates them (``test_real_shapes.layer_outer``) and run the
real streams and events; they skip where torch sees no GPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_real_shapes import layer_outer

from hylinker.components.layout import PoolKind
from hylinker.integrations import store_host
from hylinker.integrations.config import PluginConfig
from hylinker.integrations.vllm.device_pages import DevicePages, device_pages_for
from hylinker.integrations.vllm.index import rank_key
from hylinker.integrations.vllm.pages import PageTransfers, RawPages
from hylinker.integrations.vllm.plan import TransferPlan
from hylinker.runtime.dataplane.device import CudaCopies
from hylinker.runtime.dataplane.events import DeviceEvent
from hylinker.testing.fakes import FakeDeviceCopies, FakeDeviceEvent
from hylinker.tools.harness.shapes import poll_loads

NB, BLOCK = 8, 16
SAVE = TransferPlan("a", ("k1", "k2"), (1, 2), ("s2",), (3,))
LOAD = TransferPlan("b", ("k1", "k2"), (5, 6), ("s2",), (7,))


class FakeEngine:
    """The engine's stream and a save copy engine, as fakes: what was fenced and waited for."""

    def __init__(self, *, fence_polls: int | None = 0, load_auto: bool = True) -> None:
        self.copies = FakeDeviceCopies()
        self.loads = {PoolKind.FULL: FakeDeviceCopies(auto=load_auto), PoolKind.MAMBA: FakeDeviceCopies(auto=load_auto)}
        self.fence_polls = fence_polls
        self.fences: list[FakeDeviceEvent] = []
        self.log: list[tuple[str, Any]] = []

    def engine_fence(self) -> DeviceEvent:
        self.fences.append(FakeDeviceEvent(polls=self.fence_polls))
        self.log.append(("fence", self.fences[-1]))
        return self.fences[-1]

    def copy_after(self, ev: DeviceEvent) -> None:
        self.log.append(("copy stream waits" if self.copies.streaming else "waits off the copy stream", ev))

    def engine_after(self, ev: DeviceEvent) -> None:
        self.log.append(("engine waits", ev))

    def pages(self) -> DevicePages:
        return DevicePages(self.copies, self.engine_fence, self.copy_after, self.engine_after, self.loads)


def _cache(seed: int, device: str = "cpu") -> tuple[torch.Tensor, RawPages]:
    """vLLM's hybrid allocation: 2 attention and 2 state layers overlaid on one buffer."""
    buf, kv, _ = layer_outer(2, BLOCK, NB, device=device)
    g = torch.Generator().manual_seed(seed)
    buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    return buf, RawPages(kv, NB)


def _blocks(pages: RawPages, blocks: tuple[int, ...]) -> list[torch.Tensor]:
    return [r[list(blocks)].cpu().clone() for r in pages.raws]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def host() -> Iterator[store_host.StoreHost]:
    h = store_host.acquire(PluginConfig.from_extra_config({"capacity_mb": 16}, where="test"))
    try:
        yield h
    finally:
        store_host.release(h)


def _transfers(host: store_host.StoreHost, pages: RawPages, device: DevicePages | None,
               made: list[PageTransfers], fingerprint: bytes = b"d" * 32) -> PageTransfers:
    made.append(PageTransfers(host, pages, fingerprint=fingerprint, with_state=True,
                              staging_bytes=3 * sum(pages.page_bytes), device=device))
    return made[-1]


def _stored(host: store_host.StoreHost, names: tuple[str, ...]) -> list[bool]:
    return host.portal.call(host.store.exists, [rank_key(n, 0) for n in names])


def test_host_pages_keep_the_cpu_path_and_mixed_devices_are_refused() -> None:
    _, pages = _cache(1)
    assert device_pages_for(pages.raws) is None
    with pytest.raises(ValueError, match="several devices"):
        device_pages_for([pages.raws[0], torch.empty((NB, 4), dtype=torch.uint8, device="meta")])


def test_a_save_is_copied_after_the_forward_and_stored_after_its_copy(host: store_host.StoreHost) -> None:
    engine = FakeEngine()
    buf, pages = _cache(1)
    made: list[PageTransfers] = []
    try:
        pt = _transfers(host, pages, engine.pages(), made)
        assert engine.copies.staged_bytes == 3 * sum(pages.page_bytes)  # staging from the copy engine
        want = _blocks(pages, (1, 2, 3))
        pt.save([SAVE])
        fence, copied = engine.fences[0], engine.copies.events[0]
        # the copy stream waited for the forward, then the engine's stream waited for the copy
        assert engine.log == [("fence", fence), ("copy stream waits", fence), ("engine waits", copied)]
        assert engine.copies.log == ["stream", "record"] and engine.copies.on_stream_ops == 1
        buf.view(torch.uint8).zero_()  # the next step's forward reuses the blocks: staged already
        time.sleep(0.05)
        assert _stored(host, SAVE.kv_keys + SAVE.state_keys) == [False] * 3  # the copy has not completed
        assert pt.statistics().saves_ok == 0 and pt.saves_in_flight() == 1
        engine.copies.complete()
        assert pt.drain(10.0) and pt.statistics().saves_ok == 1
        assert _stored(host, SAVE.kv_keys + SAVE.state_keys) == [True] * 3
        _, other = _cache(2)
        reader = _transfers(host, other, FakeEngine().pages(), made)
        reader.load(LOAD)
        assert poll_loads(reader, 30.0) == ({"b"}, set())
        assert _same(_blocks(other, (5, 6, 7)), want)  # what the blocks held when the step saved them
    finally:
        for pt in made:
            pt.close(5.0)


def test_a_load_writes_after_its_fence_and_is_reported_after_its_copies(host: store_host.StoreHost) -> None:
    _, src = _cache(3)
    made: list[PageTransfers] = []
    try:
        writer = _transfers(host, src, None, made)  # the CPU path writes the same frames
        writer.save([SAVE])
        assert writer.drain(10.0) and writer.statistics().saves_ok == 1
        want = _blocks(src, (1, 2, 3))
        engine = FakeEngine(fence_polls=None, load_auto=False)
        _, dst = _cache(4)
        before = _blocks(dst, (5, 6, 7))
        pt = _transfers(host, dst, engine.pages(), made)
        pt.load(LOAD)
        time.sleep(0.05)
        assert _same(_blocks(dst, (5, 6, 7)), before)  # the engine's stream is not past the fence
        assert pt.finished_loads() == (set(), set())
        engine.fences[0].set()
        deadline = time.monotonic() + 10
        while not all(c.events for c in engine.loads.values()) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)
        assert _same(_blocks(dst, (5, 6, 7)), want)  # the fake copies ran, their events did not complete
        assert pt.finished_loads() == (set(), set())  # so vLLM is not told the blocks are ready
        for c in engine.loads.values():
            c.complete()
        assert poll_loads(pt, 30.0) == ({"b"}, set())
    finally:
        for pt in made:
            pt.close(5.0)


def test_a_failed_copy_fails_the_save_and_gives_its_slots_back(host: store_host.StoreHost) -> None:
    engine = FakeEngine()
    _, pages = _cache(5)
    made: list[PageTransfers] = []
    try:
        pt = _transfers(host, pages, engine.pages(), made)
        pt.save([SAVE])  # three objects: every staging slot
        pt.save([TransferPlan("c", ("k9",), (4,), (), ())])
        assert pt.statistics().saves_skipped == 1  # no free slot while the copy is pending
        engine.copies.events[0].fail("device lost")
        assert pt.drain(10.0)
        stats = pt.statistics()
        assert (stats.saves_ok, stats.saves_failed) == (0, 1)
        assert _stored(host, SAVE.kv_keys + SAVE.state_keys) == [False] * 3
        _, dropped = pt.take_report()
        assert set(SAVE.kv_keys + SAVE.state_keys) <= set(dropped)
        pt.save([SAVE])  # the slots came back
        engine.copies.complete()
        assert pt.drain(10.0) and pt.statistics().saves_ok == 1
    finally:
        for pt in made:
            pt.close(5.0)


def test_a_copy_that_cannot_be_queued_gives_its_slots_back(host: store_host.StoreHost) -> None:
    engine = FakeEngine()

    def broken(ev: DeviceEvent) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _, pages = _cache(6)
    made: list[PageTransfers] = []
    try:
        pt = _transfers(host, pages, DevicePages(engine.copies, engine.engine_fence, broken, engine.engine_after,
                                                 engine.loads), made)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            pt.save([SAVE])
        assert len(pt._free) == 3 and pt.saves_in_flight() == 0
    finally:
        for pt in made:
            pt.close(5.0)


@pytest.mark.cuda
@pytest.mark.parametrize("block_outer", [False, True], ids=["layer-outer", "block-outer"])
def test_cuda_pages_round_trip_exactly(host: store_host.StoreHost, block_outer: bool) -> None:
    """vLLM's allocation on a GPU: saves on the copy stream into pinned staging, ordered before
    the engine's next writes to the same blocks; loads landed and verified before reported."""
    made: list[PageTransfers] = []
    buf, kv, _ = layer_outer(2, BLOCK, NB, block_outer=block_outer, device="cuda")
    buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device="cuda"))
    pages = RawPages(kv, NB)
    try:
        pt = _transfers(host, pages, None, made)
        assert pt.device is not None and all(s.is_pinned() for s in pt.staging)
        assert all(isinstance(a.copies, CudaCopies) for a in pt.engine_plane.actors.values())
        want = _blocks(pages, (1, 2, 3))
        pt.save([SAVE])
        buf.view(torch.uint8).zero_()  # queued on the engine's stream after the save: waits for the copy
        assert pt.drain(30.0) and pt.statistics().saves_ok == 1
        other = RawPages(layer_outer(2, BLOCK, NB, block_outer=block_outer, device="cuda")[1], NB)
        reader = _transfers(host, other, None, made)
        reader.load(LOAD)
        assert poll_loads(reader, 60.0) == ({"b"}, set())
        assert _same(_blocks(other, (5, 6, 7)), want)
        assert not _same(_blocks(other, (1, 2, 3)), want)  # control: other blocks untouched
        # negative control: a worker of another model geometry (fingerprint) reads nothing
        wrong = _transfers(host, RawPages(layer_outer(2, BLOCK, NB, block_outer=block_outer, device="cuda")[1], NB),
                           None, made, fingerprint=b"x" * 32)
        wrong.load(LOAD)
        assert poll_loads(wrong, 60.0) == (set(), {"b"})
    finally:
        for p in made:
            p.close(5.0)
