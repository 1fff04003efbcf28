"""The fleet suite's shared run: one fleet, every fault in turn, every restore verified."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from hylinker.tools.fleet import FAULTS, run_faults
from hylinker.tools.harness.fleet import Fleet, FleetConfig
from hylinker.tools.harness.netns import NetnsUnavailableError, list_own, require_netns

WARM_S = 3.0
FAULT_S = 4.0
AFTER_S = 6.0
CONFIG = FleetConfig(hosts=2, call_timeout_s=1.0, deadline_s=2.0, transfer_timeout_s=1)


@pytest.fixture(scope="session", autouse=True)
def netns_available() -> None:
    """Fail, never skip, where namespaces cannot be built (CI runs as root with iproute2)."""
    try:
        require_netns()
    except NetnsUnavailableError as exc:
        pytest.fail(f"the fleet suite cannot run here: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def fleet_result(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    before = set(list_own())
    began = time.monotonic()
    with Fleet(CONFIG, workdir=tmp_path_factory.mktemp("fleet")) as fleet:
        tags = {fleet.net.switch, *(h.netns for h in fleet.net.hosts.values())}
        result = run_faults(fleet, FAULTS, warm_s=WARM_S, fault_s=FAULT_S, after_s=AFTER_S)
        result["closed"] = [e for eng in fleet.all_engines() for e in eng.events if e["ev"] == "closed"]
        result["survivors"] = [eng.name for eng in fleet.engines.values()]
    result["namespaces_left"] = sorted((set(list_own()) - before) & tags)
    result["seconds"] = time.monotonic() - began
    print(f"fleet run: {result['seconds']:.1f} s, {result['requests']} requests")
    yield result


def row(result: dict[str, Any], fault: str) -> dict[str, Any]:
    return next(r for r in result["faults"] if r["fault"] == fault)
