"""HylinkerLinker inside SGLang 0.5.23's real server, launched with the README's own flags.

Each test starts ``python -m sglang.launch_server`` (the README's SGLang block, read from the
README by :func:`hylinker.tests.support.sglang_server.readme_launch_args`) on a tiny random GPT-2,
sends greedy ``/generate`` requests with logprobs, flushes SGLang's device cache
(``/flush_cache``) and sends the same request again, so the cached tokens can only come from
the store.

What "the same output" means here, measured on SGLang's CPU path (torch_native attention,
fp32): a prefill that resumes after cached tokens computes the last position with other kernel
shapes than a cold prefill, so its logprobs differ from a cold run's in the 7th digit while
the tokens agree. A prefix restored from the store must therefore equal, bit for bit, what
SGLang's own device cache gives for the same prefix (the reference server's second run), and a
recompute must equal a cold run bit for bit.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hylinker.stores.mooncake_master import free_port
from hylinker.tests.support.sglang_server import (
    SGLangServer,
    get,
    launch_command,
    output_of,
    prompt,
    readme_launch_args,
)
from hylinker.tools.harness import metrics_scrape

PROMPT = prompt(60, seed=1)  # ~580 tokens: 36 pages of 16
Output = tuple[list[int], list[float]]


def start(model: Path, tmp_path: Path, name: str, extra: dict[str, Any] | None,
          **kwargs: Any) -> SGLangServer:
    cmd = launch_command(model, free_port(), extra, **kwargs)
    return SGLangServer(cmd, tmp_path / f"{name}.log").wait_healthy()


def generate(server: SGLangServer, text: str = PROMPT, **fields: Any) -> tuple[Output, int]:
    status, body = server.generate(text, **fields)
    assert status == 200, (status, body, server.tail())
    assert body["meta_info"]["finish_reason"]["type"] == "length", body["meta_info"]
    return output_of(body), int(body["meta_info"]["cached_tokens"])


def linker_lines(server: SGLangServer) -> list[str]:
    return [line for line in server.text().splitlines() if "HylinkerLinker" in line and "server_args" not in line]


def assert_stops_cleanly(server: SGLangServer, within_s: float = 60) -> None:
    """SIGTERM: SGLang drains, closes the linker (which waits for its writes) and exits 0."""
    code, took = server.stop()
    assert code == 0 and took < within_s, (code, took, server.tail())
    closed = [line for line in linker_lines(server) if "HylinkerLinker closed" in line]
    assert closed, server.tail()
    assert "memory leak detected" not in server.text()


@pytest.fixture(scope="module")
def reference(tiny_gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same server without the linker: a cold run, and a run on SGLang's own device hit."""
    server = start(tiny_gpt2, tmp_path_factory.mktemp("reference"), "reference", None)
    try:
        cold, cached_cold = generate(server)
        hit, cached_hit = generate(server)
    finally:
        server.stop()
    assert cached_cold == 0 and cached_hit > 0
    assert cold[0] == hit[0]  # same tokens either way
    return {"cold": cold, "hit": hit, "cached": cached_hit}


def test_readme_block_selects_the_dynamic_backend() -> None:
    args = readme_launch_args()
    assert args[args.index("--unified-cache-external-linker-backend") + 1] == "dynamic"
    assert "--enable-unified-cache-external-linker" in args


def test_a_bad_linker_key_stops_the_server_at_startup_naming_it(tiny_gpt2: Path, tmp_path: Path) -> None:
    cmd = launch_command(tiny_gpt2, free_port(), {"store": "embedded", "capacity_mb": 256, "stor": "x"})
    server = SGLangServer(cmd, tmp_path / "bad-key.log")
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.wait_healthy(timeout_s=300)
        assert "unknown linker_extra_config keys ['stor']" in server.text()
    finally:
        server.stop()


def _restore_after_flush(server: SGLangServer, reference: dict[str, Any]) -> None:
    cold, cached = generate(server)
    assert cached == 0 and cold == reference["cold"]
    server.flush_cache()  # SGLang's device tree is empty now: a hit can only come from the store
    restored, cached = generate(server)
    assert cached == reference["cached"]
    assert restored == reference["hit"]  # tokens and logprobs, bit for bit
    assert not [line for line in linker_lines(server) if "load" in line and "fail" in line]


def scrape(server: SGLangServer) -> dict[str, float]:
    """The server's ``/metrics``: ``name{labels}`` -> value, for hylinker's families."""
    return metrics_scrape.scrape(f"{server.url}/metrics", "sglang:hylinker_")


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    return metrics_scrape.metric(samples, "sglang:hylinker_" + name, **labels)



