"""``hylinker stress``: the command line of the stress tool (the run itself is
:mod:`.run`; its chaos and rank modes are :mod:`hylinker.tools.chaos` and :mod:`.ranks`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from ...components.eviction import EVICTION_POLICIES
from ...runtime.linker.config import LinkerConfig
from ...testing.content import PRESETS
from ..arguments import (
    UsageError,
    fault_plan,
    master_address,
    non_negative_float,
    positive_float,
    positive_int,
    probability,
    share,
    trace_file,
)
from ..chaos import add_chaos_arguments, run_chaos
from ..report import format_stress_summary
from ..workloads import Request as WorkloadRequest
from .ranks import configure as add_rank_arguments
from .ranks import format_ranks_table, run_ranks
from .run import MIB, POLICIES, load_workload, run_stress, stress_config

HELP = "replay a trace (or a synthetic agentic workload) through the runtime; verify every restore"


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--trace", type=trace_file, default=None,
                   help="Mooncake-format JSONL trace (default: the built-in synthetic agentic workload)")
    w.add_argument("--requests", type=positive_int, default=None, metavar="N",
                   help="take the first N requests, N >= 1 (default: all of the trace; 2,500 synthetic)")
    w.add_argument("--time-scale", type=non_negative_float, default=0.0,
                   help="replay arrival times multiplied by this (0: as fast as the queue admits)")
    w.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="start a request that continues an earlier one (the next turn of a "
                        "conversation) only after that one completed")
    w.add_argument("--workload", choices=("agentic", "production"), default="agentic",
                   help="without --trace: the synthetic agentic workload, or the production-regime "
                        "agentic trace (tools/production_workload.py)")
    w.add_argument("--workload-param", action="append", default=[], metavar="FIELD=VALUE",
                   help="a ProductionShape field for --workload production, e.g. hours=2 (repeatable)")
    w.add_argument("--synthetic-scale", type=positive_float, default=0.25,
                   help="size multiplier of the synthetic workload's prompts")
    w.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic workload, the page contents and the fault draws")


def add_geometry_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("geometry")
    g.add_argument("--preset", choices=PRESETS, default="kimi",
                   help="model geometry: kimi (MLA KV + KDA states + a draft layer) or attention (KV only)")
    g.add_argument("--page-size", type=positive_int, default=64, help="tokens per KV page")
    g.add_argument("--chunk-size", type=positive_int, default=64,
                   help="tokens per state checkpoint interval (the grid is a multiple of the page)")
    g.add_argument("--kv-pages", type=positive_int, default=None,
                   help="device KV pool, in pages (default: derived from the workload)")
    g.add_argument("--mamba-slots", type=positive_int, default=None,
                   help="device state pool, in slots (default: derived from the concurrency)")
    g.add_argument("--concurrency", type=positive_int, default=8, help="requests running at once")
    g.add_argument("--max-waiting", type=positive_int, default=1 << 16,
                   help="bound of the waiting queue; an arrival beyond it is rejected (counted)")
    g.add_argument("--policy", choices=POLICIES, default="marconi",
                   help="checkpoint admission: end of prefill / + branch points and last block / "
                        "+ budgeted speculative states / every grid boundary")
    g.add_argument("--eviction", choices=EVICTION_POLICIES, default="lru",
                   help="device-cache eviction: least recently used / recency + compute saved per byte")


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("store")
    s.add_argument("--store", choices=("embedded", "mooncake", "umbp"), default="embedded",
                   help="the in-process store, a Mooncake client, or AMD mori's UMBP client with a "
                        "DRAM tier of --store-capacity-mb (needs amd-mori; on a CPU machine run it in "
                        ".venv-umbp, docs/guide/umbp.md)")
    s.add_argument("--store-capacity-mb", type=positive_int, default=2048,
                   help="the store's capacity (Mooncake: the segment this client contributes), MiB")
    s.add_argument("--mooncake-master", type=master_address, default=None, metavar="HOST:PORT",
                   help="a running mooncake_master (default: start one on loopback)")
    s.add_argument("--fault-rate", type=probability, default=0.0,
                   help="inject store faults (failures, torn/corrupt objects, vanishing keys) at this rate")
    s.add_argument("--faults", type=fault_plan, default=None, metavar="SPEC",
                   help="a full fault plan, e.g. 'fail=0.02,corrupt=0.01,vanish=0.05,latency_ms=1' "
                        "(fields of hylinker.stores.faulty.FaultPlan; overrides --fault-rate)")
    s.add_argument("--touch", action=argparse.BooleanOptionalAction, default=True,
                   help="tell the store about device hits (TOUCH)")
    s.add_argument("--no-mamba-backpressure", action="store_true",
                   help="disable the 3/4-of-the-state-pool offload skip rule")
    s.add_argument("--kv-backpressure-share", type=share, default=LinkerConfig().kv_backpressure_share,
                   help="skip offloads while queued offloads lock this share of the KV pool")
    s.add_argument("--kv-backpressure-wait-s", type=non_negative_float,
                   default=LinkerConfig().kv_backpressure_wait_s,
                   help="two stages: an offload the KV rule would skip first waits this long for copies "
                        "in flight (0: skip at once)")
    s.add_argument("--no-retries", action="store_true",
                   help="talk to the store directly: no retries, timeouts or circuit breaker")


def add_restore_cost_arguments(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("restore cost")
    c.add_argument("--prefill-tokens-per-s", type=non_negative_float, default=0.0,
                   help="model the forward: it sleeps (tokens computed / this rate); reports time to "
                        "first token (0: the forward takes no time)")
    c.add_argument("--decline-slow-restores", action="store_true",
                   help="decline store hits whose load is slower than recomputing them (at that rate)")


def configure(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_geometry_arguments(parser)
    add_store_arguments(parser)
    add_chaos_arguments(parser)
    add_rank_arguments(parser)
    add_restore_cost_arguments(parser)
    o = parser.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    o.add_argument("--plot", type=Path, default=None,
                   help="write a PNG: hit rate (device and store) against its bound over the run, latency CDFs")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--trace-file", type=Path, default=None, metavar="PATH",
                   help="append one JSON line per phase event here (this process's; `hylinker trace PATH` "
                        "draws the timeline)")
    o.add_argument("--metrics-port", type=positive_int, default=None, metavar="PORT",
                   help="serve the Linker's Prometheus metrics on http://127.0.0.1:PORT/metrics during the run")
    o.add_argument("--metrics-linger-s", type=non_negative_float, default=0.0, metavar="S",
                   help="with --metrics-port: keep serving this long after the run (a scraper's last scrapes)")


def run_ranked(args: argparse.Namespace, requests: list[WorkloadRequest]) -> int:
    """``stress --ranks N``: N rank processes; exit 1 on any disagreement, mismatch or leak."""
    s = run_ranks(args, requests)
    print(format_stress_summary(s))
    print(format_ranks_table(s))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(s, indent=2))
        print(f"wrote {args.json}")
    bad = s["rank_disagreements"] or s["restore_mismatches"] or s["leaked_rows"] or s["leaked_slots"] \
        or s["locked_nodes_at_end"] or s["idle_check_failed"] or s["non_writer_replicated_bytes"]
    return 1 if bad else 0


def run(args: argparse.Namespace) -> int:
    if args.metrics_port is not None and (args.chaos or args.ranks > 1):
        raise UsageError("--metrics-port: only a single-process run without --chaos exports metrics")
    if args.trace_file is None:
        return _run(args)
    from ...runtime.dataplane.tracing import disable_trace_logging, enable_trace_logging

    try:
        enable_trace_logging(path=args.trace_file)
    except OSError as exc:
        raise UsageError(f"--trace-file: cannot open {str(args.trace_file)!r} ({exc.strerror or exc})") from None
    try:
        return _run(args)
    finally:
        disable_trace_logging()


def _run(args: argparse.Namespace) -> int:
    requests = load_workload(args)
    if not requests:
        print("stress: the workload is empty", file=sys.stderr)
        return 2
    if args.chaos:
        return run_chaos(args, stress_config(args), requests)
    if args.ranks > 1:
        return run_ranked(args, requests)
    registry = serve_metrics(args.metrics_port) if args.metrics_port is not None else None
    result = anyio.run(run_stress, args, requests, registry)
    s = result.summary
    print(format_stress_summary(s))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(s, indent=2))
        print(f"wrote {args.json}")
    if args.plot is not None:
        from ..plots import plot_stress

        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_stress(str(args.plot), result.hits_over_time, result.latency_s,
                    title=f"hylinker stress: {s['requests']:,} requests, preset {s['preset']}, "
                          f"store {s['store']['name']} {s['store']['capacity_bytes'] / MIB:,.0f} MiB; "
                          f"hit rate {s['hit_rate']:.1%} of bound {s['bound_hit_rate']:.1%}")
        print(f"wrote {args.plot}")
    if s["completed"] == 0:
        print(f"hylinker stress: error: no request of {s['requests']} completed (never fit {s['never_fit']}, "
              f"rejected {s['rejected']}, allocation failures {s['alloc_failures']})", file=sys.stderr)
        return 1
    if registry is not None and args.metrics_linger_s > 0:
        print(f"serving metrics on http://127.0.0.1:{args.metrics_port}/metrics for {args.metrics_linger_s:g} s",
              flush=True)
        time.sleep(args.metrics_linger_s)
    bad = s["restore_mismatches"] or s["leaked_rows"] or s["leaked_slots"] or s["locked_nodes_at_end"] \
        or s["idle_check_failed"]
    return 1 if bad else 0


def serve_metrics(port: int) -> Any:
    """A registry served over HTTP on loopback (``--metrics-port``) for the run's Linker."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise UsageError("--metrics-port needs prometheus_client: pip install prometheus-client") from None
    registry = CollectorRegistry()
    try:
        start_http_server(port, addr="127.0.0.1", registry=registry)
    except OSError as exc:
        raise UsageError(f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror or exc})") from None
    return registry
