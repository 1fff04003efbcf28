"""Read a server's Prometheus ``/metrics`` and its trace lines in the engine suites (standard
library only)."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from typing import Any


def scrape(url: str, prefix: str) -> dict[str, float]:
    """``url``'s exposition: ``name{labels}`` -> value, for the samples whose name starts with
    ``prefix``."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        body = resp.read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` (the full name) whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and all(w in k for w in want))


def trace_lines(log_text: str) -> list[dict[str, Any]]:
    """hylinker's JSON trace lines in a server log (a line may carry a prefix before the JSON)."""
    out = []
    for line in log_text.splitlines():
        start = line.find('{"')
        if start >= 0 and '"event"' in line:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line[start:]))
    return out


__all__ = ["metric", "scrape", "trace_lines"]
