"""Run one vLLM engine (CPU build) through a list of steps and print the results as JSON.

The vLLM connector's tests and benchmarks start every engine in its own process with this
script, so engines never share a process (vLLM keeps global state) and a test can kill a store
between steps. Steps (a JSON list, ``--steps``):

* ``{"op": "generate", "prompt": [ids...], "max_tokens": 8}`` → tokens, top-3 logprobs per
  token, ``cached`` (prompt tokens vLLM did not compute: its prefix cache plus the connector),
  ``seconds`` and ``ttft_s`` (time to the first token, from a separate 1-token request); optional
  ``"cache_salt": "A"`` (the prompt's per-request salt); optional ``"lora": {"name": "a1",
  "id": 1, "path": DIR}`` (the request's LoRA adapter; the engine needs ``--max-lora-rank``);
* ``{"op": "ttft", "prompt": [ids...]}`` → ``ttft_s`` and ``cached`` of a 1-token request (its
  latency is the time to first token); optional ``"logprobs": true`` (its token and top-3
  logprobs), ``"pause_s": 1.0`` (a pause before the timer starts: writes of what ran before land);
* ``{"op": "decode", "prompt": [ids...], "max_tokens": 64}`` → the request streamed through the
  engine's step loop (``LLMEngine.add_request`` / ``step``, EOS ignored): ``ttft_s`` and
  ``token_s``, the time each later token arrived after the one before it (one engine step
  each; tokens that arrive together count 0 for all but the first), and ``tokens``;
* ``{"op": "reset"}`` → vLLM's prefix cache reset (the connector's store is kept): ``ok`` and
  ``flushes``. vLLM refuses a reset while a block is still held, and its own
  ``MooncakeStoreConnector`` holds a restored request's blocks until a later engine step; so a
  refused reset runs a short request (below one block: no connector work) and tries again, at
  most ``RESET_FLUSHES`` times. Without that, the "restore" after it is a hit in vLLM's own
  prefix cache, not a load from the store;
* ``{"op": "sleep", "s": 0.5}`` → pause (lets asynchronous saves land before a restore);
* ``{"op": "kill", "pid": N}`` → SIGKILL that process (a Mooncake master, say);
* ``{"op": "stats"}`` → the connector's counters (scheduler and worker side) where the engine
  runs in this process (``--in-process``); in vLLM's default process model the workers log theirs
  at shutdown (``hylinker: rank R worker shut down ... statistics {...}``).

    python -m hylinker.tools.harness.vllm_runner --model DIR --extra '{"store": "embedded"}' --steps '[...]'

By default the engine runs as ``LLM(...)`` does for its users (its engine core and workers in
processes of their own); ``--in-process`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core
and, at TP 1, the worker in this process). ``--tp N``: tensor parallel size.

``--max-lora-rank R``: LoRA enabled (``enable_lora``, two adapters at a time, rank up to R).

``--extra none`` runs without the connector and without vLLM's prefix cache: the reference;
``--extra prefix-only`` without the connector, with vLLM's prefix cache. ``--connector
mooncake-store`` runs vLLM's own ``MooncakeStoreConnector`` instead of hylinker's, ``--extra`` as its
``kv_connector_extra_config`` (its Mooncake settings come from the file ``MOONCAKE_CONFIG_PATH``
names).
Results: one JSON object per step, each on a line of its own after ``RESULT ``. With ``--result-fd N``
(instead of ``--steps``) the engine takes its steps one JSON object a line from stdin and answers
each at once, one JSON line on the inherited descriptor ``N``, until stdin closes: a benchmark can
then run several engines side by side, a step of each in turn (``bench-vllm-peers --interleave``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

BLOCK_SIZE = 384
#: short requests a refused prefix-cache reset may run, each followed by another try (see "reset")
RESET_FLUSHES = 5
FLUSH_PROMPT = [11, 12, 13, 14]
#: ``--connector``: the KVTransferConfig fields that select it
CONNECTORS: dict[str, dict[str, Any]] = {
    "hylinker": {"kv_connector": "HylinkerConnector", "kv_connector_module_path": "hylinker.integrations.vllm"},
    "mooncake-store": {"kv_connector": "MooncakeStoreConnector"},
}


def _connectors(llm: Any) -> list[Any]:
    """The connector instances of an in-process engine (scheduler side, worker side)."""
    found = []
    with contextlib.suppress(AttributeError):
        found.append(llm.llm_engine.engine_core.engine_core.scheduler.connector)
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        found.append(get_kv_transfer_group())
    except Exception:
        pass
    return [c for c in found if c is not None and hasattr(c, "statistics")]


class _PeerStats:
    """vLLM's own connector's per-step stats (``get_kv_connector_stats``, drained by the engine each
    step) kept for the whole run: wraps the in-process worker connector's method."""

    def __init__(self) -> None:
        self.total: Any = None

    def install(self) -> None:
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = get_kv_transfer_group()
        except Exception:
            return
        original = worker.get_kv_connector_stats

        def kept(*args: Any, **kwargs: Any) -> Any:
            stats = original(*args, **kwargs)
            if stats is not None and not stats.is_empty():
                copy = type(stats)(data={k: list(v) for k, v in stats.data.items()})
                self.total = copy if self.total is None else self.total.aggregate(copy)
            return stats

        worker.get_kv_connector_stats = kept

    def reduced(self) -> dict[str, Any]:
        return dict(self.total.reduce()) if self.total is not None else {}


