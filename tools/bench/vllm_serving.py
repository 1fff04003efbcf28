"""Serving under load: vLLM's OpenAI server replaying a multi-turn trace with hylinker's connector,
with vLLM's own ``MooncakeStoreConnector``, and with neither, side by side in one run.

The trace is the shipped Mooncake conversation trace (``tools/traces.py``), scaled to a 2-core CPU:
its conversations are the requests that share their first two 512-token blocks, and the first
``--conversations`` conversations with at least three turns are kept, in the trace's order. Each
trace block becomes ``--tokens-per-block`` token ids (the same ids wherever the trace repeats the
block, so a later turn shares its conversation's prefix), a request's input is capped at
``--max-input`` tokens and its output is the trace's divided by ``--output-scale`` (at least 1, at
most ``--max-output``). They are sent closed-loop, ``--concurrency`` at a time, in the trace's
order, each a streamed greedy ``/v1/completions`` on token ids.

Three configurations, each its own server (vLLM's default process model) on the tests' tiny
qwen3_next (block 384) with the same device KV budget, ``--device-blocks`` blocks
(``--num-gpu-blocks-override``), small enough that vLLM evicts; several budgets
(``--device-blocks 32,16``) run one after the other after one reference, a table each:

* ``vllm_mooncake``: vLLM's ``MooncakeStoreConnector`` (``standalone-store``, no segment of its own);
* ``hylinker``: ``HylinkerConnector`` on Mooncake (``segment_mb`` 0, integrity ``--integrity``);
* ``baseline``: vLLM's prefix cache alone.

The connector configurations get a fresh loopback master and a storage-only client each
(``--segment-mib``). ``--rounds`` rounds, the order rotating. Per configuration and round: time to
first token p50/p99, output tokens per second over the replay, the prompt tokens served from vLLM's
own cache and from the connector (vLLM's ``prefix_cache_hits`` and ``external_prefix_cache_hits``
counters, scraped before and after), the bytes and keys the master holds at the end, and the losses
beside them: requests that failed, and each connector's failed saves and loads (hylinker's
``vllm:hylinker_*`` families; the master's failed allocations for both).

Exactness: a fourth server (``recompute``) serves every request once, one at a time, its prefix
cache emptied before each (vLLM chunks a hybrid model's prefill at block boundaries only with the
prefix cache on; without it the order of the sums differs): the reference. After its timed replay, each configuration serves every request once more,
one at a time, from what its caches hold then (vLLM's device cache, the store); each is compared
with the reference (the generated token ids and the first token's top logprobs). A request that
differs is reported as wrong, split by whether it was served a cached prefix, never averaged away.
The timed replay's own requests are compared too, but reported apart (``differ_under_load``): a
request batched with others is not computed in the reference's order (CPU kernels choose their
blocking by batch shape), so those differences show in the no-cache baseline as well.

    OMP_NUM_THREADS=2 .venv-vllm/bin/python -m hylinker bench-vllm-serving --rounds 2 \\
        --json bench-results/vllm-serving.json --plot bench-results/vllm-serving.png

The JSON carries every request's figures and the host (``tools/bench/host.py``); the plot draws the
TTFT CDFs of the three configurations (matplotlib; without it in the vLLM environment, draw it
later with ``python3 -m hylinker.tools.bench.vllm_serving --plot-from JSON --plot PNG``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .output import add_output_arguments, plot_only, write_outputs

CONFIGS = ("vllm_mooncake", "hylinker", "baseline")
NAMES = {"vllm_mooncake": "vLLM MooncakeStoreConnector", "hylinker": "HylinkerConnector",
         "baseline": "vLLM prefix cache only", "recompute": "recompute (reference)"}
BLOCK = 384  # the tiny qwen3_next's block


def conversation_requests(conversations: int, tokens_per_block: int, max_input: int, output_scale: int,
                          max_output: int, seed: int = 0) -> list[dict[str, Any]]:
    """The trace's first ``conversations`` conversations of three turns or more, scaled (see the
    module docstring): ``{"id", "conversation", "prompt", "max_tokens"}`` in the trace's order."""
    from ..traces import mooncake_trace

    rows = [json.loads(line) for line in mooncake_trace().read_text().splitlines() if line.strip()]
    families: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        families[tuple(r["hash_ids"][:2])].append(i)
    kept = sorted((f for f in families.values() if len(f) >= 3), key=lambda f: f[0])[:conversations]
    which = {i: n for n, f in enumerate(kept) for i in f}
    out: list[dict[str, Any]] = []
    for i in sorted(which):
        r = rows[i]
        prompt: list[int] = []
        for h in r["hash_ids"]:
            block_rng = random.Random(f"{seed}:{h}")
            prompt += [block_rng.randrange(10, 300) for _ in range(tokens_per_block)]
        tail = int(r["input_length"]) * tokens_per_block // 512  # the last block is partly filled
        prompt = prompt[:max(tokens_per_block, min(tail, max_input))]
        out.append({"id": len(out), "conversation": which[i], "prompt": prompt,
                    "max_tokens": max(1, min(max_output, int(r["output_length"]) // output_scale))})
    return out


def replay(port: int, requests: list[dict[str, Any]], concurrency: int, *,
           reset_each: bool = False) -> tuple[list[dict[str, Any]], float]:
    """Send ``requests`` closed-loop, ``concurrency`` at a time; each one's result (an ``error``
    instead where it failed) and the replay's wall seconds. ``reset_each``: empty vLLM's prefix
    cache before each request (one at a time only): every request is then a recompute."""
    from ..harness.vllm_server import post, stream_completion

    if reset_each and concurrency != 1:
        raise ValueError("reset_each needs concurrency 1")

    def one(req: dict[str, Any]) -> dict[str, Any]:
        try:
            if reset_each and not post(f"http://127.0.0.1:{port}/reset_prefix_cache").get("success", True):
                return {"id": req["id"], "error": "vLLM refused the prefix-cache reset"}
            return {"id": req["id"], **stream_completion(port, req["prompt"], req["max_tokens"])}
        except Exception as e:  # a failed request is a loss to report, not a crash
            return {"id": req["id"], "error": f"{type(e).__name__}: {e}"}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, requests))
    return results, time.perf_counter() - t0


def _scrape(url: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """The samples (``name{labels}`` -> value) whose names start with one of ``prefixes``."""
    from ..harness.metrics_scrape import scrape

    out: dict[str, float] = {}
    for prefix in prefixes:
        out.update(scrape(url, prefix))
    return out


def _total(samples: dict[str, float], name: str, label: str = "") -> int:
    """The sum of ``name``'s samples whose labels contain ``label``."""
    return int(sum(v for k, v in samples.items() if k.split("{")[0] == name and label in k.partition("{")[2]))


@contextlib.contextmanager
def _server(config: str, model: Path, work: Path, args: argparse.Namespace) -> Iterator[tuple[int, Any]]:
    """One server in ``config``; yields its port and the master (``None`` without a connector)."""
    from ..harness.vllm_server import free_port, start_server, stop_server
    from .vllm import fresh_store, vllm_mooncake_env

    port = free_port()
    common: dict[str, Any] = {"max_model_len": args.max_input + args.max_output + 16,
                              "server_args": [] if config == "recompute" else
                              ["--num-gpu-blocks-override", str(args.device_blocks)]}
    with contextlib.ExitStack() as stack:
        master = None
        if config in ("hylinker", "vllm_mooncake"):
            master = stack.enter_context(fresh_store(work, args.segment_mib))
        log = work / "server.log"
        if config == "hylinker":
            assert master is not None
            extra = {"store": "mooncake", "master": master.address, "segment_mb": 0, "integrity": args.integrity}
            proc = start_server(model, port, log, extra=extra, **common)
        elif config == "vllm_mooncake":
            assert master is not None
            transfer = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {}}
            proc = start_server(model, port, log, extra=None, transfer=transfer, **common,
                                env_extra=vllm_mooncake_env(work, master.address, args.local_buffer_mib))
        else:
            # the reference keeps vLLM's prefix cache on (emptied before each request): with it on, a
            # hybrid model's prefill is chunked at block boundaries, so only then is it computed in
            # the same order as the configurations it is compared with
            proc = start_server(model, port, log, extra=None, prefix_caching=True, **common)
        stack.callback(stop_server, proc)
        yield port, master


def _warm(port: int, rng: random.Random) -> None:
    """First calls compile and allocate: one fresh prompt twice, not measured."""
    from ..harness.vllm_server import stream_completion

    prompt = [rng.randrange(10, 300) for _ in range(2 * BLOCK + 50)]
    for _ in range(2):
        stream_completion(port, prompt, 2)


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, round(q * (len(xs) - 1)))], 4)


