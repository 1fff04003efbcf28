"""The vLLM connector's view of what every rank's store holds (``integrations/vllm/index.py``)
and the worker reports that feed it (``integrations/vllm/pages.py``: ``PageTransfers.take_report``): engine-free."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio.to_thread
import pytest
import torch

from hylinker.integrations import store_host
from hylinker.integrations.config import PluginConfigError
from hylinker.integrations.vllm.config import VllmConnectorConfig
from hylinker.integrations.vllm.index import (
    CopyRanks,
    KeyLayout,
    RankReport,
    StoreIndex,
    StoreProbe,
    kv_replicas,
    name_of,
    rank_key,
)
from hylinker.integrations.vllm.pages import PageTransfers, RawPages
from hylinker.integrations.vllm.plan import TransferPlan


def test_rank_keys_round_trip_and_carry_the_rank() -> None:
    assert rank_key("ab:kv:g3", 1) == "ab:kv:g3:r1" != rank_key("ab:kv:g3", 0)
    assert name_of(rank_key("ab:kv:g3", 12)) == "ab:kv:g3"
    assert name_of(rank_key("ab:state:g0", 0) + "|g1of2") == "ab:state:g0"  # a data-plane group key
    assert name_of("ab:kv:g3") == "ab:kv:g3"


def test_index_claims_an_object_only_when_every_rank_holds_it() -> None:
    index = StoreIndex(2)
    index.apply(RankReport(0, "w0", stored=("a", "b")))
    assert index.exists(["a", "b", "c"], 1.0) == [False, False, False]  # rank 1 has not said
    index.apply(RankReport(1, "w1", stored=("a",)))
    assert index.exists(["a", "b"], 1.0) == [True, False]
    index.apply(RankReport(1, "w1", dropped=("a",)))  # evicted or removed on rank 1
    assert index.exists(["a"], 1.0) == [False]
    with pytest.raises(ValueError, match="rank 2"):
        index.apply(RankReport(2, "w2", stored=("a",)))


def test_planned_saves_count_until_each_rank_reports_the_outcome() -> None:
    index = StoreIndex(2)
    index.planned(["k", "j"])
    assert index.exists(["k", "j"], 1.0) == [True, True]  # a load waits for the save in flight
    index.apply(RankReport(0, "w0", stored=("k",)))
    index.apply(RankReport(1, "w1", stored=("k",), dropped=("j",)))  # rank 1 could not write j
    assert index.exists(["k", "j"], 1.0) == [True, False]
    index.planned(["m"])
    index.apply(RankReport(0, "w0", dropped=("m",)))
    assert index.exists(["m"], 1.0) == [False]


def test_a_new_worker_incarnation_forgets_what_the_old_one_held() -> None:
    index = StoreIndex(1)
    index.apply(RankReport(0, "old", stored=("a",)))
    index.planned(["b"])
    assert index.exists(["a", "b"], 1.0) == [True, True]
    index.apply(RankReport(0, "new", stored=("c",)))  # the worker (and its store) was replaced
    assert index.exists(["a", "b", "c"], 1.0) == [False, False, True]
    assert index.counters["incarnations_replaced"] == 1 and index.held(0) == 1


def test_probe_asks_the_store_for_every_ranks_key() -> None:
    host = store_host.acquire(VllmConnectorConfig.from_extra_config({"capacity_mb": 4}))
    try:
        buf = [torch.zeros(64, dtype=torch.uint8)]
        host.portal.call(host.store.put, [rank_key("a", 0)], buf)
        host.portal.call(host.store.put, [rank_key("a", 1)], buf)
        host.portal.call(host.store.put, [rank_key("b", 0)], buf)
        assert StoreProbe(host, KeyLayout.per_rank(2)).exists(["a", "b", "c"], 1.0) == [True, False, False]
        assert StoreProbe(host, KeyLayout.per_rank(1)).exists(["a", "b"], 1.0) == [True, True]
    finally:
        store_host.release(host)


def test_fault_rank_keeps_the_fault_plan_on_one_rank_only() -> None:
    cfg = VllmConnectorConfig.from_extra_config({"faults": "corrupt=1", "fault_rank": 1})
    assert cfg.for_rank(1).faults == "corrupt=1" and cfg.for_rank(0).faults == ""
    assert VllmConnectorConfig.from_extra_config({"faults": "corrupt=1"}).for_rank(0).faults == "corrupt=1"
    assert cfg.for_scheduler().faults == ""  # one rank's store fails, the scheduler's probe does not
    assert VllmConnectorConfig.from_extra_config({"faults": "corrupt=1"}).for_scheduler().faults == "corrupt=1"
    with pytest.raises(PluginConfigError, match="fault_rank"):
        VllmConnectorConfig.from_extra_config({"fault_rank": -2})


def _pages(num_blocks: int) -> tuple[torch.Tensor, RawPages]:
    page = 128
    raw = torch.randint(-100, 100, (num_blocks * page,), dtype=torch.int8)
    return raw, RawPages({"l0": raw.view(num_blocks, 1, 1, page)}, num_blocks)


def _report(pt: PageTransfers) -> tuple[list[str], list[str]]:
    assert pt.drain(10.0)
    return pt.take_report()


def test_worker_reports_stored_skipped_evicted_and_removed_objects() -> None:
    # capacity for ~4 objects of 128 B (slots are rounded up): the fifth put evicts
    host = store_host.acquire(VllmConnectorConfig.from_extra_config({"capacity_mb": 1}))
    _raw, pages = _pages(16)
    pt = PageTransfers(host, pages, fingerprint=b"f" * 32, with_state=True, staging_bytes=8 * 128, rank=1)
    try:
        assert host.on_evict(pt.note_evicted)
        pt.save([TransferPlan("a", ("k1", "k2"), (1, 2), ("s2",), (3,))])
        stored, dropped = _report(pt)
        assert sorted(stored) == ["k1", "k2", "s2"] and dropped == []
        assert host.portal.call(host.store.exists, [rank_key("k1", 1), "k1"]) == [True, False]  # rank-keyed
        pt.save([TransferPlan("b", tuple(f"x{i}" for i in range(9)), tuple(range(1, 10)))])  # > 8 slots
        assert _report(pt) == ([], [f"x{i}" for i in range(9)])  # skipped: reported gone
        host.portal.call(host.store.remove, [rank_key("k2", 1)])  # lost behind the index's back
        pt.load(TransferPlan("c", ("k1", "k2"), (5, 6)))
        bad: set[str] = set()
        while not bad:
            _ok, bad = pt.finished_loads()
        assert bad == {"c"}
        assert pt.take_report() == ([], ["k2"])  # the object that did not land is reported gone
        evicted: list[str] = []
        host.on_evict(evicted.extend)  # replaces the transfers' listener
        big = torch.zeros(600 << 10, dtype=torch.uint8)
        host.portal.call(host.store.put, ["big1"], [big])
        host.portal.call(host.store.put, ["big2"], [big])
        assert "big1" in evicted
    finally:
        pt.close(5.0)
        store_host.release(host)


class _GatedPuts:
    """A store whose writes wait for :attr:`gate` (reads and the rest pass through)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not name.startswith("put"):
            return attr

        async def gated(*args: Any, **kwargs: Any) -> Any:
            await anyio.to_thread.run_sync(self.gate.wait)
            return await attr(*args, **kwargs)

        return gated


