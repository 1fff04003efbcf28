"""The connector's metrics through vLLM's connector-stats path, and its trace lines.

The merge rules are checked on the real classes vLLM calls (no engine); the server test scrapes
the ``/metrics`` of vLLM's real OpenAI server and follows one restored request through its log
by vLLM's request id."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hylinker.integrations.vllm.metrics import (
    VLLM_KEYS,
    HylinkerPromMetrics,
    HylinkerStats,
    StatsReporter,
)
from hylinker.runtime.dataplane.metrics import PLANE_KEYS
from hylinker.stores.mooncake_master import MooncakeMaster
from hylinker.tools.harness import metrics_scrape
from hylinker.tools.harness.prometheus import MISSING, PROMETHEUS, dashboard_queries, prometheus
from hylinker.tools.harness.vllm_server import (
    cached_tokens,
    chat,
    conversation,
    free_port,
    post,
    start_server,
    stop_server,
)
from hylinker.tools.timeline import build, read_events

#: dashboard families the connector does not export over a Mooncake client: the Linker's stored
#: tokens, and occupancy (a Mooncake client keeps none; its master reports the cluster's)
NOT_EXPORTED = ("stored_tokens_total", "store_bytes", "store_objects")


def dashboard_answers(port: int, tmp_path: Path) -> None:
    """A real Prometheus scraping the server answers every dashboard query of the families the
    connector exports (``vllm:hylinker_*``); skipped where Debian's prometheus is missing."""
    if PROMETHEUS is None:
        pytest.skip(MISSING + " (the server checks above passed)")
    queries = [(t, q) for t, q in dashboard_queries("vllm:hylinker_", "vllm") if not any(f in q for f in NOT_EXPORTED)]
    assert len(queries) >= 18
    with prometheus({"vllm": f"127.0.0.1:{port}"}, tmp_path / "prometheus", scrape_interval_s=3) as prom:
        prom.wait_for_series(queries, 90)
        info = prom.query('vllm:hylinker_info{job="vllm"}')
        assert {s["metric"]["store"] for s in info} == {"mooncake"}


def stats(counter: dict[str, int] | None = None, gauge: dict[str, float] | None = None,
          histogram: dict[str, list[float]] | None = None) -> HylinkerStats:
    return HylinkerStats(data={"counter": dict(counter or {}), "gauge": dict(gauge or {}),
                               "histogram": {k: list(v) for k, v in (histogram or {}).items()}})


def test_ranks_merge_counters_add_latencies_join_gauges_take_the_largest() -> None:
    rank0 = stats({"bytes|kv|load": 100, "loads|ok": 1}, {"breaker_open": 0, "queue_depth|kv|load": 2},
                  {"load_seconds": [0.1]})
    rank1 = stats({"bytes|kv|load": 50}, {"breaker_open": 1, "queue_depth|kv|load": 1}, {"load_seconds": [0.3]})
    merged = rank0.aggregate(rank1)
    assert isinstance(merged, HylinkerStats)
    assert merged.data["counter"] == {"bytes|kv|load": 150, "loads|ok": 1}
    assert merged.data["gauge"] == {"breaker_open": 1, "queue_depth|kv|load": 2}
    assert sorted(merged.data["histogram"]["load_seconds"]) == [0.1, 0.3]
    log = merged.reduce()
    assert log["hylinker_bytes|kv|load"] == 150 and log["hylinker_load_seconds_count"] == 2
    assert stats().is_empty() and not merged.is_empty()
    assert merged.aggregate(stats()) is merged


def test_the_reporter_sends_growth_once_and_gauges_when_they_change() -> None:
    rep = StatsReporter()
    first = rep.report({("loads", "ok"): 2, ("breaker_open",): 0})
    assert first is not None and first.data["counter"] == {"loads|ok": 2} and first.data["gauge"] == {"breaker_open": 0}
    assert rep.report({("loads", "ok"): 2, ("breaker_open",): 0}) is None  # nothing new
    again = rep.report({("loads", "ok"): 3, ("breaker_open",): 1})
    assert again is not None and again.data["counter"] == {"loads|ok": 1} and again.data["gauge"] == {"breaker_open": 1}


class _Config:
    kv_transfer_config = None


