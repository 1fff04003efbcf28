"""Integrity on the device for device pools (``runtime/dataplane/device_transfers.py``; the frame kinds
themselves: ``tests/stores/test_frame_kinds.py``): version-3 frames
carry the device checksum, summed on the copy stream over the rows and verified there over the
bytes as they landed, before a layer is reported; host and device readers read each other's
frames by what the header says; registered device rows move with no staging.

On CPU through ``FakeDeviceCopies`` (the device code path on host tensors); the ``cuda`` tests
run the real CUDA path (and the registered path on a Mooncake master) where torch sees a GPU."""

from __future__ import annotations

import collections
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view
from hylinker.runtime.dataplane import device_transfers
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer
from hylinker.runtime.dataplane.transfer_codec import PoolCodec
from hylinker.stores import framing
from hylinker.stores.base import GetResult, Outcome, Store
from hylinker.stores.device_checksum import device_checksum
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.framing import HEADER_BYTES, Checksum, Integrity
from hylinker.testing.fakes import FakeDeviceCopies

P = 4  # rows per page
ROWS = 32
WIDTH = 1024  # an object: 2 layers x K, V x 4 rows x 1 KiB = 16 KiB
OBJECT = HEADER_BYTES + 2 * 2 * P * WIDTH
Pools = tuple[list[torch.Tensor], list[torch.Tensor]]


class DeviceAddressing(EmbeddedStore):
    """An embedded store that declares ``device_memory``: the fake device's rows are host
    tensors, so its scatter-gather calls reach them as a GPU-capable Mooncake reaches GPU rows.
    Counts its calls and keeps what was registered."""

    def __init__(self, capacity: int, max_batch: int = 4096) -> None:
        super().__init__(capacity)
        self._capabilities = attrs.evolve(self._capabilities, device_memory=True, max_batch=max_batch)
        self.calls: collections.Counter[str] = collections.Counter()
        self.registered: list[int] = []

    def register(self, region: torch.Tensor) -> None:
        self.registered.append(region.data_ptr())
        super().register(region)

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        self.calls["put"] += 1
        return await super().put(keys, buffers)

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        self.calls["get"] += 1
        return await super().get(keys, buffers)

    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        self.calls["put_parts"] += 1
        return await super().put_parts(keys, parts)

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        self.calls["get_parts"] += 1
        return await super().get_parts(keys, parts)


def _pools(seed: int, device: str = "cpu") -> Pools:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randint(0, 256, (ROWS, WIDTH), dtype=torch.uint8, generator=g).to(device) for _ in range(2)]
    v = [torch.randint(0, 256, (ROWS, WIDTH), dtype=torch.uint8, generator=g).to(device) for _ in range(2)]
    return k, v


def _plane(pools: Pools, store: Store, *, device: bool, path: str = "staged",
           copies: FakeDeviceCopies | None = None, level: Integrity = Integrity.CHECKSUM,
           staging_frames: int = 0) -> DataPlane:
    """``device``: the pool goes through FakeDeviceCopies (unless its tensors are on CUDA,
    which get the real copies); ``path``: "staged", "in-place" (host pools; for device pools:
    registered, when the store addresses device memory) or "held" (verify-all loads)."""
    k, v = pools
    config = DataPlaneConfig(integrity=level, in_place=path == "in-place", in_place_min_bytes=0,
                             staging_bytes_per_pool=staging_frames * (OBJECT + 64) or 16 << 20)
    fake = {PoolKind.FULL: copies or FakeDeviceCopies(auto=True)} if device and k[0].device.type == "cpu" else None
    return DataPlane(PoolSet([kv_view(k, v, layer_ids=[0, 1], page_size=P)]), store, config,
                     namespace="device-integrity", copies=fake)


def _rows(*pages: int) -> torch.Tensor:
    return torch.tensor(pages)[:, None] * P + torch.arange(P)


def _same_rows(a: Pools, src: torch.Tensor, b: Pools, dst: torch.Tensor) -> bool:
    r_src, r_dst = src.reshape(-1), dst.reshape(-1)
    return all(torch.equal(y[r_dst.to(y.device)].cpu(), x[r_src.to(x.device)].cpu())
               for x, y in zip((*a[0], *a[1]), (*b[0], *b[1])))


