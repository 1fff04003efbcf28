"""MooncakeStore against a real ``mooncake_master`` on loopback (adapter-specific behaviour).

The store conformance suite covers the protocol in general; these tests pin down what is
Mooncake's own: return-code mapping, first-writer-wins as the client reports it, zero-copy
vs bounce-buffer paths, fast failure against a dead master, the outage/restart story and
touch refreshing eviction recency.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from hylinker.stores import framing
from hylinker.stores.base import (
    GetResult,
    Outcome,
    StoreClosedError,
    StoreUnavailableError,
)
from hylinker.stores.mooncake import MooncakeConfig, MooncakeStore
from hylinker.stores.mooncake_client import get_outcome, put_outcome
from hylinker.stores.mooncake_master import MooncakeMaster, free_port
from hylinker.stores.rows import CODE, RowBatch, digests_of

pytestmark = pytest.mark.mooncake

LAYOUT = b"layout-fingerprint-for-tests"
MIB = 1 << 20


def prefix() -> str:
    return f"t-{uuid.uuid4().hex}-"


def framed(key: str, payload_bytes: int, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A sealed frame for ``key`` with deterministic payload, in ``out`` when given."""
    frame = out if out is not None else torch.empty(framing.framed_size(payload_bytes),
                                                    dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    framing.payload_view(frame).copy_(
        torch.randint(0, 256, (payload_bytes,), dtype=torch.uint8, generator=gen)
    )
    framing.seal(frame, key, LAYOUT)
    return frame


async def open_store(master: MooncakeMaster, **options: Any) -> MooncakeStore:
    config = MooncakeConfig(master_address=master.address, segment_bytes=64 * MIB,
                            workers=2, **options)
    return await MooncakeStore.open(config)


# -- pure mapping (no master needed) ------------------------------------------------------


def test_put_code_mapping() -> None:
    assert put_outcome(0) is Outcome.OK
    assert put_outcome(-200) is Outcome.FULL
    assert put_outcome(-705) is Outcome.EXISTS
    assert put_outcome(-706) is Outcome.LEASED
    assert put_outcome(-900) is Outcome.UNREACHABLE
    assert put_outcome(-800) is Outcome.FAILED
    assert put_outcome(-1) is Outcome.FAILED


def test_get_code_mapping() -> None:
    assert get_outcome(0) is Outcome.OK
    assert get_outcome(4096) is Outcome.OK
    assert get_outcome(-704) is Outcome.MISSING
    assert get_outcome(-703) is Outcome.MISSING
    assert get_outcome(-600) is Outcome.TOO_SMALL
    assert get_outcome(-706) is Outcome.LEASED
    assert get_outcome(-900) is Outcome.UNREACHABLE
    assert get_outcome(-707) is Outcome.FAILED
    assert get_outcome(-800) is Outcome.FAILED


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="host:port"):
        MooncakeConfig(master_address="no-port-here")
    with pytest.raises(ValueError):
        MooncakeConfig(master_address="127.0.0.1:1", workers=0)
    with pytest.raises(ValueError):
        MooncakeConfig(master_address="127.0.0.1:1", segment_bytes=-1)
    with pytest.raises(ValueError, match="transfer_queue"):
        MooncakeConfig(master_address="127.0.0.1:1", workers=4, transfer_queue=3)


# -- against the session master ------------------------------------------------------------


async def test_framed_round_trip_registered_and_bounced(mooncake_store: MooncakeStore) -> None:
    store = mooncake_store
    p = prefix()
    region = torch.zeros(8 * MIB, dtype=torch.uint8)
    store.register(region)
    keys = [f"{p}{i}" for i in range(40)]
    sizes = [64 * 1024 - framing.HEADER_BYTES] * 30 + [MIB] * 10
    frames: list[torch.Tensor] = []
    offset = 0
    for i, (key, size) in enumerate(zip(keys, sizes)):
        if i % 2 == 0:  # half inside the registered region (zero-copy), half outside
            n = framing.framed_size(size)
            frames.append(framed(key, size, i, region[offset : offset + n]))
            offset += (n + 63) & ~63
        else:
            frames.append(framed(key, size, i))
    assert await store.put(keys, frames) == [Outcome.OK] * len(keys)
    assert await store.exists(keys) == [True] * len(keys)

    outs = [torch.zeros(f.numel() + 100, dtype=torch.uint8) for f in frames]
    results = await store.get(keys, outs)
    for key, frame, out, result in zip(keys, frames, outs, results):
        assert result == GetResult(Outcome.OK, frame.numel())
        payload = framing.verify(out, result.nbytes, key, LAYOUT)
        assert torch.equal(payload, framing.payload_view(frame))
    stats = store.statistics()
    assert stats.puts == len(keys) and stats.gets == len(keys)
    assert stats.put_bytes == sum(f.numel() for f in frames)


