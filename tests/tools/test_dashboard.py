"""The Grafana dashboard (docs/grafana/hylinker.json) against a real Prometheus (Debian's
``prometheus``, started on loopback) scraping a ``hylinker stress`` run that serves the
Linker's metrics over HTTP: every panel's query returns series, and the figures they show are
the run's. (The vLLM connector's side: tests/engines/vllm/test_vllm_metrics.py.)"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hylinker import __version__
from hylinker.tools.harness.prometheus import (
    MISSING,
    PROMETHEUS,
    dashboard_queries,
    free_port,
    prometheus,
)

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)
REQUESTS = 150


@pytest.fixture
def stress_port(tmp_path: Path) -> Iterator[tuple[int, Path, subprocess.Popen[bytes]]]:
    """A stress run serving its metrics on loopback, kept serving after it ends."""
    port = free_port()
    out = tmp_path / "stress.out"
    with out.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hylinker", "stress", "--requests", str(REQUESTS), "--kv-pages", "400",
             "--no-progress", "--metrics-port", str(port), "--metrics-linger-s", "120"],
            stdout=f, stderr=subprocess.STDOUT)
    try:
        yield port, out, proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_every_dashboard_panel_returns_series_from_a_stress_run(
        stress_port: tuple[int, Path, subprocess.Popen[bytes]], tmp_path: Path) -> None:
    port, out, proc = stress_port
    queries = dashboard_queries("hylinker_", "stress")
    assert len(queries) >= 20
    with prometheus({"stress": f"127.0.0.1:{port}"}, tmp_path / "prometheus") as prom:
        def run_ended() -> bool:  # the tool says so once the run is over and it lingers
            if proc.poll() is not None:
                raise AssertionError(f"stress exited {proc.returncode}: {out.read_text()[-800:]}")
            return "serving metrics on" in out.read_text()

        def scraped_the_end() -> bool:
            got = prom.query('sum(hylinker_lookups_total{job="stress"})')
            return bool(got) and float(got[0]["value"][1]) == REQUESTS

        prom.wait(run_ended, 300, "the end of the stress run")
        prom.wait(scraped_the_end, 30, f"the run's {REQUESTS} lookups (targets {prom.targets()}; "
                                       f"{out.read_text()[-800:]})")
        prom.wait_for_series(queries, 30)
        info = prom.query('hylinker_info{job="stress"}')
        assert [(s["metric"]["version"], s["metric"]["integrity"], s["metric"]["store"]) for s in info] == [
            (__version__, "checksum", "embedded")]
        # the figures are the run's: restores happened, pages were stored, the store holds them
        loads = prom.query('hylinker_loads_total{job="stress",outcome="ok"}')
        assert float(loads[0]["value"][1]) > 0
        stored = float(prom.query('hylinker_stored_tokens_total{job="stress"}')[0]["value"][1])
        objects = float(prom.query('hylinker_store_objects{job="stress"}')[0]["value"][1])
        assert stored > 0 and objects > 0
        ratio = prom.query(dict(queries)["Lookup hit ratio"])
        assert len(ratio) == 1
