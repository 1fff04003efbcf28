"""Per-pool rules: what each pool stores for a node and at a boundary, and how its objects
are named and indexed. One small object per rule kind instead of ``if pool is MAMBA`` branches.

* :class:`AllPages` (FULL, DRAFT): every page of a run has its own object (ALL_PAGES); a
  node's objects are its pages, indexed by the page's KV rows.
* :class:`TrailingState` (MAMBA): one state object, at the end of a run that has a state
  (TRAILING_PAGES), keyed by the run's last page and indexed by the state slot; a store probe
  asks for it only at grid boundaries.

* :class:`FoldedPages` (FULL, DRAFT under decode-context parallelism): like
  :class:`AllPages`, but a tree page's token slots are folded to the ``page_size`` rows this
  DCP rank holds (:func:`~hylinker.components.pools.dcp_fold`); the object is this rank's share
  of the page, under a key with its DCP rank.

Replicated vs sharded is the layout's (``ModelLayout.writes`` / ``rank_term``), read through
:attr:`PoolRule.writes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .keys import object_key, object_keys
from .layout import ModelLayout, PoolKind
from .pools import dcp_fold
from .radix import Node


class PoolRule:
    """The rules of one pool. Subclasses answer each question for their kind."""

    def __init__(self, kind: PoolKind, layout: ModelLayout) -> None:
        self.kind = kind
        self.layout = layout

    @property
    def writes(self) -> bool:
        """Whether this rank writes the pool (only the owner rank writes a replicated pool)."""
        return self.layout.writes(self.kind)

    def holds(self, node: Node) -> bool:
        """Whether ``node`` has data of this pool to store."""
        raise NotImplementedError

    def pages(self, node: Node) -> Sequence[int]:
        """Absolute pages whose objects hold ``node``'s data of this pool."""
        raise NotImplementedError

    def probe_positions(self, first_page: int, n_pages: int, grid_pages: int) -> list[int]:
        """Which of ``n_pages`` tail pages (starting at absolute ``first_page``) need an object."""
        raise NotImplementedError

    def node_objects(self, nodes: Sequence[Node]) -> tuple[list[str], torch.Tensor]:
        """Object keys and indices (rows or slots) of ``nodes``' data, in order."""
        raise NotImplementedError

    def load_objects(self, keys: Sequence[bytes], rows: torch.Tensor, states: Sequence[tuple[int, int]]
                     ) -> tuple[list[str], torch.Tensor]:
        """Object keys and indices for restoring the pages ``keys`` into ``rows``, and the
        states ``(pages, slot)`` a load reads (the deepest last; shallower ones are fallbacks)."""
        raise NotImplementedError

    def touch_names(self, path_keys: Sequence[bytes], node: Node) -> list[str]:
        """Object keys that keep ``node``'s path restorable (TOUCH)."""
        raise NotImplementedError

    def stored_names(self, nodes: Sequence[Node]) -> list[str]:
        """Object keys of this pool's data that ``nodes`` hold in the store, in path order."""
        raise NotImplementedError

    def stored_by_commit(self, adopted_pages: bool, adopted_state: bool) -> bool:
        """Whether a COMMIT that adopted pages / a state from the store leaves this pool stored."""
        raise NotImplementedError


