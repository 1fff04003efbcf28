"""Radix tree: match/insert, ownership of rows and slots, splits, locks, eviction, consistency."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from hylinker.components.keys import as_tokens, namespace_seed, page_keys
from hylinker.components.layout import ModelLayout, PoolKind
from hylinker.components.pools import HybridPools, PoolError, pages_of_rows
from hylinker.components.radix import Node, RadixTree

P = 4  # page size
C = 8  # chunk: grid = 8 tokens = 2 pages
GRID_PAGES = 2


def make_layout(hybrid: bool) -> ModelLayout:
    kw: dict[str, Any] = {"page_size": P, "chunk_size": C, "full_layers": [0], "kv_row_shape": (2,),
                          "kv_dtype": "float32"}
    if hybrid:
        kw["mamba_layers"] = [{"layer_id": 1, "conv_shape": (2,), "conv_dtype": "float32",
                               "temporal_shape": (2,), "temporal_dtype": "float32"}]
    return ModelLayout.create(**kw)


class Env:
    """A tree with its pools, and what the test (the "caller") currently owns."""

    def __init__(self, hybrid: bool, kv_pages: int = 64, mamba_slots: int = 8) -> None:
        self.layout = make_layout(hybrid)
        self.pools = HybridPools(self.layout, kv_pages=kv_pages, mamba_slots=mamba_slots if hybrid else 0)
        self.seed = namespace_seed(self.layout)
        self.tree = RadixTree(self.layout, self.pools, self.seed)

    def keys(self, pages: int, variant: int = 0, shared: int = 0) -> list[bytes]:
        """Keys of ``pages`` pages; prompts of different variants share their first ``shared`` pages."""
        toks = np.arange(pages * P) + 1
        toks[shared * P:] += 1000 * variant
        return page_keys(as_tokens(toks), P, self.seed)

    def rows(self, pages: int) -> torch.Tensor:
        r = self.pools.kv.alloc_rows(pages)
        assert r is not None
        return r

    def slot(self) -> int:
        assert self.pools.mamba is not None
        s = self.pools.mamba.slots.alloc(1)
        assert s is not None
        return s[0]

    @property
    def kv_used(self) -> int:
        return self.pools.kv.pages.capacity - self.pools.kv.num_free_pages

    @property
    def slots_used(self) -> int:
        assert self.pools.mamba is not None
        return self.pools.mamba.slots.capacity - self.pools.mamba.num_free

    def insert(self, keys: list[bytes], slot: bool = False) -> Node:
        res = self.tree.insert(keys, self.rows(len(keys)), self.slot() if slot else None)
        return res.node

    def audit(self, held_pages: set[int] = frozenset(), held_slots: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Stronger than check_consistent: tree + caller hold exactly the allocated indices, once."""
        self.tree.check_consistent()
        tree_pages: list[int] = []
        tree_slots: list[int] = []
        for n in self.tree.nodes():
            tree_pages.extend(pages_of_rows(n.rows, P))
            if n.mamba_slot is not None:
                tree_slots.append(n.mamba_slot)
        assert len(tree_pages) == len(set(tree_pages)), "a page is held by two nodes"
        assert not set(tree_pages) & held_pages
        allocated = {i for i in range(self.pools.kv.pages.capacity) if self.pools.kv.pages.is_allocated(i)}
        assert allocated == set(tree_pages) | held_pages
        if self.pools.mamba is not None:
            assert len(tree_slots) == len(set(tree_slots)), "a slot is held by two nodes"
            alloc_slots = {i for i in range(self.pools.mamba.slots.capacity)
                           if self.pools.mamba.slots.is_allocated(i)}
            assert alloc_slots == set(tree_slots) | held_slots


# ---- match / insert ------------------------------------------------------------------
def test_pure_match_full_partial_and_miss() -> None:
    env = Env(hybrid=False)
    keys = env.keys(8)
    rows = env.rows(8)
    res = env.tree.insert(keys, rows)
    assert res.existing_pages == 0 and not res.mamba_exist and res.node.end_page == 8
    m = env.tree.match(keys)
    assert m.pages == 8 and m.node is res.node and torch.equal(m.rows, rows)
    assert env.tree.match(keys[:3]).pages == 3  # a prefix of a node: split
    other = env.keys(8, variant=1, shared=5)
    m = env.tree.match(other)
    assert m.pages == 5 and torch.equal(m.rows, rows[: 5 * P])
    assert env.tree.match(env.keys(4, variant=2)).pages == 0
    assert env.tree.match([]).pages == 0
    st = env.tree.statistics()
    assert st.splits == 2 and st.nodes == 3 and st.pages == 8
    env.audit()


