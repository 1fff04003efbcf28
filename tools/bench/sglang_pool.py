"""SGLang's real cache at a device pool small enough to evict: store hit tokens with the plugin's
two-stage offload against the one-stage offload and an unbounded in-flight limit (issue 52).

Run in ``.venv-sglang``::

    .venv-sglang/bin/python -m hylinker bench-sglang-pool --json bench-results/sglang_pool.json

One process, one workload, three plugin settings side by side (``--modes``):

* ``one-stage``: ``two_stage_offload=False``, the default bound (an offload keeps its node locked
  until the store answers; at most ``offload_max_inflight``, and half the state slots);
* ``two-stage``: the default (SGLang's node unlocks once its bytes are sealed in host staging);
* ``unbounded``: one stage with no in-flight limit (every offload accepted): the reference.

The workload: ``--conversations`` multi-turn conversations served round robin, each turn the
whole history plus ``--turn-tokens`` new tokens, so a conversation's history has left the device
pool (``--kv-pages``) by the time it comes back and can only come from the store. The store is
the embedded one behind a put that takes ``--put-ms`` per call (a remote store's write round
trip); gets and probes do not wait. After each request the scheduler spends ``--step-ms`` (the
request's decode steps) before the next one arrives. Each mode prints store hit tokens, its ratio to the unbounded
mode's, every loss (refused at the bound, refused by host staging, failed, aborted, mismatched),
the seconds requests waited for device rows (as SGLang's scheduler holds a request the pool cannot
take while locked nodes fill it) and the host staging peak.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from .host import describe, finish, host_record

MODES = ("one-stage", "two-stage", "unbounded")
PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
PASS_THROUGH = "deadline_ms=600000"  # a FaultyStore that injects nothing: the slow put is swapped in


def mode_config(mode: str, host_staging_mb: int | None = None) -> dict[str, Any]:
    if mode == "two-stage" and host_staging_mb is not None:
        return {"two_stage_offload": True, "host_staging_bytes": host_staging_mb << 20}
    if mode == "one-stage":
        return {"two_stage_offload": False}
    if mode == "two-stage":
        return {"two_stage_offload": True}
    if mode == "unbounded":
        return {"two_stage_offload": False, "offload_max_inflight": 1 << 30, "offload_max_inflight_mb": 1 << 30}
    raise ValueError(f"unknown mode {mode!r}; known: {MODES}")


def slow_puts(inner: Any, put_s: float) -> Any:
    """``inner`` behind a put that takes ``put_s`` per call (gets, probes: as they are)."""
    from ...testing.fakes import GatedStore

    class SlowPuts(GatedStore):
        async def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> Any:
            await anyio.sleep(put_s)
            return await super().put(keys, buffers)

        async def _put_objects(self, method: str, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> Any:
            await anyio.sleep(put_s)
            return await super()._put_objects(method, keys, parts)

        async def put_rows(self, batch: Any, hashed: bool) -> Any:  # one stage: the rows read in place
            await anyio.sleep(put_s)
            return await super().put_rows(batch, hashed)

    return SlowPuts(inner)


def workload(conversations: int, turns: int, turn_tokens: int) -> list[list[int]]:
    """Round robin over conversations; each request is the conversation's history plus a turn."""
    history: list[list[int]] = [[] for _ in range(conversations)]
    out = []
    for t in range(turns):
        for c in range(conversations):
            base = 1_000_000 * (c + 1) + 10_000 * t
            history[c] = history[c] + list(range(base, base + turn_tokens))
            out.append(list(history[c]))
    return out