class AllPages(PoolRule):
    """FULL and DRAFT: one object per page, on the KV rows."""

    def holds(self, node: Node) -> bool:
        return True

    def pages(self, node: Node) -> Sequence[int]:
        return range(node.start_page, node.end_page)

    def probe_positions(self, first_page: int, n_pages: int, grid_pages: int) -> list[int]:
        return list(range(n_pages))

    def page_rows(self, slots: torch.Tensor, n_pages: int) -> torch.Tensor:
        """The tensor rows of ``n_pages`` pages' token slots, ``[n_pages, page_size]``."""
        return slots.reshape(n_pages, self.layout.page_size)

    def node_objects(self, nodes: Sequence[Node]) -> tuple[list[str], torch.Tensor]:
        keys = [k for n in nodes for k in n.keys]
        names = object_keys(keys, self.kind, self.layout)
        return names, self.page_rows(torch.cat([n.rows for n in nodes]), len(keys))

    def load_objects(self, keys: Sequence[bytes], rows: torch.Tensor, states: Sequence[tuple[int, int]]
                     ) -> tuple[list[str], torch.Tensor]:
        return object_keys(list(keys), self.kind, self.layout), self.page_rows(rows, len(keys))

    def touch_names(self, path_keys: Sequence[bytes], node: Node) -> list[str]:
        return object_keys(list(path_keys), self.kind, self.layout)

    def stored_names(self, nodes: Sequence[Node]) -> list[str]:
        return object_keys([k for n in nodes if self.kind in n.stored for k in n.keys], self.kind, self.layout)

    def stored_by_commit(self, adopted_pages: bool, adopted_state: bool) -> bool:
        return adopted_pages


class FoldedPages(AllPages):
    """FULL and DRAFT under DCP: a tree page holds ``dcp_size * page_size`` token slots; this
    rank stores and restores only the ``page_size`` rows it holds of them (``dcp_fold``), one
    object per tree page under a key that carries its DCP rank (``ModelLayout.rank_term``)."""

    def page_rows(self, slots: torch.Tensor, n_pages: int) -> torch.Tensor:
        lay = self.layout
        if slots.numel() != n_pages * lay.tree_page:
            raise ValueError(f"{self.kind.value}: {n_pages} tree pages need {n_pages * lay.tree_page} token "
                             f"slots (dcp_size={lay.dcp_size} x page_size={lay.page_size}), got {slots.numel()}")
        return dcp_fold(slots, lay.dcp_rank, lay.dcp_size, lay.page_size).reshape(n_pages, lay.page_size)


class TrailingState(PoolRule):
    """MAMBA: one state per run that has one, keyed by its last page, in a state slot."""

    def holds(self, node: Node) -> bool:
        return node.mamba_slot is not None

    def pages(self, node: Node) -> Sequence[int]:
        return [node.end_page - 1]

    def probe_positions(self, first_page: int, n_pages: int, grid_pages: int) -> list[int]:
        return [i for i in range(n_pages) if (first_page + i + 1) % grid_pages == 0]

    def node_objects(self, nodes: Sequence[Node]) -> tuple[list[str], torch.Tensor]:
        names = [object_key(n.keys[-1], self.kind, self.layout) for n in nodes]
        return names, torch.tensor([[n.mamba_slot] for n in nodes], dtype=torch.int64)

    def load_objects(self, keys: Sequence[bytes], rows: torch.Tensor, states: Sequence[tuple[int, int]]
                     ) -> tuple[list[str], torch.Tensor]:
        if not states:
            raise ValueError("restoring a state needs a slot")
        names = [object_key(keys[b - 1], self.kind, self.layout) for b, _ in states]
        return names, torch.tensor([[s] for _, s in states], dtype=torch.int64)

    def touch_names(self, path_keys: Sequence[bytes], node: Node) -> list[str]:
        if node.mamba_slot is None or not path_keys:
            return []
        return [object_key(path_keys[-1], self.kind, self.layout)]

    def stored_names(self, nodes: Sequence[Node]) -> list[str]:
        return [object_key(n.keys[-1], self.kind, self.layout) for n in nodes if self.kind in n.stored]

    def stored_by_commit(self, adopted_pages: bool, adopted_state: bool) -> bool:
        return adopted_state


def _rule_class(kind: PoolKind, layout: ModelLayout) -> type[PoolRule]:
    if kind is PoolKind.MAMBA:
        return TrailingState
    return FoldedPages if layout.folds(kind) else AllPages


def pool_rules(layout: ModelLayout) -> dict[PoolKind, PoolRule]:
    """The rule object of every pool the layout has, in layout order."""
    return {kind: _rule_class(kind, layout)(kind, layout) for kind in layout.pools}


__all__ = ["AllPages", "FoldedPages", "PoolRule", "TrailingState", "pool_rules"]