def test_hybrid_match_stops_at_the_deepest_state() -> None:
    env = Env(hybrid=True)
    keys = env.keys(8)
    env.insert(keys, slot=True)  # state at page 8 only
    assert env.tree.match(keys).pages == 8
    assert env.tree.match(keys[:6]).pages == 0  # inside the node: no state there, no split
    assert env.tree.match(env.keys(8, variant=1, shared=5)).pages == 0
    assert env.tree.statistics().splits == 0
    env.tree.insert(keys[:4], env.rows(4), env.slot())  # a state at page 4 (on the grid)
    assert env.tree.match(keys[:6]).pages == 4
    assert env.tree.match(env.keys(8, variant=1, shared=5)).pages == 4
    assert env.tree.match(keys).pages == 8
    env.audit()


def test_hybrid_match_skips_stateless_nodes() -> None:
    env = Env(hybrid=True)
    keys = env.keys(8)
    env.insert(keys[:2], slot=True)
    env.insert(keys[:6])  # no state at 6
    env.insert(keys[:8])  # no state at 8
    m = env.tree.match(keys)
    assert m.pages == 2 and m.node.mamba_slot is not None
    env.audit()


def test_insert_adopts_only_new_pages_and_frees_duplicates_once() -> None:
    env = Env(hybrid=False, kv_pages=32)
    keys = env.keys(8)
    first = env.rows(4)
    env.tree.insert(keys[:4], first)
    assert env.kv_used == 4
    second = env.rows(8)
    assert env.kv_used == 12
    res = env.tree.insert(keys, second)
    assert res.existing_pages == 4
    assert env.kv_used == 8  # the caller's 4 duplicate pages went back, once
    assert torch.equal(env.tree.match(keys).rows, torch.cat([first, second[4 * P:]]))
    with pytest.raises(PoolError):  # already freed by the tree
        env.pools.kv.free_rows(second[: 4 * P])
    again = env.rows(8)
    res2 = env.tree.insert(keys, again)
    assert res2.existing_pages == 8 and res2.node is res.node
    assert env.kv_used == 8
    env.audit()


def test_insert_splits_at_a_shorter_prefix() -> None:
    env = Env(hybrid=False)
    keys = env.keys(8)
    tail = env.insert(keys)
    res = env.tree.insert(keys[:3], env.rows(3))
    assert res.existing_pages == 3 and res.node.end_page == 3
    assert tail.parent is res.node and tail.start_page == 3
    env.audit()


def test_insert_branches() -> None:
    env = Env(hybrid=False)
    a = env.insert(env.keys(6))
    b = env.insert(env.keys(6, variant=1, shared=2))
    assert a.parent is b.parent and a.parent is not None and a.parent.end_page == 2
    assert len(a.parent.children) == 2
    assert env.tree.statistics().pages == 10
    env.audit()


def test_insert_rows_must_match_pages() -> None:
    env = Env(hybrid=False)
    r = env.rows(2)
    with pytest.raises(ValueError):
        env.tree.insert(env.keys(3), r)
    assert env.tree.statistics().nodes == 0
    env.audit(held_pages=set(pages_of_rows(r, P)))


# ---- MAMBA ownership -----------------------------------------------------------------
def test_mamba_exist_frees_the_callers_slot_exactly_once() -> None:
    env = Env(hybrid=True, mamba_slots=4)
    keys = env.keys(4)
    s1 = env.slot()
    res1 = env.tree.insert(keys, env.rows(4), s1)
    assert not res1.mamba_exist and res1.node.mamba_slot == s1
    s2 = env.slot()
    assert env.slots_used == 2
    res2 = env.tree.insert(keys, env.rows(4), s2)
    assert res2.mamba_exist and res2.node is res1.node and res2.node.mamba_slot == s1
    assert env.slots_used == 1
    assert env.pools.mamba is not None
    with pytest.raises(PoolError, match="double free"):
        env.pools.mamba.slots.free([s2])
    env.audit()
    env.tree.reset()
    assert env.pools.mamba.num_free == env.pools.mamba.slots.capacity  # never one more
    st = env.pools.mamba.slots.statistics()
    assert st.allocs == st.frees == 2
    env.pools.check_idle()


def test_slot_on_an_existing_stateless_node_is_adopted() -> None:
    env = Env(hybrid=True)
    keys = env.keys(4)
    node = env.insert(keys)
    s = env.slot()
    res = env.tree.insert(keys, env.rows(4), s)
    assert res.node is node and node.mamba_slot == s and not res.mamba_exist
    env.audit()


