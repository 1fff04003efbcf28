"""Behaviour specific to the embedded store: LRU order, slabs, pins, threads, memory."""

from __future__ import annotations

import tracemalloc
import uuid

import anyio
import pytest
import torch

from hylinker.stores.base import GetResult, Outcome
from hylinker.stores.embedded import SLOT_ALIGN, EmbeddedStore

OBJ = 4096


def keys_(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"emb-{prefix}-{i}" for i in range(n)]


def obj(i: int, nbytes: int = OBJ) -> torch.Tensor:
    return torch.full((nbytes,), i % 251, dtype=torch.uint8)


async def put_each(store: EmbeddedStore, keys: list[str], nbytes: int = OBJ) -> None:
    for i, key in enumerate(keys):
        assert await store.put([key], [obj(i, nbytes)]) == [Outcome.OK]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": -5}, "capacity_bytes"),
        ({"capacity_bytes": 1024, "chunk_bytes": 8}, "chunk_bytes"),
        ({"capacity_bytes": 1024, "max_workers": 0}, "max_workers"),
        ({"capacity_bytes": 1024, "thread_threshold_bytes": -1}, "thread_threshold_bytes"),
    ],
)
def test_bad_configuration_is_rejected(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EmbeddedStore(**kwargs)  # type: ignore[arg-type]


async def test_lru_order_follows_puts_gets_and_touches() -> None:
    store = EmbeddedStore(16 * OBJ)
    a, b, c, d = keys_(4)
    await put_each(store, [a, b, c, d])
    assert store.lru_keys() == [a, b, c, d]
    await store.get([b], [torch.empty(OBJ, dtype=torch.uint8)])
    assert store.lru_keys() == [a, c, d, b]
    await store.touch([a, "nope"])
    assert store.lru_keys() == [c, d, b, a]
    await store.exists([c])  # exists is a hint, not a use
    assert store.lru_keys() == [c, d, b, a]
    await store.put([c], [obj(0)])  # a losing put is not a use either
    assert store.lru_keys() == [c, d, b, a]
    assert store.statistics().touches == 1
    await store.close()


async def test_eviction_takes_the_least_recently_used_first() -> None:
    store = EmbeddedStore(3 * OBJ, chunk_bytes=OBJ)
    keys = keys_(5)
    await put_each(store, keys[:3])
    await store.touch([keys[0]])
    await put_each(store, keys[3:])
    assert store.lru_keys() == [keys[0], keys[3], keys[4]]
    stats = store.statistics()
    assert stats.evictions == 2
    assert stats.objects == 3
    assert stats.used_bytes == 3 * OBJ == stats.capacity_bytes
    await store.close()


async def test_mixed_sizes_evict_enough_bytes() -> None:
    store = EmbeddedStore(8 * OBJ)
    small = keys_(8)
    await put_each(store, small)
    (big,) = keys_(1)
    assert await store.put([big], [obj(1, 3 * OBJ)]) == [Outcome.OK]
    assert store.lru_keys() == [*small[3:], big]
    assert store.statistics().used_bytes == 8 * OBJ
    await store.close()


async def test_slots_are_64_byte_rounded_and_accounted() -> None:
    store = EmbeddedStore(1 << 20)
    (key,) = keys_(1)
    assert await store.put([key], [obj(3, 100)]) == [Outcome.OK]
    assert store.statistics().used_bytes == 2 * SLOT_ALIGN
    buf = torch.zeros(200, dtype=torch.uint8)
    assert await store.get([key], [buf]) == [GetResult(Outcome.OK, 100)]
    assert torch.equal(buf[:100], obj(3, 100)) and not buf[100:].any()
    await store.close()


async def test_a_batch_never_evicts_its_own_objects() -> None:
    store = EmbeddedStore(2 * OBJ, chunk_bytes=OBJ)
    keys = keys_(3)
    outcomes = await store.put(keys, [obj(i) for i in range(3)])
    assert outcomes == [Outcome.OK, Outcome.OK, Outcome.FULL]
    assert store.statistics().put_failures == 1
    await store.close()


async def test_slab_slots_are_reused_after_eviction() -> None:
    store = EmbeddedStore(8 * OBJ, chunk_bytes=4 * OBJ)
    await put_each(store, keys_(8))
    allocated = store.allocated_bytes()
    assert allocated == 8 * OBJ
    for _ in range(5):
        await put_each(store, keys_(8))
    assert store.allocated_bytes() == allocated
    assert store.statistics().evictions == 40
    await store.close()


async def test_empty_chunks_are_kept_until_another_size_needs_the_memory() -> None:
    store = EmbeddedStore(8 * OBJ, chunk_bytes=4 * OBJ)
    keys = keys_(8)
    await put_each(store, keys)
    assert store.allocated_bytes() == 8 * OBJ
    assert await store.remove(keys) == 8
    assert store.statistics().used_bytes == 0
    assert store.allocated_bytes() == 8 * OBJ  # kept: refilling them costs no page faults
    await put_each(store, keys_(4), nbytes=2 * OBJ)  # another size class
    assert store.allocated_bytes() <= 8 * OBJ  # the empty chunks made way
    assert store.statistics().used_bytes == 8 * OBJ
    await put_each(store, keys_(2))  # and back: evicts, then reuses memory
    assert store.allocated_bytes() <= 8 * OBJ + 4 * OBJ
    await store.close()


async def test_no_python_bytes_per_object() -> None:
    """The index is the only Python-side cost of an object; its bytes live in slabs."""
    n, size = 2000, OBJ
    store = EmbeddedStore(2 * n * size)
    keys = keys_(n)
    buffers = [obj(i, size) for i in range(n)]
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for start in range(0, n, 100):
            assert await store.put(keys[start : start + 100], buffers[start : start + 100]) == [
                Outcome.OK
            ] * 100
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    python_bytes = after - before
    assert python_bytes < n * size // 8, f"{python_bytes} Python bytes for {n * size} stored bytes"
    # A handful of slab chunks, not one buffer per object.
    assert sum(len(c.chunks) for c in store._classes) <= 2
    await store.close()


async def test_large_batches_copy_in_worker_threads_and_round_trip() -> None:
    store = EmbeddedStore(64 << 20, thread_threshold_bytes=0)
    keys = keys_(32)
    frames = [obj(i, 64 << 10) for i in range(32)]
    outs = [torch.empty(64 << 10, dtype=torch.uint8) for _ in range(32)]

    async def put_half(part: slice) -> None:
        assert set(await store.put(keys[part], frames[part])) == {Outcome.OK}

    async with anyio.create_task_group() as tg:
        tg.start_soon(put_half, slice(0, 16))
        tg.start_soon(put_half, slice(16, 32))
    results: list[list[GetResult]] = []

    async def get_half(part: slice) -> None:
        results.append(await store.get(keys[part], outs[part]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(get_half, slice(0, 16))
        tg.start_soon(get_half, slice(16, 32))
    assert all(r.outcome is Outcome.OK for rs in results for r in rs)
    assert all(torch.equal(a, b) for a, b in zip(frames, outs, strict=True))
    assert store._pins == {} and store._pending == {}
    await store.close()


async def test_a_slot_being_read_is_neither_evicted_nor_reused() -> None:
    store = EmbeddedStore(2 * OBJ, chunk_bytes=OBJ)
    a, b, c = keys_(3)
    await put_each(store, [a, b])
    buf = torch.empty(OBJ, dtype=torch.uint8)
    _, plan = store._plan_get([a], [buf])  # a read of `a` is now in flight
    await store.touch([b])  # `a` is the LRU object, but pinned
    assert await store.put([c], [obj(7)]) == [Outcome.OK]
    assert store.lru_keys() == [a, c]  # `b` went instead
    assert await store.remove([a]) == 1  # removed while pinned: slot freed after the read
    assert store.statistics().used_bytes == 2 * OBJ
    store._finish_get(plan, copied=True)
    assert store.statistics().used_bytes == OBJ
    assert store._pins == {}
    await store.close()


async def test_everything_pinned_means_full() -> None:
    store = EmbeddedStore(OBJ)
    a, b = keys_(2)
    await put_each(store, [a])
    _, plan = store._plan_get([a], [torch.empty(OBJ, dtype=torch.uint8)])
    assert await store.put([b], [obj(1)]) == [Outcome.FULL]
    store._finish_get(plan, copied=True)
    assert await store.put([b], [obj(1)]) == [Outcome.OK]
    await store.close()


async def test_a_cancelled_large_get_leaves_the_index_consistent() -> None:
    store = EmbeddedStore(64 << 20, thread_threshold_bytes=0)
    keys = keys_(8)
    await store.put(keys, [obj(i, 1 << 20) for i in range(8)])
    outs = [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(8)]
    with anyio.move_on_after(0):
        await store.get(keys, outs)
    assert store._pins == {}
    assert await store.exists(keys) == [True] * 8
    await store.close()


async def test_statistics_count_what_happened() -> None:
    store = EmbeddedStore(4 * OBJ)
    a, b, c = keys_(3)
    await store.put([a, b], [obj(1), obj(2)])
    await store.put([a], [obj(1)])
    await store.get([a, c], [torch.empty(OBJ, dtype=torch.uint8)] * 2)
    await store.get([b], [torch.empty(10, dtype=torch.uint8)])
    await store.exists([a])
    await store.remove([b])
    stats = store.statistics()
    assert (stats.puts, stats.put_bytes, stats.put_exists) == (2, 2 * OBJ, 1)
    assert (stats.gets, stats.get_bytes, stats.get_misses, stats.get_failures) == (1, OBJ, 1, 1)
    assert (stats.exists_calls, stats.removes, stats.objects) == (1, 1, 1)
    await store.close()
    assert store.statistics().objects == 0


def _check_free_lists(store: EmbeddedStore) -> None:
    """Every size class's heap of chunks with a free slot holds each such chunk exactly once."""
    for sc in store._classes:
        assert len(sc.partial) == len(set(sc.partial)), f"duplicate heap entries: {sorted(sc.partial)}"
        assert set(sc.partial) == sc.partial_set
        with_room = {c for c, ch in enumerate(sc.chunks) if ch is not None and sc.free[c]}
        assert sc.partial_set == with_room
        assert sc.has_free_slot() == bool(with_room)


async def test_eviction_churn_keeps_the_free_lists_bounded() -> None:
    """Eviction refills slots as fast as puts take them (a chunk fills, frees a slot, fills
    again): the free-chunk heap stays one entry per chunk with room, round after round. Before
    the fix it gained an entry each time a full chunk got a slot back (1 -> 769 entries over 8
    rounds of 4,096 puts)."""
    size, per_chunk, held = OBJ, 16, 128
    store = EmbeddedStore(held * size, chunk_bytes=per_chunk * size)
    other = 3 * OBJ  # a second size class: its chunks are given back and taken again
    peak = 0
    last: list[str] = []
    for rnd in range(8):
        for start in range(0, 1024, 64):
            odd = rnd % 3 == 2 and start % 256 == 0
            n, nbytes = (16, other) if odd else (64, size)
            last = keys_(n)
            assert await store.put(last, [obj(i, nbytes) for i in range(n)]) == [Outcome.OK] * n
            _check_free_lists(store)
            peak = max(peak, max(len(sc.partial) for sc in store._classes))
        await store.remove(last[:7])  # frees slots in full chunks, without eviction
        _check_free_lists(store)
    assert store.statistics().evictions > 6 * 1024  # it churned
    assert peak <= held // per_chunk + 1
    # positive control: what the churn left is readable, byte for byte
    outs = [torch.empty(OBJ, dtype=torch.uint8) for _ in range(64 - 7)]
    kept = last[7:]
    results = await store.get(kept, outs)
    assert all(r.outcome is Outcome.OK for r in results)
    assert all(torch.equal(o, obj(i + 7)) for i, o in enumerate(outs))
    await store.close()


async def test_evicted_objects_asked_for_again_are_counted_once_with_their_delay() -> None:
    now = [100.0]
    store = EmbeddedStore(2 * OBJ, chunk_bytes=OBJ, clock=lambda: now[0])
    a, b, c, d = (f"{k}:kv:0" for k in keys_(4))
    await put_each(store, [a, b, c, d])  # evicts a, then b, at t=100
    now[0] = 160.0
    assert await store.exists([a, c]) == [False, True]
    assert await store.exists([a]) == [False]  # asked again: counted once per eviction
    await store.touch([b])
    got = await store.get([d, a], [obj(0), obj(0)])
    assert [r.outcome for r in got] == [Outcome.OK, Outcome.MISSING]
    stats = store.statistics()
    assert (stats.evictions, stats.evicted_probed_again, stats.evicted_touched_again) == (2, 1, 1)
    kv = store.evictions_memory.pools["kv"]
    assert (kv.evicted, kv.asked, kv.touched, kv.soon, list(kv.delays)) == (2, 2, 1, 2, [60.0, 60.0])
    # a key put again is forgotten: evicting and asking for it again counts anew
    await put_each(store, [a])  # evicts c
    assert await store.exists([c, a]) == [False, True]
    assert store.statistics().evicted_probed_again == 2
    await store.close()
