"""``hylinker soak --front sglang``: the SGLang plugin inside SGLang's own cache, in SGLang's
environment (``.venv-sglang``; :mod:`hylinker.tools.harness.sglang_cache` builds SGLang 0.5.23's
pools and ``UnifiedRadixCache`` on CPU and drives requests through the scheduler's steps).

Requests are served one at a time, as the harness does: multi-turn conversations (a turn extends
the previous prompt; a conversation restarts fresh past the front's ``MAX_TOKENS``), each restore
checked against what a recompute writes. The plugin's store is the embedded store at
``--store-kib`` under the fault plan, restarted every ``--restart-every-s`` (an outage in which
every call is refused, then the store comes back empty).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from ..stores.embedded import EmbeddedStore
from ..stores.faulty import FaultyStore
from .soak_fronts import MAX_TOKENS, MAX_TURN, SYSTEM_PROMPTS, RestartSchedule, SoakOptions
from .soak_measure import Sampler

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
#: conversations served in turn
CONVERSATIONS = 16


def sglang_front(opts: SoakOptions, sampler: Sampler, warmup_s: float) -> dict[str, Any]:
    from .harness.sglang_cache import CacheSpec, SGLangCache, install_cpu_shims

    install_cpu_shims()
    spec = CacheSpec(kv_pages=4096, max_context=MAX_TOKENS + MAX_TURN)
    cache = SGLangCache(spec, {**PLUGIN, "linker_extra_config": {
        "capacity_mb": max(1, opts.store_kib >> 10), "faults": opts.faults, "fault_seed": opts.seed}})
    try:
        cache.serve(list(range(1, 65)), rid="soak-first")  # SGLang imports the rest on first use
        sampler.start_clock()
        return _serve(cache, opts, sampler, warmup_s)
    finally:
        cache.close()


async def _tasks() -> int:
    return len(asyncio.all_tasks())


def _serve(cache: Any, opts: SoakOptions, sampler: Sampler, warmup_s: float) -> dict[str, Any]:
    linker = cache.linker
    faulty = linker.store.inner
    assert isinstance(faulty, FaultyStore), "the fault plan wraps the plugin's store"
    inner = faulty.inner
    assert isinstance(inner, EmbeddedStore)
    rng = np.random.default_rng(opts.seed)
    systems = [list(np.random.default_rng([opts.seed, 1000 + i]).integers(1, 30000, size=96))
               for i in range(SYSTEM_PROMPTS)]
    histories = [systems[i % SYSTEM_PROMPTS] for i in range(CONVERSATIONS)]
    counts = {"requests": 0, "aborted": 0, "mismatched": 0, "device_hit": 0, "store_hit": 0, "tokens": 0,
              "restarts": 0, "errors": 0}
    kv_rows = cache.spec.kv_pages * cache.tree_page

    def probe() -> dict[str, float]:
        return {"tasks": float(linker.data.call_store(_tasks).result(timeout=10)),
                "pool_cached": float(kv_rows - int(cache.allocator.available_size())),
                "offloads_held": float(len(linker._offloads.results)),
                "store_objects": float(inner.statistics().objects),
                "diag_kib": inner.evictions_memory.bytes / 1024}

    stop_at = time.monotonic() + opts.seconds
    restarts = RestartSchedule(faulty, lambda: linker.data.call_store(inner.remove, inner.lru_keys()).result(timeout=30),
                               opts, stop_at)
    warm = False
    turn = 0
    while time.monotonic() < stop_at:
        restarts.step()
        counts["restarts"] = restarts.restarts
        i = turn % CONVERSATIONS
        turn += 1
        new = list(rng.integers(1, 30000, size=int(rng.integers(16, MAX_TURN))))
        tokens = histories[i] + new
        if len(tokens) > MAX_TOKENS:
            tokens = systems[int(rng.integers(SYSTEM_PROMPTS))] + new
        histories[i] = tokens
        try:
            served = cache.serve([int(t) for t in tokens], rid=f"soak-{turn}")
        except (RuntimeError, TimeoutError):  # no rows, or offloads that did not report: counted
            counts["errors"] += 1
            continue
        counts["requests"] += 1
        counts["aborted"] += served.aborted
        counts["mismatched"] += bool(served.restore_mismatches)
        counts["device_hit"] += served.device_hit
        counts["store_hit"] += served.loaded
        counts["tokens"] += served.tokens
        if sampler.due():
            sampler.take(counts["requests"], probe())
        if not warm and time.monotonic() - sampler.t0 >= warmup_s:
            sampler.warmed_up()
            warm = True
    stats = linker.statistics()
    tokens_total = max(1, counts.pop("tokens"))
    return {**counts, "requests_per_s": round(counts["requests"] / opts.seconds, 1),
            "device_hit": round(counts["device_hit"] / tokens_total, 4),
            "store_hit": round(counts["store_hit"] / tokens_total, 4), "kv_rows": kv_rows,
            "offloads_in_flight_peak": stats.offloads_in_flight_peak,
            "evictions": inner.statistics().evictions, "eviction_memory_dropped": inner.evictions_memory.dropped}


__all__ = ["sglang_front"]
