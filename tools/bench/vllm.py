"""Time to first token in vLLM's CPU build with HylinkerConnector: restore vs recompute, and the
connector's cost per decode step when nothing hits.

Run in the vLLM environment::

    OMP_NUM_THREADS=2 .venv-vllm/bin/python -m hylinker bench-vllm --json bench-results/vllm.json
    ... --sizes 4096,16384 --tp 1,2 --default-mode   # vLLM's default process model, TP 1 and 2

Per tensor parallel size (``--tp``), three engines run one after the other on the same tiny
qwen3_next (block 384), each in its own process (``hylinker.tools.harness.vllm_runner``; the engine core
in that process, or with ``--default-mode`` and always at TP > 1 in vLLM's default process model,
no environment variable): one with the connector (embedded store), one without the connector and without vLLM's prefix cache (the recompute), one
with vLLM's prefix cache only (what the connector's overhead is measured against: prefix caching
of a hybrid model has costs of its own, "align" mode chunks the prefill at block boundaries). For each prompt length
the connector engine measures a 1-token request on a new prompt (a miss: it computes and stores),
resets vLLM's prefix cache, then repeats it (a restore); the plain engine measures the same
prompt (a recompute). Decode: ``--decode-tokens`` (64) tokens on each of ``--repeats`` fresh
350-token prompts in all three engines, streamed through the engine's step loop (the runner's
``decode`` step): every token after the first is timed from the one before it, so the figure is
the time per decode step, free of the generate call's fixed cost (the prompt crosses a block
boundary while it decodes, so the connector plans and copies one filled block). Timings on a
shared machine are noisy: compare the ratios, measured side by side in one run; each time to
first token is the minimum of ``--repeats`` (all of them are in the JSON); decode figures are the
median and mean of every timed step. The JSON's ``host`` comes from ``tools/bench/host.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..harness.tiny_qwen3_next import build_tiny_qwen3_next
from .output import write_json

if TYPE_CHECKING:
    from ...stores.mooncake_master import MooncakeMaster


def _run(model: Path, extra: str, steps: list[dict[str, Any]], max_len: int, log: Path, *,
         tp: int = 1, in_process: bool = True) -> list[dict[str, Any]]:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    steps_file = log.with_suffix(".steps.json")
    steps_file.write_text(json.dumps(steps))
    cmd = [sys.executable, "-m", "hylinker.tools.harness.vllm_runner", "--model", str(model), "--extra", extra,
           "--steps", f"@{steps_file}", "--max-model-len", str(max_len), "--tp", str(tp)]
    if in_process:
        cmd.append("--in-process")
    return runner_rows(cmd, env, log, len(steps), "engine")


def runner_rows(cmd: list[str], env: dict[str, str], log: Path, n_steps: int, label: str) -> list[dict[str, Any]]:
    """Run ``harness.vllm_runner`` as ``cmd`` (stderr to ``log``) and return its ``RESULT`` rows,
    one per step; an engine that answered fewer rows failed, and the error quotes its log."""
    with open(log, "w") as f:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, env=env, text=True, check=False).stdout
    rows = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    if len(rows) != n_steps:
        raise RuntimeError(f"{label} failed, see {log}:\n{log.read_text()[-3000:]}")
    return rows


@contextlib.contextmanager
def fresh_store(work: Path, segment_mib: int) -> Iterator[MooncakeMaster]:
    """A loopback master (log in ``work``) and a storage-only client holding ``segment_mib`` MiB:
    the store each connector of the side-by-side benchmarks gets, engines contributing none."""
    from ...stores.mooncake_master import MooncakeMaster
    from ..mooncake_cli import start_segment_process

    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster(log_path=work / "master.log").start())
        seg = start_segment_process(master.address, segment_mib)
        stack.callback(seg.wait, 10)
        stack.callback(seg.kill)
        yield master


def vllm_mooncake_env(work: Path, address: str, local_buffer_mib: int) -> dict[str, str]:
    """vLLM's own ``MooncakeStoreConnector`` reads its Mooncake settings from a file: write it in
    ``work`` (``standalone-store``, no segment of its own, over TCP to ``address``) and return the
    environment that names it."""
    mooncake = {"metadata_server": "P2PHANDSHAKE", "master_server_address": address, "protocol": "tcp",
                "device_name": "", "mode": "standalone-store", "global_segment_size": 0,
                "local_buffer_size": local_buffer_mib << 20}
    (work / "mooncake.json").write_text(json.dumps(mooncake))
    return {"MOONCAKE_CONFIG_PATH": str(work / "mooncake.json"), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hylinker bench-vllm", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,4096,16384", help="prompt lengths in tokens")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-prompt", type=int, default=350, help="tokens of each decode prompt")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per figure; the minimum is reported")
    ap.add_argument("--tp", default="1", help="tensor parallel sizes, e.g. 1,2")
    ap.add_argument("--default-mode", action="store_true",
                    help="vLLM's default process model at TP 1 too (TP > 1 always runs in it)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from .host import describe, finish, host_record

    host = host_record()
    results: dict[str, Any] = {}
    for tp in (int(t) for t in args.tp.split(",")):
        print(f"== tensor parallel size {tp}")
        results[f"tp{tp}"] = _bench(args, tp, in_process=tp == 1 and not args.default_mode)
    host = finish(host)
    print(describe(host))
    result: dict[str, Any] = {"default_mode": args.default_mode, "host": host, **results}
    if args.json:
        write_json(args.json, result)
    return 0


def _bench(args: argparse.Namespace, tp: int, *, in_process: bool) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    reps = args.repeats
    rng = random.Random(0)
    prompts = {n: [[rng.randrange(10, 300) for _ in range(n)] for _ in range(reps)] for n in sizes}
    decode_prompts = [[rng.randrange(10, 300) for _ in range(args.decode_prompt)] for _ in range(reps)]
    max_len = max(sizes) + 1024
    warm = [{"op": "ttft", "prompt": [rng.randrange(10, 300) for _ in range(500)]}]  # first-call costs
    # per size: `reps` new prompts (misses), then `reps` times: reset + the first prompt (restores)
    with_steps: list[dict[str, Any]] = list(warm)
    plain_steps: list[dict[str, Any]] = list(warm)  # recompute: the same prompt `reps` times
    prefix_steps: list[dict[str, Any]] = list(warm)  # vLLM's cache only: `reps` new prompts
    for n in sizes:
        with_steps += [{"op": "ttft", "prompt": p} for p in prompts[n]]
        for _ in range(reps):
            with_steps += [{"op": "reset"}, {"op": "ttft", "prompt": prompts[n][0]}]
        plain_steps += [{"op": "ttft", "prompt": prompts[n][0]} for _ in range(reps)]
        prefix_steps += [{"op": "ttft", "prompt": p} for p in prompts[n]]
    decode = [{"op": "decode", "prompt": dp, "max_tokens": args.decode_tokens} for dp in decode_prompts]
    with_steps += decode + ([{"op": "stats"}] if in_process else [])
    plain_steps += decode
    prefix_steps += decode
    with tempfile.TemporaryDirectory(prefix="hylinker-bench-vllm-") as tmp:
        work = Path(tmp)
        model = build_tiny_qwen3_next(work / "model")
        extra = json.dumps({"store": "embedded", "capacity_mb": 2048})
        w = _run(model, extra, with_steps, max_len, work / "with.log", tp=tp, in_process=in_process)
        p = _run(model, "none", plain_steps, max_len, work / "plain.log", tp=tp, in_process=in_process)
        q = _run(model, "prefix-only", prefix_steps, max_len, work / "prefix.log", tp=tp, in_process=in_process)
    if not in_process:
        w.append({"op": "stats", "stats": {}})  # the workers' counters stay in their processes
    w_ttft = [r for r in w if r["op"] == "ttft"][1:]
    p_ttft = [r for r in p if r["op"] == "ttft"][1:]
    q_ttft = [r for r in q if r["op"] == "ttft"][1:]
    rows = []
    for i, n in enumerate(sizes):
        mine = w_ttft[2 * reps * i: 2 * reps * (i + 1)]
        misses, restores = mine[:reps], mine[reps:]
        recompute = p_ttft[reps * i: reps * (i + 1)]
        prefix_miss = q_ttft[reps * i: reps * (i + 1)]
        best = {name: min(r["ttft_s"] for r in rs) for name, rs in
                (("recompute", recompute), ("prefix", prefix_miss), ("miss", misses), ("restore", restores))}
        rows.append({"tokens": n, "restored_tokens": min(r["cached"] for r in restores),
                     "ttft_recompute_s": round(best["recompute"], 4),
                     "ttft_miss_prefix_cache_only_s": round(best["prefix"], 4),
                     "ttft_miss_with_connector_s": round(best["miss"], 4),
                     "ttft_restore_s": round(best["restore"], 4),
                     "restore_speedup": round(best["recompute"] / best["restore"], 2),
                     "all_s": {"recompute": [round(r["ttft_s"], 3) for r in recompute],
                               "prefix_miss": [round(r["ttft_s"], 3) for r in prefix_miss],
                               "miss": [round(r["ttft_s"], 3) for r in misses],
                               "restore": [round(r["ttft_s"], 3) for r in restores]}})
    decode_row = _decode_row([[r for r in rows_ if r["op"] == "decode"] for rows_ in (w, q, p)], args.decode_tokens)
    result = {"tp": tp, "in_process": in_process, "ttft": rows, "decode": decode_row,
              "connector_stats": w[-1]["stats"]}
    print(f"{'tokens':>7} {'restored':>8} {'recompute s':>11} {'prefix miss s':>13} {'miss+store s':>12} "
          f"{'restore s':>9} {'speedup':>7}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['restored_tokens']:>8} {r['ttft_recompute_s']:>11.3f} "
              f"{r['ttft_miss_prefix_cache_only_s']:>13.3f} {r['ttft_miss_with_connector_s']:>12.3f} "
              f"{r['ttft_restore_s']:>9.3f} {r['restore_speedup']:>7.2f}")
    print("decode step ms (median / mean of every step after the first token): "
          + "; ".join(f"{name} {decode_row[name]['median_ms']:.2f} / {decode_row[name]['mean_ms']:.2f}"
                      for name in DECODE_ENGINES)
          + f"; connector / prefix cache only {decode_row['connector_over_prefix_median']:.3f}, "
          f"connector / neither {decode_row['connector_over_plain_median']:.3f}; same tokens: {decode_row['same_tokens']}")
    print("connector:", json.dumps(result["connector_stats"]))
    return result


DECODE_ENGINES = ("with_connector", "prefix_cache_only", "plain")


def _decode_row(runs: list[list[dict[str, Any]]], decode_tokens: int) -> dict[str, Any]:
    """Per engine (connector, vLLM's prefix cache only, neither): the median and mean time per
    decode step, pooled over every timed step of every decode request."""
    row: dict[str, Any] = {"decode_tokens": decode_tokens}
    for name, decodes in zip(DECODE_ENGINES, runs):
        steps = sorted(g for d in decodes for g in d["token_s"])
        if not steps:
            raise RuntimeError(f"no decode step was timed ({name})")
        row[name] = {"median_ms": round(1000 * steps[len(steps) // 2], 3),
                     "mean_ms": round(1000 * sum(steps) / len(steps), 3), "steps": len(steps),
                     "ttft_s": [round(d["ttft_s"], 4) for d in decodes]}
    for other, key in (("prefix_cache_only", "connector_over_prefix_median"), ("plain", "connector_over_plain_median")):
        row[key] = round(row["with_connector"]["median_ms"] / row[other]["median_ms"], 3)
    row["same_tokens"] = all(a["tokens"] == b["tokens"] == c["tokens"] for a, b, c in zip(*runs))
    return row


if __name__ == "__main__":
    raise SystemExit(main())
