"""A short frame is never restored (``framing.check_length``), on every verifying path.

A frame whose header honestly says 16 payload bytes, with a valid checksum over those 16, is
self-consistent; anyone who can write a key to a shared store can plant one. Its reader must
refuse it because its length is not the object's room (the pool's payload bytes), whatever the
store reports: otherwise a path that lands whole staging frames restores 16 planted bytes
followed by a previous load's bytes (another request's KV). Each test loads other objects
through the same staging first, so such a restore would show those bytes; then the short frame
must be a counted miss that writes no row.

Paths: host staged, host held (verify-all), host in place, host rows (embedded; Mooncake's rows
in ``test_a_short_frame_is_refused_by_mooncake_rows``), held in place / held rows, device
(``FakeDeviceCopies`` stands in, as in ``tests/runtime/test_device_integrity.py``) staged and held; at
both integrity levels and at 1, 2 and 8 layers."""

from __future__ import annotations

import uuid
from typing import Any

import attrs
import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer
from hylinker.stores import framing
from hylinker.stores.base import Outcome, Store
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.framing import HEADER_BYTES, Integrity
from hylinker.testing.fakes import FakeDeviceCopies

P = 4  # rows per page
ROWS = 32
WIDTH = 256
SHORT = 16  # payload bytes of the planted frame
Pools = tuple[list[torch.Tensor], list[torch.Tensor]]


class ScatterOnly(EmbeddedStore):
    """The embedded store without row-described calls: in-place loads use ``get_parts``."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._capabilities = attrs.evolve(self._capabilities, rows=False)


# path: (store class, device pool, DataPlaneConfig.in_place, verify-all)
PATHS: dict[str, tuple[type[EmbeddedStore], bool, bool, bool]] = {
    "host-staged": (EmbeddedStore, False, False, False),
    "host-held": (EmbeddedStore, False, False, True),
    "host-in-place": (ScatterOnly, False, True, False),
    "host-rows": (EmbeddedStore, False, True, False),
    "host-held-in-place": (ScatterOnly, False, True, True),
    "host-held-rows": (EmbeddedStore, False, True, True),
    "device-staged": (EmbeddedStore, True, False, False),
    "device-held": (EmbeddedStore, True, False, True),
}


def _pools(seed: int, layers: int) -> Pools:
    g = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        return torch.randint(0, 256, (ROWS, WIDTH), dtype=torch.uint8, generator=g)

    return [one() for _ in range(layers)], [one() for _ in range(layers)]


def _plane(pools: Pools, store: Store, *, device: bool, in_place: bool, level: Integrity) -> DataPlane:
    k, v = pools
    config = DataPlaneConfig(integrity=level, in_place=in_place, in_place_min_bytes=0, staging_bytes_per_pool=1 << 20)
    copies = {PoolKind.FULL: FakeDeviceCopies(auto=True)} if device else None
    return DataPlane(PoolSet([kv_view(k, v, layer_ids=list(range(len(k))), page_size=P)]), store, config,
                     namespace="short-frames", copies=copies)


def _rows(*pages: int) -> torch.Tensor:
    return torch.tensor(pages)[:, None] * P + torch.arange(P)


def _snapshot(pools: Pools) -> list[torch.Tensor]:
    return [t.clone() for t in (*pools[0], *pools[1])]


async def _plant_short(store: Store, key: str, fingerprint: bytes, level: Integrity) -> None:
    """Write ``key`` as a self-consistent frame of :data:`SHORT` payload bytes."""
    frame = torch.arange(HEADER_BYTES + SHORT, dtype=torch.uint8)
    framing.seal(frame, key, fingerprint, level)
    framing.verify(frame, frame.numel(), key, fingerprint, level)  # self-consistent
    assert (await store.put([key], [frame])) == [Outcome.OK]


async def _short_frame_after_other_bytes(store: Store, path: str, level: Integrity, layers: int,
                                         fault: str = "truncated") -> None:
    """Offload objects from one pool set, load them into another (filling the staging), plant
    a short frame and load it into other rows of the same data plane: a counted miss, no layer
    reported, no row changed (in-place paths, held or not: the store writes the load's own
    rows, which are never reported landed; no other row moves). ``fault``: what the miss is
    counted as (a store that refuses to read a short object into a larger buffer fails it)."""
    _, device, in_place, held = PATHS[path]
    prefix = uuid.uuid4().hex[:8]
    good, short = [f"{prefix}/good{i}" for i in range(2)], f"{prefix}/short"
    src, dst = _pools(1, layers), _pools(2, layers)
    async with _plane(src, store, device=device, in_place=in_place, level=level) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, good, _rows(0, 1))])).wait()).ok
    async with _plane(dst, store, device=device, in_place=in_place, level=level) as dp:
        out: Any = await (await dp.load([Transfer(PoolKind.FULL, good, _rows(2, 3))], verify_all=held)).wait()
        assert out.ok, out.faults  # the staging now holds the good objects' bytes
        await _plant_short(store, short, dp.fingerprint, level)
        before = _snapshot(dst)
        ticket = await dp.load([Transfer(PoolKind.FULL, [short], _rows(5))], verify_all=held)
        out = await ticket.wait()
        layers_landed = [await ticket.wait_layer(layer) for layer in range(layers)]
    assert not out.ok
    assert dict(out.faults) == {fault: 1}, out.faults
    assert not any(layers_landed)
    after = _snapshot(dst)
    if in_place:  # the store wrote the load's own rows; nothing else moved
        rows = _rows(5).reshape(-1)
        keep = torch.ones(ROWS, dtype=torch.bool)
        keep[rows] = False
        assert all(torch.equal(a[keep], b[keep]) for a, b in zip(before, after))
    else:
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a short frame changed rows"


@pytest.mark.parametrize("layers", [1, 2, 8])
@pytest.mark.parametrize("level", list(Integrity), ids=lambda i: i.value)
@pytest.mark.parametrize("path", list(PATHS))
async def test_a_short_self_consistent_frame_is_a_counted_miss_that_writes_no_row(
        path: str, level: Integrity, layers: int) -> None:
    store = PATHS[path][0](64 << 20)
    try:
        await _short_frame_after_other_bytes(store, path, level, layers)
    finally:
        await store.close()


@pytest.mark.mooncake
@pytest.mark.parametrize("held", [False, True], ids=["rows", "held-rows"])
@pytest.mark.parametrize("level", list(Integrity), ids=lambda i: i.value)
async def test_a_short_frame_is_refused_by_mooncake_rows(mooncake_store: Store, held: bool,
                                                         level: Integrity) -> None:
    # Mooncake fails a get of an object shorter than its buffer (TRANSFER_FAIL): a counted miss
    await _short_frame_after_other_bytes(mooncake_store, "host-held-rows" if held else "host-rows", level, 2,
                                         fault="failed")
