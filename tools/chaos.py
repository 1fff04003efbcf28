"""``hylinker stress --chaos``: the cache under a misbehaving store, in one run of the tool.

Three parts, all on the workload and geometry of the stress run:

1. **Fault plans against a fault-free baseline** (``--chaos-plans``, default
   ``uniform=0.05;fail=0.2``): the same trace replayed once per plan on a fresh embedded store
   wrapped by :class:`~hylinker.stores.faulty.FaultyStore`. Reports store hit tokens kept vs
   the fault-free run next to every loss (dropped and partial loads, verification failures,
   skipped offloads, retries exhausted), and the safety counts (wrong restores, leaked rows
   and slots, locked nodes at the end).
2. **close() timings**: a linker whose store hangs (puts never return), and a linker on
   Mooncake whose master was killed (SIGKILL) mid-run.
3. **Soak** (needs Mooncake): a loopback ``mooncake_master`` that the tool kills after
   ``--soak-kill-at`` of ``--soak-seconds`` (the workload's arrivals are scaled to last that
   long) and restarts on the same port ``--soak-outage-s`` later,
   under mixed faults (``--soak-faults``) and the stress run's concurrency. The run must
   complete inside ``--soak-limit-s``, restore nothing wrong, leak nothing, and hit the store
   again after the restart.

Every process the tool starts is stopped by its own PID (``MooncakeMaster``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import anyio
import attrs

from ..components.pools import HybridPools
from ..runtime.linker.config import LinkerConfig
from ..runtime.linker.facade import Linker
from ..stores.base import Store
from ..stores.embedded import EmbeddedStore
from ..stores.faulty import FaultPlan, FaultyStore
from ..stores.resilient import ResiliencePolicy
from .arguments import fault_plan, non_negative_float, positive_float, share
from .report import format_table
from .stress.run import MIB, StressConfig, StressRun
from .workloads import Request as WorkloadRequest

DEFAULT_PLANS = "uniform=0.05;fail=0.2"


def fault_plans(text: str) -> str:
    """``--chaos-plans``: fault plans separated by ``;``, each one that parses."""
    for plan in text.split(";"):
        fault_plan(plan)
    return text


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("chaos (--chaos)")
    c.add_argument("--chaos", action="store_true",
                   help="reliability run: fault plans vs a fault-free baseline, close() with a hung "
                        "store and a killed master, and a Mooncake soak with the master restarted")
    c.add_argument("--chaos-plans", type=fault_plans, default=DEFAULT_PLANS, metavar="PLANS",
                   help="fault plans compared with the fault-free run, separated by ';'")
    c.add_argument("--no-soak", action="store_true", help="skip the Mooncake parts")
    c.add_argument("--soak-faults", type=fault_plan, default="uniform=0.01", metavar="SPEC",
                   help="faults injected during the soak, on top of the master outage")
    c.add_argument("--soak-seconds", type=positive_float, default=20.0,
                   help="the soak replays the workload's arrivals scaled to last this long")
    c.add_argument("--soak-kill-at", type=share, default=0.3,
                   help="kill the master at this share of the soak's duration")
    c.add_argument("--soak-outage-s", type=non_negative_float, default=2.0, help="seconds the master stays down")
    c.add_argument("--soak-limit-s", type=positive_float, default=300.0, help="the soak fails past this")


def _safety(s: dict[str, Any]) -> dict[str, int]:
    return {"wrong_restores": s["restore_mismatches"], "leaked_rows": s["leaked_rows"],
            "leaked_slots": s["leaked_slots"], "locked_nodes": s["locked_nodes_at_end"],
            "idle_check_failed": s["idle_check_failed"]}


def _losses(s: dict[str, Any]) -> dict[str, int]:
    r = s.get("resilience") or {}
    return {"dropped_loads": s["dropped_loads"], "partial_loads": s.get("partial_loads", 0),
            "partial_pages_lost": s.get("partial_pages_lost", 0),
            "verify_failures": s["verify_failures"], "offload_failures": s["offload_failures"],
            "offloads_skipped_kv": s.get("offloads_skipped_kv", 0),
            "offloads_dropped": s["offloads_dropped"], "alloc_failures": s["alloc_failures"],
            "retries": r.get("retries", 0), "recovered_keys": r.get("recovered_keys", 0),
            "exhausted_keys": r.get("exhausted_keys", 0), "breaker_trips": r.get("breaker_trips", 0)}


async def compare_plans(cfg: StressConfig, requests: list[WorkloadRequest], plans: list[str],
                        capacity: int, seed: int) -> dict[str, Any]:
    """Replay ``requests`` fault-free and under each plan; store hits kept vs fault-free."""
    out: dict[str, Any] = {}
    for plan in ["", *plans]:
        inner = EmbeddedStore(capacity)
        store: Store = FaultyStore(inner, FaultPlan.parse(plan), seed=seed) if plan else inner
        try:
            res = await StressRun(cfg, store, requests).run(show_progress=False)
        finally:
            await store.close()
        s = res.summary
        out[plan or "none"] = {"store_hit_tokens": s["store_hit_tokens"],
                               "device_hit_tokens": s["device_hit_tokens"],
                               "hit_rate": s["hit_rate"], "seconds": s["seconds"],
                               **_safety(s), **_losses(s)}
    base = out["none"]["store_hit_tokens"]
    total = base + out["none"]["device_hit_tokens"]
    for row in out.values():
        row["store_hits_kept"] = round(row["store_hit_tokens"] / base, 3) if base else None
        # device and store together: a slower store keeps more on the device (offload locks)
        both = row["store_hit_tokens"] + row["device_hit_tokens"]
        row["hits_kept"] = round(both / total, 3) if total else None
    return out


async def _donate(linker: Linker, content: Any, n: int, seed: int) -> None:
    import numpy as np

    from ..testing.fakes import synthetic_prefill

    rng = np.random.default_rng(seed)
    for i in range(n):
        req = linker.request(f"chaos{seed}-{i}", rng.integers(1, 30000, size=65).astype(np.int32))
        await linker.lookup(req)
        await synthetic_prefill(linker, content, req)
        await linker.release(req)


async def close_with_hung_store(config: LinkerConfig) -> dict[str, Any]:
    """Offloads stuck in a store whose puts never return: how long close() takes."""
    from ..testing.content import SyntheticContent
    from ..testing.fakes import GatedStore, small_hybrid_layout

    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=256, mamba_slots=32)
    store = GatedStore(EmbeddedStore(16 * MIB), hold_puts=True)
    linker = Linker(layout, pools, store, config)
    async with linker:
        await _donate(linker, SyntheticContent(pools), 4, seed=1)
        stuck = store.held
        t0 = time.perf_counter()
        await linker.close()
        seconds = time.perf_counter() - t0
    resilience = linker.resilience_statistics()
    pages, slots = linker.leaked()
    store.open()
    return {"close_s": round(seconds, 3), "puts_hung": stuck,
            "close_timeout_s": config.close_timeout_s,
            "close_grace_s": config.resilience.close_grace_s if config.resilience else None,
            "cancelled_on_shutdown": resilience.cancelled_on_shutdown if resilience else 0,
            "locked_nodes": len(linker.tree.tree.locked_nodes()), "leaked_pages": pages,
            "leaked_slots": slots}


async def close_after_killed_master(config: LinkerConfig) -> dict[str, Any]:
    """A linker on Mooncake whose master is SIGKILLed with offloads in flight."""
    from ..stores.mooncake import MooncakeConfig, MooncakeStore
    from ..stores.mooncake_master import MooncakeMaster
    from ..testing.content import SyntheticContent
    from ..testing.fakes import small_hybrid_layout

    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=256, mamba_slots=32)
    with MooncakeMaster() as master:
        store = await MooncakeStore.open(MooncakeConfig(master_address=master.address,
                                                        segment_bytes=64 * MIB))
        try:
            linker = Linker(layout, pools, store, config)
            async with linker:
                content = SyntheticContent(pools)
                await _donate(linker, content, 4, seed=2)
                await linker.drain()
                master.kill()
                await _donate(linker, content, 4, seed=3)  # offloads to a dead master
                t0 = time.perf_counter()
                await linker.close()
                seconds = time.perf_counter() - t0
            pages, slots = linker.leaked()
            r = linker.resilience_statistics()
            return {"close_s": round(seconds, 3), "locked_nodes": len(linker.tree.tree.locked_nodes()),
                    "leaked_pages": pages, "leaked_slots": slots,
                    "breaker_trips": r.breaker_trips if r else 0}
        finally:
            await store.close()


async def soak(cfg: StressConfig, requests: list[WorkloadRequest], args: argparse.Namespace) -> dict[str, Any]:
    """The stress run on Mooncake with the master killed and restarted mid-run."""
    from ..stores.mooncake import MooncakeConfig, MooncakeStore
    from ..stores.mooncake_master import MooncakeMaster, free_port

    master = MooncakeMaster(rpc_port=free_port()).start()
    events: dict[str, Any] = {}
    try:
        inner = await MooncakeStore.open(MooncakeConfig(
            master_address=master.address, segment_bytes=args.store_capacity_mb * MIB))
        store = FaultyStore(inner, FaultPlan.parse(args.soak_faults), seed=args.seed)
        span = max((r.arrival_s for r in requests), default=0.0)
        paced = attrs.evolve(cfg, time_scale=args.soak_seconds / span) if span > 0 else cfg
        run = StressRun(paced, store, requests)

        async def outage() -> None:
            await anyio.sleep(args.soak_kill_at * args.soak_seconds)
            events["store_hits_before_kill"] = run.c["store_hit_tokens"]
            master.kill()
            events["killed_at_request"] = len(run.finished)
            await anyio.sleep(args.soak_outage_s)
            events["store_hits_during_outage"] = run.c["store_hit_tokens"] - events["store_hits_before_kill"]
            await anyio.to_thread.run_sync(master.start)
            events["restarted_at_request"] = len(run.finished)
            events["store_hits_at_restart"] = run.c["store_hit_tokens"]

        t0 = time.perf_counter()
        try:
            with anyio.fail_after(args.soak_limit_s):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(outage)
                    res = await run.run(show_progress=False)
                    tg.cancel_scope.cancel()  # a run shorter than the outage: stop waiting
        finally:
            await store.close()
        s = res.summary
        restarted = "store_hits_at_restart" in events
        return {"completed": True, "seconds": round(time.perf_counter() - t0, 2),
                "faults": args.soak_faults, "outage_s": args.soak_outage_s, **events,
                "store_hits_after_restart": (s["store_hit_tokens"] - events["store_hits_at_restart"]
                                             if restarted else None),
                "store_hit_tokens": s["store_hit_tokens"], **_safety(s), **_losses(s),
                "rejected_calls": (s.get("resilience") or {}).get("rejected_calls", 0),
                "resumes": (s.get("resilience") or {}).get("resumes", 0)}
    finally:
        master.close()


async def run_all(args: argparse.Namespace, cfg: StressConfig,
                  requests: list[WorkloadRequest]) -> dict[str, Any]:
    plans = [p.strip() for p in args.chaos_plans.split(";") if p.strip()]
    out: dict[str, Any] = {"requests": len(requests), "preset": cfg.preset,
                           "concurrency": cfg.concurrency, "time_scale": cfg.time_scale}
    out["plans"] = await compare_plans(cfg, requests, plans, args.store_capacity_mb * MIB, args.seed)
    quick = attrs.evolve(cfg.linker, close_timeout_s=1.0,
                         resilience=attrs.evolve(cfg.linker.resilience or ResiliencePolicy(),
                                                 close_grace_s=0.5))
    out["close_hung_store"] = await close_with_hung_store(quick)
    if not args.no_soak:
        from ..stores.mooncake_master import MooncakeMasterError, find_master_binary

        try:
            find_master_binary()
        except MooncakeMasterError as exc:
            out["soak"] = {"skipped": str(exc)}
            return out
        out["close_killed_master"] = await close_after_killed_master(cfg.linker)
        out["soak"] = await soak(cfg, requests, args)
    return out


def failures(out: dict[str, Any]) -> list[str]:
    """What makes the chaos run fail: anything unsafe, or a soak that never hit again."""
    bad: list[str] = []
    for name, row in out["plans"].items():
        bad += [f"{name}: {k}={v}" for k, v in row.items()
                if k in ("wrong_restores", "leaked_rows", "leaked_slots", "locked_nodes",
                         "idle_check_failed") and v]
    for part in ("close_hung_store", "close_killed_master"):
        row = out.get(part) or {}
        bad += [f"{part}: {k}={v}" for k, v in row.items()
                if k in ("locked_nodes", "leaked_pages", "leaked_slots") and v]
    s = out.get("soak") or {}
    if "completed" in s:
        bad += [f"soak: {k}={v}" for k, v in _safety_keys(s) if v]
        if not s.get("store_hits_after_restart"):
            bad.append("soak: no store hit after the master restarted")
    return bad


def _safety_keys(s: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(k, s.get(k)) for k in ("wrong_restores", "leaked_rows", "leaked_slots",
                                    "locked_nodes", "idle_check_failed")]


def format_chaos(out: dict[str, Any]) -> str:
    rows = []
    for name, r in out["plans"].items():
        rows.append({"plan": name, "store hits": r["store_hit_tokens"], "kept": r["store_hits_kept"],
                     "device+store kept": r["hits_kept"],
                     "wrong/leak/locked": f"{r['wrong_restores']}/{r['leaked_rows'] + r['leaked_slots']}"
                                          f"/{r['locked_nodes']}",
                     "dropped/partial loads": f"{r['dropped_loads']}/{r['partial_loads']}",
                     "verify fails": r["verify_failures"],
                     "skipped kv/lat": f"{r['offloads_skipped_kv']}/{r['offloads_dropped']}",
                     "alloc fails": r["alloc_failures"],
                     "retries (exhausted)": f"{r['retries']} ({r['exhausted_keys']})"})
    text = format_table(rows)
    h = out.get("close_hung_store")
    if h:
        text += (f"\nclose() with a hung store: {h['close_s']} s ({h['puts_hung']} puts hung; "
                 f"close_timeout_s={h['close_timeout_s']}, grace={h['close_grace_s']})")
    k = out.get("close_killed_master")
    if k:
        text += f"\nclose() after a killed Mooncake master: {k['close_s']} s"
    s = out.get("soak") or {}
    if "completed" in s:
        text += (f"\nsoak: {s['seconds']} s, master killed at request {s.get('killed_at_request')}, "
                 f"restarted at {s.get('restarted_at_request')}; store hits before/after restart "
                 f"{s.get('store_hits_before_kill')}/{s.get('store_hits_after_restart')}; "
                 f"wrong/leaked/locked {s['wrong_restores']}/{s['leaked_rows'] + s['leaked_slots']}"
                 f"/{s['locked_nodes']}")
    elif s:
        text += f"\nsoak skipped: {s.get('skipped')}"
    return text


def run_chaos(args: argparse.Namespace, cfg: StressConfig, requests: list[WorkloadRequest]) -> int:
    out = anyio.run(run_all, args, cfg, requests)
    print(format_chaos(out))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    bad = failures(out)
    for line in bad:
        print(f"chaos: {line}", file=sys.stderr)
    return 1 if bad else 0


__all__ = ["add_chaos_arguments", "compare_plans", "format_chaos", "run_chaos"]
