"""The vLLM connector's saves through the host staging budget (issue 52, item 3;
``docs/design/host-staging.md``): a save waits in host staging for the store, is skipped only when
the budget is full (counted and traced with reason ``host_staging_full``), gives its bytes back
when the store answered, and restores exactly. A store whose puts are held at a gate stands for
one that lags behind the engine. A load of an object whose save by this rank is still in flight
copies it from that save's staging slot (never waits for the store); a slot a load reads is not
reused until the read ended; a save that was skipped or failed makes the next lookup a miss."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from hylinker.integrations import store_host
from hylinker.integrations.config import PluginConfigError
from hylinker.integrations.vllm.config import VllmConnectorConfig
from hylinker.integrations.vllm.index import RankReport, StoreIndex
from hylinker.integrations.vllm.metrics import WORKER_FIGURES
from hylinker.integrations.vllm.pages import (
    PageTransfers,
    RawPages,
    derived_staging_bytes,
    step_staging_bytes,
)
from hylinker.integrations.vllm.plan import TransferPlan
from hylinker.runtime.dataplane.host_staging import physical_memory_bytes
from hylinker.runtime.dataplane.tracing import disable_trace_logging, enable_trace_logging
from hylinker.testing.fakes import GatedStore

W = "kv_connector_extra_config"
BLOCKS = 16
PAGE = 2 * 4 * 8 * 2  # one attention block of one layer: k, v x 4 tokens x 8 dims x bf16


def _pages() -> RawPages:
    raw = torch.randint(-100, 100, (BLOCKS * PAGE,), dtype=torch.int8)
    return RawPages({"model.layers.0.attn": raw.view(torch.bfloat16).view(BLOCKS, 2, 4, 8)}, BLOCKS)


@pytest.fixture
def gated() -> Iterator[tuple[store_host.StoreHost, GatedStore]]:
    host = store_host.acquire(VllmConnectorConfig.from_extra_config({"capacity_mb": 8}, where=W))
    gate = GatedStore(host.store, hold_puts=True)
    try:
        yield cast(store_host.StoreHost, SimpleNamespace(store=gate, portal=host.portal)), gate
    finally:
        host.portal.call(gate.open)
        store_host.release(host)


def _poll_loads(pt: PageTransfers, timeout_s: float = 30.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout_s
    ok: set[str] = set()
    bad: set[str] = set()
    while not (ok or bad) and time.monotonic() < deadline:
        ok, bad = pt.finished_loads()
        time.sleep(0.002)
    return ok, bad


def test_host_staging_bytes_is_checked_naming_the_key() -> None:
    assert VllmConnectorConfig.from_extra_config({}, where=W).host_staging_bytes is None
    assert VllmConnectorConfig.from_extra_config({"host_staging_bytes": None}, where=W).host_staging_bytes is None
    assert VllmConnectorConfig.from_extra_config({"host_staging_bytes": 1 << 20}, where=W).host_staging_bytes == 1 << 20
    too_big = physical_memory_bytes() + 1
    for bad in (0, -5, float("nan"), 1.5, True, "1GB", too_big):
        with pytest.raises(PluginConfigError, match=r"host_staging_bytes"):
            VllmConnectorConfig.from_extra_config({"host_staging_bytes": bad}, where=W)


def test_the_derived_budget_is_twice_the_pages_and_at_least_one_step() -> None:
    pages = _pages()
    per_object = sum(pages.page_bytes)
    assert derived_staging_bytes(pages, per_object, physical=1 << 40) == 2 * BLOCKS * per_object
    assert derived_staging_bytes(pages, 100 * BLOCKS * per_object, physical=1 << 40) == 100 * BLOCKS * per_object
    assert derived_staging_bytes(pages, per_object, physical=4 * per_object) == per_object  # a quarter of memory


def test_saves_beyond_the_old_slots_wait_in_staging_until_the_budget_is_full(
        gated: tuple[store_host.StoreHost, GatedStore]) -> None:
    host, gate = gated
    pages = _pages()
    per_object = sum(pages.page_bytes)
    # the staging of one step's saves (two blocks and the next one: three objects), as before the budget
    old_slots = step_staging_bytes(pages, floor_bytes=per_object, tokens_per_step=8, block_size=4,
                                   state_groups=0) // per_object
    budget = derived_staging_bytes(pages, old_slots * per_object, physical=1 << 40)
    assert budget // per_object == 2 * BLOCKS > old_slots
    before = pages.raws[0].clone()
    trace = io.StringIO()
    enable_trace_logging(trace)
    pt = PageTransfers(host, pages, fingerprint=b"f" * 32, with_state=False, staging_bytes=budget)
    try:
        # a store that does not answer yet: every save waits in host staging, none is skipped
        for i in range(BLOCKS):
            pt.save([TransferPlan(f"r{i}", (f"k{i}",), (i,))])
        assert pt.statistics().saves_skipped == 0 and pt.budget.used == BLOCKS * per_object > old_slots * per_object
        pt.save([TransferPlan("big", tuple(f"b{i}" for i in range(BLOCKS)), tuple(range(BLOCKS)))])
        assert pt.statistics().saves_skipped == 0 and pt.budget.used == budget  # exactly full
        pt.save([TransferPlan("over", ("o1",), (3,))])  # the budget is full: skipped, counted, traced
        stats = pt.statistics()
        assert stats.saves_skipped == 1 and stats.saves == BLOCKS + 1
        assert pt.budget.refused == 1 and pt.budget.peak == budget
        skipped = [json.loads(line) for line in trace.getvalue().splitlines() if "offload.skipped" in line]
        assert [(e["request_id"], e["reason"]) for e in skipped] == [("over", "host_staging_full")]
        _, dropped = pt.take_report()
        assert dropped == ["o1"]
        pages.raws[0].zero_()  # the engine reuses every block at once: staging kept the bytes
        host.portal.call(gate.open)  # the store catches up: staging drains and gives its bytes back
        assert pt.drain(30.0)
        stats = pt.statistics()
        assert (stats.saves_ok, stats.saves_failed, stats.objects_saved) == (BLOCKS + 1, 0, 2 * BLOCKS)
        assert pt.budget.used == 0 and len(pt._free) == 2 * BLOCKS  # no leaked budget bytes or slots
        pt.save([TransferPlan("after", ("a1",), (2,))])  # room again
        assert pt.drain(30.0) and pt.statistics().saves_skipped == 1 and pt.budget.used == 0
        # exact restores, from the single saves and from the big one, into other blocks
        pt.load(TransferPlan("l1", ("k3", "k7"), (0, 1)))
        assert _poll_loads(pt) == ({"l1"}, set())
        assert torch.equal(pages.raws[0][0], before[3]) and torch.equal(pages.raws[0][1], before[7])
        pt.load(TransferPlan("l2", tuple(f"b{i}" for i in range(BLOCKS)), tuple(reversed(range(BLOCKS)))))
        assert _poll_loads(pt) == ({"l2"}, set())
        assert torch.equal(pages.raws[0], before.flip(0))
    finally:
        disable_trace_logging()
        host.portal.call(gate.open)
        pt.close(10.0)


@contextlib.contextmanager
def _staging(gated: tuple[store_host.StoreHost, GatedStore], pages: RawPages, objects: int) -> Iterator[PageTransfers]:
    """A worker's transfers with ``objects`` staging slots; closed with the gate open."""
    host, gate = gated
    pt = PageTransfers(host, pages, fingerprint=b"f" * 32, with_state=False,
                       staging_bytes=objects * sum(pages.page_bytes))
    try:
        yield pt
    finally:
        host.portal.call(gate.open)
        pt.close(10.0)