def serve_config(config: str, model: Path, requests: list[dict[str, Any]], work: Path, args: argparse.Namespace,
                 concurrency: int) -> dict[str, Any]:
    """One server's replay: per-request results, wall seconds, cache and store counters."""
    work.mkdir(parents=True, exist_ok=True)
    with _server(config, model, work, args) as (port, master):
        _warm(port, random.Random(f"warm:{config}"))
        metrics = f"http://127.0.0.1:{port}/metrics"
        before = _scrape(metrics, ("vllm:prefix_cache", "vllm:external_prefix_cache", "vllm:hylinker_"))
        load = os.getloadavg()[0]  # the host's load beside each replay: other tenants move the wall
        results, wall = replay(port, requests, concurrency, reset_each=config == "recompute")
        host_load = [round(load, 2), round(os.getloadavg()[0], 2)]
        time.sleep(args.settle_s)  # the connectors' writes run off the step
        after = _scrape(metrics, ("vllm:prefix_cache", "vllm:external_prefix_cache", "vllm:hylinker_"))
        # exactness alone: the same requests once more, one at a time (no batch to blur a
        # comparison), each served what the caches hold after the load
        alone = replay(port, requests, 1)[0] if config != "recompute" else []
        store: dict[str, float] = {}
        if master is not None:
            store = _scrape(f"http://127.0.0.1:{master.metrics_port}/metrics",
                            ("master_allocated_bytes", "master_key_count", "master_put_start_alloc_failures",
                             "master_put_start_failures", "master_eviction"))
    counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {"results": results, "wall_s": wall, "counters": counters, "store": store, "alone": alone,
            "host_load": host_load}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["tokens"] == b["tokens"] and a["first_logprobs"] == b["first_logprobs"])