@pytest.mark.parametrize("pages", [1, 3, 5])
def test_state_only_on_the_grid(pages: int) -> None:
    env = Env(hybrid=True)
    r, s = env.rows(pages), env.slot()
    with pytest.raises(ValueError, match="grid"):
        env.tree.insert(env.keys(pages), r, s)
    assert env.tree.statistics().nodes == 0
    env.audit(held_pages=set(pages_of_rows(r, P)), held_slots={s})  # the caller still owns both


def test_state_needs_pages_and_a_hybrid_layout() -> None:
    env = Env(hybrid=True)
    s = env.slot()
    with pytest.raises(ValueError):
        env.tree.insert([], torch.zeros(0, dtype=torch.int64), s)
    pure = Env(hybrid=False)
    with pytest.raises(ValueError, match="no mamba"):
        pure.tree.insert(pure.keys(2), pure.rows(2), 0)


# ---- splits --------------------------------------------------------------------------
def test_split_keeps_state_on_child_and_copies_full_draft_flags() -> None:
    env = Env(hybrid=True)
    keys = env.keys(8)
    node = env.insert(keys, slot=True)
    slot = node.mamba_slot
    node.stored = {PoolKind.FULL, PoolKind.DRAFT, PoolKind.MAMBA}
    node.pending = {PoolKind.FULL: 11, PoolKind.MAMBA: 12, PoolKind.DRAFT: 13}
    env.tree.lock(node)
    env.tree.lock(node)
    res = env.tree.insert(keys[:4], env.rows(4))
    head = res.node
    assert node.parent is head and head.end_page == 4 and node.start_page == 4
    assert node.mamba_slot == slot and head.mamba_slot is None
    assert head.stored == {PoolKind.FULL, PoolKind.DRAFT}
    assert head.pending == {PoolKind.FULL: 11, PoolKind.DRAFT: 13}
    assert node.stored == {PoolKind.FULL, PoolKind.DRAFT, PoolKind.MAMBA}
    assert node.pending == {PoolKind.FULL: 11, PoolKind.MAMBA: 12, PoolKind.DRAFT: 13}
    assert head.lock == node.lock == 2
    assert head.mamba_lock == 0 and node.mamba_lock == 2
    head.stored.add(PoolKind.MAMBA)  # the fragments' flag sets are independent objects
    assert node.stored is not head.stored and node.pending is not head.pending
    env.audit()
    # the evictor cannot take the locked fragments
    assert env.tree.evict_pages(100) == 0
    env.tree.unlock(node)
    env.tree.unlock(node)
    assert head.lock == node.lock == node.mamba_lock == 0
    env.audit()
    assert env.tree.evict_pages(100) == 8


def test_split_by_pure_match_keeps_lock_accounting() -> None:
    env = Env(hybrid=False)
    keys = env.keys(6)
    node = env.insert(keys)
    env.tree.lock(node)
    m = env.tree.match(keys[:2])
    head = m.node
    assert head is not node and node.parent is head
    assert head.lock == 1 and head.mamba_lock == 0
    env.tree.lock(head)
    assert head.lock == 2
    env.tree.unlock(node)
    assert head.lock == 1 and node.lock == 0
    assert env.tree.evict_pages(100) == 4  # the unlocked tail goes, the locked head stays
    assert env.tree.match(keys).pages == 2
    env.tree.unlock(head)
    env.tree.check_consistent()


# ---- locks ---------------------------------------------------------------------------
def test_lock_counts_reach_the_ancestors() -> None:
    env = Env(hybrid=False)
    keys = env.keys(6)
    env.insert(keys[:2])
    leaf = env.insert(keys)
    mid = leaf.parent
    assert mid is not None
    env.tree.lock(leaf)
    assert (leaf.lock, leaf.mamba_lock, mid.lock, mid.mamba_lock) == (1, 1, 1, 0)
    env.tree.unlock(leaf)
    assert (leaf.lock, mid.lock) == (0, 0)
    with pytest.raises(PoolError):
        env.tree.unlock(leaf)
    env.tree.lock(env.tree.root)  # root: no-op both ways
    env.tree.unlock(env.tree.root)
    assert env.tree.locked_nodes() == []