async def test_first_writer_wins(mooncake_store: MooncakeStore) -> None:
    key = prefix() + "k"
    first = framed(key, 1000, seed=1)
    second = framed(key, 3000, seed=2)
    assert await mooncake_store.put([key], [first]) == [Outcome.OK]
    assert await mooncake_store.put([key], [second]) == [Outcome.EXISTS]
    out = torch.zeros(second.numel(), dtype=torch.uint8)
    [result] = await mooncake_store.get([key], [out])
    assert result == GetResult(Outcome.OK, first.numel())
    framing.verify(out, result.nbytes, key, LAYOUT)
    assert mooncake_store.statistics().put_exists == 1


async def test_partial_batches(mooncake_store: MooncakeStore) -> None:
    p = prefix()
    a, b, c = p + "a", p + "b", p + "c"
    fa, fb = framed(a, 5000, 1), framed(b, 5000, 2)
    assert await mooncake_store.put([a], [fa]) == [Outcome.OK]
    assert await mooncake_store.put([a, b], [fa, fb]) == [Outcome.EXISTS, Outcome.OK]

    big = torch.zeros(fa.numel(), dtype=torch.uint8)
    small = torch.zeros(100, dtype=torch.uint8)
    other = torch.zeros(fb.numel(), dtype=torch.uint8)
    results = await mooncake_store.get([a, c, b], [big, other, small])
    assert [r.outcome for r in results] == [Outcome.OK, Outcome.MISSING, Outcome.TOO_SMALL]
    assert results[0].nbytes == fa.numel() and results[1].nbytes == 0
    assert torch.equal(big, fa)
    assert small.eq(0).all()  # a too-small buffer is left untouched
    assert await mooncake_store.exists([a, c, b]) == [True, False, True]


async def test_missing_and_remove(mooncake_store: MooncakeStore) -> None:
    p = prefix()
    keys = [p + "x", p + "y"]
    frames = [framed(k, 2000, i) for i, k in enumerate(keys)]
    assert await mooncake_store.get(keys, [torch.zeros(10, dtype=torch.uint8)] * 2) == [
        GetResult(Outcome.MISSING)
    ] * 2
    await mooncake_store.put(keys, frames)
    await mooncake_store.exists(keys)  # grants leases; remove still works (force)
    assert await mooncake_store.remove([keys[0], p + "never"]) == 1
    assert await mooncake_store.exists(keys) == [False, True]
    out = torch.zeros(frames[0].numel(), dtype=torch.uint8)
    assert (await mooncake_store.get([keys[0]], [out]))[0].outcome is Outcome.MISSING
    # a removed key can be written again
    assert await mooncake_store.put([keys[0]], [frames[0]]) == [Outcome.OK]


async def test_full_segment_reports_full(mooncake_store: MooncakeStore) -> None:
    p = prefix()
    buf = torch.ones(MIB, dtype=torch.uint8)
    keys = [f"{p}{i}" for i in range(100)]  # 100 MiB into a 64 MiB segment
    outcomes = await mooncake_store.put(keys, [buf] * len(keys))
    assert Outcome.FULL in outcomes
    assert set(outcomes) <= {Outcome.OK, Outcome.FULL}
    assert outcomes.count(Outcome.OK) >= 32
    assert mooncake_store.statistics().put_failures == outcomes.count(Outcome.FULL)