def _decode(llm: Any, step: dict[str, Any], request_id: str) -> dict[str, Any]:
    """One request through the engine's step loop, timing each token's arrival."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=int(step.get("max_tokens", 64)), temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": list(step["prompt"])}, sp)
    arrivals: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            now = time.perf_counter()
            tokens = list(out.outputs[0].token_ids)
            arrivals += [now] * (len(tokens) - len(arrivals))
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {"op": "decode", "tokens": tokens, "ttft_s": arrivals[0] - t0 if arrivals else None, "token_s": gaps}


def _prompt(step: dict[str, Any]) -> dict[str, Any]:
    """A generate step's prompt, with its ``cache_salt`` if it has one."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(step["prompt"])}
    if "cache_salt" in step:
        prompt["cache_salt"] = step["cache_salt"]
    return prompt


def _logprobs(output: Any) -> list[list[list[float]]]:
    """A completion's top logprobs per token as ``[[token, logprob], ...]``, best first."""
    return [sorted(([int(k), float(v.logprob)] for k, v in lp.items()), key=lambda kv: -kv[1])
            for lp in (output.logprobs or [])]


def _lora(step: dict[str, Any]) -> Any:
    """A generate step's ``LoRARequest``, or None."""
    if "lora" not in step:
        return None
    from vllm.lora.request import LoRARequest

    spec = step["lora"]
    return LoRARequest(str(spec["name"]), int(spec["id"]), str(spec["path"]))


def _reset(llm: Any, one_token: Any) -> dict[str, Any]:
    """vLLM's prefix cache reset; a refused reset is retried after a short request (module doc)."""
    flushes = 0
    ok = bool(llm.reset_prefix_cache())
    while not ok and flushes < RESET_FLUSHES:
        llm.generate([{"prompt_token_ids": FLUSH_PROMPT}], one_token, use_tqdm=False)
        flushes += 1
        ok = bool(llm.reset_prefix_cache())
    return {"op": "reset", "ok": ok, "flushes": flushes}


