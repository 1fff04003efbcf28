"""The Linker's and the data plane's Prometheus metrics (``runtime/dataplane/metrics.py``) through a real
restore on the embedded store: counters move by exactly what the restore did, the exposition
parses, a registry given twice degrades to no metrics, and restores that do not pay are
declined and counted."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hylinker.components.layout import PoolKind
from hylinker.components.pools import HybridPools
from hylinker.runtime.dataplane.metrics import FAMILIES, LIBRARY, Exporter, Increments
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores import framing
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import small_hybrid_layout, synthetic_prefill

LAYOUT = small_hybrid_layout()
P = LAYOUT.page_size


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


@asynccontextmanager
async def running(registry: CollectorRegistry | None, config: LinkerConfig | None = None,
                  store: EmbeddedStore | FaultyStore | None = None) -> AsyncIterator[tuple[Linker, SyntheticContent]]:
    pools = HybridPools(LAYOUT, kv_pages=64, mamba_slots=16)
    linker = Linker(LAYOUT, pools, store if store is not None else EmbeddedStore(8 << 20),
                    config or LinkerConfig(staging_bytes_per_pool=1 << 16), registry=registry)
    async with linker:
        yield linker, SyntheticContent(pools)


async def serve(linker: Linker, content: SyntheticContent, tokens: np.ndarray, rid: str) -> int:
    """One request: lookup, restore what the store has, prefill the rest, insert, release.
    Returns the tokens restored from the store."""
    req = linker.request(rid, tokens)
    await linker.lookup(req)
    load = await linker.load(req)
    restored = await linker.commit(load) if load is not None else 0
    await synthetic_prefill(linker, content, req)
    await linker.release(req)
    await linker.drain()
    return restored


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return float(registry.get_sample_value("hylinker_" + name, labels) or 0.0)


async def test_a_restore_moves_the_counters_by_exactly_what_it_did() -> None:
    registry = CollectorRegistry()
    p = prompt(41)
    async with running(registry) as (linker, content):
        assert linker.metrics is not None and linker.data.metrics is not None
        assert await serve(linker, content, p, "cold") == 0  # a miss; its pages offloaded
        offloads = linker.data.statistics().offloads_ok
        assert offloads >= 1
        assert value(registry, "lookups_total", outcome="miss") == 1
        assert value(registry, "offloads_total", outcome="ok") == offloads
        assert value(registry, "offload_seconds_count") == offloads
        assert value(registry, "loads_total", outcome="ok") == 0
        linker.flush_device()
        restored = await serve(linker, content, p, "warm")
        assert restored == 40  # 10 pages up to the grid below the 41-token prompt's ceiling
        pages = restored // P
        assert value(registry, "lookups_total", outcome="hit") == 1
        assert value(registry, "lookups_total", outcome="miss") == 1
        assert value(registry, "hit_tokens_total", source="store") == restored
        assert value(registry, "hit_tokens_total", source="device") == 0
        assert value(registry, "loads_total", outcome="ok") == 1
        assert value(registry, "loads_total", outcome="failed") == 0
        assert value(registry, "load_seconds_count") == 1
        kv_frame = framing.framed_size(linker.data.object_bytes(PoolKind.FULL))
        assert value(registry, "objects_total", pool="kv", direction="load") == pages
        assert value(registry, "bytes_total", pool="kv", direction="load") == pages * kv_frame
        assert value(registry, "objects_total", pool="mamba", direction="load") >= 1
        assert value(registry, "verify_failures_total", pool="kv") == 0
        assert value(registry, "store_events_total", event="retry") == 0
        assert value(registry, "breaker_open") == 0
        assert value(registry, "queue_depth", pool="kv", direction="load") == 0
        # the whole exposition parses and carries every family
        text = generate_latest(registry).decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {LIBRARY.prefix + f.key for f in FAMILIES} <= names
        linker.flush_device()
    # after close the last figures stay, and a scrape no longer reads the closed linker
    assert value(registry, "loads_total", outcome="ok") == 1
    assert value(registry, "objects_total", pool="kv", direction="load") == pages


async def test_no_registry_exports_nothing() -> None:
    async with running(None) as (linker, content):
        assert linker.metrics is None and linker.data.metrics is None
        await serve(linker, content, prompt(20), "r")
        linker.flush_device()


async def test_a_registry_given_twice_degrades_to_no_metrics_with_one_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    async with running(registry) as (first, content1):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            async with running(registry) as (second, content2):
                assert second.metrics is None and second.data.metrics is None
                # the second linker still serves, and records nothing on the first's families
                await serve(second, content2, prompt(41), "s")
                second.flush_device()
        lines = [r for r in caplog.records if "no metrics" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in caplog.records]
        assert value(registry, "lookups_total", outcome="miss") == 0
        await serve(first, content1, prompt(41), "f")
        assert value(registry, "lookups_total", outcome="miss") == 1
        first.flush_device()


def test_increments_publish_growth_only() -> None:
    inc = Increments()
    assert inc.take({("loads", "ok"): 3}) == {("loads", "ok"): 3}
    assert inc.take({("loads", "ok"): 3}) == {}
    assert inc.take({("loads", "ok"): 5, ("bytes", "kv", "load"): 7}) == {("loads", "ok"): 2, ("bytes", "kv", "load"): 7}


def test_a_metric_that_fails_to_record_is_logged_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    exporter = Exporter.create(registry, LIBRARY, ["loads"], who="test")
    assert exporter is not None
    with caplog.at_level(logging.WARNING):
        exporter.count("loads", 1)  # missing the outcome label: fails inside, not here
        exporter.count("loads", 1)
        exporter.publish({("loads", "ok", "extra"): 1}, force=True)
    assert len([r for r in caplog.records if "failed to record" in r.getMessage()]) == 1
    exporter.count("loads", 2, "ok")
    assert value(registry, "loads_total", outcome="ok") == 2


async def test_a_slow_store_restore_is_declined_and_counted() -> None:
    """With the check on and a prefill rate far above what the slow store delivers, the second
    restore is declined (the first measured the bandwidth) and counted; off, it is taken."""
    registry = CollectorRegistry()
    slow = FaultyStore(EmbeddedStore(8 << 20), FaultPlan(latency_ms=50))
    config = LinkerConfig(staging_bytes_per_pool=1 << 16, decline_slow_restores=True,
                          prefill_tokens_per_s=1e9)
    p, q = prompt(41, 1), prompt(41, 2)
    async with running(registry, config, slow) as (linker, content):
        await serve(linker, content, p, "p0")
        await serve(linker, content, q, "q0")
        linker.flush_device()
        assert await serve(linker, content, p, "p1") == 40  # no bandwidth known yet: taken
        assert linker.data.bandwidth.per_s is not None
        linker.flush_device()
        assert await serve(linker, content, q, "q1") == 0  # 40 tokens recompute faster: declined
        st = linker.statistics()
        assert (st.declined_lookups, st.declined_hit_tokens) == (1, 40)
        assert value(registry, "declined_hit_tokens_total") == 40
        linker.flush_device()
    off = LinkerConfig(staging_bytes_per_pool=1 << 16, prefill_tokens_per_s=1e9)
    slow2 = FaultyStore(EmbeddedStore(8 << 20), FaultPlan(latency_ms=50))
    async with running(None, off, slow2) as (linker, content):
        await serve(linker, content, p, "p0")
        linker.flush_device()
        assert await serve(linker, content, p, "p1") == 40
        linker.flush_device()
        assert await serve(linker, content, p, "p2") == 40  # off by default: always restored
        assert linker.statistics().declined_lookups == 0
        linker.flush_device()



async def test_after_decline_probe_every_declines_in_a_row_a_hit_is_taken_to_measure_again() -> None:
    """The bandwidth is measured only by loads: after ``decline_probe_every`` declines in a row
    the next hit is restored (a probe), so an estimate made while the store was slow cannot
    decline every later hit for good. Every probe and decline is counted."""
    slow = FaultyStore(EmbeddedStore(8 << 20), FaultPlan(latency_ms=50))
    config = LinkerConfig(staging_bytes_per_pool=1 << 16, decline_slow_restores=True,
                          prefill_tokens_per_s=1e9, decline_probe_every=2)
    p = prompt(41, 1)
    async with running(None, config, slow) as (linker, content):
        await serve(linker, content, p, "w")
        linker.flush_device()
        restored = []
        for i in range(7):
            restored.append(await serve(linker, content, p, f"r{i}"))
            linker.flush_device()
        # r0 measures the bandwidth; then two declines, a probe, two declines, a probe
        assert restored == [40, 0, 0, 40, 0, 0, 40]
        st = linker.statistics()
        assert (st.declined_lookups, st.decline_probes, st.declined_hit_tokens) == (4, 2, 160)


def test_a_sync_data_plane_exports_the_data_path() -> None:
    import torch

    from hylinker.runtime.dataplane.plane import Transfer
    from hylinker.runtime.dataplane.sync_plane import SyncDataPlane

    registry = CollectorRegistry()
    views = HybridPools(LAYOUT, kv_pages=16, mamba_slots=4).views()
    rows = torch.arange(2 * P).view(2, P)
    with SyncDataPlane(views, lambda: EmbeddedStore(8 << 20), registry=registry) as dp:
        assert dp.plane.metrics is not None
        assert dp.offload([Transfer(PoolKind.FULL, ["a", "b"], rows)]).result(30).ok
        assert dp.load([Transfer(PoolKind.FULL, ["a", "b"], rows)]).result.result(30).ok
        frame = framing.framed_size(dp.plane.object_bytes(PoolKind.FULL))
        assert value(registry, "offloads_total", outcome="ok") == 1
        assert value(registry, "loads_total", outcome="ok") == 1
        assert value(registry, "objects_total", pool="kv", direction="offload") == 2
        assert value(registry, "bytes_total", pool="kv", direction="load") == 2 * frame
        assert value(registry, "load_seconds_count") == 1 and value(registry, "offload_seconds_count") == 1


async def test_store_retries_and_damaged_objects_reach_the_metrics() -> None:
    """Transient store failures are retried and corrupt objects fail verification: the retry,
    verification, removal and failed-load counters equal what the statistics saw, and are not
    zero."""
    registry = CollectorRegistry()
    async with running(registry, store=FaultyStore(EmbeddedStore(8 << 20), FaultPlan(fail=0.3), seed=1)) as (
            linker, content):
        for i in range(3):
            await serve(linker, content, prompt(41, 10 + i), f"w{i}")
        res = linker.resilience_statistics()
        assert res is not None and res.retries > 0
        assert value(registry, "store_events_total", event="retry") == res.retries
        linker.flush_device()
    inner = EmbeddedStore(8 << 20)
    p = prompt(41, 5)
    async with running(None, store=inner) as (linker, content):
        await serve(linker, content, p, "donor")
        linker.flush_device()
    registry = CollectorRegistry()
    async with running(registry, store=FaultyStore(inner, FaultPlan(corrupt=1.0), seed=3)) as (linker, content):
        assert await serve(linker, content, p, "damaged") == 0  # every object damaged: recomputed
        st = linker.statistics()
        verify = {pool: s.verify_failures for pool, s in linker.pool_statistics().items()}
        assert sum(verify.values()) > 0 and st.bad_objects_removed > 0
        for pool, n in verify.items():
            assert value(registry, "verify_failures_total", pool=pool) == n
        assert value(registry, "bad_objects_removed_total") == st.bad_objects_removed
        assert value(registry, "loads_total", outcome="failed") == 1
        assert value(registry, "hit_tokens_total", source="store") == 0
        linker.flush_device()


def series(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every sample's name and label set on ``registry`` (values aside)."""
    return {(s.name, tuple(sorted(s.labels.items()))) for fam in registry.collect() for s in fam.samples}


