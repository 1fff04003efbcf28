"""SGLang's device pools as the data plane's pool views (``components/pool_view.py``).

The plugin borrows SGLang's tensors; it never allocates pool memory. Each builder reads the
attributes it needs from SGLang's pool objects (checked against ``sglang==0.5.23``) and returns
a :class:`~hylinker.components.pool_view.PoolView` whose layer ids are the indices SGLang's
``LayerWiseLoadCounter`` uses (global layer id minus the stage's first layer):

* FULL, MLA: the latent buffer ``kv_buffer[i]`` per layer (identical on every TP rank:
  rank-replicated, written by rank 0 only);
* FULL, MHA: ``k_buffer[i]`` and ``v_buffer[i]`` (per rank);
* MAMBA: the stacked ``conv[j][L, slot, ...]`` and ``temporal[L, slot, ...]`` of the Mamba
  cache, one slot per object (per rank);
* DRAFT: a sidecar MHA pool's ``k_buffer[d]``/``v_buffer[d]`` on the same KV rows.

What the plugin does not support yet is refused here with a :class:`PoolLayoutError` naming
it (scaled KV, DSA, int8 Mamba checkpoints, Mamba side states, packed MTP draft KV).
This module imports no SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..components.layout import PoolKind
from ..components.pool_view import PoolView, PoolViewError, kv_view, state_view


class PoolLayoutError(PoolViewError):
    """SGLang's pools have a shape the plugin does not support (the message says which)."""


@attrs.frozen
class SGLangPool:
    """One pool's view and whether every TP rank holds the same bytes (then rank 0 writes)."""

    view: PoolView
    replicated: bool


def _by_index(mapping: Mapping[int, int], n: int, start: int, what: str) -> list[int]:
    """Counter layer ids of buffer indices ``0..n-1`` from SGLang's ``{global id: index}``."""
    ids = {int(i): int(g) - start for g, i in mapping.items()}
    if sorted(ids) != list(range(n)):
        raise PoolLayoutError(f"{what}: the layer map covers indices {sorted(ids)}, the pool has {n} layers")
    return [ids[i] for i in range(n)]


def full_pool(kvcache: Any) -> SGLangPool:
    """FULL from a ``HybridLinearKVPool``: plain MLA (``kv_buffer``) or MHA (``k_buffer``/``v_buffer``)."""
    pool = getattr(kvcache, "full_kv_pool", None)
    mapping = getattr(kvcache, "full_attention_layer_id_mapping", None)
    if pool is None or mapping is None:
        raise PoolLayoutError("expected a hybrid KV pool with full_kv_pool and full_attention_layer_id_mapping")
    start = int(getattr(kvcache, "start_layer", 0) or 0)
    page = int(kvcache.page_size)
    if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "native_k_scale_buffer", None) is not None:
        raise PoolLayoutError("scaled KV caches are not supported yet")
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        ids = _by_index(mapping, len(pool.k_buffer), start, "full attention")
        return SGLangPool(kv_view(pool.k_buffer, pool.v_buffer, layer_ids=ids, page_size=page), replicated=False)
    if hasattr(pool, "kv_buffer"):
        if getattr(pool, "use_dsa", False):
            raise PoolLayoutError("DSA (sparse MLA) pools are not supported yet")
        ids = _by_index(mapping, len(pool.kv_buffer), start, "full attention")
        # the MLA latent is the same on every TP rank
        return SGLangPool(kv_view(pool.kv_buffer, layer_ids=ids, page_size=page), replicated=True)
    raise PoolLayoutError(f"unsupported full-attention pool {type(pool).__name__}")


def mamba_pool(req_to_token_pool: Any, start_layer: int = 0) -> SGLangPool:
    """MAMBA from a ``HybridReqToTokenPool``: each ``conv[j]`` and ``temporal`` per slot."""
    if getattr(req_to_token_pool, "mamba_ckpt_pool", None) is not None:
        raise PoolLayoutError("int8 Mamba checkpoints are not supported yet")
    for side in ("short_conv_pool", "ngram_pool"):
        if getattr(getattr(req_to_token_pool, side, None), "enabled", False):
            raise PoolLayoutError(f"Mamba side states ({side}) are not supported yet")
    cache = req_to_token_pool.mamba_pool.mamba_cache
    conv = [c for c in cache.conv if c.numel() > 0]
    temporal = cache.temporal if cache.temporal.numel() > 0 else None
    if not conv:
        raise PoolLayoutError("a Mamba cache without conv states is not supported")
    ids = _by_index(req_to_token_pool.mamba_map, conv[0].shape[0], start_layer, "mamba")
    return SGLangPool(state_view(conv, temporal, layer_ids=ids), replicated=False)


def draft_pool(draft_pools: Sequence[Any], page_size: int) -> SGLangPool | None:
    """DRAFT from SGLang's sidecar draft pools (MHA), riding the KV rows; None without one."""
    k: list[Any] = []
    v: list[Any] = []
    for pool in draft_pools:
        if int(getattr(pool, "page_size", page_size)) != page_size:
            raise PoolLayoutError("draft KV page size must match the tree page size")
        if not (hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer")):
            raise PoolLayoutError(f"unsupported draft pool {type(pool).__name__}")
        k.extend(pool.k_buffer)
        v.extend(pool.v_buffer)
    if not k:
        return None
    view = kv_view(k, v, layer_ids=list(range(len(k))), page_size=page_size, kind=PoolKind.DRAFT)
    return SGLangPool(view, replicated=False)


__all__ = ["PoolLayoutError", "SGLangPool", "draft_pool", "full_pool", "mamba_pool"]
