"""Decode-context parallelism (DCP) through the runtime: one linker per DCP rank, in one
process over one shared embedded store, and (slow) one process per DCP rank over a Mooncake
master (``hylinker.tests.support.dcp``).

A tree page is ``dcp_size`` kernel pages of ``P = 4`` rows: its ``W = 4 * dcp_size`` tokens are
interleaved over the ranks (token ``o`` of a page on rank ``o % dcp_size``), so each rank holds
``P`` rows of every page. The "engine" here writes each rank's share of a logical KV (a function
of the page key and the token's offset in the page, so every rank's bytes differ) at the rows
:func:`dcp_fold` names, as a DCP engine would; each rank stores and restores only those rows.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import pytest
import torch

from hylinker import dcp_fold
from hylinker.components.keys import page_keys
from hylinker.components.layout import LayoutError, MambaLayerSpec, ModelLayout, PoolKind
from hylinker.components.pool_rules import FoldedPages, pool_rules
from hylinker.components.pool_view import PoolSet, PoolViewError, stacked_kv_view
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker, Request, deployment_seed
from hylinker.stores import framing
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.fakes import GatedStore
from hylinker.tests.support.dcp import (
    DcpContent,
    dcp_prefill,
    dcp_prompt,
    dcp_restore,
    dcp_test_layout,
    logical_page,
)

prompt = dcp_prompt

P = 4  # kernel page: rows per rank per tree page
CHUNK = 8


def dcp_layout(dcp: int, rank: int, *, tp: int | None = None, hybrid: bool = False,
               replicated: Sequence[str] = ()) -> ModelLayout:
    return dcp_test_layout(dcp, rank, tp=tp, hybrid=hybrid, replicated=replicated, page_size=P,
                           chunk_size=CHUNK)


@attrs.define
class Rank:
    layout: ModelLayout
    pools: HybridPools
    store: GatedStore
    linker: Linker
    content: DcpContent

    @property
    def r(self) -> int:
        return self.layout.dcp_rank


@contextlib.asynccontextmanager
async def ranks(layouts: Sequence[ModelLayout], inner: EmbeddedStore, *, kv_pages: int = 32
                ) -> AsyncIterator[list[Rank]]:
    """One running linker per layout, each over its own recording view of ``inner``; every
    linker ends idle with nothing leaked."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for lay in layouts:
            pools = HybridPools(lay, kv_pages=kv_pages, mamba_slots=8 if lay.is_hybrid else 0)
            store = GatedStore(inner)
            linker = await stack.enter_async_context(
                Linker(lay, pools, store, LinkerConfig(staging_bytes_per_pool=1 << 16)))
            out.append(Rank(lay, pools, store, linker, DcpContent(pools)))
        yield out
        for rk in out:
            await rk.linker.drain()
            rk.linker.check_idle()
            assert rk.linker.leaked() == (0, 0)
    for rk in out:
        rk.linker.flush_device()
        rk.pools.check_idle()


async def look_up_nothing(rk: Rank, tokens: np.ndarray, rid: str) -> Request:
    req = rk.linker.request(rid, tokens)
    hit = await rk.linker.lookup(req)
    assert (hit.device_tokens, hit.store_tokens) == (0, 0)
    return req


async def prefill(rk: Rank, tokens: np.ndarray, rid: str, req: Request | None = None) -> int:
    """Lookup (nothing cached) unless ``req`` was looked up, forward, insert, release."""
    if req is None:
        req = await look_up_nothing(rk, tokens, rid)
    return await dcp_prefill(rk.linker, rk.content, req)


async def restore(rk: Rank, tokens: np.ndarray, rid: str, depth: int) -> None:
    """Flush, restore from the store: the restored rows hold this rank's share, every other
    row was not written, the state (hybrid) is this TP rank's."""
    restored, problems = await dcp_restore(rk.linker, rk.content, tokens, rid)
    assert (restored, problems) == (depth, [])


