"""hylinker's vLLM connector against the one vLLM ships (``MooncakeStoreConnector``), side by side in
one run, on vLLM's CPU build.

Three configurations run the same model and the same prompts, each engine in a process of its own
(``hylinker.tools.harness.vllm_runner``, engine core and worker in that process so both connectors' counters
can be read):

* ``vllm_mooncake``: vLLM's ``MooncakeStoreConnector`` (``standalone-store`` mode, the engine
  contributes no segment, asynchronous loads: its defaults);
* ``hylinker``: ``HylinkerConnector`` on Mooncake (``segment_mb`` 0, integrity the first level of
  ``--integrity``, ``"checksum"`` by default; each further level, e.g. ``--integrity checksum,header``,
  adds a configuration ``hylinker_<level>``: what the checksum costs, measured in the same run);
* ``baseline``: no connector, vLLM's own prefix cache (reset before each restore row: a recompute).

Each connector engine gets a fresh loopback ``mooncake_master`` and a storage-only client holding
the memory (``hylinker mooncake segment``). ``--rounds`` rounds, the order of the three rotating
each round (the machine's other tenants then weigh on all three alike). Per prompt length and
round: ``--repeats`` fresh prompts with a 1-token request each (a **miss**: computed and, with a
connector, saved; its time to first token is what saving costs the step), a pause, then
``--repeats`` times vLLM's prefix cache reset and the first prompt again (a **restore**; in the
baseline a recompute). vLLM refuses a reset while a connector still holds blocks (its own
connector holds a restored request's blocks until a later step): the runner then runs a short
request and resets again (``tools/harness/vllm_runner.py``); ``resets_flushed`` counts those, and a
restore whose reset was still refused (``restores_not_reset``: a hit in vLLM's own prefix cache)
is left out of the figures. Each engine first runs a miss and a restore of each length, not measured
(first calls compile and allocate). Then a decode (``--decode-tokens`` per fresh ``--decode-prompt``-token
prompt, below one block: the connector stays idle) timed per step.

Exactness and losses, beside the figures: every restore's first token and top-3 logprobs (and one
8-token greedy continuation per length) are compared with the baseline's recompute of the same
prompt; a restore that got fewer tokens from the store than the boundary below the prompt allows is
a **short restore** (a dropped or refused load, or a save that never landed); failed and skipped
saves and failed loads come from each connector's own counters (hylinker's ``statistics()``, the
error and failed-key counts of vLLM's connector stats).

    OMP_NUM_THREADS=2 .venv-vllm/bin/python -m hylinker bench-vllm-peers --sizes 4096 --rounds 3 \\
        --json bench-results/vllm-peers.json --plot bench-results/vllm-peers.png

Medians over every round. The JSON carries every sample and the host (``tools/bench/host.py``). The
plot (TTFT CDFs of restores and misses per configuration) needs matplotlib; without it in the vLLM
environment, draw it later with ``python3 -m hylinker.tools.bench.vllm_peers --plot-from JSON --plot PNG``.

``--before DIR`` adds a fourth configuration, ``hylinker_before``: the same connector imported from
``DIR`` (a folder holding another checkout as ``hylinker``, e.g. a ``git worktree`` of main), so a
change is measured before and after in one run.

What a user's miss costs (issue 52, item 5; docs/figures/vllm-peers.md): ``--recompute`` adds a
configuration without connector and without vLLM's prefix cache (``recompute``: the prompt in one
prefill step; with the prefix cache vLLM's ``align`` mode ends the first chunk at the last block
boundary and runs the tail as a second step); ``--reset-misses`` resets vLLM's prefix cache before
each miss and ``--miss-gap-s`` pauses before its timer (0: back to back, beside the writes of the
save before it); ``--misses``, ``--restores`` and ``--block-size`` shape a run like another
setup's. On a loaded host ``--interleave`` runs every configuration's engine at once, each idle
while another runs a step (the runner's ``--result-fd``), so the host's load weighs on every
configuration alike; each miss is then also divided by the recompute's miss of the same step
(``miss_over_recompute_paired``, the median printed).

``--geometry qwen3-next-80b`` runs Qwen3-Next-80B's geometry (``tools/harness/shapes.py``: 48 layers, its
KV heads, head and state dims, block 1,056) with a narrow residual stream; ``--tp 2`` runs vLLM's
default process model (two worker processes; the connectors' counters then stay in the workers and
only short restores are counted). Serving under load (the OpenAI server replaying the conversation
trace with each connector) is ``hylinker bench-vllm-serving`` (``tools/bench/vllm_serving.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .output import add_output_arguments, plot_only, write_outputs

CONFIGS = ("vllm_mooncake", "hylinker", "baseline")
#: configurations without a connector (no exactness or loss figures of their own)
NO_CONNECTOR = ("baseline", "recompute")
GEOMETRIES = ("tiny", "qwen3-next-80b")


def _levels(integrity: str) -> list[str]:
    """``--integrity`` as a list: the first level is ``hylinker``'s, each further one a configuration of its own."""
    return [level.strip() for level in str(integrity).split(",") if level.strip()]


