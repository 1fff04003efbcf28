"""Issue 53: what the runtime keeps per evicted key or per finished transfer stays bounded.

The embedded store's eviction memory holds its keys within a byte budget (checked against
``tracemalloc``, not only its own estimate) and counts what it dropped; a budget of 0 turns it
off; a bad budget is an error naming the key. ``SyncDataPlane`` keeps no finished offload
unless the caller asked for the completion FIFO.
"""

from __future__ import annotations

import gc
import math
import tracemalloc
from typing import Any

import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet, kv_view
from hylinker.integrations.config import PluginConfig, PluginConfigError
from hylinker.runtime.dataplane.plane import Transfer
from hylinker.runtime.dataplane.sync_plane import SyncDataPlane
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.eviction_memory import ENTRY_BYTES, EvictionMemory
from hylinker.stores.fault_plan import FaultPlan
from hylinker.stores.faulty import FaultyStore

KEY = "{:064x}:kv:0"  # hylinker's key shape: a 64-hex hash, the pool, the rank


def _evict_and_ask(memory: EvictionMemory, n: int) -> None:
    for i in range(n):
        memory.evicted([KEY.format(i)])
        if i % 3 == 0:  # a third of the evictions come back a little later
            memory.asked_again(KEY.format(max(0, i - 50)))


def test_eviction_memory_stays_within_its_byte_budget_by_tracemalloc() -> None:
    budget = 1 << 20
    clock = iter(range(10**9)).__next__
    memory = EvictionMemory(lambda: float(clock()), budget)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _evict_and_ask(memory, 60_000)  # ~14 MB of keys had every one been kept
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert memory.bytes <= budget
    assert held <= budget * 1.25, f"{held} bytes held for a {budget}-byte budget"
    # the estimate is not far below what Python holds (an estimate that low would be no bound)
    assert memory.remembered * ENTRY_BYTES >= held * 0.4
    kv = memory.pools["kv"]
    assert kv.evicted == 60_000
    assert memory.dropped == 60_000 - memory.remembered - kv.asked > 0
    assert kv.asked > 15_000 and kv.soon == kv.asked  # the clock ticks once a call: all soon


def test_eviction_memory_budget_zero_is_off() -> None:
    memory = EvictionMemory(lambda: 0.0, 0)
    _evict_and_ask(memory, 1000)
    assert (memory.bytes, memory.remembered, memory.asked, memory.pools) == (0, 0, 0, {})


def test_eviction_memory_median_is_sampled_past_its_sample() -> None:
    now = [0.0]
    memory = EvictionMemory(lambda: now[0], 64 << 20)
    for i in range(10_000):
        now[0] = float(i)
        memory.evicted([KEY.format(i)])
    for i in range(10_000):  # each comes back 10,000 s after its eviction: delays all equal
        now[0] = float(i + 10_000)
        assert memory.asked_again(KEY.format(i)) == 1
    kv = memory.pools["kv"]
    assert (kv.asked, kv.soon, len(kv.delays), kv.median_delay_s()) == (10_000, 0, 4096, 10_000.0)
    assert memory.remembered == 0 and memory.bytes == 4096 * 8


def test_pool_names_are_bounded() -> None:
    memory = EvictionMemory(lambda: 0.0)
    memory.evicted([f"k{i}:req-{i}:0" for i in range(1000)])  # a second part per request
    assert len(memory.pools) == 16 and memory.pools["other"].evicted == 1000 - 15


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, 1.5, "4MB", True])
def test_bad_budget_is_an_error_naming_the_key(bad: Any) -> None:
    with pytest.raises(ValueError, match="eviction_memory_bytes must be"):
        EmbeddedStore(1 << 20, eviction_memory_bytes=bad)


@pytest.mark.parametrize("bad", ["-1", "NaN", "Infinity", "1.5"])
def test_bad_budget_in_extra_config_names_the_key(bad: str) -> None:
    import json

    with pytest.raises(PluginConfigError, match=r"extra_config\['eviction_memory_bytes'\] must be"):
        PluginConfig.from_extra_config(json.loads(f'{{"eviction_memory_bytes": {bad}}}'))


async def test_extra_config_budget_reaches_the_store() -> None:
    store = await PluginConfig.from_extra_config({"eviction_memory_bytes": 0}).open_store()
    assert isinstance(store, EmbeddedStore) and not store.evictions_memory.enabled
    await store.close()
    store = await PluginConfig.from_extra_config({}).open_store()
    assert isinstance(store, EmbeddedStore) and store.evictions_memory.budget_bytes == 4 << 20
    await store.close()


@pytest.mark.parametrize(("plan", "kept"), [(FaultPlan(fail=0.01), 0), (FaultPlan(corrupt_first_read=0.01), 64)])
async def test_faulty_store_remembers_reads_only_for_a_first_read_fault(plan: FaultPlan, kept: int) -> None:
    store = FaultyStore(EmbeddedStore(1 << 20), plan, seed=1)
    keys = [f"k{i}" for i in range(64)]
    await store.put(keys, [torch.ones(64, dtype=torch.uint8)] * 64)
    ok = sum(r.nbytes > 0 for r in await store.get(keys, [torch.zeros(64, dtype=torch.uint8) for _ in keys]))
    assert len(store._read) == (ok if kept else 0) and ok > 50
    await store.close()


# ---- the sync plane keeps no finished offload ---------------------------------------------------

def _views() -> tuple[PoolSet, list[torch.Tensor]]:
    k = [torch.randn(256, 2, 8)]
    v = [torch.randn(256, 2, 8)]
    return PoolSet([kv_view(k, v, layer_ids=[0], page_size=16)]), k


def test_sync_plane_keeps_no_finished_offload_unless_asked() -> None:
    views, _ = _views()
    with SyncDataPlane(views, lambda: EmbeddedStore(1 << 20)) as dp:
        for i in range(200):  # the documented use: wait on the future, never pop
            dp.offload([Transfer(PoolKind.FULL, [f"p{i}"], torch.arange(16))]).result()
        assert len(dp._fifo) == 0
        with pytest.raises(RuntimeError, match="completion_fifo=True"):
            dp.pop_completed_offloads()
    with SyncDataPlane(views, lambda: EmbeddedStore(1 << 20), completion_fifo=True) as dp:
        for i in range(5):
            dp.offload([Transfer(PoolKind.FULL, [f"p{i}"], torch.arange(16))]).result()
        assert dp.num_completed_offloads() == 5
        assert [o.ok for o in dp.pop_completed_offloads()] == [True] * 5
        assert len(dp._fifo) == 0