async def test_a_linker_built_twice_in_one_process_exports_both_runs() -> None:
    """The second Linker on a registry takes over the first one's families: its export carries
    both runs (counters go on from the first one's totals), ``info`` and the store's occupancy."""
    registry = CollectorRegistry()
    async with running(registry) as (linker, content):
        await serve(linker, content, prompt(41, 1), "a")
        first = linker.statistics()
        stored = linker.inner_store.statistics()
        assert value(registry, "lookups_total", outcome="miss") == 1
        assert first.stored_tokens == 40 and value(registry, "stored_tokens_total") == 40
        assert value(registry, "store_objects") == stored.objects > 0
        assert value(registry, "store_bytes") == stored.used_bytes > 0
        assert value(registry, "store_capacity_bytes") == 8 << 20
        linker.flush_device()
    from hylinker import __version__

    info = {"version": __version__, "integrity": "checksum", "store": "embedded"}
    assert value(registry, "info", **info) == 1
    async with running(registry, LinkerConfig(staging_bytes_per_pool=1 << 16, integrity="header")) as (
            linker, content):
        assert linker.metrics is not None and linker.data.metrics is not None
        await serve(linker, content, prompt(41, 2), "b")
        await serve(linker, content, prompt(57, 3), "c")
        assert value(registry, "lookups_total", outcome="miss") == 3  # 1 + 2: one series, no reset
        assert value(registry, "stored_tokens_total") == 40 + linker.statistics().stored_tokens
        assert value(registry, "info", **{**info, "integrity": "header"}) == 1
        assert value(registry, "store_objects") == linker.inner_store.statistics().objects
        linker.flush_device()


