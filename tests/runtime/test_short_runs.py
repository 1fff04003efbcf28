"""A store whose transport pays per buffer (``StoreCapabilities.min_run_bytes``: Mooncake over TCP to
a peer's segment) gets objects of short pool runs staged, one buffer per object, and objects of long
runs in place by row calls; both restore exactly, and a verify-all load of staged objects still
writes no row unless the whole load verified. At 1, 2 and 12 layers per group (K and V: 2 to 24
segments), page 64; over the real Mooncake client as a pure client too."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer
from hylinker.runtime.dataplane.sync_plane import SyncDataPlane
from hylinker.stores.base import GetResult, Outcome, StoreCapabilities
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.mooncake_client import MooncakeConfig
from hylinker.stores.rows import RowBatch, RowResults

PAGE = 64
ROW = 128  # bytes per row of a part: one segment's run is 8 KiB


class PerBufferStore(EmbeddedStore):
    """The embedded store declaring a transport that pays per buffer, counting the objects each
    kind of call moved (row calls: in place; ``put`` / ``get``: staged frames)."""

    def __init__(self, capacity: int, min_run_bytes: int) -> None:
        super().__init__(capacity)
        self._caps = attrs.evolve(super().capabilities, min_run_bytes=min_run_bytes)
        self.moved = {"rows": 0, "frames": 0}

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._caps

    async def put_rows(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        self.moved["rows"] += len(batch.keys)
        return await super().put_rows(batch, hashed)

    async def get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        self.moved["rows"] += len(batch.keys)
        return await super().get_rows(batch, hashed)

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        self.moved["frames"] += len(keys)
        return await super().put(keys, buffers)

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        self.moved["frames"] += len(keys)
        return await super().get(keys, buffers)

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        self.moved["frames"] += len(keys)  # a staged frame, checksummed while copied
        return await super().put_sealed(keys, parts)

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        self.moved["frames"] += len(keys)
        return await super().get_checked(keys, parts)


def _pool(layers: int, pages: int, seed: int) -> tuple[PoolSet, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, 256, (pages * PAGE, ROW), dtype=torch.uint8, generator=g) for _ in range(2 * layers)]
    return PoolSet([kv_view(parts[0::2], parts[1::2], layer_ids=list(range(layers)), page_size=PAGE)]), parts


def _rows(page_ids: list[int]) -> torch.Tensor:
    return torch.tensor([[p * PAGE + r for r in range(PAGE)] for p in page_ids])


def _pages_equal(parts: list[torch.Tensor], a: int, b: int) -> bool:
    return all(torch.equal(t[a * PAGE:(a + 1) * PAGE], t[b * PAGE:(b + 1) * PAGE]) for t in parts)


@pytest.mark.parametrize("layers", [1, 2, 12])
@pytest.mark.parametrize("min_run", [0, 8 << 10, 16 << 10])
async def test_short_runs_move_staged_long_runs_in_place_and_both_restore_exactly(layers: int, min_run: int) -> None:
    n = 24
    pools, parts = _pool(layers, 3 * n, seed=layers)
    store = PerBufferStore(64 << 20, min_run)
    keys = [f"r{layers}-{min_run}-{i}" for i in range(n)]
    in_place = min_run <= PAGE * ROW  # every segment's run is one page of one part: 8 KiB
    async with DataPlane(pools, store) as dp:
        actor = dp.actors[PoolKind.FULL]
        assert actor.arena.in_place_groups == [in_place] and actor.arena.row_groups == [in_place]
        assert (await (await dp.offload([Transfer(PoolKind.FULL, keys, _rows(list(range(n))))])).wait()).ok
        assert store.moved == ({"rows": n, "frames": 0} if in_place else {"rows": 0, "frames": n})
        dest = list(range(2 * n - 1, n - 1, -1))
        assert (await (await dp.load([Transfer(PoolKind.FULL, keys, _rows(dest))])).wait()).ok
        assert all(_pages_equal(parts, i, d) for i, d in zip(range(n), dest))
        # verify-all: one damaged object fails the whole load before any row is written
        frame = torch.zeros(2 * layers * PAGE * ROW + 64, dtype=torch.uint8)
        await store.get([keys[3]], [frame])
        await store.remove([keys[3]])
        frame[-5] ^= 0x01
        await store.put([keys[3]], [frame])
        store.moved = {"rows": 0, "frames": 0}
        held = list(range(2 * n, 3 * n))
        before = [p.clone() for p in parts]
        ticket = await dp.load([Transfer(PoolKind.FULL, keys, _rows(held))], verify_all=True)
        out = await ticket.wait()
        assert not out.ok and out.faults == {"bad_checksum": 1}
        assert out.objects[PoolKind.FULL] == [i != 3 for i in range(n)]
        assert all(torch.equal(a, b) for a, b in zip(before, parts))  # no row written
        assert (store.moved["rows"] > 0) == in_place and (store.moved["frames"] > 0) != in_place
        ok_keys = keys[4:]
        ticket = await dp.load([Transfer(PoolKind.FULL, ok_keys, _rows(held[4:]))], verify_all=True)
        assert (await ticket.wait()).ok
        assert all(_pages_equal(parts, i, d) for i, d in zip(range(4, n), held[4:]))


def test_a_pure_tcp_client_declares_its_per_buffer_cost_and_nothing_else_does() -> None:
    address = "127.0.0.1:50051"
    assert MooncakeConfig(master_address=address, segment_bytes=0).min_run_bytes == 256 << 10
    assert MooncakeConfig(master_address=address).min_run_bytes == 0  # its own segment
    assert MooncakeConfig(master_address=address, segment_bytes=0, protocol="rdma").min_run_bytes == 0
    assert MooncakeConfig(master_address=address, segment_bytes=0, in_place_min_run_bytes=0).min_run_bytes == 0
    assert MooncakeConfig(master_address=address, in_place_min_run_bytes=4096).min_run_bytes == 4096
    with pytest.raises(ValueError, match="in_place_min_run_bytes"):
        MooncakeConfig(master_address=address, in_place_min_run_bytes=-1)


@pytest.mark.parametrize("layers", [1, 12])
def test_a_pure_mooncake_client_stages_short_runs_to_a_peers_segment(mooncake_master: Any, layers: int) -> None:
    """Over the real client: a storage-only process holds the segment, the data plane's store is a
    pure client over TCP; 8 KiB runs go staged (``put`` / ``get`` of whole frames, no row call),
    and every object restores exactly, verify-all included."""
    from hylinker.stores.mooncake import MooncakeStore
    from hylinker.tools.bench.mooncake import segment_process

    n = 64
    pools, parts = _pool(layers, 3 * n, seed=100 + layers)
    config = MooncakeConfig(master_address=mooncake_master.address, segment_bytes=0, workers=2)
    calls: list[str] = []

    async def factory() -> Any:
        store = await MooncakeStore.open(config)
        for name in ("put_rows", "get_rows", "put", "get"):
            real = getattr(store, name)

            async def call(*args: Any, _real: Any = real, _name: str = name) -> Any:
                calls.append(_name)
                return await _real(*args)
            setattr(store, name, call)
        return store

    keys = [f"tcp{layers}-{i}" for i in range(n)]
    with contextlib.ExitStack() as stack:
        segment_process(stack, mooncake_master.address, 64 << 20)
        with SyncDataPlane(pools, factory, DataPlaneConfig()) as dp:
            assert dp.offload([Transfer(PoolKind.FULL, keys, _rows(list(range(n))))]).result().ok
            dest = list(range(n, 2 * n))
            assert dp.load([Transfer(PoolKind.FULL, keys, _rows(dest))]).result.result().ok
            held = list(range(2 * n, 3 * n))
            assert dp.load([Transfer(PoolKind.FULL, keys, _rows(held))], verify_all=True).result.result().ok
    assert "put" in calls and "get" in calls
    assert "put_rows" not in calls and "get_rows" not in calls
    assert all(_pages_equal(parts, i, d) for i, d in zip(range(n), dest))
    assert all(_pages_equal(parts, i, d) for i, d in zip(range(n), held))
