"""``hylinker soak``: run a runtime for MINUTES under constant traffic with faults, and fail
when its memory, threads, descriptors or tasks grow (issue 53).

The fronts are :mod:`.soak_fronts` (``linker``, ``dataplane``) and :mod:`.soak_sglang`
(``sglang``: the SGLang plugin through SGLang's own cache, in SGLang's environment); the
sampling, the growth rule, the table and the plot are :mod:`.soak_measure`. Exit status 0:
nothing grew after the warm-up beyond its tolerance; 1: something did (the table says what);
2: a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio

from ..stores.eviction_memory import DEFAULT_BUDGET_BYTES
from .arguments import UsageError, fault_plan, non_negative_float, positive_float, positive_int
from .soak_fronts import SoakOptions
from .soak_measure import TOLERANCES, Sample, Sampler, Tolerance, plot, report

HELP = "run a runtime for MINUTES under constant traffic with faults; exit 1 if memory, threads, fds or tasks grow"
FRONTS = ("linker", "dataplane", "sglang", "vllm", "vllm-engine")
#: the vLLM front's default store: fills in the warm-up and evicts all the time, restores still hit
VLLM_STORE_KIB = 16 << 10


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--front", choices=FRONTS, default="linker",
                        help="the runtime driven: the Linker, the synchronous data plane (issue 53's "
                             "held-out loop), the SGLang plugin in SGLang's cache (.venv-sglang) or the "
                             "vLLM connector in a vLLM engine (.venv-vllm); vllm-engine: the same engine "
                             "and traffic without the connector, the control for vLLM's own memory")
    parser.add_argument("--minutes", type=positive_float, default=1.0, help="how long the traffic runs")
    parser.add_argument("--iterations", type=positive_int, default=None,
                        help="dataplane: stop after this many iterations instead of --minutes")
    parser.add_argument("--warmup-s", type=non_negative_float, default=None,
                        help="seconds before growth counts (default: a fifth of the run)")
    parser.add_argument("--interval-s", type=positive_float, default=5.0, help="seconds between samples")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="sample the Python heap with tracemalloc (slower) and list its top growth by file")
    parser.add_argument("--concurrency", type=positive_int, default=8, help="requests running at once")
    parser.add_argument("--rate", type=non_negative_float, default=SoakOptions().rate,
                        help="linker: requests started per second, all workers together (constant "
                             "traffic); 0: as fast as the workers go")
    parser.add_argument("--kv-pages", type=positive_int, default=SoakOptions().kv_pages,
                        help="linker: the device KV pool, pages of 16 tokens")
    parser.add_argument("--store-kib", type=positive_int, default=None,
                        help="embedded store capacity, KiB: small, so it evicts all the time "
                             f"(default {SoakOptions().store_kib}; vllm: {VLLM_STORE_KIB}, its pages are 96 KiB) "
                             "(sglang, vllm: whole MiB, at least 1, the plugin's capacity_mb)")
    parser.add_argument("--faults", type=fault_plan, default=SoakOptions().faults,
                        help="the store's fault plan (the `stress --faults` syntax)")
    parser.add_argument("--restart-every-s", type=non_negative_float, default=120.0,
                        help="seconds between store restarts (an outage, then an empty store); 0: none")
    parser.add_argument("--outage-s", type=non_negative_float, default=3.0, help="how long a restart's outage lasts")
    parser.add_argument("--rss-tolerance-mib", type=positive_float, default=TOLERANCES["rss_mib"].absolute,
                        help="resident memory growth allowed after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--malloc-trim", action="store_true",
                        help="give glibc's free memory back before each sample, so resident memory counts "
                             "live objects (an engine's allocator may hold hundreds of MiB it freed)")
    parser.add_argument("--json", type=Path, default=None, help="write the samples and the verdict here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of every metric against time")
    parser.add_argument("--plot-from", type=Path, default=None,
                        help="no run: draw --plot from an earlier run's --json (an engine's environment may "
                             "lack matplotlib)")


def options(args: argparse.Namespace) -> SoakOptions:
    if args.iterations is not None and args.front != "dataplane":
        raise UsageError("--iterations applies to --front dataplane only")
    store_kib = args.store_kib or (VLLM_STORE_KIB if args.front.startswith("vllm") else SoakOptions().store_kib)
    return SoakOptions(minutes=args.minutes, iterations=args.iterations or 0, concurrency=args.concurrency,
                       store_kib=store_kib, kv_pages=args.kv_pages, faults=args.faults, restart_every_s=args.restart_every_s,
                       outage_s=args.outage_s, seed=args.seed, rate=args.rate)


def redraw(source: Path, target: Path) -> int:
    """``--plot-from``: the plot of an earlier run, from its JSON."""
    try:
        saved = json.loads(source.read_text())
        samples = [Sample(float(x["t_s"]), int(x["done"]),
                          {k: float(v) for k, v in x.items() if k not in ("t_s", "done")})
                   for x in saved["samples"]]
        front, warmup_s = str(saved["front"]), float(saved["warmup_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--plot-from {source}: not a soak's --json ({exc})") from exc
    minutes = samples[-1].t_s / 60 if samples else 0.0
    plot(target, samples, warmup_s, f"hylinker soak --front {front} ({minutes:.0f} min; warm-up shaded)")
    print(f"wrote {target}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.plot_from is not None:
        if args.plot is None:
            raise UsageError("--plot-from needs --plot (the PNG to write)")
        return redraw(args.plot_from, args.plot)
    opts = options(args)
    warmup_s = args.warmup_s if args.warmup_s is not None else opts.seconds / 5
    sampler = Sampler(args.interval_s, trace_heap=args.tracemalloc, trim=args.malloc_trim)
    tolerances = dict(TOLERANCES)
    tolerances["rss_mib"] = Tolerance(args.rss_tolerance_mib, unit=" MiB")
    summary: dict[str, Any]
    if args.front == "linker":
        from .soak_fronts import linker_front

        # bounded by what is in flight: the tasks and pages held swing with the offloads in
        # flight (one settlement task each, their paths locked; the KV backpressure rule bounds
        # them by the pool), so what is checked is what the work in flight does not account
        # for: tasks beyond the settlements (a worker may be between requests), pages held
        # beyond the locked paths and the requests' rows, and locks nobody in flight holds
        del tolerances["tasks"]
        tolerances["tasks_beyond_in_flight"] = Tolerance(float(opts.concurrency))
        tolerances["pages_beyond_in_flight"] = Tolerance(0.0)
        tolerances["locks_beyond_in_flight"] = Tolerance(0.0)
        tolerances["diag_kib"] = Tolerance(DEFAULT_BUDGET_BYTES / 1024, unit=" KiB")
        summary = anyio.run(linker_front, opts, sampler, warmup_s)
    elif args.front == "dataplane":
        from .soak_fronts import dataplane_front

        summary = dataplane_front(opts, sampler, warmup_s)
    elif args.front == "vllm":
        from .soak_vllm import vllm_front

        # requests are served one at a time: the scheduler tracks the live one; the store's loop
        # runs one task per transfer in flight beside its own
        tolerances["tasks_beyond_in_flight"] = Tolerance(1.0)
        del tolerances["tasks"]
        tolerances["requests_tracked"] = Tolerance(1.0)
        tolerances["index_beyond_store"] = Tolerance(32.0)  # one request's objects, reported late
        tolerances["diag_kib"] = Tolerance(DEFAULT_BUDGET_BYTES / 1024, unit=" KiB")
        summary = vllm_front(opts, sampler, warmup_s)
    elif args.front == "vllm-engine":
        from .soak_vllm import vllm_front

        del tolerances["tasks"]  # no store loop: the engine alone
        summary = vllm_front(opts, sampler, warmup_s, connector=False)
    else:
        from .soak_sglang import sglang_front

        # requests are served one at a time; the plugin's completion FIFO holds what is in flight
        tolerances["tasks"] = Tolerance(1.0)
        tolerances["offloads_held"] = Tolerance(1.0)
        tolerances["diag_kib"] = Tolerance(DEFAULT_BUDGET_BYTES / 1024, unit=" KiB")
        summary = sglang_front(opts, sampler, warmup_s)
    sampler.finish()
    text, grew = report(sampler.samples, warmup_s, sampler.heap_top, summary, tolerances)
    print(f"soak --front {args.front}: {len(sampler.samples)} samples over "
          f"{sampler.samples[-1].t_s / 60 if sampler.samples else 0:.1f} min")
    print(text)
    print("GREW: see the table above" if grew else "flat: nothing grew beyond its tolerance")
    if args.json is not None:
        args.json.write_text(json.dumps({"front": args.front, "warmup_s": warmup_s, "grew": grew,
                                         "summary": summary,
                                         "samples": [{"t_s": round(s.t_s, 2), "done": s.done, **s.values}
                                                     for s in sampler.samples]}, indent=1))
    if args.plot is not None:
        length = f"{opts.iterations} iterations" if opts.iterations else f"{opts.minutes:g} min"
        try:
            plot(args.plot, sampler.samples, warmup_s, f"hylinker soak --front {args.front} ({length}; warm-up shaded)")
        except ImportError as exc:  # an engine's environment without matplotlib: the verdict stands
            print(f"soak: no plot written: {exc}", file=sys.stderr)
    sys.stdout.flush()
    return 1 if grew else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hylinker soak", description=HELP)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
