"""Two real TP ranks (two processes, gloo on loopback) agree through SGLang's own MIN.

Each process runs ``hylinker.tests.support.sglang_ranks``: SGLang's ``UnifiedRadixCache`` with a gloo
TP group and the plugin on one shared Mooncake master. SGLang's scheduler path intersects the
ranks' restorable sets (``_sync_restorable_prefix``, a MIN all-reduce over the group) and
reduces load and offload results; the ranks lose different state objects (or one rank alone
loses one, or has one corrupt), so their own answers differ and only the common depth may be
taken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hylinker.tests.support.sglang_ranks import run_rank_processes


def _run_ranks(tmp_path: Path, master: str, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both ranks of ``hylinker.tests.support.sglang_ranks`` (``args`` added), each its own process."""
    r0, r1 = run_rank_processes(tmp_path, master, 2, *args, timeout_s=240)
    return r0, r1


def _both_restored(r0: dict[str, Any], r1: dict[str, Any], depth: int) -> None:
    """Both ranks took ``depth`` tokens from the store (SGLang's MIN), restored them byte for
    byte, agreed on a later request and leaked nothing."""
    for r in (r0, r1):
        s = r["served"]
        assert s["device_hit"] == 0 and s["store_hit"] == s["loaded"] == depth, r
        assert not s["aborted"] and s["restore_mismatches"] == [], r
        assert not r["again"]["aborted"] and r["again"]["restore_mismatches"] == [], r
        assert r["leaks"] == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}, r
    assert r0["again"] == r1["again"]


@pytest.mark.mooncake
@pytest.mark.slow
@pytest.mark.parametrize("core", ["python", "rust"])
def test_two_ranks_take_the_same_hit_through_sglangs_min(mooncake_master: Any, tmp_path: Path, core: str) -> None:
    r0, r1 = _run_ranks(tmp_path, mooncake_master.address, "--core", core)
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)  # the plugin read its rank from the group
    # MLA latent KV is one rank-replicated object (rank 0 writes it); states are per rank
    assert r0["kv_key"] == r1["kv_key"] and r0["state_key"] != r1["state_key"]
    assert r0["removed"] == r1["removed"] == 1
    # each rank alone: different sparse sets (a lost state each) ...
    assert r0["own_lookup"] == [24, 40] and r1["own_lookup"] == [24, 48]
    # ... SGLang's MIN keeps only the common depth, and both ranks restore it exactly
    _both_restored(r0, r1, 24)
    # rank 1 never writes the replicated KV; rank 0 does
    assert r1["stats"].get("objects_offloaded", 0) < r0["stats"]["objects_offloaded"]


@pytest.mark.mooncake
@pytest.mark.slow
def test_one_ranks_missing_state_both_take_the_common_depth(mooncake_master: Any, tmp_path: Path) -> None:
    r0, r1 = _run_ranks(tmp_path, mooncake_master.address, "--damage", "missing")
    assert r0["removed"] == 0 and r1["removed"] == 1
    # only rank 1 lost an object: its own answer stops short, rank 0's does not ...
    assert r0["own_lookup"] == [24, 40, 48] and r1["own_lookup"] == [24, 40]
    # ... SGLang's MIN takes 40 on both; neither aborts, both restore it byte for byte, no leak
    _both_restored(r0, r1, 40)
    assert r0["stats"].get("loads_failed", 0) == r1["stats"].get("loads_failed", 0) == 0


@pytest.mark.mooncake
@pytest.mark.slow
def test_one_ranks_corrupt_state_aborts_both_then_both_take_the_common_depth(
        mooncake_master: Any, tmp_path: Path) -> None:
    r0, r1 = _run_ranks(tmp_path, mooncake_master.address, "--damage", "corrupt")
    # the damaged object still exists: both ranks claim the deepest state, SGLang's MIN keeps it
    assert r0["own_lookup"] == r1["own_lookup"] == [24, 40, 48]
    for r in (r0, r1):
        # rank 1's load fails verification; SGLang's MIN over finish_layer_wise_loading aborts
        # the request on both ranks (neither runs on the other's restored rows alone)
        assert r["served"]["store_hit"] == 48 and r["served"]["aborted"], r
        # rank 1 removed the damaged state before failing: the retry agrees on 40, restored exactly
        retry = r["retry"]
        assert retry["store_hit"] == retry["loaded"] == 40 and not retry["aborted"], r
        assert retry["restore_mismatches"] == [], r
        assert r["leaks"] == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}, r
    assert r1["stats"]["bad_objects_removed"] == 1 and r0["stats"].get("bad_objects_removed", 0) == 0
