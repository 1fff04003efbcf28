"""``hylinker stress``: replay a trace through the whole runtime and verify every restore.

Requests reach the runtime the way a serving engine would let them: in causal order (the next
turn of a conversation only after the previous one completed), through a bounded waiting queue
that admits a request when its pages and state slots fit (:mod:`.replay`). The forward is
synthetic (:mod:`.content`): every restored page and state — from the device tree or from the
store — is compared byte for byte with what it must be. The run ends by releasing everything
and checking that no row, slot or lock leaked. Every loss is counted and reported beside the
hit rate it explains.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, NamedTuple

import anyio
import attrs

from ...components.admission import CHECKPOINT_POLICIES, checkpoint_policy
from ...components.eviction import eviction_policy
from ...components.keys import page_keys
from ...components.layout import PoolKind
from ...components.pools import HybridPools, PoolError
from ...runtime.linker.agreement import Agreement, SingleRank
from ...runtime.linker.config import LinkerConfig
from ...runtime.linker.facade import Linker, Request
from ...runtime.linker.tree_writer import PoolExhaustedError
from ...stores.base import Store
from ...stores.resilient import ResiliencePolicy, ResilienceStatistics
from ...testing.content import SyntheticContent, preset_layout
from ..arguments import UsageError
from ..eviction_returns import TraceClock
from ..prefix_bound import bound_hits_per_request, causal_parents
from ..replay import Demand, QueueFullError, WaitingQueue, pages_for
from ..report import progress_bar
from ..workloads import MOONCAKE_BLOCK_TOKENS
from ..workloads import Request as WorkloadRequest
from .inputs import load_workload, open_store
from .summary import summarize

MIB = 1 << 20
POLICIES = CHECKPOINT_POLICIES
#: state slots a running hybrid request may hold at once: its prefix's state (locked), its
#: working state and the checkpoint being written
SLOTS_PER_REQUEST = 3
#: a request whose allocation still fails (offloads in flight lock rows) goes back to the
#: queue this many times before it is dropped and counted as an allocation failure
MAX_ATTEMPTS = 50
__all__ = ["MIB", "POLICIES", "HitSample", "StressConfig", "StressResult", "StressRun", "load_workload", "open_store", "run_stress", "stress_config"]


# ---- the run ----------------------------------------------------------------------------

@attrs.define
class StressConfig:
    preset: str = "kimi"
    page_size: int = 64
    chunk_size: int = 64
    #: device pools; ``None`` derives them from the workload (:func:`derive_pools`)
    kv_pages: int | None = None
    mamba_slots: int | None = None
    concurrency: int = 8
    time_scale: float = 0.0  # 0: as fast as the queue admits
    #: the next turn of a conversation waits for the previous one to complete
    causal: bool = True
    max_waiting: int = 1 << 16
    touch: bool = True
    policy: str = "marconi"
    eviction: str = "lru"
    #: prefix granularity of the workload (512 for Mooncake traces: sharing is known per block)
    block_tokens: int = 0
    seed: int = 0
    linker: LinkerConfig = attrs.field(factory=LinkerConfig)
    #: pools every tensor-parallel rank holds the same copy of (written once, by rank 0)
    replicated: tuple[str, ...] = ()
    #: a modelled forward: it sleeps (computed tokens / this rate); 0: the forward takes no time.
    #: With it the run reports time to first token (lookup to the end of the prefill)
    prefill_tokens_per_s: float = 0.0


class HitSample(NamedTuple):
    """The run so far, when a request finished: device and store hit tokens and the
    infinite-cache bound's, each over the prompt tokens of the requests finished by then."""

    seconds: float
    device: float
    store: float
    bound: float


@attrs.define
class StressResult:
    summary: dict[str, Any]
    hits_over_time: list[HitSample]
    latency_s: dict[str, list[float]]