# ---- eviction ------------------------------------------------------------------------
def test_lru_eviction_skips_locked_leaves() -> None:
    env = Env(hybrid=False)
    x = env.insert(env.keys(3, variant=1))  # oldest
    y = env.insert(env.keys(3, variant=2))
    z = env.insert(env.keys(3, variant=3))  # newest
    env.tree.lock(x)
    assert env.tree.evict_pages(1) == 3
    assert y.parent is None and x.parent is env.tree.root and z.parent is env.tree.root
    assert env.tree.evict_pages(1) == 3
    assert z.parent is None and x.parent is env.tree.root
    assert env.tree.evict_pages(10) == 0  # only the locked leaf is left
    env.tree.unlock(x)
    assert env.tree.evict_pages(10) == 3
    assert env.kv_used == 0
    st = env.tree.statistics()
    assert st.evicted_pages == 9 and st.nodes == 0


def test_lru_order_follows_matches() -> None:
    env = Env(hybrid=False)
    a = env.insert(env.keys(2, variant=1))
    b = env.insert(env.keys(2, variant=2))
    env.tree.match(env.keys(2, variant=1))  # a is now the most recently used
    env.tree.evict_pages(1)
    assert b.parent is None and a.parent is not None


def test_eviction_climbs_to_parents_that_become_leaves() -> None:
    env = Env(hybrid=False)
    keys = env.keys(6)
    env.insert(keys[:2])
    env.insert(keys)
    other = env.insert(env.keys(2, variant=5))
    env.tree.match(env.keys(2, variant=5))  # newest
    assert env.tree.evict_pages(6) == 6  # tail (4) then its parent (2)
    assert other.parent is env.tree.root and env.tree.statistics().pages == 2
    env.audit()


def test_evict_states_frees_internal_states_and_removes_leaves() -> None:
    env = Env(hybrid=True, mamba_slots=4)
    keys = env.keys(8)
    inner = env.insert(keys[:4], slot=True)
    leaf = env.insert(keys, slot=True)
    assert leaf.parent is inner
    env.tree.lock(leaf)  # pages of both locked; only the leaf's state is locked
    assert env.tree.evict_states(4) == 1
    assert inner.mamba_slot is None and inner.parent is env.tree.root  # node kept, state gone
    assert leaf.mamba_slot is not None
    assert env.slots_used == 1 and env.kv_used == 8
    env.tree.unlock(leaf)
    assert env.tree.evict_states(4) == 1
    assert leaf.parent is None and env.slots_used == 0  # a leaf goes with its state
    assert env.kv_used == 4 and inner.parent is env.tree.root
    st = env.tree.statistics()
    assert st.evicted_states == 2 and st.states == 0
    env.audit()


def test_evict_states_lru_and_pending_offloads() -> None:
    env = Env(hybrid=True, mamba_slots=4)
    a = env.insert(env.keys(2, variant=1), slot=True)
    b = env.insert(env.keys(2, variant=2), slot=True)
    c = env.insert(env.keys(2, variant=3), slot=True)
    a.pending[PoolKind.MAMBA] = 7  # an offload is reading a's state
    assert env.tree.evict_states(1) == 1
    assert a.mamba_slot is not None and b.parent is None and c.mamba_slot is not None
    assert env.tree.evict_states(5) == 1
    assert c.parent is None and a.mamba_slot is not None
    a.pending.clear()
    assert env.tree.evict_states(5) == 1
    env.audit()
    env.pools.check_idle()


def test_evict_for_alloc() -> None:
    env = Env(hybrid=True, kv_pages=8, mamba_slots=2)
    a = env.insert(env.keys(4, variant=1), slot=True)
    env.insert(env.keys(4, variant=2), slot=True)
    assert env.pools.kv.num_free_pages == 0 and env.pools.mamba is not None
    assert env.tree.evict_for_alloc(PoolKind.FULL, 0)
    env.tree.lock(a)
    assert env.tree.evict_for_alloc(PoolKind.FULL, 4)
    assert env.pools.kv.num_free_pages == 4 and a.parent is not None
    assert not env.tree.evict_for_alloc(PoolKind.FULL, 5)  # a is locked
    assert not env.tree.evict_for_alloc(PoolKind.MAMBA, 2)
    assert env.pools.mamba.num_free == 1
    env.tree.unlock(a)
    assert env.tree.evict_for_alloc(PoolKind.MAMBA, 2)
    assert env.pools.mamba.num_free == 2
    with pytest.raises(ValueError):
        env.tree.evict_for_alloc(PoolKind.DRAFT, 1)
    pure = Env(hybrid=False)
    with pytest.raises(PoolError):
        pure.tree.evict_for_alloc(PoolKind.MAMBA, 1)
    env.audit()


