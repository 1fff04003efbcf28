"""A real Prometheus on loopback for the dashboard tests, and the dashboard's queries.

The server is Debian's ``prometheus`` package (``apt-get install prometheus``; ``.ci/setup.sh``
installs it); :data:`PROMETHEUS` is None where the binary is missing and the tests skip saying
so. :func:`dashboard_queries` reads ``docs/grafana/hylinker.json`` and fills in the variables
Grafana would (``$prefix``, ``$job``, ``$__rate_interval``), so a test asks Prometheus exactly
what each panel asks. Standard library only: the engine suites' environments use it too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: the binary (None: not installed)
PROMETHEUS = shutil.which("prometheus")
MISSING = ("Debian's prometheus binary is not installed (apt-get install prometheus; .ci/setup.sh "
           "installs it)")
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "hylinker.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard_queries(prefix: str, job: str, rate_interval: str = "15s",
                      path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` for every target of every panel, variables filled in."""
    doc = json.loads(path.read_text())
    out = []
    for panel in doc["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("${prefix}", prefix).replace("$__rate_interval", rate_interval)
                    .replace("$job", job))
            out.append((panel["title"], expr))
    return out


class Prometheus:
    """A running server: :meth:`query` answers instant queries."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The series an instant query returns (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise AssertionError(f"{expr}: {body}")
        return list(body["data"]["result"])

    def wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus: {what} not within {timeout_s:g} s")
            time.sleep(0.5)

    def missing(self, queries: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The queries that return no series."""
        return [(title, expr) for title, expr in queries if not self.query(expr)]

    def targets(self) -> list[tuple[str, str, str]]:
        """``(job, health, last error)`` of every scrape target."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as resp:
            body = json.loads(resp.read())
        return [(t["labels"].get("job", ""), t["health"], t.get("lastError", ""))
                for t in body["data"]["activeTargets"]]

    def wait_for_series(self, queries: list[tuple[str, str]], timeout_s: float) -> None:
        """Until every query returns series; else an AssertionError naming those that do not
        and the targets' health."""
        deadline = time.monotonic() + timeout_s
        while missing := self.missing(queries):
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus: no series within {timeout_s:g} s for {missing}; "
                                     f"targets {self.targets()}")
            time.sleep(0.5)


@contextmanager
def prometheus(targets: Mapping[str, str], workdir: Path, scrape_interval_s: float = 1.0) -> Iterator[Prometheus]:
    """Prometheus on a free loopback port scraping ``targets`` (job -> ``host:port``) every
    ``scrape_interval_s`` (also the scrape timeout: an engine's ``/metrics`` on a busy host may
    need more than 1 s); stopped (and its data folder left in ``workdir``) on exit."""
    if PROMETHEUS is None:
        raise RuntimeError(MISSING)
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = "".join(f"  - job_name: {json.dumps(job)}\n    static_configs:\n      - targets: [{json.dumps(addr)}]\n"
                   for job, addr in targets.items())
    config = workdir / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: {scrape_interval_s:g}s\n  evaluation_interval: "
                      f"{scrape_interval_s:g}s\nscrape_configs:\n{jobs}")
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "GOMAXPROCS": "1"})
    server = Prometheus(port)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited {proc.returncode}: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        server.wait(ready, 60, "ready")
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


__all__ = ["DASHBOARD", "MISSING", "PROMETHEUS", "Prometheus", "dashboard_queries", "free_port", "prometheus"]
