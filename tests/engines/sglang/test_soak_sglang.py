"""``hylinker soak --front sglang`` (issue 53): the SGLang plugin inside SGLang's own cache, a
short soak with faults and store restarts, runs flat and restores exactly (about 45 s on two
cores, SGLang's import and first request included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hylinker.tools import cli


@pytest.mark.slow
def test_sglang_soak_is_flat_and_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    status = cli.main(["soak", "--front", "sglang", "--minutes", "0.2", "--interval-s", "1",
                       "--restart-every-s", "5", "--outage-s", "1", "--warmup-s", "3", "--json", str(out)])
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert status == 0, text
    s = result["summary"]
    assert s["requests"] > 30 and s["restarts"] >= 1, json.dumps(s)
    assert s["aborted"] + s["mismatched"] + s["errors"] == 0, json.dumps(s)
    assert s["evictions"] > 0 and s["store_hit"] > 0, json.dumps(s)
    assert all(sample["offloads_held"] <= 1 for sample in result["samples"])