def admit(cache: Any, tokens: int, timeout_s: float = 120.0) -> float:
    """SGLang's scheduler admits a request once the pool can hold it: evict what is unlocked,
    and while that is not enough, run scheduler rounds until offloads report (their nodes unlock).
    Returns the seconds the request waited."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    t0 = time.perf_counter()
    while True:
        cache.cache.check_hicache_events()  # a scheduler round
        if cache.allocator.available_size() < tokens:
            cache.cache.evict(EvictParams(num_tokens=tokens))
        if cache.allocator.available_size() >= tokens:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"a request of {tokens} tokens waited {timeout_s} s for device rows")
        time.sleep(0.001)


def run_mode(mode: str, requests: list[list[int]], kv_pages: int, mamba_slots: int, put_ms: float,
             step_ms: float = 0.0, host_staging_mb: int | None = None) -> dict[str, Any]:
    from ..harness.sglang_cache import CacheSpec, SGLangCache

    spec = CacheSpec(kv="mla", num_layers=4, full_layers=(1, 3), kv_pages=kv_pages, mamba_slots=mamba_slots,
                     max_reqs=4, max_context=max(len(r) for r in requests) + 8)
    cache = SGLangCache(spec, {**PLUGIN, "linker_extra_config": {
        "faults": PASS_THROUGH, "store_timeout_s": 60.0, "capacity_mb": 1024, **mode_config(mode, host_staging_mb)}})
    linker = cache.linker
    linker.store._inner = slow_puts(linker.store.inner, put_ms / 1e3)
    out: dict[str, Any] = {"mode": mode, "requests": len(requests)}
    step_s = step_ms / 1e3
    store_hit = device_hit = aborted = mismatches = 0
    waited_s = 0.0
    offload_ms: list[float] = []
    t0 = time.perf_counter()
    try:
        for tokens in requests:
            waited_s += admit(cache, len(tokens))
            served = cache.serve(tokens, settle=False)
            store_hit += served.store_hit
            device_hit += served.device_hit
            aborted += int(served.aborted)
            mismatches += len(served.restore_mismatches)
            offload_ms.append(served.offload_s * 1e3)
            time.sleep(step_s)  # the rest of the request's steps (decode) before the next one
        wall_s = time.perf_counter() - t0  # the requests served (offloads may still drain)
        cache.settle(timeout_s=120.0)
        stats = linker.statistics()
        cache.evict_all()
        leaks = cache.leaks()
    finally:
        cache.close()
    out.update(store_hit_tokens=store_hit, device_hit_tokens=device_hit, aborted=aborted,
               restore_mismatches=mismatches, admission_wait_s=round(waited_s, 3), wall_s=round(wall_s, 3),
               offloads_ok=stats.offloads_ok, offloads_failed=stats.offloads_failed,
               offloads_refused=stats.offloads_refused, offloads_refused_staging=stats.offloads_refused_staging,
               offloads_in_flight_peak=stats.offloads_in_flight_peak,
               host_staging_capacity_bytes=stats.host_staging_capacity_bytes,
               host_staging_peak_bytes=stats.host_staging_peak_bytes,
               offload_ms_median=round(statistics.median(offload_ms), 3) if offload_ms else 0.0,
               leaks=leaks)
    return out


#: the table's columns: heading -> how a result shows there
COLUMNS: dict[str, Callable[[dict[str, Any]], object]] = {
    "mode": lambda r: r["mode"],
    "store hit tokens": lambda r: r["store_hit_tokens"],
    "refused (bound)": lambda r: r["offloads_refused"],
    "refused (host staging full)": lambda r: r["offloads_refused_staging"],
    "failed": lambda r: r["offloads_failed"],
    "aborted": lambda r: r["aborted"],
    "mismatches": lambda r: r["restore_mismatches"],
    "admission wait s": lambda r: r["admission_wait_s"],
    "wall s": lambda r: r["wall_s"],
    "in flight peak": lambda r: r["offloads_in_flight_peak"],
    "staging peak / budget MiB": lambda r: (f"{r['host_staging_peak_bytes'] / 2**20:.2f} / "
                                             f"{r['host_staging_capacity_bytes'] / 2**20:.2f}"),
}


def table(results: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one row per mode, with its store hit tokens over the unbounded mode's."""
    ref = next((r["store_hit_tokens"] for r in results if r["mode"] == "unbounded"), 0)
    names = [*COLUMNS, "of unbounded"]
    rows = [[str(show(r)) for show in COLUMNS.values()] + [f"{r['store_hit_tokens'] / ref:.3f}" if ref else "n/a"]
            for r in results]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [names, ["---"] * len(names), *rows])


def main(argv: Sequence[str] | None = None) -> int:
    from .output import write_json

    parser = argparse.ArgumentParser(prog="hylinker bench-sglang-pool", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--kv-pages", type=int, default=512, help="SGLang's device KV pool (tokens, page 1)")
    parser.add_argument("--mamba-slots", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--put-ms", type=float, default=20.0, help="store put latency per call")
    parser.add_argument("--step-ms", type=float, default=40.0,
                        help="scheduler time per request after its prefill (its decode steps)")
    parser.add_argument("--host-staging-mb", type=int, default=None,
                        help="two-stage: host_staging_bytes in MiB (default: the plugin's derived budget)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    host = host_record()
    requests = workload(args.conversations, args.turns, args.turn_tokens)
    results = [run_mode(m, requests, args.kv_pages, args.mamba_slots, args.put_ms, args.step_ms,
                        args.host_staging_mb) for m in args.modes]
    host = finish(host)
    print(describe(host))
    print(table(results))
    if args.json is not None:
        record = {"host": host, "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "results": results}
        print(f"wrote {write_json(args.json, record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
