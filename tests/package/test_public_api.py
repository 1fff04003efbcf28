"""The public API is the curated list in ``hylinker/__init__.py``; changing it is deliberate."""

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


def test_import_paths_from_before_runtime_still_import_the_same_modules() -> None:
    """``hylinker.linker`` / ``hylinker.dataplane`` (before issue 46; docs/serving_example.py showed
    ``hylinker.linker.facade``) are the modules under ``hylinker.runtime``, with a deprecation
    warning; a name that never existed is still missing. A child process: importing an old path
    sets ``hylinker.linker``, which the curated-list tests above must not see."""
    import subprocess
    import sys

    code = (
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import hylinker\n"
        "from hylinker.runtime.linker import facade\n"
        "from hylinker.runtime.dataplane import plane\n"
        "try:\n"
        "    import hylinker.linker.facade\n"
        "except DeprecationWarning as w:\n"
        "    assert 'hylinker.runtime.linker' in str(w), w\n"
        "else:\n"
        "    raise AssertionError('no warning')\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from hylinker.linker.facade import Linker\n"
        "from hylinker.dataplane.plane import DataPlane\n"
        "import hylinker.dataplane.plane as old_plane\n"
        "assert Linker is hylinker.Linker is facade.Linker and DataPlane is hylinker.DataPlane\n"
        "assert old_plane is plane\n"
        "try:\n"
        "    import hylinker.linker.no_such_module\n"
        "except ModuleNotFoundError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('a missing module imported')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
