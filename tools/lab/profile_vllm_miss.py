"""What a miss pays in vLLM's CPU build with HylinkerConnector on Mooncake (TP 1): its parts,
switched off one at a time, interleaved in one engine.

One engine (engine core and worker in this process), the tiny qwen3_next, block 384, its own
loopback Mooncake master and storage-only holder (as ``bench-vllm-peers``), vLLM's prefix cache
reset before every miss. Each miss is a fresh prompt of ``--size`` tokens and a 1-token request,
timed from submit to its token (what a user's time to first token covers: the lookup, the
prefill's steps with the save's copy into staging in the step that fills the blocks, and whatever
of the save's put overlaps those steps). The variants, in turn, ``--misses`` of each:

* ``full``: a ``--gap-s`` pause (the previous save's writes land), then the miss as it runs;
* ``no lookup``: the same, the scheduler's store round trip answered "absent" without a call;
* ``no save``: the same, the save skipped (no copy, no put): the connector's lookup only;
* ``inert``: neither lookup nor save: the engine with prefix caching as the connector leaves it;
* ``back to back``: a ``full`` miss right after another ``full`` miss's token, no pause: it runs
  beside the previous save's writes.

Per miss the parts the connector runs are timed too (the lookup, the save's copy in
``wait_for_save``, the forward). Medians per variant; the JSON keeps every sample and the host.
On a loaded host read the differences between variants, measured side by side, not the seconds.

    OMP_NUM_THREADS=2 .venv-vllm/bin/python -m hylinker.tools.lab.profile_vllm_miss --size 3900 --misses 8
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

VARIANTS = ("full", "no lookup", "no save", "inert", "back to back")
PARTS: tuple[tuple[str, str, str, str], ...] = (
    ("hylinker.integrations.vllm", "HylinkerConnector", "get_num_new_matched_tokens", "lookup"),
    ("hylinker.integrations.vllm", "HylinkerConnector", "build_connector_meta", "save plans"),
    ("hylinker.integrations.vllm", "HylinkerConnector", "wait_for_save", "save copy (in the step)"),
    ("hylinker.integrations.vllm.pages", "PageTransfers", "_copy_out", "  rows into staging"),
    ("anyio.from_thread", "BlockingPortal", "start_task_soon", "  put handed to the loop"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "forward (execute_model)"),
    ("vllm.v1.engine.core", "EngineCore", "step", "engine step"),
)


class Switches:
    """Which parts of the connector run for the miss in flight."""

    lookup = True
    save = True


def _install(timings: Any) -> None:
    import importlib

    from hylinker.integrations.vllm.index import StoreProbe
    from hylinker.integrations.vllm.pages import PageTransfers

    for module, cls, attr, name in PARTS:
        timings.wrap(getattr(importlib.import_module(module), cls), attr, name)
    exists, save = StoreProbe.exists, PageTransfers.save

    def probe(self: StoreProbe, names: Any, timeout_s: float) -> list[bool] | None:
        return exists(self, names, timeout_s) if Switches.lookup else [False] * len(names)

    def saving(self: PageTransfers, plans: Any) -> None:
        if Switches.save:
            save(self, plans)
    StoreProbe.exists = probe  # type: ignore[method-assign]
    PageTransfers.save = saving  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hylinker.tools.lab.profile_vllm_miss", description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=3900, help="prompt tokens")
    ap.add_argument("--misses", type=int, default=8, help="misses per variant")
    ap.add_argument("--gap-s", type=float, default=1.0, help="pause before each miss but the back-to-back ones")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from ..bench.host import describe, finish, host_record
    from ..bench.output import write_json
    from ..bench.vllm import fresh_store
    from ..harness.tiny_qwen3_next import build_tiny_qwen3_next
    from ..harness.vllm_runner import shutdown_engine
    from .profile_vllm_restore import Timings, _summary

    host = host_record()
    timings = Timings()
    _install(timings)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="hylinker-profile-miss-") as tmp:
        work = Path(tmp)
        model = build_tiny_qwen3_next(work / "model")
        with fresh_store(work, 1024) as master:
            llm = LLM(model=str(model), dtype="bfloat16", block_size=384, enable_prefix_caching=True,
                      max_model_len=args.size + 1024, max_num_batched_tokens=args.size + 1024, enforce_eager=True,
                      seed=0, kv_transfer_config=KVTransferConfig(
                          kv_connector="HylinkerConnector", kv_connector_module_path="hylinker.integrations.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"store": "mooncake", "master": master.address, "segment_mb": 0}))

            def miss(variant: str, gap_s: float) -> None:
                Switches.lookup = variant not in ("no lookup", "inert")
                Switches.save = variant not in ("no save", "inert")
                llm.reset_prefix_cache()
                time.sleep(gap_s)
                prompt = {"prompt_token_ids": [rng.randrange(10, 300) for _ in range(args.size)]}
                timings.take()
                timings.armed = True
                t0 = time.perf_counter()
                llm.generate([prompt], one, use_tqdm=False)
                wall = time.perf_counter() - t0
                timings.armed = False
                samples[variant].append({"wall_s": wall, "parts": _summary(timings.take())})

            for variant in ("full", "inert"):  # warm-up, not measured
                miss(variant, args.gap_s)
            for v in samples.values():
                v.clear()
            for _ in range(args.misses):
                for variant in VARIANTS:
                    miss(variant, 0.0 if variant == "back to back" else args.gap_s)
            shutdown_engine(llm)
    host = finish(host)
    out = {"host": host, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "medians": {}, "samples": samples}
    shown = [p[3] for p in PARTS[:6]]
    print(f"{'variant':<14} {'TTFT median s':>13} {'best s':>7}  " + "  ".join(f"{name.strip()} ms" for name in shown))
    for variant, runs in samples.items():
        walls = [r["wall_s"] for r in runs]
        parts = {p[3]: 1000 * statistics.median(r["parts"].get(p[3], {}).get("total_s", 0.0) for r in runs)
                 for p in PARTS}
        out["medians"][variant] = {"wall_s": round(statistics.median(walls), 4), "best_s": round(min(walls), 4),
                                   "parts_ms": {k: round(v, 2) for k, v in parts.items()}}
        print(f"{variant:<14} {statistics.median(walls):>13.4f} {min(walls):>7.4f}  "
              + "  ".join(f"{parts[name]:.2f}" for name in shown))
    print(describe(host))
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
