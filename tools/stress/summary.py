"""The summary of a stress run (``tools/stress/run.py``): the figures ``hylinker stress`` prints
(``tools/report.py``) and saves as JSON, read from the run's counters, the linker's and the
pools' statistics and the store's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from ...components.layout import PoolKind
from ..eviction_returns import eviction_returns
from ..report import percentiles

if TYPE_CHECKING:
    from .run import StressRun


def _of_bound_fit(hit: int, fitting: tuple[int, int] | None) -> float | None:
    """Hits over the bound's hits, both counted over the requests that fit (a request that never
    fits runs nothing and hits nothing, so every hit is a fitting request's)."""
    if fitting is None or not fitting[0]:
        return None
    return round(hit / fitting[0], 3)


def summarize(run: StressRun, stats: Any, pool_stats: dict[str, Any], locked: int, leaks: dict[str, int],
              elapsed: float, bound_hit_tokens: int, fitting: tuple[int, int] | None = None) -> dict[str, Any]:
    """The run's summary: what ``hylinker stress`` prints and saves as JSON (hit rates against the
    infinite-cache bound, restores verified, admission, offloads, store, latencies, leaks).
    ``fitting``: (bound hit tokens, prompt tokens) of the requests that fit the device pools:
    ``of_bound_fit`` leaves the requests that can never fit out of both sides."""
    prompt = run.c["prompt_tokens"]
    hit = run.c["device_hit_tokens"] + run.c["store_hit_tokens"]
    grid = run.layout.grid
    workload_tokens = sum(r.prompt_length for r in run.requests)
    bound = bound_hit_tokens / workload_tokens if workload_tokens else 0.0

    def ms(values: list[float]) -> dict[str, float]:
        if not values:
            return {"p50": 0.0, "p99": 0.0}
        p = percentiles([v * 1e3 for v in values], (50, 99))
        return {k: round(v, 3) for k, v in p.items()}

    def per_pool(attr: str) -> dict[str, int]:
        return {k: getattr(pool_stats[v.value], attr) if v.value in pool_stats else 0
                for k, v in (("kv", PoolKind.FULL), ("mamba", PoolKind.MAMBA), ("draft", PoolKind.DRAFT))}

    sstats = run.store.statistics()
    hit_rate = hit / prompt if prompt else 0.0
    return {
        "requests": len(run.requests),
        "completed": run.c["completed"],
        "preset": run.cfg.preset,
        "policy": run.cfg.policy,
        "eviction": run.cfg.eviction,
        "page_size": run.layout.page_size,
        "grid": grid,
        "kv_pages": run.kv_pages,
        "mamba_slots": run.mamba_slots,
        "concurrency": run.cfg.concurrency,
        "causal": run.cfg.causal,
        "prompt_tokens": prompt,
        "device_hit_tokens": run.c["device_hit_tokens"],
        "store_hit_tokens": run.c["store_hit_tokens"],
        "hit_rate": round(hit_rate, 4),
        "bound_hit_rate": round(bound, 4),
        "of_bound": round(hit_rate / bound, 3) if bound else None,
        "of_bound_fit": _of_bound_fit(hit, fitting),
        "restores_verified": run.c["restores_verified"],
        "restore_mismatches": run.c["restore_mismatches"],
        "recomputed_loads": run.c["recomputed_loads"],
        # admission: waits are not losses; retries cost work; the rest lose a request's hits
        "causal_waits": run.c["causal_waits"],
        "alloc_waits": run.queue.waited,
        "max_waiting": run.queue.max_depth,
        "alloc_retries": run.c["alloc_retries"],
        "alloc_failures": run.c["alloc_failures"],
        "states_pending_offload_peak": run.states_pending_peak,
        "never_fit": run.c["never_fit"],
        "rejected": run.c["rejected"],
        "load_misses": stats.load_misses,
        # loads that found no pages and waited for them (LinkerConfig.load_wait_s); those that
        # still found none are in load_misses too
        "load_waits": stats.load_waits,
        "load_waits_recomputed": stats.load_waits_recomputed,
        "checkpoints_donated": run.c["checkpoints_donated"],
        "states_stored": pool_stats[PoolKind.MAMBA.value].objects_offloaded if PoolKind.MAMBA.value in pool_stats else 0,
        "leaked_rows": leaks["leaked_rows"],
        "leaked_slots": leaks["leaked_slots"],
        "idle_check_failed": leaks.get("idle_check_failed", 0),
        "locked_nodes_at_end": locked,
        "offloads": stats.offloads,
        "offloads_skipped_mamba": stats.offloads_skipped_mamba,
        "offloads_dropped": stats.offloads_dropped,
        "offload_failures": stats.offload_failures,
        "dropped_loads": stats.dropped_loads,
        "verify_failures": stats.verify_failures,
        "touches": stats.touches,
        "offloads_skipped_kv": stats.offloads_skipped_kv,
        "offloads_waited_kv": stats.offloads_waited_kv,  # waited for copies in flight (two stages)
        "offloads_skipped_breaker": stats.offloads_skipped_breaker,
        "offloads_skipped_staging": stats.offloads_skipped_staging,  # host staging full (two stages)
        "bad_objects_removed": stats.bad_objects_removed,
        "partial_loads": stats.partial_loads,
        "partial_pages_lost": stats.partial_pages_lost,
        "store_hit_requests": len(run.lat["ttft_store"]),  # requests with a store hit, taken or declined
        "declined_lookups": stats.declined_lookups,
        "declined_hit_tokens": stats.declined_hit_tokens,
        "decline_probes": stats.decline_probes,
        "resilience": attrs.asdict(run.resilience) if run.resilience is not None else None,
        "bytes_offloaded": per_pool("bytes_offloaded"),
        "bytes_loaded": per_pool("bytes_loaded"),
        "store": {"name": run.store.capabilities.name, "used_bytes": sstats.used_bytes,
                  "capacity_bytes": sstats.capacity_bytes, "evictions": sstats.evictions,
                  "put_bytes": sstats.put_bytes, "evicted_probed_again": sstats.evicted_probed_again,
                  "evicted_touched_again": sstats.evicted_touched_again},
        "eviction_returns": eviction_returns(run.store, sstats.evictions),
        "latency_ms": {"lookup": ms(run.lat["lookup"]), "load": ms(run.lat["load"]),
                       "commit": ms(run.lat["commit"]), "ttft": ms(run.lat["ttft"]),
                       "ttft_store": ms(run.lat["ttft_store"])},
        "loop_lag_ms": {"p99": round(float(np.percentile(run.lags, 99)), 3) if run.lags else 0.0},
        "seconds": round(elapsed, 2),
    }


__all__ = ["summarize"]
