"""One conformance suite, run unchanged against every store backend.

Backends: ``embedded``; ``umbp`` (the adapter over :class:`UMBPClientDouble`, or over the real
mori client under ``just test-umbp``); ``faulty``
(:class:`FaultyStore` at rate 0 over an embedded store); ``resilient`` (:class:`ResilientStore`,
retries and breaker, over a fault-free faulty store over an embedded store); ``mooncake`` (the ``mooncake_store``
fixture from ``conftest.py``: an opened Mooncake store on a loopback master, or a skip).

Tests that need a configurable capacity create their own store through ``CAPACITY_STORES``
and skip the backends whose capacity a test cannot set.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator, Callable

import anyio
import pytest
import torch

from hylinker.stores.base import (
    GetResult,
    Outcome,
    Store,
    StoreCapabilities,
    StoreClosedError,
    check_buffers,
)
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.stores.framing import FrameError, framed_size, payload_view, seal, verify
from hylinker.stores.resilient import ResilientStore
from hylinker.stores.umbp import UmbpStore
from hylinker.testing.umbp_double import umbp_test_client

LAYOUT = hashlib.sha256(b"store-conformance-layout").digest()
STORE_NAMES = ["embedded", "umbp", "faulty", "resilient", pytest.param("mooncake", marks=pytest.mark.mooncake)]
OBJECT = 4096  # framed object bytes in capacity tests (64-byte multiple)


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture
async def embedded_store() -> AsyncIterator[Store]:
    store = EmbeddedStore(64 << 20)
    yield store
    await store.close()


@pytest.fixture
async def umbp_store() -> AsyncIterator[Store]:
    store = UmbpStore(client=umbp_test_client(64 << 20), capacity_bytes=64 << 20)
    yield store
    await store.close()


@pytest.fixture
async def faulty_store() -> AsyncIterator[Store]:
    store = FaultyStore(EmbeddedStore(64 << 20), FaultPlan(), seed=1)
    yield store
    await store.close()


@pytest.fixture
async def resilient_store() -> AsyncIterator[Store]:
    store = ResilientStore(FaultyStore(EmbeddedStore(64 << 20), FaultPlan(), seed=1))
    yield store
    await store.close()


@pytest.fixture(params=STORE_NAMES)
def store_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(request: pytest.FixtureRequest, store_name: str) -> Store:
    """An opened store of the parametrized backend; its own fixture closes it."""
    value = request.getfixturevalue(f"{store_name}_store")
    assert isinstance(value, Store)
    return value


def _embedded_with_capacity(capacity: int) -> Store:
    return EmbeddedStore(capacity, chunk_bytes=2 * OBJECT)


def _faulty_with_capacity(capacity: int) -> Store:
    return FaultyStore(EmbeddedStore(capacity, chunk_bytes=2 * OBJECT), FaultPlan(), seed=2)


# Backends whose capacity a test can set and that evict just enough to fit. umbp: its tier is
# counted in 64 KiB pages and evicts down to 70 % in one go (tests/stores/test_umbp_store.py and
# tests/stores/test_umbp_client.py pin that), mooncake: the master's segment is the fixture's.
CAPACITY_STORES: dict[str, Callable[[int], Store]] = {
    "embedded": _embedded_with_capacity,
    "faulty": _faulty_with_capacity,
    "resilient": lambda capacity: ResilientStore(_faulty_with_capacity(capacity)),
}


def capacity_store(store_name: str, capacity: int) -> Store:
    """A store of ``capacity`` bytes of the given backend, or a skip."""
    factory = CAPACITY_STORES.get(store_name)
    if factory is None:
        pytest.skip(f"{store_name}: capacity is not configurable from a test")
    return factory(capacity)


# ---- helpers -----------------------------------------------------------------------------------


def new_keys(n: int) -> list[str]:
    prefix = uuid.uuid4().hex
    return [f"conf-{prefix}-{i}" for i in range(n)]


def framed(key: str, payload_bytes: int, salt: int = 0) -> torch.Tensor:
    """A sealed object whose payload is a function of (key, salt)."""
    frame = torch.empty(framed_size(payload_bytes), dtype=torch.uint8)
    seed = int.from_bytes(hashlib.blake2b(f"{key}/{salt}".encode(), digest_size=8).digest(), "little")
    gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    payload_view(frame).copy_(
        torch.randint(0, 256, (payload_bytes,), dtype=torch.uint8, generator=gen)
    )
    seal(frame, key, LAYOUT)
    return frame


def empty_like(frame: torch.Tensor, extra: int = 0) -> torch.Tensor:
    return torch.zeros(frame.numel() + extra, dtype=torch.uint8)


async def read_back(store: Store, keys: list[str], sizes: list[int]) -> tuple[list[GetResult], list[torch.Tensor]]:
    buffers = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    return await store.get(keys, buffers), buffers


async def fill(store: Store, keys: list[str], payload_bytes: int = OBJECT - 64) -> list[torch.Tensor]:
    frames = [framed(k, payload_bytes) for k in keys]
    for key, frame in zip(keys, frames, strict=True):
        assert await store.put([key], [frame]) == [Outcome.OK]
    return frames


# ---- protocol basics ---------------------------------------------------------------------------


async def test_implements_the_protocol(store: Store) -> None:
    assert isinstance(store, Store)
    caps = store.capabilities
    assert isinstance(caps, StoreCapabilities)
    assert caps.name and caps.max_batch > 0
    assert isinstance(store.statistics().puts, int)


async def test_round_trip_of_framed_objects(store: Store) -> None:
    keys = new_keys(5)
    payloads = [0, 64, 4032, 65472, 262080]
    frames = [framed(k, n) for k, n in zip(keys, payloads, strict=True)]
    assert await store.put(keys, frames) == [Outcome.OK] * len(keys)
    assert await store.exists(keys) == [True] * len(keys)
    results, buffers = await read_back(store, keys, [f.numel() for f in frames])
    for key, frame, result, buf in zip(keys, frames, results, buffers, strict=True):
        assert result == GetResult(Outcome.OK, frame.numel())
        payload = verify(buf, result.nbytes, key, LAYOUT)
        assert torch.equal(payload, payload_view(frame))


async def test_get_into_a_larger_buffer_reports_the_object_size(store: Store) -> None:
    (key,) = new_keys(1)
    frame = framed(key, 1000 * 64)
    assert await store.put([key], [frame]) == [Outcome.OK]
    buf = empty_like(frame, extra=4096)
    [result] = await store.get([key], [buf])
    assert result == GetResult(Outcome.OK, frame.numel())
    assert torch.equal(verify(buf, result.nbytes, key, LAYOUT), payload_view(frame))


async def test_put_does_not_keep_a_reference_to_the_buffer(store: Store) -> None:
    (key,) = new_keys(1)
    frame = framed(key, 4032)
    original = frame.clone()
    assert await store.put([key], [frame]) == [Outcome.OK]
    frame.zero_()  # the caller reuses its staging buffer
    [result], [buf] = await read_back(store, [key], [original.numel()])
    assert result.outcome is Outcome.OK
    assert torch.equal(buf, original)


async def test_first_writer_wins(store: Store) -> None:
    (key,) = new_keys(1)
    first, second = framed(key, 4032, salt=1), framed(key, 4032, salt=2)
    assert not torch.equal(first, second)
    assert await store.put([key], [first]) == [Outcome.OK]
    assert await store.put([key], [second]) == [Outcome.EXISTS]
    [result], [buf] = await read_back(store, [key], [first.numel()])
    assert result == GetResult(Outcome.OK, first.numel())
    assert torch.equal(buf, first)


async def test_first_writer_wins_inside_one_batch(store: Store) -> None:
    (key,) = new_keys(1)
    first, second = framed(key, 4032, salt=1), framed(key, 4032, salt=2)
    assert await store.put([key, key], [first, second]) == [Outcome.OK, Outcome.EXISTS]
    [result], [buf] = await read_back(store, [key], [first.numel()])
    assert result.outcome is Outcome.OK
    assert torch.equal(buf, first)


async def test_missing_keys(store: Store) -> None:
    keys = new_keys(3)
    assert await store.exists(keys) == [False, False, False]
    results, _ = await read_back(store, keys, [4096, 64, 1])
    assert [r.outcome for r in results] == [Outcome.MISSING] * 3
    assert all(r.nbytes == 0 for r in results)


async def test_batch_partial_results(store: Store) -> None:
    keys = new_keys(6)
    present = keys[::2]
    frames = {k: framed(k, 4032) for k in present}
    assert await store.put(present, [frames[k] for k in present]) == [Outcome.OK] * 3
    assert await store.exists(keys) == [True, False] * 3
    results, buffers = await read_back(store, keys, [4096] * 6)
    for key, result, buf in zip(keys, results, buffers, strict=True):
        if key in frames:
            assert result == GetResult(Outcome.OK, 4096)
            verify(buf, result.nbytes, key, LAYOUT)
        else:
            assert result.outcome is Outcome.MISSING


async def test_mixed_put_batch_reports_each_key(store: Store) -> None:
    keys = new_keys(4)
    assert await store.put(keys[:2], [framed(k, 4032) for k in keys[:2]]) == [Outcome.OK] * 2
    outcomes = await store.put(keys, [framed(k, 4032) for k in keys])
    assert outcomes == [Outcome.EXISTS, Outcome.EXISTS, Outcome.OK, Outcome.OK]
    assert await store.exists(keys) == [True] * 4


async def test_buffer_too_small(store: Store) -> None:
    (key,) = new_keys(1)
    frame = framed(key, 8128)
    assert await store.put([key], [frame]) == [Outcome.OK]
    [result] = await store.get([key], [empty_like(frame)[: frame.numel() - 64]])
    assert result.outcome is Outcome.TOO_SMALL
    # The object is still there and whole.
    [result], [buf] = await read_back(store, [key], [frame.numel()])
    assert result == GetResult(Outcome.OK, frame.numel())
    assert torch.equal(buf, frame)


async def test_empty_batches(store: Store) -> None:
    assert await store.exists([]) == []
    assert await store.put([], []) == []
    assert await store.get([], []) == []
    await store.touch([])


async def test_touch_of_missing_keys_is_harmless(store: Store) -> None:
    keys = new_keys(2)
    await store.touch(keys)
    assert await store.exists(keys) == [False, False]


async def test_buffers_inside_a_registered_region(store: Store) -> None:
    region = torch.zeros(1 << 20, dtype=torch.uint8)
    store.register(region)
    keys = new_keys(4)
    size = framed_size(4032)
    sources = [region[i * size : (i + 1) * size] for i in range(4)]
    for key, view in zip(keys, sources, strict=True):
        view.copy_(framed(key, 4032))
    assert await store.put(keys, sources) == [Outcome.OK] * 4
    targets = [region[(8 + i) * size : (9 + i) * size] for i in range(4)]
    results = await store.get(keys, targets)
    for key, result, target in zip(keys, results, targets, strict=True):
        assert result == GetResult(Outcome.OK, size)
        verify(target, size, key, LAYOUT)


# ---- bad input ---------------------------------------------------------------------------------

BAD_BATCHES: list[tuple[str, Callable[[list[str]], tuple[list[str], list[torch.Tensor]]]]] = [
    ("more keys than buffers", lambda k: (k, [torch.zeros(64, dtype=torch.uint8)])),
    ("wrong dtype", lambda k: (k[:1], [torch.zeros(16, dtype=torch.float32)])),
    ("two-dimensional", lambda k: (k[:1], [torch.zeros(2, 64, dtype=torch.uint8)])),
    ("not contiguous", lambda k: (k[:1], [torch.zeros(128, dtype=torch.uint8)[::2]])),
    ("not a tensor", lambda k: (k[:1], [bytearray(64)])),  # type: ignore[list-item]
    ("empty key", lambda k: ([""], [torch.zeros(64, dtype=torch.uint8)])),
    ("key not a string", lambda k: ([7], [torch.zeros(64, dtype=torch.uint8)])),  # type: ignore[list-item]
]


@pytest.mark.parametrize("case", [c[0] for c in BAD_BATCHES])
async def test_bad_buffers_raise_clear_errors(store: Store, case: str) -> None:
    make = dict(BAD_BATCHES)[case]
    keys, buffers = make(new_keys(2))
    with pytest.raises((TypeError, ValueError)) as expected:
        check_buffers(keys, buffers)
    with pytest.raises(type(expected.value)):
        await store.put(keys, buffers)
    with pytest.raises(type(expected.value)):
        await store.get(keys, buffers)


# ---- capacity, eviction, touch, remove ------------------------------------------------------


async def test_lru_eviction_makes_room(store_name: str) -> None:
    store = capacity_store(store_name, 4 * OBJECT)
    try:
        keys = new_keys(6)
        frames = await fill(store, keys)
        assert await store.exists(keys) == [False, False, True, True, True, True]
        assert store.statistics().evictions >= 2
        results, buffers = await read_back(store, keys[2:], [OBJECT] * 4)
        for frame, result, buf in zip(frames[2:], results, buffers, strict=True):
            assert result.outcome is Outcome.OK
            assert torch.equal(buf, frame)
    finally:
        await store.close()


async def test_object_larger_than_capacity_is_full(store_name: str) -> None:
    store = capacity_store(store_name, 4 * OBJECT)
    try:
        keys = new_keys(2)
        await fill(store, keys[:1])
        too_big = framed(keys[1], 5 * OBJECT)
        assert await store.put([keys[1]], [too_big]) == [Outcome.FULL]
        assert await store.exists(keys) == [True, False]  # nothing evicted for a hopeless put
    finally:
        await store.close()


async def test_get_keeps_an_object_alive(store_name: str) -> None:
    store = capacity_store(store_name, 4 * OBJECT)
    try:
        keys = new_keys(5)
        await fill(store, keys[:4])
        [result], _ = await read_back(store, keys[:1], [OBJECT])
        assert result.outcome is Outcome.OK
        await fill(store, keys[4:])
        assert await store.exists(keys) == [True, False, True, True, True]
    finally:
        await store.close()


async def test_touch_keeps_an_object_alive(store_name: str) -> None:
    store = capacity_store(store_name, 4 * OBJECT)
    try:
        if not store.capabilities.touch:
            pytest.skip(f"{store_name} cannot touch")
        keys = new_keys(6)
        await fill(store, keys[:4])
        await store.touch(keys[:2])
        await fill(store, keys[4:])
        assert await store.exists(keys) == [True, True, False, False, True, True]
    finally:
        await store.close()


async def test_remove(store: Store) -> None:
    if not store.capabilities.remove:
        pytest.skip(f"{store.capabilities.name} has no per-key delete")
    keys = new_keys(3)
    await store.put(keys[:2], [framed(k, 4032) for k in keys[:2]])
    assert await store.remove([keys[0], keys[2]]) == 1
    assert await store.exists(keys) == [False, True, False]
    [result], _ = await read_back(store, keys[:1], [4096])
    assert result.outcome is Outcome.MISSING
    assert await store.remove([keys[0]]) == 0
    # A removed key can be stored again.
    fresh = framed(keys[0], 4032, salt=9)
    assert await store.put([keys[0]], [fresh]) == [Outcome.OK]
    [result], [buf] = await read_back(store, keys[:1], [4096])
    assert result.outcome is Outcome.OK and torch.equal(buf, fresh)


# ---- close -------------------------------------------------------------------------------------


async def test_use_after_close_raises_and_double_close_is_fine(store: Store) -> None:
    keys = new_keys(1)
    buf = framed(keys[0], 64)
    await store.close()
    await store.close()
    with pytest.raises(StoreClosedError):
        await store.exists(keys)
    with pytest.raises(StoreClosedError):
        await store.put(keys, [buf])
    with pytest.raises(StoreClosedError):
        await store.get(keys, [buf])
    with pytest.raises(StoreClosedError):
        await store.touch(keys)
    with pytest.raises(StoreClosedError):
        await store.remove(keys)


async def test_close_waits_for_calls_in_flight(store: Store) -> None:
    keys = new_keys(16)
    frames = [framed(k, (256 << 10) - 64) for k in keys]  # 4 MiB in one batch
    outcomes: list[Outcome] = []

    async def put_all() -> None:
        outcomes.extend(await store.put(keys, frames))

    async with anyio.create_task_group() as tg:
        tg.start_soon(put_all)
        await anyio.sleep(0)
        await store.close()
        # close returned: the put it waited for has its answer (or never started)
        assert outcomes in ([Outcome.OK] * len(keys), [])
    assert outcomes == [Outcome.OK] * len(keys) or outcomes == []


async def test_statistics_are_a_snapshot(store: Store) -> None:
    before = store.statistics()
    keys = new_keys(2)
    await store.put(keys, [framed(k, 4032) for k in keys])
    with pytest.raises(AttributeError):
        before.puts = 99  # type: ignore[misc]
    after = store.statistics()
    assert after is not before
    assert after.puts >= before.puts


def test_frame_helper_is_verifiable() -> None:
    (key,) = new_keys(1)
    frame = framed(key, 128)
    verify(frame, frame.numel(), key, LAYOUT)
    with pytest.raises(FrameError):
        verify(frame, frame.numel(), key + "x", LAYOUT)
