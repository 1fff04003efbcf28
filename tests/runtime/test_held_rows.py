"""Verify-all loads over a store with row-described calls (the embedded store): every object is got
into private rows laid out like the pool's segments and verified by sub-batch; no pool row is
written unless the whole load verified, then one copy per segment lands it. At 1, 2 and 12 layers
per group (K and V: 2 to 24 segments), page 64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view
from hylinker.runtime.dataplane.plane import DataPlane, Transfer
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.rows import RowBatch, RowResults

PAGE = 64
ROW = 128  # bytes per row of each part: 1 layer is a 16 KiB object, 12 layers 192 KiB (held, not in place)


class RowCountingStore(EmbeddedStore):
    """The embedded store, counting the objects its row-described gets moved (a subclass that
    changed another data call would be moved around the row calls: ``stores.base.supports_rows``)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.got_rows = 0
        self.calls = 0

    async def put_rows(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        self.calls += 1
        return await super().put_rows(batch, hashed)

    async def get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        self.got_rows += len(batch.keys)
        self.calls += 1
        return await super().get_rows(batch, hashed)


def _pool(layers: int, pages: int) -> tuple[PoolSet, list[torch.Tensor]]:
    parts = [torch.randint(0, 256, (pages * PAGE, ROW), dtype=torch.uint8) for _ in range(2 * layers)]
    return PoolSet([kv_view(parts[0::2], parts[1::2], layer_ids=list(range(layers)), page_size=PAGE)]), parts


def _rows(page_ids: list[int]) -> torch.Tensor:
    return torch.tensor([[p * PAGE + r for r in range(PAGE)] for p in page_ids])


def _page(t: torch.Tensor, p: int) -> torch.Tensor:
    return t[p * PAGE:(p + 1) * PAGE]


@pytest.mark.parametrize("layers", [1, 2, 12])
async def test_a_verify_all_load_lands_every_segment_only_once_the_whole_load_verified(layers: int) -> None:
    n = 40
    pools, parts = _pool(layers, 2 * n)
    store = RowCountingStore(64 << 20)
    keys = [f"h{layers}-{i}" for i in range(n)]
    dest = list(range(2 * n - 1, n - 1, -1))  # other pages, in another order: the rows follow the index
    async with DataPlane(pools, store) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, keys, _rows(list(range(n))))])).wait()).ok
        frame = torch.zeros(2 * layers * PAGE * ROW + 64, dtype=torch.uint8)  # damage one object
        await store.get([keys[n // 2]], [frame])
        await store.remove([keys[n // 2]])
        frame[-7] ^= 0x10
        await store.put([keys[n // 2]], [frame])
        store.got_rows = 0
        before = [p.clone() for p in parts]
        ticket = await dp.load([Transfer(PoolKind.FULL, keys, _rows(dest))], verify_all=True)
        out = await ticket.wait()
        assert not out.ok and out.faults == {"bad_checksum": 1}
        assert out.objects[PoolKind.FULL] == [i != n // 2 for i in range(n)]  # which verified
        assert not any([await ticket.wait_layer(layer) for layer in ticket.layer_ids])
        assert all(torch.equal(a, b) for a, b in zip(before, parts))  # no row written
        assert store.got_rows == n + 1  # row-described gets: every object, and the bad one once more
        half = n // 2
        ticket = await dp.load([Transfer(PoolKind.FULL, keys[:half], _rows(dest[:half]))], verify_all=True)
        assert (await ticket.wait()).ok
        assert all([await ticket.wait_layer(layer) for layer in ticket.layer_ids])
    landed = {dest[i]: i for i in range(half)}  # destination page -> the source page it holds
    for now, was in zip(parts, before):  # every segment: each page at its own rows, nothing else moved
        for p in range(2 * n):
            assert torch.equal(_page(now, p), _page(was, landed.get(p, p))), p
    await store.close()


@pytest.mark.parametrize("verify_all", [False, True], ids=["default", "verify-all"])
async def test_row_sub_batches_two_in_flight_each_land_at_their_own_rows(
        verify_all: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With three objects per row-described call (``IN_PLACE_CALL_BYTES`` made small), a transfer is
    many sub-batches, two store calls in flight and the header slots rotating: every object
    still lands at its own rows, in every one of 24 segments."""
    from hylinker.runtime.dataplane import in_place

    layers, n = 12, 20
    pools, parts = _pool(layers, 2 * n)
    monkeypatch.setattr(in_place, "IN_PLACE_CALL_BYTES", 3 * (2 * layers * PAGE * ROW + 64))
    store = RowCountingStore(64 << 20)
    keys = [f"s-{i}" for i in range(n)]
    dest = list(range(2 * n - 1, n - 1, -1))
    before = [p.clone() for p in parts]
    async with DataPlane(pools, store) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, keys, _rows(list(range(n))))])).wait()).ok
        puts = store.calls
        assert puts == -(-n // 3)
        ticket = await dp.load([Transfer(PoolKind.FULL, keys, _rows(dest))], verify_all=verify_all)
        assert (await ticket.wait()).ok
        assert all([await ticket.wait_layer(layer) for layer in ticket.layer_ids])
    assert store.calls - puts == -(-n // 3)
    landed = {dest[i]: i for i in range(n)}
    for now, was in zip(parts, before):
        for p in range(2 * n):
            assert torch.equal(_page(now, p), _page(was, landed.get(p, p))), p
    await store.close()
