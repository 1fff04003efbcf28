"""What a stress run replays and against which store: the workload from the command line
(a trace, the synthetic agentic workload or the production-regime one) and the store it opens
(embedded, Mooncake or UMBP, under a fault plan if one is given)."""

from __future__ import annotations

import argparse
from typing import Any

from ...stores import registry
from ...stores.base import Store, StoreUnavailableError
from ...stores.faulty import FaultPlan
from ...stores.registry import StoreSpec
from ..arguments import UsageError
from ..eviction_returns import TraceClock
from ..workloads import Request as WorkloadRequest
from ..workloads import read_mooncake_trace, synthetic_agentic

MIB = 1 << 20
#: the stress replay's eviction memory budget (the embedded store's default is 4 MiB)
REPLAY_EVICTION_MEMORY_BYTES = 256 * MIB


def load_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.trace is not None:
        if not args.trace.exists():
            raise UsageError(f"--trace: no such file: {args.trace}")
        reqs = read_mooncake_trace(args.trace, first_n=args.requests, time_scale=1.0)
    elif getattr(args, "workload", "agentic") == "production":
        from ..production_workload import production_agentic, production_shape

        shape = production_shape(getattr(args, "workload_param", []), scale=args.synthetic_scale)
        reqs = production_agentic(args.requests or 2000, seed=args.seed, shape=shape)
    else:
        reqs = synthetic_agentic(args.requests or 2500, seed=args.seed, scale=args.synthetic_scale)
    return reqs


async def open_store(args: argparse.Namespace, clock: TraceClock | None = None) -> tuple[Store, Any]:
    """The store the run uses, and an object to close after it (a master we started);
    ``clock`` stamps the embedded store's evictions (trace time)."""
    capacity = args.store_capacity_mb * MIB
    plan = None
    if args.faults or args.fault_rate > 0:
        plan = FaultPlan.parse(args.faults) if args.faults else FaultPlan.uniform(args.fault_rate)
    # a replay ends with its trace: its eviction memory may hold far more than a server's
    # (the published eviction-return figures count every return of a long trace)
    spec = StoreSpec(args.store, capacity, eviction_memory_bytes=REPLAY_EVICTION_MEMORY_BYTES, clock=clock,
                     mooncake={"master_address": args.mooncake_master}, faults=plan, fault_seed=args.seed)
    try:
        opened = await registry.open_store(spec)
    except StoreUnavailableError as exc:  # no UMBP or Mooncake client here, or nothing answers
        where = f" ({args.mooncake_master or 'a loopback master'})" if args.store == "mooncake" else ""
        raise UsageError(f"--store {args.store}{where}: {exc}") from exc
    return opened.store, (opened.master, opened.backend if opened.wrapped else None)


__all__ = ["load_workload", "open_store"]