def test_prom_metrics_add_the_merged_stats_per_engine() -> None:
    from prometheus_client import REGISTRY as registry  # where vLLM's frontend registers them

    prom = HylinkerPromMetrics(_Config(), {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                               ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(stats({"bytes|kv|load": 150, "loads|ok": 1}, {"breaker_open": 1}, {"load_seconds": [0.1, 0.3]}).data)
    prom.observe(stats({"loads|ok": 2}).data)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:hylinker_bytes_total", {**labels, "pool": "kv", "direction": "load"}) == 150
    assert registry.get_sample_value("vllm:hylinker_loads_total", {**labels, "outcome": "ok"}) == 3
    assert registry.get_sample_value("vllm:hylinker_breaker_open", labels) == 1
    assert registry.get_sample_value("vllm:hylinker_load_seconds_count", labels) == 2
    assert {m.name for m in registry.collect()} >= {"vllm:hylinker_" + k for k in VLLM_KEYS if k != "lookups"}


def test_every_family_a_worker_reports_is_registered_and_an_unknown_one_never_fails_a_step(
        caplog: pytest.LogCaptureFixture) -> None:
    """The worker reports the data plane's families (``PLANE_KEYS``): each has a family on the
    frontend (a missing one, ``rereads``, once failed the step that carried it); a figure with
    no family is logged once and skipped."""
    assert set(PLANE_KEYS) <= set(VLLM_KEYS)
    registry = CollectorRegistry()
    types: dict[type, Any] = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = HylinkerPromMetrics(_Config(), types, ["engine"], {0: ["0"]})
    with caplog.at_level(logging.WARNING):
        prom.observe(stats({"no_such_family|x": 1, "rereads|kv|failed": 0, "loads|ok": 2}).data)
        prom.observe(stats({"no_such_family|x": 2}).data)
    assert len([r for r in caplog.records if "no_such_family" in r.getMessage()]) == 1
    labels = {"engine": "0", "pool": "kv", "outcome": "failed"}
    assert registry.get_sample_value("vllm:hylinker_rereads_total", labels) == 0  # exists at 0
    assert registry.get_sample_value("vllm:hylinker_loads_total", {"engine": "0", "outcome": "ok"}) == 2


def scrape(port: int) -> dict[str, float]:
    return metrics_scrape.scrape(f"http://127.0.0.1:{port}/metrics", "vllm:hylinker_")


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    return metrics_scrape.metric(samples, "vllm:hylinker_" + name, **labels)



@pytest.mark.slow
def test_server_metrics_move_with_a_restore_and_a_trace_follows_the_request(
        model_dir: Path, mooncake: tuple[MooncakeMaster, subprocess.Popen[str]], tmp_path: Path) -> None:
    master, _seg = mooncake
    port = free_port()
    log = tmp_path / "server.log"
    trace_file = tmp_path / "trace" / "vllm.jsonl"  # the trace_file key: every engine process appends here
    proc = start_server(model_dir, port, log, extra={"store": "mooncake", "master": master.address, "segment_mb": 0,
                                                     "trace_file": str(trace_file)})
    try:
        before = scrape(port)
        assert metric(before, "loads_total", outcome="ok") == 0
        messages = conversation(1200)
        first = chat(port, messages)
        assert cached_tokens(first) == 0
        time.sleep(1.0)  # the store writes run off the step
        assert post(f"http://127.0.0.1:{port}/reset_prefix_cache")["success"] is True
        again = chat(port, messages)
        restored = cached_tokens(again)
        assert restored >= 384
        deadline = time.monotonic() + 60
        while True:  # the last step's stats reach the frontend with a later step
            samples = scrape(port)
            if metric(samples, "load_seconds_count") >= 1 or time.monotonic() > deadline:
                break
            chat(port, [{"role": "user", "content": "hi"}], max_tokens=1)
            time.sleep(1.0)
        assert metric(samples, "lookups_total", outcome="hit") == 1
        assert metric(samples, "hit_tokens_total", source="store") == restored
        assert metric(samples, "loads_total", outcome="ok") == 1
        assert metric(samples, "loads_total", outcome="failed") == 0
        assert metric(samples, "load_seconds_count") == 1
        assert metric(samples, "objects_total", direction="load") >= restored // 384
        assert metric(samples, "bytes_total", direction="load") > 0
        assert metric(samples, "offloads_total", outcome="ok") >= 1
        assert metric(samples, "bytes_total", direction="offload") >= metric(samples, "bytes_total", direction="load")
        assert metric(samples, "verify_failures_total") == 0
        # one restored request through the server log by vLLM's request id: lookup, load (its
        # objects verified as they landed), the load reported done (committed), its saves
        rid = again["id"]
        lines = [json.loads(line) for line in trace_file.read_text().splitlines()]  # nothing but JSON lines
        mine = [t for t in lines if rid in str(t.get("request_id", ""))]
        events = [t["event"] for t in mine]
        for event in ("vllm.lookup", "vllm.load.planned", "load", "vllm.load.done"):
            assert event in events, (event, events, [t["event"] for t in lines][:40])
        lookup = next(t for t in mine if t["event"] == "vllm.lookup")
        assert lookup["store_tokens"] == restored
        assert next(t for t in mine if t["event"] == "vllm.load.done")["ok"] is True
        assert events.index("vllm.lookup") < events.index("vllm.load.planned") < events.index("vllm.load.done")
        first_mine = [t["event"] for t in lines if first["id"] in str(t.get("request_id", ""))]
        assert "vllm.save.planned" in first_mine and "offload" in first_mine
        # the same file as a timeline: the restored request has its track
        timeline = build(read_events(trace_file)[0])
        assert any(rid in track for track in timeline.requests) and timeline.pools
        dashboard_answers(port, tmp_path)
    finally:
        stop_server(proc)
