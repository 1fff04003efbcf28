"""SGLang's device pools as the data plane's pool views (``components/pool_view.py``).

The plugin borrows SGLang's tensors; it never allocates pool memory. Each builder reads the
attributes it needs from SGLang's pool objects (checked against ``sglang==0.5.23``) and returns
a :class:`~hylinker.components.pool_view.PoolView` whose layer ids are the indices SGLang's
``LayerWiseLoadCounter`` uses (global layer id minus the stage's first layer):

* FULL, MLA: the latent buffer ``kv_buffer[i]`` per layer (identical on every TP rank:
  rank-replicated, written by rank 0 only);
* FULL, MHA: ``k_buffer[i]`` and ``v_buffer[i]`` (per rank);
* FULL of a dense model: SGLang's plain MHA or MLA pool itself, every layer of the stage;
* MAMBA: the stacked ``conv[j][L, slot, ...]`` and ``temporal[L, slot, ...]`` of the Mamba
  cache, one slot per object (per rank);
* SWA: the sliding-window layers' ``k_buffer[i]``/``v_buffer[i]`` of an ``SWAKVPool``, on SWA rows
  (per rank);
* DRAFT: a sidecar draft pool or SGLang's packed MTP/DSPARK draft pools (MHA ``k_buffer[d]``/
  ``v_buffer[d]`` per rank, or MLA ``kv_buffer[d]``, rank-replicated) on the same KV rows.

What the plugin does not support yet is refused here with a :class:`PoolLayoutError` naming
it (scaled KV, non-row-major KV layouts, DSA, int8 Mamba checkpoints, Mamba side states, SGLang's
unified memory pool).
This module imports no SGLang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from ...components.layout import PoolKind
from ...components.pool_view import PoolView, PoolViewError, kv_view, state_view


class PoolLayoutError(PoolViewError):
    """SGLang's pools have a shape the plugin does not support (the message says which)."""


#: SGLang's ``(widened locs, dcp_size, dcp_rank) -> this rank's rows``
#: (``sglang.srt.layers.dcp.layout.maybe_dcp_kernel_indices``)
DcpCollapse = Callable[[torch.Tensor, int, int], torch.Tensor]


@attrs.frozen
class DcpShare:
    """This decode-context-parallel rank's rows of SGLang's DCP-widened KV locs.

    Under DCP SGLang's KV allocator pages are ``page_size * size`` locs wide (the tree page) and a
    loc ``w`` lives on rank ``w % size`` at row ``w // size`` of that rank's pool, so a widened
    page collapses to ``page_size`` rows on every rank. ``collapse`` is SGLang's own function
    for that (the one its host pools use). SGLang's static pools only: a unified memory pool
    (rows behind a page table) is refused by :func:`full_pool`. Locs that are not whole, aligned widened pages
    raise :class:`PoolLayoutError` (the same on every rank: a refused load).
    """

    size: int
    rank: int
    page_size: int  # rows of one page in this rank's pool (SGLang's physical page)
    collapse: DcpCollapse

    @property
    def widened(self) -> int:
        return self.page_size * self.size

    def rows(self, locs: torch.Tensor) -> torch.Tensor:
        flat = locs.detach().reshape(-1).to("cpu", torch.int64)
        w = self.widened
        if flat.numel() % w:
            raise PoolLayoutError(f"DCP {self.size}: {flat.numel()} KV locs are not whole widened pages of {w}")
        if flat.numel():
            pages = flat.view(-1, w)
            if bool((pages[:, 0] % w).any()) or not torch.equal(pages, pages[:, :1] + torch.arange(w)):
                raise PoolLayoutError(f"DCP {self.size}: KV locs are not aligned, contiguous widened pages of {w}")
        return self.collapse(flat, self.size, self.rank).reshape(-1).to("cpu", torch.int64)


@attrs.frozen
class SGLangPool:
    """One pool's view, whether every TP rank holds the same bytes (then rank 0 writes) and,
    under DCP, the rule that turns SGLang's widened locs into this rank's rows."""

    view: PoolView
    replicated: bool
    dcp: DcpShare | None = None

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """The view's rows for SGLang's transfer indices."""
        return indices.detach().reshape(-1).to("cpu", torch.int64) if self.dcp is None else self.dcp.rows(indices)


