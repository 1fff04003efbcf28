"""vLLM's KV-cache configuration read as hylinker's: the group kinds, the geometry the store's
namespace is derived from, and which rank's key each rank reads and writes. Imports vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from .index import CopyRanks, KeyLayout, kv_replicas
from .plan import Groups, window_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def cache_groups(kv_cache_config: KVCacheConfig, block_size: int) -> Groups:
    """vLLM's KV-cache groups as hylinker's: which are full attention, which sliding window
    (with its window in blocks), which recurrent state; any other kind is refused."""
    attention: list[int] = []
    state: list[int] = []
    window: list[tuple[int, int]] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            state.append(gid)
        elif type(spec) is SlidingWindowSpec:
            window.append((gid, window_blocks(spec.sliding_window, block_size)))
        elif type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec") and isinstance(spec, FullAttentionSpec):
            attention.append(gid)
        else:
            raise ValueError(f"HylinkerConnector: KV cache group {gid} is {type(spec).__name__}; "
                             "only full attention (MHA, MLA), sliding-window attention and "
                             "Mamba/linear-attention groups are supported")
    if not attention:
        raise ValueError("HylinkerConnector: the model has no full-attention KV cache group")
    return Groups(tuple(attention), tuple(state), tuple(window))


def cache_geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """What the store's namespace must differ by: block size, dtype, each group's kind, page
    bytes and layer count."""
    specs = [f"{type(g.kv_cache_spec).__name__}:{g.kv_cache_spec.page_size_bytes}:{len(g.layer_names)}"
             for g in kv_cache_config.kv_cache_groups]
    return (f"block={vllm_config.cache_config.block_size};dtype={vllm_config.model_config.dtype};"
            f"groups={','.join(specs)}")


def key_layout(vllm_config: VllmConfig, ranks: int, shared_store: bool) -> KeyLayout:
    """Whose key each rank reads and writes. In a store every rank reaches, attention pages vLLM
    replicates over ranks are written once (:func:`~hylinker.integrations.vllm.index.kv_replicas`);
    a store inside each worker keeps a copy per rank (no rank can read another's)."""
    if not shared_store or ranks == 1:
        return KeyLayout.per_rank(ranks)
    model = vllm_config.model_config
    replicas = kv_replicas(model.get_total_num_kv_heads(), ranks, latent=bool(model.use_mla))
    return KeyLayout(CopyRanks(ranks, replicas), CopyRanks(ranks))


__all__ = ["cache_geometry", "cache_groups", "key_layout"]
