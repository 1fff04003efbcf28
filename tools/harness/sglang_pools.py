"""SGLang 0.5.23 on a CPU, for the harness's cache (``tools/harness/sglang_cache.py``): the shims
that make it importable, SGLang's own page keys, the geometry of the cache to build
(:class:`CacheSpec`) and SGLang's pools and allocator for it (:func:`build_pools`), built the way
SGLang's scheduler builds them. Imports SGLang only inside functions."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from array import array
from collections.abc import Sequence
from typing import Any

import attrs
import torch

SGLANG_VERSION = "0.5.23"


def install_cpu_shims() -> None:
    """Make SGLang importable on a CPU-only machine.

    The registry's torchvision wheels are CUDA builds that fail to load next to the CPU torch;
    only SGLang's multimodal code imports torchvision, never the cache. A placeholder module
    (registered after transformers has decided torchvision is absent) is enough.
    """
    if "torchvision" in sys.modules:
        return
    try:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except Exception:  # pragma: no cover - transformers missing or changed
        pass

    class _Placeholder(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            sub = _Placeholder(f"{self.__name__}.{name}")
            sub.__spec__ = importlib.machinery.ModuleSpec(sub.__name__, None)
            setattr(self, name, sub)
            return sub

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("torchvision is a placeholder on this CPU-only setup")

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                 "torchvision.io", "torchvision.ops"):
        module = _Placeholder(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        sys.modules[name] = module
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]  # type: ignore[attr-defined]


def page_keys(tokens: Sequence[int], page_size: int = 1, *, extra_key: str | None = None,
              cache_salt: str | None = None) -> list[str]:
    """SGLang's page keys (the chained hashes its tree gives the linker) of ``tokens`` in the
    namespace ``extra_key``/``cache_salt`` (SGLang's own ``get_storage_hash_str``)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    key = RadixKey(array("q", list(tokens)), extra_key=extra_key, cache_salt=cache_salt)
    return list(get_storage_hash_str(key, None, page_size=page_size))


class ServerArgsOverlay:
    """``inner`` (SGLang's read-only ServerArgs) with some attributes answered otherwise."""

    def __init__(self, inner: Any, **values: Any) -> None:
        self._inner, self._values = inner, values

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__["_values"]
        return values[name] if name in values else getattr(self.__dict__["_inner"], name)


@attrs.frozen
class CacheSpec:
    """Geometry of the SGLang cache the harness builds."""

    page_size: int = 1
    kv: str = "mla"  # "mla" (latent, rank-replicated) or "mha" (separate K and V)
    #: "hybrid": FULL + MAMBA (a HybridLinearKVPool over the full layers, a Mamba2 state pool);
    #: "dense": component FULL alone, SGLang's plain MHA/MLA pool over every layer
    #: (``full_layers`` is then ignored); "swa_mamba": FULL + SWA + MAMBA as SGLang's own fixture
    #: builds it (an ``SWAKVPool``, MHA; every non-full layer has sliding-window KV and a Mamba
    #: state; page size 1, which SGLang's Mamba component needs without the extra buffer)
    model: str = "hybrid"
    sliding_window: int = 8  # tokens ("swa_mamba")
    #: SGLang's ``--mamba-radix-cache-strategy extra_buffer`` ("hybrid"): the forward keeps the
    #: state at the last checkpoint boundary in the request's ping-pong track buffer, and the
    #: tree caches that one (page sizes above 1 need it)
    mamba_extra_buffer: bool = False
    enable_metrics: bool = False  # SGLang's --enable-metrics (the plugin then registers its metrics)
    model_path: str = "dummy"  # SGLang's --model-path as the plugin sees it (it fingerprints a local checkpoint)
    #: SGLang's resolved --lora-paths as (name, path): the start-up adapters the plugin digests
    lora_paths: tuple[tuple[str, str], ...] = ()
    #: decode-context parallelism as SGLang runs it: ``get_parallel()`` publishes
    #: ``attn_dcp_size``/``attn_dcp_rank``, the paged allocator's pages (the tree page) are
    #: ``page_size * dcp_size`` widened locs over ``dcp_size`` times the pool's rows, and this
    #: rank's forward writes only the locs it owns (``loc % dcp_size == dcp_rank``) at
    #: ``KVIndexTranslator.translate_dcp_read_ids(loc)`` (``loc // dcp_size``). With
    #: ``model="swa_mamba"`` the allocator stays unwidened, as SGLang builds it under DCP (for
    #: the plugin's refusal; the synthetic forward does not shard it)
    dcp_size: int = 1
    dcp_rank: int = 0
    #: packed MTP draft KV (SGLang's ``mtp_draft_device_pools``): one NextN draft runner's KV pool
    #: per draft depth, one layer each, the target's kind (MLA or MHA), on the target's KV locs
    draft_layers: int = 0
    num_layers: int = 6
    full_layers: tuple[int, ...] = (2, 5)
    kv_pages: int = 2048
    mamba_slots: int = 32
    max_reqs: int = 8
    max_context: int = 1024
    tree_core: str = "python"  # SGLang's tree core: "python" or "rust"
    kv_lora_rank: int = 32  # MLA
    qk_rope_head_dim: int = 8  # MLA
    head_num: int = 2  # MHA
    head_dim: int = 16  # MHA
    mamba_heads: int = 2
    mamba_head_dim: int = 8
    mamba_state: int = 8
    mamba_intermediate: int = 16
    mamba_conv_kernel: int = 4
    mamba_groups: int = 1  # n_groups (Qwen3-Next: linear_num_key_heads)
    mamba_ssm_dtype: str = "bfloat16"  # SGLANG_MAMBA_SSM_DTYPE (real checkpoints: float32)
    dtype: torch.dtype = torch.bfloat16


@attrs.frozen
class SGLangPools:
    """What :func:`build_pools` made: SGLang's request-to-token pool (with the Mamba state pool),
    its KV pool, the tree's components, the draft KV pools and the token allocator."""

    req_to_token_pool: Any
    kvcache: Any
    components: tuple[Any, ...]
    draft_pools: list[Any]
    allocator: Any


def build_pools(spec: CacheSpec, tree_page: int, mamba_layers: list[int], swa_layers: list[int]) -> SGLangPools:
    """SGLang's pools for ``spec`` (on CPU): a dense model's MHA/MLA pool over every layer, or a
    hybrid's ``HybridLinearKVPool`` / ``SWAKVPool`` beside a ``HybridReqToTokenPool`` with a Mamba2
    state pool; packed draft pools; the paged allocator over ``tree_page`` (widened under DCP)."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        HybridReqToTokenPool,
        MHATokenToKVPool,
        MLATokenToKVPool,
        ReqToTokenPool,
    )
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    P, D, W = spec.page_size, spec.dcp_size, tree_page
    dense, swa = spec.model == "dense", spec.model == "swa_mamba"
    size = spec.kv_pages * P
    mla = spec.kv == "mla"
    req_to_token_pool: Any
    kvcache: Any
    if dense:
        req_to_token_pool = ReqToTokenPool(
            size=spec.max_reqs, max_context_len=spec.max_context, device="cpu", enable_memory_saver=False)
        if mla:
            kvcache = MLATokenToKVPool(
                size=size, page_size=P, dtype=spec.dtype, kv_lora_rank=spec.kv_lora_rank,
                qk_rope_head_dim=spec.qk_rope_head_dim, layer_num=spec.num_layers, device="cpu",
                enable_memory_saver=False)
        else:
            kvcache = MHATokenToKVPool(
                size=size, page_size=P, dtype=spec.dtype, head_num=spec.head_num, head_dim=spec.head_dim,
                layer_num=spec.num_layers, device="cpu", enable_memory_saver=False)
        components: tuple[Any, ...] = (ComponentType.FULL,)
    else:
        with envs.SGLANG_MAMBA_SSM_DTYPE.override(spec.mamba_ssm_dtype):
            shape = Mamba2StateShape.create(
                tp_world_size=1, intermediate_size=spec.mamba_intermediate, n_groups=spec.mamba_groups,
                num_heads=spec.mamba_heads, head_dim=spec.mamba_head_dim, state_size=spec.mamba_state,
                conv_kernel=spec.mamba_conv_kernel)
            cache_params = Mamba2CacheParams(shape=shape, layers=mamba_layers)
        req_to_token_pool = HybridReqToTokenPool(
            size=spec.max_reqs, mamba_size=spec.mamba_slots, mamba_spec_state_size=spec.max_reqs,
            max_context_len=spec.max_context, device="cpu", enable_memory_saver=False,
            cache_params=cache_params, mamba_layer_ids=mamba_layers,
            enable_mamba_extra_buffer=spec.mamba_extra_buffer, speculative_num_draft_tokens=3)
        if swa:
            kvcache = SWAKVPool(
                size=size, size_swa=size, page_size=P, dtype=spec.dtype, head_num=spec.head_num,
                head_dim=spec.head_dim, swa_attention_layer_ids=swa_layers,
                full_attention_layer_ids=list(spec.full_layers), device="cpu")
            components = (ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA)
        else:
            kvcache = HybridLinearKVPool(
                size=size, dtype=spec.dtype, page_size=P, head_num=spec.head_num, head_dim=spec.head_dim,
                full_attention_layer_ids=list(spec.full_layers), device="cpu", enable_memory_saver=False,
                mamba_pool=req_to_token_pool.mamba_pool, use_mla=mla,
                kv_lora_rank=spec.kv_lora_rank if mla else None,
                qk_rope_head_dim=spec.qk_rope_head_dim if mla else None)
            components = (ComponentType.FULL, ComponentType.MAMBA)
    draft_pools: list[Any] = []
    for _ in range(spec.draft_layers):
        if mla:
            draft_pools.append(MLATokenToKVPool(
                size=size, page_size=P, dtype=spec.dtype, kv_lora_rank=spec.kv_lora_rank,
                qk_rope_head_dim=spec.qk_rope_head_dim, layer_num=1, device="cpu", enable_memory_saver=False))
        else:
            draft_pools.append(MHATokenToKVPool(
                size=size, page_size=P, dtype=spec.dtype, head_num=spec.head_num, head_dim=spec.head_dim,
                layer_num=1, device="cpu", enable_memory_saver=False))
    allocator: Any
    if D > 1 and not swa:  # SGLang's DCP allocator: widened on both axes (kv_cache_configurator)
        allocator = PagedTokenToKVPoolAllocator(size * D, page_size=W, dtype=spec.dtype, device="cpu",
                                                kvcache=kvcache, need_sort=False)
    elif swa:
        allocator = SWATokenToKVPoolAllocator(size=size, size_swa=size, page_size=P, dtype=spec.dtype,
                                              device="cpu", kvcache=kvcache, need_sort=False)
    else:
        alloc_cls = PagedTokenToKVPoolAllocator if P > 1 else TokenToKVPoolAllocator
        kwargs: dict[str, Any] = {"page_size": P} if P > 1 else {}
        allocator = alloc_cls(size=size, dtype=spec.dtype, device="cpu", kvcache=kvcache,
                              need_sort=False, **kwargs)
    return SGLangPools(req_to_token_pool, kvcache, components, draft_pools, allocator)


__all__ = ["SGLANG_VERSION", "CacheSpec", "SGLangPools", "ServerArgsOverlay", "build_pools", "install_cpu_shims",
           "page_keys"]
