"""Who holds the device's pages and state slots: the tree, the open requests (their own rows,
working and checkpoint slots, the rows and slots of a load in flight), or nobody (a leak).

:meth:`Linker.leaked <hylinker.runtime.linker.facade.Linker.leaked>` and
:meth:`Linker.check_idle <hylinker.runtime.linker.facade.Linker.check_idle>` answer with these.
"""

from __future__ import annotations

from collections.abc import Collection

from ...components.pools import HybridPools, PoolError
from .request import Request
from .tree_writer import TreeWriter


def leaked(tree: TreeWriter, pools: HybridPools, requests: Collection[Request], page: int) -> tuple[int, int]:
    """``(KV pages, state slots)`` allocated but held by neither the tree nor an open request."""
    stats = tree.statistics()
    owned_pages = sum(req.rows.numel() // page - req.prefix_pages for req in requests)
    owned_slots = sum(len(req.checkpoints) + (req.working is not None) for req in requests)
    for req in requests:
        if req.load is not None and not req.load.finished:
            owned_pages += req.load.rows.numel() // page
            owned_slots += len(req.load.states)
    used_pages = pools.kv.pages.capacity - pools.kv.num_free_pages
    used_slots = 0 if pools.mamba is None else pools.mamba.slots.capacity - pools.mamba.num_free
    return used_pages - stats.pages - owned_pages, used_slots - stats.states - owned_slots


def check_idle(tree: TreeWriter, pools: HybridPools, requests: Collection[Request], page: int) -> None:
    """Raise :class:`PoolError` unless no request is open, nothing is locked and the tree
    matches the pools."""
    if requests:
        raise PoolError(f"{len(requests)} requests are still open")
    locked = tree.locked_nodes()
    if locked:
        raise PoolError(f"{len(locked)} nodes are still locked: {locked[:3]}")
    tree.check_consistent()
    pages, slots = leaked(tree, pools, requests, page)
    if pages:
        raise PoolError(f"{pages} KV pages leaked (allocated but not in the tree)")
    if slots:
        raise PoolError(f"{slots} mamba slots leaked")


__all__ = ["check_idle", "leaked"]
