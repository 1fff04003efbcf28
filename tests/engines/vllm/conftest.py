"""Fixtures for the vLLM connector's suite: the tiny model, engines in their own processes, and
the reference outputs of an engine without any cache.

Every engine runs in a child process (``hylinker.tools.harness.vllm_runner``) so that tests can kill a
store between steps and engines never share vLLM's global state.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hylinker.stores.mooncake_master import MooncakeMaster
from hylinker.tools.mooncake_cli import start_segment_process

ENGINE_TIMEOUT_S = 900


def run_engine(model: Path, extra: dict[str, Any] | None, steps: list[dict[str, Any]],
               log: Path, *, in_process: bool = True, tp: int = 1,
               block_size: int | None = None, max_lora_rank: int = 0) -> list[dict[str, Any]]:
    """Run one engine through ``steps``; ``extra=None``: no connector, no prefix cache.
    ``in_process``: the engine core (and at TP 1 the worker) in the runner's process, so the
    ``stats`` step reads both connector sides; otherwise vLLM's default process model, no
    variable set (the workers log their statistics at shutdown: :func:`worker_statistics`).
    ``max_lora_rank``: LoRA enabled (steps may carry a ``lora`` adapter)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [sys.executable, "-m", "hylinker.tools.harness.vllm_runner", "--model", str(model), "--tp", str(tp),
           "--extra", "none" if extra is None else json.dumps(extra), "--steps", json.dumps(steps)]
    if in_process:
        cmd.append("--in-process")
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if max_lora_rank:
        cmd += ["--max-lora-rank", str(max_lora_rank)]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, env=env, timeout=ENGINE_TIMEOUT_S, text=True)
    out = proc.stdout
    with open(log, "a") as f:  # vLLM's processes log to stdout
        f.write(out)
    if proc.returncode != 0 or "RESULT" not in out:
        tail = log.read_text()[-4000:]
        raise AssertionError(f"engine failed (rc {proc.returncode}):\n{out[-2000:]}\n--- stderr ---\n{tail}")
    return [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]


def worker_statistics(log: Path) -> dict[int, dict[str, int]]:
    """Per rank, the statistics each worker-side connector logged at shutdown."""
    out: dict[int, dict[str, int]] = {}
    for line in log.read_text().splitlines():
        m = re.search(r"hylinker: rank (\d+) worker shut down .*statistics (\{.*\})", line)
        if m:
            out[int(m.group(1))] = ast.literal_eval(m.group(2))
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hylinker.tools.harness.tiny_qwen3_next import build_tiny_qwen3_next

    return build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[int]]:
    """``short``: 1,306 tokens (vLLM checkpoints its state at 1,152); ``long``: ``short`` plus
    700 tokens (it restores from ``short``'s state)."""
    rng = random.Random(15)
    short = [rng.randrange(10, 300) for _ in range(1306)]
    return {"short": short, "long": short + [rng.randrange(10, 300) for _ in range(700)]}


@pytest.fixture(scope="session")
def reference(model_dir: Path, prompts: dict[str, list[int]],
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Greedy tokens and logprobs of an engine with no connector and no prefix cache."""
    log = tmp_path_factory.mktemp("logs") / "reference.log"
    res = run_engine(model_dir, None, [{"op": "generate", "prompt": prompts[k]} for k in ("short", "long")], log)
    return {"short": res[0], "long": res[1]}


@pytest.fixture
def engine_log(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "engine.log"


@pytest.fixture
def mooncake(tmp_path: Path) -> Iterator[tuple[MooncakeMaster, subprocess.Popen[str]]]:
    """A master and a separate storage process (256 MiB segment) on loopback."""
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster().start())
        seg = start_segment_process(master.address, 256)
        stack.callback(seg.kill)
        yield master, seg