def test_a_load_of_an_object_whose_save_is_in_flight_lands_from_staging_without_waiting() -> None:
    """Host pages: the object is copied from the save's staging slot, the store's put still held."""
    host = store_host.acquire(VllmConnectorConfig.from_extra_config({"capacity_mb": 4}))
    inner = host.store
    gated = _GatedPuts(inner)
    host.store = gated
    _raw, pages = _pages(8)
    pt = PageTransfers(host, pages, fingerprint=b"f" * 32, with_state=False, staging_bytes=4 * 128)
    try:
        before = pages.raws[0][1].clone()
        pt.save([TransferPlan("a", ("k1",), (1,))])  # its write waits at the gate
        pt.load(TransferPlan("b", ("k1",), (4,)))  # planned while the save is in flight
        ok: set[str] = set()
        bad: set[str] = set()
        deadline = time.monotonic() + 5.0
        while not (ok or bad) and time.monotonic() < deadline:
            ok, bad = pt.finished_loads()
            time.sleep(0.005)
        assert ok == {"b"} and not bad  # landed while the put is still held: no wait for the store
        assert pt.saves_in_flight() == 1 and pt.statistics().objects_from_staging == 1
        assert torch.equal(pages.raws[0][4], before)
        gated.gate.set()
        assert pt.drain(5.0)
    finally:
        gated.gate.set()
        pt.close(5.0)
        host.store = inner
        store_host.release(host)


