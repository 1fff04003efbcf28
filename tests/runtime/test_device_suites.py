"""The data plane's round trips with device pools (the ``Linker``'s: ``test_data_plane.py``,
``test_linker_restores_exactly_through_the_data_plane``, its ``cuda`` case).

Each case runs twice: over CPU tensors standing in for device memory with the test kit's fake
copy engine (``FakeDeviceCopies``: the device code path, the device checksum and staging through
the copy engine, events that complete at once), in CI; and, ``cuda``-marked, over pools in CUDA
memory with the real copy streams, pinned staging and events, where torch sees a GPU (the
prepared device check, ``just gpu-check``, runs them). The host path's own suites are
``test_data_plane.py`` and the Linker's tests.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from test_data_plane import FULL_IDS, MAMBA_IDS, EnginePools, flip_a_payload_bit, pages, transfers

from hylinker.components.layout import PoolKind
from hylinker.runtime.dataplane.device import CudaCopies, DeviceCopies
from hylinker.runtime.dataplane.events import record_fence
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.framing import Integrity
from hylinker.testing.fakes import FakeDeviceCopies

PATHS = ["fake", pytest.param("cuda", marks=pytest.mark.cuda)]


def _device(path: str) -> str:
    return "cuda" if path == "cuda" else "cpu"


def _copies(path: str) -> Mapping[PoolKind, DeviceCopies] | None:
    """The fake copy engine per pool; ``None`` on CUDA (the data plane's own streams)."""
    if path == "cuda":
        return None
    return {kind: FakeDeviceCopies(auto=True) for kind in (PoolKind.FULL, PoolKind.MAMBA, PoolKind.DRAFT)}


def _plane(engine: EnginePools, store: EmbeddedStore, path: str, groups: int = 1,
           integrity: Integrity = Integrity.CHECKSUM) -> DataPlane:
    dp = DataPlane(engine.views(), store, DataPlaneConfig(layer_groups=groups, integrity=integrity),
                   namespace="test", copies=_copies(path))
    want = CudaCopies if path == "cuda" else FakeDeviceCopies
    assert all(isinstance(a.copies, want) for a in dp.actors.values())
    return dp


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("integrity", [Integrity.CHECKSUM, Integrity.HEADER], ids=["checksum", "header"])
@pytest.mark.parametrize("groups", [1, 2])
async def test_device_pools_round_trip_exactly(path: str, integrity: Integrity, groups: int) -> None:
    store = EmbeddedStore(16 << 20)
    a, b = EnginePools(1, _device(path)), EnginePools(2, _device(path))
    src_rows, dst_rows = pages(3, 0, 9), pages(1, 12, 5)
    async with _plane(a, store, path, groups, integrity) as dp:
        fence = record_fence(torch.device(_device(path)))  # the forward that wrote the rows
        out = await (await dp.offload(transfers("x", src_rows, 4), fence=fence)).wait()
        assert out.ok and out.objects[PoolKind.FULL] == [True] * 3
    before = b.snapshot()
    async with _plane(b, store, path, groups, integrity) as dp:
        ticket = await dp.load(transfers("x", dst_rows, 2))
        assert (await ticket.wait()).ok
        assert all([await ticket.wait_layer(layer) for layer in ticket.layer_ids])
    assert all(torch.equal(x, y) for x, y in zip(b.rows(dst_rows), a.rows(src_rows)))
    assert all(torch.equal(x, y) for x, y in zip(b.slot(2), a.slot(4)))
    keep = torch.ones(before[0].shape[0], dtype=torch.bool)
    keep[dst_rows.reshape(-1)] = False  # control: every other row as it was
    assert all(torch.equal(old[keep.to(old.device)].view(torch.uint8), new[keep.to(new.device)].view(torch.uint8))
               for old, new in zip(before[:2 * len(FULL_IDS)], b.snapshot()[:2 * len(FULL_IDS)]))
    await store.close()


@pytest.mark.parametrize("path", PATHS)
async def test_a_damaged_object_fails_a_verified_load_before_any_layer(path: str) -> None:
    store = EmbeddedStore(16 << 20)
    a, b = EnginePools(1, _device(path)), EnginePools(2, _device(path))
    async with _plane(a, store, path) as dp:
        assert (await (await dp.offload(transfers("z", pages(0, 1), 0))).wait()).ok
    await flip_a_payload_bit(store, "zk-1", a.views()[PoolKind.FULL].payload_bytes)
    settled: list[tuple[int, bool]] = []
    async with _plane(b, store, path) as dp:
        ticket = await dp.load(transfers("z", pages(2, 3), 1), verify_all=True)
        ticket.add_layer_callback(lambda layer, landed: settled.append((layer, landed)))
        out = await ticket.wait()
        assert not out.ok and out.faults == {"bad_checksum": 1}
        assert out.objects[PoolKind.FULL] == [True, False]
        assert settled and all(not landed for _, landed in settled)
        assert [await ticket.wait_layer(layer) for layer in [*FULL_IDS, *MAMBA_IDS]] == [False] * 6
    await store.close()