@pytest.fixture(scope="module")
def embedded(tiny_gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """The README's server with the embedded store, metrics and traces, shared by the tests that
    need nothing else; it must stop cleanly at the end."""
    server = start(tiny_gpt2, tmp_path_factory.mktemp("embedded"), "embedded",
                   {"store": "embedded", "capacity_mb": 256, "trace": True}, extra_args=["--enable-metrics"])
    try:
        yield server
    finally:
        assert_stops_cleanly(server)


def test_embedded_store_restores_after_flush_with_metrics_and_traces(
        embedded: SGLangServer, reference: dict[str, Any]) -> None:
    """Runs first on the shared server: the load counts below are this test's alone."""
    server = embedded
    assert any("HylinkerLinker: store=embedded" in line for line in linker_lines(server))
    _restore_after_flush(server, reference)
    assert get(f"{server.url}/health")[0] == 200
    # SGLang's own /metrics carries the plugin's families (scheduler process, multiprocess dir)
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(server)
        if metric(samples, "bytes_total", direction="load") > 0 or time.monotonic() > deadline:
            break
        server.generate("a short request", max_new_tokens=1)  # a scheduler round publishes
        time.sleep(1.1)
    assert metric(samples, "lookups_total", outcome="hit") >= 1
    assert metric(samples, "lookups_total", outcome="miss") >= 1
    assert metric(samples, "hit_tokens_total") >= reference["cached"]
    assert metric(samples, "loads_total", outcome="ok") == 1
    assert metric(samples, "loads_total", outcome="failed") == 0
    assert metric(samples, "offloads_total", outcome="ok") >= 1
    assert metric(samples, "load_seconds_count") == 1
    assert metric(samples, "bytes_total", pool="kv", direction="load") > 0
    assert metric(samples, "bytes_total", pool="kv", direction="offload") > 0
    # one restored request followed through the server log by its SGLang request id
    server.flush_cache()
    status, body = server.generate(PROMPT)
    assert status == 200 and body["meta_info"]["cached_tokens"] == reference["cached"]
    rid = body["meta_info"]["id"]
    mine = [t for t in metrics_scrape.trace_lines(server.text())
            if t.get("request_id") == rid or rid in t.get("request_ids", [])]
    events = [t["event"] for t in mine]
    for event in ("sglang.lookup", "sglang.load.queued", "sglang.load.start", "load"):
        assert event in events, (event, events)
    lookup = next(t for t in mine if t["event"] == "sglang.lookup")
    assert lookup["hit_pages"] * 16 == reference["cached"]
    data_load = next(t for t in mine if t["event"] == "load")
    assert data_load["ok"] == data_load["objects"] > 0 and data_load["faults"] == {}
    index = next(t for t in mine if t["event"] == "sglang.load.start")["counter_index"]
    ends = [t for t in metrics_scrape.trace_lines(server.text()) if t["event"] == "sglang.load.end" and t["counter_index"] == index]
    assert ends and ends[-1]["ok"] is True


def test_request_namespaces_never_share_an_object(embedded: SGLangServer, reference: dict[str, Any]) -> None:
    """``extra_key`` and ``cache_salt`` per request (SGLang's /generate fields): a request in another
    namespace gets 0 cached tokens from the device or the store and computes what a cold run
    does; the same namespace after a flush restores what SGLang's own device hit gives."""
    server = embedded  # PROMPT, unnamespaced, is on its device and in its store already
    owners: list[dict[str, str]] = [{"extra_key": "tenant-a"}, {"cache_salt": "salt-1"}]
    for ns in owners:  # the device holds PROMPT in other namespaces, the store too
        out, cached = generate(server, **ns)
        assert cached == 0 and out == reference["cold"], ns
    server.flush_cache()
    for ns in [{"extra_key": "tenant-b"}, {"cache_salt": "salt-2"},
               {"extra_key": "tenant-a", "cache_salt": "salt-1"}]:  # the store only
        out, cached = generate(server, **ns)
        assert cached == 0 and out == reference["cold"], ns
    for ns in owners:  # positive controls
        server.flush_cache()
        out, cached = generate(server, **ns)
        assert cached == reference["cached"] and out == reference["hit"], ns
    assert not [line for line in linker_lines(server) if "load" in line and "fail" in line]


@pytest.fixture
def storage_segment(mooncake_master: Any, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A storage-only process contributing 256 MiB to the master (``hylinker mooncake segment``):
    the servers then run with ``segment_mb: 0``, and what they stored outlives them."""
    with open(tmp_path / "segment.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hylinker", "mooncake", "segment", "--master",
                                 mooncake_master.address, "--segment-mib", "256"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while b"mounted" not in (tmp_path / "segment.log").read_bytes():
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "segment.log").read_text()
                time.sleep(0.2)
            yield proc
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.mooncake
def test_mooncake_store_restores_after_flush_and_in_a_second_server(
        tiny_gpt2: Path, tmp_path: Path, reference: dict[str, Any], mooncake_master: Any,
        storage_segment: Any) -> None:
    extra = {"store": "mooncake", "master": mooncake_master.address, "segment_mb": 0}
    server = start(tiny_gpt2, tmp_path, "mooncake-1", extra)
    try:
        _restore_after_flush(server, reference)
    finally:
        assert_stops_cleanly(server)
    # a second server process (a fleet's next engine) restores the prefix on its first request
    second = start(tiny_gpt2, tmp_path, "mooncake-2", extra)
    try:
        restored, cached = generate(second)
        assert cached == reference["cached"]
        assert restored == reference["hit"]
    finally:
        assert_stops_cleanly(second)


def test_corrupt_objects_abort_once_then_recompute(tiny_gpt2: Path, tmp_path: Path,
                                                   reference: dict[str, Any]) -> None:
    # every object is stored with one byte flipped: its checksum cannot verify
    extra = {"store": "embedded", "capacity_mb": 256, "faults": "corrupt=1.0", "fault_seed": 3}
    server = start(tiny_gpt2, tmp_path, "corrupt", extra)
    try:
        cold, _ = generate(server)
        assert cold == reference["cold"]
        server.flush_cache()
        # the store claims the prefix, the load verifies nothing: SGLang finishes the request
        # with its abort (503), never with output computed on unverified rows
        status, body = server.generate(PROMPT)
        aborted = status == 503 or (
            status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort")
        assert aborted, (status, body)
        # the damaged objects were removed before the failure was reported: the retry recomputes
        again, cached = generate(server)
        assert cached == 0 and again == reference["cold"]
        time.sleep(3)  # SGLang's idle check looks for leaked KV rows and request slots
        assert get(f"{server.url}/health")[0] == 200
    finally:
        assert_stops_cleanly(server)
    assert any(re.search(r"load batch \d+: load failed", line) for line in linker_lines(server))


@pytest.mark.mooncake
def test_killed_master_recomputes_and_shuts_down(tiny_gpt2: Path, tmp_path: Path,
                                                 reference: dict[str, Any], mooncake_master: Any) -> None:
    extra = {"store": "mooncake", "master": mooncake_master.address, "segment_mb": 64,
             "store_timeout_s": 2, "lookup_timeout_s": 1}
    server = start(tiny_gpt2, tmp_path, "dead-master", extra)
    try:
        cold, _ = generate(server)
        assert cold == reference["cold"]
        mooncake_master.kill()
        server.flush_cache()
        t0 = time.monotonic()
        again, cached = generate(server)  # the lookup misses: a recompute, never a hang
        took = time.monotonic() - t0
        assert cached == 0 and again == reference["cold"]
        assert took < 30, took
        assert get(f"{server.url}/health")[0] == 200
    finally:
        assert_stops_cleanly(server, within_s=60)


@pytest.mark.cuda
@pytest.mark.parametrize("flags", [
    [],  # the README's block as it is: SGLang's auto strategy (extra_buffer on a GPU with paging)
    ["--page-size", "1", "--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"],
], ids=["auto", "no_buffer"])
def test_hybrid_model_restores_on_a_gpu(tmp_path: Path, flags: list[str]) -> None:
    """A tiny hybrid model (qwen3_next: Gated DeltaNet + full attention) on SGLang's GPU path,
    launched from the README's block: the restored prefix equals SGLang's own device hit."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("SGLang's hybrid models need a GPU (Triton kernels)")
    from hylinker.tools.harness.tiny_qwen3_next import build_tiny_qwen3_next

    model = build_tiny_qwen3_next(tmp_path / "model")
    hybrid = [*flags, "--mem-fraction-static", "0.3"]
    ref_server = start(model, tmp_path, "hybrid-reference", None, cpu=False, extra_args=hybrid)
    try:
        cold, _ = generate(ref_server)
        hit, cached_hit = generate(ref_server)
    finally:
        ref_server.stop()
    server = start(model, tmp_path, "hybrid", {"store": "embedded", "capacity_mb": 1024}, cpu=False,
                   extra_args=hybrid)
    try:
        assert generate(server)[0] == cold
        server.flush_cache()
        restored, cached = generate(server)
        assert cached == cached_hit > 0
        assert restored == hit
    finally:
        assert_stops_cleanly(server)