def _hylinker_figures(counters: dict[str, float]) -> dict[str, int]:
    """hylinker's loads and saves from its ``vllm:hylinker_*`` families, losses beside them."""
    h = "vllm:hylinker_"
    return {"loads_ok": _total(counters, h + "loads_total", '"ok"'),
            "saves_ok": _total(counters, h + "offloads_total", '"ok"'),
            "loads_failed": _total(counters, h + "loads_total", '"failed"'),
            "loads_refused": _total(counters, h + "loads_total", '"refused"'),
            "saves_failed": _total(counters, h + "offloads_total", '"failed"'),
            "objects_skipped": _total(counters, h + "objects_skipped_total"),
            "lookup_errors": _total(counters, h + "lookups_total", '"error"'),
            "verify_failures": _total(counters, h + "verify_failures_total"),
            "transfer_failures": _total(counters, h + "transfer_failures_total")}


def summarize(config: str, run: dict[str, Any], reference: dict[int, dict[str, Any]],
              requests: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's round: the figures, and the losses and exactness beside them."""
    ok = [r for r in run["results"] if "error" not in r]
    ttfts = [r["ttft_s"] for r in ok]
    prompt_tokens = sum(len(q["prompt"]) for q in requests)
    counters = run["counters"]
    device = _total(counters, "vllm:prefix_cache_hits_total")
    external = _total(counters, "vllm:external_prefix_cache_hits_total")
    under_load = sum(1 for r in ok if "error" not in reference.get(r["id"], {"error": 1})
                     and not _same(r, reference[r["id"]]))
    wrong_hit = wrong_miss = compared = hits = 0
    for r in run["alone"]:
        ref = reference.get(r["id"])
        if "error" in r or ref is None or "error" in ref:
            continue
        compared += 1
        hits += r["cached"] > 0
        if not _same(r, ref):
            if r["cached"] > 0:
                wrong_hit += 1
            else:
                wrong_miss += 1
    store = run["store"]
    out: dict[str, Any] = {
        "requests": len(run["results"]), "failed_requests": len(run["results"]) - len(ok),
        "ttft_p50_s": _percentile(ttfts, 0.5), "ttft_p99_s": _percentile(ttfts, 0.99),
        "output_tokens_per_s": round(sum(len(r["tokens"]) for r in ok) / run["wall_s"], 2),
        "wall_s": round(run["wall_s"], 3), "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r["cached"] for r in ok),
        "device_hit_tokens": int(device), "store_hit_tokens": int(external),
        "hit_rate": round(sum(r["cached"] for r in ok) / prompt_tokens, 4),
        "store_bytes": int(store.get("master_allocated_bytes", 0)), "store_keys": int(store.get("master_key_count", 0)),
        "store_alloc_failures": int(store.get("master_put_start_alloc_failures_total", 0)),
        "compared": compared, "served_a_cached_prefix": hits, "wrong_with_cached_prefix": wrong_hit,
        "wrong_without": wrong_miss, "alone_failed": sum("error" in r for r in run["alone"]),
        "differ_under_load": under_load, "host_load": run["host_load"],
    }
    if config == "hylinker":
        out["connector"] = _hylinker_figures(counters)
    return out


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The reference once, then every ``--device-blocks`` budget's rounds. One budget: its figures
    at the top level; several: one entry per budget under ``budgets``, side by side."""
    from ..harness.tiny_qwen3_next import build_tiny_qwen3_next
    from .host import describe, finish, host_record

    host = host_record()
    requests = conversation_requests(args.conversations, args.tokens_per_block, args.max_input, args.output_scale,
                                     args.max_output, args.seed)
    budgets: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hylinker-bench-vllm-serving-") as tmp:
        work = Path(tmp)
        model = build_tiny_qwen3_next(work / "model")
        print(f"{len(requests)} requests, {sum(len(q['prompt']) for q in requests)} prompt tokens: the reference",
              flush=True)
        ref_run = serve_config("recompute", model, requests, work / "recompute", args, concurrency=1)
        reference = {r["id"]: r for r in ref_run["results"]}
        ref_failed = sum("error" in r for r in ref_run["results"])
        for blocks in args.device_blocks:
            budgets.append(run_budget(argparse.Namespace(**{**vars(args), "device_blocks": blocks}), model,
                                      requests, reference, work / f"blocks-{blocks}"))
    host = finish(host)
    result: dict[str, Any] = {
        "configs": list(CONFIGS), "host": host,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "workload": {"requests": len(requests), "conversations": args.conversations,
                     "prompt_tokens": sum(len(q["prompt"]) for q in requests),
                     "output_tokens": sum(q["max_tokens"] for q in requests)},
        "reference_failed_requests": ref_failed}
    if len(budgets) == 1:
        result.update(budgets[0])
    else:
        result["budgets"] = budgets
    print(format_table(result))
    print(describe(host))
    return result


def run_budget(args: argparse.Namespace, model: Path, requests: list[dict[str, Any]],
               reference: dict[int, dict[str, Any]], work: Path) -> dict[str, Any]:
    """``--rounds`` rounds of every configuration at the device budget ``args.device_blocks``."""
    rounds: list[dict[str, Any]] = []
    orders: list[list[str]] = []
    samples: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for n in range(args.rounds):
        order = [CONFIGS[(i + n) % len(CONFIGS)] for i in range(len(CONFIGS))]
        orders.append(order)
        row: dict[str, Any] = {}
        for config in order:
            print(f"{args.device_blocks} device blocks, round {n + 1}/{args.rounds}: {config}", flush=True)
            run = serve_config(config, model, requests, work / f"{config}-{n}", args, args.concurrency)
            row[config] = summarize(config, run, reference, requests)
            row[config]["per_request"] = run["results"]
            row[config]["alone"] = run["alone"]
            samples[config] += [r["ttft_s"] for r in run["results"] if "error" not in r]
        rounds.append(row)
    table = {c: {k: statistics.median(r[c][k] for r in rounds)
                 for k in ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s", "hit_rate", "device_hit_tokens",
                           "store_hit_tokens", "store_bytes")} for c in CONFIGS}
    for c in CONFIGS:
        for k in ("failed_requests", "wrong_with_cached_prefix", "wrong_without", "compared", "store_alloc_failures",
                  "served_a_cached_prefix", "alone_failed", "differ_under_load"):
            table[c][k] = sum(r[c][k] for r in rounds)
    # saves the connector did not write (hylinker: its host staging budget was full); vLLM's
    # connector does not export such a count (None)
    table["hylinker"]["skipped_saves"] = sum(r["hylinker"]["connector"]["objects_skipped"] for r in rounds)
    table["vllm_mooncake"]["skipped_saves"] = None
    table["baseline"]["skipped_saves"] = 0
    hy, vm = table["hylinker"], table["vllm_mooncake"]
    ratios = {"throughput_hylinker_over_vllm": round(hy["output_tokens_per_s"] / vm["output_tokens_per_s"], 3),
              "ttft_p99_vllm_over_hylinker": round(vm["ttft_p99_s"] / hy["ttft_p99_s"], 3),
              "ttft_p50_vllm_over_hylinker": round(vm["ttft_p50_s"] / hy["ttft_p50_s"], 3),
              "store_hit_tokens_hylinker_over_vllm": round(hy["store_hit_tokens"] / max(1, vm["store_hit_tokens"]), 3)}
    return {"device_blocks": args.device_blocks, "orders": orders, "table": table, "ratios": ratios,
            "rounds": rounds, "samples": samples}


def format_table(result: dict[str, Any]) -> str:
    """The printed (and docs') tables, one per device budget: medians over rounds; losses and
    exactness summed beside them."""
    lines: list[str] = []
    for budget in result.get("budgets", [result]):
        lines += [f"device budget {budget['device_blocks']} blocks of {BLOCK} tokens:",
                  "| serving, medians of rounds | TTFT p50 s | TTFT p99 s | output tok/s | hit rate (device / store "
                  "tokens) | store MiB | skipped saves | failed requests | alone: wrong (cached prefix / none) of "
                  "compared (cached) | differ under load | store alloc failures |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in result["configs"]:
            t = budget["table"][c]
            skipped = "not exported" if t.get("skipped_saves") is None else t["skipped_saves"]
            lines.append(f"| {NAMES[c]} | {t['ttft_p50_s']:.3f} | {t['ttft_p99_s']:.3f} | "
                         f"{t['output_tokens_per_s']:.1f} | {t['hit_rate']:.3f} ({t['device_hit_tokens']:.0f} / "
                         f"{t['store_hit_tokens']:.0f}) | {t['store_bytes'] / 2**20:.0f} | {skipped} | "
                         f"{t['failed_requests']} | {t['wrong_with_cached_prefix']} / {t['wrong_without']} of "
                         f"{t['compared']} ({t['served_a_cached_prefix']}) | {t['differ_under_load']} | "
                         f"{t['store_alloc_failures']} |")
        r = budget["ratios"]
        lines.append(f"hylinker over vLLM's connector: throughput {r['throughput_hylinker_over_vllm']:.2f}x, "
                     f"TTFT p99 {r['ttft_p99_vllm_over_hylinker']:.2f}x, p50 {r['ttft_p50_vllm_over_hylinker']:.2f}x "
                     f"(above 1: hylinker ahead), store hit tokens "
                     f"{r.get('store_hit_tokens_hylinker_over_vllm', float('nan')):.2f}x")
        for n, rnd in enumerate(budget["rounds"]):
            lines.append(f"round {n + 1}, replay wall s (host load average at its start / end): " + ", ".join(
                f"{NAMES[c]} {rnd[c]['wall_s']:.1f} ({'/'.join(str(x) for x in rnd[c].get('host_load', []))})"
                for c in budget["orders"][n]))
            f = rnd["hylinker"].get("connector", {})
            lines.append(f"round {n + 1}, HylinkerConnector: " + ", ".join(f"{k} {v}" for k, v in f.items()))
    w = result["workload"]
    lines.append(f"workload: {w['requests']} requests of {w['conversations']} conversations, {w['prompt_tokens']} "
                 f"prompt tokens, reference failed {result['reference_failed_requests']}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT CDFs of the three configurations, every round pooled (of the first device budget)."""
    from matplotlib.figure import Figure

    if "budgets" in result:
        result = {**result, **result["budgets"][0]}

    from ..plots import save_ttft_cdf

    fig = Figure(figsize=(7, 5.0))
    ax = fig.add_subplot(1, 1, 1)
    colors = {"vllm_mooncake": "tab:orange", "hylinker": "tab:blue", "baseline": "tab:gray"}
    for config in result["configs"]:
        xs = sorted(result["samples"][config])
        if xs:
            t = result["table"][config]
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=colors[config],
                    label=f"{NAMES[config]}: p99 {t['ttft_p99_s']:.3f} s, hit rate {t['hit_rate']:.2f}")
    host, w = result["host"], result["workload"]
    save_ttft_cdf(fig, ax, path, f"vLLM CPU server, {w['requests']} trace requests at concurrency "
                  f"{result['args']['concurrency']}, {len(result['rounds'])} rounds pooled\n{host['cores']} cores, "
                  f"load {host['load_average'][0]} -> {host.get('load_average_end', '?')}", title_size=9, columns=1,
                  bottom=0.32)


def _budgets(text: str) -> list[int]:
    """``--device-blocks``: ``64`` or ``64,32,16``."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"device blocks must be integers, comma-separated, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hylinker bench-vllm-serving", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12, help="trace conversations (3 turns or more) replayed")
    ap.add_argument("--tokens-per-block", type=int, default=64, help="token ids per 512-token trace block")
    ap.add_argument("--max-input", type=int, default=6144, help="a request's prompt is cut to this many tokens")
    ap.add_argument("--output-scale", type=int, default=16, help="the trace's output length is divided by this")
    ap.add_argument("--max-output", type=int, default=32, help="and capped at this many tokens")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--device-blocks", type=_budgets, default=[64],
                    help="vLLM's device KV budget in blocks of 384; several, comma-separated (64,32,16), "
                         "run side by side after one reference")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the configurations' order rotates")
    ap.add_argument("--integrity", default="checksum", help="hylinker's integrity level")
    ap.add_argument("--segment-mib", type=int, default=2048, help="the storage client's Mooncake segment")
    ap.add_argument("--local-buffer-mib", type=int, default=256, help="vLLM's connector's registered buffer")
    ap.add_argument("--settle-s", type=float, default=1.0, help="pause after a replay before the counters are read")
    ap.add_argument("--seed", type=int, default=0)
    add_output_arguments(ap)  # --plot: the TTFT CDFs
    args = ap.parse_args(argv)
    if plot_only(ap, args, plot):
        return 0
    for name in ("conversations", "tokens_per_block", "max_input", "output_scale", "max_output", "concurrency",
                 "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.device_blocks) < 1:
        ap.error("--device-blocks must be at least 1 each")
    result = run_bench(args)
    write_outputs(args, result, plot, "vllm_serving")
    wrong = sum(t["wrong_with_cached_prefix"] for b in result.get("budgets", [result]) for t in b["table"].values())
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