def _keys(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"{prefix}/o{i}" for i in range(n)]


async def _offload(pools: Pools, store: Store, keys: list[str], rows: torch.Tensor, *, device: bool,
                   path: str = "staged") -> None:
    async with _plane(pools, store, device=device, path=path) as dp:
        out = await (await dp.offload([Transfer(PoolKind.FULL, keys, rows)])).wait()
        assert out.ok, out.faults


async def _load(pools: Pools, store: Store, keys: list[str], rows: torch.Tensor, *, device: bool,
                path: str = "staged") -> tuple[Any, list[bool], dict[str, int], Any]:
    """(outcome, layers reported landed, faults, the pool's statistics)"""
    async with _plane(pools, store, device=device, path=path) as dp:
        ticket = await dp.load([Transfer(PoolKind.FULL, keys, rows)], verify_all=path == "held")
        out = await ticket.wait()
        layers = [await ticket.wait_layer(layer) for layer in (0, 1)]
        stats = dp.pool_statistics()[PoolKind.FULL.value]
    return out, layers, dict(out.faults), stats


async def _raw(store: Store, key: str) -> torch.Tensor:
    frame = torch.zeros(OBJECT, dtype=torch.uint8)
    got = await store.get([key], [frame])
    assert got[0].outcome is Outcome.OK and got[0].nbytes == OBJECT
    return frame


