"""vLLM's OpenAI server with HylinkerConnector, in vLLM's default process model (no environment
variable): a repeated conversation after ``/reset_prefix_cache`` is served from the store with
identical ``top_logprobs``: the README's launch line as written (the embedded store), and a
shared Mooncake store."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from hylinker.stores.mooncake_master import MooncakeMaster
from hylinker.tools.harness.vllm_server import (
    cached_tokens,
    chat,
    conversation,
    free_port,
    post,
    start_server,
    stop_server,
    top_logprobs,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("store", ["readme-embedded", "mooncake"])
def test_openai_server_serves_a_repeated_conversation_from_the_store(
        store: str, model_dir: Path, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    if store == "mooncake":
        master, _seg = request.getfixturevalue("mooncake")
        assert isinstance(master, MooncakeMaster)
        proc = start_server(model_dir, port, log,
                            extra={"store": "mooncake", "master": master.address, "segment_mb": 0})
    else:
        proc = start_server(model_dir, port, log, extra=None, readme=True)
    try:
        messages = conversation(1200)
        first = chat(port, messages)
        assert first["usage"]["prompt_tokens"] > 2 * 384
        assert cached_tokens(first) == 0
        time.sleep(1.0)  # the store writes run off the step
        assert post(f"http://127.0.0.1:{port}/reset_prefix_cache")["success"] is True
        again = chat(port, messages)
        assert top_logprobs(again) == top_logprobs(first)
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert cached_tokens(again) >= 384  # restored by the connector: vLLM's own cache was empty
    finally:
        rc = stop_server(proc)
    deadline = time.monotonic() + 60  # the worker process may log after the server process exited
    while "hylinker: rank 0 worker shut down" not in (text := log.read_text()) and time.monotonic() < deadline:
        time.sleep(1)
    # the connector's shutdown ran (writes drained) and nothing of the connector raised; vLLM
    # itself may log its engine's death when it force-kills a slow worker on a loaded machine
    assert "hylinker: rank 0 worker shut down" in text, text[-4000:]
    assert "integrations/vllm" not in text and "integrations/store_host" not in text, text[-4000:]
    assert rc in (0, 1, -signal.SIGINT, 130), f"server exit code {rc}"
