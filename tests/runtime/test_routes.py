"""The data plane's transfer routes (issue 54): the one sub-batch pipeline every route runs
(``runtime/dataplane/pipeline.py``), the route a job takes, and what backpressure reads
(``DataPlane.backpressure()``)."""

from __future__ import annotations

import anyio
import attrs
import pytest
from test_data_plane import EnginePools, keys, pages, transfers

from hylinker.components.layout import PoolKind
from hylinker.runtime.dataplane.pipeline import pipelined
from hylinker.runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer
from hylinker.runtime.dataplane.rows_route import RowsRoute
from hylinker.runtime.dataplane.staged_route import StagedRoute
from hylinker.runtime.dataplane.statistics import Backpressure
from hylinker.runtime.dataplane.transfer_jobs import TransferJob
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.stores.resilient import ResiliencePolicy, ResilientStore
from hylinker.testing.fakes import GatedStore


async def run(n: int, calls_in_flight: int, fail_at: int | None = None) -> tuple[dict[tuple[str, int], tuple[int, int]], int]:
    """Run the pipeline over ``n`` sub-batches whose steps yield; return each step's
    (start, end) tick and the most ``then`` steps that ran at once."""
    tick = 0
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    now = {"then": 0}
    most = 0

    async def step(what: str, k: int, pause: int) -> None:
        nonlocal tick, most
        tick += 1
        start = tick
        if what == "then":
            now["then"] += 1
            most = max(most, now["then"])
        try:
            for _ in range(pause):
                await anyio.sleep(0)
            if k == fail_at and what == "then":
                raise RuntimeError(f"sub-batch {k} failed")
        finally:
            if what == "then":
                now["then"] -= 1
            tick += 1
            spans[(what, k)] = (start, tick)

    async def first(k: int) -> int:
        await step("first", k, 1)
        return 10 * k

    async def then(k: int, got: int) -> None:
        assert got == 10 * k  # what first(k) returned, for the same k
        await step("then", k, 3 + (k % 3))

    await pipelined(n, first, then, calls_in_flight=calls_in_flight)
    return spans, most


@pytest.mark.parametrize("n", [0, 1, 2, 7])
@pytest.mark.parametrize("calls_in_flight", [1, 2])
async def test_the_pipeline_overlaps_k_with_k_minus_1_and_never_reuses_a_busy_half(n: int, calls_in_flight: int) -> None:
    spans, most = await run(n, calls_in_flight)
    assert sorted(spans) == sorted([(w, k) for w in ("first", "then") for k in range(n)])
    for k in range(n):
        assert spans[("then", k)][0] > spans[("first", k)][1]  # then(k) after first(k)
        if k >= 1:
            assert spans[("first", k)][0] > spans[("first", k - 1)][1]  # first in order
            if calls_in_flight == 1:
                assert spans[("then", k)][0] > spans[("then", k - 1)][1]  # one call at a time
        if k >= 2:  # the half (or header slot) of k - 2 is free before k reuses it
            assert spans[("first", k)][0] > spans[("then", k - 2)][1]
    assert most <= calls_in_flight
    if n >= 2:
        assert most == calls_in_flight  # and the overlap happens
        assert spans[("first", 1)][0] < spans[("then", 0)][1]  # first(1) overlaps then(0)


@pytest.mark.parametrize("calls_in_flight", [1, 2])
async def test_a_failing_sub_batch_ends_the_pipeline_with_its_error_not_a_hang(calls_in_flight: int) -> None:
    with anyio.fail_after(5), pytest.raises(BaseException) as info:
        await run(6, calls_in_flight, fail_at=3)
    errors = list(getattr(info.value, "exceptions", (info.value,)))  # one, or a task group's
    assert any("sub-batch 3 failed" in str(e) for e in errors)


async def test_each_job_takes_the_route_its_pool_and_store_call_for() -> None:
    """Host pools over a store that moves rows: row-described in place; staged with in place
    off or over a store that cannot scatter; a verify-all load takes the held route."""
    store = EmbeddedStore(16 << 20)
    a = EnginePools(1)
    job = TransferJob(keys("r", 2), pages(0, 1))
    for config, route in ((DataPlaneConfig(in_place_min_bytes=0), RowsRoute),
                          (DataPlaneConfig(in_place=False), StagedRoute)):
        dp = DataPlane(a.views(), store, config, namespace="t")
        actor = dp.actors[PoolKind.FULL]
        assert isinstance(actor.offload_route(job), route) and isinstance(actor.load_route(job), route)
        held = attrs.evolve(job, hold=True)
        assert actor.load_route(held) is actor.held
    parts = DataPlane(a.views(), GatedStore(store), DataPlaneConfig(in_place_min_bytes=0), namespace="t")
    assert isinstance(parts.actors[PoolKind.FULL].offload_route(job), StagedRoute)  # no scatter calls
    await store.close()


async def test_backpressure_reads_pending_states_latency_and_the_breaker() -> None:
    store = EmbeddedStore(16 << 20)
    gated = GatedStore(store, hold_puts=True)
    async with DataPlane(EnginePools(1).views(), gated, DataPlaneConfig(latency_high_ms=100, latency_low_ms=10),
                         namespace="t") as dp:
        assert dp.backpressure() == Backpressure(pending_states=0, latency_ema_ms=0.0, dropping=False,
                                                 breaker_open=False)
        done = await dp.offload(transfers("p", pages(0), 3))
        assert dp.backpressure().pending_states == 1  # the state's offload is queued or in flight
        gated.open()
        assert (await done.wait()).ok
        assert dp.backpressure().pending_states == 0
        for _ in range(20):
            dp.latency.observe(1.0)  # 1 s per call: far past the high watermark
        pressure = dp.backpressure()
        assert pressure.dropping and pressure.latency_ema_ms > 100
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            pressure.dropping = False  # type: ignore[misc]
    policy = ResiliencePolicy(attempts=1, failure_threshold=1, backoff_s=0.0, backoff_max_s=0.0)
    down = ResilientStore(FaultyStore(store, FaultPlan(fail_calls=((1, 9),), scheduled="unavailable")), policy,
                          owns_inner=False)
    async with DataPlane(EnginePools(1).views(), down, namespace="t") as dp:
        assert not dp.backpressure().breaker_open
        out = await (await dp.offload([Transfer(PoolKind.FULL, keys("b", 1), pages(0))])).wait()
        assert not out.ok and out.objects[PoolKind.FULL] == [False]
        assert dp.backpressure().breaker_open
    await store.close()
