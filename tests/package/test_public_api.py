"""The public API is the curated list in ``hylinker/__init__.py``; changing it is deliberate."""

import pytest

import hylinker

EXPECTED = {
    "BranchPoints", "CheckpointPolicy", "EndOfPrefill", "EveryBoundary", "EvictionPolicy",
    "FlopAwareEviction", "LRUEviction", "Prefill", "SpeculativeCheckpoints",
    "DeviceEvent", "EmbeddedStore", "FenceError", "FrameError", "FrameFault", "GetResult",
    "HybridPools", "LayoutError", "Linker", "LinkerConfig", "LinkerStatistics", "LoadHandle",
    "LookupResult", "MambaLayerSpec", "ModelLayout", "Outcome", "PhaseError",
    "PoolActorStatistics", "PoolError", "PoolExhaustedError", "PoolKind", "QueueStatistics",
    "RadixTree", "Request", "Store", "StoreCapabilities", "StoreClosedError", "StoreError",
    "StoreStatistics", "StoreUnavailableError", "TokenError", "__version__", "checkpoint_depth",
    "checkpoint_grid", "dcp_fold", "disable_trace_logging", "enable_trace_logging",
    "namespace_seed", "object_key", "page_keys", "restorable_ceiling", "restorable_page_counts",
    "wait_fence",
    # reliability (issue 11): the store wrapper every linker uses, its policy and statistics
    "ResiliencePolicy", "ResilienceStatistics", "ResilientStore",
}
# the data plane over an engine's own pools
EXPECTED |= {
    "DataPlane", "DataPlaneClosedError", "DataPlaneConfig", "DataPlaneStatistics", "LoadTicket",
    "OffloadTicket",
    "PoolSet", "PoolView", "PoolViewError", "SyncDataPlane", "SyncLoad", "Transfer",
    "TransferOutcome", "kv_view", "stacked_kv_view", "state_view",
}

# agreement across tensor-parallel ranks: what a multi-rank linker is given
EXPECTED |= {"Agreement", "AgreementError", "GlooAgreement", "RankMismatchError", "SingleRank"}

# a request's multimodal input, one of its isolation keys (Linker.request(multimodal=...))
EXPECTED |= {"MultimodalSpan"}


def test_all_is_the_curated_list() -> None:
    assert set(hylinker.__all__) == EXPECTED
    assert len(hylinker.__all__) == len(set(hylinker.__all__))


def test_every_name_resolves() -> None:
    for name in hylinker.__all__:
        assert getattr(hylinker, name) is not None, name


def test_no_unlisted_public_names() -> None:
    public = {n for n in vars(hylinker) if not n.startswith("_")}
    modules = {"components", "runtime", "stores", "tools", "testing", "tests", "integrations"}
    assert public - modules - EXPECTED == set()


def test_grid_rules_reachable_under_documented_names() -> None:
    from hylinker.components.mamba import checkpoint_depth, checkpoint_grid, restorable_ceiling

    assert checkpoint_depth(16384, 4066, checkpoint_grid(64, 256), 64) == 20224
    assert restorable_ceiling(16384, 64) == 16320


def test_the_layers_import_only_from_under_runtime() -> None:
    """``hylinker.linker`` / ``hylinker.dataplane`` (the layers' paths before they moved under
    ``hylinker.runtime``; nothing was released under them) import nowhere: one path per module."""
    import importlib

    for old in ("hylinker.linker", "hylinker.linker.facade", "hylinker.dataplane.plane"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
