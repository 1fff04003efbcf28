"""The pool groups SGLang 0.5.23 builds, each against its own direct linker and against ours.

Each row of the matrix in ``docs/design/sglang.md`` ("SGLang pool groups") is a test here: what SGLang's
own pool-group resolver (the one ``MooncakeDirectLinker`` and ``UMBPDirectLinker`` call) does
with SGLang's real pools, and what ``HylinkerLinker`` does inside SGLang's real
``UnifiedRadixCache`` (both tree cores), restores compared byte for byte with a recompute.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache, page_keys

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
CORES = ["python", "rust"]
A = list(range(1000, 1040))  # 40 tokens
B = list(range(2000, 2024))
C = list(range(3000, 3010))


def build(made: list[SGLangCache], spec: CacheSpec, **extra: Any) -> SGLangCache:
    cache = SGLangCache(spec, {**PLUGIN, "linker_extra_config": extra})
    made.append(cache)
    return cache


def sglang_direct_group(cache: SGLangCache) -> Any:
    """SGLang's own direct-linker pool group for this cache's pools (raises where it refuses)."""
    from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
        resolve_hybrid_device_pool_group,
    )

    return resolve_hybrid_device_pool_group(
        kvcache=cache.kvcache, page_size=cache.spec.page_size, params=cache.params,
        components=set(cache.cache.components))


def assert_clean(cache: SGLangCache) -> None:
    cache.settle()
    cache.evict_all()
    assert cache.leaks() == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}


# ---- dense FULL (MHA, MLA): SGLang's linker refuses it, ours serves it ----------------------
@pytest.mark.parametrize("kv", ["mha", "mla"])
def test_sglang_direct_linker_refuses_dense_models(caches: list[SGLangCache], kv: str) -> None:
    cache = build(caches, CacheSpec(model="dense", kv=kv, page_size=4))
    with pytest.raises(ValueError, match="does not support the direct external linker"):
        sglang_direct_group(cache)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("kv", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_dense_restore_is_byte_exact(caches: list[SGLangCache], core: str, kv: str, page_size: int) -> None:
    spec = CacheSpec(model="dense", kv=kv, page_size=page_size, tree_core=core, num_layers=3)
    cache = build(caches, spec)
    assert {c.name for c in cache.cache.components} == {"FULL"}
    view = cache.linker.pools[next(iter(cache.linker.pools))]
    assert list(view.layer_ids) == [0, 1, 2]  # every layer of the dense pool
    first = cache.serve(A + B)
    assert first.store_hit == 0 and not first.aborted
    cache.flush()
    again = cache.serve(A + B + C)
    stored = len(A + B) // page_size * page_size  # whole pages only
    assert again.device_hit == 0
    assert again.loaded == stored, again
    assert not again.aborted and again.restore_mismatches == []
    stats = cache.linker.statistics()
    assert stats.loads_ok == 1 and stats.verify_failures == 0
    assert stats.objects_skipped_restored == stored // page_size  # restored pages not re-offloaded
    assert_clean(cache)


def test_dense_damaged_page_fails_the_load_and_is_removed(caches: list[SGLangCache]) -> None:
    cache = build(caches, CacheSpec(model="dense", kv="mha", page_size=4, num_layers=2))
    cache.serve(A)
    cache.flush()
    pages = page_keys(A, page_size=4)
    key = cache.linker.object_keys("kv", [pages[3]])[0]
    cache.corrupt_object(key, 1 << 16)  # the last payload byte
    failed = cache.serve(A + C)
    assert failed.aborted and failed.restore_mismatches == []  # SGLang aborts it (503), nothing landed
    assert cache.linker.statistics().bad_objects_removed >= 1
    cache.flush()
    retry = cache.serve(A + C)  # the damaged page is gone: the pages below it restore
    assert not retry.aborted and retry.loaded == 3 * 4 and retry.restore_mismatches == []
    assert_clean(cache)


# ---- FULL + MAMBA ---------------------------------------------------------------------------
def test_full_mamba_mla_is_served_by_both_linkers(caches: list[SGLangCache]) -> None:
    cache = build(caches, CacheSpec(model="hybrid", kv="mla", page_size=1))
    group = sglang_direct_group(cache)
    assert {str(getattr(n, "value", n)) for n in group.entry_map} == {"kv", "mamba"}
    cache.serve(A + B)
    cache.flush()
    again = cache.serve(A + B + C)
    assert again.loaded == len(A + B) and not again.aborted and again.restore_mismatches == []
    assert_clean(cache)


def test_full_mamba_mha_is_refused_by_sglang_served_by_ours(caches: list[SGLangCache]) -> None:
    cache = build(caches, CacheSpec(model="hybrid", kv="mha", page_size=1))
    with pytest.raises(Exception, match=r"(?i)mla|support"):
        sglang_direct_group(cache)
    cache.serve(A + B)
    cache.flush()
    again = cache.serve(A + B + C)
    assert again.loaded == len(A + B) and not again.aborted and again.restore_mismatches == []
    assert_clean(cache)


# ---- FULL + SWA + MAMBA -------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("window", [4, 64])
def test_full_swa_mamba_restores_the_window(caches: list[SGLangCache], core: str, window: int) -> None:
    spec = CacheSpec(model="swa_mamba", kv="mha", page_size=1, tree_core=core, sliding_window=window)
    cache = build(caches, spec)
    group = sglang_direct_group(cache)  # SGLang's own linker serves this group too
    assert {str(getattr(n, "value", n)) for n in group.entry_map} == {"kv", "swa", "mamba"}
    cache.serve(A + B)
    cache.flush()
    again = cache.serve(A + B + C)
    assert again.device_hit == 0
    assert again.loaded == len(A + B) and not again.aborted, again
    assert again.restore_mismatches == []  # full KV, the SWA window below the boundary, the state
    stats = cache.linker.statistics()
    assert stats.loads_ok == 1 and stats.verify_failures == 0
    assert_clean(cache)


@pytest.mark.parametrize("window", [4, 64])
def test_a_missing_swa_page_only_matters_inside_the_window(caches: list[SGLangCache], window: int) -> None:
    spec = CacheSpec(model="swa_mamba", kv="mha", page_size=1, sliding_window=window)
    cache = build(caches, spec)
    cache.serve(A)  # a state at len(A)
    cache.serve(A + B)  # and at len(A + B)
    swa_stored = cache.linker.data.pool_statistics()["swa"].objects_offloaded
    assert 0 < swa_stored <= 2 * max(window, 1) + len(A + B)
    cache.flush()
    pages = page_keys(A + B)
    gone = cache.linker.object_keys("swa", [pages[len(A) + 2]])
    assert cache.linker.data.call_store(cache.linker.store.remove, gone).result(timeout=10) == 1
    again = cache.serve(A + B + C)
    # the stop at len(A+B) needs SWA pages [len(A+B) - window, len(A+B)); with a 64-token window
    # that covers the removed page, so only the stop at len(A) (its own window whole) is left
    expected = len(A) if window > len(B) - 2 else len(A + B)
    assert again.loaded == expected and not again.aborted and again.restore_mismatches == []
    loaded_swa = cache.linker.data.pool_statistics()["swa"].objects_loaded
    assert loaded_swa == min(window, expected)  # only the window below the boundary is read
    assert_clean(cache)


# ---- FULL + MAMBA with SGLang's extra_buffer strategy (paged hybrid trees) -----------------
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("kv", ["mla", "mha"])
def test_full_mamba_extra_buffer_paged_restore(caches: list[SGLangCache], core: str, kv: str) -> None:
    spec = CacheSpec(model="hybrid", kv=kv, page_size=4, tree_core=core, mamba_extra_buffer=True,
                     max_context=1024, kv_pages=1024)
    cache = build(caches, spec)
    prompt = list(range(7000, 7000 + 150))  # the tracked state sits at 128 (grid 64), pages to 148
    cache.serve(prompt)
    cache.flush()
    again = cache.serve(prompt + C)
    assert again.device_hit == 0
    assert again.loaded == 128 and not again.aborted, again  # the deepest state boundary
    assert again.restore_mismatches == []
    assert_clean(cache)


# ---- SGLang's unified memory pool ---------------------------------------------------------
def test_unified_memory_pool_is_refused_by_name(caches: list[SGLangCache]) -> None:
    # --enable-unified-memory puts KV rows behind a virtual-to-physical page table: SGLang's
    # unified allocators set the full pool's host_transfer_translate (SGLang's own
    # translate_token_ids over their v2p table). The plugin's rows would be virtual ids, so it
    # refuses the pool at startup instead of restoring into the wrong rows.
    import functools

    from sglang.kernels.ops.memory.virtual_slot import translate_token_ids

    from hylinker.integrations.sglang.pools import PoolLayoutError, full_pool

    cache = SGLangCache(CacheSpec(model="dense", kv="mha", page_size=4, num_layers=2), None)
    caches.append(cache)
    assert full_pool(cache.kvcache).view.unit == 4  # a static pool is served
    v2p = torch.arange(cache.spec.kv_pages, dtype=torch.int64).flip(0)
    cache.kvcache.host_transfer_translate = functools.partial(translate_token_ids, v2p=v2p, page_size=4)
    with pytest.raises(PoolLayoutError, match="unified memory pool"):
        full_pool(cache.kvcache)


# ---- packed MTP/DSPARK draft KV -----------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("kv", ["mla", "mha"])
def test_packed_mtp_draft_kv_is_refused_by_sglang_served_by_ours(caches: list[SGLangCache], core: str,
                                                                 kv: str) -> None:
    # SGLang's NextN MTP with HiCache or a linker packs the draft runners' KV pools
    # (params.mtp_draft_device_pools, one per draft depth, on the target's KV locs); its direct
    # linker refuses them for FULL + MAMBA. Ours restores every draft layer's rows with the KV
    # pages, byte for byte
    spec = CacheSpec(model="hybrid", kv=kv, page_size=1, draft_layers=2, tree_core=core)
    cache = build(caches, spec)
    if kv == "mla":
        with pytest.raises(ValueError, match="packed draft KV"):
            sglang_direct_group(cache)
    assert {str(getattr(n, "value", n)) for n in cache.linker.pools} == {"kv", "mamba", "draft"}
    draft_view = cache.linker.pools[next(n for n in cache.linker.pools if str(getattr(n, "value", n)) == "draft")]
    assert list(draft_view.layer_ids) == [0, 1]  # draft depth d rides counter layer d
    cache.serve(A + B)
    keys = page_keys(A + B)
    draft_keys = cache.linker.object_keys("draft", keys)
    assert draft_keys[0].split(":")[-1].startswith("rep" if kv == "mla" else "tp0")
    cache.flush()
    again = cache.serve(A + B + C)
    assert again.loaded == len(A + B) and not again.aborted and again.restore_mismatches == []
    assert any("draft" in name for name in cache.kv_names)
    # a missing draft page ends the restorable prefix there, as a missing KV page does
    cache.linker.data.call_store(cache.linker.store.remove, [draft_keys[10]]).result(timeout=10)
    cache.flush()
    partial = cache.serve(A + B + C + [7])
    assert not partial.aborted and partial.restore_mismatches == [] and partial.loaded <= 10
    assert_clean(cache)
