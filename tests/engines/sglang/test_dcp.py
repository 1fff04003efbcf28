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

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.tests.support.sglang_ranks import DCP_A as A
from hylinker.tests.support.sglang_ranks import DCP_GROUPS as GROUPS
from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache, page_keys

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
C = list(range(3000, 3010))


def dcp_ranks(caches: list[SGLangCache], monkeypatch: pytest.MonkeyPatch, dcp: int, group: str,
              core: str = "python", **extra: Any) -> list[SGLangCache]:
    """One SGLang cache per DCP rank; TP rank r is DCP rank r (tp = dcp, SGLang's placement)."""
    import hylinker.integrations.sglang.linker as plugin_module

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
        assert stats.objects_offloaded == pages + state_objects
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
        assert stats.loads_ok == 1 and stats.verify_failures == 0
        assert stats.objects_loaded == pages + (0 if group == "dense-mha" else 1)
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
    assert cache.linker.statistics().loads_refused == 2
    assert cache.linker.start_layer_wise_loading() == -1  # nothing queued
    assert_clean(cache)


def test_draft_kv_with_dcp_is_refused_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    # SGLang keeps a draft's KV unsharded under DCP (the draft reads every token); the plugin does
    # not serve that pairing and stops at construction, naming it
    from hylinker.integrations.sglang.pools import PoolLayoutError

    spec = CacheSpec(page_size=2, dcp_size=2, dcp_rank=0, num_layers=2, kv_pages=64, model="dense", kv="mha",
                     draft_layers=1)
    with pytest.raises(PoolLayoutError, match="draft KV with DCP 2"):
        SGLangCache(spec, {**PLUGIN, "linker_extra_config": {}})


def test_swa_with_dcp_is_refused_at_startup(caches: list[SGLangCache]) -> None:
    # SGLang 0.5.23 does not shard a sliding-window model's KV by DCP rank: its SWA allocator is
    # built unwidened under DCP (kv_cache_configurator: "SWA allocators never widen under DCP"),
    # so the tree page is the pool's page and every rank's locs name every token; its DCP
    # attention backends refuse sliding-window layers. The plugin stops at construction, naming it
    from hylinker.integrations.sglang.pools import PoolLayoutError

    spec = CacheSpec(model="swa_mamba", kv="mha", page_size=1, dcp_size=2, dcp_rank=1, kv_pages=64)
    bare = SGLangCache(spec, None)  # SGLang's own cache under DCP 2, no linker: it builds
    caches.append(bare)
    assert bare.params.page_size == bare.allocator.page_size == 1  # not page_size x dcp_size
    locs = bare.allocator.alloc(4)
    assert locs is not None and int(locs.max()) < spec.kv_pages  # no widened loc space
    # SGLang's own direct linker has no DCP check for this group: it resolves it as without DCP
    from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
        resolve_hybrid_device_pool_group,
    )

    bare.publish_dcp()
    group = resolve_hybrid_device_pool_group(kvcache=bare.kvcache, page_size=1, params=bare.params,
                                             components=set(bare.cache.components))
    assert {str(e.name.value) for e in group.entries} == {"kv", "swa", "mamba"} and group.page_size == 1
    with pytest.raises(PoolLayoutError, match=r"FULL \+ SWA with DCP 2 is not supported: SGLang does not shard"):
        SGLangCache(spec, {**PLUGIN, "linker_extra_config": {}})