def _step(llm: Any, step: dict[str, Any], n: int, peer_stats: _PeerStats) -> dict[str, Any]:
    """Run step ``n`` (see the module docstring) and return its result."""
    from vllm import SamplingParams

    op = step["op"]
    if op == "generate":
        prompt = _prompt(step)
        sp = SamplingParams(max_tokens=int(step.get("max_tokens", 8)), temperature=0.0, logprobs=3)
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False, lora_request=_lora(step))[0]
        seconds = time.perf_counter() - t0
        o = out.outputs[0]
        return {"op": op, "tokens": list(o.token_ids), "logprobs": _logprobs(o),
                "cached": int(out.num_cached_tokens or 0), "seconds": seconds}
    elif op == "ttft":  # a 1-token request: its latency is the time to first token
        prompt = {"prompt_token_ids": list(step["prompt"])}
        sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3 if step.get("logprobs") else None)
        time.sleep(float(step.get("pause_s", 0.0)))  # before the timer: what ran before it settles
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        row = {"op": op, "ttft_s": time.perf_counter() - t0, "cached": int(out.num_cached_tokens or 0)}
        if step.get("logprobs"):
            row.update(tokens=list(out.outputs[0].token_ids), logprobs=_logprobs(out.outputs[0]))
        return row
    elif op == "decode":
        return _decode(llm, step, f"decode-{n}")
    elif op == "reset":
        return _reset(llm, SamplingParams(max_tokens=1, temperature=0.0))
    elif op == "sleep":
        time.sleep(float(step.get("s", 0.5)))
        return {"op": op}
    elif op == "kill":
        os.kill(int(step["pid"]), signal.SIGKILL)
        time.sleep(float(step.get("settle_s", 1.0)))
        return {"op": op}
    elif op == "stats":
        stats: dict[str, int] = {}
        for c in _connectors(llm):
            for k, v in attrs.asdict(c.statistics()).items():
                stats[k] = stats.get(k, 0) + v  # each counter lives on one side
        return {"op": op, "stats": stats or peer_stats.reduced()}
    else:
        raise SystemExit(f"unknown step {op!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON, 'none' or 'prefix-only'")
    ap.add_argument("--steps", help="JSON list of steps (see the module docstring), or @FILE")
    ap.add_argument("--result-fd", type=int,
                    help="steps one JSON object a line on stdin, each result a line on this inherited descriptor")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--max-lora-rank", type=int, default=0, help="enable LoRA with this maximum rank (0: off)")
    ap.add_argument("--in-process", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=0")
    ap.add_argument("--connector", choices=sorted(CONNECTORS), default="hylinker",
                    help="whose KV connector: hylinker's or vLLM's own Mooncake store connector")
    args = ap.parse_args(argv)
    if (args.steps is None) == (args.result_fd is None):
        ap.error("give --steps or --result-fd")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if args.max_lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=args.max_lora_rank, max_loras=2)
    if args.extra not in ("none", "prefix-only"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            **CONNECTORS[args.connector], kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=json.loads(args.extra))
    llm = LLM(model=args.model, dtype="bfloat16", block_size=args.block_size,
              enable_prefix_caching=args.extra != "none", max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_model_len, enforce_eager=True, seed=0,
              tensor_parallel_size=args.tp, **kwargs)
    peer_stats = _PeerStats()
    if args.connector != "hylinker" and args.in_process:
        peer_stats.install()
    if args.result_fd is not None:  # steps one by one from stdin, each result on its own descriptor
        with os.fdopen(args.result_fd, "w") as answers:
            for n, line in enumerate(sys.stdin):
                answers.write(json.dumps(_step(llm, json.loads(line), n, peer_stats)) + "\n")
                answers.flush()
        shutdown_engine(llm)
        return 0
    text = Path(args.steps[1:]).read_text() if args.steps.startswith("@") else args.steps
    results = [_step(llm, step, n, peer_stats) for n, step in enumerate(json.loads(text))]
    for r in results:
        print("RESULT " + json.dumps(r))
    sys.stdout.flush()
    shutdown_engine(llm)
    return 0


# vLLM gives its engine-core process 5 s after SIGTERM before it kills it (its default when no
# timeout is passed). The worker's connector drains its writes (``drain_timeout_s``, 10 s by default)
# and logs its statistics during that teardown, and on two loaded cores the teardown alone can pass
# 5 s: the statistics line was then never written (a CI failure). The grace covers the drain with room.
SHUTDOWN_GRACE_S = 60.0


def shutdown_engine(llm: Any) -> None:
    """Shut the engine down, waiting for the connector's drain (bounded by ``drain_timeout_s``)."""
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)


if __name__ == "__main__":
    raise SystemExit(main())
