"""The Mooncake store's row-described calls (``put_rows`` / ``get_rows``, ``stores/mooncake_rows.py``)
against a real ``mooncake_master`` on loopback: the frames they store, their per-object outcomes,
the checksums they return, the unregistered-rows path, bad input, the header arenas, the wrappers,
and a data plane that moves its transfers through them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import pytest
import torch
import xxhash

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view
from hylinker.runtime.dataplane.plane import DataPlaneConfig, Transfer
from hylinker.runtime.dataplane.sync_plane import SyncDataPlane
from hylinker.stores import framing
from hylinker.stores.base import Outcome, supports_rows
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.stores.mooncake import MooncakeConfig, MooncakeStore
from hylinker.stores.mooncake_master import MooncakeMaster
from hylinker.stores.resilient import ResiliencePolicy, ResilientStore
from hylinker.stores.rows import CODE, OUTCOMES, RowBatch, digests_of

pytestmark = pytest.mark.mooncake

FP = b"mooncake-rows-fingerprint-32byte"
ROW = 64  # bytes of one row of one segment
MIB = 1 << 20
LEVELS = list(framing.Integrity)


def keys_(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:10]
    return [f"mcrows-{prefix}-{i}" for i in range(n)]


class Pool:
    """``segs`` segments of ``rows`` rows (one tensor each, registered with ``store`` unless
    told not to) and their NumPy views."""

    def __init__(self, store: MooncakeStore | None, segs: int, rows: int, seed: int | None) -> None:
        g = torch.Generator().manual_seed(seed or 0)
        self.tensors = [torch.randint(0, 256, (rows * ROW,), dtype=torch.uint8, generator=g) if seed is not None
                        else torch.zeros(rows * ROW, dtype=torch.uint8) for _ in range(segs)]
        self.segments = [t.numpy() for t in self.tensors]
        if store is not None:
            for t in self.tensors:
                store.register(t)

    def rows(self, start: int, unit: int) -> list[np.ndarray]:
        return [s[start * ROW:(start + unit) * ROW] for s in self.segments]


def batch(keys: list[str], pool: Pool, unit: int, starts: Sequence[int], heads: np.ndarray | None = None,
          level: framing.Integrity = framing.Integrity.CHECKSUM) -> RowBatch:
    payload = unit * ROW * len(pool.segments)
    return RowBatch(keys, digests_of(keys), pool.segments, [ROW] * len(pool.segments), unit,
                    np.asarray(starts, dtype=np.int64), framing.header_template(FP, payload, level), heads)


def frame_of(key: str, pieces: list[np.ndarray], level: framing.Integrity) -> np.ndarray:
    """The frame seal_array makes of these rows: what put_rows must store."""
    payload = np.concatenate(pieces)
    frame = np.empty(framing.HEADER_BYTES + payload.shape[0], dtype=np.uint8)
    frame[framing.HEADER_BYTES:] = payload
    framing.seal_array(frame, key, FP, level)
    return frame


def xxh3(pieces: list[np.ndarray]) -> int:
    return xxhash.xxh3_64_intdigest(np.concatenate(pieces).data)


def codes_of(outcomes: Sequence[Outcome]) -> list[int]:
    return [CODE[o] for o in outcomes]


class Spy:
    """Records which of the adapter's worker-thread calls ran (the real ones still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: MooncakeStore) -> None:
        self.called: list[str] = []
        for name in ("put_parts", "get_parts", "put", "get"):
            real = getattr(store._batches, name)
            monkeypatch.setattr(store._batches, name, self._wrap(name, real))

    def _wrap(self, name: str, real: Any) -> Any:
        def call(*args: Any) -> Any:
            self.called.append(name)
            return real(*args)
        return call