def put_keys(rk: Rank, kind: PoolKind) -> list[str]:
    return [k for k in rk.store.put_keys() if f":{kind.value}:" in k]


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
@pytest.mark.parametrize("dcp", [2, 4])
async def test_dcp_restore_exact_on_every_rank(dcp: int, hybrid: bool) -> None:
    inner = EmbeddedStore(8 << 20)
    layouts = [dcp_layout(dcp, r, hybrid=hybrid) for r in range(dcp)]
    W = P * dcp
    tokens = prompt(6 * W + 3)
    async with ranks(layouts, inner) as rks:
        assert {rk.linker.page for rk in rks} == {W}
        assert all(isinstance(rk.linker.rules[PoolKind.FULL], FoldedPages) for rk in rks)
        depths = {await prefill(rk, tokens, f"donor{rk.r}") for rk in rks}
        assert len(depths) == 1
        depth = depths.pop()
        pages = depth // W
        assert pages >= 4
        # every rank wrote one object per tree page of each token pool, under its own DCP rank
        seen: dict[PoolKind, set[str]] = {PoolKind.FULL: set(), PoolKind.DRAFT: set()}
        prefixes = set()
        for rk in rks:
            for kind in seen:
                keys = put_keys(rk, kind)
                assert len(keys) == pages
                assert all(k.endswith(f":{kind.value}:tp{rk.r}dcp{rk.r}") for k in keys)
                assert not seen[kind] & set(keys)
                seen[kind] |= set(keys)
                prefixes.add(tuple(k.split(":")[0] for k in keys))
            if hybrid:  # a state is per TP rank: each rank writes its own, with no DCP term
                states = put_keys(rk, PoolKind.MAMBA)
                assert len(states) == 1 and states[0].endswith(f":mamba:tp{rk.r}")
            stats = rk.linker.statistics()
            assert stats.offload_failures == 0 and stats.offloads == 1
        assert len(prefixes) == 1  # the same tree pages (page keys) on every rank
        # each object is one kernel page of this rank's rows, not the widened page
        per_object = layouts[0].payload_bytes(PoolKind.FULL)
        assert per_object == P * layouts[0].kv_row_bytes
        sizes = {(s.objects_offloaded, s.bytes_offloaded) for s in (rk.linker.actors[PoolKind.FULL].statistics() for rk in rks)}
        assert sizes == {(pages, pages * (framing.HEADER_BYTES + per_object))}
        for rk in rks:
            await restore(rk, tokens, f"restore{rk.r}", depth)
            assert rk.linker.statistics().dropped_loads == 0


async def test_dcp_ranks_hold_different_bytes_and_cannot_swap() -> None:
    """Rank 1 restoring rank 0's objects would be detected: their bytes differ, and rank 1
    reads only keys with its own DCP rank."""
    inner = EmbeddedStore(8 << 20)
    layouts = [dcp_layout(2, r) for r in range(2)]
    tokens = prompt(4 * 8 + 1, seed=3)
    async with ranks(layouts, inner) as rks:
        depth = await prefill(rks[0], tokens, "donor0")
        # rank 1 never wrote: it finds nothing, although rank 0's objects are there
        req = rks[1].linker.request("probe", tokens)
        hit = await rks[1].linker.lookup(req)
        assert hit.store_tokens == 0
        assert all(":kv:tp1dcp1" in k or ":draft:tp1dcp1" in k
                   for call in rks[1].store.keys["exists"] for k in call)
        await rks[1].linker.release(req)
        # the two ranks' shares of a page differ (the test would catch a swap)
        key = page_keys(tokens, 8, deployment_seed(layouts[0]), max_pages=1)[0]
        full = logical_page(key, 2, 8, (2, 4), 1)
        assert not torch.equal(full[:, 0::2], full[:, 1::2])
        await restore(rks[0], tokens, "restore0", depth)