def test_waiting_for_loads_is_bounded_and_ends_when_a_load_ends() -> None:
    """What the worker does in a step that computes nothing (``IDLE_LOAD_WAIT_S``): it blocks on its
    loads in flight, at most the timeout, and returns with the load finished once it ended."""
    host = store_host.acquire(VllmConnectorConfig.from_extra_config({"capacity_mb": 4}))
    inner = host.store
    gated = _GatedPuts(inner)
    host.store = gated
    _raw, pages = _pages(8)
    pt = PageTransfers(host, pages, fingerprint=b"f" * 32, with_state=False, staging_bytes=4 * 128)
    copied = threading.Event()  # the load's copy from the save's staging slot waits for it
    copy_in = pt._copy_in

    def held_copy_in(plan: TransferPlan, slots: dict[str, int]) -> None:
        assert copied.wait(30.0)
        copy_in(plan, slots)

    pt._copy_in = held_copy_in  # type: ignore[method-assign]
    try:
        pt.wait_for_loads(60.0)  # nothing in flight: returns at once
        pt.save([TransferPlan("a", ("k1",), (1,))])  # its write waits at the gate
        pt.load(TransferPlan("b", ("k1",), (4,)))  # read from the save's slot, held above
        pt.wait_for_loads(0.05)  # bounded: returns with the load still in flight
        assert pt.finished_loads() == (set(), set())
        threading.Timer(0.2, copied.set).start()
        pt.wait_for_loads(60.0)
        assert pt.finished_loads() == ({"b"}, set())  # returned because the load ended
    finally:
        copied.set()
        gated.gate.set()
        pt.close(5.0)
        host.store = inner
        store_host.release(host)


def test_kv_replicas_follows_vllms_sharding_of_kv_heads() -> None:
    assert kv_replicas(1, 2) == 2  # one KV head on both ranks (the tests' tiny model at TP 2)
    assert kv_replicas(2, 2) == 1 and kv_replicas(8, 2) == 1  # heads split: no two ranks alike
    assert kv_replicas(2, 8) == 4  # ranks 0-3 hold head 0, ranks 4-7 head 1
    assert kv_replicas(1, 1) == 1
    assert kv_replicas(64, 4, latent=True) == 4  # MLA: one latent cache, the same on every rank
    with pytest.raises(ValueError, match="evenly"):
        kv_replicas(2, 3)
    layout = KeyLayout(CopyRanks(8, 4), CopyRanks(8))
    assert [layout.key("h:kv:g0", r) for r in (0, 3, 4, 7)] == ["h:kv:g0:r0", "h:kv:g0:r0", "h:kv:g0:r4", "h:kv:g0:r4"]
    assert layout.key("h:state:g1", 3) == "h:state:g1:r3"  # states are sharded on every rank
    assert layout.copy_keys("h:kv:g0") == ["h:kv:g0:r0", "h:kv:g0:r4"]
    assert [r for r in range(8) if layout.blocks.writes(r)] == [0, 4]
    with pytest.raises(ValueError, match="divide"):
        CopyRanks(6, 4)


def test_replicated_attention_pages_are_written_once_and_read_by_every_rank() -> None:
    """Two ranks over one shared store with one KV head replicated on both: rank 0 writes the
    block, rank 1 writes only its state; the probe needs the one block copy and both states;
    rank 1 restores the block from rank 0's copy."""
    host = store_host.acquire(VllmConnectorConfig.from_extra_config({"capacity_mb": 8}))
    layout = KeyLayout(CopyRanks(2, 2), CopyRanks(2))
    raws, ranks = [], []
    for rank in (0, 1):
        raw, pages = _pages(8)
        raws.append(raw)
        ranks.append(PageTransfers(host, pages, fingerprint=b"f" * 32, with_state=True, staging_bytes=8 * 128,
                                   rank=rank, layout=layout))
    kv, state = "h1:kv:g0", "h1:state:g1"
    try:
        raws[1].view(8, 128)[1].copy_(raws[0].view(8, 128)[1])  # the replicated block: the same bytes
        for pt in ranks:
            pt.save([TransferPlan("a", (kv,), (1,), (state,), (2,))])
            assert pt.drain(10.0)
        assert [pt.statistics().objects_saved for pt in ranks] == [2, 1]  # the block once
        keys = [rank_key(kv, 0), rank_key(kv, 1), rank_key(state, 0), rank_key(state, 1)]
        assert host.portal.call(host.store.exists, keys) == [True, False, True, True]
        probe = StoreProbe(host, layout)
        assert probe.exists([kv, state, "h2:kv:g0"], 1.0) == [True, True, False]
        host.portal.call(host.store.remove, [rank_key(state, 1)])
        assert probe.exists([kv, state], 1.0) == [True, False]  # a state needs every rank's copy
        ranks[1].load(TransferPlan("b", (kv,), (5,)))
        done: set[str] = set()
        bad: set[str] = set()
        while not (done or bad):
            done, bad = ranks[1].finished_loads()
        assert done == {"b"} and torch.equal(raws[1].view(8, 128)[5], raws[0].view(8, 128)[1])
    finally:
        for pt in ranks:
            pt.close(5.0)
        store_host.release(host)
