"""``hylinker stress --ranks N``: N tensor-parallel ranks, each its own process, linker, pools,
store client and fault injection, agreeing over gloo on loopback.

The store is shared: one ``mooncake_master`` on loopback (started here unless
``--mooncake-master`` names one), one Mooncake client per rank. Each rank replays the same
workload in the same order (:class:`~hylinker.tools.stress.StressRun` with an agreement) and
records, per request, the prefix it stood on after LOOKUP/LOAD/COMMIT. The parent compares
those decisions across ranks: ``rank_disagreements`` counts the requests where they differ
(must be 0). Faults are drawn per rank (seed + rank), so ranks see different store failures.
"""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from ...runtime.linker.agreement import Agreement
from ...stores.base import Store
from ..arguments import positive_float, positive_int
from ..report import percentiles
from ..workloads import Request as WorkloadRequest
from .run import StressRun, stress_config

MIB = 1 << 20
#: per preset, the pools every rank holds the same copy of: MLA's KV (and the draft's), not
#: the recurrent state (sharded over heads)
REPLICATED = {"kimi": ("kv", "draft"), "attention": ()}


async def open_rank_store(args: argparse.Namespace, address: str, rank: int) -> tuple[Store, Store]:
    """This rank's store client (the shared master) and, wrapped around it, this rank's faults."""
    from ...stores.mooncake import MooncakeConfig, MooncakeStore

    inner = await MooncakeStore.open(MooncakeConfig(master_address=address,
                                                    segment_bytes=args.store_capacity_mb * MIB))
    if args.faults or args.fault_rate > 0:
        from ...stores.faulty import FaultPlan, FaultyStore

        plan = FaultPlan.parse(args.faults) if args.faults else FaultPlan.uniform(args.fault_rate)
        return FaultyStore(inner, plan, seed=args.seed + 1000 * (rank + 1)), inner
    return inner, inner


def _us(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0}
    return {k: round(v, 1) for k, v in percentiles([v * 1e6 for v in values], (50, 99)).items()}


async def stress_rank(rank: int, size: int, agreement: Agreement, args: argparse.Namespace,
                      address: str, requests: list[WorkloadRequest]) -> dict[str, Any]:
    """One rank of ``stress --ranks``: its replay's summary, its decisions and its rounds."""
    store, inner = await open_rank_store(args, address, rank)
    cfg = attrs.evolve(stress_config(args), replicated=tuple(args.replicated))
    try:
        run = StressRun(cfg, store, requests, agreement=agreement)
        result = await run.run(show_progress=False)
    finally:
        await store.close()
        if inner is not store:
            await inner.close()
    s = result.summary
    lookups = result.latency_s["lookup"]
    times = agreement.round_seconds.get(("requests", "lookup"))
    rounds = times.since(0) if times is not None else []
    # one round per lookup: the last lookups pair with the rounds still kept
    paired = times is not None and times.count == len(lookups)
    local = [t - r for t, r in zip(lookups[len(lookups) - len(rounds):], rounds)] if paired else []
    stats = run.linker.statistics()
    return {
        "rank": rank,
        "summary": s,
        "decisions": run.decisions,
        "lookup_us": _us(lookups),
        "lookup_round_us": _us(rounds),
        "lookup_local_us": _us(local),
        "rounds": {f"{c}/{p}": v.count for (c, p), v in agreement.round_seconds.items()},
        "round_us": {f"{c}/{p}": _us(list(v.recent)) for (c, p), v in agreement.round_seconds.items()},
        "rank_shortened_lookups": stats.rank_shortened_lookups,
        "rank_shortened_loads": stats.rank_shortened_loads,
        "rank_unsettled_offloads": stats.rank_unsettled_offloads,
        "offloads_verified_replicas": stats.offloads_verified_replicas,
        # rounds whose values did not fit one slot (two collectives instead of one)
        "large_rounds": getattr(agreement, "large_rounds", 0),
    }


def rank_disagreements(per_rank: list[list[tuple[str, int]]]) -> int:
    """Requests whose decision (the prefix a rank stood on) differs between ranks; a request
    one rank served and another did not counts too."""
    maps: list[dict[str, int]] = [{rid: tokens for rid, tokens in d} for d in per_rank]
    ids: set[str] = set().union(*maps)
    return sum(1 for i in ids if len({m.get(i) for m in maps}) > 1)