async def test_dcp_replicated_kv_one_writer_per_dcp_rank() -> None:
    """MLA-style replicated KV with tp=4, dcp=2: TP ranks 0 and 1 write (DCP ranks 0 and 1);
    ranks 2 and 3 hold the same rows as 0 and 1, write nothing and verify the objects are
    there; all four restore exactly."""
    inner = EmbeddedStore(8 << 20)
    layouts = [dcp_layout(2, r, tp=4, replicated=["kv", "draft"]) for r in range(4)]
    assert [lay.writes(PoolKind.FULL) for lay in layouts] == [True, True, False, False]
    assert [lay.rank_term(PoolKind.FULL) for lay in layouts] == ["repdcp0", "repdcp1"] * 2
    tokens = prompt(5 * 8 + 2, seed=5)
    async with ranks(layouts, inner) as rks:
        # every rank looks up before any writes (as ranks that agree on one step do), then the
        # writers prefill first, so the other ranks find the objects when they verify
        reqs = [await look_up_nothing(rk, tokens, f"donor{rk.layout.tp_rank}") for rk in rks]
        depths = {await prefill(rk, tokens, "", req) for rk, req in zip(rks, reqs)}
        depth = depths.pop()
        assert not depths
        for rk in rks:
            n = len(put_keys(rk, PoolKind.FULL))
            assert n == (depth // 8 if rk.layout.tp_rank < 2 else 0)
            if rk.layout.tp_rank >= 2:
                assert rk.linker.statistics().offloads_verified_replicas > 0
        for rk in rks:
            await restore(rk, tokens, f"restore{rk.layout.tp_rank}", depth)


async def test_one_ranks_missing_shard_shortens_only_that_ranks_hit() -> None:
    """Without agreement across ranks (not built here) each rank decides on its own objects:
    rank 1 missing page 3 restores 3 pages exactly, rank 0 all of them; nothing leaks."""
    inner = EmbeddedStore(8 << 20)
    layouts = [dcp_layout(2, r) for r in range(2)]
    tokens = prompt(6 * 8 + 3, seed=11)
    async with ranks(layouts, inner) as rks:
        depth = {await prefill(rk, tokens, f"donor{rk.r}") for rk in rks}.pop()
        missing = [k for k in put_keys(rks[1], PoolKind.FULL)
                   if k.startswith(page_keys(tokens, 8, deployment_seed(layouts[1]))[3].hex())]
        assert len(missing) == 1 and await inner.remove(missing) == 1
        await restore(rks[0], tokens, "restore0", depth)
        await restore(rks[1], tokens, "restore1", 3 * 8)


async def test_layout_of_another_dcp_size_shares_nothing() -> None:
    """Objects written under dcp_size 2 are invisible to dcp_size 4 ranks (the fingerprint,
    hence every page key, includes the DCP size): no rank restores bytes of another geometry."""
    inner = EmbeddedStore(8 << 20)
    tokens = prompt(4 * 16, seed=9)
    async with ranks([dcp_layout(2, 0)], inner) as two:
        await prefill(two[0], tokens, "donor")
    async with ranks([dcp_layout(4, 0)], inner) as four:
        req = four[0].linker.request("probe", tokens)
        assert (await four[0].linker.lookup(req)).store_tokens == 0
        await four[0].linker.release(req)


# ---- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize(("over", "match"), [
    ({"dcp_size": 2, "dcp_rank": 2, "tp_size": 2, "tp_rank": 0}, "dcp_rank must lie"),
    ({"dcp_size": 0}, "dcp_size"),
    ({"dcp_size": 3, "dcp_rank": 0, "tp_size": 4, "tp_rank": 0}, "must divide tp_size"),
    ({"dcp_size": 2, "dcp_rank": 1, "tp_size": 4, "tp_rank": 2}, "tp_rank % dcp_size"),
    ({"dcp_size": 2, "dcp_rank": 0, "tp_size": 2, "tp_rank": 0, "page_size": 96, "chunk_size": 160,
      "mamba_layers": [MambaLayerSpec(0, (3, 8), torch.float32)]}, "grid"),
])
def test_bad_dcp_layouts(over: dict[str, Any], match: str) -> None:
    kw: dict[str, Any] = {"page_size": P, "chunk_size": CHUNK, "full_layers": [1], "kv_row_shape": [8]}
    kw.update(over)
    with pytest.raises(LayoutError, match=match):
        ModelLayout.create(**kw)


@pytest.mark.parametrize("slots", [
    torch.arange(4),  # half a widened page
    torch.arange(8) + 4,  # a whole page's worth, not aligned to a widened page
    torch.tensor([0, 1, 2, 3, 4, 5, 7, 6]),  # aligned, out of order
], ids=["partial", "unaligned", "shuffled"])
def test_folded_rule_refuses_what_is_not_whole_widened_pages(slots: torch.Tensor) -> None:
    rule = pool_rules(dcp_layout(2, 1))[PoolKind.FULL]
    with pytest.raises(ValueError, match=r"widened|token slots"):
        rule.load_objects([b"k" * 16], slots, [])


