"""Device pools and their allocators.

* :class:`KVPool` — ``tensor[full_layer, row, *kv_row_shape]``; rows are token slots handed
  out a whole page at a time (rows ``p*P .. p*P+P-1`` of page ``p``).
* :class:`DraftPool` — ``tensor[draft_layer, row, *draft_row_shape]``, indexed by the same
  token rows as KV (it has no allocator of its own).
* :class:`MambaPool` — one *slot* holds every linear layer's conv and temporal state:
  ``conv[i][slot]`` and ``temporal[i][slot]`` for the ``i``-th layer of the layout.

Invariants the caller keeps: every index handed out is freed exactly once; freeing a free
index, or one out of range, raises :class:`PoolError` (that is how a double free shows up).
:meth:`HybridPools.check_idle` asserts every pool is whole again.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from .layout import ModelLayout, PoolKind
from .pool_view import PoolSet, PoolView, stacked_kv_view, state_view


class PoolError(RuntimeError):
    """Misuse of a pool: double free, out-of-range index, ragged pages."""


@attrs.frozen
class AllocatorStatistics:
    capacity: int
    free: int
    allocs: int
    frees: int
    failed_allocs: int


class SlotAllocator:
    """A free list over ``capacity`` indices with a bitmap that catches double frees."""

    def __init__(self, capacity: int, name: str) -> None:
        if capacity <= 0:
            raise PoolError(f"{name}: capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._free_list: list[int] = list(range(capacity - 1, -1, -1))
        self._is_free = np.ones(capacity, dtype=bool)
        self._allocs = self._frees = self._failed = 0

    @property
    def num_free(self) -> int:
        return len(self._free_list)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` distinct indices, or ``None`` (nothing taken) if fewer are free."""
        if n < 0:
            raise PoolError(f"{self.name}: cannot allocate {n} slots")
        if n > len(self._free_list):
            self._failed += 1
            return None
        out = [self._free_list.pop() for _ in range(n)]
        self._is_free[out] = False
        self._allocs += n
        return out

    def free(self, indices: list[int]) -> None:
        if not indices:
            return
        idx = np.asarray(indices, dtype=np.int64)
        if idx.min() < 0 or idx.max() >= self.capacity:
            raise PoolError(f"{self.name}: index out of range [0, {self.capacity}): {indices}")
        if len(np.unique(idx)) != len(idx) or self._is_free[idx].any():
            bad = [int(i) for i in idx if self._is_free[i]]
            raise PoolError(f"{self.name}: double free of {bad or 'repeated indices'}")
        self._is_free[idx] = True
        self._free_list.extend(int(i) for i in idx)
        self._frees += len(idx)

    def is_allocated(self, index: int) -> bool:
        return 0 <= index < self.capacity and not bool(self._is_free[index])

    def statistics(self) -> AllocatorStatistics:
        return AllocatorStatistics(self.capacity, self.num_free, self._allocs, self._frees, self._failed)


