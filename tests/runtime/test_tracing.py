"""Observability: silent by default; one switch gives JSON lines with request id and phase."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import numpy as np
import pytest

from hylinker.components.pools import HybridPools
from hylinker.runtime.dataplane.tracing import (
    disable_trace_logging,
    enable_trace_logging,
    trace_enabled,
)
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import small_hybrid_layout, synthetic_prefill

LAYOUT = small_hybrid_layout()


@pytest.fixture(autouse=True)
def _tracing_off() -> Iterator[None]:
    disable_trace_logging()
    yield
    disable_trace_logging()


async def every_phase() -> None:
    """lookup, insert + offload, release, then lookup, load, commit, release."""
    pools = HybridPools(LAYOUT, kv_pages=64, mamba_slots=8)
    store = EmbeddedStore(8 << 20)
    content = SyntheticContent(pools)
    p = np.arange(1, 42, dtype=np.int32)
    async with Linker(LAYOUT, pools, store, LinkerConfig(staging_bytes_per_pool=1 << 16)) as lk:
        req = lk.request("writer", p)
        await lk.lookup(req)
        await synthetic_prefill(lk, content, req)
        await lk.release(req)
        await lk.drain()
        lk.flush_device()
        req = lk.request("reader", p)
        await lk.lookup(req)
        load = await lk.load(req)
        assert load is not None
        await load.wait_layer(0)
        assert await lk.commit(load) == 40
        await lk.release(req)
        lk.check_idle()
    await store.close()


async def test_silent_by_default(capfd: pytest.CaptureFixture[str]) -> None:
    """Nothing on stdout/stderr, at the file-descriptor level (Python and native writes)."""
    assert not trace_enabled()
    await every_phase()
    out = capfd.readouterr()
    assert (out.out, out.err) == ("", "")


async def test_trace_logging_gives_json_lines_per_phase(capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    enable_trace_logging(stream)
    assert trace_enabled()
    await every_phase()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines, "no trace lines"
    for line in lines:
        assert {"event", "phase", "level", "timestamp"} <= line.keys()
    by_phase: dict[str, list[dict[str, object]]] = {}
    for line in lines:
        by_phase.setdefault(str(line["phase"]), []).append(line)
    for phase in ("lookup", "load", "commit", "insert", "offload", "release"):
        assert phase in by_phase, f"no {phase} line"
    assert {line["request_id"] for line in by_phase["lookup"]} == {"writer", "reader"}
    assert all(line["request_id"] == "writer" for line in by_phase["insert"] + by_phase["offload"])
    assert {line["request_id"] for line in by_phase["load"]} == {"reader"}
    assert {line["request_id"] for line in by_phase["commit"]} == {"reader"}
    assert {line.get("pool") for line in by_phase["offload"]} == {"kv", "mamba", "draft"}
    assert all(isinstance(line["bytes"], int) and line["bytes"] > 0 for line in by_phase["offload"])
    assert capsys.readouterr().err == ""  # the stream given, nothing else

    disable_trace_logging()
    before = stream.getvalue()
    await every_phase()
    assert stream.getvalue() == before


class _FailingStream(io.StringIO):
    """A trace stream that fails after ``good`` lines (a closed pipe, a full disk)."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good
        self.failures = 0

    def write(self, text: str) -> int:
        if self.good <= 0:
            self.failures += 1
            raise OSError(32, "Broken pipe")
        self.good -= 1
        return super().write(text)


async def test_a_failing_trace_stream_turns_tracing_off_and_never_fails_a_request(
        caplog: pytest.LogCaptureFixture) -> None:
    """The stream breaks mid-run: every phase still completes (the restore commits its 40
    tokens inside ``every_phase``), tracing turns off after the first failed line, and one log
    line says so."""
    stream = _FailingStream(good=3)
    enable_trace_logging(stream)
    with caplog.at_level(logging.WARNING, logger="hylinker.runtime.dataplane.tracing"):
        await every_phase()
    assert stream.failures == 1 and not trace_enabled()
    assert len(stream.getvalue().splitlines()) == 3
    lines = [r for r in caplog.records if r.name == "hylinker.runtime.dataplane.tracing"]
    assert len(lines) == 1 and "trace stream failed" in lines[0].getMessage()
