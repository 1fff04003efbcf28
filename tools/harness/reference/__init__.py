"""Reference hybrid models (transformers) for hylinker's bit-exact restore oracle.

Heavy imports (transformers) happen when a model is built, not at package import.
"""

from __future__ import annotations

from .boundary_pools import (
    BoundaryPools,
    ReferencePools,
    allocate_pools,
    kl_divergence,
    max_abs_diff,
    read_boundary,
    state_nbytes,
    write_boundary,
)
from .engine import (
    BoundaryState,
    CacheGeometry,
    ExtendResult,
    KVRowSpec,
    LinearStateMode,
    LinearStateSpec,
    ReferenceEngine,
    ReferenceSequence,
    cache_geometry,
    chunk_schedule,
    layout_for,
)
from .models import (
    DEFAULT_ARCH,
    RECURRENT_LAYER_KINDS,
    SUPPORTED_ARCHS,
    UnsupportedModelError,
    build_draft_model,
    build_model,
    check_config,
    draft_config,
    recurrent_model_types,
    tiny_config,
)
from .runtime_engine import LinkedEngine, PrefillResult, pool_views

__all__ = [
    "DEFAULT_ARCH",
    "RECURRENT_LAYER_KINDS",
    "SUPPORTED_ARCHS",
    "BoundaryPools",
    "BoundaryState",
    "CacheGeometry",
    "ExtendResult",
    "KVRowSpec",
    "LinearStateMode",
    "LinearStateSpec",
    "LinkedEngine",
    "PrefillResult",
    "ReferenceEngine",
    "ReferencePools",
    "ReferenceSequence",
    "UnsupportedModelError",
    "allocate_pools",
    "build_draft_model",
    "build_model",
    "cache_geometry",
    "check_config",
    "chunk_schedule",
    "draft_config",
    "kl_divergence",
    "layout_for",
    "max_abs_diff",
    "pool_views",
    "read_boundary",
    "recurrent_model_types",
    "state_nbytes",
    "tiny_config",
    "write_boundary",
]