class KVPool:
    """Full-attention KV rows, allocated a page at a time.

    Under decode-context parallelism (``layout.dcp_size > 1``) a page is a *tree page* of
    ``dcp_size * page_size`` tokens and the rows handed out are its token slots
    (``p*W .. p*W+W-1``, ``W = layout.tree_page``); this rank holds every ``dcp_size``-th of
    them, in ``page_size`` tensor rows (:func:`dcp_fold` maps slots to rows). Without DCP slots
    and tensor rows coincide.

    For a state-only layout the tensor has no layers (zero bytes): the pool still hands out
    rows, which the tree uses as page accounting for the tokens it keys.
    """

    def __init__(self, layout: ModelLayout, capacity_pages: int, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        #: token slots per page (the tree page)
        self.page_size = layout.tree_page
        self.pages = SlotAllocator(capacity_pages, "kv pages")
        #: rows of this rank's tensor (``page_size`` kernel rows per page)
        self.capacity_rows = capacity_pages * layout.page_size
        self.tensor = torch.zeros(
            (len(layout.full_layers), self.capacity_rows, *layout.kv_row_shape),
            dtype=layout.kv_dtype, device=device)

    def alloc_rows(self, n_pages: int) -> torch.Tensor | None:
        """Rows of ``n_pages`` fresh pages (int64, page-major), or ``None`` if short."""
        pages = self.pages.alloc(n_pages)
        if pages is None:
            return None
        return rows_of_pages(pages, self.page_size)

    def free_rows(self, rows: torch.Tensor) -> None:
        self.pages.free(pages_of_rows(rows, self.page_size))

    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free


class DraftPool:
    """Draft-model KV rows; indexed by the KV pool's token rows."""

    def __init__(self, layout: ModelLayout, capacity_rows: int, device: torch.device | str = "cpu") -> None:
        if not layout.draft_layers or layout.draft_row_shape is None or layout.draft_dtype is None:
            raise PoolError("the layout has no draft layers")
        self.tensor = torch.zeros(
            (layout.draft_layers, capacity_rows, *layout.draft_row_shape),
            dtype=layout.draft_dtype, device=device)


class MambaPool:
    """Recurrent-state slots; one slot holds every linear layer's conv and temporal state."""

    def __init__(self, layout: ModelLayout, capacity_slots: int, device: torch.device | str = "cpu") -> None:
        if not layout.mamba_layers:
            raise PoolError("the layout has no mamba layers")
        self.slots = SlotAllocator(capacity_slots, "mamba slots")
        self.conv: list[torch.Tensor] = []
        self.temporal: list[torch.Tensor | None] = []
        for spec in layout.mamba_layers:
            self.conv.append(torch.zeros((capacity_slots, *spec.conv_shape), dtype=spec.conv_dtype, device=device))
            if spec.temporal_shape is not None and spec.temporal_dtype is not None:
                self.temporal.append(torch.zeros(
                    (capacity_slots, *spec.temporal_shape), dtype=spec.temporal_dtype, device=device))
            else:
                self.temporal.append(None)

    def tensors(self) -> list[torch.Tensor]:
        """Every per-layer state tensor in layout order (conv_0, temporal_0, conv_1, ...)."""
        out: list[torch.Tensor] = []
        for c, t in zip(self.conv, self.temporal):
            out.append(c)
            if t is not None:
                out.append(t)
        return out

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy-on-write: give slot ``dst`` the state of ``src``."""
        for t in self.tensors():
            t[dst].copy_(t[src])

    @property
    def num_free(self) -> int:
        return self.slots.num_free


class HybridPools:
    """The pools of one rank, built from a layout."""

    def __init__(
        self,
        layout: ModelLayout,
        *,
        kv_pages: int,
        mamba_slots: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout = layout
        self.kv = KVPool(layout, kv_pages, device)
        self.draft = DraftPool(layout, self.kv.capacity_rows, device) if layout.draft_layers else None
        if layout.is_hybrid and mamba_slots <= 0:
            raise PoolError("a hybrid layout needs mamba_slots > 0")
        self.mamba = MambaPool(layout, mamba_slots, device) if layout.is_hybrid else None

    def check_idle(self) -> None:
        """Raise :class:`PoolError` unless every row and slot is free."""
        problems = []
        if self.kv.pages.num_free != self.kv.pages.capacity:
            problems.append(f"kv: {self.kv.pages.capacity - self.kv.pages.num_free} pages in use")
        if self.mamba is not None and self.mamba.slots.num_free != self.mamba.slots.capacity:
            problems.append(f"mamba: {self.mamba.slots.capacity - self.mamba.slots.num_free} slots in use")
        if problems:
            raise PoolError("pools are not idle: " + "; ".join(problems))

    def views(self) -> PoolSet:
        """Views over these pools' own tensors: the same objects an engine's borrowed pools
        give (``components.pool_view``); the runtime moves data only through views."""
        views: list[PoolView] = []
        if not self.layout.state_only:  # a state-only layout's KV pool only counts pages
            views.append(stacked_kv_view(
                self.kv.tensor, layer_ids=self.layout.full_layers, page_size=self.layout.page_size))
        if self.mamba is not None:
            views.append(state_view([[c] for c in self.mamba.conv], list(self.mamba.temporal),
                                    layer_ids=[s.layer_id for s in self.layout.mamba_layers]))
        if self.draft is not None:
            views.append(stacked_kv_view(
                self.draft.tensor, layer_ids=self.layout.full_layers[: self.draft.tensor.shape[0]],
                page_size=self.layout.page_size, kind=PoolKind.DRAFT))
        pool_set = PoolSet(views)
        pool_set.check_layout(self.layout)
        return pool_set

    def pool_tensors(self, kind: PoolKind) -> list[torch.Tensor]:
        if kind is PoolKind.FULL:
            return [self.kv.tensor]
        if kind is PoolKind.DRAFT:
            if self.draft is None:
                raise PoolError("no draft pool")
            return [self.draft.tensor]
        if self.mamba is None:
            raise PoolError("no mamba pool")
        return self.mamba.tensors()


def rows_of_pages(pages: list[int], page_size: int) -> torch.Tensor:
    p = torch.from_numpy(np.asarray(pages, dtype=np.int64))
    return (p[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)).reshape(-1)


def pages_of_rows(rows: torch.Tensor, page_size: int) -> list[int]:
    """Inverse of :func:`rows_of_pages`; raises unless ``rows`` are whole, aligned pages."""
    if rows.numel() % page_size:
        raise PoolError(f"{rows.numel()} rows is not a whole number of {page_size}-row pages")
    r = rows.reshape(-1, page_size)
    first = r[:, 0]
    if bool((first % page_size).any()) or not torch.equal(
            r, first[:, None] + torch.arange(page_size, dtype=r.dtype)):
        raise PoolError("rows are not whole aligned pages")
    return (first // page_size).tolist()


def dcp_fold(indices: torch.Tensor, dcp_rank: int, dcp_size: int, page_size: int) -> torch.Tensor:
    """Rows this DCP rank holds of a run of token slots: ``indices[rank::size] // size``.

    Decode-context parallelism interleaves tokens over ``dcp_size`` ranks: token slot ``s`` of
    widened page ``p`` (``s`` in ``p*W .. p*W+W-1``, ``W = page_size * dcp_size``) lives on
    rank ``s % dcp_size`` at row ``s // dcp_size``, so widened page ``p`` is kernel page ``p``
    (rows ``p*page_size ..``) on every rank. ``indices`` must be whole, aligned widened pages
    (what the linker's rows are); the result is this rank's ``page_size`` rows per page, in
    order. The runtime folds KV and draft KV this way (``pool_rules.FoldedPages``), never a
    state.
    """
    if isinstance(dcp_size, bool) or isinstance(dcp_rank, bool) or dcp_size <= 0 or not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"bad dcp rank/size: {dcp_rank}/{dcp_size}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    widened = page_size * dcp_size
    if indices.dim() != 1:
        indices = indices.reshape(-1)
    if indices.numel() % widened:
        raise ValueError(
            f"dcp folding needs whole widened pages of {widened} tokens "
            f"(page_size={page_size} x dcp_size={dcp_size}); got {indices.numel()} indices")
    if indices.numel():
        pages = indices.reshape(-1, widened)
        first = pages[:, 0]
        if bool((first % widened).any()) or not torch.equal(
                pages, first[:, None] + torch.arange(widened, dtype=pages.dtype)):
            raise ValueError(f"dcp folding needs whole aligned widened pages of {widened} token slots")
    return indices[dcp_rank::dcp_size] // dcp_size