async def test_bad_input_is_a_clear_error(mooncake_store: MooncakeStore) -> None:
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        await mooncake_store.put(["k"], [torch.zeros(4, dtype=torch.float32)])
    with pytest.raises(ValueError, match="keys but"):
        await mooncake_store.get(["a", "b"], [torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="non-empty"):
        await mooncake_store.exists([""])
    with pytest.raises(ValueError, match="contiguous CPU"):
        mooncake_store.register(torch.zeros(0, dtype=torch.uint8))


async def test_close_drains_in_flight_and_refuses_later_calls(
    mooncake_store: MooncakeStore,
) -> None:
    store = mooncake_store
    p = prefix()
    keys = [f"{p}{i}" for i in range(24)]
    frames = [framed(k, MIB, i) for i, k in enumerate(keys)]  # unregistered: bounce copies
    results: list[list[Outcome]] = []

    async def writer() -> None:
        results.append(await store.put(keys, frames))

    async with anyio.create_task_group() as tg:
        tg.start_soon(writer)
        with anyio.fail_after(10):
            while store._in_flight == 0:
                await anyio.sleep(0)
        await store.close()
        assert store._in_flight == 0  # close returned only after the put finished
    assert results == [[Outcome.OK] * len(keys)]

    buf = torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(StoreClosedError):
        await store.put(["k"], [buf])
    with pytest.raises(StoreClosedError):
        await store.get(["k"], [buf])
    with pytest.raises(StoreClosedError):
        await store.exists(["k"])
    with pytest.raises(StoreClosedError):
        await store.touch(["k"])
    with pytest.raises(StoreClosedError):
        await store.remove(["k"])
    with pytest.raises(StoreClosedError):
        store.register(buf)
    await store.close()  # idempotent


async def test_cancelled_get_returns_only_after_the_call(mooncake_store: MooncakeStore) -> None:
    store = mooncake_store
    p = prefix()
    keys = [f"{p}{i}" for i in range(16)]
    frames = [framed(k, MIB, i) for i, k in enumerate(keys)]
    await store.put(keys, frames)
    outs = [torch.zeros(f.numel(), dtype=torch.uint8) for f in frames]
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.get, keys, outs)
            while store._in_flight == 0:
                await anyio.sleep(0)
            scope.cancel()
    # the worker thread finished before the cancellation landed: nothing writes `outs` now
    assert store._in_flight == 0
    snapshot = [o.clone() for o in outs]
    await anyio.sleep(0.05)
    assert all(torch.equal(a, b) for a, b in zip(outs, snapshot))


async def test_chunked_batches_and_bounce_growth(mooncake_master: MooncakeMaster) -> None:
    store = await open_store(mooncake_master, max_batch=5, bounce_bytes=4096)
    try:
        p = prefix()
        keys = [f"{p}{i}" for i in range(23)]
        sizes = [3000] * 20 + [MIB, 2 * MIB, 100]  # the big ones outgrow the bounce buffer
        frames = [framed(k, s, i) for i, (k, s) in enumerate(zip(keys, sizes))]
        assert await store.put(keys, frames) == [Outcome.OK] * len(keys)
        outs = [torch.zeros(f.numel(), dtype=torch.uint8) for f in frames]
        results = await store.get(keys, outs)
        assert all(r.outcome is Outcome.OK for r in results)
        for key, out, r in zip(keys, outs, results):
            framing.verify(out, r.nbytes, key, LAYOUT)
        assert await store.exists([*keys, p + "none"]) == [True] * len(keys) + [False]
        assert await store.remove(keys) == len(keys)
    finally:
        await store.close()


