"""The tree writer: the only writer of the radix tree and the pools' allocators.

hylinker runs on one event loop, and every tree operation here is synchronous and never
awaits, so each call runs to completion before any other task can touch the tree: the loop
itself serializes match, insert, COMMIT, eviction and locks, with no mailbox hop on the
scheduler's path. Nothing outside this class mutates the tree or allocates rows or slots, and
the linker reads the tree only through it (``tree`` stays public for tests and tools that
inspect it).
"""

from __future__ import annotations

import anyio
import torch

from ...components.eviction import EvictionPolicy
from ...components.layout import ModelLayout, PoolKind
from ...components.pools import HybridPools, PoolError
from ...components.radix import InsertResult, MatchResult, Node, RadixTree, TreeStatistics


class PoolExhaustedError(RuntimeError):
    """No rows or slots could be freed for an allocation, even after eviction."""


class TreeWriter:
    def __init__(self, layout: ModelLayout, pools: HybridPools, seed_key: bytes,
                 eviction: EvictionPolicy | None = None) -> None:
        self.layout = layout
        self.pools = pools
        self.tree = RadixTree(layout, pools, seed_key, eviction)
        #: set (and dropped) when a lock is let go or rows or a slot are freed: what a load that
        #: found no pages waits for (made lazily: a writer may be built outside an event loop)
        self._released: anyio.Event | None = None

    # ---- tree ----------------------------------------------------------------------
    def match(self, keys: list[bytes]) -> MatchResult:
        return self.tree.match(keys)

    def insert(self, keys: list[bytes], rows: torch.Tensor, slot: int | None, owned_from: int) -> InsertResult:
        return self.tree.insert(keys, rows, slot, owned_from=owned_from)

    def lock(self, node: Node) -> None:
        self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)
        self._note_released()

    # ---- waiting for pages (a load that found none) -------------------------------------
    def _note_released(self) -> None:
        if self._released is not None:
            released, self._released = self._released, None
            released.set()

    async def released(self) -> None:
        """Return at the next unlock or free (pages or a slot may have become available)."""
        if self._released is None:
            self._released = anyio.Event()
        await self._released.wait()

    # ---- reads and whole-tree operations (the linker never reaches past this class) ------
    @property
    def root(self) -> Node:
        return self.tree.root

    def path_keys(self, node: Node) -> list[bytes]:
        return self.tree.path_keys(node)

    def path_rows(self, node: Node) -> torch.Tensor:
        return self.tree.path_rows(node)

    def statistics(self) -> TreeStatistics:
        return self.tree.statistics()

    def locked_nodes(self) -> list[Node]:
        return self.tree.locked_nodes()

    def check_consistent(self) -> None:
        self.tree.check_consistent()

    def reset(self) -> None:
        """Evict the whole tree (nothing may be locked)."""
        self.tree.reset()

    # ---- allocation (evicting when short) -------------------------------------------
    def kv_headroom_pages(self) -> int:
        """KV pages an allocation could get now: free, or evictable (unlocked) in the tree."""
        return self.pools.kv.num_free_pages + self.tree.evictable_pages()

    def try_alloc_rows(self, n_pages: int) -> torch.Tensor | None:
        if n_pages == 0:
            return torch.zeros(0, dtype=torch.int64)
        if not self.tree.evict_for_alloc(PoolKind.FULL, n_pages):
            return None
        return self.pools.kv.alloc_rows(n_pages)

    def alloc_rows(self, n_pages: int) -> torch.Tensor:
        rows = self.try_alloc_rows(n_pages)
        if rows is None:
            raise PoolExhaustedError(
                f"cannot allocate {n_pages} KV pages: {self.pools.kv.num_free_pages} free and "
                "everything else is locked")
        return rows

    def free_rows(self, rows: torch.Tensor, *, wake: bool = True) -> None:
        """Give rows back; ``wake=False`` for rows taken a moment ago and returned unused (an
        allocation rolled back): nothing new is free, and waking the loads that wait for pages
        would let two of them wake each other in turn until their limit."""
        if rows.numel():
            self.pools.kv.free_rows(rows)
            if wake:
                self._note_released()

    def try_alloc_slot(self) -> int | None:
        if self.pools.mamba is None:
            raise PoolError("the layout has no mamba pool")
        if not self.tree.evict_for_alloc(PoolKind.MAMBA, 1):
            return None
        got = self.pools.mamba.slots.alloc(1)
        return None if got is None else got[0]

    def alloc_slot(self) -> int:
        slot = self.try_alloc_slot()
        if slot is None:
            raise PoolExhaustedError("cannot allocate a mamba slot: every state is locked")
        return slot

    def free_slot(self, slot: int) -> None:
        assert self.pools.mamba is not None
        self.pools.mamba.slots.free([slot])
        self._note_released()
