"""Checksum while copying: ``framing.copy_checksummed``, the embedded store's ``put_sealed`` /
``get_checked`` (``ChecksumStore``), its forwarding by ``ResilientStore``, and the data plane's
in-place path over such a store: same objects, same bytes, and a corrupt, torn, foreign or
unchecked object is never reported landed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest
import torch
import xxhash

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer
from hylinker.stores import frame_copies, framing
from hylinker.stores.base import GetResult, Outcome, supports_checksums, supports_scatter
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.framing import HEADER_BYTES, FrameError, FrameFault
from hylinker.stores.resilient import ResilientStore
from hylinker.testing.fakes import GatedStore

LAYOUT = b"checksum-copy-layout-fingerprint"
CHUNK = framing.CHECKSUM_CHUNK_BYTES


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("sizes", [[1], [CHUNK], [CHUNK + 1], [3 * CHUNK + 17, 5, CHUNK - 1], [64] * 9])
def test_copy_checksummed_copies_and_hashes_the_concatenation(sizes: list[int]) -> None:
    sources = [_random(n, i) for i, n in enumerate(sizes)]
    targets = [np.zeros(n, dtype=np.uint8) for n in sizes]
    digest = framing.copy_checksummed(targets, sources)
    assert all(np.array_equal(t, s) for t, s in zip(targets, sources))
    assert digest == xxhash.xxh3_64_intdigest(np.concatenate(sources).tobytes())


def test_copy_checksummed_refuses_a_buffer_of_another_length() -> None:
    with pytest.raises(ValueError, match="copy of 10 bytes"):
        framing.copy_checksummed([np.zeros(9, dtype=np.uint8)], [np.zeros(10, dtype=np.uint8)])


def test_a_header_sealed_then_checksummed_is_the_sealed_header() -> None:
    pieces = [_random(CHUNK + 3, 1), _random(100, 2)]
    want = np.zeros(HEADER_BYTES, dtype=np.uint8)
    framing.seal_parts(want, pieces, "k", LAYOUT)
    got = np.zeros(HEADER_BYTES, dtype=np.uint8)
    framing.seal_header(got, "k", LAYOUT, sum(p.shape[0] for p in pieces))
    assert not np.array_equal(got, want)  # the checksum is missing until set
    framing.set_checksum(got, framing.copy_checksummed([np.empty_like(p) for p in pieces], pieces))
    assert np.array_equal(got, want)


def test_verify_parts_with_a_landed_checksum_still_checks_every_field() -> None:
    pieces = [_random(1000, 3)]
    head = np.zeros(HEADER_BYTES, dtype=np.uint8)
    framing.seal_parts(head, pieces, "k", LAYOUT)
    right = xxhash.xxh3_64_intdigest(pieces[0].tobytes())
    framing.verify_parts(head, HEADER_BYTES + 1000, pieces, "k", LAYOUT, landed_checksum=right)
    with pytest.raises(FrameError) as bad:
        framing.verify_parts(head, HEADER_BYTES + 1000, pieces, "k", LAYOUT, landed_checksum=right ^ 1)
    assert bad.value.fault is FrameFault.BAD_CHECKSUM
    with pytest.raises(FrameError) as foreign:
        framing.verify_parts(head, HEADER_BYTES + 1000, pieces, "other", LAYOUT, landed_checksum=right)
    assert foreign.value.fault is FrameFault.OTHER_KEY


@pytest.fixture
async def store() -> AsyncIterator[EmbeddedStore]:
    # threshold 0: every copy runs in the store's worker thread, as large batches do
    s = EmbeddedStore(64 << 20, thread_threshold_bytes=0)
    yield s
    await s.close()


def _object(seed: int, sizes: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    head = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    return head, [torch.from_numpy(_random(n, seed + i)) for i, n in enumerate(sizes)]


async def test_put_sealed_stores_the_object_seal_parts_and_put_parts_store(store: EmbeddedStore) -> None:
    sizes = [CHUNK + 5, 333, 2 * CHUNK]
    head, pieces = _object(7, sizes)
    framing.seal_header(head.numpy(), "a", LAYOUT, sum(sizes))
    assert await store.put_sealed(["a"], [[head, *pieces]]) == [Outcome.OK]
    twin = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    framing.seal_parts(twin.numpy(), [p.numpy() for p in pieces], "b", LAYOUT)
    assert await store.put_parts(["b"], [[twin, *pieces]]) == [Outcome.OK]
    a = torch.zeros(HEADER_BYTES + sum(sizes), dtype=torch.uint8)
    b = torch.zeros_like(a)
    assert [r.outcome for r in await store.get(["a", "b"], [a, b])] == [Outcome.OK, Outcome.OK]
    assert torch.equal(framing.verify(a, a.numel(), "a", LAYOUT), torch.cat(pieces))
    assert torch.equal(a[HEADER_BYTES:], b[HEADER_BYTES:])
    # same header but for the key digest (bytes 16..32)
    assert torch.equal(torch.cat([a[:16], a[32:HEADER_BYTES]]), torch.cat([b[:16], b[32:HEADER_BYTES]]))
    assert await store.put_sealed(["a"], [[head, *pieces]]) == [Outcome.EXISTS]


async def test_get_checked_reports_the_checksum_of_the_landed_bytes(store: EmbeddedStore) -> None:
    sizes = [3 * CHUNK + 1, 64]
    head, pieces = _object(11, sizes)
    framing.seal_header(head.numpy(), "k", LAYOUT, sum(sizes))
    assert await store.put_sealed(["k"], [[head, *pieces]]) == [Outcome.OK]
    into = [torch.zeros(HEADER_BYTES, dtype=torch.uint8), *(torch.zeros(n, dtype=torch.uint8) for n in sizes)]
    missing = [torch.zeros(HEADER_BYTES, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)]
    small = [torch.zeros(HEADER_BYTES, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)]
    got = await store.get_checked(["k", "nope", "k"], [into, missing, small])
    assert [r.outcome for r in got] == [Outcome.OK, Outcome.MISSING, Outcome.TOO_SMALL]
    assert got[0].nbytes == HEADER_BYTES + sum(sizes) and got[1].checksum is None
    assert all(torch.equal(x, y) for x, y in zip(into[1:], pieces))
    framing.verify_parts(into[0].numpy(), got[0].nbytes, [p.numpy() for p in into[1:]], "k", LAYOUT,
                         landed_checksum=got[0].checksum)
    # the stored payload rots: its landed checksum no longer matches its header
    frame = torch.zeros(HEADER_BYTES + sum(sizes), dtype=torch.uint8)
    assert (await store.get(["k"], [frame]))[0].outcome is Outcome.OK
    frame[HEADER_BYTES + 2 * CHUNK + 9] ^= 1
    await store.remove(["k"])
    assert await store.put(["k"], [frame]) == [Outcome.OK]
    (rot,) = await store.get_checked(["k"], [into])
    assert rot.outcome is Outcome.OK and rot.checksum != got[0].checksum
    with pytest.raises(FrameError) as err:
        framing.verify_parts(into[0].numpy(), rot.nbytes, [p.numpy() for p in into[1:]], "k", LAYOUT,
                             landed_checksum=rot.checksum)
    assert err.value.fault is FrameFault.BAD_CHECKSUM


async def test_sealed_calls_need_a_header_first(store: EmbeddedStore) -> None:
    body = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="64-byte frame header"):
        await store.put_sealed(["k"], [[body]])
    with pytest.raises(ValueError, match="64-byte frame header"):
        await store.get_checked(["k"], [[body, body]])


async def test_a_failed_checksummed_copy_is_failed_and_leaves_nothing(store: EmbeddedStore,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    head, pieces = _object(5, [1000])
    framing.seal_header(head.numpy(), "k", LAYOUT, 1000)

    def broken(targets: list[np.ndarray], sources: list[np.ndarray]) -> int:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(frame_copies, "copy_checksummed", broken)
    assert await store.put_sealed(["k"], [[head, *pieces]]) == [Outcome.FAILED]
    assert await store.exists(["k"]) == [False] and store.statistics().used_bytes == 0
    monkeypatch.undo()
    assert await store.put_sealed(["k"], [[head, *pieces]]) == [Outcome.OK]
    monkeypatch.setattr(frame_copies, "copy_checksummed", broken)
    (r,) = await store.get_checked(["k"], [[torch.zeros(64, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)]])
    assert r.outcome is Outcome.FAILED and r.checksum is None


async def test_resilient_store_forwards_checksums_only_when_the_inner_store_has_them() -> None:
    inner = EmbeddedStore(8 << 20)
    wrapped = ResilientStore(inner)
    try:
        assert supports_checksums(inner) and supports_checksums(wrapped)
        head, pieces = _object(3, [CHUNK + 1])
        framing.seal_header(head.numpy(), "k", LAYOUT, CHUNK + 1)
        assert await wrapped.put_sealed(["k"], [[head, *pieces]]) == [Outcome.OK]
        into = [torch.zeros(64, dtype=torch.uint8), torch.zeros(CHUNK + 1, dtype=torch.uint8)]
        (r,) = await wrapped.get_checked(["k"], [into])
        assert r.outcome is Outcome.OK and r.checksum == xxhash.xxh3_64_intdigest(pieces[0].numpy().tobytes())
        # a wrapper that forwards only the plain protocol has neither scatter nor checksums
        gated = ResilientStore(GatedStore(EmbeddedStore(8 << 20)))
        assert not supports_scatter(gated) and not supports_checksums(gated)
        await gated.close()
    finally:
        await wrapped.close()


# ---- the data plane over a checksumming store, in place and staged ------------------------

P = 4
ROWS = 64


def _pools(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    # objects of 4 rows x 2 layers x K and V x 40 KiB: 640 KiB, so each piece spans chunks
    g = torch.Generator().manual_seed(seed)
    k = [torch.randint(0, 256, (ROWS, 40 << 10), dtype=torch.uint8, generator=g) for _ in range(2)]
    v = [torch.randint(0, 256, (ROWS, 40 << 10), dtype=torch.uint8, generator=g) for _ in range(2)]
    return k, v


def _plane(k: list[torch.Tensor], v: list[torch.Tensor], store: EmbeddedStore, in_place: bool) -> DataPlane:
    return DataPlane(PoolSet([kv_view(k, v, layer_ids=[0, 1], page_size=P)]), store,
                     DataPlaneConfig(in_place_min_bytes=0, in_place=in_place), namespace="cc")


def _rows(*pages: int) -> torch.Tensor:
    return torch.tensor(pages)[:, None] * P + torch.arange(P)


class CallsStore(EmbeddedStore):
    """Records which store calls moved objects."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.calls: set[str] = set()

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        self.calls.add("put")
        return await super().put(keys, buffers)

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        self.calls.add("get")
        return await super().get(keys, buffers)

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        self.calls.add("put_sealed")
        return await super().put_sealed(keys, parts)

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        self.calls.add("get_checked")
        return await super().get_checked(keys, parts)