def _integrity(config: str, args: argparse.Namespace) -> str:
    """The integrity level a hylinker configuration runs at (``hylinker_<level>``, else the first level)."""
    levels = _levels(args.integrity)
    suffix = config.removeprefix("hylinker_")
    return suffix if config != "hylinker" and suffix in levels[1:] else levels[0]


@contextlib.contextmanager
def _engine_command(config: str, model: Path, work: Path, args: argparse.Namespace,
                    block: int) -> Iterator[tuple[list[str], dict[str, str]]]:
    """The runner's command line and environment for configuration ``config`` (without its steps),
    with the configuration's fresh store running while the context is open."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [sys.executable, "-m", "hylinker.tools.harness.vllm_runner", "--model", str(model),
           "--max-model-len", str(max(args.size_list) + 1024), "--tp", str(args.tp), "--block-size", str(block)]
    if args.tp == 1:
        cmd.append("--in-process")
    from .vllm import fresh_store, vllm_mooncake_env

    with contextlib.ExitStack() as stack:
        if config == "baseline":
            cmd += ["--extra", "prefix-only"]
        elif config == "recompute":  # no connector and no prefix cache: one prefill chunk, as a user without either
            cmd += ["--extra", "none"]
        else:
            address = stack.enter_context(fresh_store(work, args.segment_mib)).address
            if config.startswith("hylinker"):
                if config == "hylinker_before":
                    env["PYTHONPATH"] = os.pathsep.join([str(args.before), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
                extra = {"store": "mooncake", "master": address, "segment_mb": 0,
                         "integrity": _integrity(config, args)}
                cmd += ["--extra", json.dumps(extra)]
            else:
                env.update(vllm_mooncake_env(work, address, args.local_buffer_mib))
                cmd += ["--connector", "mooncake-store", "--extra", "{}"]
        yield cmd, env


def _engine(config: str, model: Path, steps: list[dict[str, Any]], work: Path, args: argparse.Namespace,
            block: int) -> list[dict[str, Any]]:
    """Run one engine through ``steps`` in configuration ``config``; its result rows."""
    from .vllm import runner_rows

    steps_file = work / f"{config}.steps.json"
    steps_file.write_text(json.dumps(steps))
    with _engine_command(config, model, work, args, block) as (cmd, env):
        return runner_rows([*cmd, "--steps", f"@{steps_file}"], env, work / f"{config}.log", len(steps),
                           f"{config} engine")


def _engines_interleaved(order: list[str], model: Path, steps: list[dict[str, Any]], work: Path,
                         args: argparse.Namespace, block: int) -> dict[str, list[dict[str, Any]]]:
    """Run every configuration's engine at once, each idle while another runs: step ``i`` of each
    in turn (the order rotating with ``i``), so a load that comes and goes on the host weighs on
    every configuration's samples alike. Their result rows per configuration."""
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in order}
    with contextlib.ExitStack() as stack:
        engines: dict[str, tuple[subprocess.Popen[str], Any, Path]] = {}
        for config in order:
            cmd, env = stack.enter_context(_engine_command(config, model, work / config, args, block))
            read_fd, write_fd = os.pipe()
            log = work / config / f"{config}.log"
            err = stack.enter_context(open(log, "w"))
            proc = subprocess.Popen([*cmd, "--result-fd", str(write_fd)], stdin=subprocess.PIPE, stdout=err,
                                    stderr=err, env=env, text=True, pass_fds=(write_fd,))
            os.close(write_fd)
            stack.callback(_stop, proc)
            engines[config] = (proc, stack.enter_context(os.fdopen(read_fd)), log)
        for i, step in enumerate(steps):
            for k in range(len(order)):
                config = order[(i + k) % len(order)]
                proc, answers, log = engines[config]
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(step) + "\n")
                proc.stdin.flush()
                line = answers.readline()
                if not line:
                    raise RuntimeError(f"{config} engine failed at step {i}, see {log}:\n{log.read_text()[-3000:]}")
                rows[config].append(json.loads(line))
    return rows