class BufferCount:
    """Wraps the client: the buffers each data call hands the transfer engine."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._client, name)
        if not name.startswith(("batch_put_from", "batch_get_into")):
            return real

        def call(keys: list[str], ptrs: list[Any], sizes: list[Any], *rest: Any) -> Any:
            many = name.endswith("multi_buffers")
            self.calls.append((name, sum(map(len, ptrs)) if many else len(ptrs)))
            return real(keys, ptrs, sizes, *rest)
        return call


@pytest.mark.parametrize("parts", [1, 3, 25])
async def test_calls_stay_within_the_transfer_queue(mooncake_master: MooncakeMaster, parts: int) -> None:
    """No client call carries more than ``transfer_queue // workers`` buffers (Mooncake's TCP
    lanes reject the excess: a 2,400-buffer call to a peer's segment lost every object), for
    plain, multi-buffer and row-described calls alike, and every object still round-trips."""
    store = await open_store(mooncake_master, transfer_queue=60)  # workers=2: 30 per call
    spy = BufferCount(store._batches.client)
    store._batches.client = spy
    try:
        p, n, row = prefix(), 40, 512
        keys = [f"{p}{i}" for i in range(n)]
        region = torch.zeros(2 * n * (64 + parts * row), dtype=torch.uint8)
        store.register(region)
        frames = [framed(k, parts * row, i) for i, k in enumerate(keys)]
        assert await store.put(keys[:n // 2], frames[:n // 2]) == [Outcome.OK] * (n // 2)
        half = region[: n * (64 + parts * row)]
        pieces = []
        for i in range(n // 2, n):
            at = i * (64 + parts * row)
            half[at:at + frames[i].numel()].copy_(frames[i])
            cuts = [at, at + 64, *(at + 64 + (j + 1) * row for j in range(parts))]
            pieces.append([half[a:b] for a, b in itertools.pairwise(cuts)])
        assert await store.put_parts(keys[n // 2:], pieces) == [Outcome.OK] * (n // 2)
        outs = [torch.zeros(f.numel(), dtype=torch.uint8) for f in frames]
        got = await store.get(keys, outs)
        assert [r.outcome for r in got] == [Outcome.OK] * n
        assert all(torch.equal(a, b) for a, b in zip(outs, frames))
        dest = region[n * (64 + parts * row):]
        back = [[dest[i * 64:(i + 1) * 64], *(dest[n * 64 + (i * parts + j) * row:][:row] for j in range(parts))]
                for i in range(n)]
        res = await store.get_parts(keys, back)
        assert [r.outcome for r in res] == [Outcome.OK] * n
        assert all(torch.equal(torch.cat(b), f) for b, f in zip(back, frames))
        # row-described: each segment a pool of n rows of `row` bytes
        pool = [torch.randint(0, 256, (n * row,), dtype=torch.uint8) for _ in range(parts)]
        for t in pool:
            store.register(t)
        segs = [t.numpy() for t in pool]
        rkeys = [f"{p}r{i}" for i in range(n)]
        tmpl = framing.header_template(LAYOUT, parts * row, framing.Integrity.CHECKSUM)
        rb = RowBatch(rkeys, digests_of(rkeys), segs, [row] * parts, 1, np.arange(n, dtype=np.int64), tmpl, None)
        assert (await store.put_rows(rb, True)).tolist() == [CODE[Outcome.OK]] * n
        assert max(b for _, b in spy.calls) <= 30
        per = parts + 1  # header and parts
        assert sum(b for _, b in spy.calls) == n // 2 + n // 2 * per + n + n * per + n * per  # each moved once
    finally:
        await store.close()


# -- failure modes ---------------------------------------------------------------------------


async def test_dead_master_fails_fast_with_clear_error(mooncake_master: MooncakeMaster) -> None:
    port = free_port()  # nothing listens here
    with anyio.fail_after(30), pytest.raises(StoreUnavailableError, match="not accepting"):
        await MooncakeStore.open(MooncakeConfig(master_address=f"127.0.0.1:{port}"))


async def test_master_outage_then_restart(mooncake_master: MooncakeMaster) -> None:
    """Kill the master mid-run: calls answer UNREACHABLE or raise StoreUnavailableError,
    quickly and without crashing; a master restarted on the same address is picked up by
    the same store (the client re-registers its segment) and by new stores. Objects stored
    before the outage are gone: a new master starts empty."""
    port = free_port()
    master = MooncakeMaster(rpc_port=port).start()
    store: MooncakeStore | None = None
    try:
        store = await open_store(master)
        p = prefix()
        before = framed(p + "before", 4000, 1)
        assert await store.put([p + "before"], [before]) == [Outcome.OK]

        master.kill()
        buf = framed(p + "during", 4000, 2)
        out = torch.zeros(buf.numel(), dtype=torch.uint8)
        with anyio.fail_after(60):
            assert await store.put([p + "during"], [buf]) == [Outcome.UNREACHABLE]
            assert await store.get([p + "before"], [out]) == [GetResult(Outcome.UNREACHABLE)]
            with pytest.raises(StoreUnavailableError):
                await store.exists([p + "before"])
            with pytest.raises(StoreUnavailableError):
                await store.remove([p + "before"])
            await store.touch([p + "before"])  # a hint: no exception
        assert store.statistics().put_failures == 1

        master.start()  # same port
        with anyio.fail_after(60):
            while True:
                [outcome] = await store.put([p + "after"], [buf])
                if outcome is Outcome.OK:
                    break
                assert outcome in (Outcome.FULL, Outcome.UNREACHABLE)  # segment remounting
                await anyio.sleep(0.2)
        assert (await store.get([p + "before"], [out]))[0].outcome is Outcome.MISSING

        fresh = await open_store(master)
        try:
            assert await fresh.put([p + "fresh"], [buf]) == [Outcome.OK]
        finally:
            await fresh.close()
    finally:
        if store is not None:
            await store.close()
        master.close()


async def test_touch_refreshes_eviction_recency(mooncake_master: MooncakeMaster) -> None:
    """``touch`` (batch_is_exist) moves objects to the back of Mooncake's eviction order."""
    with MooncakeMaster(lease_ttl_ms=100) as master:
        store = await open_store(master)
        try:
            assert store.capabilities.touch
            p = prefix()
            buf = torch.ones(MIB, dtype=torch.uint8)
            old = [f"{p}old{i}" for i in range(40)]
            assert await store.put(old, [buf] * 40) == [Outcome.OK] * 40
            await anyio.sleep(0.3)
            hot = old[:20]  # the oldest half: without a touch these go first
            await store.touch(hot)
            await anyio.sleep(0.3)  # let the touch leases expire, keeping their recency
            new = [f"{p}new{i}" for i in range(40)]
            for key in new:  # 40 more MiB into 64: the master must evict ~16+ objects
                with anyio.fail_after(30):
                    while (await store.put([key], [buf]))[0] is Outcome.FULL:
                        await anyio.sleep(0.1)
            present = await store.exists(old)
            hot_left, cold_left = sum(present[:20]), sum(present[20:])
            assert hot_left + cold_left < 40  # eviction happened
            assert hot_left > cold_left
        finally:
            await store.close()


