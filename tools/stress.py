"""``hylinker stress``: replay a trace through the whole runtime and verify every restore.

The forward is synthetic: for every whole page it writes content that is a function of the
page key and the position (KV and draft rows), and for every checkpoint a state that is a
function of the boundary's page key. Every restored page and state — from the device tree
or from the store — is compared byte for byte with what it must be. The run ends by releasing
everything and checking that no row, slot or lock leaked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import torch

from ..components.keys import page_keys
from ..components.layout import MambaLayerSpec, ModelLayout, PoolKind
from ..components.mamba import checkpoint_depth
from ..components.pools import HybridPools, PoolError
from ..runtime.config import LinkerConfig
from ..runtime.linker import Linker, Request
from ..runtime.tree_actor import PoolExhaustedError
from ..stores.base import Store
from ..stores.resilient import ResiliencePolicy, ResilienceStatistics
from .report import format_table, percentiles, progress_bar
from .workloads import Request as WorkloadRequest
from .workloads import bound_hit_rate, read_mooncake_trace, synthetic_agentic

HELP = "replay a trace (or a synthetic agentic workload) through the runtime; verify every restore"

MIB = 1 << 20
PRESETS = ("kimi", "attention")
POLICIES = ("end", "marconi", "grid")


# ---- geometry ---------------------------------------------------------------------------

def preset_layout(name: str, page_size: int = 64, chunk_size: int = 64) -> ModelLayout:
    """Stress geometries, scaled to this machine.

    * ``kimi``: Kimi-K3-like ratios — one MLA-like KV layer (fp8, 256 B per token), four
      KDA layers whose states add up to ~65 KV pages of 64 tokens (the real ratio: one state is
      worth ~64 pages), a one-layer draft model.
    * ``attention``: plain attention, four layers of 64 B per token, no states, no draft.
    """
    if name == "kimi":
        kda = [MambaLayerSpec(layer_id=i, conv_shape=(4, 256), conv_dtype=torch.float32,
                              temporal_shape=(4, 128, 128), temporal_dtype=torch.float32)
               for i in (0, 1, 2)]
        kda.append(MambaLayerSpec(layer_id=4, conv_shape=(4, 256), conv_dtype=torch.float32,
                                  temporal_shape=(4, 128, 128), temporal_dtype=torch.float32))
        return ModelLayout.create(page_size=page_size, chunk_size=chunk_size, full_layers=[3],
                                  kv_row_shape=[256], kv_dtype="float8_e4m3fn", mamba_layers=kda,
                                  draft_layers=1, draft_row_shape=[32], draft_dtype="bfloat16",
                                  model_name="stress-kimi")
    if name == "attention":
        return ModelLayout.create(page_size=page_size, chunk_size=chunk_size, full_layers=[0, 1, 2, 3],
                                  kv_row_shape=[32], kv_dtype="bfloat16", model_name="stress-attention")
    raise ValueError(f"unknown preset {name!r}; choose from {PRESETS}")


# ---- synthetic content -------------------------------------------------------------------

class Content:
    """Deterministic bytes for every page and state: a function of the page key and position.

    A page's byte ``b`` of token ``p`` in layer ``l`` is ``TABLE[(s + l * P + p) % M, b]``
    with ``s`` taken from the page key, so content is cheap to write and to check (a gather)
    and two different pages coincide with probability ~1/M.
    """

    M = 65521

    def __init__(self, layout: ModelLayout, pools: HybridPools, seed: int = 0) -> None:
        self.layout = layout
        self.pools = pools
        g = torch.Generator().manual_seed(seed)
        self.views: dict[PoolKind, torch.Tensor] = {}
        self.tables: dict[PoolKind, torch.Tensor] = {}
        for kind, t in ((PoolKind.FULL, pools.kv.tensor),
                        (PoolKind.DRAFT, pools.draft.tensor if pools.draft is not None else None)):
            if t is None:
                continue
            v = t.view(torch.uint8).reshape(t.shape[0], t.shape[1], -1)
            self.views[kind] = v
            self.tables[kind] = torch.randint(0, 256, (self.M, v.shape[2]), generator=g, dtype=torch.uint8)
        self.state_views: list[torch.Tensor] = []
        if pools.mamba is not None:
            self.state_views = [t.view(torch.uint8).reshape(t.shape[0], -1) for t in pools.mamba.tensors()]
            width = sum(v.shape[1] for v in self.state_views)
            self.state_table = torch.randint(0, 256, (self.M + width // 64 + 1, 64), generator=g,
                                             dtype=torch.uint8)

    @staticmethod
    def _seed(keys: Sequence[bytes]) -> torch.Tensor:
        return torch.tensor([int.from_bytes(k[:7], "little") for k in keys], dtype=torch.int64)

    def _page_index(self, keys: Sequence[bytes], n_layers: int) -> torch.Tensor:
        P = self.layout.page_size
        s = self._seed(keys)  # [n]
        idx = s[:, None, None] + torch.arange(n_layers)[None, :, None] * P + torch.arange(P)[None, None, :]
        return (idx % self.M).transpose(0, 1).reshape(n_layers, -1)  # [L, n*P]

    def write_pages(self, keys: Sequence[bytes], rows: torch.Tensor) -> None:
        if not keys:
            return
        for kind, v in self.views.items():
            idx = self._page_index(keys, v.shape[0])
            v[:, rows] = self.tables[kind][idx]

    def check_pages(self, keys: Sequence[bytes], rows: torch.Tensor) -> int:
        """Number of pages whose content differs from what it must be."""
        if not keys:
            return 0
        bad = torch.zeros(len(keys), dtype=torch.bool)
        P = self.layout.page_size
        for kind, v in self.views.items():
            idx = self._page_index(keys, v.shape[0])
            diff = (v[:, rows] != self.tables[kind][idx]).reshape(v.shape[0], len(keys), P, -1)
            bad |= diff.any(dim=3).any(dim=2).any(dim=0)
        return int(bad.sum())

    def _state_bytes(self, key: bytes) -> list[torch.Tensor]:
        s = int.from_bytes(key[:7], "little") % self.M
        out = []
        off = 0
        for v in self.state_views:
            n = v.shape[1]
            rows = -(-n // 64)
            out.append(self.state_table[s + off // 64: s + off // 64 + rows].reshape(-1)[:n])
            off += n
        return out

    def write_state(self, key: bytes, slot: int) -> None:
        for v, b in zip(self.state_views, self._state_bytes(key)):
            v[slot] = b

    def check_state(self, key: bytes, slot: int) -> bool:
        return all(torch.equal(v[slot], b) for v, b in zip(self.state_views, self._state_bytes(key)))


# ---- the run ----------------------------------------------------------------------------

@attrs.define
class StressConfig:
    preset: str = "kimi"
    page_size: int = 64
    chunk_size: int = 64
    kv_pages: int = 4096
    mamba_slots: int = 48
    concurrency: int = 8
    time_scale: float = 0.0  # 0: as fast as possible
    touch: bool = True
    policy: str = "marconi"
    #: prefix granularity of the workload (512 for Mooncake traces: sharing is known per block)
    block_tokens: int = 0
    seed: int = 0
    linker: LinkerConfig = attrs.field(factory=LinkerConfig)


@attrs.define
class StressResult:
    summary: dict[str, Any]
    hit_rate_over_time: list[tuple[float, float]]
    latency_s: dict[str, list[float]]


class StressRun:
    def __init__(self, cfg: StressConfig, store: Store, requests: list[WorkloadRequest]) -> None:
        self.cfg = cfg
        self.store = store
        self.requests = requests
        self.layout = preset_layout(cfg.preset, cfg.page_size, cfg.chunk_size)
        self.pools = HybridPools(self.layout, kv_pages=cfg.kv_pages,
                                 mamba_slots=cfg.mamba_slots if self.layout.is_hybrid else 0)
        self.content = Content(self.layout, self.pools, cfg.seed)
        self.lat: dict[str, list[float]] = {"lookup": [], "load": [], "commit": []}
        self.c: dict[str, int] = {k: 0 for k in (
            "prompt_tokens", "device_hit_tokens", "store_hit_tokens", "restores_verified",
            "restore_mismatches", "alloc_failures", "checkpoints_donated", "recomputed_loads")}
        self.hits_over_time: list[tuple[float, float]] = []
        self.seen_pages: set[bytes] = set()
        #: (request id, prompt tokens, device hit tokens, store tokens found by lookup)
        self.per_request: list[tuple[str, int, int, int]] = []
        self.lags: list[float] = []
        self.resilience: ResilienceStatistics | None = None

    async def run(self, show_progress: bool = True) -> StressResult:
        cfg = self.cfg
        lk_cfg = attrs.evolve(cfg.linker, touch=cfg.touch)
        t_start = time.perf_counter()
        limiter = anyio.Semaphore(cfg.concurrency)
        done = anyio.Event()
        bar = progress_bar(len(self.requests), desc="stress", unit="req", force=show_progress and sys.stderr.isatty())
        async with Linker(self.layout, self.pools, self.store, lk_cfg) as lk:
            self.linker = lk

            async def ticker() -> None:
                while not done.is_set():
                    t0 = time.perf_counter()
                    await anyio.sleep(0.005)
                    self.lags.append(max(0.0, (time.perf_counter() - t0) * 1e3 - 5.0))

            async def one(wr: WorkloadRequest) -> None:
                try:
                    await self._serve(lk, wr)
                finally:
                    limiter.release()
                    bar.update(1)
                    total = self.c["prompt_tokens"]
                    hit = self.c["device_hit_tokens"] + self.c["store_hit_tokens"]
                    self.hits_over_time.append((time.perf_counter() - t_start, hit / total if total else 0.0))

            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                async with anyio.create_task_group() as reqs:
                    for wr in self.requests:
                        if cfg.time_scale > 0:
                            delay = wr.arrival_s * cfg.time_scale - (time.perf_counter() - t_start)
                            if delay > 0:
                                await anyio.sleep(delay)
                        await limiter.acquire()
                        reqs.start_soon(one, wr)
                await lk.drain()
                done.set()
            bar.close()
            stats = lk.statistics()
            pool_stats = lk.pool_statistics()
            self.resilience = lk.resilience_statistics()
            locked = len(lk.tree.tree.locked_nodes())
            leaks = self._leaks(lk)
        elapsed = time.perf_counter() - t_start
        return StressResult(self._summary(stats, pool_stats, locked, leaks, elapsed),
                            self.hits_over_time, self.lat)

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

    async def _serve(self, lk: Linker, wr: WorkloadRequest) -> None:
        tokens = wr.token_ids()
        P = self.layout.page_size
        L = len(tokens)
        self.c["prompt_tokens"] += L
        async with lk.session(wr.request_id, tokens) as req:
            t0 = time.perf_counter()
            hit = await lk.lookup(req)
            self.lat["lookup"].append(time.perf_counter() - t0)
            self.c["device_hit_tokens"] += hit.device_tokens
            self.per_request.append((wr.request_id, L, hit.device_tokens, hit.store_tokens))
            if hit.store_tokens:
                t0 = time.perf_counter()
                load = await lk.load(req)
                if load is not None:
                    await load.wait()
                    self.lat["load"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    restored = await lk.commit(load)
                    self.lat["commit"].append(time.perf_counter() - t0)
                    self.c["store_hit_tokens"] += restored
                    if restored == 0:
                        self.c["recomputed_loads"] += 1
            keys = page_keys(req.tokens, P, req.seed)
            # content checks and writes stand in for device work: keep them off the loop
            await anyio.to_thread.run_sync(self._verify, req, keys)
            try:
                await self._forward(lk, req, keys)
            except PoolExhaustedError:
                self.c["alloc_failures"] += 1

    def _verify(self, req: Request, keys: list[bytes]) -> None:
        n = req.prefix_pages
        if n == 0:
            return
        bad = self.content.check_pages(keys[:n], req.rows[: n * self.layout.page_size])
        self.c["restores_verified"] += n
        if self.layout.is_hybrid:
            self.c["restores_verified"] += 1
            if req.state_source is None or not self.content.check_state(keys[n - 1], req.state_source):
                bad += 1
        self.c["restore_mismatches"] += bad

    def _depths(self, req: Request, keys: list[bytes], L: int) -> list[int]:
        """Checkpoint depths this request donates, by admission policy."""
        G = self.layout.grid
        prefix = req.prefix_tokens
        end = checkpoint_depth(prefix, L - prefix, G, self.layout.chunk_size)
        if end is None:
            return []
        if self.cfg.policy == "grid":
            return list(range(prefix + G, end + 1, G))
        depths = {end}
        if end == L and end - G > prefix:
            # a prompt ending on the grid restores at most L - G (one token must run): donate
            # there too, or resubmitting the same prompt could restore nothing
            depths.add(end - G)
        if self.cfg.policy == "marconi":
            # the branch point: where this prompt leaves every earlier prompt
            shared = 0
            while shared < len(keys) and keys[shared] in self.seen_pages:
                shared += 1
            branch = shared * self.layout.page_size // G * G
            if prefix < branch < end:
                depths.add(branch)
            # the end of the turn, as far as the workload can share it: its last whole block
            if self.cfg.block_tokens:
                last_block = L // self.cfg.block_tokens * self.cfg.block_tokens // G * G
                if prefix < last_block < end:
                    depths.add(last_block)
        return sorted(depths)

    async def _forward(self, lk: Linker, req: Request, keys: list[bytes]) -> None:
        P = self.layout.page_size
        L = len(req.tokens)
        prefix_pages = req.prefix_pages
        rows = lk.extend(req, L)
        whole = L // P
        await anyio.to_thread.run_sync(
            self.content.write_pages, keys[prefix_pages:whole], rows[prefix_pages * P: whole * P])
        if not self.layout.is_hybrid:
            if whole > prefix_pages:
                await lk.insert(req, whole * P)
            self.seen_pages.update(keys[:whole])
            return
        lk.working_slot(req)
        depths = self._depths(req, keys, L)
        self.seen_pages.update(keys[:whole])
        for depth in depths:
            slot = lk.checkpoint_slot(req)
            self.content.write_state(keys[depth // P - 1], slot)
            await lk.insert(req, depth, checkpoint_slot=slot)
            self.c["checkpoints_donated"] += 1

    def _summary(self, stats: Any, pool_stats: dict[str, Any], locked: int, leaks: dict[str, int],
                 elapsed: float) -> dict[str, Any]:
        prompt = self.c["prompt_tokens"]
        hit = self.c["device_hit_tokens"] + self.c["store_hit_tokens"]
        grid = self.layout.grid
        bound = bound_hit_rate(self.requests, page_size=self.layout.page_size, grid=grid)

        def ms(values: list[float]) -> dict[str, float]:
            if not values:
                return {"p50": 0.0, "p99": 0.0}
            p = percentiles([v * 1e3 for v in values], (50, 99))
            return {k: round(v, 3) for k, v in p.items()}

        pools = {p: pool_stats[p] for p in pool_stats}
        sstats = self.store.statistics()
        return {
            "requests": len(self.requests),
            "preset": self.cfg.preset,
            "policy": self.cfg.policy,
            "page_size": self.layout.page_size,
            "grid": grid,
            "prompt_tokens": prompt,
            "device_hit_tokens": self.c["device_hit_tokens"],
            "store_hit_tokens": self.c["store_hit_tokens"],
            "hit_rate": round(hit / prompt, 4) if prompt else 0.0,
            "bound_hit_rate": round(bound, 4),
            "restores_verified": self.c["restores_verified"],
            "restore_mismatches": self.c["restore_mismatches"],
            "recomputed_loads": self.c["recomputed_loads"],
            "alloc_failures": self.c["alloc_failures"],
            "checkpoints_donated": self.c["checkpoints_donated"],
            "leaked_rows": leaks["leaked_rows"],
            "leaked_slots": leaks["leaked_slots"],
            "idle_check_failed": leaks.get("idle_check_failed", 0),
            "locked_nodes_at_end": locked,
            "offloads": stats.offloads,
            "offloads_skipped": stats.offloads_skipped,
            "offloads_dropped": stats.offloads_dropped,
            "offload_failures": stats.offload_failures,
            "dropped_loads": stats.dropped_loads,
            "verify_failures": stats.verify_failures,
            "touches": stats.touches,
            "offloads_skipped_kv": stats.offloads_skipped_kv,
            "offloads_skipped_breaker": stats.offloads_skipped_breaker,
            "bad_objects_removed": stats.bad_objects_removed,
            "partial_loads": stats.partial_loads,
            "partial_pages_lost": stats.partial_pages_lost,
            "resilience": attrs.asdict(self.resilience) if self.resilience is not None else None,
            "bytes_offloaded": {k: pools[v.value].bytes_offloaded if v.value in pools else 0
                                for k, v in (("kv", PoolKind.FULL), ("mamba", PoolKind.MAMBA),
                                             ("draft", PoolKind.DRAFT))},
            "bytes_loaded": {k: pools[v.value].bytes_loaded if v.value in pools else 0
                             for k, v in (("kv", PoolKind.FULL), ("mamba", PoolKind.MAMBA),
                                          ("draft", PoolKind.DRAFT))},
            "store": {"name": self.store.capabilities.name, "used_bytes": sstats.used_bytes,
                      "capacity_bytes": sstats.capacity_bytes, "evictions": sstats.evictions},
            "latency_ms": {"lookup": ms(self.lat["lookup"]), "load": ms(self.lat["load"]),
                           "commit": ms(self.lat["commit"])},
            "loop_lag_ms": {"p99": round(float(np.percentile(self.lags, 99)), 3) if self.lags else 0.0},
            "seconds": round(elapsed, 2),
        }


# ---- CLI ----------------------------------------------------------------------------------

def configure(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--trace", type=Path, default=None,
                   help="Mooncake-format JSONL trace (default: the built-in synthetic agentic workload)")
    w.add_argument("--requests", type=int, default=None, help="take the first N requests")
    w.add_argument("--time-scale", type=float, default=0.0,
                   help="replay arrival times multiplied by this (0: as fast as concurrency allows)")
    w.add_argument("--synthetic-scale", type=float, default=0.25,
                   help="size multiplier of the synthetic workload's prompts")
    w.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("geometry")
    g.add_argument("--preset", choices=PRESETS, default="kimi")
    g.add_argument("--page-size", type=int, default=64)
    g.add_argument("--chunk-size", type=int, default=64)
    g.add_argument("--kv-pages", type=int, default=4096, help="device KV pool, in pages")
    g.add_argument("--mamba-slots", type=int, default=48, help="device state pool, in slots")
    g.add_argument("--concurrency", type=int, default=8)
    g.add_argument("--policy", choices=POLICIES, default="marconi",
                   help="checkpoint admission: end of prefill / + branch points / every grid boundary")
    s = parser.add_argument_group("store")
    s.add_argument("--store", choices=("embedded", "mooncake"), default="embedded")
    s.add_argument("--store-capacity-mb", type=int, default=2048)
    s.add_argument("--mooncake-master", default=None,
                   help="HOST:PORT of a running mooncake_master (default: start one on loopback)")
    s.add_argument("--fault-rate", type=float, default=0.0,
                   help="inject store faults (failures, torn/corrupt objects, vanishing keys) at this rate")
    s.add_argument("--faults", default=None, metavar="SPEC",
                   help="a full fault plan, e.g. 'fail=0.02,corrupt=0.01,vanish=0.05,latency_ms=1' "
                        "(fields of hylinker.stores.faulty.FaultPlan; overrides --fault-rate)")
    s.add_argument("--touch", action=argparse.BooleanOptionalAction, default=True,
                   help="tell the store about device hits (TOUCH)")
    s.add_argument("--no-mamba-backpressure", action="store_true",
                   help="disable the 3/4-of-the-state-pool offload skip rule")
    s.add_argument("--kv-backpressure-share", type=float, default=LinkerConfig().kv_backpressure_share,
                   help="skip offloads while queued offloads lock this share of the KV pool")
    s.add_argument("--no-retries", action="store_true",
                   help="talk to the store directly: no retries, timeouts or circuit breaker")
    from .chaos import add_chaos_arguments

    add_chaos_arguments(parser)
    o = parser.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    o.add_argument("--plot", type=Path, default=None, help="write a PNG: hit rate over time, latency CDFs")
    o.add_argument("--no-progress", action="store_true")


def load_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.trace is not None:
        if not args.trace.exists():
            raise SystemExit(f"stress: trace file not found: {args.trace}")
        reqs = read_mooncake_trace(args.trace, first_n=args.requests, time_scale=1.0)
    else:
        reqs = synthetic_agentic(args.requests or 2500, seed=args.seed, scale=args.synthetic_scale)
    return reqs


async def open_store(args: argparse.Namespace) -> tuple[Store, Any]:
    """The store the run uses, and an object to close after it (a master we started)."""
    capacity = args.store_capacity_mb * MIB
    inner: Store
    extra: Any = None
    if args.store == "embedded":
        from ..stores.embedded import EmbeddedStore

        inner = EmbeddedStore(capacity)
    else:
        from ..stores.mooncake import MooncakeConfig, MooncakeStore

        address = args.mooncake_master
        if address is None:
            from ..stores.mooncake_master import MooncakeMaster

            extra = MooncakeMaster().start()
            address = extra.address
        inner = await MooncakeStore.open(MooncakeConfig(master_address=address, segment_bytes=capacity))
    if args.faults or args.fault_rate > 0:
        from ..stores.faulty import FaultPlan, FaultyStore

        plan = FaultPlan.parse(args.faults) if args.faults else FaultPlan.uniform(args.fault_rate)
        return FaultyStore(inner, plan, seed=args.seed), (extra, inner)
    return inner, (extra, None)


def stress_config(args: argparse.Namespace) -> StressConfig:
    return StressConfig(
        preset=args.preset, page_size=args.page_size, chunk_size=args.chunk_size,
        kv_pages=args.kv_pages, mamba_slots=args.mamba_slots, concurrency=args.concurrency,
        time_scale=args.time_scale, touch=args.touch, policy=args.policy, seed=args.seed,
        block_tokens=512 if args.trace is not None else 0,
        linker=LinkerConfig(mamba_backpressure=not args.no_mamba_backpressure,
                            kv_backpressure_share=args.kv_backpressure_share,
                            resilience=None if args.no_retries else ResiliencePolicy()),
    )


async def run_stress(args: argparse.Namespace, requests: list[WorkloadRequest]) -> StressResult:
    store, (master, inner) = await open_store(args)
    cfg = stress_config(args)
    try:
        return await StressRun(cfg, store, requests).run(show_progress=not args.no_progress)
    finally:
        await store.close()
        if inner is not None:
            await inner.close()
        if master is not None:
            master.stop()


def run(args: argparse.Namespace) -> int:
    requests = load_workload(args)
    if not requests:
        print("stress: the workload is empty", file=sys.stderr)
        return 2
    if args.chaos:
        from .chaos import run_chaos

        return run_chaos(args, stress_config(args), requests)
    result = anyio.run(run_stress, args, requests)
    s = result.summary
    print(format_summary(s))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(s, indent=2))
        print(f"wrote {args.json}")
    if args.plot is not None:
        from .report import plot_stress

        plot_stress(str(args.plot), result.hit_rate_over_time, result.latency_s,
                    title=f"hylinker stress: {s['requests']} requests, {s['preset']}",
                    bound_hit_rate=s["bound_hit_rate"])
        print(f"wrote {args.plot}")
    bad = s["restore_mismatches"] or s["leaked_rows"] or s["leaked_slots"] or s["locked_nodes_at_end"] \
        or s["idle_check_failed"]
    return 1 if bad else 0


def format_summary(s: dict[str, Any]) -> str:
    rows = [
        {"metric": "requests", "value": s["requests"]},
        {"metric": "prompt tokens", "value": s["prompt_tokens"]},
        {"metric": "hit rate (device + store)", "value": f"{s['hit_rate']:.1%}"},
        {"metric": "  bound (infinite cache)", "value": f"{s['bound_hit_rate']:.1%}"},
        {"metric": "device hit tokens", "value": s["device_hit_tokens"]},
        {"metric": "store hit tokens", "value": s["store_hit_tokens"]},
        {"metric": "restores verified (pages + states)", "value": s["restores_verified"]},
        {"metric": "restore mismatches", "value": s["restore_mismatches"]},
        {"metric": "loads dropped -> recomputed", "value": s["dropped_loads"]},
        {"metric": "leaked rows / slots / locked nodes",
         "value": f"{s['leaked_rows']} / {s['leaked_slots']} / {s['locked_nodes_at_end']}"},
        {"metric": "offloads (skipped / dropped / failed)",
         "value": f"{s['offloads']} ({s['offloads_skipped']} / {s['offloads_dropped']} / {s['offload_failures']})"},
        *resilience_rows(s),
        {"metric": "MB offloaded kv / mamba / draft",
         "value": " / ".join(f"{v / MIB:.1f}" for v in s["bytes_offloaded"].values())},
        {"metric": "MB loaded kv / mamba / draft",
         "value": " / ".join(f"{v / MIB:.1f}" for v in s["bytes_loaded"].values())},
        {"metric": "lookup ms p50 / p99",
         "value": f"{s['latency_ms']['lookup']['p50']} / {s['latency_ms']['lookup']['p99']}"},
        {"metric": "load ms p50 / p99",
         "value": f"{s['latency_ms']['load']['p50']} / {s['latency_ms']['load']['p99']}"},
        {"metric": "commit ms p50 / p99",
         "value": f"{s['latency_ms']['commit']['p50']} / {s['latency_ms']['commit']['p99']}"},
        {"metric": "event-loop lag ms p99", "value": s["loop_lag_ms"]["p99"]},
        {"metric": "seconds", "value": s["seconds"]},
    ]
    return format_table(rows, ["metric", "value"])


def resilience_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows for the store wrapper's retries and circuit breaker (none without it)."""
    r = s.get("resilience")
    if not r:
        return []
    return [
        {"metric": "store retries (keys recovered / exhausted)",
         "value": f"{r['retries']} ({r['recovered_keys']} / {r['exhausted_keys']})"},
        {"metric": "store timeouts / unavailable calls", "value": f"{r['timeouts']} / {r['unavailable']}"},
        {"metric": "breaker trips / rejected calls / resumes",
         "value": f"{r['breaker_trips']} / {r['rejected_calls']} / {r['resumes']}"},
        {"metric": "offloads skipped (kv backpressure / breaker open)",
         "value": f"{s.get('offloads_skipped_kv', 0)} / {s.get('offloads_skipped_breaker', 0)}"},
        {"metric": "loads kept partly (pages lost)",
         "value": f"{s.get('partial_loads', 0)} ({s.get('partial_pages_lost', 0)})"},
        {"metric": "bad objects removed", "value": s.get("bad_objects_removed", 0)},
    ]