def _by_index(mapping: Mapping[int, int], n: int, start: int, what: str) -> list[int]:
    """Counter layer ids of buffer indices ``0..n-1`` from SGLang's ``{global id: index}``."""
    ids = {int(i): int(g) - start for g, i in mapping.items()}
    if sorted(ids) != list(range(n)):
        raise PoolLayoutError(f"{what}: the layer map covers indices {sorted(ids)}, the pool has {n} layers")
    return [ids[i] for i in range(n)]


def _check_row_layout(pool: Any) -> None:
    """The views index a buffer by KV row: refuse SGLang's other physical layouts and scaled KV."""
    layout = str(getattr(pool, "kv_cache_layout", "nhd") or "nhd")
    if layout != "nhd":
        raise PoolLayoutError(f"KV cache layout {layout!r} is not supported (only the row-major 'nhd' layout)")
    if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "native_k_scale_buffer", None) is not None:
        raise PoolLayoutError("scaled KV caches are not supported yet")


def _kv_pool(pool: Any, start: int, page: int, mapping: Mapping[int, int] | None,
             kind: PoolKind = PoolKind.FULL) -> SGLangPool:
    """One full-attention pool: MHA (``k_buffer``/``v_buffer``, per rank) or plain MLA (one latent
    ``kv_buffer``, the same on every TP rank). ``mapping``: SGLang's global id -> buffer index
    (hybrid pools); without it buffer ``i`` is layer ``start + i`` (a dense model's pool)."""
    _check_row_layout(pool)
    if getattr(pool, "use_dsa", False):
        raise PoolLayoutError("DSA (sparse MLA) pools are not supported yet")
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        buffers: tuple[Any, ...] = (pool.k_buffer, pool.v_buffer)
        replicated = False
    elif hasattr(pool, "kv_buffer"):
        buffers = (pool.kv_buffer,)
        replicated = True  # the MLA latent is the same on every TP rank
    else:
        raise PoolLayoutError(f"unsupported full-attention pool {type(pool).__name__}")
    n = len(buffers[0])
    layer_ids = _by_index(mapping, n, start, kind.value) if mapping is not None else list(range(n))
    return SGLangPool(kv_view(*buffers, layer_ids=layer_ids, page_size=page, kind=kind), replicated=replicated)


def full_pool(kvcache: Any) -> SGLangPool:
    """FULL from SGLang's KV cache object (``token_to_kv_pool_allocator.get_kvcache()``):

    * a ``HybridLinearKVPool`` (FULL + MAMBA models): its ``full_kv_pool``, layers by
      ``full_attention_layer_id_mapping``;
    * an ``SWAKVPool`` (FULL + SWA [+ MAMBA] models): its ``full_kv_pool``, layers by the
      non-sliding entries of ``layers_mapping``;
    * a dense model's plain ``MHATokenToKVPool`` or ``MLATokenToKVPool`` (component FULL alone):
      every layer of the stage, counter layer ``i`` = buffer ``i``.
    """
    if getattr(full_kv_device_pool(kvcache), "host_transfer_translate", None) is not None:
        raise PoolLayoutError("SGLang's unified memory pool (--enable-unified-memory: KV rows behind a "
                              "virtual-to-physical page table) is not supported yet")
    page = int(kvcache.page_size)
    start = int(getattr(kvcache, "start_layer", 0) or 0)
    if hasattr(kvcache, "swa_kv_pool"):
        return _kv_pool(kvcache.full_kv_pool, start, page, _swa_layer_maps(kvcache)[0])
    if hasattr(kvcache, "full_kv_pool"):
        mapping = getattr(kvcache, "full_attention_layer_id_mapping", None)
        if mapping is None:
            raise PoolLayoutError("a hybrid KV pool without full_attention_layer_id_mapping")
        return _kv_pool(kvcache.full_kv_pool, start, page, mapping)
    for other in ("mamba_pool", "indexer_k_buffer"):
        if getattr(kvcache, other, None) is not None:
            raise PoolLayoutError(f"KV cache {type(kvcache).__name__} holds {other}, which is not supported")
    if not hasattr(kvcache, "layer_num"):
        raise PoolLayoutError(f"unsupported KV cache {type(kvcache).__name__}")
    return _kv_pool(kvcache, start, page, None)


