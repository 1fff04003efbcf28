"""HylinkerLinker inside SGLang 0.5.23's real UnifiedRadixCache (FULL + MAMBA) on CPU.

Every test builds SGLang's own pools and cache, loads the plugin through SGLang's dynamic linker
factory, and drives requests through the scheduler's steps (hylinker.tools.harness.sglang_cache). A
restore is checked byte for byte against what a recompute writes.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
import torch

from hylinker.stores import framing
from hylinker.stores.base import Store, supports_checksums, supports_scatter
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.testing.fakes import GatedStore
from hylinker.tools.harness.sglang_cache import CacheSpec, Served, SGLangCache, page_keys

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
CORES = ["python", "rust"]
A = list(range(1000, 1024))  # 24 tokens (page size 1: 24 pages)
B = list(range(2000, 2016))
C = list(range(3000, 3008))


def plugin(**extra: Any) -> dict[str, Any]:
    return {**PLUGIN, "linker_extra_config": extra}


def build(made: list[SGLangCache], core: str = "python", kv: str = "mla", **extra: Any) -> SGLangCache:
    cache = SGLangCache(CacheSpec(tree_core=core, kv=kv), plugin(**extra))
    made.append(cache)
    return cache


def call(cache: SGLangCache, fn: Any, *args: Any) -> Any:
    """``await fn(*args)`` on the plugin's data-plane loop (stores bind to their loop)."""
    return cache.linker.data.call_store(fn, *args).result(timeout=10)


def store(cache: SGLangCache) -> Any:
    """The plugin's store: the one retry rule (ResilientStore) around the configured store."""
    return cache.linker.store


def swap_inner(cache: SGLangCache, inner: Store) -> None:
    """Put ``inner`` under the plugin's retry rule from now on (to inject faults mid-test).

    The data plane chose its calls (plain, scatter-gather, checksumming) from the store it was
    built over, so ``inner`` must offer the same ones: build such a cache with
    :func:`build_swappable`."""
    old = store(cache)._inner
    for offers in (supports_checksums, supports_scatter):
        assert offers(inner) == offers(old), f"{offers.__name__}: {inner!r} does not replace {old!r}"
    store(cache)._inner = inner


#: a fault plan that injects nothing but keeps the store wrapped in a FaultyStore (plain
#: put/get), so FaultyStores and GatedStores with the same calls can be swapped in later
PASS_THROUGH = "deadline_ms=600000"


def build_swappable(made: list[SGLangCache], core: str = "python", **extra: Any) -> SGLangCache:
    return build(made, core, faults=PASS_THROUGH, **extra)


def kv_key(cache: SGLangCache, tokens: list[int], page: int, pool: str = "kv") -> str:
    return cache.linker.object_keys(pool, [page_keys(tokens)[page]])[0]


def frame_bytes(cache: SGLangCache, pool: str) -> int:
    return framing.framed_size(cache.linker.pools[pool_name(pool)].payload_bytes)


def pool_name(pool: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return PoolName(pool)


def assert_clean(cache: SGLangCache) -> None:
    cache.settle()
    cache.evict_all()
    assert cache.leaks() == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}


def restored_ok(served: Served, tokens: int) -> None:
    assert not served.aborted
    assert served.loaded == tokens, served
    assert served.restore_mismatches == []


# ---- loading and the bit-exact restore -------------------------------------------------------
def test_factory_loads_the_plugin_and_rejects_unknown_keys(caches: list[SGLangCache]) -> None:
    from hylinker.integrations.sglang.config import LinkerConfigError
    from hylinker.integrations.sglang.linker import HylinkerLinker

    cache = build(caches)
    assert type(cache.linker) is HylinkerLinker
    assert cache.cache.linker.layer_done_counter is cache.linker.layer_done_counter
    with pytest.raises(LinkerConfigError, match="unknown linker_extra_config keys"):
        SGLangCache(CacheSpec(), plugin(stor="embedded"))
    with pytest.raises(LinkerConfigError, match="HOST:PORT"):
        SGLangCache(CacheSpec(), plugin(store="mooncake"))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("kv", ["mla", "mha"])