def test_folded_rule_rows_are_the_ranks_tokens() -> None:
    for r in range(4):
        rule = pool_rules(dcp_layout(4, r))[PoolKind.FULL]
        _, index = rule.load_objects([b"a" * 16, b"b" * 16], torch.arange(32, 64), [])
        assert index.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]  # pages 2 and 3, P rows each
        assert dcp_fold(torch.arange(32, 48), r, 4, P).tolist() == [(32 + r + 4 * i) // 4 for i in range(4)]
    assert not isinstance(pool_rules(dcp_layout(4, 0, hybrid=True))[PoolKind.MAMBA], FoldedPages)
    assert not isinstance(pool_rules(dcp_layout(1, 0))[PoolKind.FULL], FoldedPages)


async def test_insert_of_a_partial_widened_page_is_refused() -> None:
    inner = EmbeddedStore(8 << 20)
    async with ranks([dcp_layout(2, 0)], inner) as (rk,):
        req = rk.linker.request("r", prompt(20))
        await rk.linker.lookup(req)
        rk.linker.extend(req, 20)
        with pytest.raises(ValueError, match=r"whole pages.*multiple of 8"):
            await rk.linker.insert(req, 12)  # three kernel pages: one and a half tree pages
        await rk.linker.release(req)


def test_pools_and_views_must_match_the_dcp_layout() -> None:
    lay = dcp_layout(2, 1)
    pools = HybridPools(lay, kv_pages=4)
    assert pools.kv.capacity_rows == 4 * P  # this rank's rows: one kernel page per tree page
    assert pools.kv.alloc_rows(1) is not None and pools.kv.num_free_pages == 3
    with pytest.raises(ValueError, match="another layout"):
        Linker(dcp_layout(2, 0), pools, EmbeddedStore(1 << 20))
    assert pools.draft is not None
    # an engine's views that take a tree page for a kernel page are refused (each object is
    # this rank's page_size rows of a tree page)
    wide = [stacked_kv_view(pools.kv.tensor, layer_ids=list(lay.full_layers), page_size=lay.tree_page),
            stacked_kv_view(pools.draft.tensor, layer_ids=[1], page_size=lay.tree_page, kind=PoolKind.DRAFT)]
    with pytest.raises(PoolViewError, match="bytes per object"):
        PoolSet(wide).check_layout(lay)
    pools.views().check_layout(lay)


@pytest.mark.parametrize(("tp_rank", "pool", "replicated", "writes", "term"), [
    (1, PoolKind.FULL, [], True, "tp1dcp1"),
    (2, PoolKind.FULL, ["kv"], False, "repdcp0"),
    (1, PoolKind.FULL, ["kv"], True, "repdcp1"),
    (1, PoolKind.MAMBA, [], True, "tp1"),  # a state: every rank its own shard, no DCP term
    (1, PoolKind.MAMBA, ["mamba"], False, "rep"),  # a replicated state: TP rank 0 only
    (0, PoolKind.MAMBA, ["mamba"], True, "rep"),
])
def test_who_writes_under_dcp(tp_rank: int, pool: PoolKind, replicated: list[str], writes: bool,
                              term: str) -> None:
    lay = dcp_layout(2, tp_rank, tp=4, hybrid=True, replicated=replicated)
    assert lay.writes(pool) is writes
    assert lay.rank_term(pool) == term


# ---- real processes ---------------------------------------------------------------------------

def _run_ranks(master: str, dcp: int, phase: str, salt: str, hybrid: bool) -> list[dict[str, Any]]:
    """One process per DCP rank, all at once; each prints one JSON line."""
    cmd = [sys.executable, "-m", "hylinker.tests.support.dcp", "--master", master, "--dcp", str(dcp),
           "--phase", phase, "--salt", salt, "--tokens", str(6 * P * dcp + 3), *(["--hybrid"] if hybrid else [])]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(dcp)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.parametrize(("dcp", "hybrid"), [(2, True), (4, False)], ids=["dcp2-hybrid", "dcp4-attention"])
async def test_dcp_ranks_in_real_processes(dcp: int, hybrid: bool, mooncake_master: Any,
                                           mooncake_store: Any) -> None:
    """Each DCP rank in its own process on a Mooncake client (the objects live in this test's
    segment): one set of processes offloads, a fresh set restores and checks every row."""
    salt = uuid.uuid4().hex
    offloaded = await anyio.to_thread.run_sync(_run_ranks, mooncake_master.address, dcp, "offload", salt, hybrid)
    depths = {o["depth"] for o in offloaded}
    assert len(depths) == 1
    depth = depths.pop()
    assert depth >= 4 * P * dcp
    keys: set[str] = set()
    for o in offloaded:
        r = o["rank"]
        assert (o["store_hit"], o["offload_failures"], o["leaked"]) == (0, 0, [0, 0])
        kv = [k for k in o["puts"] if ":kv:" in k]
        assert len(kv) == depth // (P * dcp) and all(k.endswith(f":kv:tp{r}dcp{r}") for k in kv)
        if hybrid:
            states = [k for k in o["puts"] if ":mamba:" in k]
            assert len(states) == 1 and states[0].endswith(f":mamba:tp{r}")
        assert not keys & set(o["puts"])
        keys |= set(o["puts"])
    assert all(await mooncake_store.exists(sorted(keys)))
    restored = await anyio.to_thread.run_sync(_run_ranks, mooncake_master.address, dcp, "restore", salt, hybrid)
    for o in restored:
        assert (o["restored"], o["problems"], o["leaked"], o["puts"]) == (depth, [], [0, 0], [])
