"""Per-pool rules: what each pool stores for a node and at a boundary, and how its objects
are named and indexed. One small object per rule kind instead of ``if pool is MAMBA`` branches.

* :class:`AllPages` (FULL, DRAFT): every page of a run has its own object (ALL_PAGES); a
  node's objects are its pages, indexed by the page's KV rows.
* :class:`TrailingState` (MAMBA): one state object, at the end of a run that has a state
  (TRAILING_PAGES), keyed by the run's last page and indexed by the state slot; a store probe
  asks for it only at grid boundaries.

Replicated vs sharded is the layout's (``ModelLayout.writes`` / ``rank_term``), read through
:attr:`PoolRule.writes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .keys import object_key, object_keys
from .layout import ModelLayout, PoolKind
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

    def node_objects(self, nodes: Sequence[Node]) -> tuple[list[str], torch.Tensor]:
        names = object_keys([k for n in nodes for k in n.keys], self.kind, self.layout)
        return names, torch.cat([n.rows for n in nodes]).view(-1, self.layout.page_size)

    def load_objects(self, keys: Sequence[bytes], rows: torch.Tensor, states: Sequence[tuple[int, int]]
                     ) -> tuple[list[str], torch.Tensor]:
        return object_keys(list(keys), self.kind, self.layout), rows.view(len(keys), self.layout.page_size)

    def touch_names(self, path_keys: Sequence[bytes], node: Node) -> list[str]:
        return object_keys(list(path_keys), self.kind, self.layout)

    def stored_by_commit(self, adopted_pages: bool, adopted_state: bool) -> bool:
        return adopted_pages


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

    def stored_by_commit(self, adopted_pages: bool, adopted_state: bool) -> bool:
        return adopted_state


def pool_rules(layout: ModelLayout) -> dict[PoolKind, PoolRule]:
    """The rule object of every pool the layout has, in layout order."""
    return {kind: (TrailingState if kind is PoolKind.MAMBA else AllPages)(kind, layout) for kind in layout.pools}


__all__ = ["AllPages", "PoolRule", "TrailingState", "pool_rules"]