@pytest.fixture
def published_dcp() -> Iterator[Callable[[int, int], None]]:
    """Publish a DCP size and rank in SGLang's process-wide ``get_parallel()``; DCP off after."""
    from sglang.srt.runtime_context import get_parallel

    def publish(size: int, rank: int) -> None:
        get_parallel().override_permanently(attn_dcp_size=size, dcp_size=size, dcp_enabled=size > 1,
                                            attn_dcp_rank=rank, dcp_rank=rank)

    yield publish
    publish(1, 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_sglangs_unified_mamba_allocator_under_dcp_is_refused(published_dcp: Callable[[int, int], None],
                                                              rank: int) -> None:
    # SGLang's unified memory pool (--enable-unified-memory) for FULL (MLA) + MAMBA under DCP 2,
    # built on CPU by SGLang's own init_unified_mamba_pools. Its allocator hands out widened
    # *virtual* locs; a reader collapses them (maybe_dcp_kernel_indices, what the plugin's
    # DcpShare does) and then translates through the pool's page table (host_transfer_translate)
    # to the physical rows the forward writes. The plugin's rows stop at the first stage: it
    # refuses the pool at startup rather than move bytes at virtual ids
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.layers.dcp.layout import maybe_dcp_kernel_indices
    from sglang.srt.mem_cache.allocator.unified_mamba import UnifiedMambaTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_memory_pool import init_unified_mamba_pools
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from hylinker.integrations.sglang.linker import HylinkerLinker
    from hylinker.integrations.sglang.pools import DcpShare, PoolLayoutError

    server_args = ServerArgs(model_path="dummy", page_size=2)
    set_global_server_args_for_scheduler(server_args)
    published_dcp(2, rank)
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2, head_dim=8,
                                        state_size=8, conv_kernel=4)
        state_params = Mamba2CacheParams(shape=shape, layers=[0, 1])
    bundle = init_unified_mamba_pools(
        device="cpu", kv_cache_dtype=torch.bfloat16, head_num=1, head_dim=40, page_size=2, start_layer=0,
        end_layer=3, is_draft_worker=False, use_mla_backend=True, kv_lora_rank=32, qk_rope_head_dim=8,
        mamba_layer_ids=[0, 1], full_attention_layer_ids=[2], mamba2_cache_params=state_params,
        model_context_len=1024, extra_max_context_len=0, max_total_num_tokens=1024, max_mamba_cache_size=16,
        max_num_reqs=4, enable_memory_saver=False, enable_mamba_extra_buffer=True,
        enable_mamba_extra_buffer_lazy=False, speculative_num_draft_tokens=3, disable_overlap_schedule=True,
        need_sort=False)
    allocator = bundle.token_to_kv_pool_allocator
    assert isinstance(allocator, UnifiedMambaTokenToKVPoolAllocator)
    assert allocator.page_size == 4  # page_size x dcp_size, like the static DCP allocator
    full = bundle.token_to_kv_pool.full_kv_pool
    locs = allocator.alloc(8)  # two widened pages
    assert locs is not None and locs.numel() == 8
    # the plugin's rows of these locs are SGLang's first stage (collapsed, still virtual) ...
    share = DcpShare(2, rank, 2, maybe_dcp_kernel_indices)
    virtual = share.rows(locs)
    assert torch.equal(virtual, maybe_dcp_kernel_indices(locs, 2, rank).to(torch.int64))
    # ... and the rows the forward writes are the second stage, elsewhere in the pool's buffer
    physical = full.host_transfer_translate(virtual).to(torch.int64)
    assert not torch.equal(physical, virtual)
    assert bool((physical > 0).all()) and int(physical.max()) < full.kv_buffer[0].shape[0]
    # widened ids translated without the collapse land on the sink row 0: the order matters
    assert set(full.host_transfer_translate(locs.to(torch.int64)).tolist()) == {0}
    # the Mamba slots are virtual too (the state pool has its own translate)
    assert bundle.req_to_token_pool.mamba_pool.host_transfer_translate is not None
    params = CacheInitParams(req_to_token_pool=bundle.req_to_token_pool, token_to_kv_pool_allocator=allocator,
                             page_size=4, disable=False,
                             tree_components=(ComponentType.FULL, ComponentType.MAMBA))
    with pytest.raises(PoolLayoutError, match="unified memory pool"):
        HylinkerLinker(server_args, params, components={ComponentType.FULL, ComponentType.MAMBA},
                       extra_config={})