LAYERS = [1, 2, 12]
PAGES = [16, 64]


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("level", LEVELS, ids=lambda i: i.value)
async def test_round_trip_stores_seal_array_frames_and_restores_other_rows(
        mooncake_store: MooncakeStore, monkeypatch: pytest.MonkeyPatch, layers: int, page: int,
        level: framing.Integrity) -> None:
    store = mooncake_store
    assert store.capabilities.rows and supports_rows(store)
    spy = Spy(monkeypatch, store)
    segs, n = 2 * layers, 12
    src = Pool(store, segs, 3 * n * page, seed=layers * page)
    dst = Pool(store, segs, 3 * n * page, seed=None)
    starts = [(2 * i + 1) * page for i in range(n)]  # every other page, from the second
    back = [(3 * n - 1 - 2 * i) * page - page for i in range(n)]  # elsewhere in the other pool
    keys = keys_(n)
    hashed = level is framing.Integrity.CHECKSUM
    got = await store.put_rows(batch(keys, src, page, starts, level=level), hashed)
    assert got.dtype == np.int8 and got.tolist() == codes_of([Outcome.OK] * n)
    size = framing.HEADER_BYTES + page * ROW * segs
    for i in (0, n // 2, n - 1):  # the stored frame, byte for byte, through the plain get
        whole = torch.zeros(size, dtype=torch.uint8)
        assert (await store.get([keys[i]], [whole]))[0].outcome is Outcome.OK
        assert np.array_equal(whole.numpy(), frame_of(keys[i], src.rows(starts[i], page), level))
    assert spy.called == ["get"] * 3  # the put went by rows, not by parts
    heads = np.zeros((n, framing.HEADER_BYTES), dtype=np.uint8)
    res = await store.get_rows(batch(keys, dst, page, back, heads, level), hashed)
    assert spy.called == ["get"] * 3  # ... and so did the get
    assert res.codes.tolist() == codes_of([Outcome.OK] * n) and res.nbytes.tolist() == [size] * n
    for i in range(n):
        landed = dst.rows(back[i], page)
        assert all(np.array_equal(a, b) for a, b in zip(src.rows(starts[i], page), landed))
        assert np.array_equal(heads[i], frame_of(keys[i], landed, level)[:framing.HEADER_BYTES])
        assert int(res.checksums[i]) == (xxh3(landed) if hashed else 0)
        framing.verify_parts(heads[i], size, landed, keys[i], FP,
                             landed_checksum=int(res.checksums[i]) if hashed else None, integrity=level)
    untouched = np.ones(3 * n * page, dtype=bool)
    for b in back:
        untouched[b:b + page] = False
    assert all(not s.reshape(-1, ROW)[untouched].any() for s in dst.segments)  # no row outside the objects
    stats = store.statistics()
    assert stats.puts >= n and stats.gets >= n + 3


async def test_exists_repeats_and_missing(mooncake_store: MooncakeStore) -> None:
    store = mooncake_store
    page = 16
    src = Pool(store, 4, 8 * page, seed=1)
    other = Pool(store, 4, 8 * page, seed=2)
    keys = keys_(4)
    assert (await store.put_rows(batch(keys[:2], src, page, [0, page]), True)).tolist() == codes_of([Outcome.OK] * 2)
    # stored keys answer EXISTS and keep their first value; a key twice in one batch: the first writes
    got = await store.put_rows(batch([keys[0], keys[2], keys[2], keys[1]], other, page,
                                     [0, 2 * page, 3 * page, page]), True)
    assert got.tolist() == codes_of([Outcome.EXISTS, Outcome.OK, Outcome.EXISTS, Outcome.EXISTS])
    dst = Pool(store, 4, 8 * page, seed=None)
    heads = np.full((4, framing.HEADER_BYTES), 7, dtype=np.uint8)
    res = await store.get_rows(batch([keys[0], keys[3], keys[2], keys[1]], dst, page,
                                     [0, page, 2 * page, 3 * page], heads), True)
    assert [OUTCOMES[c] for c in res.codes.tolist()] == [Outcome.OK, Outcome.MISSING, Outcome.OK, Outcome.OK]
    assert np.array_equal(np.concatenate(dst.rows(0, page)), np.concatenate(src.rows(0, page)))  # the first value
    assert np.array_equal(np.concatenate(dst.rows(3 * page, page)), np.concatenate(src.rows(page, page)))
    assert np.array_equal(np.concatenate(dst.rows(2 * page, page)), np.concatenate(other.rows(2 * page, page)))
    assert not np.concatenate(dst.rows(page, page)).any() and (heads[1] == 7).all()  # the miss wrote nothing
    assert res.nbytes[1] == 0 and res.checksums[1] == 0


async def test_objects_larger_or_shorter_than_the_rows(mooncake_store: MooncakeStore) -> None:
    """Larger: TOO_SMALL, nothing written. Shorter: OK with its size and its header landed,
    its rows untouched (Mooncake fails the read as a whole; the adapter asks the size)."""
    store = mooncake_store
    page = 16
    keys = keys_(3)
    small, exact, large = (torch.zeros(framing.framed_size(p), dtype=torch.uint8) for p in (1000, 2 * page * ROW,
                                                                                          5 * page * ROW))
    for key, frame in zip(keys, (small, exact, large)):
        frame[framing.HEADER_BYTES:] = 9
        framing.seal(frame, key, FP)
    assert await store.put(keys, [small, exact, large]) == [Outcome.OK] * 3
    dst = Pool(store, 2, 4 * page, seed=None)
    heads = np.zeros((3, framing.HEADER_BYTES), dtype=np.uint8)
    res = await store.get_rows(batch(keys, dst, page, [0, page, 2 * page], heads), True)
    assert [OUTCOMES[c] for c in res.codes.tolist()] == [Outcome.OK, Outcome.OK, Outcome.TOO_SMALL]
    assert res.nbytes.tolist() == [small.numel(), exact.numel(), 0]
    assert np.array_equal(heads[0], small[:64].numpy()) and np.array_equal(heads[1], exact[:64].numpy())
    assert not heads[2].any()
    assert res.checksums[0] == 0 and res.checksums[1] == xxh3(dst.rows(page, page))  # a short object: no checksum
    assert not np.concatenate(dst.rows(0, page)).any() and not np.concatenate(dst.rows(2 * page, 2 * page)).any()
    with pytest.raises(framing.FrameError):  # the reader sees the length and rejects it
        framing.verify_parts(heads[0], int(res.nbytes[0]), dst.rows(0, page), keys[0], FP)


@pytest.mark.parametrize("which", ["source", "target"])
async def test_unregistered_rows_take_the_parts_path_and_round_trip(
        mooncake_store: MooncakeStore, monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    store = mooncake_store
    page, n = 16, 6
    spy = Spy(monkeypatch, store)
    src = Pool(store if which == "target" else None, 4, 2 * n * page, seed=5)
    dst = Pool(store if which == "source" else None, 4, 2 * n * page, seed=None)
    starts = [i * 2 * page for i in range(n)]
    keys = keys_(n)
    got = await store.put_rows(batch(keys + keys[:1], src, page, [*starts, page]), True)
    assert got.tolist() == codes_of([Outcome.OK] * n + [Outcome.EXISTS])
    assert ("put_parts" in spy.called) is (which == "source")
    heads = np.zeros((n + 1, framing.HEADER_BYTES), dtype=np.uint8)
    res = await store.get_rows(batch([*keys, "mcrows-missing-" + keys[0]], dst, page, [*starts, page], heads), True)
    assert ("get_parts" in spy.called) is (which == "target")
    assert res.codes.tolist() == codes_of([Outcome.OK] * n + [Outcome.MISSING])
    for i, s in enumerate(starts):
        whole = torch.zeros(framing.framed_size(4 * page * ROW), dtype=torch.uint8)
        assert (await store.get([keys[i]], [whole]))[0].outcome is Outcome.OK
        assert np.array_equal(whole.numpy(), frame_of(keys[i], src.rows(s, page), framing.Integrity.CHECKSUM))
        assert np.array_equal(heads[i], whole[:64].numpy())
        assert all(np.array_equal(a, b) for a, b in zip(src.rows(s, page), dst.rows(s, page)))
        assert int(res.checksums[i]) == xxh3(dst.rows(s, page))
    assert not np.concatenate(dst.rows(page, page)).any()  # the miss's rows


@pytest.mark.parametrize("case", ["row past the end", "negative row", "segment dtype", "template length",
                                  "heads shape", "digests", "empty key"])
async def test_bad_descriptions_raise_and_write_nothing(mooncake_store: MooncakeStore, case: str) -> None:
    store = mooncake_store
    page = 16
    src = Pool(store, 2, 4 * page, seed=3)
    keys = keys_(2)
    b = batch(keys, src, page, [0, 3 * page], np.zeros((2, 64), np.uint8))
    bad = {
        "row past the end": attrs.evolve(b, starts=np.asarray([0, 3 * page + 1], np.int64)),
        "negative row": attrs.evolve(b, starts=np.asarray([-1, page], np.int64)),
        "segment dtype": attrs.evolve(b, segments=[s.view(np.int8) for s in src.segments]),
        "template length": attrs.evolve(b, template=framing.header_template(FP, 7)),
        "heads shape": attrs.evolve(b, heads=np.zeros((1, 64), np.uint8)),
        "digests": attrs.evolve(b, digests=b.digests[:1]),
        "empty key": attrs.evolve(b, keys=["", keys[1]]),
    }[case]
    before = [s.copy() for s in src.segments]
    for call in ("put_rows", "get_rows"):
        if call == "put_rows" and case == "heads shape":
            continue
        with pytest.raises(ValueError):
            await getattr(store, call)(bad, True)
    assert await store.exists(keys) == [False, False]
    assert all(np.array_equal(a, c) for a, c in zip(src.segments, before))
    assert store.statistics().puts == 0 and store.statistics().gets == 0


async def test_header_arenas_are_registered_once_grown_reused_and_released(mooncake_master: MooncakeMaster) -> None:
    store = await MooncakeStore.open(MooncakeConfig(master_address=mooncake_master.address, segment_bytes=64 * MIB,
                                                    workers=2, max_batch=2048,
                                                    transfer_queue=2 * 2048 * 3))  # calls cut by max_batch alone
    try:
        page = 16
        pool = Pool(store, 2, 3000 * page // 16, seed=7)  # 3000 objects of one row each
        keys = keys_(3000)
        assert (await store.put_rows(batch(keys[:10], pool, 1, list(range(10))), True) == CODE[Outcome.OK]).all()
        arenas = store._rows.arenas
        assert arenas.registered == 1
        await store.put_rows(batch(keys[10:20], pool, 1, list(range(10, 20))), True)
        assert arenas.registered == 1  # reused
        # 2980 objects: chunks of 2048 need a larger arena than the first (1024 headers)
        got = await store.put_rows(batch(keys[20:], pool, 1, list(range(20, 3000))), True)
        assert (got == CODE[Outcome.OK]).all() and arenas.registered == 2
        # two calls in flight at once: each has its own arena, each object its own header
        heads = [np.zeros((1500, 64), np.uint8), np.zeros((1500, 64), np.uint8)]
        dst = Pool(store, 2, 3000 * page // 16, seed=None)
        out: list[Any] = [None, None]

        async def get(k: int) -> None:
            out[k] = await store.get_rows(batch(keys[1500 * k:1500 * (k + 1)], dst, 1,
                                                list(range(1500 * k, 1500 * (k + 1))), heads[k]), True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(get, 0)
            tg.start_soon(get, 1)
        assert all((r.codes == CODE[Outcome.OK]).all() for r in out)
        assert all(np.array_equal(a, b) for a, b in zip(pool.segments, dst.segments))
        for k in range(2):
            assert np.array_equal(heads[k][:, 16:32], digests_of(keys[1500 * k:1500 * (k + 1)]))
        assert arenas.registered <= 3
    finally:
        await store.close()
    assert not store._rows.arenas._free  # unregistered before the client closed


async def test_an_unreachable_master_answers_per_object(mooncake_master: MooncakeMaster) -> None:
    master = MooncakeMaster(lease_ttl_ms=1000)
    master.start()
    store = await MooncakeStore.open(MooncakeConfig(master_address=master.address, segment_bytes=16 * MIB))
    try:
        pool = Pool(store, 2, 64, seed=8)
        keys = keys_(3)
        assert (await store.put_rows(batch(keys, pool, 16, [0, 16, 32]), True) == CODE[Outcome.OK]).all()
        master.kill()
        got = await store.put_rows(batch(keys_(3), pool, 16, [0, 16, 32]), True)
        assert got.tolist() == codes_of([Outcome.UNREACHABLE] * 3)
        res = await store.get_rows(batch(keys, pool, 16, [0, 16, 32], np.zeros((3, 64), np.uint8)), True)
        assert set(res.codes.tolist()) <= {CODE[Outcome.UNREACHABLE], CODE[Outcome.FAILED]}
    finally:
        await store.close()
        master.close()


async def test_the_wrappers_forward_the_row_calls(mooncake_master: MooncakeMaster) -> None:
    store = await MooncakeStore.open(MooncakeConfig(master_address=mooncake_master.address, segment_bytes=32 * MIB))
    off = await MooncakeStore.open(MooncakeConfig(master_address=mooncake_master.address, segment_bytes=16 * MIB,
                                                  row_calls=False))
    try:
        faulty = FaultyStore(store)
        resilient = ResilientStore(FaultyStore(store), ResiliencePolicy(attempts=2))
        assert supports_rows(store) and supports_rows(faulty) and supports_rows(resilient)
        assert not supports_rows(off) and not supports_rows(FaultyStore(off))
        pool = Pool(store, 4, 64, seed=9)
        keys = keys_(4)
        got = await resilient.put_rows(batch(keys, pool, 16, [0, 16, 32, 48]), True)
        assert got.tolist() == codes_of([Outcome.OK] * 4)
        dst = Pool(store, 4, 64, seed=None)
        heads = np.zeros((4, 64), np.uint8)
        res = await faulty.get_rows(batch(keys, dst, 16, [0, 16, 32, 48], heads), True)
        assert res.codes.tolist() == codes_of([Outcome.OK] * 4)
        assert all(np.array_equal(a, b) for a, b in zip(pool.segments, dst.segments))
    finally:
        await store.close()
        await off.close()


# ---- a data plane over Mooncake moves by rows ---------------------------------------------------

N_OBJ, LAYERS_E2E, PAGE_E2E, ROW_E2E = 256, 12, 16, 256  # 24 segments, 96 KiB objects


@pytest.fixture
def e2e_pools() -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(11)
    rows = 2 * N_OBJ * PAGE_E2E
    ks = [torch.randint(0, 256, (rows, ROW_E2E), dtype=torch.uint8, generator=g) for _ in range(LAYERS_E2E)]
    vs = [torch.randint(0, 256, (rows, ROW_E2E), dtype=torch.uint8, generator=g) for _ in range(LAYERS_E2E)]
    yield ks, vs


@pytest.mark.parametrize("plan", ["clean", "corrupt first read", "torn and corrupt puts"])
def test_a_data_plane_over_mooncake_moves_24_segments_by_rows(
        mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch,
        e2e_pools: tuple[list[torch.Tensor], list[torch.Tensor]], plan: str) -> None:
    ks, vs = e2e_pools
    view = kv_view(ks, vs, layer_ids=list(range(LAYERS_E2E)), page_size=PAGE_E2E)
    calls: list[str] = []
    config = MooncakeConfig(master_address=mooncake_master.address, segment_bytes=128 * MIB, workers=2)
    faults = {"clean": None, "corrupt first read": FaultPlan(corrupt_first_read=1.0),
              "torn and corrupt puts": FaultPlan(torn=0.2, corrupt=0.2)}[plan]
    inner: list[MooncakeStore] = []

    async def factory() -> Any:
        store = await MooncakeStore.open(config)
        inner.append(store)
        for name in ("put_rows", "get_rows", "put_parts", "get_parts"):  # record, then the real call
            real = getattr(MooncakeStore, name)

            async def call(*args: Any, _real: Any = real, _name: str = name) -> Any:
                calls.append(_name)
                return await _real(store, *args)
            monkeypatch.setattr(store, name, call)
        return store if faults is None else FaultyStore(store, faults, seed=3)

    keys = keys_(N_OBJ)
    src = torch.arange(N_OBJ * PAGE_E2E)
    dst = torch.arange(N_OBJ * PAGE_E2E, 2 * N_OBJ * PAGE_E2E)
    with SyncDataPlane(PoolSet([view]), factory, DataPlaneConfig()) as dp:
        put = dp.offload([Transfer(PoolKind.FULL, keys, src)]).result()
        stored = put.objects[PoolKind.FULL]
        if faults is None or faults.corrupt_first_read:
            assert put.ok and calls.count("put_rows") >= 1 and "put_parts" not in calls
        else:  # damaging plans move puts by parts (a row description cannot carry a torn object)
            assert "put_parts" in calls and sum(stored) == N_OBJ
        calls.clear()
        got = dp.load([Transfer(PoolKind.FULL, keys, dst)]).result.result()
        assert "get_rows" in calls and "get_parts" not in calls[:calls.index("get_rows") + 1]
        stats = dp.pool_statistics()[PoolKind.FULL.value]
        if faults is None:
            assert got.ok and "get_parts" not in calls
        elif faults.corrupt_first_read:
            assert got.ok and stats.rereads_recovered == N_OBJ  # read again, by parts, and good
        else:
            assert not got.ok  # the damaged objects are rejected, never landed as good
        for layer in range(LAYERS_E2E):
            for pool in (ks[layer], vs[layer]):
                for i in range(N_OBJ):
                    landed = got.objects[PoolKind.FULL][i] if faults is not None else True
                    same = torch.equal(pool[i * PAGE_E2E:(i + 1) * PAGE_E2E],
                                       pool[(N_OBJ + i) * PAGE_E2E:(N_OBJ + i + 1) * PAGE_E2E])
                    assert same or not landed
        if faults is None:
            calls.clear()  # a verify-all load: by rows into the held arena, then landed
            for t in (*ks, *vs):
                t[N_OBJ * PAGE_E2E:] = 0
            held = dp.load([Transfer(PoolKind.FULL, keys, dst)], verify_all=True).result.result()
            assert held.ok and "get_rows" in calls and "get_parts" not in calls
            for t in (*ks, *vs):
                assert torch.equal(t[:N_OBJ * PAGE_E2E], t[N_OBJ * PAGE_E2E:])
    assert inner and inner[0].closed
