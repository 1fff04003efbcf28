"""Traces as timelines: ``enable_trace_logging(path=...)`` / ``stress --trace-file`` / the plugins'
``trace_file`` key write only JSON lines; ``hylinker trace FILE`` turns them into Chrome
trace-event JSON (one track per request with its phases in order, a track per pool actor, store
calls as slices) and a PNG of a window of requests; mistakes are one line and exit 2."""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_tracing import every_phase

from hylinker.integrations.config import PluginConfig, PluginConfigError
from hylinker.runtime.dataplane.tracing import (
    disable_trace_logging,
    enable_trace_logging,
    trace_enabled,
)
from hylinker.tools import cli
from hylinker.tools.timeline import PHASES, Slice, lanes


@pytest.fixture(autouse=True)
def _tracing_off() -> Iterator[None]:
    disable_trace_logging()
    yield
    disable_trace_logging()


@pytest.fixture
async def trace_path(tmp_path: Path) -> Path:
    """A trace of a store miss ("writer": lookup, prefill, insert, offload, release) and a
    restore ("reader": lookup, load, commit, release) through the real Linker and store."""
    path = tmp_path / "run" / "trace.jsonl"
    enable_trace_logging(path=path)
    await every_phase()
    disable_trace_logging()
    return path


def check_chrome_format(doc: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The trace-event format Perfetto and chrome://tracing read; returns the slices and
    instants per (pid, tid), checking that the slices of a track nest."""
    assert set(doc) == {"traceEvents", "displayTimeUnit"}
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "i", "M"), e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["args"], dict)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] > 0
        else:
            assert e["s"] == "t"
        tracks[e["pid"], e["tid"]].append(e)
    for events in tracks.values():
        open_ends: list[float] = []
        for e in sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + 0.01:  # 0.1 us rounding
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + 0.01, f"{e['name']} overlaps its parent"
            open_ends.append(end)
    return tracks


def names(doc: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}


def test_the_trace_file_holds_only_json_lines(trace_path: Path) -> None:
    lines = trace_path.read_text().splitlines()
    events = [json.loads(line) for line in lines]  # every line, not just most
    assert len(events) > 10
    assert all({"event", "t", "pid"} <= e.keys() for e in events)
    assert any(e["event"] == "store" and e["us"] >= 0 for e in events)
    assert not trace_enabled()


async def test_hylinker_trace_writes_a_chrome_trace_with_every_phase_in_order(
        trace_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "out" / "t.json", tmp_path / "t.png"
    assert cli.main(["trace", str(trace_path), "--out", str(out), "--png", str(png), "--window", "0:2"]) == 0
    assert "2 requests" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    tracks = check_chrome_format(doc)
    track_names = names(doc)
    by_name = {track_names[k]: v for k, v in tracks.items()}
    for rid, phases in (("writer", ("lookup", "engine", "offload")), ("reader", ("lookup", "load"))):
        slices = [e for e in by_name[rid] if e["ph"] == "X"]
        request = next(e for e in slices if e["name"] == "request")
        got = sorted((e for e in slices if e["name"] in PHASES), key=lambda e: e["ts"])
        assert tuple(e["name"] for e in got) == phases
        for a, b in itertools.pairwise(got):  # in order, none before the previous one ended
            assert a["ts"] + a["dur"] <= b["ts"] + 0.01
        assert request["ts"] <= got[0]["ts"] and got[-1]["ts"] + got[-1]["dur"] <= request["ts"] + request["dur"] + 0.01
        assert any(e["ph"] == "i" and e["name"] == "release" for e in by_name[rid])
    # a track per pool actor and direction, the store calls as slices under them
    for pool in ("kv", "mamba", "draft"):
        jobs = [e for e in by_name[f"{pool} offload"] if e["ph"] == "X"]
        assert jobs and all(e["args"]["request_id"] == "writer" for e in jobs)
        assert [e for e in by_name[f"{pool} load"] if e["ph"] == "X"]
        puts = [e for e in by_name[f"{pool} store put"] if e["ph"] == "X"]
        assert puts and all(e["name"].startswith("put") and e["args"]["objects"] >= 1 for e in puts)
        assert [e for e in by_name[f"{pool} store get"] if e["ph"] == "X"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overlapping_slices_go_on_separate_lanes() -> None:
    a, b, c = Slice("a", 0, 10), Slice("b", 5, 12), Slice("c", 10, 11)
    assert lanes([b, c, a]) == [[a, c], [b]]


@pytest.mark.parametrize(("argv", "says"), [
    (["trace", "{tmp}/missing.jsonl"], "no such trace file"),
    (["trace", "{tmp}/text.log"], "no trace events"),
    (["trace", "{tmp}/text.log", "--window", "5:2"], "--window"),
])
def test_mistakes_are_one_line_and_exit_2(argv: list[str], says: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "text.log").write_text("INFO plain text\n{\"not\": \"an event\"}\n")
    try:
        rc = cli.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_a_window_past_the_last_request_is_one_line(trace_path: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["trace", str(trace_path), "--png", str(tmp_path / "x.png"), "--window", "7:9"])
    err = capsys.readouterr().err
    assert rc == 2 and "the trace has 2 requests" in err


def test_stress_trace_file_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "stress.jsonl"
    assert cli.main(["stress", "--requests", "6", "--no-progress", "--trace-file", str(path)]) == 0
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert {e["request_id"] for e in events if e["event"] == "lookup"} == {
        e["request_id"] for e in events if e["event"] == "release"}
    assert len({e["request_id"] for e in events if e["event"] == "lookup"}) == 6
    assert not trace_enabled()  # the run turned it off again
    rc = cli.main(["stress", "--requests", "1", "--no-progress", "--trace-file", str(tmp_path)])
    assert rc == 2 and "--trace-file: cannot open" in capsys.readouterr().err


async def test_the_trace_file_key_of_both_engines(tmp_path: Path) -> None:
    """``trace_file`` turns tracing on into that file (both plugins take PluginConfig's keys);
    a file that cannot be opened names the key."""
    path = tmp_path / "engine.jsonl"
    config = PluginConfig.from_extra_config({"trace_file": str(path)})
    assert config.tracing
    config.start_tracing("kv_connector_extra_config")
    await every_phase()
    disable_trace_logging()
    assert {json.loads(line)["event"] for line in path.read_text().splitlines()} >= {"lookup", "commit", "release"}
    with pytest.raises(PluginConfigError, match=r"linker_extra_config\['trace_file'\]: cannot open"):
        PluginConfig.from_extra_config({"trace_file": str(tmp_path)}).start_tracing("linker_extra_config")
    assert not PluginConfig.from_extra_config({}).tracing or "HYLINKER_TRACE" in os.environ
