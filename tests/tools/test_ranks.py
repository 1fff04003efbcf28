"""Agreement across ranks with real processes: gloo on loopback, one linker, pool set and
Mooncake client per rank, one shared ``mooncake_master``.

The scenarios run inside the rank processes (module-level functions, so the spawned processes
can import them) and return what they saw; the tests compare the ranks' answers.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio
import numpy as np
import pytest

from hylinker.components.admission import checkpoint_policy
from hylinker.components.keys import as_tokens, object_key, page_keys
from hylinker.components.layout import PoolKind
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.agreement import (
    SLOT_BYTES,
    Agreement,
    AgreementError,
    RankMismatchError,
    SingleRank,
    agreed_boundary,
    page_runs,
    restorable,
    runs_pages,
)
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker, Request
from hylinker.stores.mooncake import MooncakeConfig, MooncakeStore
from hylinker.testing.content import SyntheticContent, preset_layout
from hylinker.tools.ranks import launch
from hylinker.tools.stress.ranks import rank_disagreements

pytestmark = pytest.mark.mooncake

PAGE = 64
PAGES = 8  # the shared prompt: 8 pages, a state at every page (grid = page)


# ---- pure rules (no processes) --------------------------------------------------------------

def test_agreed_boundary_takes_the_largest_common_member_not_the_min_of_maxima() -> None:
    # rank 0 can restore 8 (store) or anything up to 3 on device; rank 1 only 4 and 8 from the
    # store, nothing on device: the common set is {0, 8}
    assert agreed_boundary([(3, None, (8,)), (0, None, (4, 8))]) == 8
    # hybrid device points: rank 0 has states at 2 and 6 on device, rank 1 can restore 4 or 6
    assert agreed_boundary([(6, (2, 6), ()), (0, (), (4, 6))]) == 6
    # no common member but 0
    assert agreed_boundary([(0, (), (4,)), (0, (), (8,))]) == 0
    # pure attention devices: any count up to the device hit
    assert agreed_boundary([(10, None, ()), (7, None, (16,))]) == 7
    assert restorable((5, (2,), ()), 0) and not restorable((5, (2,), ()), 4)


def test_page_runs_round_trip() -> None:
    pages = {0, 1, 2, 5, 7, 8, 100}
    assert page_runs(pages) == ((0, 3), (5, 6), (7, 9), (100, 101))
    assert runs_pages(page_runs(pages)) == pages
    assert page_runs(set()) == () and runs_pages(()) == set()
    assert len(page_runs(set(range(4096)))) == 1  # a long path is one run


async def test_single_rank_rounds_are_the_ranks_own_value() -> None:
    agreement = SingleRank()
    assert not agreement.collective
    assert await agreement.gather("requests", "lookup", "r", 7) == [7]
    with pytest.raises(ValueError, match="channel"):
        await agreement.gather("nowhere", "lookup", "r", 7)  # type: ignore[arg-type]


async def test_round_times_stay_bounded_over_many_rounds_and_count_every_one() -> None:
    # a server agrees on every request for weeks: the durations kept stop at the window
    agreement = SingleRank(round_window=16)
    for i in range(100):
        await agreement.gather("requests", "lookup", f"r{i}", i)
    await agreement.gather("offloads", "settle", "r", 0)
    lookups = agreement.round_seconds[("requests", "lookup")]
    assert lookups.count == 100 and len(lookups.recent) == 16 and agreement.rounds == 101
    assert lookups.total_s >= sum(lookups.recent) and lookups.max_s >= max(lookups.recent)
    assert len(lookups.since(90)) == 10 and lookups.since(90) == list(lookups.recent)[-10:]
    assert len(lookups.since(0)) == 16  # only the kept ones
    assert agreement.round_seconds[("offloads", "settle")].count == 1
    with pytest.raises(ValueError, match="round_window"):
        SingleRank(round_window=0)


class _TwoRanks(SingleRank):
    """An agreement that claims two ranks (construction checks only; it never runs a round)."""

    rank = 1
    size = 2


async def test_the_agreement_must_match_the_layouts_ranks() -> None:
    from hylinker.stores.embedded import EmbeddedStore

    one = preset_layout("attention", PAGE, PAGE)
    store = EmbeddedStore(1 << 20)
    with pytest.raises(ValueError, match="tp_size=1"):
        Linker(one, HybridPools(one, kv_pages=8), store, agreement=_TwoRanks())
    rank0 = preset_layout("attention", PAGE, PAGE, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="tp_rank=0"):
        Linker(rank0, HybridPools(rank0, kv_pages=8), store, agreement=_TwoRanks())
    await store.close()


# ---- scenarios run on every rank -------------------------------------------------------------

def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, size=n, dtype=np.int64)


async def _serve(lk: Linker, content: SyntheticContent, rid: str, tokens: np.ndarray) -> dict[str, Any]:
    """One request through every phase; what the rank stood on and whether it checked out."""
    async with lk.session(rid, tokens) as req:
        hit = await lk.lookup(req)
        load = await lk.load(req)  # several ranks: after every lookup
        restored = await lk.commit(load) if load is not None else 0
        keys = page_keys(req.tokens, PAGE, req.seed)
        n = req.prefix_pages
        bad = len(content.pages_match(keys[:n], req.rows[: n * PAGE])) if n else 0
        if n and (req.state_source is None or not content.state_matches(keys[n - 1], req.state_source)):
            bad += 1
        seen = {"lookup_tokens": hit.total_tokens, "prefix_tokens": req.prefix_tokens,
                "device_tokens": hit.device_tokens, "restored": restored, "mismatches": bad}
        await _forward(lk, content, req, keys)
    return seen


async def _forward(lk: Linker, content: SyntheticContent, req: Request, keys: list[bytes]) -> None:
    rows = lk.extend(req, len(req.tokens))
    whole = len(req.tokens) // PAGE
    content.write_pages(keys[req.prefix_pages:whole], rows[req.prefix_pages * PAGE: whole * PAGE])
    lk.working_slot(req)
    for depth in lk.checkpoint_depths(req):
        slot = lk.checkpoint_slot(req)
        content.write_state(keys[depth // PAGE - 1], slot)
        await lk.insert(req, depth, checkpoint_slot=slot)


async def _remove_states(lk: Linker, tokens: np.ndarray, req_seed: bytes, boundaries: range) -> int:
    keys = page_keys(as_tokens(tokens), PAGE, req_seed)
    names = [name for b in boundaries
             for name in lk.data.store_keys(PoolKind.MAMBA, object_key(keys[b - 1], PoolKind.MAMBA, lk.layout))]
    return await lk.inner_store.remove(names)


#: these scenarios count pages restored: an offload the store-latency rule dropped (its EMA
#: above 250 ms when the 2-core host is loaded) would leave a page unstored and shorten a hit;
#: one failure at load average 9 (192 restored tokens for 256) fits that, not reproduced since.
#: The rule is tested on its own (tests/runtime/test_backpressure.py); here it is out of reach
NO_LATENCY_DROPS: tuple[float, float] = (60_000.0, 30_000.0)  # (latency_high_ms, latency_low_ms)

async def scenario_two_ranks(rank: int, size: int, agreement: Agreement, address: str, prefix: int
                             ) -> dict[str, Any]:
    layout = preset_layout("kimi", PAGE, PAGE, tp_rank=rank, tp_size=size, replicated=("kv", "draft"))
    pools = HybridPools(layout, kv_pages=64, mamba_slots=16)
    content = SyntheticContent(pools, seed=0)
    store = await MooncakeStore.open(MooncakeConfig(master_address=address, segment_bytes=32 << 20))
    out: dict[str, Any] = {}
    tokens = _tokens(prefix, PAGES * PAGE + 5)
    try:
        async with Linker(layout, pools, store, LinkerConfig(resilience=None, latency_high_ms=NO_LATENCY_DROPS[0], latency_low_ms=NO_LATENCY_DROPS[1]), salt=f"t{prefix}",
                          checkpoints=checkpoint_policy("grid"), agreement=agreement) as lk:
            out["first"] = await _serve(lk, content, "a1", tokens)
            await lk.drain()
            stats = lk.statistics()
            out["bytes_offloaded"] = {k: v.bytes_offloaded for k, v in lk.pool_statistics().items()}
            out["verified_replicas"] = stats.offloads_verified_replicas
            out["stored_kinds"] = sorted({k.value for n in lk.tree.tree.nodes() for k in n.stored})
            seed = lk._default_seed

            # one rank's shard missing: rank 1's states above page 4 vanish from the store
            lk.flush_device()
            if rank == 1:
                out["removed"] = await _remove_states(lk, tokens, seed, range(5, PAGES + 1))
            await agreement.gather("requests", "barrier", "removed", None)
            out["shard_missing"] = await _serve(lk, content, "a2", tokens)
            await lk.drain()

            # device hits differ: rank 0 keeps its tree (8 pages), rank 1 flushes it and loses
            # its states above page 4 again; rank 0 must stand on 4 pages like rank 1
            if rank == 1:
                lk.flush_device()
                await _remove_states(lk, tokens, seed, range(5, PAGES + 1))
            await agreement.gather("requests", "barrier", "diverged", None)
            out["device_deeper"] = await _serve(lk, content, "a3", tokens)
            await lk.drain()

            # offloads still settling while the next requests look up (no drain): the two
            # channels do not wait on each other, decisions still match
            out["overlapped"] = [
                (await _serve(lk, content, f"b{i}", _tokens(prefix + 1, (PAGES + 2 * i) * PAGE + 1)))["prefix_tokens"]
                for i in range(3)]

            # a round waiting for a late peer leaves the event loop serving
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await anyio.sleep(0.01)
                    ticks += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                if rank == 1:
                    await anyio.sleep(0.5)
                await agreement.gather("requests", "barrier", "late", None)
                tg.cancel_scope.cancel()
            out["ticks_while_waiting"] = ticks

            # a value larger than a round's slot goes the two-collective way, same answer
            big = await agreement.gather("requests", "barrier", "large", bytes([rank]) * (SLOT_BYTES + rank))
            out["large"] = [len(v) for v in big] + [v[0] for v in big]
            out["large_rounds"] = getattr(agreement, "large_rounds", 0)
            await lk.drain()

            # ranks that break the ordering rule: both see the mismatch
            try:
                async with lk.session(f"x{rank}", tokens) as req:
                    await lk.lookup(req)
                out["mismatch"] = None
            except RankMismatchError as exc:
                out["mismatch"] = str(exc)
            await lk.drain()
            stats = lk.statistics()
            out["rank_shortened_lookups"] = stats.rank_shortened_lookups
            out["rank_shortened_loads"] = stats.rank_shortened_loads
            lk.check_idle()
            out["leaked"] = list(lk.leaked())
        lk.flush_device()
        pools.check_idle()
    finally:
        await store.close()
    return out


@pytest.fixture(scope="module")
def two_ranks(mooncake_master: Any) -> list[dict[str, Any]]:
    return launch(2, scenario_two_ranks, mooncake_master.address, 7, timeout_s=60)


def test_replicated_kv_is_written_once_and_verified(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = two_ranks
    assert r0["bytes_offloaded"]["kv"] > 0 and r0["bytes_offloaded"]["draft"] > 0
    assert r1["bytes_offloaded"]["kv"] == 0 and r1["bytes_offloaded"]["draft"] == 0
    # the state is per rank: both write theirs
    assert r0["bytes_offloaded"]["mamba"] > 0 and r1["bytes_offloaded"]["mamba"] > 0
    # the non-writer checked the writer's objects, and marks them stored like the writer
    assert r1["verified_replicas"] > 0
    assert r0["stored_kinds"] == r1["stored_kinds"] == ["draft", "kv", "mamba"]


def test_one_ranks_missing_shard_shortens_every_ranks_hit(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = two_ranks
    assert r1["removed"] > 0
    a0, a1 = r0["shard_missing"], r1["shard_missing"]
    # rank 0 alone could restore all 8 pages; rank 1 only 4: both restore 4, bytes exact
    assert a0["lookup_tokens"] == a1["lookup_tokens"] == 4 * PAGE
    assert a0["prefix_tokens"] == a1["prefix_tokens"] == a0["restored"] == a1["restored"] == 4 * PAGE
    assert a0["mismatches"] == a1["mismatches"] == 0
    assert r0["rank_shortened_lookups"] >= 1


def test_a_deeper_device_hit_moves_back_to_the_agreed_boundary(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = two_ranks
    d0, d1 = r0["device_deeper"], r1["device_deeper"]
    # rank 0's device tree holds all 8 pages; rank 1 can restore 4 from the store
    assert d0["prefix_tokens"] == d1["prefix_tokens"] == 4 * PAGE
    assert d0["device_tokens"] == 4 * PAGE and d0["restored"] == 0  # moved back, nothing read
    assert d1["device_tokens"] == 0 and d1["restored"] == 4 * PAGE  # read from the store
    assert d0["mismatches"] == d1["mismatches"] == 0


def test_rounds_that_do_not_match_raise_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        assert r["mismatch"] is not None and "same order" in r["mismatch"]


def test_offloads_settling_during_lookups_keep_decisions_equal(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = two_ranks
    assert r0["overlapped"] == r1["overlapped"]
    assert r0["overlapped"][1] > 0  # the later requests did hit the earlier ones' prefix


def test_a_round_waiting_for_a_peer_leaves_the_loop_serving(two_ranks: list[dict[str, Any]]) -> None:
    assert two_ranks[0]["ticks_while_waiting"] >= 10  # rank 0 waited ~0.5 s for rank 1


def test_values_larger_than_a_slot_still_agree(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        assert r["large"] == [SLOT_BYTES, SLOT_BYTES + 1, 0, 1]
        assert r["large_rounds"] == 1  # only that round: lookups, loads and settlements fit


def test_nothing_leaks_on_any_rank(two_ranks: list[dict[str, Any]]) -> None:
    assert [r["leaked"] for r in two_ranks] == [[0, 0], [0, 0]]


async def scenario_a_peer_that_never_comes(rank: int, size: int, agreement: Agreement) -> dict[str, Any]:
    """Rank 0 enters a round rank 1 never reaches (the ordering rule broken on one rank)."""
    out: dict[str, Any] = {}
    if rank == 0:
        started = time.monotonic()
        try:
            await agreement.gather("requests", "barrier", "alone", None)
            out["error"] = None
        except AgreementError as exc:
            out["error"] = type(exc).__name__
        out["waited_s"] = time.monotonic() - started
    else:
        await anyio.sleep(6.0)  # long past rank 0's round timeout; then leave without the round
    return out


def test_a_round_whose_peer_never_comes_fails_within_the_round_timeout() -> None:
    # the round timeout is the launcher's 2 s: rank 0 gets an AgreementError, not a hang
    r0, _ = launch(2, scenario_a_peer_that_never_comes, timeout_s=2.0)
    assert r0["error"] == "AgreementError"
    assert r0["waited_s"] < 6.0


# ---- independent faults per rank, through stress --ranks --------------------------------------

def _stress_args(ranks: int, requests: int, address: str) -> argparse.Namespace:
    from hylinker.tools.stress.cli import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args([
        "--ranks", str(ranks), "--requests", str(requests), "--preset", "kimi", "--kv-pages", "512",
        "--mamba-slots", "24", "--store-capacity-mb", "64", "--faults",
        "fail=0.03,corrupt=0.02,vanish=0.05", "--no-progress", "--mooncake-master", address])


def _check_faulty_ranks(s: dict[str, Any], ranks: int) -> None:
    assert s["ranks"] == ranks
    assert s["rank_disagreements"] == 0
    assert s["restore_mismatches"] == 0
    assert s["leaked_rows"] == s["leaked_slots"] == s["locked_nodes_at_end"] == s["idle_check_failed"] == 0
    assert s["non_writer_replicated_bytes"] == 0
    assert all(r["bytes_offloaded"]["kv"] == 0 for r in s["per_rank"][1:])
    assert s["per_rank"][0]["bytes_offloaded"]["kv"] > 0
    # the faults did bite (a rank lost a load, was cut short by a peer, or kept an offload
    # unsettled), and the decisions above still agree. Which of these a 60-request run shows
    # depends on where the random faults land, so only their sum is pinned; a peer cutting a
    # rank short is pinned deterministically by the scenario tests above.
    bitten = sum(r["dropped_loads"] + r["rank_shortened_lookups"] + r["rank_shortened_loads"]
                 + r["rank_unsettled_offloads"] for r in s["per_rank"])
    assert bitten > 0
    assert sum(r["restores_verified"] for r in s["per_rank"]) > 0


def test_independent_faults_give_identical_decisions_on_two_ranks(mooncake_master: Any) -> None:
    from hylinker.tools.stress.ranks import run_ranks
    from hylinker.tools.workloads import synthetic_agentic

    args = _stress_args(2, 60, mooncake_master.address)
    _check_faulty_ranks(run_ranks(args, synthetic_agentic(60, seed=3, scale=0.25)), 2)


@pytest.mark.slow
def test_independent_faults_give_identical_decisions_on_four_ranks(mooncake_master: Any) -> None:
    from hylinker.tools.stress.ranks import run_ranks
    from hylinker.tools.workloads import synthetic_agentic

    args = _stress_args(4, 80, mooncake_master.address)
    _check_faulty_ranks(run_ranks(args, synthetic_agentic(80, seed=4, scale=0.25)), 4)


def test_rank_disagreements_counts_requests_whose_prefix_differs() -> None:
    assert rank_disagreements([[("a", 64), ("b", 0)], [("a", 64), ("b", 0)]]) == 0
    assert rank_disagreements([[("a", 64), ("b", 0)], [("a", 128), ("b", 0)]]) == 1
    assert rank_disagreements([[("a", 64)], [("a", 64), ("c", 0)]]) == 1  # served on one rank only


# ---- agreement under decode-context parallelism (tp 4 x dcp 2) ----------------------------------

async def scenario_dcp(rank: int, size: int, agreement: Agreement, address: str, prefix: int) -> dict[str, Any]:
    from hylinker.tests.support.dcp import (
        DcpContent,
        dcp_prefill,
        dcp_prompt,
        dcp_restore,
        dcp_test_layout,
    )

    layout = dcp_test_layout(2, rank, tp=size, hybrid=True, replicated=("kv", "draft"))
    pools = HybridPools(layout, kv_pages=32, mamba_slots=8)
    content = DcpContent(pools)
    store = await MooncakeStore.open(MooncakeConfig(master_address=address, segment_bytes=16 << 20))
    out: dict[str, Any] = {}
    tokens = dcp_prompt(5 * layout.tree_page + 3, seed=prefix)  # restorable up to 5 tree pages
    try:
        async with Linker(layout, pools, store, LinkerConfig(resilience=None, staging_bytes_per_pool=1 << 16,
                                                        latency_high_ms=NO_LATENCY_DROPS[0], latency_low_ms=NO_LATENCY_DROPS[1]),
                          salt=f"dcp{prefix}", agreement=agreement) as lk:
            req = lk.request("donor", tokens)
            await lk.lookup(req)
            await lk.load(req)
            out["depth"] = await dcp_prefill(lk, content, req)
            out["bytes_offloaded"] = {k: v.bytes_offloaded for k, v in lk.pool_statistics().items()}
            out["verified_replicas"] = lk.statistics().offloads_verified_replicas
            out["stored_kinds"] = sorted({k.value for n in lk.tree.tree.nodes() for k in n.stored})
            out["restored"], out["problems"] = await dcp_restore(lk, content, tokens, "restore")
            await lk.drain()
            lk.check_idle()
            out["leaked"] = list(lk.leaked())
        lk.flush_device()
        pools.check_idle()
    finally:
        await store.close()
    return out


@pytest.mark.slow
def test_dcp_ranks_agree_and_replicated_kv_has_one_writer_per_dcp_rank(mooncake_master: Any) -> None:
    ranks = launch(4, scenario_dcp, mooncake_master.address, 11, timeout_s=60)
    for r, got in enumerate(ranks):
        writes_replicas = r < 2  # the first DCP group: one writer per DCP rank
        assert (got["bytes_offloaded"]["kv"] > 0) is writes_replicas, (r, got["bytes_offloaded"])
        assert (got["bytes_offloaded"]["draft"] > 0) is writes_replicas, (r, got["bytes_offloaded"])
        assert got["bytes_offloaded"]["mamba"] > 0  # every TP rank's own state shard
        assert (got["verified_replicas"] > 0) is not writes_replicas
        assert got["stored_kinds"] == ["draft", "kv", "mamba"]
        assert got["restored"] == got["depth"] > 0 and got["problems"] == [], (r, got)
        assert got["leaked"] == [0, 0]
