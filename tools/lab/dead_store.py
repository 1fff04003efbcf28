"""How long SGLang's scheduler thread is blocked in the plugin's lookups while the store is dead.

Runs in the SGLang environment (``.ci/sglang-setup.sh``)::

    .venv-sglang/bin/python -m hylinker.tools.lab.dead_store --seconds 60 --json bench-results/dead-store.json

One SGLang cache (``hylinker.tools.harness.sglang_cache``, CPU) with the plugin over a store that never
answers (the fault plan ``latency_ms=3600000``: every call waits an hour). For ``--seconds`` the
scheduler is driven as SGLang drives it: each round calls ``num_completed_offloads`` (SGLang's
``check_hicache_events``), looks up ``--lookups`` new requests and then runs a forward of
``--forward-ms``. Reported: each lookup's blocked time (p50, p99, max), each round's, their total
and its share of the wall time, and the store wrapper's breaker trips and cancelled calls.

Only keys every version of the plugin takes are set (``faults``, ``lookup_timeout_s``), so the
same script measures an older checkout (``PYTHONPATH`` pointing at it) for a before/after.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..bench.output import write_json

HELP = "the SGLang scheduler's time blocked in lookups while the store does not answer (.venv-sglang)"
DEAD = "latency_ms=3600000"


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def measure(seconds: float, lookups_per_round: int, forward_ms: float, lookup_timeout_s: float) -> dict[str, Any]:
    from ..harness.sglang_cache import CacheSpec, SGLangCache, install_cpu_shims, page_keys

    install_cpu_shims()
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    extra = {"faults": DEAD, "lookup_timeout_s": lookup_timeout_s}
    cache = SGLangCache(CacheSpec(), {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang",
                                      "linker_extra_config": extra})
    linker = cache.linker
    per_lookup: list[float] = []
    per_round: list[float] = []
    start = time.perf_counter()
    n = 0
    try:
        while time.perf_counter() - start < seconds:
            linker.num_completed_offloads()
            blocked = 0.0
            for _ in range(lookups_per_round):
                keys = page_keys(list(range(10_000 * n, 10_000 * n + 16)))
                n += 1
                t0 = time.perf_counter()
                linker.lookup(f"r{n}", [PoolTransfer(name=PoolName("kv"), keys=keys)])
                dt = time.perf_counter() - t0
                per_lookup.append(dt)
                blocked += dt
            per_round.append(blocked)
            time.sleep(forward_ms / 1e3)
        wall = time.perf_counter() - start
        res = linker.store.resilience()
        stats = linker.statistics()
    finally:
        cache.close()
    return {
        "seconds": wall, "rounds": len(per_round), "lookups": len(per_lookup),
        "lookup_s": _percentiles(per_lookup), "round_s": _percentiles(per_round),
        "blocked_s": sum(per_lookup), "blocked_share": sum(per_lookup) / wall,
        "breaker_trips": res.breaker_trips, "store_cancelled": getattr(res, "cancelled", None),
        "rejected_calls": res.rejected_calls, "lookup_errors": stats.lookup_errors,
        "config": {"lookups_per_round": lookups_per_round, "forward_ms": forward_ms,
                   "lookup_timeout_s": lookup_timeout_s,
                   "lookup_budget_s": getattr(linker.config, "lookup_budget_s", None)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hylinker.tools.lab.dead_store", description=HELP)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the store is dead (default 60)")
    parser.add_argument("--lookups", type=int, default=4, help="new requests looked up per round (default 4)")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="a round's forward (default 20 ms)")
    parser.add_argument("--lookup-timeout-s", type=float, default=1.0, help="the plugin's key (default 1.0)")
    parser.add_argument("--label", default="", help="a name for this run in the JSON (before / after)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    from ..bench import host as host_probe

    record = measure(args.seconds, args.lookups, args.forward_ms, args.lookup_timeout_s)
    record = host_probe.finish({"label": args.label, "host": host_probe.host_record(), **record})
    print(f"{args.label or 'run'}: {record['lookups']} lookups in {record['rounds']} rounds over "
          f"{record['seconds']:.1f} s of a dead store: blocked {record['blocked_s']:.2f} s "
          f"({100 * record['blocked_share']:.1f} %), lookup p99 {1e3 * record['lookup_s']['p99']:.1f} ms "
          f"max {1e3 * record['lookup_s']['max']:.1f} ms, round p99 {1e3 * record['round_s']['p99']:.1f} ms; "
          f"breaker trips {record['breaker_trips']}, cancelled store calls {record['store_cancelled']}")
    print(host_probe.describe(record["host"]))
    if args.json:
        write_json(args.json, record)
    return 0


__all__ = ["HELP", "main", "measure"]

if __name__ == "__main__":
    raise SystemExit(main())