def test_reset_refuses_when_locked() -> None:
    env = Env(hybrid=True)
    keys = env.keys(6)
    n = env.insert(keys[:2], slot=True)
    env.insert(keys, slot=True)
    env.tree.lock(n)
    before = env.tree.statistics()
    with pytest.raises(PoolError, match="locked"):
        env.tree.reset()
    assert env.tree.statistics() == before
    env.tree.unlock(n)
    env.tree.reset()
    assert env.tree.statistics().nodes == 0
    env.pools.check_idle()


# ---- owned_from ----------------------------------------------------------------------
def test_owned_from_frees_only_the_callers_duplicates() -> None:
    env = Env(hybrid=True, kv_pages=32)
    keys = env.keys(10)
    hit = env.insert(keys[:4], slot=True)
    env.tree.lock(hit)  # the caller's device hit: 4 pages
    m = env.tree.match(keys)
    assert m.pages == 4
    env.insert(keys[:8], slot=True)  # another request got there first
    assert env.kv_used == 8
    loaded = env.rows(6)  # the caller loaded pages 4..10 from the store
    s = env.slot()
    res = env.tree.insert(keys, torch.cat([m.rows, loaded]), s, owned_from=4)
    assert res.existing_pages == 8 and not res.mamba_exist
    assert res.node.end_page == 10 and res.node.mamba_slot == s
    assert env.kv_used == 10  # pages 4..8 of the caller went back; the tree's 0..4 did not
    assert torch.equal(env.tree.path_rows(res.node)[: 4 * P], m.rows)
    assert torch.equal(res.node.rows, loaded[4 * P:])
    env.tree.unlock(hit)
    env.audit()


def test_owned_from_equal_to_existing_frees_nothing() -> None:
    env = Env(hybrid=False)
    keys = env.keys(6)
    hit = env.insert(keys[:2])
    env.tree.lock(hit)
    m = env.tree.match(keys)
    new = env.rows(4)
    res = env.tree.insert(keys, torch.cat([m.rows, new]), owned_from=2)
    assert res.existing_pages == 2 and env.kv_used == 6
    env.tree.unlock(hit)
    env.audit()


def test_owned_from_beyond_the_tree_raises() -> None:
    env = Env(hybrid=False)
    keys = env.keys(6)
    env.insert(keys[:2])
    r = env.rows(6)
    with pytest.raises(PoolError, match="missing"):
        env.tree.insert(keys, r, owned_from=4)
    env.audit(held_pages=set(pages_of_rows(r, P)))


# ---- random operations ---------------------------------------------------------------
@pytest.mark.parametrize("hybrid", [False, True], ids=["pure", "hybrid"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_consistent_after_random_operations(hybrid: bool, seed: int) -> None:
    rng = random.Random(seed)
    env = Env(hybrid=hybrid, kv_pages=48, mamba_slots=6)
    locked: list[Node] = []
    exists = 0
    prompts = [env.keys(12, variant=v, shared=rng.choice([0, 2, 4, 6])) for v in range(6)]
    for _ in range(250):
        op = rng.random()
        keys = rng.choice(prompts)[: rng.randrange(1, 13)]
        if op < 0.45:
            n = len(keys)
            if not env.tree.evict_for_alloc(PoolKind.FULL, n):
                continue
            rows = env.rows(n)
            slot = None
            if (hybrid and n % GRID_PAGES == 0 and rng.random() < 0.7
                    and env.tree.evict_for_alloc(PoolKind.MAMBA, 1)):
                slot = env.slot()
            res = env.tree.insert(keys, rows, slot)
            assert res.node.end_page == n
            if slot is not None:
                assert res.node.mamba_slot is not None
                exists += res.mamba_exist
        elif op < 0.65:
            m = env.tree.match(keys)
            assert m.pages <= len(keys) and m.rows.numel() == m.pages * P
            assert env.tree.path_keys(m.node) == keys[: m.pages]
            if hybrid:
                assert m.pages == 0 or m.node.mamba_slot is not None
            if m.pages and rng.random() < 0.5:
                env.tree.lock(m.node)
                locked.append(m.node)
        elif op < 0.8 and locked:
            env.tree.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.9:
            env.tree.evict_pages(rng.randrange(1, 8))
        elif hybrid:
            env.tree.evict_states(rng.randrange(1, 3))
        env.audit()
        for held in locked:  # locked work is never evicted from under its owner
            assert held.path()[0].parent is env.tree.root
    st = env.tree.statistics()  # the run did exercise the interesting paths
    assert st.splits > 0 and st.evicted_pages > 0
    if hybrid:
        assert exists > 0 and st.evicted_states > 0
    while locked:
        env.tree.unlock(locked.pop())
    env.tree.reset()
    env.pools.check_idle()
