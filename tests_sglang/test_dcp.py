"""Decode-context parallelism (DCP) as SGLang 0.5.23 runs it, inside its real ``UnifiedRadixCache``.

Under DCP SGLang's paged KV allocator hands out pages of ``page_size * dcp_size`` widened locs (the
tree page), and loc ``w`` lives on DCP rank ``w % dcp_size`` at row ``w // dcp_size`` of that
rank's pool (``KVIndexTranslator.translate_dcp_read_ids``). SGLang's own direct linker refuses
DCP for FULL + MAMBA. Here one SGLang cache per DCP rank (TP rank = DCP rank, tp = dcp) runs over
one Mooncake master: each rank offloads only the rows it holds, under keys of its own DCP rank,
and after a flush each restores its rows byte for byte, the harness checking them at the rows
SGLang's translator names.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.testing.sglang_cache import CacheSpec, SGLangCache, page_keys

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
A = list(range(1000, 1064))  # 64 tokens: one Mamba checkpoint (SGLang's grid is 64 here)
C = list(range(3000, 3010))
GROUPS: dict[str, dict[str, Any]] = {  # name -> CacheSpec fields
    "dense-mha": {"model": "dense", "kv": "mha"},
    "full-mamba-mla": {"model": "hybrid", "kv": "mla", "mamba_extra_buffer": True},
}


def dcp_ranks(caches: list[SGLangCache], monkeypatch: pytest.MonkeyPatch, dcp: int, group: str,
              core: str = "python", **extra: Any) -> list[SGLangCache]:
    """One SGLang cache per DCP rank; TP rank r is DCP rank r (tp = dcp, SGLang's placement)."""
    import hylinker.integrations.sglang as plugin_module

    ranks = []
    for rank in range(dcp):
        monkeypatch.setattr(plugin_module, "_tp_rank", lambda params, r=rank: r)
        spec = CacheSpec(page_size=2, dcp_size=dcp, dcp_rank=rank, num_layers=3, kv_pages=512,
                         tree_core=core, **GROUPS[group])
        cache = SGLangCache(spec, {**PLUGIN, "linker_extra_config": extra})
        caches.append(cache)
        ranks.append(cache)
    return ranks


def assert_clean(cache: SGLangCache) -> None:
    cache.settle()
    cache.evict_all()
    assert cache.leaks() == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}


def store_exists(cache: SGLangCache, keys: list[str]) -> list[bool]:
    linker = cache.linker
    return list(linker.data.call_store(linker.store.exists, keys).result(timeout=10))


@pytest.mark.mooncake
# each DCP size, group and tree core at least once (the full 2 x 2 x 2 matrix took 5 min here)
@pytest.mark.parametrize(("dcp", "group", "core"), [
    (2, "dense-mha", "python"), (4, "dense-mha", "rust"),
    (2, "full-mamba-mla", "rust"), (4, "full-mamba-mla", "python")])
def test_dcp_ranks_restore_their_own_rows_byte_exact(caches: list[SGLangCache], mooncake_master: Any,
                                                     monkeypatch: pytest.MonkeyPatch, dcp: int, group: str,
                                                     core: str) -> None:
    ranks = dcp_ranks(caches, monkeypatch, dcp, group, core, store="mooncake",
                      master=mooncake_master.address, segment_mb=16)
    W = ranks[0].tree_page
    assert ranks[0].tree_page == 2 * dcp
    assert ranks[0].params.page_size == W and ranks[0].allocator.page_size == W
    pages = len(A) // W
    for cache in ranks:
        first = cache.serve(A)
        assert first.store_hit == 0 and not first.aborted
    keys = page_keys(A, W)
    kv_keys = [cache.linker.object_keys("kv", keys) for cache in ranks]
    # keys per DCP rank: the same page keys, one DCP term each, every rank's objects stored
    assert all(k.endswith(f"dcp{r}cp0pp0") for r, ks in enumerate(kv_keys) for k in ks)
    assert len({k for ks in kv_keys for k in ks}) == dcp * pages
    for cache, ks in zip(ranks, kv_keys):
        assert store_exists(cache, ks) == [True] * pages
    # one object of page_size rows per tree page per rank (this rank's rows, not the widened page)
    view = ranks[0].linker.pools[next(iter(ranks[0].linker.pools))]
    assert view.unit == 2 and view.kind is PoolKind.FULL
    for cache in ranks:
        stats = cache.linker.statistics()
        state_objects = 0 if group == "dense-mha" else 1
        assert stats["objects_offloaded"] == pages + state_objects
    # the ranks hold different tokens of the same page: their objects differ
    frame = ranks[0].linker.data.plane.pools[PoolKind.FULL].payload_bytes + 4096
    stored = {ranks[r].stored_bytes(kv_keys[r][0], frame) for r in range(dcp)}
    assert None not in stored and len(stored) == dcp
    for cache in ranks:
        cache.flush()
    for rank, cache in enumerate(ranks):
        again = cache.serve(A + C)
        assert again.device_hit == 0 and again.loaded == len(A), (rank, again)
        assert not again.aborted and again.restore_mismatches == [], (rank, again)
        stats = cache.linker.statistics()
        assert stats["loads_ok"] == 1 and stats.get("verify_failures", 0) == 0
        assert stats["objects_loaded"] == pages + (0 if group == "dense-mha" else 1)
    for cache in ranks:
        assert_clean(cache)