def _stop(proc: subprocess.Popen[str]) -> None:
    """Close an interleaved engine's steps (it shuts down, draining its connector) and wait for it."""
    if proc.stdin is not None and not proc.stdin.closed:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _round_steps(args: argparse.Namespace, rng: random.Random) -> tuple[list[dict[str, Any]], dict[int, list[list[int]]]]:
    """One round's steps (the same for every configuration) and its prompts per length."""
    prompts = {n: [[rng.randrange(10, 300) for _ in range(n)] for _ in range(args.misses)] for n in args.size_list}
    steps: list[dict[str, Any]] = []
    for n in args.size_list:  # warm-up, not measured: a miss and a restore of each length
        warm = [rng.randrange(10, 300) for _ in range(n)]
        steps += [{"op": "ttft", "prompt": warm, "logprobs": True}, {"op": "sleep", "s": args.settle_s},
                  {"op": "reset"}, {"op": "ttft", "prompt": warm, "logprobs": True}]
    for n in args.size_list:
        for p in prompts[n]:
            steps += [{"op": "reset"}] if args.reset_misses else []
            steps.append({"op": "ttft", "prompt": p, "logprobs": True, "row": f"miss:{n}", "pause_s": args.miss_gap_s})
        steps.append({"op": "sleep", "s": args.settle_s})
        for _ in range(args.restores):
            steps += [{"op": "reset"}, {"op": "ttft", "prompt": prompts[n][0], "logprobs": True, "row": f"restore:{n}"}]
        steps += [{"op": "reset"}, {"op": "generate", "prompt": prompts[n][0], "max_tokens": 8, "row": f"check:{n}"}]
    for _ in range(args.repeats):
        steps.append({"op": "decode", "prompt": [rng.randrange(10, 300) for _ in range(args.decode_prompt)],
                      "max_tokens": args.decode_tokens, "row": "decode"})
    steps.append({"op": "stats"})
    return steps, prompts


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"])


def _losses(config: str, stats: dict[str, Any]) -> dict[str, int]:
    """Failed or skipped saves and failed loads from a connector's own counters (0 where it has none);
    ``unread`` 1 where the counters stayed in worker processes (``--tp`` > 1)."""
    if not stats and config not in NO_CONNECTOR:
        return {"unread": 1}
    if config.startswith("hylinker"):
        return {"saves_failed": int(stats.get("saves_failed", 0)), "saves_skipped": int(stats.get("saves_skipped", 0)),
                "loads_failed": int(stats.get("loads_failed", 0)), "lookup_errors": int(stats.get("lookup_errors", 0))}
    if config == "vllm_mooncake":
        def total(prefix: str, kind: str) -> int:
            return sum(int(v) for k, v in stats.items() if k.startswith(prefix) and k.endswith(kind))
        return {"saves_failed": total("save", "_error_count") + total("save", "_failed_keys"),
                "saves_skipped": 0,
                "loads_failed": total("load", "_error_count") + total("load", "_failed_keys"),
                "lookup_errors": total("lookup", "_error_count")}
    return {}