def derive_pools(requests: list[WorkloadRequest], page_size: int, concurrency: int, hybrid: bool,
                 backpressure_share: float) -> tuple[int, int]:
    """Device pools that fit the workload: ``concurrency`` of its longest prompts at once (and a
    quarter more, for the device cache), and state slots for as many running requests beside
    the share of the pool that offloads in flight may hold (the backpressure rule)."""
    longest = max((pages_for(r.prompt_length, page_size) for r in requests), default=1)
    kv_pages = max(4096, math.ceil(1.25 * concurrency * longest))
    slots = 0
    if hybrid:
        slots = max(48, math.ceil(SLOTS_PER_REQUEST * concurrency / (1 - backpressure_share)) + 1)
    return kv_pages, slots


@attrs.define
class _Attempts:
    """One request's tries: the hit it is credited with never includes its own donations."""

    hit: tuple[int, int] | None = None  # (device, store) tokens of record
    donated: bool = False


class StressRun:
    """One rank's replay. With an ``agreement`` over several ranks (``stress --ranks``) the
    requests run one at a time in workload order, offloads drained before each, so every rank
    calls the linker in the same order (the ordering rule, ``runtime/linker/agreement.py``)."""

    def __init__(self, cfg: StressConfig, store: Store, requests: list[WorkloadRequest],
                 agreement: Agreement | None = None, clock: TraceClock | None = None, registry: Any = None) -> None:
        self.cfg = cfg
        #: a prometheus_client registry the Linker exports its metrics on (``stress --metrics-port``)
        self.registry = registry
        self.store = store
        #: trace time (the latest arrival started), which the embedded store stamps evictions with
        self.clock = clock if clock is not None else TraceClock()
        self.requests = requests
        self.agreement = agreement if agreement is not None else SingleRank()
        self.layout = preset_layout(cfg.preset, cfg.page_size, cfg.chunk_size, tp_rank=self.agreement.rank,
                                    tp_size=self.agreement.size, replicated=cfg.replicated)
        share = cfg.linker.mamba_backpressure_share if cfg.linker.mamba_backpressure else 0.0
        kv, slots = derive_pools(requests, self.layout.page_size, cfg.concurrency, self.layout.is_hybrid,
                                 share)
        self.kv_pages = cfg.kv_pages if cfg.kv_pages is not None else kv
        self.mamba_slots = (cfg.mamba_slots if cfg.mamba_slots is not None else slots) if self.layout.is_hybrid else 0
        self.pools = HybridPools(self.layout, kv_pages=self.kv_pages, mamba_slots=self.mamba_slots)
        self.content = SyntheticContent(self.pools, seed=cfg.seed)
        # the waiting queue's budget: the whole KV pool, and the slots offloads can never hold
        slot_budget = math.floor(self.mamba_slots * (1 - share)) if self.layout.is_hybrid else 0
        self.queue = WaitingQueue(pages=self.kv_pages, slots=slot_budget, concurrency=cfg.concurrency,
                                  max_waiting=cfg.max_waiting)
        self.lat: dict[str, list[float]] = {"lookup": [], "load": [], "commit": [], "ttft": [],
                                               "ttft_store": []}
        self.c: dict[str, int] = {k: 0 for k in (
            "prompt_tokens", "device_hit_tokens", "store_hit_tokens", "restores_verified",
            "restore_mismatches", "alloc_retries", "alloc_failures", "never_fit", "rejected",
            "causal_waits", "checkpoints_donated", "recomputed_loads", "completed")}
        #: (seconds, request index, device and store hit tokens so far) as each request finished
        self.finished: list[tuple[float, int, int, int]] = []
        #: the most states waiting for their offload at once (sampled every 5 ms)
        self.states_pending_peak = 0
        self.lags: list[float] = []
        #: (request id, tokens the request stood on after LOOKUP/LOAD/COMMIT), in serving order
        self.decisions: list[tuple[str, int]] = []
        self.resilience: ResilienceStatistics | None = None
        self.parents = (causal_parents(requests, block_tokens=cfg.block_tokens) if cfg.causal
                        else [None] * len(requests))
        self.never_fit_ids = [r.request_id for r in requests if self.queue.never_fits(self._demand(r))]
        if requests and len(self.never_fit_ids) == len(requests):
            least = min((self._demand(r) for r in requests), key=lambda d: (d.pages, d.slots))
            raise UsageError(f"no request can ever fit the device pools (admission budget {self.queue.pages} "
                             f"KV pages, {self.queue.slots} state slots; the smallest request needs "
                             f"{least.pages} pages, {least.slots} slots): raise --kv-pages / --mamba-slots")

    def _demand(self, wr: WorkloadRequest) -> Demand:
        return Demand(pages_for(wr.prompt_length, self.layout.page_size),
                      SLOTS_PER_REQUEST if self.layout.is_hybrid else 0)

    async def run(self, show_progress: bool = True) -> StressResult:
        cfg = self.cfg
        if self.never_fit_ids:
            print(f"stress: {len(self.never_fit_ids)} requests can never fit the device pools "
                  f"({self.kv_pages} pages, {self.mamba_slots} slots), e.g. {self.never_fit_ids[:3]}; "
                  "they are counted as never_fit", file=sys.stderr)
        lk_cfg = attrs.evolve(cfg.linker, touch=cfg.touch)
        t_start = time.perf_counter()
        done = anyio.Event()
        finished = [anyio.Event() for _ in self.requests]
        bar = progress_bar(len(self.requests), desc="stress", unit="req", force=show_progress and sys.stderr.isatty())
        block = cfg.block_tokens
        async with Linker(self.layout, self.pools, self.store, lk_cfg,
                          checkpoints=checkpoint_policy(cfg.policy, block_tokens=block),
                          eviction=eviction_policy(cfg.eviction), agreement=self.agreement,
                          registry=self.registry) as lk:
            self.linker = lk

            async def ticker() -> None:
                mamba = lk.actors.get(PoolKind.MAMBA)
                while not done.is_set():
                    t0 = time.perf_counter()
                    await anyio.sleep(0.005)
                    self.lags.append(max(0.0, (time.perf_counter() - t0) * 1e3 - 5.0))
                    if mamba is not None:  # state slots held by offloads not yet settled
                        self.states_pending_peak = max(self.states_pending_peak, mamba.pending_states)

            async def client(i: int, wr: WorkloadRequest) -> None:
                try:
                    if cfg.time_scale > 0:
                        delay = wr.arrival_s * cfg.time_scale - (time.perf_counter() - t_start)
                        if delay > 0:
                            await anyio.sleep(delay)
                    parent = self.parents[i]
                    if parent is not None and not finished[parent].is_set():
                        self.c["causal_waits"] += 1
                        await finished[parent].wait()
                    await self._admit_and_serve(lk, wr, i)
                finally:
                    finished[i].set()
                    bar.update(1)
                    self._finished(i, time.perf_counter() - t_start)

            async def in_order() -> None:
                for i, wr in enumerate(self.requests):
                    await lk.drain()  # no offload lock makes one rank's allocation fail alone
                    try:
                        await self._admit_and_serve(lk, wr, i)
                    finally:
                        finished[i].set()
                        bar.update(1)
                        self._finished(i, time.perf_counter() - t_start)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                if self.agreement.collective:
                    await in_order()
                else:
                    async with anyio.create_task_group() as reqs:
                        for i, wr in enumerate(self.requests):
                            reqs.start_soon(client, i, wr)
                await lk.drain()
                done.set()
            bar.close()
            stats = lk.statistics()
            pool_stats = lk.pool_statistics()
            self.resilience = lk.resilience_statistics()
            locked = len(lk.tree.tree.locked_nodes())
            leaks = self._leaks(lk)
        elapsed = time.perf_counter() - t_start
        bound_hits = bound_hits_per_request(self.requests, page_size=self.layout.page_size, grid=self.layout.grid)
        never = set(self.never_fit_ids)
        fit = [i for i, r in enumerate(self.requests) if r.request_id not in never]
        fitting = (sum(bound_hits[i] for i in fit), sum(self.requests[i].prompt_length for i in fit))
        return StressResult(summarize(self, stats, pool_stats, locked, leaks, elapsed, sum(bound_hits), fitting),
                            self._hits_over_time(bound_hits), self.lat)

    def _finished(self, index: int, seconds: float) -> None:
        """Request ``index`` finished (served or not)."""
        self.finished.append((seconds, index, self.c["device_hit_tokens"], self.c["store_hit_tokens"]))

    def _hits_over_time(self, bound_hits: list[int]) -> list[HitSample]:
        """A sample per finished request: the hit rates of the run so far, the bound's with them
        (each request's bound tokens, computed after the run)."""
        out: list[HitSample] = []
        prompt = bound = 0
        for seconds, index, device, store in self.finished:
            prompt += self.requests[index].prompt_length
            bound += bound_hits[index]
            per = 1 / prompt if prompt else 0.0
            out.append(HitSample(seconds, device * per, store * per, bound * per))
        return out

    async def _admit_and_serve(self, lk: Linker, wr: WorkloadRequest, order: int) -> None:
        self.c["prompt_tokens"] += wr.prompt_length
        demand = self._demand(wr)
        if self.queue.never_fits(demand):
            self.c["never_fit"] += 1
            return
        attempts = _Attempts()
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                self.c["alloc_retries"] += 1
                if self.queue.running == 0:
                    await lk.drain()  # only offloads in flight hold what it needs
                else:
                    await self.queue.wait_progress(0.05)
            try:
                async with self.queue.admitted_for(demand, order):
                    if await self._serve(lk, wr, attempts):
                        self.c["completed"] += 1
                        return
            except QueueFullError:
                self.c["rejected"] += 1
                return
        self.c["alloc_failures"] += 1

    def _leaks(self, lk: Linker) -> dict[str, int]:
        pages, slots = lk.leaked()
        out = {"leaked_rows": pages * self.layout.page_size, "leaked_slots": slots}
        try:
            lk.check_idle()
            lk.flush_device()
            self.pools.check_idle()
        except PoolError as exc:
            print(f"stress: idle check failed: {exc}", file=sys.stderr)
            out["idle_check_failed"] = 1
        return out

    async def _serve(self, lk: Linker, wr: WorkloadRequest, attempts: _Attempts) -> bool:
        """One try at serving ``wr``; False when the device pools ran out (it is retried)."""
        self.clock.reached(wr.arrival_s)  # admitted: the replay has reached its arrival
        tokens = wr.token_ids()
        P = self.layout.page_size
        async with lk.session(wr.request_id, tokens) as req:
            t0 = t_first = time.perf_counter()
            hit = await lk.lookup(req)
            self.lat["lookup"].append(time.perf_counter() - t0)
            restored = 0
            if hit.store_tokens or self.agreement.collective:  # several ranks: LOAD is collective
                t0 = time.perf_counter()
                load = await lk.load(req)
                if load is not None:
                    await load.wait()
                    self.lat["load"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    restored = await lk.commit(load)
                    self.lat["commit"].append(time.perf_counter() - t0)
                    if restored == 0:
                        self.c["recomputed_loads"] += 1
                elif hit.store_tokens and self.agreement.collective:
                    self.c["recomputed_loads"] += 1  # another rank could not restore it: none does
            this_try = (req.prefix_tokens - restored, restored)
            self.decisions.append((wr.request_id, req.prefix_tokens))
            keys = page_keys(req.tokens, P, req.seed)
            # content checks and writes stand in for device work: keep them off the loop
            await anyio.to_thread.run_sync(self._verify, req, keys)
            try:
                await self._forward(lk, req, keys, attempts)
                self.lat["ttft"].append(time.perf_counter() - t_first)
                if hit.store_tokens or req.declined_tokens:  # the requests the store could serve
                    self.lat["ttft_store"].append(time.perf_counter() - t_first)
            except PoolExhaustedError:
                if attempts.donated and attempts.hit is None:
                    attempts.hit = this_try
                return False
        device, store = attempts.hit if attempts.hit is not None else this_try
        self.c["device_hit_tokens"] += device
        self.c["store_hit_tokens"] += store
        return True

    def _verify(self, req: Request, keys: list[bytes]) -> None:
        n = req.prefix_pages
        if n == 0:
            return
        bad = len(self.content.pages_match(keys[:n], req.rows[: n * self.layout.page_size]))
        self.c["restores_verified"] += n
        if self.layout.is_hybrid:
            self.c["restores_verified"] += 1
            if req.state_source is None or not self.content.state_matches(keys[n - 1], req.state_source):
                bad += 1
        self.c["restore_mismatches"] += bad

    async def _forward(self, lk: Linker, req: Request, keys: list[bytes], attempts: _Attempts) -> None:
        P = self.layout.page_size
        L = len(req.tokens)
        prefix_pages = req.prefix_pages
        rows = lk.extend(req, L)
        whole = L // P
        if self.cfg.prefill_tokens_per_s:  # the modelled prefill of what was not restored
            await anyio.sleep((L - req.prefix_tokens) / self.cfg.prefill_tokens_per_s)
        await anyio.to_thread.run_sync(
            self.content.write_pages, keys[prefix_pages:whole], rows[prefix_pages * P: whole * P])
        if not self.layout.is_hybrid:
            if whole > prefix_pages:
                await lk.insert(req, whole * P)
                attempts.donated = True
            return
        lk.working_slot(req)
        for depth in lk.checkpoint_depths(req):
            slot = lk.checkpoint_slot(req)
            self.content.write_state(keys[depth // P - 1], slot)
            await lk.insert(req, depth, checkpoint_slot=slot)
            attempts.donated = True
            self.c["checkpoints_donated"] += 1


# ---- CLI ----------------------------------------------------------------------------------

def stress_config(args: argparse.Namespace) -> StressConfig:
    return StressConfig(
        preset=args.preset, page_size=args.page_size, chunk_size=args.chunk_size,
        kv_pages=args.kv_pages, mamba_slots=args.mamba_slots, concurrency=args.concurrency,
        time_scale=args.time_scale, causal=args.causal, max_waiting=args.max_waiting, touch=args.touch,
        policy=args.policy, eviction=args.eviction, seed=args.seed,
        block_tokens=MOONCAKE_BLOCK_TOKENS if args.trace is not None else 0,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        linker=LinkerConfig(mamba_backpressure=not args.no_mamba_backpressure,
                            # TOUCH's interval is trace time: a replay compressed by time_scale
                            # compresses it too
                            touch_interval_s=max(1e-3, LinkerConfig().touch_interval_s * args.time_scale)
                            if args.time_scale > 0 else LinkerConfig().touch_interval_s,
                            kv_backpressure_share=args.kv_backpressure_share,
                            kv_backpressure_wait_s=args.kv_backpressure_wait_s,
                            resilience=None if args.no_retries else ResiliencePolicy(),
                            decline_slow_restores=args.decline_slow_restores,
                            prefill_tokens_per_s=args.prefill_tokens_per_s or None),
    )


async def run_stress(args: argparse.Namespace, requests: list[WorkloadRequest], registry: Any = None) -> StressResult:
    clock = TraceClock()
    store, (master, inner) = await open_store(args, clock)
    cfg = stress_config(args)
    try:
        return await StressRun(cfg, store, requests, clock=clock, registry=registry).run(
            show_progress=not args.no_progress)
    finally:
        await store.close()
        if inner is not None:
            await inner.close()
        if master is not None:
            master.stop()