@pytest.fixture
def no_host_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any XXH3 pass over a payload fails the test (the device path must not make one)."""
    class NoXxh3:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"xxhash.{name} called on the device path")

    monkeypatch.setattr(framing, "xxhash", NoXxh3())
    monkeypatch.setattr(device_transfers, "xxhash", NoXxh3())


# ---- the device path through FakeDeviceCopies ------------------------------------------------


async def test_device_pools_write_the_device_checksum_summed_on_the_copy_stream(
        monkeypatch: pytest.MonkeyPatch, no_host_hash: None) -> None:
    """Offload: version-3 frames whose checksum equals the CPU value of the stored payload,
    summed while the copy stream was current; load: restored byte for byte, verified on the
    device, with no XXH3 pass anywhere."""
    fake = FakeDeviceCopies(auto=True)
    where: list[bool] = []
    real = device_transfers.device_checksums

    def spy(rows: torch.Tensor) -> torch.Tensor:
        where.append(fake.streaming)
        return real(rows)

    monkeypatch.setattr(device_transfers, "device_checksums", spy)
    monkeypatch.setattr(device_transfers, "verify_on_device",
                        lambda rows, expected: spy(rows) == expected.to(torch.int64))
    store = EmbeddedStore(64 << 20)
    src, dst = _pools(1), _pools(2)
    keys, a, b = _keys(3), _rows(3, 0, 6), _rows(1, 7, 4)
    try:
        async with _plane(src, store, device=True, copies=fake) as dp:
            assert (await (await dp.offload([Transfer(PoolKind.FULL, keys, a)])).wait()).ok
        assert where == [True]  # one sub-batch, summed on the copy stream
        for key in keys:
            frame = await _raw(store, key)
            assert frame[4:8].tolist() == [framing.DEVICE_SUM_VERSION, 0, framing.FLAG_DEVICE_SUM, 0]
            stored = int.from_bytes(bytes(frame[framing.CHECKSUM_OFFSET:framing.CHECKSUM_OFFSET + 8].tolist()), "little")
            assert stored == device_checksum(frame[HEADER_BYTES:])
        async with _plane(dst, store, device=True, copies=fake) as dp:
            out = await (await dp.load([Transfer(PoolKind.FULL, keys, b)])).wait()
            assert out.ok, out.faults
            assert dp.pool_statistics()[PoolKind.FULL.value].verify_failures == 0
        assert _same_rows(src, a, dst, b)
        assert where[1:] == [True]  # compared on the copy stream
    finally:
        await store.close()


@pytest.mark.parametrize("reader_path", ["staged", "in-place", "held"])
async def test_a_host_pool_reads_device_summed_frames(reader_path: str) -> None:
    src, dst = _pools(3), _pools(4)
    keys, a, b = _keys(3), _rows(2, 5, 0), _rows(6, 1, 3)
    store = EmbeddedStore(64 << 20)  # checksumming: its XXH3 of what landed is not used here
    try:
        await _offload(src, store, keys, a, device=True)
        out, layers, faults, _ = await _load(dst, store, keys, b, device=False, path=reader_path)
        assert out.ok and layers == [True, True], faults
        assert _same_rows(src, a, dst, b)
    finally:
        await store.close()


@pytest.mark.parametrize("path", ["staged", "held", "registered"])
async def test_a_device_pool_reads_host_frames_by_their_xxh3(path: str) -> None:
    """Version-1 frames (host writers) read into device pools: hashed on the host, in staging
    or after a copy of the registered rows to the host."""
    src, dst = _pools(5), _pools(6)
    keys, a, b = _keys(3), _rows(0, 1, 2), _rows(5, 3, 7)
    store = DeviceAddressing(64 << 20)
    try:
        await _offload(src, store, keys, a, device=False)
        assert (await _raw(store, keys[0]))[4].item() == framing.FORMAT_VERSION
        out, layers, faults, _ = await _load(dst, store, keys, b, device=True,
                                             path="in-place" if path == "registered" else path)
        assert out.ok and layers == [True, True], faults
        assert _same_rows(src, a, dst, b)
        assert (store.calls["get_parts"] > 0) == (path == "registered")
    finally:
        await store.close()


@pytest.mark.parametrize("reader", ["device-staged", "device-held", "device-registered", "host"])
async def test_a_corrupt_device_summed_object_fails_the_load_with_no_layer_reported(reader: str) -> None:
    """The middle object's stored payload has one flipped byte: caught (on the device, or on
    the host by the same function), read a second time, counted failed; no layer reported, in
    the default mode and in verify-all."""
    src, dst = _pools(7), _pools(8)
    keys, a, b = _keys(3), _rows(2, 5, 0), _rows(6, 1, 3)
    scratch = EmbeddedStore(16 << 20)
    store = DeviceAddressing(64 << 20)
    try:
        await _offload(src, scratch, keys, a, device=True)
        frames = [await _raw(scratch, k) for k in keys]
        frames[1][OBJECT - 5] ^= 0x40
        assert await store.put(keys, frames) == [Outcome.OK] * 3
        path = {"device-staged": "staged", "device-held": "held", "device-registered": "in-place"}.get(reader, "staged")
        out, layers, faults, stats = await _load(dst, store, keys, b, device=reader != "host", path=path)
        assert not out.ok and layers == [False, False]
        assert out.objects[PoolKind.FULL] == [True, False, True]
        assert faults == {"bad_checksum": 1}
        assert (stats.rereads_recovered, stats.rereads_failed, stats.verify_failures) == (0, 1, 1)
    finally:
        await scratch.close()
        await store.close()


@pytest.mark.parametrize("path", ["staged", "held"])
async def test_damage_between_staging_and_the_rows_is_caught_on_the_device(
        monkeypatch: pytest.MonkeyPatch, path: str, no_host_hash: None) -> None:
    """The first scatter into the rows damages one byte (the staged bytes are intact, so a
    host check of staging would pass): the rows' device checksum catches it, the object is
    read again, lands whole and the load restores."""
    real = PoolCodec.scatter
    damaged: list[int] = []

    def scatter(self: PoolCodec, src: torch.Tensor, index: torch.Tensor, on_layer: Any = None) -> None:
        real(self, src, index, on_layer)
        if not damaged:
            self.view.layers[1].parts[0][int(index[0, 0])][7] ^= 0x02
            damaged.append(1)

    src, dst = _pools(9), _pools(10)
    keys, a, b = _keys(3), _rows(0, 4, 2), _rows(1, 5, 3)
    store = EmbeddedStore(64 << 20)
    try:
        await _offload(src, store, keys, a, device=True)
        monkeypatch.setattr(PoolCodec, "scatter", scatter)
        out, layers, faults, stats = await _load(dst, store, keys, b, device=True, path=path)
        assert damaged and out.ok and layers == [True, True], faults
        assert _same_rows(src, a, dst, b)
        assert (stats.rereads_recovered, stats.rereads_failed) == (1, 0)
    finally:
        await store.close()


async def test_no_layer_is_reported_before_the_device_verification_completed() -> None:
    import anyio

    src, dst = _pools(11), _pools(12)
    keys, a, b = _keys(2), _rows(0, 1), _rows(2, 3)
    store = EmbeddedStore(64 << 20)
    try:
        await _offload(src, store, keys, a, device=True)
        fake = FakeDeviceCopies()
        async with _plane(dst, store, device=True, copies=fake) as dp:
            ticket = await dp.load([Transfer(PoolKind.FULL, keys, b)])
            with anyio.fail_after(5):
                while not fake.events:
                    await anyio.sleep(0.001)
            await anyio.sleep(0.02)
            settled: list[tuple[int, bool]] = []
            ticket.add_layer_callback(lambda layer, landed: settled.append((layer, landed)))
            assert not ticket.done and settled == []  # rows written, comparison not completed
            fake.complete()
            with anyio.fail_after(5):
                assert (await ticket.wait()).ok
            assert sorted(settled) == [(0, True), (1, True)]
        assert _same_rows(src, a, dst, b)
    finally:
        await store.close()


@pytest.mark.parametrize("level", list(Integrity), ids=lambda i: i.value)
async def test_registered_device_rows_move_in_place_with_no_staging(level: Integrity, no_host_hash: None) -> None:
    """A store that addresses device memory: the pool rows are registered, every object moves
    with put_parts / get_parts straight from and into the rows (no whole-frame put or get), and
    the device checksum is written and verified (at "header": unhashed frames, no sums)."""
    src, dst = _pools(13), _pools(14)
    keys, a, b = _keys(5), _rows(0, 2, 4, 6, 1), _rows(7, 5, 3, 1, 0)
    store = DeviceAddressing(64 << 20)
    try:
        async with _plane(src, store, device=True, path="in-place", level=level) as dp:
            actor = dp.actors[PoolKind.FULL]
            assert actor.arena.in_place_groups == [True] and actor.arena.scatter
            rows = {t.data_ptr() for t in (*src[0], *src[1])}
            assert rows <= set(store.registered)
            assert (await (await dp.offload([Transfer(PoolKind.FULL, keys, a)])).wait()).ok
        frame = await _raw(store, keys[0])
        kind = Checksum.DEVICE if level is Integrity.CHECKSUM else Checksum.NONE
        assert (frame[4].item(), frame[6].item()) == kind.value
        async with _plane(dst, store, device=True, path="in-place", level=level) as dp:
            out = await (await dp.load([Transfer(PoolKind.FULL, keys, b)])).wait()
            assert out.ok, out.faults
        assert _same_rows(src, a, dst, b)
        assert store.calls["put"] == 0 and store.calls["get"] == 1  # the one get: _raw above
        assert store.calls["put_parts"] >= 1 and store.calls["get_parts"] >= 1
    finally:
        await store.close()


@pytest.mark.parametrize("path", ["staged", "held", "in-place"])
async def test_many_sub_batches_round_trip_and_a_corrupt_one_is_pinpointed(path: str) -> None:
    """Seven objects in sub-batches of two (staging of four frames; the registered store takes
    two keys per call): restored byte for byte; then the fourth object (second sub-batch) is
    damaged in the store and only it fails."""
    src, dst = _pools(15), _pools(16)
    keys, a, b = _keys(7), _rows(0, 1, 2, 3, 4, 5, 6), _rows(7, 6, 5, 4, 3, 2, 1)
    store = DeviceAddressing(64 << 20, max_batch=2)
    try:
        async with _plane(src, store, device=True, path=path, staging_frames=4) as dp:
            assert dp.actors[PoolKind.FULL].arena.batch == 2
            assert (await (await dp.offload([Transfer(PoolKind.FULL, keys, a)])).wait()).ok
        calls = store.calls["put_parts" if path == "in-place" else "put"]
        assert calls == 4
        async with _plane(dst, store, device=True, path=path, staging_frames=4) as dp:
            ticket = await dp.load([Transfer(PoolKind.FULL, keys, b)], verify_all=path == "held")
            assert (await ticket.wait()).ok
        assert _same_rows(src, a, dst, b)
        frames = [await _raw(store, k) for k in keys]
        frames[3][HEADER_BYTES + 100] ^= 0x01
        await store.remove(keys)
        assert await store.put(keys, frames) == [Outcome.OK] * 7
        async with _plane(dst, store, device=True, path=path, staging_frames=4) as dp:
            ticket = await dp.load([Transfer(PoolKind.FULL, keys, b)], verify_all=path == "held")
            out = await ticket.wait()
            assert [await ticket.wait_layer(layer) for layer in (0, 1)] == [False, False]
        assert out.objects[PoolKind.FULL] == [True, True, True, False, True, True, True]
        assert dict(out.faults) == {"bad_checksum": 1}
    finally:
        await store.close()


async def test_a_store_without_device_memory_keeps_the_staged_path() -> None:
    store = EmbeddedStore(8 << 20)
    try:
        async with _plane(_pools(1), store, device=True, path="in-place") as dp:
            actor = dp.actors[PoolKind.FULL]
            assert actor.arena.in_place_groups == [False] and not actor.arena.scatter and actor.arena.device_sums
    finally:
        await store.close()


# ---- Mooncake: can the client address device memory? ---------------------------------------


async def test_mooncake_says_whether_its_client_addresses_device_memory(
        mooncake_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's build decides (its CUDA libraries); this machine's client (the non-CUDA
    wheel) cannot, so the store says no, says why, refuses device regions, and device pools
    over it stay staged. A client that links the CUDA runtime would say yes."""
    import mooncake.store as mooncake_module

    from hylinker.stores import mooncake_client
    from hylinker.stores.mooncake import MooncakeStore

    assert isinstance(mooncake_store, MooncakeStore)
    needed = mooncake_client.needed_libraries(str(mooncake_module.__file__))
    assert "libibverbs.so.1" in needed  # what readelf -d lists for the installed client
    if any(n.startswith(("libcuda.", "libcudart")) for n in needed):
        pytest.skip("this Mooncake client links CUDA: the cuda tests cover it")
    assert not mooncake_store.capabilities.device_memory
    assert "without GPU support" in mooncake_store.device_memory_reason
    with pytest.raises(ValueError, match="without GPU support"):
        mooncake_store.register(torch.empty(4096, dtype=torch.uint8, device="meta"))
    async with _plane(_pools(1), mooncake_store, device=True, path="in-place") as dp:
        assert dp.actors[PoolKind.FULL].arena.in_place_groups == [False]
    config = mooncake_store.config
    mooncake_client._client_links.cache_clear()
    monkeypatch.setattr(mooncake_client, "needed_libraries", lambda path: ["libc.so.6", "libcudart.so.12"])
    try:
        assert mooncake_client.device_memory_support(config) == (
            True, f"{mooncake_module.__file__} links libcudart.so.12 (built with GPU support)")
        assert mooncake_client.device_memory_support(attrs.evolve(config, device_memory=False))[0] is False
    finally:
        mooncake_client._client_links.cache_clear()


