"""hylinker: off-GPU prefix caching for hybrid models.

The curated public API. Everything here is stable; anything reached through a submodule
path is an implementation detail. ``tests/package/test_public_api.py`` pins this list.
"""

from .components.admission import (
    BranchPoints,
    CheckpointPolicy,
    EndOfPrefill,
    EveryBoundary,
    Prefill,
    SpeculativeCheckpoints,
)
from .components.eviction import EvictionPolicy, FlopAwareEviction, LRUEviction
from .components.keys import MultimodalSpan, TokenError, namespace_seed, object_key, page_keys
from .components.layout import LayoutError, MambaLayerSpec, ModelLayout, PoolKind
from .components.lookup import restorable_page_counts
from .components.mamba import checkpoint_depth, checkpoint_grid, restorable_ceiling
from .components.pool_view import (
    PoolSet,
    PoolView,
    PoolViewError,
    kv_view,
    stacked_kv_view,
    state_view,
)
from .components.pools import HybridPools, PoolError, dcp_fold
from .components.radix import RadixTree
from .runtime.dataplane.events import DeviceEvent, FenceError, wait_fence
from .runtime.dataplane.plane import (
    DataPlane,
    DataPlaneClosedError,
    DataPlaneConfig,
    Transfer,
)
from .runtime.dataplane.statistics import DataPlaneStatistics, PoolActorStatistics, QueueStatistics
from .runtime.dataplane.sync_plane import SyncDataPlane, SyncLoad
from .runtime.dataplane.tickets import LoadTicket, OffloadTicket, TransferOutcome
from .runtime.dataplane.tracing import disable_trace_logging, enable_trace_logging
from .runtime.linker.agreement import (
    Agreement,
    AgreementError,
    GlooAgreement,
    RankMismatchError,
    SingleRank,
)
from .runtime.linker.config import LinkerConfig
from .runtime.linker.facade import Linker
from .runtime.linker.request import LookupResult, PhaseError, Request
from .runtime.linker.restore_room import LoadHandle
from .runtime.linker.statistics import LinkerStatistics
from .runtime.linker.tree_writer import PoolExhaustedError
from .stores.base import (
    GetResult,
    Outcome,
    Store,
    StoreCapabilities,
    StoreClosedError,
    StoreError,
    StoreStatistics,
    StoreUnavailableError,
)
from .stores.embedded import EmbeddedStore
from .stores.framing import FrameError, FrameFault
from .stores.resilient import ResiliencePolicy, ResilienceStatistics, ResilientStore

__version__ = "0.1.0"

__all__ = [
    "BranchPoints",
    "CheckpointPolicy",
    "DeviceEvent",
    "EmbeddedStore",
    "EndOfPrefill",
    "EveryBoundary",
    "EvictionPolicy",
    "FenceError",
    "FlopAwareEviction",
    "FrameError",
    "FrameFault",
    "GetResult",
    "HybridPools",
    "LRUEviction",
    "LayoutError",
    "Linker",
    "LinkerConfig",
    "LinkerStatistics",
    "LoadHandle",
    "LookupResult",
    "MambaLayerSpec",
    "ModelLayout",
    "MultimodalSpan",
    "Outcome",
    "PhaseError",
    "PoolActorStatistics",
    "PoolError",
    "PoolExhaustedError",
    "PoolKind",
    "Prefill",
    "QueueStatistics",
    "RadixTree",
    "Request",
    "ResiliencePolicy",
    "ResilienceStatistics",
    "ResilientStore",
    "SpeculativeCheckpoints",
    "Store",
    "StoreCapabilities",
    "StoreClosedError",
    "StoreError",
    "StoreStatistics",
    "StoreUnavailableError",
    "TokenError",
    "__version__",
    "checkpoint_depth",
    "checkpoint_grid",
    "dcp_fold",
    "disable_trace_logging",
    "enable_trace_logging",
    "namespace_seed",
    "object_key",
    "page_keys",
    "restorable_ceiling",
    "restorable_page_counts",
    "wait_fence",
]

# the data plane over an engine's own pools (docs/design/runtime.md, "Data plane")
__all__ += [
    "DataPlane",
    "DataPlaneClosedError",
    "DataPlaneConfig",
    "DataPlaneStatistics",
    "LoadTicket",
    "OffloadTicket",
    "PoolSet",
    "PoolView",
    "PoolViewError",
    "SyncDataPlane",
    "SyncLoad",
    "Transfer",
    "TransferOutcome",
    "kv_view",
    "stacked_kv_view",
    "state_view",
]

# agreement across tensor-parallel ranks (docs/design/ranks.md, "Several ranks")
__all__ += [
    "Agreement",
    "AgreementError",
    "GlooAgreement",
    "RankMismatchError",
    "SingleRank",
]
