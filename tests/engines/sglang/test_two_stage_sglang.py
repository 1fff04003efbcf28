"""The SGLang plugin's two-stage offload through host staging (issue 52, item 3), on SGLang's real
cache: SGLang's node unlocks once its bytes are sealed in host staging, a lookup finds it in the
draining frames and a load restores it from there before the store acknowledged it, it is stored
only once the store did, a full budget refuses and counts, close drains or drops and
counts, and no staging byte is left charged. Asserted by counting, never by timing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from hylinker.testing.fakes import GatedStore
from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache, page_keys

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
PASS_THROUGH = "deadline_ms=600000"  # a FaultyStore that injects nothing: a gate can be swapped in

#: (model, kv, page size, layers, full layers): layer counts 1, 2, 8; page sizes 1 and 64
GEOMETRIES = [
    pytest.param(dict(model="dense", kv="mha", page_size=1, num_layers=1), id="dense-p1-l1"),
    pytest.param(dict(model="hybrid", kv="mla", page_size=1, num_layers=2, full_layers=(1,)), id="hybrid-p1-l2"),
    pytest.param(dict(model="hybrid", kv="mla", page_size=1, num_layers=8, full_layers=(3, 7)), id="hybrid-p1-l8"),
    pytest.param(dict(model="dense", kv="mha", page_size=64, num_layers=1), id="dense-p64-l1"),
    pytest.param(dict(model="dense", kv="mla", page_size=64, num_layers=8), id="dense-p64-l8"),
]


def build(made: list[SGLangCache], spec: dict[str, Any] | None = None, **extra: Any) -> tuple[SGLangCache, GatedStore]:
    """A cache whose store's puts wait at a gate (opened with :func:`open_gate`)."""
    cache = SGLangCache(CacheSpec(**(spec or {})), {**PLUGIN, "linker_extra_config": {
        "faults": PASS_THROUGH, "store_timeout_s": 60.0, "two_stage_offload": True, **extra}})
    made.append(cache)
    gated = GatedStore(cache.linker.store.inner, hold_puts=True)
    cache.linker.store._inner = gated
    return cache, gated


def open_gate(cache: SGLangCache, gated: GatedStore) -> None:
    async def run() -> None:  # on the store's loop, where the held calls wait
        gated.open()

    cache.linker.data.call_store(run).result(timeout=10)


def report_all(cache: SGLangCache, timeout_s: float = 10.0) -> None:
    """SGLang's scheduler rounds until it has no offload pending (its nodes unlocked)."""
    wrapper = cache.cache.linker
    deadline = time.monotonic() + timeout_s
    while wrapper.pending_offloads:
        cache.cache.check_hicache_events()
        assert time.monotonic() < deadline, f"{len(wrapper.pending_offloads)} offloads still pending"
        time.sleep(0.001)


