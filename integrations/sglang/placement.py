"""Which of SGLang's pools this rank serves and how: discovery from SGLang's cache components
(refused by name where the layout is one the plugin does not serve), the per-rank key suffix, the
writer rule for replicated pools, and the DCP placement of FULL. Imports SGLang only inside the
DCP functions."""

from __future__ import annotations

from typing import Any

import torch

from ...components.keys import sglang_key_suffix
from ...components.layout import PoolKind
from ...components.ranks import rank_term, replicated_writes
from .pools import (
    DcpShare,
    PoolLayoutError,
    SGLangPool,
    draft_pool,
    full_pool,
    mamba_pool,
    swa_pool,
)


def engine_pools(params: Any, components: Any, page_size: int) -> tuple[dict[PoolKind, SGLangPool], tuple[int, int]]:
    """SGLang's device pools this rank serves, as pool views (refused with a clear error where
    the layout is one the plugin does not serve), and this rank's DCP ``(size, rank)``."""
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    names = {getattr(c, "name", str(c)) for c in components}
    unsupported = names - {"FULL", "SWA", "MAMBA"}
    if unsupported or "FULL" not in names:
        raise PoolLayoutError(
            f"HylinkerLinker serves FULL with SWA and/or MAMBA components, not {sorted(names)}")
    packed = tuple(getattr(params, "mtp_draft_device_pools", None) or ())
    sidecar = tuple(getattr(params, "sidecar_draft_device_pools", None) or ())
    if packed and sidecar:
        raise PoolLayoutError("both packed MTP and sidecar draft KV pools: SGLang builds one or the other")
    if getattr(params, "mtp_draft_mamba_pools", None):
        raise PoolLayoutError("packed MTP draft Mamba states (a state pool per draft layer) are not supported yet")
    pools: dict[PoolKind, SGLangPool] = {PoolKind.FULL: full_pool(kvcache)}
    if "SWA" in names:
        pools[PoolKind.SWA] = swa_pool(kvcache)
    if "MAMBA" in names:
        pools[PoolKind.MAMBA] = mamba_pool(params.req_to_token_pool,
                                           int(getattr(kvcache, "start_layer", 0) or 0))
    dcp_size, dcp_rank = dcp_placement()
    if dcp_size > 1 and (packed or sidecar):  # SGLang keeps a draft's KV unsharded under DCP
        raise PoolLayoutError(f"draft KV with DCP {dcp_size} is not supported yet")
    draft = draft_pool(packed or sidecar, page_size)
    if draft is not None:
        pools[PoolKind.DRAFT] = draft
    if dcp_size > 1:
        pools[PoolKind.FULL] = dcp_full(pools, page_size, dcp_size, dcp_rank)
    return pools, (dcp_size, dcp_rank)


def key_suffix(kind: PoolKind, pool: SGLangPool, ns: str, tp_rank: int, dcp_rank: int, cp_rank: int,
                pp_rank: int) -> str:
    """What this rank appends to a page key for ``pool``'s objects: the namespace, the pool,
    and the ranks whose rows differ (a replicated pool's objects are the same on every TP rank)."""
    term = rank_term(tp_rank, replicated=pool.replicated, dcp_rank=dcp_rank if pool.dcp is not None else None)
    return sglang_key_suffix(ns, kind, term, cp_rank, pp_rank)


def writes(pool: SGLangPool, tp_rank: int, dcp_size: int) -> bool:
    """Whether this rank offloads ``pool``: a per-rank pool always; a replicated pool TP rank 0
    only, or under DCP (the latent sharded by token) the first DCP group, one writer per DCP
    rank (SGLang's HiCache rule: tp_rank == dcp_rank)."""
    return replicated_writes(tp_rank, replicated=pool.replicated, dcp_size=dcp_size, folded=pool.dcp is not None)


def dcp_placement() -> tuple[int, int]:
    """SGLang's attention DCP size and this process's DCP rank (``get_parallel()``)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        size = int(parallel.attn_dcp_size)
    except (RuntimeError, ValueError):  # nothing published (a bare cache): no DCP
        return 1, 0
    return size, (int(parallel.attn_dcp_rank) if size > 1 else 0)


def dcp_full(pools: dict[PoolKind, SGLangPool], tree_page: int, size: int, rank: int) -> SGLangPool:
    """FULL under DCP: SGLang's widened locs collapse to this rank's rows (its own
    ``maybe_dcp_kernel_indices``). What the plugin does not serve with DCP is refused by name."""
    from sglang.srt.layers.dcp.layout import maybe_dcp_kernel_indices

    if PoolKind.SWA in pools:
        # SGLang 0.5.23 builds a sliding-window model's allocator unwidened under DCP (its locs
        # are not sharded by token, the tree page is not page x dcp) and its DCP attention
        # backends refuse sliding-window layers: there is no sharded layout to serve
        raise PoolLayoutError(f"FULL + SWA with DCP {size} is not supported: SGLang does not shard a "
                              "sliding-window model's KV locs by DCP rank (its SWA allocator is not widened)")
    full = pools[PoolKind.FULL]
    page = full.view.unit
    if tree_page != page * size:
        raise PoolLayoutError(
            f"DCP {size}: the tree page is {tree_page} tokens, not the KV pool's page {page} x {size}")
    return SGLangPool(full.view, full.replicated, DcpShare(size, rank, page, maybe_dcp_kernel_indices))


def tp_rank(params: Any) -> int:
    """This rank's index in SGLang's attention TP cache group (0 outside ``torch.distributed``)."""
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank(group=group))
    return 0


__all__ = ["dcp_full", "dcp_placement", "engine_pools", "key_suffix", "tp_rank", "writes"]