def test_sglang_direct_linker_refuses_dcp_for_full_mamba(caches: list[SGLangCache],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
        resolve_hybrid_device_pool_group,
    )

    cache = dcp_ranks(caches, monkeypatch, 2, "full-mamba-mla")[0]
    cache.publish_dcp()
    with pytest.raises(ValueError, match="without DCP"):
        resolve_hybrid_device_pool_group(kvcache=cache.kvcache, page_size=cache.tree_page, params=cache.params,
                                         components=set(cache.cache.components))
    # ours serves the same group on the same pools (restore: the test above)
    assert cache.linker.dcp_size == 2 and cache.linker.dcp_rank == 0


@pytest.mark.parametrize("dcp", [2, 4])
def test_plugin_rows_are_sglangs_dcp_translation(caches: list[SGLangCache], monkeypatch: pytest.MonkeyPatch,
                                                 dcp: int) -> None:
    # every rank's rows of a widened page, as the plugin computes them, are exactly the rows
    # SGLang's KVIndexTranslator names for the locs that rank owns; together the ranks hold each
    # loc once
    ranks = dcp_ranks(caches, monkeypatch, dcp, "dense-mha")
    W = ranks[0].tree_page
    locs = torch.cat([torch.arange(5 * W, 6 * W), torch.arange(9 * W, 10 * W)])
    owned = torch.zeros(locs.numel(), dtype=torch.int64)
    for cache in ranks:
        cache.publish_dcp()
        mine, rows = cache.own_rows(locs)
        owned += mine.to(torch.int64)
        assert torch.equal(cache.linker.rows("kv", locs), rows)
        assert rows.tolist() == list(range(10, 12)) + list(range(18, 20))  # page p -> rows of page p
    assert owned.tolist() == [1] * locs.numel()


def test_misaligned_dcp_locs_refuse_the_load(caches: list[SGLangCache], monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    cache = dcp_ranks(caches, monkeypatch, 2, "dense-mha")[0]
    cache.serve(A)
    cache.flush()
    W = cache.tree_page
    keys = page_keys(A, W)[:2]
    for locs in (torch.arange(W + 1, 3 * W + 1), torch.arange(W, 2 * W + 2)):  # shifted; not whole pages
        transfer = PoolTransfer(name=PoolName.KV, keys=keys, device_indices=locs)
        assert cache.linker.load("bad", [transfer]) is False
    assert cache.linker.statistics()["loads_refused"] == 2
    assert cache.linker.start_layer_wise_loading() == -1  # nothing queued
    assert_clean(cache)


def test_draft_kv_with_dcp_is_refused_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    # SGLang keeps a draft's KV unsharded under DCP (the draft reads every token); the plugin does
    # not serve that pairing and stops at construction, naming it
    from hylinker.integrations.sglang_pools import PoolLayoutError

    spec = CacheSpec(page_size=2, dcp_size=2, dcp_rank=0, num_layers=2, kv_pages=64, model="dense", kv="mha",
                     draft_layers=1)
    with pytest.raises(PoolLayoutError, match="draft KV with DCP 2"):
        SGLangCache(spec, {**PLUGIN, "linker_extra_config": {}})