def hit(cache: SGLangCache, tokens: list[int]) -> list[int]:
    """The store-restorable page counts the plugin's lookup offers for ``tokens``."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    keys = page_keys(tokens, cache.spec.page_size)
    found: list[int] = cache.linker.lookup("probe", [PoolTransfer(name=PoolName("kv"), keys=keys)])
    return found


def prompt(i: int, pages: int, page: int) -> list[int]:
    return list(range(10_000 * i, 10_000 * i + pages * page))


@pytest.mark.parametrize("spec", GEOMETRIES)
def test_device_pages_free_before_the_put_stored_only_after_the_ack(caches: list[SGLangCache],
                                                                     spec: dict[str, Any]) -> None:
    cache, gated = build(caches, spec)
    linker = cache.linker
    page = spec["page_size"]
    tokens = prompt(1, 4, page)
    served = cache.serve(tokens, settle=False)
    assert not served.aborted
    report_all(cache)  # SGLang heard back while every put still waits at the gate
    assert gated.held >= 1 and gated.completed["put"] == 0
    stats = linker.statistics()
    assert stats.offloads_ok == 0 and stats.host_staging_used_bytes > 0
    # the node is unlocked: eviction frees every row and state slot though no put ended
    cache.evict_all()
    assert cache.leaks() == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}
    # not stored before the store acknowledged it, yet restorable: the lookup reads the frames
    # still draining (the freshest copy), and a load copies them from there, exact
    assert hit(cache, tokens)[-1] >= len(tokens) // page - 1
    early = cache.serve([*tokens, 5], settle=False)
    assert not early.aborted and early.restore_mismatches == [] and early.loaded > 0
    assert linker.statistics().staging_restores > 0 and gated.completed["put"] == 0
    report_all(cache)
    open_gate(cache, gated)
    assert linker.wait_drained(10)
    stats = linker.statistics()
    assert stats.offloads_ok >= 1 and stats.offloads_failed == 0
    assert stats.host_staging_used_bytes == 0 and stats.host_staging_peak_bytes > 0
    assert stats.host_staging_region_bytes > 0 and stats.host_staging_frames_outside == 0
    assert hit(cache, tokens)[-1] >= len(tokens) // page - 1  # the store holds it now (pages)
    cache.flush()
    again = cache.serve([*tokens, 7], settle=True)
    assert not again.aborted and again.restore_mismatches == [] and again.loaded > 0


def test_failed_put_leaves_it_unstored_and_it_is_offered_again(caches: list[SGLangCache]) -> None:
    cache, gated = build(caches)
    open_gate(cache, gated)
    gated.fail_puts = True
    tokens = prompt(2, 16, 1)
    cache.serve(tokens, settle=True)  # settle: reported to SGLang and answered by the store
    stats = cache.linker.statistics()
    assert stats.offloads_failed >= 1 and stats.offloads_ok == 0
    assert stats.host_staging_used_bytes == 0
    assert hit(cache, tokens) == []
    gated.fail_puts = False
    cache.serve([*tokens, 1], settle=True)  # the unstored node is offered again on its hit
    assert cache.linker.statistics().offloads_ok >= 1
    assert hit(cache, tokens)[-1] == len(tokens)
    # an acknowledged node offered again writes nothing and reports stored
    puts = gated.calls["put"]
    cache.serve([*tokens, 1, 2], settle=True)
    assert cache.linker.statistics().objects_skipped_restored > 0
    cache.evict_all()
    assert cache.leaks() == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}
    assert gated.calls["put"] - puts <= 2  # only the new tail's pages


def test_full_budget_refuses_counts_and_unlocks(caches: list[SGLangCache]) -> None:
    cache, gated = build(caches, dict(model="dense", kv="mha", page_size=1, num_layers=2))
    linker = cache.linker
    staging = linker.host_staging
    assert staging is not None
    one = staging.floor * 8  # room for one 8-page prompt's frames, not two
    staging.capacity = one + staging.floor
    prompts = [prompt(10 + i, 8, 1) for i in range(4)]
    for tokens in prompts:
        assert not cache.serve(tokens, settle=False).aborted
    report_all(cache)
    stats = linker.statistics()
    assert stats.offloads_refused_staging >= 1 and stats.offloads_refused == 0
    assert stats.host_staging_used_bytes <= staging.capacity
    assert staging.refused == stats.offloads_refused_staging
    cache.evict_all()  # refused nodes unlock too
    assert cache.leaks() == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}
    open_gate(cache, gated)
    assert linker.wait_drained(10)
    assert linker.statistics().host_staging_used_bytes == 0
    # a refused prefix was never stored
    assert any(hit(cache, tokens) == [] for tokens in prompts)


@pytest.mark.parametrize("drains", [True, False], ids=["drains", "drops"])
def test_close_drains_or_drops_and_counts(caches: list[SGLangCache], drains: bool) -> None:
    cache, gated = build(caches, drain_timeout_s=0.5)
    linker = cache.linker
    for i in range(3):
        cache.serve(prompt(20 + i, 8, 1), settle=False)
    report_all(cache)
    assert linker.statistics().host_staging_used_bytes > 0
    if drains:
        open_gate(cache, gated)
    caches.remove(cache)
    cache.close()
    staging = linker.host_staging.figures()  # the data plane is gone: its budget and the plugin's counters
    counts = linker._c
    assert staging["host_staging_used_bytes"] == 0
    if drains:
        assert counts["offloads_failed"] == 0 and staging["host_staging_dropped_objects"] == 0
        assert counts["offloads_ok"] >= 1
    else:
        assert staging["host_staging_dropped_objects"] > 0 and counts["offloads_failed"] >= 1
        assert counts["offloads_ok"] == 0


def test_close_with_a_put_that_never_returns_is_bounded(caches: list[SGLangCache]) -> None:
    """A put that never returns and cannot be cancelled (Mooncake's put to a dead master reads
    the frames in a thread, never abandoned): close() still returns, within close_timeout_s
    (the drain's share of it, not drain_timeout_s); the frames queued behind it are dropped and
    counted, the put at the store is counted abandoned, and no node is marked stored."""
    cache, gated = build(caches, drain_timeout_s=600.0, close_timeout_s=1.0, store_timeout_s=600.0)
    gated.shielded = True
    linker = cache.linker
    prompts = [prompt(40 + i, 8, 1) for i in range(3)]
    for tokens in prompts:
        cache.serve(tokens, settle=False)
    report_all(cache)  # every node unlocked at its copy; the first put waits at the gate for good
    assert gated.held >= 1 and linker.statistics().host_staging_used_bytes > 0
    caches.remove(cache)
    closing = threading.Thread(target=cache.close, daemon=True)
    try:
        closing.start()
        closing.join(timeout=60)  # unbounded before: the data plane's reset waited for the put
        assert not closing.is_alive(), "close() hung behind a put that never returns"
        counts = linker._c
        assert counts["offloads_abandoned_at_close"] >= 1 and counts["offloads_ok"] == 0
        assert linker.host_staging.dropped_objects > 0 and counts["offloads_failed"] >= 1
    finally:
        gated.shielded = False
        linker.data._loop.call_soon_threadsafe(gated.open)  # the put ends: the background close finishes


def test_one_stage_is_kept_by_the_switch(caches: list[SGLangCache]) -> None:
    cache, gated = build(caches, two_stage_offload=False)
    assert cache.linker.host_staging is None
    cache.serve(prompt(30, 8, 1), settle=False)
    cache.cache.check_hicache_events()
    assert cache.cache.linker.pending_offloads  # locked until the store answers
    open_gate(cache, gated)
    cache.settle()
    assert cache.linker.statistics().host_staging_capacity_bytes == 0


def test_host_staging_bytes_is_checked_by_name(caches: list[SGLangCache]) -> None:
    from hylinker.integrations.sglang.config import LinkerConfigError

    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(LinkerConfigError, match="host_staging_bytes"):
            SGLangCache(CacheSpec(), {**PLUGIN, "linker_extra_config": {"two_stage_offload": True, "host_staging_bytes": bad}})
    cache = SGLangCache(CacheSpec(), {**PLUGIN, "linker_extra_config": {"two_stage_offload": True, "host_staging_bytes": 1 << 22}})
    caches.append(cache)
    assert cache.linker.host_staging is not None and cache.linker.host_staging.capacity == 1 << 22


def test_the_derived_budget_is_raised_to_the_floor_and_capped_by_the_inflight_bytes(caches: list[SGLangCache]) -> None:
    """Twice a small pool's bytes (well under a MiB here) fills at once behind a store that lags:
    the derived budget is at least HOST_STAGING_FLOOR_MB, and never above offload_max_inflight_mb."""
    from hylinker.integrations.sglang.config import HOST_STAGING_FLOOR_MB

    cache = SGLangCache(CacheSpec(), {**PLUGIN, "linker_extra_config": {"two_stage_offload": True}})
    caches.append(cache)
    staging = cache.linker.host_staging
    assert staging is not None and staging.capacity == HOST_STAGING_FLOOR_MB << 20
    capped = SGLangCache(CacheSpec(), {**PLUGIN, "linker_extra_config": {"two_stage_offload": True,
                                                                          "offload_max_inflight_mb": 1}})
    caches.append(capped)
    assert capped.linker.host_staging is not None and capped.linker.host_staging.capacity == 1 << 20