def _median(xs: Sequence[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from ..harness.shapes import QWEN3_NEXT_80B, build_qwen3_next_at
    from ..harness.tiny_qwen3_next import build_tiny_qwen3_next
    from .host import describe, finish, host_record

    host = host_record()
    rng = random.Random(args.seed)
    configs = [*CONFIGS, *(f"hylinker_{level}" for level in _levels(args.integrity)[1:]),
               *(["hylinker_before"] if args.before else []), *(["recompute"] if args.recompute else [])]
    samples: dict[str, dict[str, list[float]]] = {c: {} for c in configs}
    cached: dict[str, dict[str, list[int]]] = {c: {} for c in configs}
    findings: dict[str, dict[str, int]] = {c: {"restores_compared": 0, "wrong_restores": 0, "short_restores": 0,
                                               "misses_compared": 0, "wrong_misses": 0, "resets_flushed": 0,
                                               "restores_not_reset": 0} for c in configs}
    losses: dict[str, dict[str, int]] = {c: {} for c in configs}
    stats_all: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    orders: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="hylinker-bench-vllm-peers-") as tmp:
        work = Path(tmp)
        if args.geometry == "tiny":
            model, block = build_tiny_qwen3_next(work / "model"), 384
        else:
            model, block = build_qwen3_next_at(work / "model", QWEN3_NEXT_80B), QWEN3_NEXT_80B.vllm_block_size(args.tp)
        block = args.block_size or block
        for r in range(args.rounds):
            steps, _ = _round_steps(args, rng)
            order = [configs[(i + r) % len(configs)] for i in range(len(configs))]
            orders.append(order)
            rows: dict[str, list[dict[str, Any]]] = {}
            for config in order:
                (work / config).mkdir(exist_ok=True)
            if args.interleave:
                print(f"round {r + 1}/{args.rounds}: {', '.join(order)} interleaved", flush=True)
                rows = _engines_interleaved(order, model, steps, work, args, block)
            for config in [] if args.interleave else order:
                print(f"round {r + 1}/{args.rounds}: {config}", flush=True)
                rows[config] = _engine(config, model, steps, work / config, args, block)
            ref = {s.get("row", "") + f"#{i}": row for i, (s, row) in enumerate(zip(steps, rows["baseline"]))}
            for config in configs:
                reset_ok = True
                for i, (step, got) in enumerate(zip(steps, rows[config])):
                    name = step.get("row")
                    if name is None:
                        if got["op"] == "reset":
                            reset_ok = bool(got.get("ok", True))
                            findings[config]["resets_flushed"] += int(got.get("flushes", 0)) > 0
                        if got["op"] == "stats":
                            stats_all[config].append(got["stats"])
                            for k, v in _losses(config, got["stats"]).items():
                                losses[config][k] = losses[config].get(k, 0) + v
                        continue
                    kind, _, size = name.partition(":")
                    if kind == "decode":
                        samples[config].setdefault("decode_step", []).extend(got["token_s"])
                        continue
                    base = ref[f"{name}#{i}"]
                    if kind == "restore" and not reset_ok:  # vLLM's prefix cache still held it: no store load
                        findings[config]["restores_not_reset"] += 1
                        continue
                    if kind in ("restore", "check"):
                        cached[config].setdefault(size, []).append(got["cached"])
                        if config not in NO_CONNECTOR:
                            findings[config]["restores_compared"] += 1
                            findings[config]["wrong_restores"] += not _same(got, base)
                            n = int(size)
                            findings[config]["short_restores"] += got["cached"] < (n - 1) // block * block
                    elif kind == "miss" and config not in NO_CONNECTOR:
                        findings[config]["misses_compared"] += 1
                        findings[config]["wrong_misses"] += not _same(got, base)
                    if kind != "check":
                        samples[config].setdefault(name, []).append(got["ttft_s"])
    host = finish(host)
    table = []
    for n in args.size_list:
        row: dict[str, Any] = {"tokens": n}
        for config in configs:
            restores, misses = samples[config].get(f"restore:{n}", []), samples[config].get(f"miss:{n}", [])
            row[config] = {"restore_s": _median(restores), "miss_s": _median(misses),
                           "restore_best_s": round(min(restores), 4), "miss_best_s": round(min(misses), 4),
                           "cached": sorted(set(cached[config].get(str(n), [])))}
        hy, vm, base = row["hylinker"], row["vllm_mooncake"], row["baseline"]
        row["restore_speedup_over_vllm"] = {c: round(vm["restore_s"] / row[c]["restore_s"], 3)
                                            for c in configs if c.startswith("hylinker")}
        row["miss_over_recompute"] = {c: round(row[c]["miss_s"] / base["miss_s"], 3) for c in configs if c != "baseline"}
        if args.interleave:  # each miss over the recompute's miss of the same step (misses are never left out)
            row["miss_over_recompute_paired"] = {
                c: _median([a / b for a, b in zip(samples[c][f"miss:{n}"], base_misses)])
                for c in configs if c != "baseline" for base_misses in [samples["baseline"][f"miss:{n}"]]}
        if args.recompute:  # against a recompute without vLLM's prefix cache (one prefill chunk, no alignment)
            row["miss_over_no_prefix_cache"] = {c: round(row[c]["miss_s"] / row["recompute"]["miss_s"], 3)
                                                for c in configs if c != "recompute"}
        if args.before:
            row["restore_speedup_over_before"] = round(row["hylinker_before"]["restore_s"] / hy["restore_s"], 3)
        table.append(row)
    decode = {c: {"median_ms": round(1000 * statistics.median(samples[c]["decode_step"]), 3),
                  "steps": len(samples[c]["decode_step"])} for c in configs}
    result = {"configs": configs, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "size_list"},
              "host": host,
              "orders": orders, "block_size": block, "ttft": table, "decode": decode, "findings": findings,
              "losses": losses, "connector_stats": stats_all, "samples": samples}
    print(format_table(result))
    print(describe(host))
    return result


