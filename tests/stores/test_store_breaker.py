"""A store that stops answering opens the breaker, and then costs a lookup nothing (issue 42, item 4).

Before: a caller that gave up on a store call first (a lookup's ``lookup_timeout_s`` is shorter
than the wrapper's ``call_timeout_s``) cancelled the attempt, and a cancelled attempt was never
counted, so the breaker of a dead store never opened; vLLM's ``StoreHost`` had no breaker at all.
Asserted by counting calls and breaker state, never by timing.
"""

from __future__ import annotations

import time

import anyio
import pytest

from hylinker.integrations.config import PluginConfig
from hylinker.integrations.store_host import StoreHost
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.fault_plan import FaultPlan
from hylinker.stores.faulty import FaultyStore
from hylinker.stores.resilient import ResiliencePolicy, ResilientStore

#: a store that never answers: every call waits an hour first
DEAD = "latency_ms=3600000"
THRESHOLD = ResiliencePolicy().failure_threshold


def _wait_for(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


async def test_cancelled_attempts_open_the_breaker() -> None:
    dead = FaultyStore(EmbeddedStore(1 << 20), FaultPlan(latency_ms=3_600_000))
    store = ResilientStore(dead, ResiliencePolicy(call_timeout_s=60, deadline_s=60, failure_threshold=3,
                                                  probe_interval_s=3600))
    for _ in range(3):  # the caller's own deadline is shorter than the wrapper's call timeout
        with anyio.move_on_after(0.01):
            await store.exists(["k"])
    res = store.resilience()
    assert res.breaker == "open" and res.breaker_trips == 1
    assert res.cancelled == 3 and res.timeouts == 0
    calls = dead.statistics().calls
    assert await store.exists(["k"]) == [False]  # a miss from the breaker, the store not asked
    assert dead.statistics().calls == calls
    assert store.resilience().rejected_calls == 1
    await store.close()


async def test_shutdown_cancellations_do_not_count() -> None:
    dead = FaultyStore(EmbeddedStore(1 << 20), FaultPlan(latency_ms=3_600_000))
    store = ResilientStore(dead, ResiliencePolicy(close_grace_s=0.01, failure_threshold=1))
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.exists, ["k"])
        await anyio.sleep(0.01)
        await store.shutdown()
    res = store.resilience()
    assert res.cancelled_on_shutdown == 1 and res.cancelled == 0
    await store.close()


@pytest.fixture
def dead_host() -> object:
    host = StoreHost(PluginConfig(faults=DEAD))
    yield host
    host.close()


def test_store_host_breaker_opens_then_misses_at_once(dead_host: StoreHost) -> None:
    host = dead_host
    dead = host.store
    assert isinstance(dead, FaultyStore)
    for n in range(1, THRESHOLD + 1):
        assert host.exists(["a", "b"], 0.02) is None  # the deadline passed: a miss
        assert dead.statistics().calls == n
    for _ in range(50):  # the breaker is open (settled before each miss above returned)
        assert host.exists(["a", "b"], 0.02) is None
    reached = dead.statistics().calls - THRESHOLD
    assert reached < 50  # only the breaker's probes reached the store
    assert host.breaker.counts["breaker_trips"] == 1
    # each probe went out in the background, a miss at once; the rest were refused
    assert reached == host.breaker.counts["probes"]
    assert host.breaker.counts["rejected_calls"] == 50 - reached


def test_store_host_breaker_closes_when_the_store_answers() -> None:
    host = StoreHost(PluginConfig())
    try:
        assert host.exists(["a"], 1.0) == [False]
        host.breaker.failures = THRESHOLD - 1
        host.breaker.failure()  # as if the store had stopped answering
        assert host.breaker.state == "open" and host.exists(["a"], 1.0) is None
        host.breaker.opened_at -= host.breaker.interval  # the probe interval passed
        assert host.exists(["a"], 1.0) is None  # the probe: answered in the background
        _wait_for(lambda: host.breaker.state == "closed")
        assert host.breaker.counts["resumes"] == 1
        assert host.exists(["a"], 1.0) == [False]
    finally:
        host.close()
