"""Where one restore's time goes in vLLM's CPU build with HylinkerConnector (TP 1).

Runs one engine with its engine core and worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so both connector sides and vLLM's model runner can be timed here) on the tiny qwen3_next
(block 384, embedded store). Per prompt length: a miss (computes and stores), then ``--repeats``
times: reset vLLM's prefix cache, restore the prompt with a 1-token request. During each restore
every call of the parts below is timed (wall clock, the thread it ran on does not matter):

* scheduler side: the lookup (``get_num_new_matched_tokens``), inside it the chained block keys and
  the index; the load plan (``update_state_after_alloc``); the step's metadata
  (``build_connector_meta``); the worker reports (``update_connector_output``);
* worker side: submitting the load (``start_load_kv``), polling it (``get_transfer_results``, what vLLM 0.32 calls), the save
  copy (``wait_for_save``); in the data plane: store gets, frame verification, copies into the
  KV cache and state pages; the load's wall time from submit to done;
* vLLM: ``Scheduler.schedule``, the model runner's ``execute_model`` (the forward) and
  ``sample_tokens``, and ``EngineCore.step`` (each step, everything above included).

Parts nest (the lookup includes the keys and the index; a step includes everything), so shares do
not add up to 1. The restore whose total is the median is printed as a table and all of them are
saved as JSON with the host record (``tools/bench/host.py``). On a loaded machine read the shares,
not the seconds.

    OMP_NUM_THREADS=2 .venv-vllm/bin/python -m hylinker.tools.lab.profile_vllm_restore --sizes 4096,16384 \\
        --json bench-results/vllm-restore-profile.json

``--save-copy`` instead times, side by side in one run, the two ways of copying a save's pages
into staging that the profile compared (one ``index_select`` + ``index_copy_``, as the worker
did before, against one row copy per block, as it does now) on the tiny model's geometry (16 K
tokens: 42 attention blocks and 3 states of 98,304 bytes).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class Timings:
    """Wall time per named part while armed; thread-safe."""

    def __init__(self) -> None:
        self.armed = False
        self._lock = threading.Lock()
        self.parts: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        if self.armed:
            with self._lock:
                self.parts.setdefault(name, []).append(seconds)

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            out, self.parts = self.parts, {}
        return out

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time every call of ``owner.attr`` (a function or coroutine function) as ``name``."""
        fn = getattr(owner, attr)
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self.add(name, time.perf_counter() - t0)
            setattr(owner, attr, timed_async)
            return

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)
        setattr(owner, attr, timed)


