"""The runtimes a soak drives (``hylinker soak --front``), each with constant traffic and
streaming statistics only (counters; nothing kept per request).

* ``linker``: the whole asyncio runtime (:class:`~hylinker.runtime.linker.facade.Linker`) over an
  embedded store small enough to evict all the time, wrapped in a fault plan (transient
  failures, timeouts, slow calls) and restarted every ``--restart-every-s`` (an outage in which
  every call is refused, then the store comes back empty, as a restarted embedded store does).
  Workers run multi-turn conversations (a turn extends the previous prompt; a conversation
  restarts fresh past ``MAX_TOKENS``) with synthetic content, and every restored prefix is
  checked byte for byte.
* ``dataplane``: the held-out soak of issue 53, docs/guide/library.md's example as a loop:
  ``SyncDataPlane`` over ``EmbeddedStore(16 MiB)``, a new 8-page prefix plus one state
  offloaded (``.result()``) and loaded each iteration; uses only the public API of the
  version before issue 53, so the same loop measures both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import numpy as np
import torch

from ..components.layout import PoolKind
from ..components.pools import HybridPools, PoolError
from ..runtime.linker.config import LinkerConfig
from ..runtime.linker.facade import Linker
from ..runtime.linker.tree_writer import PoolExhaustedError
from ..stores.embedded import EmbeddedStore
from ..stores.fault_plan import FaultPlan
from ..stores.faulty import FaultyStore
from ..testing.content import SyntheticContent
from ..testing.fakes import small_hybrid_layout, synthetic_prefill
from .soak_measure import Sampler

MIB = 1 << 20
#: a conversation restarts with a fresh prompt past this many tokens
MAX_TOKENS = 768
#: tokens a turn adds, at most
MAX_TURN = 96
#: system prompts the conversations start from (shared prefixes)
SYSTEM_PROMPTS = 8
#: tokens per page (and per state checkpoint interval) of the Linker front's layout
PAGE = 16


@attrs.define
class SoakOptions:
    minutes: float = 1.0
    iterations: int = 0  # dataplane: stop after this many (0: run the minutes)
    concurrency: int = 8
    store_kib: int = 1024
    kv_pages: int = 1024  # linker: the device pool
    faults: str = "fail=0.01,timeout=0.002,latency_ms=0.2,jitter_ms=1"
    restart_every_s: float = 120.0
    outage_s: float = 3.0
    seed: int = 0
    #: linker: requests started per second, all workers together (constant traffic: a host
    #: that gets faster must not raise the load and with it the offloads in flight); 0: as
    #: fast as the workers go
    rate: float = 30.0

    @property
    def seconds(self) -> float:
        return self.minutes * 60


def _stop_at(opts: SoakOptions) -> float:
    return time.monotonic() + opts.seconds


# ---- the Linker ------------------------------------------------------------------------------

@attrs.define
class _Counts:
    requests: int = 0
    wrong_prefixes: int = 0
    allocation_failures: int = 0
    restarts: int = 0
    errors: dict[str, int] = attrs.field(factory=dict)  # by exception type: a bounded set of names


async def _conversations(linker: Linker, content: SyntheticContent, worker: int, stop_at: float,
                         counts: _Counts, opts: SoakOptions) -> None:
    seed = opts.seed
    rng = np.random.default_rng([seed, worker])
    # constant traffic: this worker's requests start every `period` s (staggered across workers);
    # a worker that falls behind starts its next at once and does not catch up in a burst
    period = opts.concurrency / opts.rate if opts.rate > 0 else 0.0
    next_at = time.monotonic() + period * worker / opts.concurrency
    systems = [np.random.default_rng([seed, 1000 + i]).integers(1, 30000, size=96).astype(np.int32)
               for i in range(SYSTEM_PROMPTS)]
    histories = [systems[i % SYSTEM_PROMPTS] for i in range(8)]  # this worker's conversations
    turn = 0
    while time.monotonic() < stop_at:
        if period:
            await anyio.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at + period, time.monotonic())
        i = turn % len(histories)
        turn += 1
        new = rng.integers(1, 30000, size=int(rng.integers(16, MAX_TURN))).astype(np.int32)
        tokens = np.concatenate([histories[i], new])
        if len(tokens) > MAX_TOKENS:  # a fresh conversation: new keys, the old ones age out
            tokens = np.concatenate([systems[int(rng.integers(SYSTEM_PROMPTS))], new])
        histories[i] = tokens
        counts.requests += 1
        req = linker.request(f"soak-{worker}-{turn}", tokens)
        try:
            found = await linker.lookup(req)
            if found.store_tokens:
                load = await linker.load(req)
                if load is not None:
                    await linker.commit(load)
            if content.prefix_problems(linker, req):
                counts.wrong_prefixes += 1
            await synthetic_prefill(linker, content, req)
        except (PoolExhaustedError, PoolError):
            counts.allocation_failures += 1
        except Exception as exc:  # counted and reported; the soak goes on
            name = type(exc).__name__
            counts.errors[name] = counts.errors.get(name, 0) + 1
        finally:
            await linker.release(req)
        # the engine's forward and its network I/O: without a suspension here a store that
        # refuses every call at once (an outage) lets one worker run request after request
        # without ever yielding, and the loop's other tasks (the restart, the sampling) starve
        await anyio.sleep(0)


async def _restarts(store: FaultyStore, inner: EmbeddedStore, opts: SoakOptions, stop_at: float,
                    counts: _Counts) -> None:
    plan = store.plan
    while True:
        next_at = time.monotonic() + opts.restart_every_s
        if next_at + opts.outage_s >= stop_at:
            return
        await anyio.sleep(opts.restart_every_s)
        store.replan(FaultPlan(unavailable=1.0))  # down: every call refused
        await anyio.sleep(opts.outage_s)
        await inner.remove(inner.lru_keys())  # back, empty
        store.replan(plan)
        counts.restarts += 1


async def _sampling(sampler: Sampler, probe: Callable[[], dict[str, float]], done: Callable[[], int],
                    warmup_s: float, stop_at: float) -> None:
    warm = False
    while time.monotonic() < stop_at:
        sampler.take(done(), probe())
        if not warm and time.monotonic() - sampler.t0 >= warmup_s:
            sampler.warmed_up()
            warm = True
        await anyio.sleep(min(sampler.interval_s, max(0.0, stop_at - time.monotonic())))


@attrs.frozen
class InFlight:
    pages: int  # KV pages of locked tree nodes plus the open requests' own rows
    stray_locks: int  # node locks that no open request and no offload in flight holds


def in_flight(linker: Linker) -> InFlight:
    """What the Linker's work in flight holds: every lock is an open request's (one, on the
    node it stands on) or an offload's (one per node it sends); anything beyond is a leak."""
    locked_pages = locks = 0
    for n in linker.tree.tree.nodes():
        if n.lock:
            locked_pages += len(n.keys)
        locks += n.mamba_lock
    requests = list(linker._requests.values())
    own = sum(r.rows.numel() // linker.page - r.prefix_pages for r in requests)
    own += sum(r.load.rows.numel() // linker.page for r in requests if r.load is not None and not r.load.finished)
    request_locks = sum(not r.node.is_root for r in requests)
    return InFlight(locked_pages + own, locks - request_locks - linker.offloads.locked_nodes)


async def linker_front(opts: SoakOptions, sampler: Sampler, warmup_s: float) -> dict[str, Any]:
    layout = small_hybrid_layout(page_size=PAGE, chunk_size=PAGE)
    pools = HybridPools(layout, kv_pages=opts.kv_pages, mamba_slots=64)
    content = SyntheticContent(pools)
    inner = EmbeddedStore(opts.store_kib << 10)
    store = FaultyStore(inner, FaultPlan.parse(opts.faults), seed=opts.seed)
    counts = _Counts()
    stop_at = _stop_at(opts)

    def probe() -> dict[str, float]:
        tasks = len(asyncio.all_tasks())
        held = pools.kv.pages.capacity - linker.tree.kv_headroom_pages()
        flight = in_flight(linker)
        return {"tasks": float(tasks), "offloads_in_flight": float(linker.offloads.in_flight),
                # one settlement task per offload in flight; the rest is the runtime's own
                "tasks_beyond_in_flight": float(tasks - linker.offloads.in_flight),
                "pool_cached": float(pools.kv.pages.capacity - pools.kv.pages.num_free),
                # pages no allocation could take, and those that requests and offloads in
                # flight account for (locked paths, the requests' own rows)
                "pool_held": float(held), "pages_in_flight": float(flight.pages),
                "pages_beyond_in_flight": float(held - flight.pages),
                "locks_beyond_in_flight": float(flight.stray_locks),
                "store_objects": float(inner.statistics().objects),
                "diag_kib": inner.evictions_memory.bytes / 1024}

    async with Linker(layout, pools, store, LinkerConfig(staging_bytes_per_pool=1 << 20)) as linker:
        async with anyio.create_task_group() as tg:
            for w in range(opts.concurrency):
                tg.start_soon(_conversations, linker, content, w, stop_at, counts, opts)
            tg.start_soon(_sampling, sampler, probe, lambda: counts.requests, warmup_s, stop_at)
            if opts.restart_every_s > 0:
                tg.start_soon(_restarts, store, inner, opts, stop_at, counts)
        await linker.drain()
        stats = linker.statistics()
        faults = store.statistics()
        # after the traffic, nothing in flight: nothing may stay locked, leaked or open
        try:
            linker.check_idle()
            idle = "yes"
        except PoolError as exc:
            idle = str(exc)
    prompt = max(1, stats.lookup_prompt_tokens)
    await store.close()
    return {"requests": counts.requests, "requests_per_s": round(counts.requests / opts.seconds, 1),
            "rate": opts.rate, "idle_at_end": idle,
            "device_hit": round(stats.device_hit_tokens / prompt, 4),
            "store_hit": round(stats.store_hit_tokens / prompt, 4),
            "wrong_prefixes": counts.wrong_prefixes, "dropped_loads": stats.dropped_loads,
            "allocation_failures": counts.allocation_failures, "errors": counts.errors,
            "restarts": counts.restarts, "evictions": faults.evictions, "failed_keys": faults.failed_keys,
            "timeouts": faults.timeouts, "unavailable_calls": faults.unavailable_calls,
            "eviction_memory_dropped": getattr(inner.evictions_memory, "dropped", None)}


class RestartSchedule:
    """The store restarts of a front that serves from its own loop (sglang, vllm): call
    :meth:`step` between requests; every ``restart_every_s`` an outage of ``outage_s`` in which
    every call is refused, then the store comes back empty (``empty`` removes its keys)."""

    def __init__(self, store: FaultyStore, empty: Callable[[], object], opts: SoakOptions, stop_at: float) -> None:
        self.store, self.empty, self.opts, self.stop_at = store, empty, opts, stop_at
        self.plan = store.plan
        self.next_at = time.monotonic() + opts.restart_every_s if opts.restart_every_s else float("inf")
        self.back_at = float("inf")
        self.restarts = 0

    def step(self) -> None:
        now = time.monotonic()
        if now >= self.next_at and now + self.opts.outage_s < self.stop_at:
            self.store.replan(FaultPlan(unavailable=1.0))  # down: every call refused
            self.back_at, self.next_at = now + self.opts.outage_s, now + self.opts.restart_every_s
        elif now >= self.back_at:
            self.empty()  # back, empty
            self.store.replan(self.plan)
            self.back_at = float("inf")
            self.restarts += 1


# ---- the data plane (issue 53's held-out soak) --------------------------------------------------

def dataplane_front(opts: SoakOptions, sampler: Sampler, warmup_s: float) -> dict[str, Any]:
    import hylinker as hl  # the public API only: the same loop runs on the version before the fix

    k = [torch.randn(1024, 8, 64) for _ in range(2)]
    v = [torch.randn(1024, 8, 64) for _ in range(2)]
    conv, temporal = [torch.randn(16, 3, 512)], [torch.randn(16, 8, 64, 64)]
    views = hl.PoolSet([hl.kv_view(k, v, layer_ids=[1, 3], page_size=16),
                        hl.state_view([conv], temporal, layer_ids=[0])])
    rows = torch.arange(128)  # 8 pages of 16 rows
    failed = 0
    rss_at: dict[int, float] = {}
    milestone = max(1, opts.iterations // 10) if opts.iterations else 0
    stop_at = _stop_at(opts) if not opts.iterations else float("inf")

    async def tasks() -> int:
        return len(asyncio.all_tasks())

    with hl.SyncDataPlane(views, lambda: hl.EmbeddedStore(16 << 20)) as dp:
        def probe() -> dict[str, float]:
            memory = getattr(dp.store, "evictions_memory", None)
            out = {"tasks": float(dp.call_store(tasks).result()),
                   "store_objects": float(dp.store.statistics().objects)}
            if memory is not None and hasattr(memory, "bytes"):
                out["diag_kib"] = memory.bytes / 1024
            return out

        i = 0
        warm = False
        while (i < opts.iterations) if opts.iterations else (time.monotonic() < stop_at):
            keys = [f"it{i}-page{j}" for j in range(8)]
            state = [f"it{i}-state"]
            out = dp.offload([hl.Transfer(hl.PoolKind.FULL, keys, rows),
                              hl.Transfer(hl.PoolKind.MAMBA, state, [i % 16])]).result()
            load = dp.load([hl.Transfer(PoolKind.FULL, keys, rows + 128),
                            hl.Transfer(PoolKind.MAMBA, state, [(i + 1) % 16])])
            failed += (not out.ok) + (not load.result.result().ok)
            i += 1
            if milestone and i % milestone == 0:
                rss_at[i] = round(sampler.take(i, probe()).values["rss_mib"], 1)
            elif sampler.due():
                sampler.take(i, probe())
            if not warm and time.monotonic() - sampler.t0 >= warmup_s:
                sampler.warmed_up()
                warm = True
        sampler.take(i, probe())
        evictions = dp.store.statistics().evictions
    return {"iterations": i, "failed_transfers": failed, "evictions": evictions, "rss_mib_at": rss_at}


__all__ = ["MAX_TOKENS", "InFlight", "RestartSchedule", "SoakOptions", "dataplane_front", "in_flight", "linker_front"]