class UncheckedStore(CallsStore):
    """Declares checksums but answers gets without one: a store that broke its word."""

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        return [GetResult(r.outcome, r.nbytes) for r in await super().get_checked(keys, parts)]


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
@pytest.mark.parametrize("fault", ["none", "flip_payload", "unchecked"])
async def test_a_checksumming_store_restores_exactly_or_reports_the_fault(fault: str, in_place: bool) -> None:
    """In place and staged alike, objects move through ``put_sealed`` / ``get_checked`` (no
    hash pass of the runtime's own), restore byte-exactly, and a corrupt object or a missing
    landed checksum is a counted fault, never a landed layer."""
    store: CallsStore = UncheckedStore(64 << 20) if fault == "unchecked" else CallsStore(64 << 20)
    (ka, va), (kb, vb) = _pools(1), _pools(2)
    src, dst = _rows(3, 0, 9), _rows(1, 12, 5)
    try:
        async with _plane(ka, va, store, in_place) as dp:
            assert all(a.arena.store_checksums and a.arena.scatter is in_place for a in dp.actors.values())
            assert (await (await dp.offload([Transfer(PoolKind.FULL, ["o0", "o1", "o2"], src)])).wait()).ok
        if fault == "flip_payload":
            size = HEADER_BYTES + 2 * 2 * P * (40 << 10)
            frame = torch.zeros(size, dtype=torch.uint8)
            assert (await store.get(["o1"], [frame]))[0].outcome is Outcome.OK
            frame[size - 7] ^= 0x40
            await store.remove(["o1"])
            assert await store.put(["o1"], [frame]) == [Outcome.OK]
        before = [t.clone() for t in (*kb, *vb)]
        async with _plane(kb, vb, store, in_place) as dp:
            ticket = await dp.load([Transfer(PoolKind.FULL, ["o0", "o1", "o2"], dst)])
            out = await ticket.wait()
            if fault == "none":
                assert out.ok and all([await ticket.wait_layer(layer) for layer in (0, 1)])
                r_src, r_dst = src.reshape(-1), dst.reshape(-1)
                assert all(torch.equal(b[r_dst], a[r_src]) for a, b in zip((*ka, *va), (*kb, *vb)))
                # rows no object named are untouched
                rest = torch.ones(ROWS, dtype=torch.bool)
                rest[r_dst] = False
                assert all(torch.equal(b[rest], x[rest]) for b, x in zip((*kb, *vb), before))
            else:
                landed = [True, False, True] if fault == "flip_payload" else [False, False, False]
                assert not out.ok and out.objects[PoolKind.FULL] == landed
                assert out.faults == ({"bad_checksum": 1} if fault == "flip_payload" else {"failed": 3})
                assert [await ticket.wait_layer(layer) for layer in (0, 1)] == [False, False]
        assert store.calls == {"put_sealed", "get_checked"} | ({"put", "get"} if fault == "flip_payload" else set())
    finally:
        await store.close()


async def test_the_checksum_cost_bench_moves_and_verifies_every_way() -> None:
    from hylinker.tools.lab.checksum import WAYS, measure

    row = await measure(64 << 10, 1 << 20, rounds=1)
    assert row["objects"] == 16
    assert all(row[f"{w}_{d}"]["best_gbps"] > 0 for w in WAYS for d in ("put", "get"))
    assert row["raw_put"]["vs_raw_median"] == 1.0