def test_master_helper_reports_missing_binary() -> None:
    from hylinker.stores.mooncake_master import MooncakeMasterError

    master = MooncakeMaster(binary="/nonexistent/mooncake_master")
    with pytest.raises(MooncakeMasterError, match="not executable"):
        master.start(timeout_s=2)


async def test_scatter_gather_registered_and_joined(mooncake_store: MooncakeStore) -> None:
    """put_parts / get_parts: one object from / into several buffers, in place when every
    buffer is registered (multi-buffer batch calls), joined through the bounce buffer when not;
    both give the same object as a plain put."""
    store = mooncake_store
    assert store.capabilities.scatter
    p = prefix()
    region = torch.zeros(4 * MIB, dtype=torch.uint8)
    store.register(region)
    frame = framed(f"{p}a", 300_000, 1)
    head, body = frame[:framing.HEADER_BYTES], frame[framing.HEADER_BYTES:]
    # registered: header and two payload pieces at scattered places of the region
    r_head, r_a, r_b = region[0:64], region[MIB: MIB + 100_000], region[2 * MIB: 2 * MIB + 200_000]
    r_head.copy_(head), r_a.copy_(body[:100_000]), r_b.copy_(body[100_000:])
    loose = [head.clone(), body[:100_000].clone(), body[100_000:].clone()]
    got = await store.put_parts([f"{p}a", f"{p}b", f"{p}a"], [[r_head, r_a, r_b], loose, loose])
    assert got == [Outcome.OK, Outcome.OK, Outcome.EXISTS]
    # a plain get sees one contiguous object
    whole = torch.zeros(frame.numel(), dtype=torch.uint8)
    assert await store.get([f"{p}b"], [whole]) == [GetResult(Outcome.OK, frame.numel())]
    assert torch.equal(whole, frame)
    # in place into registered pieces, and joined into unregistered ones
    d_head, d_a, d_b = region[64:128], region[3 * MIB: 3 * MIB + 100_000], region[MIB + 200_000: MIB + 400_000]
    u = [torch.zeros(64, dtype=torch.uint8), torch.zeros(100_000, dtype=torch.uint8),
         torch.zeros(200_000, dtype=torch.uint8)]
    res = await store.get_parts([f"{p}a", f"{p}b", f"{p}missing"], [[d_head, d_a, d_b], u, [region[-64:]]])
    assert res[:2] == [GetResult(Outcome.OK, frame.numel())] * 2 and res[2].outcome is Outcome.MISSING
    framing.verify_parts(d_head.numpy(), res[0].nbytes, [d_a.numpy(), d_b.numpy()], f"{p}a", LAYOUT)
    framing.verify_parts(u[0].numpy(), res[1].nbytes, [u[1].numpy(), u[2].numpy()], f"{p}a", LAYOUT)  # a's bytes
    # buffers smaller than the object: TOO_SMALL, nothing claimed
    small = await store.get_parts([f"{p}a"], [[region[:64], region[MIB: MIB + 1000]]])
    assert small[0].outcome is Outcome.TOO_SMALL
    # buffers larger than the object (a torn or foreign object): a failure, never OK
    big = await store.get_parts([f"{p}a"], [[region[:64], region[MIB: MIB + 400_000]]])
    assert big[0].outcome is not Outcome.OK