PARTS: tuple[tuple[str, str, str, str], ...] = (
    # (module, class or "", attribute, name)
    ("hylinker.integrations.vllm", "HylinkerConnector", "get_num_new_matched_tokens", "S lookup"),
    ("hylinker.integrations.vllm.plan", "BlockKeys", "extend", "S   chained block keys"),
    ("hylinker.integrations.vllm.index", "StoreIndex", "exists", "S   index"),
    ("hylinker.integrations.vllm", "HylinkerConnector", "update_state_after_alloc", "S load plan"),
    ("hylinker.integrations.vllm", "HylinkerConnector", "build_connector_meta", "S step metadata (save plans)"),
    ("hylinker.integrations.vllm", "HylinkerConnector", "update_connector_output", "S worker reports"),
    ("hylinker.integrations.vllm", "HylinkerConnector", "start_load_kv", "W submit load"),
    ("hylinker.integrations.vllm", "HylinkerConnector", "get_transfer_results", "W poll loads"),
    ("hylinker.integrations.vllm", "HylinkerConnector", "wait_for_save", "W save copy"),
    ("hylinker.stores.embedded", "EmbeddedStore", "get", "W   store get"),
    ("hylinker.stores.embedded", "EmbeddedStore", "get_parts", "W   store get"),
    ("hylinker.stores.embedded", "EmbeddedStore", "get_checked", "W   store get"),
    # the row-described path (host pools over the embedded store): one store call per sub-batch
    # that copies each object from its slot into the pages itself, so "copy into pages" is
    # counted inside "store get" there
    ("hylinker.stores.embedded", "EmbeddedStore", "get_rows", "W   store get"),
    ("hylinker.stores.embedded_rows", "", "scatter", "W   copy into pages"),
    ("hylinker.stores.framing", "", "verify_array", "W   verify"),
    ("hylinker.stores.framing", "", "verify_parts", "W   verify"),
    ("hylinker.runtime.dataplane.transfer_codec", "PoolCodec", "scatter", "W   copy into pages"),
    ("hylinker.runtime.dataplane.transfer_codec", "PoolCodec", "scatter_one", "W   copy into pages"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "V schedule"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "V forward (execute_model)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "V sample"),
    ("vllm.v1.engine.core", "EngineCore", "step", "V engine step"),
)


def _install(timings: Timings) -> None:
    import importlib

    for module, cls, attr, name in PARTS:
        mod = importlib.import_module(module)
        timings.wrap(getattr(mod, cls) if cls else mod, attr, name)
    from hylinker.integrations.vllm.pages import PageTransfers

    load = PageTransfers.load

    def timed_load(self: PageTransfers, plan: Any) -> None:  # submit -> the load's future done
        t0 = time.perf_counter()
        load(self, plan)
        future = self._loads[plan.request_id][1]
        future.add_done_callback(lambda _f: timings.add("W load wall (submit to done)", time.perf_counter() - t0))
    PageTransfers.load = timed_load  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hylinker.tools.lab.profile_vllm_restore", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--save-copy", action="store_true", help="time the save's staging copy, both ways")
    args = ap.parse_args(argv)
    from ..bench.host import describe, finish, host_record

    host = host_record()
    if args.save_copy:
        return _save_copy(args, host)
    timings = Timings()
    _install(timings)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from ..harness.tiny_qwen3_next import build_tiny_qwen3_next
    from ..harness.vllm_runner import shutdown_engine

    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    out: dict[str, Any] = {"host": host, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="hylinker-profile-vllm-") as tmp:
        model = build_tiny_qwen3_next(Path(tmp) / "model")
        llm = LLM(model=str(model), dtype="bfloat16", block_size=384, enable_prefix_caching=True,
                  max_model_len=max(sizes) + 1024, max_num_batched_tokens=max(sizes) + 1024, enforce_eager=True,
                  seed=0, kv_transfer_config=KVTransferConfig(
                      kv_connector="HylinkerConnector", kv_connector_module_path="hylinker.integrations.vllm",
                      kv_role="kv_both", kv_load_failure_policy="recompute",
                      kv_connector_extra_config={"store": "embedded", "capacity_mb": 2048}))
        llm.generate([{"prompt_token_ids": [rng.randrange(10, 300) for _ in range(500)]}], one, use_tqdm=False)
        for n in sizes:
            prompt = {"prompt_token_ids": [rng.randrange(10, 300) for _ in range(n)]}
            timings.armed = True
            t0 = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            miss = {"wall_s": time.perf_counter() - t0, "parts": _summary(timings.take())}
            time.sleep(1.0)  # the miss's writes land off the step
            runs: list[dict[str, Any]] = []
            for _ in range(args.repeats):
                llm.reset_prefix_cache()
                time.sleep(0.2)
                load = [round(x, 2) for x in os.getloadavg()]
                t0 = time.perf_counter()
                res = llm.generate([prompt], one, use_tqdm=False)[0]
                wall = time.perf_counter() - t0
                runs.append({"wall_s": wall, "cached": int(res.num_cached_tokens or 0), "load_average": load,
                             "parts": _summary(timings.take())})
            timings.armed = False
            runs.sort(key=lambda r: r["wall_s"])
            median = runs[len(runs) // 2]
            out["sizes"][str(n)] = {"miss": miss, "restores": runs, "median_restore": median}
            _print(n, median, miss)
        shutdown_engine(llm)
    host = finish(host)
    out["host"] = host
    print(describe(host))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def _save_copy(args: argparse.Namespace, host: dict[str, Any], objects: int = 45, page: int = 98304,
               blocks: int = 8192, rounds: int = 20) -> int:
    """Best and median of ``rounds`` alternating runs of each way of copying ``objects`` pages."""
    import torch

    from ..bench.host import describe, finish

    raw = torch.randint(0, 255, (blocks, page), dtype=torch.uint8)
    staging = torch.zeros((objects * 2, page), dtype=torch.uint8)
    rng = random.Random(0)
    src = rng.sample(range(1, blocks), objects)
    dst = rng.sample(range(objects * 2), objects)
    src_t, dst_t = torch.tensor(src), torch.tensor(dst)

    def gather_scatter() -> None:
        staging.index_copy_(0, dst_t, raw.index_select(0, src_t))

    def rows() -> None:
        for s, b in zip(dst, src):
            staging[s].copy_(raw[b])

    times: dict[str, list[float]] = {"index_select_index_copy": [], "row_copies": []}
    for _ in range(rounds):
        for name, fn in (("index_select_index_copy", gather_scatter), ("row_copies", rows)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    assert torch.equal(staging[dst_t], raw[src_t])
    host = finish(host)
    seconds = {k: sorted(v) for k, v in times.items()}
    out: dict[str, Any] = {"host": host, "objects": objects, "page_bytes": page, "rounds": rounds, "seconds": seconds}
    for name, xs in seconds.items():
        print(f"{name:<24} best {1000 * xs[0]:7.2f} ms  median {1000 * xs[len(xs) // 2]:7.2f} ms")
    best = {k: v[0] for k, v in seconds.items()}
    med = {k: v[len(v) // 2] for k, v in seconds.items()}
    out["ratio_best"] = round(best["index_select_index_copy"] / best["row_copies"], 2)
    out["ratio_median"] = round(med["index_select_index_copy"] / med["row_copies"], 2)
    print(f"index_select + index_copy_ / row copies: {out['ratio_best']}x (best), {out['ratio_median']}x (median)")
    print(describe(host))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def _summary(parts: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {name: {"calls": len(xs), "total_s": round(sum(xs), 5), "max_s": round(max(xs), 5)}
            for name, xs in parts.items()}


def _print(n: int, run: dict[str, Any], miss: dict[str, Any]) -> None:
    wall = run["wall_s"]
    print(f"== {n} tokens: restore of {run['cached']} tokens, {wall:.3f} s wall (load average {run['load_average']}); "
          f"the miss (compute + store) took {miss['wall_s']:.3f} s")
    print(f"{'part':<34} {'calls':>5} {'total s':>8} {'share':>6} {'miss s':>8}")
    names = [name for _m, _c, _a, name in PARTS] + ["W load wall (submit to done)"]
    for name in dict.fromkeys(names):
        p = run["parts"].get(name)
        m = miss["parts"].get(name, {}).get("total_s", 0.0)
        if p is None:
            continue
        print(f"{name:<34} {p['calls']:>5} {p['total_s']:>8.4f} {p['total_s'] / wall:>6.1%} {m:>8.4f}")


if __name__ == "__main__":
    raise SystemExit(main())
