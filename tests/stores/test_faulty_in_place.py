"""Fault plans reach the in-place path: FaultyStore forwards the scatter-gather and
checksumming calls, injecting the same faults into objects made of several buffers."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer
from hylinker.stores.base import GetResult, Outcome, supports_checksums, supports_scatter
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.stores.framing import Integrity

P = 16  # rows per page
N = 6  # pages moved


class Recording(EmbeddedStore):
    """An embedded store that records which calls reached it."""

    def __init__(self) -> None:
        super().__init__(64 << 20)
        self.called: list[str] = []

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        self.called.append("put_sealed")
        return await super().put_sealed(keys, parts)

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        self.called.append("get_checked")
        return await super().get_checked(keys, parts)

    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        self.called.append("put_parts")
        return await super().put_parts(keys, parts)

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        self.called.append("get_parts")
        return await super().get_parts(keys, parts)


def _pools(seed: int, layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2 * N * P, 96), dtype=torch.uint8, generator=g) for _ in range(2 * layers)]


def _plane(pool: list[torch.Tensor], store: FaultyStore, level: Integrity) -> DataPlane:
    layers = len(pool) // 2
    view = kv_view(pool[:layers], pool[layers:], layer_ids=list(range(layers)), page_size=P)
    return DataPlane(PoolSet([view]), store, DataPlaneConfig(integrity=level, in_place_min_bytes=0))


def _rows(first: int) -> torch.Tensor:
    return torch.arange(first * P, (first + N) * P)


async def _move(src: list[torch.Tensor], dst: list[torch.Tensor], store: FaultyStore, level: Integrity,
                keys: list[str]) -> tuple[bool, dict[str, int], dict[str, int]]:
    async with _plane(src, store, level) as dp:
        assert (await (await dp.offload([Transfer(PoolKind.FULL, keys, _rows(0))])).wait()).ok
    async with _plane(dst, store, level) as dp:
        out = await (await dp.load([Transfer(PoolKind.FULL, keys, _rows(N))])).wait()
        s = dp.pool_statistics()[PoolKind.FULL.value]
    return out.ok, dict(out.faults), {"recovered": s.rereads_recovered, "failed": s.rereads_failed}


def _same(src: list[torch.Tensor], dst: list[torch.Tensor]) -> bool:
    return all(torch.equal(a[: N * P], b[N * P: 2 * N * P]) for a, b in zip(src, dst))


def test_the_wrapper_declares_what_its_inner_store_has() -> None:
    store = FaultyStore(EmbeddedStore(1 << 20))
    assert supports_scatter(store) and supports_checksums(store)


@pytest.mark.parametrize("layers", [1, 2, 8])
@pytest.mark.parametrize("level", [Integrity.CHECKSUM, Integrity.HEADER], ids=lambda i: i.value)
async def test_a_corrupt_first_read_in_place_is_caught_read_again_and_restored(layers: int, level: Integrity) -> None:
    inner = Recording()
    store = FaultyStore(inner, FaultPlan(corrupt_first_read=1.0), seed=5)
    src, dst = _pools(1, layers), _pools(2, layers)
    keys = [f"{uuid.uuid4().hex[:8]}/{i}" for i in range(N)]
    try:
        ok, faults, rereads = await _move(src, dst, store, level, keys)
        # the in-place calls reached the inner store through the wrapper
        expected = {"put_sealed", "get_checked"} if level is Integrity.CHECKSUM else {"put_parts", "get_parts"}
        assert set(inner.called) == expected
        assert store.statistics().corrupted_first_reads == N
        if level is Integrity.HEADER:
            # no payload hash: a payload flip lands unseen (documented); a header flip is caught
            assert rereads["recovered"] <= N and rereads["failed"] == 0
            return
        assert ok, faults
        assert rereads == {"recovered": N, "failed": 0}
        assert _same(src, dst)  # positive control: the second reads restored every byte
    finally:
        await store.close()


@pytest.mark.parametrize("plan", ["torn=1", "corrupt=1", "fail=1"])
async def test_damaged_or_failed_in_place_puts_never_restore_wrong_rows(plan: str) -> None:
    """Torn, corrupted (a header byte: the store writes the checksum) and failed puts through
    the in-place path: every object fails its load; none is reported landed."""
    inner = Recording()
    store = FaultyStore(inner, FaultPlan.parse(plan), seed=3)
    src, dst = _pools(3, 2), _pools(4, 2)
    before = [t.clone() for t in dst]
    keys = [f"{uuid.uuid4().hex[:8]}/{i}" for i in range(N)]
    try:
        async with _plane(src, store, Integrity.CHECKSUM) as dp:
            await (await dp.offload([Transfer(PoolKind.FULL, keys, _rows(0))])).wait()
        clean = FaultyStore(inner)  # read back without injected read faults
        async with _plane(dst, clean, Integrity.CHECKSUM) as dp:
            ticket = await dp.load([Transfer(PoolKind.FULL, keys, _rows(N))])
            out = await ticket.wait()
            landed = [await ticket.wait_layer(layer) for layer in (0, 1)]
        assert "put_sealed" in inner.called
        assert not out.ok and landed == [False, False]
        assert not any(out.objects[PoolKind.FULL])
        assert all(torch.equal(a[: N * P], b[: N * P]) for a, b in zip(before, dst))  # rows outside: untouched
    finally:
        await store.close()