def full_kv_device_pool(kvcache: Any) -> Any:
    """SGLang's full-attention pool object inside ``kvcache`` (a hybrid pool's ``full_kv_pool``, a
    dense model's pool itself)."""
    return getattr(kvcache, "full_kv_pool", kvcache)


def _swa_layer_maps(kvcache: Any) -> tuple[dict[int, int], dict[int, int]]:
    """An ``SWAKVPool``'s ``layers_mapping`` (``{global id: (buffer index, is_swa)}``) split into
    the full-attention and the sliding-window ``{global id: buffer index}``."""
    mapping = getattr(kvcache, "layers_mapping", None)
    if not isinstance(mapping, Mapping):
        raise PoolLayoutError(f"{type(kvcache).__name__} has no layers_mapping")
    full = {int(g): int(i) for g, (i, is_swa) in mapping.items() if not is_swa}
    swa = {int(g): int(i) for g, (i, is_swa) in mapping.items() if is_swa}
    return full, swa


def swa_pool(kvcache: Any) -> SGLangPool:
    """SWA from an ``SWAKVPool``: the sliding-window layers' ``k_buffer``/``v_buffer``, indexed by
    SWA row (SGLang allocates those rows apart from the full-attention rows)."""
    pool = getattr(kvcache, "swa_kv_pool", None)
    if pool is None:
        raise PoolLayoutError(f"component SWA needs an SWAKVPool, got {type(kvcache).__name__}")
    start = int(getattr(kvcache, "start_layer", 0) or 0)
    return _kv_pool(pool, start, int(kvcache.page_size), _swa_layer_maps(kvcache)[1], kind=PoolKind.SWA)


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
    """DRAFT from SGLang's draft KV pools, riding the target's KV rows; None without one.

    ``draft_pools`` is either the sidecar draft pool (``sidecar_draft_device_pools``) or the packed
    MTP/DSPARK draft pools (``mtp_draft_device_pools``: each NextN draft runner's own KV pool, one
    per draft depth, on the target's KV locs; SGLang's own linkers pack their rows into the
    target's page objects, draft depth ``d`` riding transfer layer ``d``). Either way draft layer
    ``d`` (every layer of every pool, in order) is counter layer ``d``, on the KV transfer's rows.
    MHA pools (``k_buffer``/``v_buffer``) are per rank; MLA pools (``kv_buffer``) are the same on
    every TP rank, like the target's latent. The pools must all be one kind.
    """
    parts: list[list[Any]] = []
    kinds = set()
    for pool in draft_pools:
        if int(getattr(pool, "page_size", page_size)) != page_size:
            raise PoolLayoutError("draft KV page size must match the tree page size")
        _check_row_layout(pool)
        if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
            kinds.add("mha")
            buffers: tuple[Any, ...] = (pool.k_buffer, pool.v_buffer)
        elif hasattr(pool, "kv_buffer") and not hasattr(pool, "full_kv_pool"):
            kinds.add("mla")
            buffers = (pool.kv_buffer,)
        else:
            raise PoolLayoutError(f"unsupported draft pool {type(pool).__name__}")
        if not parts:
            parts = [[] for _ in buffers]
        for into, layers in zip(parts, buffers):
            into.extend(layers)
    if not parts:
        return None
    if len(kinds) > 1:
        raise PoolLayoutError("draft KV pools mix MHA and MLA")
    layer_ids = list(range(len(parts[0])))
    view = kv_view(parts[0], parts[1] if len(parts) > 1 else None, layer_ids=layer_ids, page_size=page_size,
                   kind=PoolKind.DRAFT)
    return SGLangPool(view, replicated=kinds == {"mla"})


__all__ = ["DcpCollapse", "DcpShare", "PoolLayoutError", "SGLangPool", "draft_pool", "full_kv_device_pool", "full_pool", "mamba_pool", "swa_pool"]
