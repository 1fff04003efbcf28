"""``hylinker bench``: control-path latency, event-loop lag and the data path, as JSON.

Timing lives here, never in tests. Every figure is measured side by side in one run and
printed; ``--json PATH`` writes one object::

    {"control_path": {"lookup_us": {"16k": {"p50", "p99"}, "128k": {...}},
                      "restore_us": {"16k": {...}, "128k": {...}}},
     "loop_lag_ms": {"p50", "p99", "offloaded_bytes", "seconds"},
     "data_path": [{"store", "object_bytes", "segments", "objects", "direction", "runtime_gbps",
                    "in_place_gbps", "staged_gbps", "raw_gbps", "memcpy_gbps", "torch_copy_gbps",
                    "runtime_vs_raw", "runtime_vs_memcpy", "raw_vs_memcpy", "runtime_median_gbps",
                    "raw_median_gbps",
                    "runtime_vs_raw_median", "rounds", "rounds_lost", "load_average"}...],
     "key_hashing": {...},
     "python_calls": [{"shape", "object_bytes", "segments", "objects", "offload_calls_per_object",
                       "load_calls_per_object", "verify_all_load_calls_per_object", ...}...],
     "integrity_levels": [{"store", "object_bytes", "direction", "checksum_gbps", "header_gbps",
                           "raw_gbps", "checksum_vs_raw", "header_vs_raw", ..._median...}...],
     "host": {"cores", "usable_cores", "memcpy_gbps", "load_average", "load_average_end", ...}}

``host`` (``tools/bench/host.py``): the machine, with its memcpy GB/s measured in this run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from ...components.layout import ModelLayout
from ...components.pools import HybridPools
from ...runtime.linker.config import LinkerConfig
from ...runtime.linker.facade import Linker
from ...stores.base import Store, StoreUnavailableError
from ...stores.embedded import EmbeddedStore
from ..arguments import MOONCAKE_INSTALL, UsageError, positive_int, require_package
from .output import write_json
from .runtime import runtime_transfer
from .store import FAULTED_IN, fault_in

HELP = "benchmarks: control path, event-loop lag, data path (JSON with --json PATH)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes")
    parser.add_argument("--only", choices=["control", "lag", "data", "keys", "facade", "levels", "steps", "calls"],
                        action="append",
                        help="run only these sections (repeatable; 'levels' is --integrity-levels alone; "
                             "'steps': µs per object of each data-path step, 'calls': Python calls per object through "
                             "the synchronous data plane at 64 KiB, 1 MiB and a 24-segment page; "
                             "neither in the default set)")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help="data path: interleaved rounds, best and median kept (default 5, 3 with --quick)")
    parser.add_argument("--mooncake", choices=["auto", "yes", "no"], default="auto",
                        help="include Mooncake in the data path (auto: when importable)")
    parser.add_argument("--integrity-levels", action="store_true",
                        help="also compare the runtime at integrity 'checksum' and 'header' with the raw store "
                             "(every store and object shape of 'data'; JSON 'integrity_levels')")


def run(args: argparse.Namespace) -> int:
    from .host import describe, finish, host_record

    if args.mooncake == "yes":
        require_package("mooncake.store", "--mooncake yes", MOONCAKE_INSTALL)
    sections = set(args.only or ["control", "lag", "data", "keys", "facade"])
    host = host_record()
    print(describe(host))
    out: dict[str, Any] = {}
    if "keys" in sections:
        out["key_hashing"] = _key_hashing(args.quick)
        _print_section("key hashing (ms per prompt)", out["key_hashing"])
    if "control" in sections:
        out["control_path"] = anyio.run(control_path, args.quick)
        _print_section("control path (µs)", out["control_path"])
    if "lag" in sections:
        out["loop_lag_ms"] = anyio.run(loop_lag, args.quick)
        _print_section("event-loop lag while offloading", out["loop_lag_ms"])
    if "data" in sections:
        out["data_path"] = data_path(args.quick, args.mooncake, args.rounds)
        _print_data_path(out["data_path"])
    if args.integrity_levels or "levels" in sections:
        out["integrity_levels"] = data_path(args.quick, args.mooncake, args.rounds, variants=LEVEL_VARIANTS)
        _print_data_path(out["integrity_levels"], LEVEL_VARIANTS, "integrity levels, runtime vs raw store")
    if "steps" in sections:
        from .steps import object_steps, print_steps

        n, reps = (64, 5) if args.quick else (256, 15)
        out["object_steps"] = [object_steps(size, n, reps, (64 if args.quick else 256) << 20)
                               for size in (64 << 10, 1 << 20)]
        print_steps(out["object_steps"])
    if "calls" in sections:
        from .calls import all_shapes, print_calls

        out["python_calls"] = all_shapes(args.quick)
        print_calls(out["python_calls"])
    if "facade" in sections:
        out["sync_facade_us"] = sync_facade(args.quick)
        _print_section("synchronous facade: µs per call, facade vs the async call on the loop",
                       out["sync_facade_us"])
    out["host"] = finish(host)
    print(describe(out["host"]))
    if args.json is not None:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0


def _pct(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"p50": round(float(np.percentile(a, 50)), 1), "p99": round(float(np.percentile(a, 99)), 1),
            "n": len(values)}


def _print_section(title: str, data: dict[str, Any]) -> None:
    print(f"\n== {title}")
    print(json.dumps(data, indent=1))


def _key_hashing(quick: bool) -> dict[str, Any]:
    """Page-key hashing of a 128K-token prompt, ms, per page size."""
    from .keys import measure_key_hashing

    res = measure_key_hashing(repeats=3 if quick else 7)
    return {f"page_{page}": figures for page, figures in res.items()}


# ---- control path -------------------------------------------------------------------

def control_layout(page: int = 64) -> ModelLayout:
    """A small-row layout: the control path, not bytes, dominates."""
    return ModelLayout.create(page_size=page, chunk_size=64, full_layers=[0], kv_row_shape=[64],
                              kv_dtype="uint8",
                              mamba_layers=[{"layer_id": 1, "conv_shape": (4, 64), "conv_dtype": "float32",
                                             "temporal_shape": (64, 64), "temporal_dtype": "float32"}])


async def control_path(quick: bool = False) -> dict[str, Any]:
    """Scheduler-visible lookup cost and the whole lookup→load→commit path."""
    layout = control_layout()
    repeats = 10 if quick else 40
    out: dict[str, Any] = {"lookup_us": {}, "restore_us": {}, "layout": "page 64, grid 64, 1 KV layer x 64 B, 1 state"}
    store = EmbeddedStore(1 << 30)
    rng = np.random.default_rng(0)
    for label, n_tokens in (("16k", 16384), ("128k", 131072)):
        pools = HybridPools(layout, kv_pages=n_tokens // 64 + 64, mamba_slots=8)
        tokens = rng.integers(1, 50000, n_tokens + 1)
        async with Linker(layout, pools, store, LinkerConfig(touch=False)) as lk:
            req = lk.request("seed", tokens)
            await lk.lookup(req)
            lk.extend(req, n_tokens)
            depth = lk.checkpoint_depth(req, n_tokens)
            assert depth is not None
            cs = lk.checkpoint_slot(req)
            await lk.insert(req, depth, checkpoint_slot=cs)
            await lk.release(req)
            await lk.drain()
            lk.flush_device()
            lookups: list[float] = []
            restores: list[float] = []
            for i in range(repeats):
                r = lk.request(f"l{i}", tokens)
                t0 = time.perf_counter()
                hit = await lk.lookup(r)
                lookups.append((time.perf_counter() - t0) * 1e6)
                assert hit.store_tokens == depth, (hit, depth)
                await lk.release(r)
                r = lk.request(f"r{i}", tokens)
                t0 = time.perf_counter()
                await lk.lookup(r)
                load = await lk.load(r)
                assert load is not None
                restored = await lk.commit(load)
                restores.append((time.perf_counter() - t0) * 1e6)
                assert restored == depth
                await lk.release(r)
                lk.flush_device()
            out["lookup_us"][label] = _pct(lookups)
            out["restore_us"][label] = _pct(restores)
    await store.close()
    return out


# ---- loop lag -------------------------------------------------------------------------

async def loop_lag(quick: bool = False) -> dict[str, Any]:
    """Event-loop lag (timer overshoot, 1 ms ticks) while the actors move ~1 GB of offloads."""
    total = (256 if quick else 1024) << 20
    page = 64
    row = 16384  # 1 MiB KV page objects
    layout = ModelLayout.create(page_size=page, full_layers=[0], kv_row_shape=[row], kv_dtype="uint8")
    pages_per_req = 64
    n_req = max(1, total // (pages_per_req * page * row))
    pools = HybridPools(layout, kv_pages=pages_per_req * 4)
    store = EmbeddedStore(total + (64 << 20))
    lags: list[float] = []
    stop = anyio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(max(0.0, (time.perf_counter() - t0) * 1e3 - 1.0))

    rng = np.random.default_rng(1)
    t_start = time.perf_counter()
    async with Linker(layout, pools, store, LinkerConfig(touch=False, latency_high_ms=1e6,
                                                          latency_low_ms=1e5)) as lk:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for i in range(n_req):
                tokens = rng.integers(1, 50000, pages_per_req * page + 1)
                r = lk.request(f"o{i}", tokens)
                await lk.lookup(r)
                rows = lk.extend(r, pages_per_req * page)
                # the "forward" writing the rows is device work: keep it off the loop
                await anyio.to_thread.run_sync(pools.kv.tensor.index_fill_, 1, rows, 7)
                await lk.insert(r, pages_per_req * page)
                await lk.release(r)
                await lk.drain()
                lk.flush_device()
            stop.set()
        offloaded = sum(s.bytes_offloaded for s in lk.pool_statistics().values())
    await store.close()
    res = _pct(lags)
    return {"p50": round(res["p50"], 3), "p99": round(res["p99"], 3), "ticks": len(lags),
            "offloaded_bytes": offloaded, "seconds": round(time.perf_counter() - t_start, 2)}


# ---- data path ------------------------------------------------------------------------

StoreFactory = Callable[[int], Awaitable[Store]]



#: the data path's objects: (bytes with the header, segments): 64 KiB and 1 MiB in one layer,
#: and a Qwen3-Next-like page (768 KiB in 24 segments: 12 full-attention layers' K and V, page
#: 64, 512-byte rows; laid out here as 24 one-part layers)
SHAPES: tuple[tuple[int, int], ...] = ((64 << 10, 1), (1 << 20, 1), ((768 << 10) + 64, 24))

#: what the data path compares with the raw store API, by name: ``runtime_transfer`` keywords
DEFAULT_VARIANTS: dict[str, dict[str, Any]] = {
    "runtime": {},  # the default (in place from LinkerConfig.in_place_min_bytes up, staged below)
    "in_place": {"in_place_min_bytes": 0},  # in place forced at every size
    "staged": {"in_place": False},  # staged forced
}
#: ``--integrity-levels``: the runtime's default paths at each integrity level
LEVEL_VARIANTS: dict[str, dict[str, Any]] = {
    "checksum": {"integrity": "checksum"},
    "header": {"integrity": "header"},
}


def data_path(quick: bool, mooncake: str = "auto", rounds: int | None = None,
              variants: dict[str, dict[str, Any]] | None = None,
              stores: tuple[str, ...] | None = None,
              shapes: tuple[tuple[int, int], ...] = SHAPES) -> list[dict[str, Any]]:
    """Offload then load through the runtime (each of ``variants``), the store's raw batch
    API, and memcpy. ``stores``: only these setups (None: all); ``shapes``: (object bytes,
    segments) of the objects moved.

    ``memcpy_gbps`` is ``numpy.copyto`` per object between two preallocated buffers: the copy
    routine the embedded store runs, so raw/memcpy compares like with like;
    ``torch_copy_gbps`` is ``Tensor.copy_`` on one thread, for reference (slower here). Each
    variant ``v`` gives ``v_gbps`` (best of the rounds), ``v_median_gbps``, ``v_vs_raw`` (best
    over best) and ``v_vs_raw_median``."""
    import contextlib
    import os

    rounds = rounds if rounds is not None else (3 if quick else 5)
    variants = variants if variants is not None else DEFAULT_VARIANTS

    from .store import measure_raw_vs_memcpy

    rows: list[dict[str, Any]] = []
    runs = itertools.count()  # each runtime round's keys are its own
    total = (128 if quick else 256) << 20
    with contextlib.ExitStack() as stack:
        setups: list[tuple[str, Callable[[int], Any]]] = [("embedded", lambda cap: EmbeddedStore(cap))]
        if mooncake != "no":
            try:
                from .mooncake import mooncake_setups

                setups.extend(mooncake_setups(stack, segment_bytes=8 * total))
            except (ImportError, RuntimeError, StoreUnavailableError) as exc:  # no client, master or binary
                if mooncake == "yes":
                    raise UsageError(f"--mooncake yes: {exc}") from None
                print(f"bench: skipping Mooncake ({exc})")
        for name, make in setups:
            if stores is not None and name not in stores:
                continue
            for object_bytes, segments in shapes:
                n = max(16, total // object_bytes)
                if name == "mooncake-remote" and object_bytes < (1 << 20):
                    n = min(n, 1024)  # big batches of small objects stall over loopback TCP
                factory: Callable[[], Any] = functools.partial(_warm_store, make, total * 8, object_bytes, n)

                async def _rt(make: Callable[[int], Any] = make, object_bytes: int = object_bytes,
                              n: int = n, segments: int = segments, **options: Any) -> dict[str, float]:
                    store = await _maybe_await(make(total * 8))
                    try:
                        await fault_in(store, object_bytes, n)
                        return await runtime_transfer(store, object_bytes, n, segments=segments,
                                                      run=f"-{next(runs)}", **options)
                    finally:
                        await store.close()

                # every variant and the raw store API, interleaved in every round (the order
                # rotates), so all see the same machine; best and median over the rounds
                paths: dict[str, Callable[[], Any]] = {v: functools.partial(_rt, **kw) for v, kw in variants.items()}
                samples: dict[str, dict[str, list[float]]] = {
                    p: {"put": [], "get": []} for p in ("raw", "memcpy", "torch_copy", *paths)}
                lost = dict.fromkeys(paths, 0)  # rounds a variant did not restore every object in
                load_before = os.getloadavg()[0]
                order = ["raw", *paths]
                for k in range(rounds):
                    for p in order[k % len(order):] + order[:k % len(order)]:
                        if p == "raw":
                            for r in measure_raw_vs_memcpy(factory, object_bytes, n, repeats=1):
                                d = r["direction"]
                                samples["raw"][d].append(r["raw_gbps"])
                                samples["memcpy"][d].append(r["numpy_gbps"])
                                samples["torch_copy"][d].append(r["memcpy_gbps"])
                        else:
                            got = anyio.run(paths[p])
                            if got.get("restored_fraction", 1.0) < 1.0:  # a loss, not a figure
                                lost[p] += 1
                                print(f"bench: {name} {object_bytes} B x {segments}, {p}: round lost "
                                      f"(restored {got['restored_fraction']:.3f} of the objects)")
                                continue
                            for d in ("put", "get"):
                                samples[p][d].append(got[d])
                load_after = os.getloadavg()[0]
                for direction in ("put", "get"):
                    best = {p: max(v[direction], default=0.0) for p, v in samples.items()}
                    med = {p: float(np.median(v[direction])) if v[direction] else 0.0 for p, v in samples.items()}
                    row: dict[str, Any] = {"store": name, "object_bytes": object_bytes, "segments": segments,
                                           "objects": n, "direction": direction}
                    for v in variants:
                        row[f"{v}_gbps"] = round(best[v], 2)
                    for p in ("raw", "memcpy", "torch_copy"):
                        row[f"{p}_gbps"] = round(best[p], 2)
                    for v in variants:
                        row[f"{v}_vs_raw"] = round(best[v] / best["raw"], 3) if best["raw"] else None
                        row[f"{v}_vs_memcpy"] = round(best[v] / best["memcpy"], 3) if best["memcpy"] else None
                        row[f"{v}_median_gbps"] = round(med[v], 2)
                        row[f"{v}_vs_raw_median"] = round(med[v] / med["raw"], 3) if med["raw"] else None
                    row["raw_median_gbps"] = round(med["raw"], 2)
                    row["raw_vs_memcpy"] = round(best["raw"] / best["memcpy"], 3) if best["memcpy"] else None
                    row["rounds"] = rounds
                    row["rounds_lost"] = sum(lost.values())
                    row["load_average"] = [round(load_before, 2), round(load_after, 2)]
                    rows.append(row)
    return rows


async def _warm_store(make: Callable[[int], Any], capacity: int, object_bytes: int, n: int) -> Store:
    store: Store = await _maybe_await(make(capacity))
    await fault_in(store, object_bytes, n)
    return store


async def _maybe_await(x: Any) -> Any:
    if hasattr(x, "__await__"):
        return await x
    return x


def _print_data_path(rows: list[dict[str, Any]], variants: dict[str, dict[str, Any]] = DEFAULT_VARIANTS,
                     title: str = "data path") -> None:
    from ..report import format_table

    print(f"\n== {title} (GB/s; best of {rows[0]['rounds'] if rows else 0} interleaved rounds, "
          "ratios of the best and of the medians)")
    print(FAULTED_IN)
    first = next(iter(variants))
    ratios = [f"{first}_vs_raw", f"{first}_vs_raw_median"] if variants is DEFAULT_VARIANTS else [
        f"{v}_vs_raw{m}" for m in ("", "_median") for v in variants]
    ratios += [f"{v}_vs_memcpy" for v in variants] + ["raw_vs_memcpy"]
    print(format_table(rows, ["store", "object_bytes", "segments", "direction", *(f"{v}_gbps" for v in variants),
                              "raw_gbps", "memcpy_gbps", *ratios, "rounds_lost", "load_average"]))


# ---- synchronous facade ----------------------------------------------------------------

def sync_facade(quick: bool = False) -> dict[str, Any]:
    """What a synchronous scheduler pays per call for the background loop: the facade's
    ``exists`` / one-page ``load`` / one-page ``offload`` from the calling thread (submit +
    wait on the future) against the same async call made on the loop itself."""
    from ...components.layout import PoolKind
    from ...components.pool_view import PoolSet, kv_view
    from ...runtime.dataplane.plane import DataPlane, Transfer
    from ...runtime.dataplane.sync_plane import SyncDataPlane

    n = 200 if quick else 1000
    page = 16
    k = [torch.zeros(page * 64, 256, dtype=torch.uint8) for _ in range(4)]
    views = PoolSet([kv_view(k, layer_ids=[0, 1, 2, 3], page_size=page)])
    rows = torch.arange(page)

    def calls(i: int) -> dict[str, Any]:
        return {
            "exists": ({PoolKind.FULL: [f"k{i % 8}"]},),
            "offload": ([Transfer(PoolKind.FULL, [f"k{i}"], rows)],),
            "load": ([Transfer(PoolKind.FULL, [f"k{i % 8}"], rows + page)],),
        }

    def facade() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"exists": [], "offload": [], "load": []}
        with SyncDataPlane(views, lambda: EmbeddedStore(256 << 20)) as dp:
            for i in range(n):
                for name, args in calls(i).items():
                    t0 = time.perf_counter()
                    if name == "exists":
                        dp.exists(*args).result()
                    elif name == "offload":
                        dp.offload(*args).result()
                    else:
                        dp.load(*args).result.result()
                    out[name].append((time.perf_counter() - t0) * 1e6)
        return out

    async def direct() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"exists": [], "offload": [], "load": []}
        store = EmbeddedStore(256 << 20)
        async with DataPlane(views, store) as dp:
            for i in range(n):
                for name, args in calls(i).items():
                    t0 = time.perf_counter()
                    if name == "exists":
                        await dp.exists(*args)
                    elif name == "offload":
                        await (await dp.offload(*args)).wait()
                    else:
                        await (await dp.load(*args)).wait()
                    out[name].append((time.perf_counter() - t0) * 1e6)
        await store.close()
        return out

    a, b = facade(), anyio.run(direct)
    res: dict[str, Any] = {}
    for name in a:
        fa, da = _pct(a[name][n // 10:]), _pct(b[name][n // 10:])  # first 10%: warm-up
        res[name] = {"facade_p50": fa["p50"], "async_p50": da["p50"],
                     "overhead_p50": round(fa["p50"] - da["p50"], 1), "facade_p99": fa["p99"],
                     "async_p99": da["p99"], "calls": n}
    return res