async def test_registered_regions_are_found_by_address_whatever_the_order(mooncake_store: MooncakeStore) -> None:
    """A buffer goes zero-copy only when it lies inside one registered region (regions are
    looked up by address, registered in any order); one that straddles two adjacent regions,
    or lies outside all of them, is bounced, and every object still round-trips."""
    store = mooncake_store
    p = prefix()
    block = torch.zeros(3 * MIB, dtype=torch.uint8)
    for lo in (2 * MIB, 0, MIB):  # three adjacent regions, registered out of address order
        store.register(block[lo:lo + MIB])
    base = block.data_ptr()
    assert store._batches.registered(base, MIB) and store._batches.registered(base + 2 * MIB, MIB)
    assert store._batches.registered(base + MIB + 5, 1000)
    assert not store._batches.registered(base + MIB - 10, 20)  # straddles two regions
    assert not store._batches.registered(base - 64, 64) and not store._batches.registered(base + 3 * MIB, 64)
    frame = framed(f"{p}x", 200_000, 3)
    head, body = frame[:framing.HEADER_BYTES], frame[framing.HEADER_BYTES:]
    inside = [block[0:64], block[2 * MIB: 2 * MIB + 200_000]]
    straddle = [block[64:128], block[MIB - 100_000: MIB + 100_000]]
    for parts in (inside, straddle):
        parts[0].copy_(head)
        parts[1].copy_(body)
    got = await store.put_parts([f"{p}in", f"{p}across"], [inside, straddle])
    assert got == [Outcome.OK, Outcome.OK]
    for key in (f"{p}in", f"{p}across"):
        whole = torch.zeros(frame.numel(), dtype=torch.uint8)
        assert await store.get([key], [whole]) == [GetResult(Outcome.OK, frame.numel())]
        assert torch.equal(whole, frame)


def test_benches_record_the_mooncake_copy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both Mooncake benches record ``MC_STORE_MEMCPY`` (local memcpy vs loopback TCP)."""
    from hylinker.tools.bench.mooncake import copy_path_setting

    monkeypatch.delenv("MC_STORE_MEMCPY", raising=False)
    assert copy_path_setting() == "unset"
    monkeypatch.setenv("MC_STORE_MEMCPY", "0")
    assert copy_path_setting() == "0"


def test_hash_overlap_bench_partitions_and_puts_every_object(mooncake_master: MooncakeMaster) -> None:
    """The checksum-cost bench (tools/lab/hash_overlap.py) puts every object in each of its
    three cases (a failed put raises) and its sub-batches cover the objects once, in order.
    (``mooncake_master``, the session's master, only gates the test: the bench starts its own.)"""
    from hylinker.tools.lab import hash_overlap as bench

    for n in (1, 2, 5, 48):
        batches = bench._sub_batches(n)
        assert [i for lo, hi in batches for i in range(lo, hi)] == list(range(n))
    out = bench.run(64, 5, 2, segment_mib=64)
    assert {k: len(v) for k, v in out["runs_ms"].items()} == {"plain": 2, "overlapped": 2, "serial": 2}
    assert all(out[f"{k}_ms"] > 0 for k in ("plain", "overlapped", "serial"))