def test_a_save_larger_than_the_budget_is_skipped_never_a_stall(
        gated: tuple[store_host.StoreHost, GatedStore]) -> None:
    pages = _pages()
    per_object = sum(pages.page_bytes)
    with _staging(gated, pages, 3) as pt:
        pt.save([TransferPlan("a", tuple(f"k{i}" for i in range(4)), (0, 1, 2, 3))])
        assert pt.statistics().saves_skipped == 1 and pt.budget.used == 0
        pt.save([TransferPlan("b", ("k0", "k1", "k2"), (0, 1, 2))])
        assert pt.statistics().saves_skipped == 1 and pt.budget.used == 3 * per_object
    assert pt.budget.used == 0


def test_skipped_saves_carry_the_host_staging_full_label() -> None:
    labels: dict[str, Any] = dict(WORKER_FIGURES)
    assert labels["saves_skipped"] == ("objects_skipped", "host_staging_full")


def _wait(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert cond(), "timed out"


def test_a_load_of_an_object_whose_save_is_in_flight_copies_it_from_the_slot(
        gated: tuple[store_host.StoreHost, GatedStore]) -> None:
    host, gate = gated
    pages = _pages()
    before = pages.raws[0].clone()
    with _staging(gated, pages, 8) as pt:
        host.portal.call(gate.open)  # one object reaches the store first
        pt.save([TransferPlan("s", ("stored",), (1,))])
        assert pt.drain(30.0)
        gate.hold(puts=True)  # the next save stays in flight until the gate opens
        pt.save([TransferPlan("r", ("k0", "k1"), (2, 3))])
        pages.raws[0][1:4].zero_()  # the engine reuses the blocks at once
        pt.load(TransferPlan("l", ("k1", "stored", "k0"), (5, 6, 7)))
        assert _poll_loads(pt, timeout_s=10.0) == ({"l"}, set())
        # landed while the put is still held: from the slot, not the store, and not waited for
        assert pt.saves_in_flight() == 1 and gate.completed["put"] == 1
        assert torch.equal(pages.raws[0][5], before[3]) and torch.equal(pages.raws[0][6], before[1])
        assert torch.equal(pages.raws[0][7], before[2])
        stats = pt.statistics()
        assert (stats.loads_ok, stats.objects_loaded, stats.objects_from_staging) == (1, 3, 2)
        read = [k for call in gate.keys["get"] for k in call]
        assert read and not any("k0" in k or "k1" in k for k in read)
        host.portal.call(gate.open)
        assert pt.drain(30.0)
        assert pt.budget.used == 0 and len(pt._free) == 8  # no slot or byte kept


def test_a_slot_is_not_reused_while_a_load_reads_it(gated: tuple[store_host.StoreHost, GatedStore]) -> None:
    host, gate = gated
    pages = _pages()
    before = pages.raws[0].clone()
    reading = threading.Event()
    go_on = threading.Event()
    with _staging(gated, pages, 1) as pt:
        copy_in = pt._copy_in

        def slow_copy_in(plan: TransferPlan, slots: dict[str, int]) -> None:
            reading.set()
            assert go_on.wait(30.0)
            copy_in(plan, slots)

        pt._copy_in = slow_copy_in  # type: ignore[method-assign]
        try:
            pt.save([TransferPlan("r", ("k0",), (2,))])  # the one slot
            pt.load(TransferPlan("l", ("k0",), (9,)))
            assert reading.wait(10.0)
            host.portal.call(gate.open)  # the save ends while the load still reads its slot
            _wait(lambda: pt.saves_in_flight() == 0)
            assert pt.statistics().saves_ok == 1
            assert pt._free == [] and pt.budget.used == pt.per_object  # held by the reader
            pt.save([TransferPlan("r2", ("k9",), (4,))])  # no slot: skipped, never written over the read
            assert pt.statistics().saves_skipped == 1
        finally:
            go_on.set()
        assert _poll_loads(pt) == ({"l"}, set())
        assert torch.equal(pages.raws[0][9], before[2])
        _wait(lambda: pt._free == [0])
        assert pt.budget.used == 0
        pt.save([TransferPlan("r3", ("k3",), (3,))])  # the slot is free again
        assert pt.drain(30.0) and pt.statistics().saves_ok == 2


def test_a_load_reads_the_slot_even_when_the_save_then_fails(
        gated: tuple[store_host.StoreHost, GatedStore]) -> None:
    pages = _pages()
    with _staging(gated, pages, 4) as pt:
        gated[1].fail_puts = True
        saved = pages.raws[0][2].clone()
        pt.save([TransferPlan("r", ("k0",), (2,))])
        pt.load(TransferPlan("l", ("k0",), (8,)))
        assert _poll_loads(pt) == ({"l"}, set())
        assert torch.equal(pages.raws[0][8], saved)
        gated[0].portal.call(gated[1].open)
        assert pt.drain(30.0)
        assert pt.statistics().saves_failed == 1
        _, dropped = pt.take_report()
        assert dropped == ["k0"]  # the scheduler is told: its next lookup misses


@pytest.mark.parametrize("how", ["skipped", "failed"])
def test_a_save_that_did_not_land_makes_the_next_lookup_a_miss(
        gated: tuple[store_host.StoreHost, GatedStore], how: str) -> None:
    host, gate = gated
    index = StoreIndex(1)
    with _staging(gated, _pages(), 1) as pt:
        if how == "skipped":
            pt.save([TransferPlan("full", ("other",), (0,))])  # the one slot, in flight
        else:
            gate.fail_puts = True
            host.portal.call(gate.open)
        index.planned(["o1"])  # the scheduler planned the save this step: counted present
        assert index.exists(["o1"], 1.0) == [True]
        pt.save([TransferPlan("r", ("o1",), (3,))])
        if how == "failed":
            assert pt.drain(30.0)
        stored, dropped = pt.take_report()  # the worker's report, with this step's output
        assert "o1" in dropped and "o1" not in stored
        index.apply(RankReport(0, "w", tuple(stored), tuple(dropped)))
        assert index.exists(["o1"], 1.0) == [False]  # a miss, never a hit whose load would fail
