"""The SGLang plugin under a dead or stalled store: bounded scheduler time, bounded offloads
(issue 42, items 4 and 5), on SGLang's real cache. Asserted by counting, never by timing.

Before: each lookup of a store that never answers blocked the scheduler for lookup_timeout_s and
the breaker never opened (a lookup's cancelled attempt was not counted); offloads were never
refused, each holding its node's rows locked while the store did not drain.
"""

from __future__ import annotations

import time
from typing import Any

from hylinker.stores.resilient import ResiliencePolicy
from hylinker.testing.fakes import GatedStore
from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache, page_keys

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
#: a store that never answers: every call waits an hour first
DEAD = "latency_ms=3600000"
#: a fault plan that injects nothing but keeps a FaultyStore (plain calls) to swap a gate into
PASS_THROUGH = "deadline_ms=600000"
THRESHOLD = ResiliencePolicy().failure_threshold


def build(made: list[SGLangCache], **extra: Any) -> SGLangCache:
    cache = SGLangCache(CacheSpec(), {**PLUGIN, "linker_extra_config": extra})
    made.append(cache)
    return cache


def lookup(cache: SGLangCache, tokens: list[int]) -> list[int]:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    result: list[int] = cache.linker.lookup("r", [PoolTransfer(name=PoolName("kv"), keys=page_keys(tokens))])
    return result


def store_calls(cache: SGLangCache) -> int:
    """Calls that reached the (fault-wrapped) store under the plugin's retry rule."""
    calls: int = cache.linker.store.inner.statistics().calls
    return calls


def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


# ---- item 4: a dead store --------------------------------------------------------------------
def test_dead_store_opens_the_breaker_then_lookups_miss_at_once(caches: list[SGLangCache]) -> None:
    cache = build(caches, faults=DEAD, lookup_timeout_s=0.05)
    linker = cache.linker
    tokens = list(range(100, 116))
    for n in range(1, THRESHOLD + 1):
        linker.num_completed_offloads()  # a scheduler round
        assert lookup(cache, tokens) == []  # gave up after lookup_timeout_s: a miss
        # the given-up call counts toward the breaker (on the loop, just after the lookup returned)
        wait_for(lambda n=n: linker.store.breaker.failures == n)
    assert store_calls(cache) == THRESHOLD
    res = linker.store.resilience()
    assert res.breaker == "open" and res.breaker_trips == 1
    calls, probes = store_calls(cache), res.probes
    for _ in range(40):
        linker.num_completed_offloads()
        assert lookup(cache, tokens) == []  # at once: the breaker is open
    stats = linker.statistics()
    assert stats.lookups_breaker_open == 40 and stats.lookup_errors == THRESHOLD
    assert stats.store_cancelled == THRESHOLD and stats.store_breaker_trips == 1
    # only the breaker's probes (one per probe interval, in the background) reached the store
    assert store_calls(cache) - calls == linker.store.resilience().probes - probes <= 40


def test_lookups_share_one_budget_per_scheduler_round(caches: list[SGLangCache]) -> None:
    cache = build(caches, faults=DEAD, lookup_timeout_s=0.2, lookup_budget_s=0.3)
    linker = cache.linker
    tokens = list(range(200, 208))
    linker.num_completed_offloads()  # a round starts: 0.3 s of store time
    assert lookup(cache, tokens) == []  # waits 0.2 s
    assert lookup(cache, tokens) == []  # waits what is left, about 0.1 s
    assert store_calls(cache) == 2
    for _ in range(10):  # the budget is spent: misses without asking the store
        assert lookup(cache, tokens) == []
    assert store_calls(cache) == 2
    assert linker.statistics().lookups_over_budget == 10
    linker.num_completed_offloads()  # the next round has its budget again
    assert lookup(cache, tokens) == []
    assert store_calls(cache) == 3
    assert linker.statistics().lookups_over_budget == 10


# ---- item 5: offloads in flight are bounded ----------------------------------------------------
def test_offloads_beyond_the_bound_are_refused_and_unlocked(caches: list[SGLangCache]) -> None:
    bound = 4
    # one stage: the bound counts nodes locked until the store answers (two stages: test_two_stage_sglang.py)
    cache = build(caches, faults=PASS_THROUGH, offload_max_inflight=bound, store_timeout_s=60.0,
                  two_stage_offload=False)
    linker = cache.linker
    gated = GatedStore(linker.store.inner, hold_puts=True)  # the store takes no write
    linker.store._inner = gated
    wrapper = cache.cache.linker  # SGLang's side: its pending offloads hold their nodes locked
    prompts = [list(range(1000 * i, 1000 * i + 8)) for i in range(1, 21)]
    most_pending = 0
    for tokens in prompts:  # a flood of new nodes, one offload each
        served = cache.serve(tokens, settle=False)
        assert not served.aborted
        most_pending = max(most_pending, len(wrapper.pending_offloads))
        assert linker.statistics().offloads_in_flight <= bound
    stats = linker.statistics()
    assert stats.offloads_refused == len(prompts) - bound
    assert stats.offloads_in_flight == bound and stats.offloads_in_flight_peak == bound
    assert most_pending == bound == len(wrapper.pending_offloads)
    assert stats.offload_bytes_in_flight > 0
    # every refused node is unlocked: eviction frees all but the accepted nodes' rows and states
    cache.evict_all()
    rows = cache.leaks()
    assert rows["kv_rows"] == bound * 8 and rows["mamba_slots"] == bound, rows
    # the gate opens: every accepted offload completes and reports True
    async def open_gate() -> None:  # on the store's loop, where the held calls wait
        gated.open()

    linker.data.call_store(open_gate).result(timeout=10)
    cache.settle()
    stats = linker.statistics()
    assert stats.offloads_ok == bound and stats.offloads_failed == 0
    assert stats.offloads_in_flight == 0 and stats.offload_bytes_in_flight == 0
    linker.store._inner = gated.inner
    cache.evict_all()
    assert cache.leaks() == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}
    # a refused node was not marked stored: it is offered again on its next hit
    again = cache.serve(prompts[-1] + [7], settle=True)
    assert again.store_hit == 0 and linker.statistics().offloads_ok > bound


def test_default_bound_keeps_state_slots_free_under_a_stalled_store(caches: list[SGLangCache]) -> None:
    # "Can not alloc mamba cache": nodes locked by offloads that never drain hold every state
    # slot, and the next request cannot get one. The default bound keeps half the slots free
    cache = build(caches, faults=PASS_THROUGH, store_timeout_s=60.0, two_stage_offload=False)
    linker = cache.linker
    gated = GatedStore(linker.store.inner, hold_puts=True)
    linker.store._inner = gated
    slots = cache.spec.mamba_slots
    for i in range(1, slots + 9):  # more requests than state slots; the scheduler evicts as needed
        served = cache.serve(list(range(1000 * i, 1000 * i + 8)), settle=False)
        assert not served.aborted
        cache.evict_all()
    stats = linker.statistics()
    assert stats.offloads_in_flight_peak <= slots // 2 + 1
    assert stats.offloads_refused >= 8
    assert cache.leaks()["mamba_slots"] <= slots // 2 + 1

    async def open_gate() -> None:
        gated.open()

    linker.data.call_store(open_gate).result(timeout=10)
    cache.settle()
    linker.store._inner = gated.inner
    cache.evict_all()
    assert cache.leaks() == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}
