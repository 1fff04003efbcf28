"""Checkpoint admission and eviction policies: pure rules, the radix tree's order, and the Linker
using them end to end (a sibling prompt restores from the branch point the policy chose)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hylinker.components.admission import (
    BranchPoints,
    CheckpointPolicy,
    EndOfPrefill,
    EveryBoundary,
    Prefill,
    SpeculativeCheckpoints,
    checkpoint_policy,
    valid_depth,
)
from hylinker.components.eviction import FlopAwareEviction, LRUEviction, eviction_policy
from hylinker.components.keys import as_tokens, namespace_seed, page_keys
from hylinker.components.layout import MambaLayerSpec, ModelLayout
from hylinker.components.pools import HybridPools
from hylinker.components.radix import RadixTree
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import small_hybrid_layout

P, G, C = 4, 8, 8


def keys_of(pages: int, variant: int = 0, shared: int = 0) -> list[bytes]:
    toks = np.arange(pages * P) + 1
    toks[shared * P:] += 1000 * variant
    return page_keys(as_tokens(toks), P, b"s" * 16)


def prefill(prompt: int, prefix: int = 0, keys: list[bytes] | None = None) -> Prefill:
    keys = keys if keys is not None else keys_of(prompt // P)
    return Prefill(prefix, prompt, keys, P, G, C)


# ---- admission ---------------------------------------------------------------------------------


def test_end_of_prefill_and_the_resubmission_depth() -> None:
    assert EndOfPrefill().place(prefill(21)) == [16]
    # a prompt that ends on the grid also donates at L - G: resubmitted, it restores L - G
    assert EndOfPrefill().place(prefill(24)) == [16, 24]
    assert EndOfPrefill().place(prefill(24, prefix=16)) == [24]  # 16 is the prefix itself
    assert EndOfPrefill().place(prefill(7)) == []


def test_branch_points_find_where_a_prompt_leaves_earlier_ones() -> None:
    policy = BranchPoints()
    first = keys_of(10)
    assert policy.place(prefill(41, keys=first)) == [40]
    sibling = keys_of(10, variant=1, shared=5)  # shares 5 pages = 20 tokens with the first
    # branch point: 20 tokens, on the grid 16
    assert policy.place(prefill(41, keys=sibling)) == [16, 40]
    # the branch is already a cached prefix for the next one: nothing new at 16
    assert policy.place(prefill(41, prefix=16, keys=keys_of(10, variant=2, shared=5))) == [40]


def test_branch_points_donate_at_the_last_whole_block() -> None:
    policy = BranchPoints(block_tokens=16)
    # the state moves from inside the partial block (40) to the last whole block (32)
    assert policy.place(prefill(43, keys=keys_of(10))) == [32]
    # a prompt of whole blocks keeps its end, and the resubmission depth on the block grid
    assert BranchPoints(block_tokens=16).place(prefill(48, keys=keys_of(12))) == [32, 48]


def test_branch_point_memory_is_bounded() -> None:
    policy = BranchPoints(memory_pages=4)
    policy.place(prefill(41, keys=keys_of(10)))
    assert policy.shared_pages(keys_of(10)) == 0  # the first pages were forgotten
    with pytest.raises(ValueError):
        BranchPoints(memory_pages=0)


def test_speculative_states_stay_within_budget() -> None:
    policy = SpeculativeCheckpoints(EndOfPrefill(), every_tokens=16, max_extra=2)
    # 80 computed tokens: budget min(2, 80 // 16) = 2 extra states, the shallowest first
    assert policy.place(prefill(81, keys=keys_of(20))) == [16, 32, 80]
    # 24 computed tokens after a prefix of 56: one extra at most
    assert policy.place(prefill(81, prefix=56, keys=keys_of(20))) == [64, 80]
    # a short prefill gets no speculation
    assert policy.place(prefill(13, keys=keys_of(3))) == [8]


def test_every_boundary() -> None:
    assert EveryBoundary().place(prefill(33, prefix=8, keys=keys_of(8))) == [16, 24, 32]


@given(prompt=st.integers(1, 400), prefix_grids=st.integers(0, 50), shared=st.integers(0, 100),
       name=st.sampled_from(["end", "marconi", "speculative", "grid"]), block=st.sampled_from([0, 16, 24]))
def test_every_policy_returns_sorted_valid_depths(prompt: int, prefix_grids: int, shared: int,
                                                  name: str, block: int) -> None:
    prefix = min(prefix_grids * G, (prompt - 1) // G * G)
    policy = checkpoint_policy(name, block_tokens=block)
    assert isinstance(policy, CheckpointPolicy)
    policy.place(prefill(prompt, prefix, keys_of(prompt // P)))  # remember one prompt
    keys = keys_of(prompt // P, variant=1, shared=min(shared, prompt // P))
    depths = policy.place(prefill(prompt, prefix, keys))
    assert depths == sorted(set(depths))
    assert all(valid_depth(prefill(prompt, prefix, keys), d) for d in depths)
    end = set(EndOfPrefill().place(prefill(prompt, prefix, keys)))
    if block and name in ("marconi", "speculative"):
        # block-granular: ends inside the last partial block move to its start
        assert {d for d in end if d % block == 0} <= set(depths)
    else:
        assert end <= set(depths)  # every other policy donates at least the end of the prefill


def test_unknown_policy_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        checkpoint_policy("everywhere")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        eviction_policy("random")
    with pytest.raises(ValueError):
        Prefill(10, 5, [], P, G, C)


# ---- eviction ----------------------------------------------------------------------------------


def _tree(eviction: Any, kv_pages: int = 64) -> tuple[RadixTree, HybridPools, ModelLayout]:
    layout = ModelLayout.create(page_size=P, chunk_size=P, full_layers=[0], kv_row_shape=(2,),
                                kv_dtype="float32")
    pools = HybridPools(layout, kv_pages=kv_pages)
    return RadixTree(layout, pools, namespace_seed(layout), eviction), pools, layout


def _insert(tree: RadixTree, pools: HybridPools, keys: list[bytes]) -> None:
    rows = pools.kv.alloc_rows(len(keys))
    assert rows is not None
    tree.insert(keys, rows)


def test_lru_evicts_the_oldest_leaf_first() -> None:
    tree, pools, _ = _tree(LRUEviction())
    deep, short = keys_of(12, variant=1), keys_of(1, variant=2)
    _insert(tree, pools, deep)
    _insert(tree, pools, short)
    tree.evict_pages(1)
    assert tree.match(deep).pages == 0 and tree.match(short).pages == 1


def test_flop_aware_eviction_keeps_the_node_that_saves_more_compute_per_byte() -> None:
    """Same order of use as the LRU test, but the long deep prefix saves far more compute
    (attention grows with depth) per byte than the one-page leaf: the leaf goes first."""
    tree, pools, layout = _tree(FlopAwareEviction(alpha=4.0, attention_ratio=1.0))
    deep, short = keys_of(12, variant=1), keys_of(1, variant=2)
    _insert(tree, pools, deep)
    _insert(tree, pools, short)
    policy = tree.eviction
    assert isinstance(policy, FlopAwareEviction)
    nodes = {len(n.keys): n for n in tree.nodes()}
    assert policy.efficiency(nodes[12], layout) > policy.efficiency(nodes[1], layout)
    tree.evict_pages(1)
    assert tree.match(deep).pages == 12 and tree.match(short).pages == 0
    tree.check_consistent()


def test_flop_aware_eviction_with_alpha_zero_is_lru() -> None:
    tree, pools, _ = _tree(FlopAwareEviction(alpha=0.0))
    deep, short = keys_of(12, variant=1), keys_of(1, variant=2)
    _insert(tree, pools, deep)
    _insert(tree, pools, short)
    tree.evict_pages(1)
    assert tree.match(deep).pages == 0 and tree.match(short).pages == 1


def test_flop_aware_eviction_values_a_node_holding_nothing_at_nothing() -> None:
    """On a state-only layout a leaf without a state holds no bytes and saves no compute (a
    prefix resumes only from a state): it must not look like infinite value per byte."""
    layout = ModelLayout.create(page_size=P, chunk_size=P, full_layers=[],
                                mamba_layers=[MambaLayerSpec(0, (3, 8), torch.float32)])
    pools = HybridPools(layout, kv_pages=16, mamba_slots=2)
    policy = FlopAwareEviction(alpha=4.0)
    tree = RadixTree(layout, pools, namespace_seed(layout), policy)
    with_state, without = keys_of(2, variant=1), keys_of(6, variant=2)
    assert pools.mamba is not None
    slot = pools.mamba.slots.alloc(1)
    assert slot is not None
    _insert_with(tree, pools, with_state, slot[0])
    _insert_with(tree, pools, without, None)
    nodes = {len(n.keys): n for n in tree.nodes()}
    assert policy.efficiency(nodes[6], layout) == 0.0
    assert policy.efficiency(nodes[2], layout) > 0.0
    # the newer stateless leaf still goes first: what it holds cannot be resumed from
    tree.evict_pages(1)
    assert tree.match(without).pages == 0 and tree.match(with_state).pages == 2
    tree.check_consistent()


def _insert_with(tree: RadixTree, pools: HybridPools, keys: list[bytes], slot: int | None) -> None:
    rows = pools.kv.alloc_rows(len(keys))
    assert rows is not None
    tree.insert(keys, rows, mamba_slot=slot)


# ---- the Linker uses them ----------------------------------------------------------------------


async def _serve(lk: Linker, content: SyntheticContent, rid: str, tokens: np.ndarray) -> tuple[int, list[int]]:
    """One request; returns (cached tokens at lookup, depths donated)."""
    async with lk.session(rid, tokens) as req:
        hit = await lk.lookup(req)
        load = await lk.load(req)
        if load is not None:
            await lk.commit(load)
        keys = page_keys(req.tokens, lk.page, req.seed)
        rows = lk.extend(req, len(tokens))
        content.write_pages(keys[req.prefix_pages:len(tokens) // lk.page],
                            rows[req.prefix_tokens:len(tokens) // lk.page * lk.page])
        lk.working_slot(req)
        depths = lk.checkpoint_depths(req)
        for depth in depths:
            slot = lk.checkpoint_slot(req)
            content.write_state(keys[depth // lk.page - 1], slot)
            await lk.insert(req, depth, checkpoint_slot=slot)
        await lk.drain()
    return hit.total_tokens, depths


@pytest.mark.parametrize("flush", [False, True], ids=["device", "store"])
async def test_linker_donates_at_the_branch_point_and_a_sibling_restores_from_it(flush: bool) -> None:
    layout = small_hybrid_layout()  # page 4, grid 8
    pools = HybridPools(layout, kv_pages=64, mamba_slots=16)
    rng = np.random.default_rng(0)
    system = rng.integers(1, 30000, size=20).astype(np.int32)  # 20 shared tokens
    a = np.concatenate([system, rng.integers(1, 30000, size=21).astype(np.int32)])
    b = np.concatenate([system, rng.integers(1, 30000, size=9).astype(np.int32)])
    c = np.concatenate([system, rng.integers(1, 30000, size=13).astype(np.int32)])
    results: dict[str, tuple[int, list[int]]] = {}
    for name, policy in (("end", EndOfPrefill()), ("marconi", BranchPoints())):
        pools = HybridPools(layout, kv_pages=64, mamba_slots=16)
        async with Linker(layout, pools, EmbeddedStore(8 << 20), LinkerConfig(staging_bytes_per_pool=1 << 16),
                          checkpoints=policy) as lk:
            content = SyntheticContent(pools)
            await _serve(lk, content, "a", a)
            results[f"{name}-b"] = await _serve(lk, content, "b", b)
            if flush:
                lk.flush_device()
            results[f"{name}-c"] = await _serve(lk, content, "c", c)
            lk.check_idle()
    assert results["end-b"] == (0, [24])
    assert results["marconi-b"] == (0, [16, 24])  # b leaves a after 20 tokens: grid 16
    assert results["end-c"][0] == 0  # no state on the shared prefix: c recomputes it all
    assert results["marconi-c"][0] == 16  # restored (device or store) from b's branch point