def _label_sets(requests: int) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    import anyio

    async def run() -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        registry = CollectorRegistry()
        async with running(registry) as (linker, content):
            for i in range(requests):
                await serve(linker, content, prompt(41 + 16 * (i % 3), i % 4), f"req-{i}")
            linker.flush_device()
        return series(registry)

    return anyio.run(run)


def test_no_label_grows_with_traffic() -> None:
    """Two runs, 4 and 12 requests (distinct ids, prompts, keys): the same series, and no label
    value names a request."""
    few, many = _label_sets(4), _label_sets(12)
    assert few == many
    values = {v for _, labels in many for _, v in labels}
    assert not any(v.startswith("req-") for v in values)


#: every label a family may carry: each names a dimension with a fixed, small set of values
#: (an outcome, a pool, a direction...), never a request, a key or a node (issue 53)
BOUNDED_LABELS = {"outcome": "hit/miss/error, ok/failed...", "source": "device/store", "reason": "skip reasons",
                  "phase": "lookup/load/offload", "pool": "the layout's pool kinds", "direction": "load/offload",
                  "event": "STORE_EVENTS", "version": "one per process", "integrity": "one per process",
                  "store": "one per process"}


def test_every_family_label_is_a_bounded_dimension() -> None:
    """A new label on any family (the Linker's, the data plane's, each plugin's: they all export
    FAMILIES) must be added here with what bounds its values; a per-request label fails here
    even where no traffic test exports that family."""
    unknown = {(f.key, label) for f in FAMILIES for label in f.labels if label not in BOUNDED_LABELS}
    assert not unknown, f"labels not known to be bounded: {sorted(unknown)}"
    assert not LIBRARY.base_labels