def test_bit_exact_restore_after_flush(caches: list[SGLangCache], core: str, kv: str) -> None:
    cache = build(caches, core, kv)
    first = cache.serve(A + B)
    assert first.store_hit == 0
    cache.flush()
    again = cache.serve(A + B + C)  # the state at len(A+B) is stored: the whole prefix restores
    assert again.device_hit == 0
    restored_ok(again, len(A + B))
    stats = cache.linker.statistics()
    assert stats.loads_ok == 1 and stats.verify_failures == 0
    # the restored pages are not written again by the request's insert
    assert stats.objects_skipped_restored == len(A + B)
    assert_clean(cache)


@pytest.mark.parametrize("core", CORES)
def test_second_request_sharing_a_restored_prefix(caches: list[SGLangCache], core: str) -> None:
    cache = build(caches, core)
    cache.serve(A + B)
    cache.flush()
    restored_ok(cache.serve(A + B + C), len(A + B))
    # no flush: the restored prefix is in the device tree now (inserted with the request)
    shared = cache.serve(A + B + [7, 8, 9])
    assert shared.device_hit + shared.loaded == len(A + B)
    assert not shared.aborted and shared.restore_mismatches == []
    assert_clean(cache)


@pytest.mark.parametrize("core", CORES)
def test_sparse_state_boundaries(caches: list[SGLangCache], core: str) -> None:
    cache = build(caches, core)
    cache.serve(A)  # a state at len(A)
    cache.serve(A + B)  # and at len(A + B); none in between
    cache.flush()
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer

    keys = page_keys(A + B + C)
    counts = cache.linker.lookup("probe", [
        PoolTransfer(name=pool_name("kv"), keys=keys),
        PoolTransfer(name=pool_name("mamba"), keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert counts == [len(A), len(A + B)]
    # a request branching inside B restores up to the deepest state below its branch point
    restored_ok(cache.serve(A + B[:8] + C), len(A))
    assert_clean(cache)


@pytest.mark.parametrize("core", CORES)
def test_page_evicted_from_the_store_gives_a_shorter_hit(caches: list[SGLangCache], core: str) -> None:
    cache = build(caches, core)
    cache.serve(A)
    cache.serve(A + B)
    cache.flush()
    gone = kv_key(cache, A + B, len(A) + 3)
    assert call(cache, store(cache).remove, [gone]) == 1
    restored_ok(cache.serve(A + B + C), len(A))
    assert_clean(cache)


# ---- integrity ------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["none", "corrupt_header", "corrupt_payload"])
def test_integrity_header_is_taken_from_the_extra_config(caches: list[SGLangCache], damage: str) -> None:
    """``linker_extra_config = {"integrity": "header"}``: objects are stored as unhashed
    frames (version 2) and restored bit for bit; a damaged header is still refused (read
    twice, removed); a flipped payload byte is not caught at this level (documented) and is
    restored as stored."""
    cache = build(caches, integrity="header")
    cache.serve(A + B)
    cache.flush()
    key = kv_key(cache, A + B, 5)
    good = cache.stored_bytes(key, frame_bytes(cache, "kv"))
    assert good is not None and good[4:8] == bytes([2, 0, 1, 0])  # version 2, flags FLAG_UNHASHED
    if damage != "none":
        cache.replace_object(key, _flip(good, 20 if damage == "corrupt_header" else len(good) - 3))
    served = cache.serve(A + B + C)
    stats = cache.linker.statistics()
    if damage == "corrupt_header":
        assert served.aborted
        assert (stats.verify_failures, stats.rereads_failed) == (1, 1)
    else:
        assert not served.aborted and served.loaded == len(A + B)
        assert (served.restore_mismatches == []) is (damage == "none")
        assert stats.verify_failures == 0
    assert_clean(cache)


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x5A
    return bytes(b)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("damage", ["corrupt_payload", "corrupt_header", "torn", "foreign"])
def test_damaged_objects_are_never_restored(caches: list[SGLangCache], core: str, damage: str) -> None:
    cache = build(caches, core)
    cache.serve(A + B)
    cache.flush()
    key = kv_key(cache, A + B, 5)
    good = cache.stored_bytes(key, frame_bytes(cache, "kv"))
    assert good is not None
    if damage == "corrupt_payload":
        bad = _flip(good, len(good) - 3)
    elif damage == "corrupt_header":
        bad = _flip(good, 20)
    elif damage == "torn":
        bad = good[: len(good) // 2]
    else:  # an object written under the same key by another layout (another model or salt)
        other = kv_key(cache, A + B, 6)
        bad = cache.stored_bytes(other, frame_bytes(cache, "kv")) or b""
    cache.replace_object(key, bad)
    target: dict[str, torch.Tensor] = {}

    def remember_rows(req: Any) -> None:  # the load's private rows, before anything lands
        rows = cache.cache.prefix_device_indices(req)
        target["rows"] = rows
        target["before"] = torch.stack([b[rows].clone() for bufs in cache.kv_buffers for b in bufs])

    served = cache.serve(A + B + C, before_forward=remember_rows)
    assert served.aborted  # SGLang finishes this request with 503
    after = torch.stack([b[target["rows"]].clone() for bufs in cache.kv_buffers for b in bufs])
    assert torch.equal(after.view(torch.uint8), target["before"].view(torch.uint8))  # nothing landed
    stats = cache.linker.statistics()
    assert stats.verify_failures == 1 and stats.loads_failed == 1
    assert (stats.rereads_failed, stats.rereads_recovered) == (1, 0)  # read twice, bad both times
    # the damaged object was removed: the next request recomputes above it instead of failing
    retry = cache.serve(A + B + C + [5])
    assert not retry.aborted and retry.loaded < len(A + B)
    assert_clean(cache)


# ---- transient faults, failures, retries ----------------------------------------------------
def _wrap_store(cache: SGLangCache, plan: FaultPlan, seed: int = 7) -> FaultyStore:
    faulty = FaultyStore(store(cache).inner, plan, seed=seed)
    swap_inner(cache, faulty)
    return faulty


@pytest.mark.parametrize("core", CORES)
def test_transient_store_errors_are_retried_then_restored(caches: list[SGLangCache], core: str) -> None:
    cache = build_swappable(caches, core, load_retries=8, retry_backoff_ms=1)
    cache.serve(A + B)
    cache.flush()
    faulty = FaultyStore(store(cache).inner, FaultPlan(fail=0.3), seed=7)

    def flaky_store(req: Any) -> None:  # after the lookup: the load meets the failing store
        swap_inner(cache, faulty)

    restored_ok(cache.serve(A + B + C, before_forward=flaky_store), len(A + B))
    assert faulty.statistics().failed_keys > 0
    stats = cache.linker.statistics()
    assert stats.store_retried_keys >= 1 and stats.store_recovered_keys >= 1
    assert stats.store_exhausted_keys == 0
    swap_inner(cache, faulty.inner)
    assert_clean(cache)


def test_retries_are_bounded_then_the_load_fails(caches: list[SGLangCache]) -> None:
    cache = build_swappable(caches, load_retries=2, retry_backoff_ms=1)
    cache.serve(A + B)
    cache.flush()
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer

    keys = page_keys(A + B + C)
    assert cache.linker.lookup("p", [PoolTransfer(name=pool_name("kv"), keys=keys),
                                     PoolTransfer(name=pool_name("mamba"), keys=keys[-1:],
                                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    faulty = FaultyStore(store(cache).inner, FaultPlan(fail=1.0), seed=7)
    # lookups would fail closed (a miss), so drive the failing load through a clean lookup first
    served_hit: dict[str, int] = {}
    before = cache.linker.statistics()

    def break_store(req: Any) -> None:
        served_hit["hit"] = req.host_loaded_length
        swap_inner(cache, faulty)

    served = cache.serve(A + B + C, before_forward=break_store)
    swap_inner(cache, faulty.inner)
    assert served_hit["hit"] == len(A + B) and served.aborted
    stats = cache.linker.statistics()
    objects = len(A + B) + 1  # KV pages and the state
    # every object was tried 1 + load_retries times, then given up on: bounded
    assert stats.store_exhausted_keys - before.store_exhausted_keys == objects
    assert stats.store_retried_keys - before.store_retried_keys == 2 * objects
    assert stats.loads_failed == 1
    assert_clean(cache)


@pytest.mark.parametrize("core", CORES)
def test_offload_failure_then_retry_on_the_next_hit(caches: list[SGLangCache], core: str) -> None:
    cache = build_swappable(caches, core)
    faulty = _wrap_store(cache, FaultPlan(fail=1.0))
    cache.serve(A + B)
    assert cache.linker.statistics().offloads_failed >= 1
    assert faulty.statistics().failed_keys >= 1  # failed by the injected faults, nothing else
    swap_inner(cache, faulty.inner)
    # the node was not marked stored: the next request that hits it offloads it again
    hit = cache.serve(A + B + C)
    assert hit.device_hit == len(A + B)
    assert cache.linker.statistics().offloads_ok >= 1
    cache.flush()
    restored_ok(cache.serve(A + B + C + [1, 2]), len(A + B + C))
    assert_clean(cache)


def test_reset_with_transfers_in_flight(caches: list[SGLangCache]) -> None:
    # one stage: SGLang's offloads stay pending until the store answers (two stages: test_two_stage_sglang.py)
    cache = build_swappable(caches, two_stage_offload=False)
    gated = GatedStore(store(cache).inner, hold_puts=True)  # writes wait at the gate
    swap_inner(cache, gated)
    cache.serve(A + B, settle=False)  # its offloads are still in the store
    cache.serve(list(range(50, 80)), settle=False)
    assert cache.cache.linker.pending_offloads  # no write can finish before the gate opens

    async def open_gate_soon() -> None:
        await anyio.sleep(0.3)
        gated.open()

    cache.linker.data.call_store(open_gate_soon)  # not awaited: the writes are in flight during the flush
    cache.flush()  # SGLang's flush: the linker quiesces, pending offloads are released
    assert not cache.cache.linker.pending_offloads
    assert cache.linker.num_completed_offloads() == 0
    assert gated.calls["put"] >= 1 and gated.held == 0
    swap_inner(cache, gated.inner)
    restored_ok(cache.serve(A + B + C), len(A + B))
    assert_clean(cache)


def test_cancel_before_start(caches: list[SGLangCache]) -> None:
    cache = build(caches)
    cache.serve(A + B)
    cache.flush()
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer

    keys = page_keys(A + B)
    rows = cache.allocator.alloc(len(keys))
    slot = cache.req_to_token_pool.mamba_allocator.alloc(1)
    transfers = [PoolTransfer(name=pool_name("kv"), keys=keys, device_indices=rows.to(torch.int64)),
                 PoolTransfer(name=pool_name("mamba"), keys=keys[-1:], device_indices=slot,
                              hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    before = cache.kv_buffers[0][0][rows].clone()
    assert cache.linker.load("r1", transfers)
    assert cache.linker.cancel_queued_load("r1")
    assert not cache.linker.cancel_queued_load("r1")
    assert cache.linker.start_layer_wise_loading() == -1  # nothing left to start
    assert torch.equal(cache.kv_buffers[0][0][rows].view(torch.uint8), before.view(torch.uint8))
    # a started load can no longer be cancelled; it lands and reports every layer
    assert cache.linker.load("r2", transfers)
    index = cache.linker.start_layer_wise_loading()
    assert index >= 0 and not cache.linker.cancel_queued_load("r2")
    assert cache.linker.finish_layer_wise_loading(index)
    cache.allocator.free(rows)
    cache.req_to_token_pool.mamba_allocator.free(slot)
    assert_clean(cache)


# ---- Mooncake: a dead master, two ranks ----------------------------------------------------
@pytest.mark.mooncake
@pytest.mark.slow
def test_dead_mooncake_master_no_hang_no_leak(caches: list[SGLangCache], mooncake_master: Any) -> None:
    cache = build(caches, store="mooncake", master=mooncake_master.address, segment_mb=64,
                  store_timeout_s=3.0, lookup_timeout_s=1.0)
    cache.serve(A + B)
    cache.flush()
    restored_ok(cache.serve(A + B + C), len(A + B))
    cache.flush()
    mooncake_master.kill()
    start = time.monotonic()
    served = cache.serve(A + B + C + [9], settle=False)  # lookup fails closed: recompute
    assert not served.aborted and served.loaded == 0
    cache.settle(timeout_s=20)  # the offloads report (False) within the store timeout
    elapsed = time.monotonic() - start
    assert elapsed < 20, elapsed
    assert cache.linker.statistics().offloads_failed >= 1
    assert_clean(cache)
    grace = cache.linker.store.policy.close_grace_s
    t0 = time.monotonic()
    cache.close()
    caches.remove(cache)
    # close's documented bounds: the store's shutdown (close_grace_s + 5), then the client's own
    # close (store_timeout_s + 5); measured 10.2 s on a loaded 2-core host, so no tighter figure
    assert time.monotonic() - t0 < (grace + 5) + (3.0 + 5) + 2


@pytest.mark.mooncake
@pytest.mark.slow
def test_two_ranks_agree(caches: list[SGLangCache], mooncake_master: Any,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    import hylinker.integrations.sglang.linker as plugin_module

    ranks = []
    for rank in (0, 1):
        monkeypatch.setattr(plugin_module, "_tp_rank", lambda params, r=rank: r)
        ranks.append(build(caches, store="mooncake", master=mooncake_master.address, segment_mb=32))
    r0, r1 = (c.linker for c in ranks)
    # MLA latent KV is rank-replicated (one object, written by rank 0); the Mamba state is per rank
    assert r0.object_keys("kv", ["k"]) == r1.object_keys("kv", ["k"])
    assert r0.object_keys("mamba", ["k"]) != r1.object_keys("mamba", ["k"])
    for cache in ranks:
        cache.serve(A + B)
        cache.flush()
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer

    keys = page_keys(A + B + C)
    transfers = [PoolTransfer(name=pool_name("kv"), keys=keys),
                 PoolTransfer(name=pool_name("mamba"), keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert r0.lookup("x", transfers) == r1.lookup("x", transfers) == [len(A + B)]
    assert r1.statistics().objects_offloaded == 1  # its state only
    # rank 1 loses its state: its answer changes, rank 0's does not; SGLang's MIN takes the common set
    state1 = r1.object_keys("mamba", [keys[len(A + B) - 1]])
    r1.data.call_store(r1.store.remove, state1).result(timeout=10)
    assert r0.lookup("x", transfers) == [len(A + B)] and r1.lookup("x", transfers) == []
    for cache in ranks:
        served = cache.serve(A + B + C, settle=True)
        assert served.restore_mismatches == []
    for cache in ranks:
        assert_clean(cache)


@pytest.mark.mooncake
def test_damaged_object_is_gone_before_the_failed_load_reports(caches: list[SGLangCache],
                                                               mooncake_master: Any) -> None:
    # Mooncake removes in a worker thread: the next lookup must not race the removal (it would
    # see the object, load it, find it missing and fail a second request)
    cache = build(caches, store="mooncake", master=mooncake_master.address, segment_mb=64)
    cache.serve(A + B)
    cache.flush()
    key = kv_key(cache, A + B, 5)
    good = cache.stored_bytes(key, frame_bytes(cache, "kv"))
    assert good is not None
    cache.replace_object(key, _flip(good, len(good) - 3))
    assert cache.serve(A + B + C).aborted
    assert call(cache, store(cache).exists, [key]) == [False]
    after = cache.serve(A + B + C + [5])
    assert not after.aborted and after.loaded < len(A + B)
    assert_clean(cache)


def test_faults_key_wraps_the_store(caches: list[SGLangCache]) -> None:
    # linker_extra_config["faults"]: every key fails -> offloads report False, lookups miss,
    # requests recompute; nothing leaks
    cache = build(caches, faults="fail=1.0", fault_seed=3)
    assert isinstance(store(cache).inner, FaultyStore)
    cache.serve(A + B)
    cache.flush()
    again = cache.serve(A + B + C)
    assert again.loaded == 0 and not again.aborted
    stats = cache.linker.statistics()
    assert stats.offloads_failed == 2 and stats.offloads_ok == 0
    assert store(cache).inner.statistics().failed_keys > 0
    assert_clean(cache)
