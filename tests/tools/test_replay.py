"""How the stress tool feeds the runtime: the waiting queue, causal order, and that a request
that does not fit waits instead of being dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from hylinker.tools.cli import main
from hylinker.tools.replay import Demand, QueueFullError, WaitingQueue
from hylinker.tools.workloads import PromptTokens, Request, causal_parents, synthetic_agentic


def _req(rid: str, *segments: tuple[int, int]) -> Request:
    return Request(request_id=rid, arrival_s=0.0, prompt=PromptTokens(segments), output_length=1)


# ---- causal order ------------------------------------------------------------------------------


def test_a_turn_depends_on_the_longest_earlier_prompt_it_extends() -> None:
    reqs = [
        _req("a0", (1, 100), (2, 50)),
        _req("b0", (1, 100), (3, 40)),
        _req("a1", (1, 100), (2, 50), (4, 30), (5, 20)),
        _req("a2", (1, 100), (2, 50), (4, 30), (5, 20), (6, 10)),
        _req("c", (1, 100)),  # the system prompt alone extends nobody
        _req("a0-again", (1, 100), (2, 50)),  # not a continuation of the same prompt a0, but of c
    ]
    assert causal_parents(reqs) == [None, None, 0, 2, None, 4]


def test_block_traces_match_whole_blocks_and_ignore_the_shared_first_block() -> None:
    B = 16
    reqs = [
        _req("t0", (0, B), (1, B), (2, 5)),  # partial last block
        _req("t1", (0, B), (1, B), (7, B), (8, 3)),  # next turn: block 2 became block 7
        _req("other", (0, B), (9, 4)),  # one whole block: only the shared system prompt
        _req("x", (0, B), (10, B), (11, 2)),  # shares block 0 with "other": not its turn
    ]
    assert causal_parents(reqs, block_tokens=B) == [None, 0, None, None]


def test_the_synthetic_workload_chains_its_turns() -> None:
    reqs = synthetic_agentic(300, seed=1, scale=0.05)
    parents = causal_parents(reqs)
    by_id = {r.request_id: i for i, r in enumerate(reqs)}
    chained = 0
    for i, r in enumerate(reqs):
        branch, turn = r.request_id.rsplit(".t", 1)
        prev = by_id.get(f"{branch}.t{int(turn) - 1}")
        if prev is not None:
            parent = parents[i]
            assert parent is not None and parent < i
            assert reqs[parent].session_id == r.session_id
            chained += 1
    assert chained > 100


# ---- the waiting queue -------------------------------------------------------------------------


async def test_the_queue_admits_first_come_first_served_within_budget() -> None:
    q = WaitingQueue(pages=10, slots=6, concurrency=2, max_waiting=8)
    order: list[str] = []

    async def run(name: str, demand: Demand, hold: anyio.Event) -> None:
        async with q.admitted_for(demand):
            order.append(name)
            await hold.wait()

    holds = {n: anyio.Event() for n in "abcd"}
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "a", Demand(6, 3), holds["a"])
        await anyio.sleep(0.01)
        tg.start_soon(run, "b", Demand(6, 3), holds["b"])  # pages do not fit beside a
        await anyio.sleep(0.01)
        tg.start_soon(run, "c", Demand(1, 1), holds["c"])  # fits, but waits behind b (FCFS)
        await anyio.sleep(0.01)
        assert order == ["a"] and q.waited == 2
        holds["a"].set()
        await anyio.sleep(0.01)
        assert order == ["a", "b", "c"]
        tg.start_soon(run, "d", Demand(1, 1), holds["d"])  # concurrency 2: waits
        await anyio.sleep(0.01)
        assert order == ["a", "b", "c"]
        holds["b"].set()
        await anyio.sleep(0.01)
        assert order == ["a", "b", "c", "d"]
        holds["c"].set()
        holds["d"].set()
    assert q.running == 0


async def test_waiting_requests_are_served_in_arrival_order_not_join_order() -> None:
    """A next turn that became ready late (its previous turn just finished) arrived, in the
    trace, before the requests queued behind it: it goes first."""
    q = WaitingQueue(pages=4, slots=0, concurrency=1, max_waiting=8)
    order: list[int] = []
    hold = anyio.Event()

    async def run(arrival: int) -> None:
        async with q.admitted_for(Demand(4, 0), arrival):
            order.append(arrival)
            if arrival == 0:
                await hold.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, 0)
        await anyio.sleep(0.01)
        for arrival in (5, 7, 2):  # 2 joins last
            tg.start_soon(run, arrival)
            await anyio.sleep(0.01)
        hold.set()
    assert order == [0, 2, 5, 7]


async def test_the_queue_is_bounded_and_knows_what_never_fits() -> None:
    q = WaitingQueue(pages=4, slots=3, concurrency=1, max_waiting=1)
    assert q.never_fits(Demand(5, 0)) and q.never_fits(Demand(1, 4)) and not q.never_fits(Demand(4, 3))
    with pytest.raises(ValueError):
        async with q.admitted_for(Demand(5, 0)):
            pass
    hold = anyio.Event()

    async def holder() -> None:
        async with q.admitted_for(Demand(1, 0)):
            await hold.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await anyio.sleep(0.01)
        tg.start_soon(holder)  # waits
        await anyio.sleep(0.01)
        with pytest.raises(QueueFullError):
            async with q.admitted_for(Demand(1, 0)):
                pass
        assert q.rejected == 1
        hold.set()


async def test_a_cancelled_waiter_leaves_the_queue_and_gives_nothing_back_twice() -> None:
    q = WaitingQueue(pages=4, slots=0, concurrency=1, max_waiting=4)
    hold = anyio.Event()

    async def holder() -> None:
        async with q.admitted_for(Demand(4, 0)):
            await hold.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await anyio.sleep(0.01)
        with anyio.move_on_after(0.02):
            async with q.admitted_for(Demand(4, 0)):
                pytest.fail("admitted beside a holder of the whole budget")
        hold.set()
    async with q.admitted_for(Demand(4, 0)):
        assert q.running == 1
    assert q.running == 0


# ---- the stress tool ---------------------------------------------------------------------------


def _stress(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "stress.json"
    rc = main(["stress", "--no-progress", "--json", str(out), *extra])
    s: dict[str, Any] = json.loads(out.read_text())
    assert rc == 0, s
    assert s["restore_mismatches"] == 0 and s["leaked_rows"] == 0 and s["leaked_slots"] == 0
    assert s["locked_nodes_at_end"] == 0 and s["idle_check_failed"] == 0
    return s


def test_small_pools_make_requests_wait_not_drop(tmp_path: Path) -> None:
    """Pools far below what concurrency 8 would hold: every request waits its turn, none is
    dropped, and the hit rate stays near the bound."""
    s = _stress(tmp_path, "--requests", "150", "--synthetic-scale", "0.05", "--kv-pages", "256",
                "--mamba-slots", "16", "--concurrency", "8")
    assert s["completed"] == s["requests"] == 150
    assert s["alloc_failures"] == 0 and s["never_fit"] == 0 and s["rejected"] == 0
    assert s["alloc_waits"] > 0
    assert s["of_bound"] >= 0.9


def test_a_request_that_can_never_fit_is_reported_not_hung(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _stress(tmp_path, "--requests", "60", "--synthetic-scale", "0.1", "--kv-pages", "8",
                "--mamba-slots", "16")
    assert s["never_fit"] > 0
    assert s["completed"] + s["never_fit"] == s["requests"]
    assert "can never fit" in capsys.readouterr().err


def test_of_bound_fit_leaves_the_requests_that_never_fit_out_of_both_sides(tmp_path: Path) -> None:
    s = _stress(tmp_path, "--requests", "60", "--synthetic-scale", "0.1", "--kv-pages", "8",
                "--mamba-slots", "16")
    assert s["never_fit"] > 0 and s["of_bound"] is not None and s["of_bound_fit"] is not None
    assert s["of_bound_fit"] > s["of_bound"]  # their hits left the bound, not only the hits
    generous = _stress(tmp_path, "--requests", "60", "--synthetic-scale", "0.1")
    assert generous["never_fit"] == 0 and generous["of_bound_fit"] == generous["of_bound"]


def test_causal_replay_keeps_the_hit_rate_at_concurrency(tmp_path: Path) -> None:
    """Turn N+1 starts only after turn N: at concurrency 8 the run reaches what concurrency 1
    reaches; without causal order, later turns race their predecessors and miss."""
    args = ("--requests", "200", "--synthetic-scale", "0.05", "--concurrency", "8")
    causal = _stress(tmp_path, *args)
    racing = _stress(tmp_path, *args, "--no-causal")
    assert causal["causal_waits"] > 0 and racing["causal_waits"] == 0
    assert causal["of_bound"] >= 0.9
    assert racing["hit_rate"] < causal["hit_rate"]


@pytest.mark.parametrize(("policy", "eviction"), [("end", "lru"), ("speculative", "flop"), ("grid", "flop")])
def test_every_policy_runs_exact_and_leak_free_under_eviction(tmp_path: Path, policy: str, eviction: str) -> None:
    """Small pools force device eviction on every request: the policies the runtime takes are
    exact and leak nothing, and they differ in what they store."""
    s = _stress(tmp_path, "--requests", "100", "--synthetic-scale", "0.1", "--kv-pages", "128",
                "--mamba-slots", "24", "--policy", policy, "--eviction", eviction)
    assert s["policy"] == policy and s["eviction"] == eviction
    assert s["completed"] + s["never_fit"] == 100 and s["store_hit_tokens"] > 0
    end = _stress(tmp_path, "--requests", "100", "--synthetic-scale", "0.1", "--kv-pages", "128",
                  "--mamba-slots", "24", "--policy", "end")
    if policy != "end":
        assert s["checkpoints_donated"] > end["checkpoints_donated"]


def test_arrival_times_are_honoured_with_time_scale(tmp_path: Path) -> None:
    reqs = synthetic_agentic(30, seed=0, scale=0.05)
    scale = 0.02
    last = max(r.arrival_s for r in reqs) * scale
    s = _stress(tmp_path, "--requests", "30", "--synthetic-scale", "0.05", "--time-scale", str(scale))
    assert s["completed"] == 30
    assert s["seconds"] >= last > 0.05
