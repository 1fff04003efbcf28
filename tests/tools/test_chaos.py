"""``hylinker stress --chaos`` end to end, short: fault plans against a fault-free replay,
close() with a hung store, and (Mooncake) the master killed and restarted mid-run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hylinker.tools.cli import main

SMALL = ["--requests", "120", "--synthetic-scale", "0.1", "--kv-pages", "1024", "--mamba-slots", "24",
         "--store-capacity-mb", "256", "--no-progress"]


def _chaos(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "chaos.json"
    rc = main(["stress", "--chaos", "--json", str(out), *SMALL, *extra])
    return rc, json.loads(out.read_text())


def _safe(row: dict[str, Any]) -> None:
    for key in ("wrong_restores", "leaked_rows", "leaked_slots", "locked_nodes", "idle_check_failed"):
        assert row[key] == 0, (key, row)


@pytest.mark.slow
def test_fault_plans_against_the_baseline_and_a_hung_store(tmp_path: Path) -> None:
    rc, out = _chaos(tmp_path, "--no-soak", "--chaos-plans", "uniform=0.05;fail=0.2")
    assert rc == 0
    assert set(out["plans"]) == {"none", "uniform=0.05", "fail=0.2"}
    for row in out["plans"].values():
        _safe(row)
    assert out["plans"]["none"]["store_hit_tokens"] > 0
    assert out["plans"]["fail=0.2"]["recovered_keys"] > 0  # retries really ran
    assert out["plans"]["fail=0.2"]["store_hit_tokens"] > 0  # and the store stayed useful
    hung = out["close_hung_store"]
    assert hung["puts_hung"] > 0 and hung["cancelled_on_shutdown"] > 0
    assert hung["locked_nodes"] == hung["leaked_pages"] == hung["leaked_slots"] == 0


@pytest.mark.slow
@pytest.mark.mooncake
def test_soak_with_the_master_killed_and_restarted(tmp_path: Path, mooncake_master: object) -> None:
    # the fixture only makes sure Mooncake can run here; the soak starts its own master
    rc, out = _chaos(tmp_path, "--chaos-plans", "", "--soak-seconds", "8", "--soak-outage-s", "1.5",
                     "--soak-faults", "uniform=0.01")
    assert rc == 0, out
    soak = out["soak"]
    assert soak["completed"]
    _safe(soak)
    assert soak["restarted_at_request"] > soak["killed_at_request"]
    assert soak["store_hits_after_restart"] > 0  # the store is used again after the restart
    killed = out["close_killed_master"]
    assert killed["locked_nodes"] == killed["leaked_pages"] == killed["leaked_slots"] == 0