def format_table(result: dict[str, Any]) -> str:
    """The printed (and docs') table: medians per configuration, exactness and losses beside them."""
    levels = _levels(result["args"].get("integrity", "checksum"))
    names = {"vllm_mooncake": "vLLM MooncakeStoreConnector", "hylinker": f"HylinkerConnector ({levels[0]})",
             "baseline": "no connector (recompute)", "hylinker_before": "HylinkerConnector, --before build",
             "recompute": "no connector, no prefix cache"}
    names.update({f"hylinker_{level}": f"HylinkerConnector ({level})" for level in levels[1:]})
    lines = ["| TTFT median / best | " + " | ".join(f"restore {r['tokens']} s (cached) | miss {r['tokens']} s"
                                                   for r in result["ttft"])
             + " | decode step ms | wrong restores | short restores | failed/skipped saves, failed loads |",
             "|---|" + "---|---|" * len(result["ttft"]) + "---|---|---|---|"]
    for c in result["configs"]:
        cells = []
        for r in result["ttft"]:
            x = r[c]
            ratio = "" if c == "baseline" else f" ({r['miss_over_recompute'][c]:.2f}x recompute)"
            if c != "recompute" and "miss_over_no_prefix_cache" in r:
                ratio += f" ({r['miss_over_no_prefix_cache'][c]:.2f}x no prefix cache)"
            cells.append(f"{x['restore_s']:.3f} / {x['restore_best_s']:.3f} ({'/'.join(map(str, x['cached']))}) | "
                         f"{x['miss_s']:.3f} / {x['miss_best_s']:.3f}{ratio}")
        f = result["findings"][c]
        lost = result["losses"][c]
        loss = "—" if c in NO_CONNECTOR else "not read (workers' counters)" if lost.get("unread") else (
            f"{lost.get('saves_failed', 0)}/{lost.get('saves_skipped', 0)}, {lost.get('loads_failed', 0)}")
        exact = "—" if c in NO_CONNECTOR else f"{f['wrong_restores']} of {f['restores_compared']}"
        short = "—" if c in NO_CONNECTOR else str(f["short_restores"])
        lines.append(f"| {names[c]} | " + " | ".join(cells)
                     + f" | {result['decode'][c]['median_ms']:.2f} | {exact} | {short} | {loss} |")
    for c in result["configs"]:
        f = result["findings"][c]
        if f.get("resets_flushed") or f.get("restores_not_reset"):
            lines.append(f"{names[c]}: {f['resets_flushed']} prefix-cache resets refused until a short request ran, "
                         f"{f['restores_not_reset']} restores left out (their reset stayed refused)")
    for r in result["ttft"]:
        if "miss_over_recompute_paired" in r:
            lines.append(f"miss {r['tokens']}, each over the recompute's miss of the same step (median): "
                         + ", ".join(f"{names[c]} {x:.2f}x" for c, x in r["miss_over_recompute_paired"].items()))
        lines.append(f"restore {r['tokens']}: " + ", ".join(f"{names[c]} {x:.2f}x vLLM's connector"
                                                             for c, x in r["restore_speedup_over_vllm"].items())
                     + (f"; {r['restore_speedup_over_before']:.2f}x the --before build" if "hylinker_before" in r else ""))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT CDFs of the three configurations: restores (solid) and misses (dashed), every length pooled."""
    from matplotlib.figure import Figure

    from ..plots import save_ttft_cdf

    fig = Figure(figsize=(7, 5.6))
    ax = fig.add_subplot(1, 1, 1)
    colors = {"vllm_mooncake": "tab:orange", "hylinker": "tab:blue", "baseline": "tab:gray",
              "hylinker_before": "tab:cyan", "hylinker_header": "tab:green"}
    for config in result["configs"]:
        for kind, style in (("restore", "-"), ("miss", "--")):
            xs = sorted(v for k, vs in result["samples"][config].items() if k.startswith(kind + ":") for v in vs)
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                label = f"{config} {kind if config != 'baseline' or kind == 'miss' else 'recompute'}"
                ax.step(xs, ys, style, where="post", color=colors.get(config, "tab:red"), label=label)
    sizes = ",".join(str(r["tokens"]) for r in result["ttft"])
    host = result["host"]
    # a log axis: restores and misses differ by an order of magnitude; stalls by another
    save_ttft_cdf(fig, ax, path, f"vLLM CPU build, {sizes} tokens, {host['cores']} cores, load "
                  f"{host['load_average'][0]} -> {host.get('load_average_end', '?')}", title_size=10, columns=2,
                  bottom=0.36)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hylinker bench-vllm-peers", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4096", help="prompt lengths in tokens, e.g. 4096,16384")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the configurations' order rotates each round")
    ap.add_argument("--repeats", type=int, default=5, help="misses and restores per length and round")
    ap.add_argument("--misses", type=int, help="misses per length and round (default: --repeats)")
    ap.add_argument("--restores", type=int, help="restores per length and round (default: --repeats)")
    ap.add_argument("--block-size", type=int, help="vLLM's block size (default: the geometry's, 384 for tiny)")
    ap.add_argument("--recompute", action="store_true",
                    help="add a configuration without connector and without vLLM's prefix cache (one prefill chunk)")
    ap.add_argument("--reset-misses", action="store_true", help="reset vLLM's prefix cache before each miss")
    ap.add_argument("--interleave", action="store_true",
                    help="run the configurations' engines at once, a step of each in turn (TP 1; a loaded host)")
    ap.add_argument("--miss-gap-s", type=float, default=0.0,
                    help="pause before each miss's timer (0: back to back, beside the writes of the save before it; "
                         "with --interleave, of another engine's)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--decode-prompt", type=int, default=300, help="below one block: the connector stays idle")
    ap.add_argument("--integrity", default="checksum",
                    help="hylinker's integrity level; a list (checksum,header) adds a hylinker configuration per further level")
    ap.add_argument("--geometry", choices=GEOMETRIES, default="tiny")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--segment-mib", type=int, default=1024, help="the storage client's Mooncake segment")
    ap.add_argument("--local-buffer-mib", type=int, default=256, help="vLLM's connector's registered buffer")
    ap.add_argument("--settle-s", type=float, default=0.5, help="pause between the misses and the restores")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--before", type=Path, help="also run HylinkerConnector from this checkout's parent folder "
                                                "(PYTHONPATH), as a fourth configuration: a before/after in one run")
    add_output_arguments(ap)  # --plot: the TTFT CDFs
    args = ap.parse_args(argv)
    if plot_only(ap, args, plot):
        return 0
    args.size_list = [int(s) for s in args.sizes.split(",")]
    if args.interleave and args.tp != 1:
        ap.error("--interleave runs each engine in one process: --tp 1")
    args.misses = args.misses or args.repeats
    args.restores = args.restores or args.repeats
    result = run_bench(args)
    write_outputs(args, result, plot, "vllm_peers")
    bad = sum(f["wrong_restores"] + f["wrong_misses"] for f in result["findings"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
