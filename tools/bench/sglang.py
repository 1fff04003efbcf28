"""Side by side inside SGLang: hylinker's plugin vs SGLang's own ``MooncakeDirectLinker``.

Runs in the SGLang environment (``.ci/sglang-setup.sh``)::

    .venv-sglang/bin/python -m hylinker bench-sglang --json bench-results/sglang.json

For each page-object size (64 KiB and 1 MiB of KV per page by default) and each linker, on a
fresh loopback ``mooncake_master`` and an in-process segment, the same SGLang
``UnifiedRadixCache`` geometry (MLA full attention + Mamba2 states, page size 1, CPU) serves
the same requests (``hylinker.tools.harness.sglang_cache``):

* **offload**: a prompt of ``--tokens`` pages is inserted; time from SGLang's insert to the
  last offload result (``check_hicache_events``); GB/s over the page and state bytes; and the
  time the scheduler thread spent inside the linker's ``offload`` calls (it does nothing else
  meanwhile);
* **load**: after a flush, the prompt plus one token restores every page and the state; time
  from ``start_layer_wise_loading`` to ``finish_external_linker_loads``; every restored byte is
  compared with a recompute;
* **corrupt**: one stored KV object gets a flipped byte; does the next restore abort (503),
  silently restore garbage, or recompute?
* **dead master**: the master is killed; how long the next request's scheduler-thread calls and
  its offloads take, and what the request sees.

Both linkers are measured in steady state: right after a linker is built, every new anonymous
mapping of 512 MiB or more (the in-process Mooncake segment, whichever linker allocated it) is
populated (``madvise(MADV_POPULATE_WRITE)``) before anything is timed. Otherwise the first pass
over the segment pays a page fault per 4 KiB, and on a virtual machine that returns free memory
to its host that costs ~10 µs a page (0.4 GB/s): measured here, 1 MiB offloads took 40–47 ms
(hylinker) and 31–33 ms (SGLang's linker) on fresh segments against ~26 and ~16 ms on populated
ones (docs/figures/sglang.md). ``--cold-segment`` skips it.

hylinker runs once per ``--integrity`` level (both by default: ``"checksum"`` and ``"header"``,
the plugin's ``integrity`` key), side by side with SGLang's linker. At ``"header"`` the corrupt
case flips a payload byte that level does not hash, so it restores the damaged bytes: that row
shows the price of the level.

Each figure is the median of ``--repeats`` runs; the machine may be shared, so compare the
ratios of one run, not absolute numbers across runs. The JSON's ``host`` (``tools/bench/host.py``)
records the cores, the memcpy GB/s measured in the run and the load average.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .mooncake import copy_path_setting
from .output import write_json

LINKERS = ("hylinker", "sglang-mooncake")


def _spec(object_kib: int, tokens: int, tree_core: str) -> Any:
    from ..harness.sglang_cache import CacheSpec

    # two MLA layers: a page object is 2 rows of (kv_lora_rank + rope) bf16 values
    row = object_kib * 1024 // 2 // 2
    return CacheSpec(page_size=1, kv="mla", num_layers=4, full_layers=(1, 3), kv_lora_rank=row - 64,
                     qk_rope_head_dim=64, kv_pages=4 * tokens + 64, mamba_slots=16, max_reqs=4,
                     max_context=4 * tokens + 64, tree_core=tree_core)


def _segment_mb(object_kib: int, tokens: int, repeats: int) -> int:
    """The in-process segment each linker contributes: 1 GiB, or room for every timed prompt
    (one per repeat, none of them evicted before its restore) plus the extra cases' if more."""
    return max(1024, -(-(repeats + 2) * tokens * object_kib // 1024) + 64)


def _config(linker: str, master: str, integrity: str = "checksum",
            segment_mb: int = 1024, stages: int = 2) -> tuple[dict[str, Any], str]:
    if linker == "hylinker":
        return ({"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang",
                 "linker_extra_config": {"store": "mooncake", "master": master, "segment_mb": segment_mb,
                                         "integrity": integrity, "two_stage_offload": stages == 2}},
                "dynamic")
    return ({"master_server_address": master, "protocol": "tcp", "global_segment_size": segment_mb << 20,
             "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1"}, "mooncake")


def _object_key(cache: Any, linker: str, page_key: str) -> str:
    if linker == "hylinker":
        return str(cache.linker.object_keys("kv", [page_key])[0])
    storage = cache.linker.storage
    return str(storage._tag_keys([f"{page_key}_{storage.mla_suffix}_k"])[0])


def _flip_object(master: str, key: str, nbytes: int) -> bool:
    """Flip one payload byte of a stored object through a separate client (no segment)."""
    import anyio
    import torch

    from ...stores.base import Outcome
    from ...stores.mooncake import MooncakeConfig, MooncakeStore

    async def run() -> bool:
        async with await MooncakeStore.open(MooncakeConfig(master_address=master, segment_bytes=0)) as store:
            buf = torch.zeros(nbytes + 4096, dtype=torch.uint8)
            got = await store.get([key], [buf])
            if got[0].outcome is not Outcome.OK:
                return False
            data = buf[: got[0].nbytes].clone()
            data[-7] ^= 0x5A
            await store.remove([key])
            return (await store.put([key], [data])) == [Outcome.OK]

    return anyio.run(run)


def _page_keys(tokens: list[int]) -> list[str]:
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(RadixKey(array("q", tokens)), None, page_size=1))


class _Phases:
    """``--phases``: where the plugin's time goes, by wrapping its hot calls (hylinker only):
    the checksum (``framing`` seal/verify), the copy from staging into the rows
    (``PoolCodec.scatter``) and the store calls under the retry rule. Seconds summed over
    threads, so phases that overlap add up to more than the wall time."""

    FRAMING = ("seal_array", "seal_parts", "verify_array", "verify_parts")
    STORE = ("put", "get", "put_parts", "get_parts")

    def __init__(self) -> None:
        import threading

        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    def _add(self, name: str, t0: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def _wrap(self, owner: Any, attr: str, label: str, *, instance: bool = False) -> None:
        import inspect

        fn = getattr(owner, attr)
        timed: Any
        if inspect.iscoroutinefunction(fn):
            async def timed(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(*a, **k)
                finally:
                    self._add(label, t0)
        else:
            def timed(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self._add(label, t0)
        setattr(owner, attr, timed)
        self._undo.append((lambda: delattr(owner, attr)) if instance else (lambda: setattr(owner, attr, fn)))

    def install(self, cache: Any) -> None:
        from ...runtime.dataplane.transfer_codec import PoolCodec
        from ...stores import framing

        for name in self.FRAMING:
            self._wrap(framing, name, f"checksum.{name}")
        self._wrap(PoolCodec, "scatter", "copy.staging_to_rows")
        inner = cache.linker.store.inner
        for name in self.STORE:
            if hasattr(inner, name):
                self._wrap(inner, name, f"store.{name}", instance=True)

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


class _ThreadProfiles:
    """``--profile DIR``: cProfile in every thread started while a case runs (its whole life: the
    linkers' load, offload and loop threads, the store's worker threads), so offloads and loads
    both, and in the scheduler thread during the loads only; written as one ``.pstats`` per thread and a text summary of the
    functions by cumulative time. The calls' counts and cumulative shares are what to read on a
    loaded machine, not the seconds."""

    def __init__(self) -> None:
        import cProfile
        import sys
        import threading

        self.by_thread: list[tuple[str, Any]] = []
        self.scheduler = cProfile.Profile()
        self._lock = threading.Lock()
        profiles = self

        # threading.setprofile's hook runs first in every new thread, whatever its class (anyio's
        # worker threads override run()): it hands the thread to a profiler of its own
        def hook(frame: Any, event: str, arg: Any) -> None:
            sys.setprofile(None)
            prof = cProfile.Profile()
            with profiles._lock:
                profiles.by_thread.append((threading.current_thread().name, prof))
            prof.enable()

        threading.setprofile(hook)

    def stop_patching(self) -> None:
        import threading

        threading.setprofile(None)

    def write(self, directory: Path, stem: str) -> list[str]:
        import io
        import pstats

        directory.mkdir(parents=True, exist_ok=True)
        files = []
        summary = io.StringIO()
        for i, (name, prof) in enumerate([("scheduler-during-loads", self.scheduler), *self.by_thread]):
            try:
                stats = pstats.Stats(prof, stream=summary)
            except TypeError:  # a thread that never ran a profiled call
                continue
            path = directory / f"{stem}-{i:02d}-{name.replace('/', '_')}.pstats"
            stats.dump_stats(str(path))
            files.append(str(path))
            summary.write(f"\n===== {stem} thread {name}\n")
            stats.sort_stats("cumulative").print_stats(25)
        (directory / f"{stem}-summary.txt").write_text(summary.getvalue())
        return files


def run_case(linker: str, object_kib: int, tokens: int, repeats: int, tree_core: str,
             phases: bool = False, cold_segment: bool = False, profile_dir: Path | None = None,
             integrity: str = "checksum", stages: int = 2) -> dict[str, Any]:
    from ...stores.mooncake_master import MooncakeMaster
    from ..harness.sglang_cache import SGLangCache
    from .mooncake import anonymous_mappings, populate_new_segments

    out: dict[str, Any] = {"linker": linker, "object_kib": object_kib, "tokens": tokens,
                           "integrity": integrity if linker == "hylinker" else None,
                           "stages": stages if linker == "hylinker" else None}
    with MooncakeMaster() as master:
        config, backend = _config(linker, master.address, integrity, _segment_mb(object_kib, tokens, repeats),
                                  stages)
        before = anonymous_mappings()
        # every thread started from here on (the linkers' own, and the store's worker threads
        # started on first use) runs under its own profiler until the profile is written
        threads = _ThreadProfiles() if profile_dir is not None else None
        try:
            cache = SGLangCache(_spec(object_kib, tokens, tree_core), config, backend=backend)
        except BaseException:
            if threads is not None:
                threads.stop_patching()
            raise
        try:
            out["populated_bytes"] = 0 if cold_segment else populate_new_segments(before)
            kv_bytes = sum(v.payload_bytes for k, v in _views(cache).items() if k == "kv")
            state_bytes = _views(cache)["mamba"].payload_bytes
            cache.serve(list(range(7, 7 + 8)))  # warm the client and the tree
            cache.flush()
            # the scheduler thread's time inside the linker's offload calls (SGLang's scheduler
            # makes them while inserting a finished request and runs nothing else meanwhile)
            calls = _Phases()
            calls._wrap(cache.linker, "offload", "offload", instance=True)
            profile = _Phases() if phases and linker == "hylinker" else None
            if profile is not None:
                profile.install(cache)
            offload_gbps, load_gbps, mismatches = [], [], 0
            rows_held_ms: list[float] = []
            stored_ms: list[float] = []
            scheduler_ms: list[float] = []
            for r in range(repeats):
                prompt = [10_000 * (r + 1) + i for i in range(tokens)]
                calls.seconds.clear()
                first = cache.serve(prompt)
                scheduler_ms.append(calls.seconds.get("offload", 0.0) * 1e3)
                nbytes = tokens * kv_bytes + state_bytes
                offload_gbps.append(nbytes / first.offload_s / 1e9)
                rows_held_ms.append(first.reported_s * 1e3)
                stored_ms.append(first.offload_s * 1e3)
                cache.flush()
                if threads is not None:
                    threads.scheduler.enable()
                again = cache.serve([*prompt, 1])
                if threads is not None:
                    threads.scheduler.disable()
                if again.loaded != tokens or again.aborted:
                    raise RuntimeError(f"{linker}: expected a full restore, got {again}")
                mismatches += len(again.restore_mismatches)
                load_gbps.append(nbytes / again.load_s / 1e9)
                cache.flush()
            if profile is not None:  # per offload + load pair, summed over threads
                profile.remove()
                out["phases_ms_per_run"] = {k: round(v * 1e3 / repeats, 2) for k, v in sorted(profile.seconds.items())}
            out.update(offload_gbps=statistics.median(offload_gbps), load_gbps=statistics.median(load_gbps),
                       offload_call_ms=statistics.median(scheduler_ms), offload_call_ms_runs=scheduler_ms,
                       rows_held_ms=statistics.median(rows_held_ms), rows_held_ms_runs=rows_held_ms,
                       offload_ms_runs=stored_ms,
                       offload_runs=offload_gbps, load_runs=load_gbps, restore_mismatches=mismatches,
                       kv_object_bytes=kv_bytes, state_object_bytes=state_bytes)
            if threads is not None and profile_dir is not None:  # the profile covers the runs above only
                cache.settle()
                threads.stop_patching()
                out["profiles"] = threads.write(profile_dir, f"{linker}-{object_kib}KiB")
                return out
            # a corrupted object
            prompt = [900_000 + i for i in range(16)]
            cache.serve(prompt)
            cache.flush()
            key = _object_key(cache, linker, _page_keys(prompt)[5])
            flipped = _flip_object(master.address, key, kv_bytes + 64)
            bad = cache.serve([*prompt, 1])
            after = cache.serve([*prompt, 1, 2])
            out["corrupt"] = {
                "flipped": flipped,
                "restored_garbage": bool(bad.restore_mismatches) and not bad.aborted,
                "aborted_503": bad.aborted,
                "next_request": {"device_hit": after.device_hit, "store_loaded": after.loaded,
                                 "aborted": after.aborted, "wrong_bytes": bool(after.restore_mismatches)}}
            cache.flush()
            # the master dies
            prompt = [800_000 + i for i in range(16)]
            cache.serve(prompt)
            cache.flush()
            master.kill()
            t0 = time.perf_counter()
            served = cache.serve([*prompt, 1], settle=False)
            scheduler_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            try:
                cache.settle(timeout_s=60)
                settled: float | None = time.perf_counter() - t1
            except TimeoutError:
                settled = None
            out["dead_master"] = {"scheduler_calls_s": round(scheduler_s, 3),
                                  "offloads_reported_s": None if settled is None else round(settled, 3),
                                  "request": "aborted (503)" if served.aborted else "recomputed"}
            t2 = time.perf_counter()
        finally:
            cache.close()
        out["dead_master"]["close_s"] = round(time.perf_counter() - t2, 3)
    return out


def _views(cache: Any) -> dict[str, Any]:
    """Page and state object payload sizes, from whichever linker runs."""
    pools = cache.linker.pools
    return {str(getattr(name, "value", name)): _Sized(pool) for name, pool in pools.items()}


class _Sized:
    def __init__(self, pool: Any) -> None:
        if hasattr(pool, "payload_bytes"):
            self.payload_bytes = int(pool.payload_bytes)
        else:  # SGLang's DevicePoolEntry: one object per page holds every buffer of the page
            self.payload_bytes = int(sum(size for comp in pool.buffer_meta for _, _, size in comp))


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| object | linker | offload GB/s (stored) | rows held | scheduler thread in offload calls | load GB/s | restore bytes wrong | corrupt object | dead master: scheduler calls / offloads reported / close |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, d = r["corrupt"], r["dead_master"]
        corrupt = ("restored garbage silently" if c["restored_garbage"] else
                   "load failed (503), object removed" if c["aborted_503"] else "?")
        n = c["next_request"]
        corrupt += (f"; next request: {n['device_hit']} tokens from the device tree"
                    + (" (the garbage, inserted)" if c["restored_garbage"] and n["device_hit"] else "")
                    + f", {n['store_loaded']} from the store" + (", aborted (503)" if n["aborted"] else ""))
        name = r["linker"] + (f" ({r['integrity']}, {r['stages']} stage{'s' * (r['stages'] > 1)})"
                              if r.get("integrity") else "")
        lines.append(
            f"| {r['object_kib']} KiB | {name} | {r['offload_gbps']:.2f} | {r['rows_held_ms']:.1f} ms | "
            f"{r['offload_call_ms']:.2f} ms | "
            f"{r['load_gbps']:.2f} | "
            f"{r['restore_mismatches']} | {corrupt} | "
            f"{d['scheduler_calls_s']} s / {d['offloads_reported_s']} s / {d['close_s']} s |")
    by = {(r["object_kib"], r["linker"], r.get("integrity"), r.get("stages")): r for r in results}
    for kib in sorted({r["object_kib"] for r in results}):
        s = by.get((kib, "sglang-mooncake", None, None))
        for level in ("checksum", "header"):
            for stages in (2, 1):
                h = by.get((kib, "hylinker", level, stages))
                if h and s:
                    lines.append(f"\n{kib} KiB: hylinker ({level}, {stages} stage{'s' * (stages > 1)}) / SGLang = offload "
                                 f"{h['offload_gbps'] / s['offload_gbps']:.2f}x, rows held "
                                 f"{h['rows_held_ms'] / s['rows_held_ms']:.2f}x as long, "
                                 f"load {h['load_gbps'] / s['load_gbps']:.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, run: Callable[..., dict[str, Any]] = run_case) -> int:
    parser = argparse.ArgumentParser(prog="hylinker bench-sglang", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--object-kib", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--tokens", type=int, default=48, help="pages per prompt (page size 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--linkers", nargs="+", choices=LINKERS, default=list(LINKERS))
    parser.add_argument("--tree-core", choices=("python", "rust"), default="python")
    parser.add_argument("--phases", action="store_true",
                        help="time the plugin's checksum, copy and store calls (hylinker; adds overhead)")
    parser.add_argument("--cold-segment", action="store_true",
                        help="do not populate the linkers' Mooncake segments before timing")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="cProfile every linker thread and the scheduler thread's loads; write .pstats "
                             "and a summary to DIR (skips the corrupt and dead-master steps)")
    parser.add_argument("--integrity", nargs="+", choices=("checksum", "header"), default=["checksum", "header"],
                        help="the plugin's integrity levels, each run side by side with the others")
    parser.add_argument("--stages", nargs="+", type=int, choices=(1, 2), default=[2],
                        help="the plugin's offload stages (two_stage_offload on = 2), each run side by side")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from ..harness.sglang_cache import install_cpu_shims
    from .host import describe, finish, host_record

    install_cpu_shims()
    host = host_record()
    print(describe(host), flush=True)
    results = []
    for kib in args.object_kib:
        for linker in args.linkers:  # side by side: the same sizes, one after the other
            plugin = linker == "hylinker"
            for level, stages in [(lv, st) for lv in args.integrity for st in args.stages] if plugin else [("checksum", 2)]:
                results.append(run(linker, kib, args.tokens, args.repeats, args.tree_core, args.phases,
                                   args.cold_segment, args.profile, integrity=level, stages=stages))
                print(json.dumps({k: v for k, v in results[-1].items() if not k.endswith("_runs")}), flush=True)
    if args.profile is None:  # a profiled run stops before the corrupt and dead-master steps
        print(table(results))
    host = finish(host)
    print(describe(host))
    if args.json is not None:
        write_json(args.json, {"results": results, "argv": list(argv or sys.argv[1:]),
                               "MC_STORE_MEMCPY": copy_path_setting(), "host": host})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
