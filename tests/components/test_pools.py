"""Pools and allocators: alloc/free accounting, double frees, idle checks, page rows, DCP folding."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hylinker.components.layout import ModelLayout, PoolKind
from hylinker.components.pools import (
    DraftPool,
    HybridPools,
    KVPool,
    MambaPool,
    PoolError,
    SlotAllocator,
    dcp_fold,
    pages_of_rows,
    rows_of_pages,
)

P = 4


def layout(**over: Any) -> ModelLayout:
    kw: dict[str, Any] = {
        "page_size": P, "chunk_size": 8, "full_layers": [0, 2, 4], "kv_row_shape": (2, 3),
        "kv_dtype": "float32",
        "mamba_layers": [
            {"layer_id": 1, "conv_shape": (3, 5), "conv_dtype": "float32",
             "temporal_shape": (2, 4, 4), "temporal_dtype": "float32"},
            {"layer_id": 3, "conv_shape": (2, 5), "conv_dtype": "bfloat16"},  # conv only
            {"layer_id": 5, "conv_shape": (3, 5), "conv_dtype": "float16",
             "temporal_shape": (4,), "temporal_dtype": "bfloat16"},
        ],
        "draft_layers": 2, "draft_row_shape": (6,), "draft_dtype": "float16",
    }
    kw.update(over)
    return ModelLayout.create(**kw)


# ---- SlotAllocator -------------------------------------------------------------------
def test_alloc_and_free_accounting() -> None:
    a = SlotAllocator(8, "t")
    got = a.alloc(3)
    assert got is not None and len(set(got)) == 3 and all(0 <= i < 8 for i in got)
    assert a.num_free == 5 and all(a.is_allocated(i) for i in got)
    more = a.alloc(5)
    assert more is not None and set(got).isdisjoint(more) and set(got) | set(more) == set(range(8))
    assert a.num_free == 0
    a.free(got)
    a.free(more)
    s = a.statistics()
    assert (s.capacity, s.free, s.allocs, s.frees, s.failed_allocs) == (8, 8, 8, 8, 0)


def test_alloc_zero_and_free_nothing() -> None:
    a = SlotAllocator(2, "t")
    assert a.alloc(0) == []
    a.free([])
    assert a.num_free == 2


def test_failed_alloc_takes_nothing() -> None:
    a = SlotAllocator(4, "t")
    held = a.alloc(3)
    assert held is not None
    assert a.alloc(2) is None
    assert a.num_free == 1
    assert a.statistics().failed_allocs == 1
    assert a.alloc(1) is not None  # the one free index is still there


@pytest.mark.parametrize(("first", "second"), [
    ([1], [1]),  # plain double free
    ([1, 2], [2, 3]),  # one of a batch was already free
    ([], [0, 0]),  # the same index twice in one call
    ([], [5]),  # never allocated
], ids=["twice", "batch overlap", "repeated in call", "never allocated"])
def test_double_free_raises_and_changes_nothing(first: list[int], second: list[int]) -> None:
    a = SlotAllocator(8, "slots")
    assert a.alloc(4) == [0, 1, 2, 3]
    a.free(first)
    if first:
        with pytest.raises(PoolError, match="double free"):
            a.free(first)
    before = a.statistics()
    with pytest.raises(PoolError, match="double free"):
        a.free(second)
    assert a.statistics() == before
    # The allocator is not corrupted: every index comes out exactly once.
    rest = a.alloc(a.num_free)
    assert rest is not None and len(set(rest)) == len(rest) == 4 + len(first)


def test_failed_double_free_leaves_state_untouched() -> None:
    a = SlotAllocator(4, "slots")
    assert a.alloc(4) is not None
    a.free([2])
    with pytest.raises(PoolError):
        a.free([1, 2])  # 1 is allocated, 2 is free: the whole call is refused
    assert a.num_free == 1 and a.is_allocated(1) and not a.is_allocated(2)


@pytest.mark.parametrize("bad", [[-1], [8], [0, 100]])
def test_out_of_range_free_raises(bad: list[int]) -> None:
    a = SlotAllocator(8, "slots")
    assert a.alloc(8) is not None
    with pytest.raises(PoolError, match="out of range"):
        a.free(bad)
    assert a.num_free == 0


@pytest.mark.parametrize("cap", [0, -3])
def test_capacity_must_be_positive(cap: int) -> None:
    with pytest.raises(PoolError):
        SlotAllocator(cap, "t")


def test_negative_alloc_raises() -> None:
    with pytest.raises(PoolError):
        SlotAllocator(3, "t").alloc(-1)


def test_is_allocated_out_of_range_is_false() -> None:
    a = SlotAllocator(2, "t")
    assert a.alloc(2) is not None
    assert not a.is_allocated(-1) and not a.is_allocated(2)


# ---- page rows -----------------------------------------------------------------------
@pytest.mark.parametrize(("pages", "page_size", "rows"), [
    ([0], 4, [0, 1, 2, 3]),
    ([2], 4, [8, 9, 10, 11]),
    ([3, 1], 2, [6, 7, 2, 3]),
    ([5], 1, [5]),
    ([], 4, []),
])
def test_rows_of_pages_and_back(pages: list[int], page_size: int, rows: list[int]) -> None:
    r = rows_of_pages(pages, page_size)
    assert r.dtype == torch.int64 and r.tolist() == rows
    assert pages_of_rows(r, page_size) == pages


@pytest.mark.parametrize("rows", [
    [0, 1, 2],  # not a whole page
    [1, 2, 3, 4],  # not aligned
    [0, 1, 3, 2],  # not in order within the page
    [0, 1, 2, 3, 4, 5, 6, 8],  # second page ragged
    [4, 5, 6, 7, 0, 1, 2],  # ragged tail
], ids=["partial", "misaligned", "shuffled", "ragged second", "ragged tail"])
def test_ragged_rows_rejected(rows: list[int]) -> None:
    with pytest.raises(PoolError):
        pages_of_rows(torch.tensor(rows, dtype=torch.int64), 4)


def test_kv_pool_alloc_and_free() -> None:
    lay = layout()
    kv = KVPool(lay, 5)
    assert kv.tensor.shape == (3, 5 * P, 2, 3) and kv.tensor.dtype == torch.float32
    rows = kv.alloc_rows(2)
    assert rows is not None and rows.numel() == 2 * P
    assert kv.num_free_pages == 3
    assert len(set(pages_of_rows(rows, P))) == 2
    assert kv.alloc_rows(4) is None and kv.num_free_pages == 3
    kv.free_rows(rows)
    assert kv.num_free_pages == 5
    with pytest.raises(PoolError):
        kv.free_rows(rows)


# ---- DCP -----------------------------------------------------------------------------
@pytest.mark.parametrize(("indices", "rank", "size", "page", "expected"), [
    (list(range(16)), 1, 2, 8, list(range(8))),
    (list(range(16)), 0, 2, 8, [i // 2 for i in range(0, 16, 2)]),
    (list(range(16, 32)), 0, 2, 8, list(range(8, 16))),
    (list(range(16, 32)), 1, 2, 8, list(range(8, 16))),
    (list(range(8)), 3, 4, 2, [0, 1]),  # slots 3, 7 -> rows 0, 1
    (list(range(8)), 0, 1, 8, list(range(8))),  # no DCP: identity
])
def test_dcp_fold(indices: list[int], rank: int, size: int, page: int, expected: list[int]) -> None:
    got = dcp_fold(torch.tensor(indices), rank, size, page)
    assert got.tolist() == expected


def test_dcp_fold_rank_1_takes_odd_slots() -> None:
    slots = torch.arange(16)
    assert dcp_fold(slots, 1, 2, 8).tolist() == [s // 2 for s in range(1, 16, 2)]
    assert dcp_fold(slots, 0, 2, 8).tolist() == [s // 2 for s in range(0, 16, 2)]


@pytest.mark.parametrize(("n", "rank", "size", "page"), [
    (8, 0, 2, 8),  # half a widened page
    (24, 1, 2, 8),  # one and a half
    (10, 0, 3, 5),  # two thirds
])
def test_dcp_fold_needs_whole_widened_pages(n: int, rank: int, size: int, page: int) -> None:
    with pytest.raises(ValueError, match="widened"):
        dcp_fold(torch.arange(n), rank, size, page)


@pytest.mark.parametrize(("rank", "size"), [(2, 2), (-1, 2), (0, 0)])
def test_dcp_fold_bad_rank(rank: int, size: int) -> None:
    with pytest.raises(ValueError):
        dcp_fold(torch.arange(16), rank, size, 8)


# ---- MAMBA pool ----------------------------------------------------------------------
def _fill_distinct(pool: MambaPool) -> None:
    g = torch.Generator().manual_seed(0)
    for t in pool.tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def test_mamba_pool_shapes() -> None:
    lay = layout()
    pool = MambaPool(lay, 6)
    assert [c.shape for c in pool.conv] == [(6, 3, 5), (6, 2, 5), (6, 3, 5)]
    assert [None if t is None else t.shape for t in pool.temporal] == [(6, 2, 4, 4), None, (6, 4)]
    assert [t.dtype for t in pool.tensors()] == [
        torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]


@pytest.mark.parametrize(("src", "dst"), [(0, 5), (4, 1), (2, 3)])
def test_copy_slot_copies_every_layer(src: int, dst: int) -> None:
    pool = MambaPool(layout(), 6)
    _fill_distinct(pool)
    before = [t.clone() for t in pool.tensors()]
    pool.copy_slot(src, dst)
    tensors = pool.tensors()
    assert len(tensors) == 5  # 3 conv + 2 temporal
    for t, b in zip(tensors, before):
        assert torch.equal(t[dst], b[src])
        others = [i for i in range(6) if i != dst]
        assert torch.equal(t[others], b[others])
        assert not torch.equal(b[dst], b[src])  # the copy changed something


def test_pool_without_its_layers_raises() -> None:
    pure = layout(mamba_layers=[], draft_layers=0)
    with pytest.raises(PoolError):
        MambaPool(pure, 2)
    with pytest.raises(PoolError):
        DraftPool(pure, 8)


# ---- HybridPools ---------------------------------------------------------------------
def test_hybrid_pools_build_and_idle() -> None:
    pools = HybridPools(layout(), kv_pages=4, mamba_slots=3)
    assert pools.draft is not None and pools.mamba is not None
    assert pools.draft.tensor.shape == (2, 4 * P, 6) and pools.draft.tensor.dtype == torch.float16
    pools.check_idle()
    rows = pools.kv.alloc_rows(1)
    slots = pools.mamba.slots.alloc(2)
    assert rows is not None and slots is not None
    with pytest.raises(PoolError) as info:
        pools.check_idle()
    assert "kv: 1 pages in use" in str(info.value) and "mamba: 2 slots in use" in str(info.value)
    pools.kv.free_rows(rows)
    with pytest.raises(PoolError, match="mamba"):
        pools.check_idle()
    pools.mamba.slots.free(slots)
    pools.check_idle()


def test_hybrid_needs_mamba_slots() -> None:
    with pytest.raises(PoolError):
        HybridPools(layout(), kv_pages=4)


def test_pool_tensors() -> None:
    pools = HybridPools(layout(), kv_pages=2, mamba_slots=2)
    assert pools.pool_tensors(PoolKind.FULL)[0] is pools.kv.tensor
    assert pools.draft is not None and pools.pool_tensors(PoolKind.DRAFT)[0] is pools.draft.tensor
    assert len(pools.pool_tensors(PoolKind.MAMBA)) == 5
    pure = HybridPools(layout(mamba_layers=[], draft_layers=0), kv_pages=2)
    assert pure.mamba is None and pure.draft is None
    for kind in (PoolKind.MAMBA, PoolKind.DRAFT):
        with pytest.raises(PoolError):
            pure.pool_tensors(kind)
