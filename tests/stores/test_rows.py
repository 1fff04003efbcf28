"""Row-described store calls (``put_rows`` / ``get_rows``, ``stores/rows.py``): the frames they
store, their per-object outcomes, bad input, and the wrappers (fault plans, retries) that must
reach them."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import attrs
import numpy as np
import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer, TransferOutcome
from hylinker.runtime.dataplane.statistics import PoolActorStatistics
from hylinker.stores import framing
from hylinker.stores.base import Outcome, supports_rows
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.stores.resilient import ResiliencePolicy, ResilientStore
from hylinker.stores.rows import CODE, OUTCOMES, RowBatch, RowResults, digests_of

FP = b"rows-layout-fingerprint-32-bytes"
UNIT, ROW = 4, 48


def keys_(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"rows-{prefix}-{i}" for i in range(n)]


def segments(segs: int, rows: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, rows * ROW, dtype=np.uint8) for _ in range(segs)]


def batch(keys: list[str], segs: list[np.ndarray], starts: Sequence[int], heads: np.ndarray | None = None,
          level: framing.Integrity = framing.Integrity.CHECKSUM) -> RowBatch:
    payload = UNIT * ROW * len(segs)
    return RowBatch(keys, digests_of(keys), segs, [ROW] * len(segs), UNIT, np.asarray(starts, dtype=np.int64),
                    framing.header_template(FP, payload, level), heads)


def frame_of(key: str, segs: list[np.ndarray], start: int, level: framing.Integrity) -> np.ndarray:
    """The frame seal_array makes of these rows: what put_rows must store."""
    payload = np.concatenate([s[start * ROW:(start + UNIT) * ROW] for s in segs])
    frame = np.empty(framing.HEADER_BYTES + payload.shape[0], dtype=np.uint8)
    frame[framing.HEADER_BYTES:] = payload
    framing.seal_array(frame, key, FP, level)
    return frame


def codes(outcomes: Sequence[Outcome]) -> list[int]:
    return [CODE[o] for o in outcomes]


@pytest.mark.parametrize("segs", [1, 2, 24])
@pytest.mark.parametrize("level", list(framing.Integrity), ids=lambda i: i.value)
async def test_put_rows_stores_the_frames_seal_array_makes_and_get_rows_restores_them(
        segs: int, level: framing.Integrity) -> None:
    store = EmbeddedStore(16 << 20, chunk_bytes=64 << 10)  # several chunks: slots in runs and apart
    n = 40
    src = segments(segs, 4 * n * UNIT, 1)
    starts = list(range(3, 3 + 2 * n * UNIT, 2 * UNIT))  # every other page
    keys = keys_(n)
    hashed = level is framing.Integrity.CHECKSUM
    assert (await store.put_rows(batch(keys, src, starts, level=level), hashed)).tolist() == [CODE[Outcome.OK]] * n
    size = framing.HEADER_BYTES + UNIT * ROW * segs
    for i in (0, n // 2, n - 1):  # the frame, byte for byte, through the plain get
        out = torch.empty(size, dtype=torch.uint8)
        assert (await store.get([keys[i]], [out]))[0].outcome is Outcome.OK
        assert np.array_equal(out.numpy(), frame_of(keys[i], src, starts[i], level))
    dst = [np.zeros_like(s) for s in src]
    heads = np.zeros((n, 64), dtype=np.uint8)
    res = await store.get_rows(batch(keys, dst, starts, heads, level), hashed)
    assert res.codes.tolist() == [CODE[Outcome.OK]] * n and res.nbytes.tolist() == [size] * n
    for i, s0 in enumerate(starts):
        for a, b in zip(src, dst):
            assert np.array_equal(a[s0 * ROW:(s0 + UNIT) * ROW], b[s0 * ROW:(s0 + UNIT) * ROW])
        framing.verify_parts(heads[i], size, [b[s0 * ROW:(s0 + UNIT) * ROW] for b in dst], keys[i], FP,
                             landed_checksum=int(res.checksums[i]) if hashed else None, integrity=level)
    untouched = np.ones(dst[0].shape[0] // ROW, dtype=bool)
    for s0 in starts:
        untouched[s0:s0 + UNIT] = False
    assert all(not b.reshape(-1, ROW)[untouched].any() for b in dst)  # no row outside the objects
    await store.close()


async def test_per_object_outcomes_come_back_as_arrays() -> None:
    store = EmbeddedStore(8 * (64 + UNIT * ROW * 2) + 64)
    src = segments(2, 64, 2)
    keys = keys_(4)
    assert (await store.put_rows(batch(keys[:2], src, [0, 4]), True)).tolist() == codes([Outcome.OK] * 2)
    # stored and repeated keys answer EXISTS, the new one is stored
    got = await store.put_rows(batch([keys[0], keys[2], keys[2]], src, [0, 8, 12]), True)
    assert got.tolist() == codes([Outcome.EXISTS, Outcome.OK, Outcome.EXISTS])
    heads = np.zeros((3, 64), dtype=np.uint8)
    res = await store.get_rows(batch([keys[0], keys[3], keys[2]], [np.zeros_like(s) for s in src],
                                     [0, 4, 8], heads), True)
    assert [OUTCOMES[c] for c in res.codes.tolist()] == [Outcome.OK, Outcome.MISSING, Outcome.OK]
    # an object larger than the rows: TOO_SMALL, nothing written
    big = RowBatch([keys[0]], digests_of([keys[0]]), [np.zeros(64 * ROW // 2, np.uint8)], [ROW // 2], UNIT,
                   np.zeros(1, np.int64), framing.header_template(FP, UNIT * ROW // 2), np.zeros((1, 64), np.uint8))
    res = await store.get_rows(big, True)
    assert OUTCOMES[int(res.codes[0])] is Outcome.TOO_SMALL and not big.segments[0].any()
    # more than the capacity holds: what fits is stored, the rest is FULL
    many = keys_(20)
    got = await store.put_rows(batch(many, src, [0] * 20), True)
    assert set(got.tolist()) == {CODE[Outcome.OK], CODE[Outcome.FULL]} and (got == CODE[Outcome.OK]).sum() == 8
    await store.close()


@pytest.mark.parametrize("case", ["row past the end", "negative row", "segment dtype", "template length",
                                  "heads shape", "digests", "empty key"])
async def test_bad_descriptions_raise_and_write_nothing(case: str) -> None:
    store = EmbeddedStore(1 << 20)
    src = segments(2, 16, 3)
    keys = keys_(2)
    b = batch(keys, src, [0, 12], np.zeros((2, 64), np.uint8))
    bad = {
        "row past the end": attrs.evolve(b, starts=np.asarray([0, 13], np.int64)),
        "negative row": attrs.evolve(b, starts=np.asarray([-1, 4], np.int64)),
        "segment dtype": attrs.evolve(b, segments=[s.view(np.int8) for s in src]),
        "template length": attrs.evolve(b, template=framing.header_template(FP, 7)),
        "heads shape": attrs.evolve(b, heads=np.zeros((1, 64), np.uint8)),
        "digests": attrs.evolve(b, digests=b.digests[:1]),
        "empty key": attrs.evolve(b, keys=["", keys[1]]),
    }[case]
    before = [s.copy() for s in src]
    for call in ("put_rows", "get_rows"):
        if call == "put_rows" and case == "heads shape":
            continue
        with pytest.raises(ValueError):
            await getattr(store, call)(bad, True)
    assert store.statistics().objects == 0 and all(np.array_equal(a, c) for a, c in zip(src, before))
    await store.close()


# ---- the wrappers and the data plane reach the row calls -------------------------------------

class Recording(EmbeddedStore):
    """An embedded store that records which calls reached it."""

    def __init__(self) -> None:
        super().__init__(64 << 20)
        self.called: list[str] = []

    async def put_rows(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        self.called.append("put_rows")
        return await super().put_rows(batch, hashed)

    async def get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        self.called.append("get_rows")
        return await super().get_rows(batch, hashed)


P, N = 16, 12


def _pools(seed: int, layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2 * N * P, 64), dtype=torch.uint8, generator=g) for _ in range(2 * layers)]


def _plane(pool: list[torch.Tensor], store: object) -> DataPlane:
    layers = len(pool) // 2
    view = kv_view(pool[:layers], pool[layers:], layer_ids=list(range(layers)), page_size=P)
    return DataPlane(PoolSet([view]), store, DataPlaneConfig(in_place_min_bytes=0))  # type: ignore[arg-type]


def _same(src: list[torch.Tensor], dst: list[torch.Tensor]) -> bool:
    return all(torch.equal(a[: N * P], b[N * P: 2 * N * P]) for a, b in zip(src, dst))


async def _move(src: list[torch.Tensor], dst: list[torch.Tensor], store: object,
                keys: list[str]) -> tuple[tuple[TransferOutcome, TransferOutcome], PoolActorStatistics]:
    async with _plane(src, store) as dp:
        put = await (await dp.offload([Transfer(PoolKind.FULL, keys, torch.arange(N * P))])).wait()
    async with _plane(dst, store) as dp:
        got = await (await dp.load([Transfer(PoolKind.FULL, keys, torch.arange(N * P, 2 * N * P))])).wait()
        stats = dp.pool_statistics()[PoolKind.FULL.value]
    return (put, got), stats


@pytest.mark.parametrize("layers", [1, 2, 8])
async def test_a_fault_plan_reaches_the_row_path_and_the_load_recovers(layers: int) -> None:
    inner = Recording()
    store = FaultyStore(inner, FaultPlan(corrupt_first_read=1.0), seed=2)
    assert supports_rows(store) and supports_rows(inner)
    src, dst = _pools(1, layers), _pools(2, layers)
    try:
        (put, got), stats = await _move(src, dst, store, keys_(N))
        assert set(inner.called) == {"put_rows", "get_rows"}
        assert put.ok and got.ok, got
        assert store.statistics().corrupted_first_reads == N
        assert stats.rereads_recovered == N
        assert _same(src, dst)
    finally:
        await store.close()


async def test_retries_by_index_reach_the_row_path() -> None:
    """Half the objects fail on each call; the resilient wrapper retries just those, by
    index, through put_rows / get_rows, until every object moved."""
    inner = Recording()
    faulty = FaultyStore(inner, FaultPlan(fail=0.5), seed=4)
    store = ResilientStore(faulty, ResiliencePolicy(attempts=20, backoff_s=0.0, jitter=0.0), seed=1)
    assert supports_rows(store)
    src, dst = _pools(3, 2), _pools(4, 2)
    try:
        (put, got), _ = await _move(src, dst, store, keys_(N))
        assert put.ok and got.ok
        assert store.resilience().retried_keys > 0 and faulty.statistics().failed_keys > 0
        assert inner.called.count("put_rows") > 1 and inner.called.count("get_rows") > 1
        assert _same(src, dst)
    finally:
        await store.close()


async def test_a_store_failing_part_of_a_sub_batch_fails_those_objects_only() -> None:
    inner = Recording()
    store = FaultyStore(inner, FaultPlan(fail=0.5), seed=6)
    src, dst = _pools(5, 2), _pools(6, 2)
    before = [t.clone() for t in dst]
    keys = keys_(N)
    try:
        async with _plane(src, store) as dp:
            put = await (await dp.offload([Transfer(PoolKind.FULL, keys, torch.arange(N * P))])).wait()
        stored = put.objects[PoolKind.FULL]
        assert 0 < sum(stored) < N  # partly failed
        clean = FaultyStore(inner)
        async with _plane(dst, clean) as dp:
            got = await (await dp.load([Transfer(PoolKind.FULL, keys, torch.arange(N * P, 2 * N * P))])).wait()
        assert got.objects[PoolKind.FULL] == stored  # each object as its put went
        for i, ok in enumerate(stored):
            rows = slice((N + i) * P, (N + i + 1) * P)
            for a, b, c in zip(src, dst, before):
                assert torch.equal(b[rows], a[i * P:(i + 1) * P] if ok else c[rows])
        assert all(torch.equal(b[: N * P], c[: N * P]) for b, c in zip(dst, before))  # rows outside: untouched
    finally:
        await store.close()
