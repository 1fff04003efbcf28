"""DCP ranks as SGLang runs them: each DCP rank its own process, SGLang's own MIN over ranks.

Each process runs ``hylinker.tests.support.sglang_ranks --dcp N``: TP rank r is DCP rank r (tp = dcp),
``get_parallel()`` publishes that rank's DCP size and rank, SGLang's paged allocator hands out
widened pages, and SGLang's ``UnifiedRadixCache`` reduces lookups (a MIN all-reduce of a 0/1
mask) and load results over a gloo TP group; every rank's plugin uses one Mooncake master. Each
rank restores only its own rows, checked byte for byte at the rows SGLang's
``KVIndexTranslator`` names. Then one rank's KV object is missing, or damaged: every rank takes
the same count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hylinker.tests.support.sglang_ranks import (
    DCP_A,
    DCP_B,
    DCP_C,
    DCP_D,
    DCP_LOST_TOKEN,
    run_rank_processes,
)

pytestmark = [pytest.mark.mooncake, pytest.mark.slow]
GROUPS = pytest.mark.parametrize("group", ["full-mamba-mla", "dense-mha"])
PROMPT = len(DCP_A + DCP_B + DCP_C)  # 192 tokens, Mamba states at 64, 128 and 192
NO_LEAK = {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}


def _ranks(tmp_path: Path, master: str, dcp: int, group: str, damage: str, core: str = "python") -> list[dict[str, Any]]:
    ranks = run_rank_processes(tmp_path, master, dcp, "--dcp", str(dcp), "--group", group, "--damage", damage,
                               "--core", core, timeout_s=420)
    W = 2 * dcp
    for rank, r in enumerate(ranks):
        # the plugin read its TP rank from the group and its DCP rank from get_parallel()
        assert r["tp_rank"] == rank and r["dcp"] == [dcp, rank], r
        assert r["tree_page"] == r["allocator_page"] == W  # SGLang's widened page is the tree's
        assert all(k.endswith(f"dcp{rank}cp0pp0") for k in r["kv_keys"])
        for first in r["first"]:
            assert first["store_hit"] == 0 and not first["aborted"], r
    # keys per DCP rank: the same page keys, disjoint objects, each rank's own tokens (bytes differ)
    assert len({k for r in ranks for k in r["kv_keys"]}) == dcp * PROMPT // W
    objects = [r["first_object"] for r in ranks]
    assert None not in objects and len(set(objects)) == dcp
    return ranks


def _restorable(group: str, W: int, upto: int) -> list[int]:
    """The depths (tokens) a rank holding every KV page below ``upto`` can restore: every page
    for dense KV, only the Mamba checkpoints (every 64 tokens) for the hybrid group."""
    step = W if group == "dense-mha" else 64
    return list(range(step, upto + 1, step))


def _all_restored(ranks: list[dict[str, Any]], depth: int, served: str = "served") -> None:
    for r in ranks:
        s = r[served]
        assert s["device_hit"] == 0 and s["store_hit"] == s["loaded"] == depth, r
        assert not s["aborted"] and s["restore_mismatches"] == [], r
        assert not r["again"]["aborted"] and r["again"]["restore_mismatches"] == [], r
        assert r["leaks"] == NO_LEAK, r
    assert all(r["again"] == ranks[0]["again"] for r in ranks)


@pytest.mark.parametrize(("group", "core"), [("full-mamba-mla", "python"), ("dense-mha", "rust")])
def test_dcp_rank_processes_restore_their_own_rows(mooncake_master: Any, tmp_path: Path, group: str,
                                                   core: str) -> None:
    ranks = _ranks(tmp_path, mooncake_master.address, 2, group, "none", core)
    for r in ranks:
        assert r["own_lookup"] == _restorable(group, 4, PROMPT), r
        stats = r["stats"]
        # each rank wrote one object of its own rows per tree page (dense: the restored request's
        # whole pages of D too; hybrid: the pages below the checkpoints and three states), and
        # nothing twice (the restored pages are not written again)
        pages = (PROMPT + len(DCP_D)) // 4 if group == "dense-mha" else PROMPT // 4 + 3
        assert stats["objects_offloaded"] == pages, r
        # the restore, and the later request when SGLang reloads its prefix from the store
        assert stats["loads_ok"] == 1 + (r["again"]["loaded"] > 0) and stats.get("verify_failures", 0) == 0, r
    _all_restored(ranks, PROMPT)


@GROUPS
def test_one_dcp_ranks_missing_object_every_rank_takes_the_min(mooncake_master: Any, tmp_path: Path,
                                                               group: str) -> None:
    r0, r1 = ranks = _ranks(tmp_path, mooncake_master.address, 2, group, "missing")
    assert r0["removed"] == 0 and r1["removed"] == 1
    lost = DCP_LOST_TOKEN // 4 * 4  # the first token of the lost page
    # rank 1 alone misses one of its own KV pages: its own answer stops below it, rank 0's does not
    assert r0["own_lookup"] == _restorable(group, 4, PROMPT)
    assert r1["own_lookup"] == _restorable(group, 4, lost)
    # SGLang's MIN takes the deepest depth both can restore; neither aborts; exact; no leak
    _all_restored(ranks, max(_restorable(group, 4, lost)))
    assert all(r["stats"].get("loads_failed", 0) == 0 for r in ranks)


@GROUPS
def test_one_dcp_ranks_corrupt_object_aborts_every_rank_then_the_min(mooncake_master: Any, tmp_path: Path,
                                                                     group: str) -> None:
    r0, r1 = ranks = _ranks(tmp_path, mooncake_master.address, 2, group, "corrupt")
    # the damaged object still exists: every rank claims the whole prompt, SGLang's MIN keeps it
    for r in ranks:
        assert r["own_lookup"] == _restorable(group, 4, PROMPT), r
        # rank 1's load fails verification; SGLang's MIN over finish_layer_wise_loading aborts
        # the request on every rank (none runs on rows restored on the others alone)
        assert r["served"]["store_hit"] == PROMPT and r["served"]["aborted"], r
    # rank 1 removed the damaged object before failing: the retry restores the common depth
    _all_restored(ranks, max(_restorable(group, 4, DCP_LOST_TOKEN // 4 * 4)), served="retry")
    assert r1["stats"]["bad_objects_removed"] == 1 and r0["stats"].get("bad_objects_removed", 0) == 0


def test_four_dcp_rank_processes_take_the_min(mooncake_master: Any, tmp_path: Path) -> None:
    # dcp 4 (tree page 8), dense MHA: rank 1 misses one page; all four restore the same depth
    ranks = _ranks(tmp_path, mooncake_master.address, 4, "dense-mha", "missing")
    lost = DCP_LOST_TOKEN // 8 * 8
    for rank, r in enumerate(ranks):
        assert r["own_lookup"] == _restorable("dense-mha", 8, lost if rank == 1 else PROMPT), r
    _all_restored(ranks, lost)
