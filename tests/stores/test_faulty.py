"""FaultyStore: plans, determinism, and every fault kind caught (never a wrong payload)."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import torch

from hylinker.stores.base import GetResult, Outcome, StoreUnavailableError
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultStatistics, FaultyStore
from hylinker.stores.framing import FrameError, FrameFault, framed_size, payload_view, seal, verify
from hylinker.stores.umbp import UmbpStore
from hylinker.testing.umbp_double import UMBPClientDouble

LAYOUT = hashlib.sha256(b"faulty-layout").digest()
PAYLOAD = 1024 - 64


def keys_(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"fault-{prefix}-{i}" for i in range(n)]


def framed(key: str, payload_bytes: int = PAYLOAD) -> torch.Tensor:
    frame = torch.empty(framed_size(payload_bytes), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(int(hashlib.sha256(key.encode()).hexdigest()[:8], 16))
    payload_view(frame).copy_(torch.randint(0, 256, (payload_bytes,), dtype=torch.uint8, generator=gen))
    seal(frame, key, LAYOUT)
    return frame


def faulty(plan: FaultPlan | str, seed: int = 0) -> FaultyStore:
    if isinstance(plan, str):
        plan = FaultPlan.parse(plan)
    return FaultyStore(EmbeddedStore(64 << 20), plan, seed=seed)


# ---- plans -------------------------------------------------------------------------------------


def test_parse_reads_every_field() -> None:
    plan = FaultPlan.parse(
        "fail=0.05, latency_ms=2,torn=0.01,corrupt=0.01,vanish=0.02,unavailable=0.1,"
        "timeout=0.2,jitter_ms=1.5,deadline_ms=30,fail_calls=3-5+9,fail_every=7,"
        "scheduled=unavailable"
    )
    assert plan == FaultPlan(
        fail=0.05, latency_ms=2, torn=0.01, corrupt=0.01, vanish=0.02, unavailable=0.1,
        timeout=0.2, jitter_ms=1.5, deadline_ms=30, fail_calls=((3, 5), (9, 9)), fail_every=7,
        scheduled="unavailable",
    )
    assert FaultPlan.parse(plan.describe()) == plan
    assert FaultPlan.parse("") == FaultPlan() and FaultPlan().is_empty


def test_uniform_spreads_one_rate_over_every_kind() -> None:
    plan = FaultPlan.uniform(0.03)
    for name in FaultPlan.RATE_FIELDS:
        assert getattr(plan, name) == 0.03
    assert plan.latency_ms == 0 and plan.fail_calls == ()
    assert FaultPlan.parse("uniform=0.03,torn=0.5") == FaultPlan.uniform(0.03, torn=0.5)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("fial=0.1", "unknown fault plan field 'fial' \\(did you mean 'fail'\\?\\)"),
        ("fail", "not name=value"),
        ("fail=lots", "not a number"),
        ("fail=1.5", r"\[0, 1\]"),
        ("latency_ms=-1", ">= 0"),
        ("fail_calls=5-3", "first <= last"),
        ("fail_calls=a-b", "ranges joined by"),
        ("fail_every=2.5", "not an integer"),
        ("scheduled=sometimes", "scheduled"),
    ],
)
def test_parse_rejects_bad_plans_clearly(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FaultPlan.parse(text)


def test_plans_are_frozen() -> None:
    with pytest.raises(AttributeError):
        FaultPlan().fail = 0.5  # type: ignore[misc]


# ---- transparency and determinism ------------------------------------------------------------


async def run_script(store: FaultyStore | EmbeddedStore, keys: list[str]) -> list[object]:
    """A fixed call sequence; returns everything observable."""
    seen: list[object] = []
    for start in range(0, len(keys), 4):
        batch = keys[start : start + 4]
        try:
            seen.append(await store.put(batch, [framed(k) for k in batch]))
        except StoreUnavailableError:
            seen.append("unavailable")
        try:
            seen.append(await store.exists(batch))
        except StoreUnavailableError:
            seen.append("unavailable")
        buffers = [torch.zeros(framed_size(PAYLOAD), dtype=torch.uint8) for _ in batch]
        try:
            results = await store.get(batch, buffers)
        except StoreUnavailableError:
            seen.append("unavailable")
            continue
        seen.append(results)
        seen.append([bytes(b.numpy()) for b in buffers])
    return seen


async def test_rate_zero_is_transparent() -> None:
    keys = keys_(24)
    plain = EmbeddedStore(64 << 20)
    wrapped = faulty(FaultPlan())
    assert await run_script(wrapped, keys) == await run_script(plain, keys)
    stats = wrapped.statistics()
    assert isinstance(stats, FaultStatistics)
    assert stats.puts == 24 and stats.gets == 24
    assert stats.calls == 18
    injected = ("failed_keys", "unavailable_calls", "scheduled_failures", "timeouts",
                "torn_writes", "corrupted_writes", "corrupted_reads", "vanished")
    assert all(getattr(stats, name) == 0 for name in injected)
    assert wrapped.capabilities.name == "faulty(embedded)"
    await wrapped.close()
    await plain.close()


async def test_same_seed_same_faults() -> None:
    keys = keys_(40)
    plan = FaultPlan.uniform(0.15)
    first, second, other = faulty(plan, seed=7), faulty(plan, seed=7), faulty(plan, seed=8)
    a = await run_script(first, keys)
    b = await run_script(second, keys)
    c = await run_script(other, keys)
    assert a == b
    assert first.statistics() == second.statistics()
    assert a != c  # another seed, other faults
    for store in (first, second, other):
        await store.close()


# ---- schedules -------------------------------------------------------------------------------


async def test_scheduled_call_ranges_fail() -> None:
    store = faulty("fail_calls=2-3+5")
    (key,) = keys_(1)
    outcomes = [await store.put([f"{key}-{n}"], [framed(f"{key}-{n}")]) for n in range(1, 7)]
    assert outcomes == [[Outcome.OK], [Outcome.FAILED], [Outcome.FAILED], [Outcome.OK],
                        [Outcome.FAILED], [Outcome.OK]]
    assert store.statistics().scheduled_failures == 3
    await store.close()


async def test_every_kth_call_raises_when_scheduled_unavailable() -> None:
    store = faulty("fail_every=3,scheduled=unavailable")
    (key,) = keys_(1)
    raised = []
    for n in range(1, 8):
        try:
            await store.exists([key])
        except StoreUnavailableError:
            raised.append(n)
    assert raised == [3, 6]
    assert store.statistics().unavailable_calls == 2
    await store.close()


async def test_scheduled_timeout_on_get_is_unreachable() -> None:
    store = faulty("fail_calls=2,scheduled=timeout,deadline_ms=1")
    (key,) = keys_(1)
    await store.put([key], [framed(key)])
    [result] = await store.get([key], [torch.empty(framed_size(PAYLOAD), dtype=torch.uint8)])
    assert result == GetResult(Outcome.UNREACHABLE)
    assert store.statistics().timeouts == 1
    await store.close()


# ---- each fault kind --------------------------------------------------------------------------


async def test_failed_keys() -> None:
    store = faulty("fail=1")
    keys = keys_(3)
    assert await store.put(keys, [framed(k) for k in keys]) == [Outcome.FAILED] * 3
    assert await store.inner.exists(keys) == [False] * 3  # never reached the inner store
    assert await store.exists(keys) == [False] * 3
    assert store.statistics().failed_keys == 6
    await store.close()


async def test_unavailable_calls_raise() -> None:
    store = faulty("unavailable=1")
    with pytest.raises(StoreUnavailableError, match="injected"):
        await store.put(keys_(1), [framed("x")])
    with pytest.raises(StoreUnavailableError):
        await store.remove(keys_(1))
    await store.close()


async def test_latency_is_added_and_counted() -> None:
    store = faulty("latency_ms=1,jitter_ms=1")
    keys = keys_(2)
    await store.put(keys, [framed(k) for k in keys])
    assert await store.exists(keys) == [True, True]
    assert store.statistics().delayed_calls == 2
    await store.close()


async def test_a_call_past_the_deadline_is_unreachable() -> None:
    store = faulty("latency_ms=50,deadline_ms=2")
    keys = keys_(2)
    assert await store.put(keys, [framed(k) for k in keys]) == [Outcome.UNREACHABLE] * 2
    results = await store.get(keys, [torch.empty(1024, dtype=torch.uint8)] * 2)
    assert [r.outcome for r in results] == [Outcome.UNREACHABLE] * 2
    assert await store.exists(keys) == [False, False]
    assert store.statistics().timeouts == 3
    await store.close()


async def test_an_injected_timeout_put_may_still_land() -> None:
    store = faulty("timeout=1,deadline_ms=1")
    (key,) = keys_(1)
    assert await store.put([key], [framed(key)]) == [Outcome.UNREACHABLE]
    assert await store.inner.exists([key]) == [True]
    await store.close()


async def get_and_verify(store: FaultyStore, keys: list[str]) -> list[FrameFault | None]:
    """Read each key and verify it: None for a good object, else the rejection."""
    buffers = [torch.zeros(framed_size(PAYLOAD) + 64, dtype=torch.uint8) for _ in keys]
    results = await store.get(keys, buffers)
    faults: list[FrameFault | None] = []
    for key, result, buf in zip(keys, results, buffers, strict=True):
        assert result.outcome is Outcome.OK
        try:
            payload = verify(buf, result.nbytes, key, LAYOUT)
        except FrameError as exc:
            faults.append(exc.fault)
        else:
            assert torch.equal(payload, payload_view(framed(key)))
            faults.append(None)
    return faults


async def test_torn_writes_are_rejected_by_framing() -> None:
    store = faulty("torn=1", seed=3)
    keys = keys_(40)
    assert await store.put(keys, [framed(k) for k in keys]) == [Outcome.OK] * 40
    faults = await get_and_verify(store, keys)
    assert set(faults) <= {FrameFault.TRUNCATED, FrameFault.BAD_LENGTH}
    assert None not in faults
    assert store.statistics().torn_writes == 40
    await store.close()


async def test_corrupted_writes_are_rejected_and_the_caller_buffer_is_restored() -> None:
    store = faulty("corrupt=1", seed=4)
    keys = keys_(60)
    frames = [framed(k) for k in keys]
    originals = [f.clone() for f in frames]
    assert await store.put(keys, frames) == [Outcome.OK] * 60
    assert all(torch.equal(a, b) for a, b in zip(frames, originals, strict=True))
    clean = FaultyStore(store.inner, FaultPlan())  # read around the read-side corruption
    faults = await get_and_verify(clean, keys)
    assert None not in faults
    assert FrameFault.BAD_CHECKSUM in faults and len(set(faults)) > 2  # header and payload hits
    assert store.statistics().corrupted_writes == 60
    await store.close()


async def test_corrupted_reads_are_rejected() -> None:
    store = faulty("corrupt=1", seed=5)
    keys = keys_(30)
    await store.inner.put(keys, [framed(k) for k in keys])
    faults = await get_and_verify(store, keys)
    assert None not in faults
    assert store.statistics().corrupted_reads == 30
    await store.close()


async def test_objects_vanish_between_exists_and_get() -> None:
    store = faulty("vanish=1")
    keys = keys_(3)
    await store.put(keys, [framed(k) for k in keys])
    assert await store.exists(keys) == [True] * 3
    results = await store.get(keys, [torch.empty(1024, dtype=torch.uint8)] * 3)
    assert [r.outcome for r in results] == [Outcome.MISSING] * 3
    assert await store.exists(keys) == [False] * 3
    assert store.statistics().vanished == 3
    # Putting it again brings it back.
    assert await store.put(keys[:1], [framed(keys[0])]) == [Outcome.OK]
    assert (await store.get(keys[:1], [torch.empty(1024, dtype=torch.uint8)]))[0].outcome is Outcome.OK
    await store.close()


async def test_vanish_masks_objects_on_stores_without_remove() -> None:
    store = FaultyStore(UmbpStore(client=UMBPClientDouble()), FaultPlan(vanish=1.0))
    (key,) = keys_(1)
    await store.put([key], [framed(key)])
    assert await store.exists([key]) == [True]
    [result] = await store.get([key], [torch.empty(1024, dtype=torch.uint8)])
    assert result.outcome is Outcome.MISSING
    await store.close()


async def test_under_every_fault_no_wrong_payload_is_ever_accepted() -> None:
    store = faulty(FaultPlan.uniform(0.2), seed=11)
    keys = keys_(200)
    rejected = accepted = 0
    for start in range(0, len(keys), 10):
        batch = keys[start : start + 10]
        try:
            await store.put(batch, [framed(k) for k in batch])
            await store.exists(batch)
            buffers = [torch.zeros(framed_size(PAYLOAD), dtype=torch.uint8) for _ in batch]
            results = await store.get(batch, buffers)
        except StoreUnavailableError:
            continue
        for key, result, buf in zip(batch, results, buffers, strict=True):
            if result.outcome is not Outcome.OK:
                continue
            try:
                payload = verify(buf, result.nbytes, key, LAYOUT)
            except FrameError:
                rejected += 1
                continue
            assert torch.equal(payload, payload_view(framed(key)))
            accepted += 1
    assert rejected > 0 and accepted > 0
    await store.close()
