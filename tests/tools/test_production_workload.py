"""The production-regime agentic workload (tools/production_workload.py, issue 44)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hylinker.tools.arguments import UsageError
from hylinker.tools.cli import main
from hylinker.tools.production_workload import ProductionShape, production_agentic, production_shape
from hylinker.tools.workloads import causal_parents

SMALL = ProductionShape(scale=0.05, sessions_per_hour=60.0, hours=1.0)


def test_sessions_share_a_few_heads_and_extend_their_own_history_over_hours() -> None:
    reqs = production_agentic(400, seed=3, shape=SMALL)
    assert reqs == production_agentic(400, seed=3, shape=SMALL)  # deterministic
    assert len(reqs) == 400 and [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    sessions = {r.session_id for r in reqs}
    assert len({r.prompt.segments[0] for r in reqs}) <= SMALL.n_system_prompts < len(sessions)
    assert len({r.prompt.segments[1] for r in reqs}) <= SMALL.n_tool_preambles < len(sessions)
    parents = causal_parents(reqs)
    continued = [i for i, p in enumerate(parents) if p is not None]
    assert len(continued) > len(reqs) // 2  # most requests are a later turn of their session
    assert all(reqs[parents[i]].session_id == reqs[i].session_id for i in continued)  # type: ignore[index]
    assert reqs[-1].arrival_s > 1200  # arrivals over trace time, not a burst


def test_workload_params_parse_and_bad_ones_are_one_line_errors() -> None:
    shape = production_shape(["hours=0.5", "system_prompt_tokens=100:200"], scale=0.1)
    assert (shape.hours, shape.system_prompt_tokens, shape.scale) == (0.5, (100, 200), 0.1)
    for bad in ("nope=1", "hours", "hours=x", "hours=-1", "user_tokens=5"):
        with pytest.raises(UsageError, match="--workload-param"):
            production_shape([bad], scale=1.0)
    with pytest.raises(UsageError, match="did you mean 'system_prompt_tokens'"):
        production_shape(["system_promt_tokens=100:200"], scale=1.0)


def test_stress_replays_the_production_workload_with_evictions_accounted(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    rc = main(["stress", "--no-progress", "--json", str(out), "--workload", "production",
               "--workload-param", "sessions_per_hour=60", "--workload-param", "hours=1",
               "--synthetic-scale", "0.05", "--requests", "120", "--store-capacity-mb", "24"])
    s = json.loads(out.read_text())
    assert rc == 0 and s["completed"] == 120 and s["restore_mismatches"] == 0
    assert s["store"]["evictions"] > 0
    returns = s["eviction_returns"]
    assert returns["asked_again"] == s["store"]["evicted_probed_again"] + s["store"]["evicted_touched_again"]
    assert set(returns["pools"]) <= {"kv", "mamba", "draft"}
