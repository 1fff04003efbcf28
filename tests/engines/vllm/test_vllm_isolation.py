"""Per-request ``cache_salt`` end to end with real forwards in vLLM's default process model:
another tenant's salt (or none) gets 0 tokens from the store and the output of a recompute; the
same salt after ``reset_prefix_cache()`` is served from the store (the positive control),
identical to a recompute. Offline API over the embedded store; the OpenAI server's
``/v1/completions`` field over Mooncake.

LoRA adapters run end to end on a dense attention model in ``test_vllm_lora.py``. Multimodal
inputs do not run with the connector on the CPU build (qwen3_5 needs torchvision), nor LoRA on
the hybrid models (qwen3_next needs Triton's MoE kernels): their keys are checked with vLLM's
real request objects through the connector's scheduler side in ``test_vllm_request_keys.py``; see
``docs/design/vllm.md`` §10.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from conftest import run_engine

from hylinker.stores.mooncake_master import MooncakeMaster
from hylinker.tools.harness.vllm_server import free_port, post, start_server, stop_server

pytestmark = pytest.mark.slow
RESTORED = 1152  # tokens restored for the 1,306-token prompt (3 blocks of 384 and the states there)
RESET = {"op": "reset"}


def same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]  # bit-exact: ids and float values of the top 3


def gen(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"op": "generate", "prompt": prompt, **kw}


def test_cache_salt_offline_other_tenants_recompute_the_same_tenant_restores(
        model_dir: Path, prompts: dict[str, list[int]], reference: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    short = prompts["short"]
    r = run_engine(model_dir, {"store": "embedded"},
                   [gen(short, cache_salt="A"), RESET, gen(short, cache_salt="B"), gen(short),
                    gen(short, cache_salt="A")], tmp_path / "engine.log", in_process=False)
    tenant_a, tenant_b, no_salt, tenant_a_again = r[0], r[2], r[3], r[4]
    assert tenant_a["cached"] == 0
    for other in (tenant_b, no_salt):  # vLLM's own cache is empty for them, and so is the store
        assert other["cached"] == 0
        same_output(other, reference["short"])
    assert tenant_a_again["cached"] == RESTORED  # vLLM's cache holds B's and the unsalted blocks only
    same_output(tenant_a_again, reference["short"])
    same_output(tenant_a, reference["short"])


def _complete(port: int, prompt: list[int], salt: object = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 3}
    if salt is not None:
        body["cache_salt"] = salt
    return post(f"http://127.0.0.1:{port}/v1/completions", body)


def _cached(resp: dict[str, Any]) -> int:
    return int((resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _answer(resp: dict[str, Any]) -> tuple[str, list[dict[str, float]]]:
    choice = resp["choices"][0]
    return choice["text"], choice["logprobs"]["top_logprobs"]


def test_cache_salt_through_the_openai_server_over_mooncake(
        model_dir: Path, prompts: dict[str, list[int]], mooncake: tuple[MooncakeMaster, subprocess.Popen[str]],
        tmp_path: Path) -> None:
    master, _seg = mooncake
    port = free_port()
    proc = start_server(model_dir, port, tmp_path / "server.log",
                        extra={"store": "mooncake", "master": master.address, "segment_mb": 0})
    try:
        short = prompts["short"]
        tenant_a = _complete(port, short, "A")
        assert _cached(tenant_a) == 0
        time.sleep(1.0)  # the store writes run off the step
        assert post(f"http://127.0.0.1:{port}/reset_prefix_cache")["success"] is True
        for salt in ("B", None):
            other = _complete(port, short, salt)
            assert _cached(other) == 0
            assert _answer(other) == _answer(tenant_a)  # a recompute: the salt does not change the model
        again = _complete(port, short, "A")
        assert _cached(again) == RESTORED  # from the store: vLLM's own cache never held A's blocks since
        assert _answer(again) == _answer(tenant_a)
        with pytest.raises(urllib.error.HTTPError) as bad:  # a salt that is not a string: refused at the request
            _complete(port, short, 5)
        assert bad.value.code == 400
    finally:
        stop_server(proc)
