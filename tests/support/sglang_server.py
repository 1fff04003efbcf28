"""SGLang's real server (``python -m sglang.launch_server``) as a child process, launched with the
README's own flags, and a tiny dense model built locally for it (standard library + transformers).

For the SGLang plugin's server suite (``tests/engines/sglang_server/``, run from ``.venv-sglang-server``).
The launch line is **read from the README** (the ``bash`` block of "For SGLang users"), so the
suite runs what a user copies: :func:`readme_launch_args` returns its arguments, and
:func:`launch_command` swaps in the model path and the test's ``linker_extra_config`` and adds
what SGLang needs to run a forward on a CPU host (measured in ``shared/SGLANG.md``, "Real server
on CPU"): ``--device cpu --attention-backend torch_native --disable-cuda-graph``, a small pool,
``--skip-server-warmup``. A GPU run passes ``cpu=False`` and keeps SGLang's own defaults.

On CPU SGLang runs a real forward only for a dense model without rotary embeddings, so
:func:`build_tiny_gpt2` writes a random-weight GPT-2 (learned positions) and a word-level BPE
tokenizer trained here; hybrid models need SGLang's Triton kernels (a GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hylinker.tools.harness.tiny_qwen3_next import VOCAB, build_tokenizer, corpus

README = Path(__file__).resolve().parents[2] / "README.md"
_SECTION = "## For SGLang users"


def readme_launch_args(readme: Path = README) -> list[str]:
    """The arguments of the README's SGLang launch line (after ``python -m sglang.launch_server``)."""
    text = readme.read_text()
    start = text.find(_SECTION)
    if start < 0:
        raise ValueError(f"{readme} has no {_SECTION!r} section")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    if block is None:
        raise ValueError(f"the README's {_SECTION!r} section has no bash block")
    words = shlex.split(block.group(1).replace("\\\n", " "))
    head = ["python", "-m", "sglang.launch_server"]
    if words[:3] != head:
        raise ValueError(f"the README's SGLang block does not start with {' '.join(head)}: {words[:3]}")
    return words[3:]


def _set(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def launch_command(model: Path, port: int, extra_config: dict[str, Any] | None, *,
                   readme: Path = README, cpu: bool = True, extra_args: Sequence[str] = ()) -> list[str]:
    """The README's launch line on ``model`` with ``extra_config`` as ``linker_extra_config``;
    ``extra_config=None``: the same server with every linker flag removed (the reference)."""
    args = _set(readme_launch_args(readme), "--model-path", str(model))
    linker_flags = ("--enable-unified-cache-external-linker", "--unified-cache-external-linker-backend",
                    "--unified-cache-external-linker-config")
    if extra_config is None:
        kept: list[str] = []
        skip = False
        for a in args:
            if skip:
                skip = False
                continue
            if a in linker_flags:
                skip = a != "--enable-unified-cache-external-linker"
                continue
            kept.append(a)
        args = kept
    else:
        config = json.loads(args[args.index("--unified-cache-external-linker-config") + 1])
        config["linker_extra_config"] = extra_config
        args = _set(args, "--unified-cache-external-linker-config", json.dumps(config))
    args = _set(_set(args, "--host", "127.0.0.1"), "--port", str(port))
    args = _set(args, "--random-seed", "0")
    if cpu:
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                 "--dtype", "float32", "--mem-fraction-static", "0.05", "--max-total-tokens", "8192",
                 "--skip-server-warmup"]
    return [sys.executable, "-m", "sglang.launch_server", *args, *extra_args]


def build_tiny_gpt2(path: Path | str, *, seed: int = 0, layers: int = 4) -> Path:
    """A random-weight GPT-2 (``layers`` layers, fp32) and its tokenizer in ``path``. Same seed,
    same bytes. Weights are drawn wide (``initializer_range=0.2``) so that greedy tokens and
    logprobs depend visibly on the whole context."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, seed=seed)
    tok = AutoTokenizer.from_pretrained(str(path))
    config = GPT2Config(vocab_size=VOCAB, n_positions=4096, n_embd=64, n_layer=layers, n_head=2,
                        initializer_range=0.2, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.config.architectures = ["GPT2LMHeadModel"]
    model.save_pretrained(str(path))
    return path


def prompt(n_lines: int, seed: int) -> str:
    return " ".join(corpus(n_lines, seed))


# ---- the server process --------------------------------------------------------------------
def get(url: str, timeout_s: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def post(url: str, body: dict[str, Any] | None = None, timeout_s: float = 300) -> tuple[int, Any]:
    """POST JSON; returns (HTTP status, parsed body or text)."""
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = int(exc.code), exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class SGLangServer:
    """One ``sglang.launch_server`` child process (its own session, log in a file)."""

    def __init__(self, cmd: list[str], log: Path, *, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log = log
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        environ = dict(os.environ, **(env or {}))
        environ.pop("SGLANG_USE_CPU_ENGINE", None)  # the CPU engine path needs sgl-kernel's CPU build
        environ.setdefault("OMP_NUM_THREADS", "2")
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=environ,
                                         start_new_session=True)

    def wait_healthy(self, timeout_s: float = 600) -> SGLangServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if get(f"{self.url}/health", timeout_s=5)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def generate(self, text: str, max_new_tokens: int = 8, timeout_s: float = 300,
                 **fields: Any) -> tuple[int, Any]:
        """Greedy ``/generate`` with the output tokens' logprobs; ``fields``: more of the request's
        fields (e.g. ``extra_key``, ``cache_salt``: the request's cache namespace)."""
        return post(f"{self.url}/generate", {
            "text": text, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            **fields,
        }, timeout_s=timeout_s)

    def flush_cache(self) -> None:
        deadline = time.monotonic() + 60
        while True:  # refused while requests run or wait
            status, body = post(f"{self.url}/flush_cache", timeout_s=60)
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"/flush_cache kept failing: {status} {body}")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 90) -> tuple[int, float]:
        """SIGTERM the server's main process (SGLang's graceful shutdown: it drains requests and
        then ends its subprocesses), SIGKILL of the process group after ``timeout_s``; returns
        (exit code, seconds it took)."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # children SGLang left (scheduler, detokenizer)
            os.killpg(self.proc.pid, signal.SIGKILL)
        return int(self.proc.returncode), time.monotonic() - t0


def output_of(body: Any) -> tuple[list[int], list[float]]:
    """(output token ids, their logprobs) of a ``/generate`` answer."""
    meta = body["meta_info"]
    pairs = meta["output_token_logprobs"]
    return [int(p[1]) for p in pairs], [float(p[0]) for p in pairs]


__all__ = ["README", "SGLangServer", "build_tiny_gpt2", "get", "launch_command", "output_of", "post",
           "prompt", "readme_launch_args"]