def summarize(results: list[dict[str, Any]], replicated: tuple[str, ...]) -> dict[str, Any]:
    """Rank 0's summary, the sums of every loss over ranks, and a compact row per rank."""
    out = dict(results[0]["summary"])
    for key in ("restore_mismatches", "leaked_rows", "leaked_slots", "locked_nodes_at_end",
                "idle_check_failed", "alloc_failures", "dropped_loads", "offload_failures"):
        out[key] = sum(r["summary"][key] for r in results)
    out["ranks"] = len(results)
    out["replicated"] = list(replicated)
    out["rank_disagreements"] = rank_disagreements([r["decisions"] for r in results])
    # bytes written per rank; a non-writer rank must write 0 of a replicated pool
    out["non_writer_replicated_bytes"] = sum(
        r["summary"]["bytes_offloaded"].get(p, 0) for r in results[1:] for p in replicated)
    out["per_rank"] = [{
        "rank": r["rank"],
        "bytes_offloaded": r["summary"]["bytes_offloaded"],
        "hit_rate": r["summary"]["hit_rate"],
        "restores_verified": r["summary"]["restores_verified"],
        "restore_mismatches": r["summary"]["restore_mismatches"],
        "dropped_loads": r["summary"]["dropped_loads"],
        "leaked_rows": r["summary"]["leaked_rows"],
        "leaked_slots": r["summary"]["leaked_slots"],
        **{k: r[k] for k in ("rank_shortened_lookups", "rank_shortened_loads", "rank_unsettled_offloads",
                             "offloads_verified_replicas", "large_rounds", "lookup_us", "lookup_round_us",
                             "lookup_local_us", "rounds", "round_us")},
    } for r in results]
    return out


def format_ranks_table(s: dict[str, Any]) -> str:
    """The per-rank lines of a ``--ranks`` run, under the usual summary table."""
    lines = [f"ranks {s['ranks']}  rank_disagreements {s['rank_disagreements']}  replicated "
             f"{','.join(s['replicated']) or '-'}  non-writer replicated bytes {s['non_writer_replicated_bytes']}",
             f"{'rank':>4} {'kv MB':>8} {'mamba MB':>9} {'draft MB':>9} {'hit':>6} {'mism':>5} "
             f"{'drop':>5} {'short lk/ld':>11} {'unsettled':>9} {'lookup p50/p99 us':>18} "
             f"{'round p50/p99 us':>17} {'local p50/p99 us':>17}"]
    for r in s["per_rank"]:
        b = r["bytes_offloaded"]
        lk, rd, lc = r["lookup_us"], r["lookup_round_us"], r["lookup_local_us"]
        lines.append(
            f"{r['rank']:>4} {b.get('kv', 0) / MIB:>8.1f} {b.get('mamba', 0) / MIB:>9.1f} "
            f"{b.get('draft', 0) / MIB:>9.1f} {r['hit_rate']:>6.3f} {r['restore_mismatches']:>5} "
            f"{r['dropped_loads']:>5} {r['rank_shortened_lookups']:>5}/{r['rank_shortened_loads']:<5} "
            f"{r['rank_unsettled_offloads']:>9} {lk['p50']:>8.0f}/{lk['p99']:<9.0f} "
            f"{rd['p50']:>8.0f}/{rd['p99']:<8.0f} {lc['p50']:>8.0f}/{lc['p99']:<8.0f}")
    return "\n".join(lines)


def run_ranks(args: argparse.Namespace, requests: list[WorkloadRequest]) -> dict[str, Any]:
    """Start the shared master (unless given), run every rank, and summarize."""
    from ..ranks import launch

    if args.replicated is None:
        args.replicated = list(REPLICATED[args.preset])
    master = None
    address = args.mooncake_master
    if address is None:
        from ...stores.mooncake_master import MooncakeMaster

        master = MooncakeMaster().start()
        address = master.address
    try:
        results = launch(args.ranks, stress_rank, args, address, requests, timeout_s=args.rank_timeout_s)
    finally:
        if master is not None:
            master.stop()
    return summarize(results, tuple(args.replicated))


def configure(parser: argparse.ArgumentParser) -> None:
    r = parser.add_argument_group("ranks")
    r.add_argument("--ranks", type=positive_int, default=1,
                   help="run N tensor-parallel ranks as N processes agreeing over gloo on loopback; "
                        "they share one Mooncake store (--store is ignored), faults are drawn per rank")
    r.add_argument("--replicated", type=lambda v: [p for p in v.split(",") if p], default=None,
                   metavar="POOLS", help="pools every rank holds the same copy of, written once by rank 0 "
                                         "(default per preset: kimi 'kv,draft', attention none)")
    r.add_argument("--rank-timeout-s", type=positive_float, default=120.0,
                   help="a rank that stops answering fails its peers' rounds after this long")


__all__ = ["REPLICATED", "configure", "format_ranks_table", "rank_disagreements", "run_ranks",
           "stress_rank", "summarize"]
