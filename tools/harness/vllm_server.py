"""vLLM's OpenAI server as a child process, and a small client for it (standard library only).

Used by the connector's server test and by the serve demo (``python -m hylinker serve-demo``).
The server runs the CPU build's defaults otherwise: its engine core and its workers in processes of
their own (no ``VLLM_ENABLE_V1_MULTIPROCESSING`` set). :func:`readme_server_args` reads the launch
line of the README's "For vLLM users" section, so a test can run it as written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .tiny_qwen3_next import BLOCK_SIZE, corpus

README = Path(__file__).resolve().parents[2] / "README.md"
_SECTION = "## For vLLM users"
_HEAD = ["python", "-m", "vllm.entrypoints.openai.api_server"]


def readme_server_args(readme: Path = README) -> list[str]:
    """The arguments of the README's vLLM launch line (after ``python -m vllm.entrypoints...``)."""
    text = readme.read_text()
    start = text.find(_SECTION)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S) if start >= 0 else None
    if block is None:
        raise ValueError(f"{readme} has no bash block in a {_SECTION!r} section")
    words = shlex.split(block.group(1).replace("\\\n", " "))
    if words[:3] != _HEAD:
        raise ValueError(f"the README's vLLM block does not start with {' '.join(_HEAD)}: {words[:3]}")
    return words[3:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any] | None = None, timeout_s: float = 600) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return dict(json.loads(resp.read()))


def connector_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "HylinkerConnector", "kv_connector_module_path": "hylinker.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def start_server(model: Path, port: int, log: Path, *, extra: dict[str, Any] | None,
                 timeout_s: float = 900, readme: bool = False, transfer: dict[str, Any] | None = None,
                 prefix_caching: bool = False, block_size: int = BLOCK_SIZE, max_model_len: int = 20480,
                 server_args: Sequence[str] = (), env_extra: Mapping[str, str] | None = None,
                 ) -> subprocess.Popen[bytes]:
    """Start the server on ``model`` with the connector (``extra``: its extra config), or without
    it and without vLLM's prefix cache (``extra=None``); wait until ``/health`` answers.
    ``readme``: the README's launch line as written (``MODEL`` replaced; ``extra`` unused), plus
    this harness's host, port, seed, dtype and lengths. ``transfer``: a whole ``--kv-transfer-config``
    instead (another connector, e.g. vLLM's own ``MooncakeStoreConnector``); ``prefix_caching``:
    vLLM's prefix cache on where no connector is given; ``server_args`` are appended to the launch
    line and ``env_extra`` to its environment."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_SERVER_DEV_MODE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    env.update(env_extra or {})
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default process model
    length = str(max_model_len)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--dtype", "bfloat16", "--block-size", str(block_size), "--max-model-len", length,
           "--max-num-batched-tokens", length, "--enforce-eager", "--enable-prompt-tokens-details",
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           # vLLM's default (0) kills the worker at once on shutdown: the connector could not drain
           "--shutdown-timeout", "60"]
    if readme:
        args = readme_server_args()
        args[args.index("--model") + 1] = str(model)
        cmd = [sys.executable, "-m", _HEAD[2], *args, "--dtype", "bfloat16", "--max-model-len", "20480",
               "--max-num-batched-tokens", "20480", "--enforce-eager", "--enable-prompt-tokens-details",
               "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    elif transfer is not None:
        cmd += ["--enable-prefix-caching", "--kv-transfer-config", json.dumps(transfer)]
    elif extra is not None:
        cmd += ["--enable-prefix-caching", "--kv-transfer-config", json.dumps(connector_config(extra))]
    else:
        cmd += ["--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    cmd += list(server_args)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(2)
    stop_server(proc)
    raise RuntimeError("the server did not become healthy in time")


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> int:
    """SIGINT (vLLM's graceful shutdown: the connector drains its writes), SIGKILL after
    ``timeout_s``; returns the exit code."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return int(proc.returncode)


def conversation(words: int, seed: int = 7) -> list[dict[str, str]]:
    """A multi-turn chat of about ``words`` tokens (one word of the tiny tokenizer ~ one token)."""
    text = " ".join(corpus(max(1, words // 10), seed=seed))
    return [{"role": "system", "content": "you answer with the state of the cache"},
            {"role": "user", "content": text},
            {"role": "assistant", "content": "the cache holds the prefix"},
            {"role": "user", "content": "restore the boundary and answer the question again"}]


def chat(port: int, messages: list[dict[str, str]], max_tokens: int = 6) -> dict[str, Any]:
    return post(f"http://127.0.0.1:{port}/v1/chat/completions", {
        "model": "", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": True, "top_logprobs": 3})


def _stream(port: int, path: str, body: dict[str, Any], timeout_s: float = 600) -> Iterator[dict[str, Any]]:
    """POST ``body`` (``stream`` set) to ``path`` and yield each server-sent event's JSON."""
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])


def _cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def time_to_first_token(port: int, messages: list[dict[str, str]]) -> tuple[float, int]:
    """Stream a chat completion: seconds until the first content token, and the prompt tokens
    served from a cache (vLLM's own or the connector's)."""
    body = {"model": "", "messages": messages, "max_tokens": 4, "temperature": 0.0}
    t0 = time.perf_counter()
    ttft: float | None = None
    cached = 0
    for event in _stream(port, "/v1/chat/completions", body):
        if ttft is None and event.get("choices") and event["choices"][0].get("delta", {}).get("content") is not None:
            ttft = time.perf_counter() - t0
        if event.get("usage"):
            cached = _cached(event["usage"])
    return (ttft if ttft is not None else time.perf_counter() - t0), cached


def stream_completion(port: int, prompt: list[int], max_tokens: int, *, logprobs: int = 3,
                      timeout_s: float = 600) -> dict[str, Any]:
    """One streamed ``/v1/completions`` request on token ids, greedy: its time to first token and
    total seconds, the generated token ids, the first token's top ``logprobs`` (token id ->
    logprob), and the prompt tokens served from a cache (vLLM's own or a connector's)."""
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": logprobs,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens: list[int] = []
    first: dict[int, float] = {}
    cached = prompt_tokens = 0
    for event in _stream(port, "/v1/completions", body, timeout_s):
        for choice in event.get("choices") or []:
            lp = choice.get("logprobs") or {}
            got = [int(t.removeprefix("token_id:")) for t in lp.get("tokens") or []]
            if got and ttft is None:
                ttft = time.perf_counter() - t0
                top = (lp.get("top_logprobs") or [{}])[0] or {}
                first = {int(k.removeprefix("token_id:")): float(v) for k, v in top.items()}
            tokens += got
        if event.get("usage"):
            prompt_tokens = int(event["usage"].get("prompt_tokens") or 0)
            cached = _cached(event["usage"])
    total = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "tokens": tokens,
            "first_logprobs": first, "cached": cached, "prompt_tokens": prompt_tokens}


def top_logprobs(resp: dict[str, Any]) -> list[list[tuple[str, float]]]:
    content = resp["choices"][0]["logprobs"]["content"]
    return [[(t["token"], t["logprob"]) for t in c["top_logprobs"]] for c in content]


def cached_tokens(resp: dict[str, Any]) -> int:
    return _cached(resp["usage"])


__all__ = [
    "README",
    "cached_tokens",
    "chat",
    "connector_config",
    "conversation",
    "free_port",
    "post",
    "readme_server_args",
    "start_server",
    "stop_server",
    "stream_completion",
    "time_to_first_token",
    "top_logprobs",
]