# ---- CUDA: the real copy path, and Mooncake with device memory --------------------------------


@pytest.mark.cuda
async def test_cuda_device_checksum_written_equals_the_cpu_value_and_round_trips(no_host_hash: None) -> None:
    store = EmbeddedStore(64 << 20)
    src, dst = _pools(21, "cuda"), _pools(22, "cuda")
    keys, a, b = _keys(4), _rows(0, 3, 5, 7), _rows(1, 2, 4, 6)
    try:
        await _offload(src, store, keys, a, device=True)
        for key in keys:
            frame = await _raw(store, key)
            stored = int.from_bytes(bytes(frame[framing.CHECKSUM_OFFSET:framing.CHECKSUM_OFFSET + 8].tolist()), "little")
            assert frame[4].item() == framing.DEVICE_SUM_VERSION
            assert stored == device_checksum(frame[HEADER_BYTES:]) == device_checksum(frame[HEADER_BYTES:].cuda())
        out, layers, faults, _ = await _load(dst, store, keys, b, device=True)
        assert out.ok and layers == [True, True], faults
        assert _same_rows(src, a, dst, b)
    finally:
        await store.close()


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["staged", "held"])
async def test_cuda_corrupt_object_is_caught_on_the_device(path: str) -> None:
    src, dst = _pools(23, "cuda"), _pools(24, "cuda")
    keys, a, b = _keys(3), _rows(2, 5, 0), _rows(6, 1, 3)
    scratch, store = EmbeddedStore(16 << 20), EmbeddedStore(64 << 20)
    try:
        await _offload(src, scratch, keys, a, device=True)
        frames = [await _raw(scratch, k) for k in keys]
        frames[1][OBJECT - 9] ^= 0x10
        assert await store.put(keys, frames) == [Outcome.OK] * 3
        out, layers, faults, stats = await _load(dst, store, keys, b, device=True, path=path)
        assert not out.ok and layers == [False, False] and faults == {"bad_checksum": 1}
        assert out.objects[PoolKind.FULL] == [True, False, True] and stats.rereads_failed == 1
    finally:
        await scratch.close()
        await store.close()


@pytest.mark.cuda
async def test_cuda_host_and_device_pools_read_each_other() -> None:
    store = EmbeddedStore(64 << 20)
    host, gpu = _pools(25), _pools(26, "cuda")
    k1, k2, a, b = _keys(2), _keys(2), _rows(0, 1), _rows(2, 3)
    try:
        await _offload(host, store, k1, a, device=False)
        out, _, faults, _ = await _load(gpu, store, k1, b, device=True)
        assert out.ok and _same_rows(host, a, gpu, b), faults
        await _offload(gpu, store, k2, b, device=True)
        out, _, faults, _ = await _load(host, store, k2, _rows(6, 7), device=False)
        assert out.ok and _same_rows(gpu, b, host, _rows(6, 7)), faults
    finally:
        await store.close()


@pytest.mark.cuda
async def test_cuda_registered_pools_on_a_mooncake_master(mooncake_master: Any) -> None:
    """GPU rows registered with Mooncake and moved straight into and out of them, verified
    with the device checksum; a corrupt object is caught on the device."""
    from hylinker.stores.mooncake import MooncakeConfig, MooncakeStore

    if not mooncake_master.running:
        mooncake_master.start()
    store = await MooncakeStore.open(MooncakeConfig(master_address=mooncake_master.address, segment_bytes=64 << 20,
                                                    bounce_bytes=4 << 20, workers=2))
    try:
        if not store.capabilities.device_memory:
            pytest.skip(f"this Mooncake client cannot address GPU memory: {store.device_memory_reason}")
        src, dst = _pools(27, "cuda"), _pools(28, "cuda")
        keys, a, b = _keys(4), _rows(0, 2, 4, 6), _rows(7, 5, 3, 1)
        async with _plane(src, store, device=True, path="in-place") as dp:
            assert dp.actors[PoolKind.FULL].arena.in_place_groups == [True]
            assert (await (await dp.offload([Transfer(PoolKind.FULL, keys, a)])).wait()).ok
        out, layers, faults, _ = await _load(dst, store, keys, b, device=True, path="in-place")
        assert out.ok and layers == [True, True], faults
        assert _same_rows(src, a, dst, b)
        frames = [await _raw(store, k) for k in keys[:3]]
        frames[1][OBJECT - 9] ^= 0x10
        await store.remove(keys[:3])
        assert await store.put(keys[:3], frames) == [Outcome.OK] * 3
        out, layers, faults, stats = await _load(dst, store, keys[:3], b[:3], device=True, path="in-place")
        assert not out.ok and layers == [False, False] and faults == {"bad_checksum": 1}
        assert out.objects[PoolKind.FULL] == [True, False, True] and stats.rereads_failed == 1
    finally:
        await store.close()
