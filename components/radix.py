"""Radix tree over whole pages, with per-component values for hybrid models.

Each :class:`Node` is a run of whole pages under chained page keys. It holds

* FULL: the KV token rows of its pages (DRAFT rides on the same rows);
* MAMBA: at most one state slot, valid only at the node's *end*, and only when that end lies
  on the checkpoint grid ``G``;
* a lock count (``lock``: lockers at or below the node) and ``mamba_lock`` (lockers of this
  node's state), an LRU stamp, and per-pool ``stored`` flags and ``pending`` offload job ids.

Rules the tree enforces (each has a test):

* Insert adopts only the pages it does not already hold; the caller's rows for pages that
  were present are freed here, once. If the end node already has a state (``mamba_exist``),
  the caller's slot is freed here, once; otherwise the node takes it.
* A split keeps the recurrent state (and its MAMBA flags) on the child — the state belongs to
  the end of the run — and copies the FULL/DRAFT stored and pending flags and the lock count
  to both fragments. The original node object stays the child, so references held by
  in-flight work keep pointing at the run that owns the state.
* Eviction is per component, in the order of an :class:`~.eviction.EvictionPolicy` (LRU by
  default); it never touches a locked node. FULL eviction removes
  unlocked leaves (and their states); MAMBA eviction frees unlocked states, removing the node
  when it is a leaf.
* A device match on a hybrid layout stops at the deepest node whose state exists.

The tree is synchronous and not thread-safe: in the runtime only the tree writer calls it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

import attrs
import torch

from .eviction import EvictionPolicy, LRUEviction, Scorer
from .layout import ModelLayout, PoolKind
from .pools import HybridPools, PoolError

_EMPTY_ROWS = torch.zeros(0, dtype=torch.int64)


@attrs.define(eq=False, repr=False)
class Node:
    parent: Node | None
    keys: list[bytes]
    rows: torch.Tensor
    start_page: int  # pages from the root to this node's first page
    id: int
    children: dict[bytes, Node] = attrs.field(factory=dict)  # bounded: nodes hold pool pages; eviction frees them
    mamba_slot: int | None = None
    lock: int = 0
    mamba_lock: int = 0
    last_access: int = 0
    stored: set[PoolKind] = attrs.field(factory=set)
    pending: dict[PoolKind, int] = attrs.field(factory=dict)  # pool -> offload job id
    last_touch: float = float("-inf")

    @property
    def end_page(self) -> int:
        return self.start_page + len(self.keys)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def last_key(self) -> bytes | None:
        return self.keys[-1] if self.keys else None

    def path(self) -> list[Node]:
        """Nodes from the root's first child down to this node."""
        out: list[Node] = []
        n: Node | None = self
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return (f"Node(id={self.id}, pages=[{self.start_page},{self.end_page}), "
                f"slot={self.mamba_slot}, lock={self.lock}/{self.mamba_lock})")


@attrs.frozen
class MatchResult:
    node: Node  # deepest usable node (the root for a miss)
    pages: int  # pages matched, = node.end_page
    rows: torch.Tensor  # KV rows of those pages


@attrs.frozen
class InsertResult:
    node: Node  # the node that ends at the inserted length
    existing_pages: int  # leading pages the tree already held (caller's rows for them were freed)
    mamba_exist: bool  # the end node already had a state (caller's slot was freed)


@attrs.frozen
class TreeStatistics:
    nodes: int
    pages: int
    states: int
    locked_nodes: int
    evicted_pages: int
    evicted_states: int
    splits: int


class RadixTree:
    """The device prefix cache of one rank. See the module docstring for the rules."""

    def __init__(self, layout: ModelLayout, pools: HybridPools, seed_key: bytes,
                 eviction: EvictionPolicy | None = None) -> None:
        self.layout = layout
        self.eviction: EvictionPolicy = eviction if eviction is not None else LRUEviction()
        self.pools = pools
        self.page_size = layout.tree_page  # token slots per page (kernel rows x DCP size)
        self.grid_pages = layout.grid // layout.tree_page
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.root = Node(parent=None, keys=[], rows=_EMPTY_ROWS, start_page=0, id=0)
        self.root.lock = 1  # the root is never evicted
        #: offload job ids whose states were copied into restorable host-staging frames: a state
        #: pending only on such a job may be evicted (``docs/design/host-staging.md``)
        self.copied_states: set[int] = set()
        self.seed_key = seed_key
        self._evicted_pages = 0
        self._evicted_states = 0
        self._splits = 0

    # ---- match ---------------------------------------------------------------------
    def match(self, keys: list[bytes]) -> MatchResult:
        """Deepest cached prefix of ``keys`` that can be used on the device.

        Pure attention: the longest run of matching pages (splitting a node if the match
        ends inside it). Hybrid: the deepest node on that run whose state exists.
        """
        node = self.root
        best = self.root
        i = 0
        now = next(self._clock)
        while i < len(keys) and (step := _step(node, keys, i, now)) is not None:
            child, n = step
            if n < len(child.keys):
                if not self.layout.is_hybrid:
                    best = self._split(child, n)
                break
            node = child
            i += n
            if not self.layout.is_hybrid or node.mamba_slot is not None:
                best = node
        return MatchResult(best, best.end_page, self.path_rows(best))

    def path_rows(self, node: Node) -> torch.Tensor:
        parts = [n.rows for n in node.path()]
        return torch.cat(parts) if parts else _EMPTY_ROWS

    def path_keys(self, node: Node) -> list[bytes]:
        out: list[bytes] = []
        for n in node.path():
            out.extend(n.keys)
        return out

    # ---- insert --------------------------------------------------------------------
    def insert(self, keys: list[bytes], rows: torch.Tensor, mamba_slot: int | None = None,
               *, owned_from: int = 0) -> InsertResult:
        """Insert a prefix of whole pages with its KV rows (and a state at its end).

        The caller owns the rows of pages ``owned_from ..``; pages before that are the tree's
        own (the caller holds a lock on them) and must be present. Ownership of the owned rows
        and of ``mamba_slot`` passes to the tree: rows of pages it already held, and a slot
        whose node already has a state, are freed here, once.
        """
        if rows.numel() != len(keys) * self.page_size:
            raise ValueError(f"{len(keys)} pages need {len(keys) * self.page_size} rows, got {rows.numel()}")
        if mamba_slot is not None:
            if not self.layout.is_hybrid:
                raise ValueError("a mamba slot was given but the layout has no mamba layers")
            if not keys or len(keys) % self.grid_pages:
                raise ValueError(
                    f"a state can only sit on the checkpoint grid: {len(keys)} pages is not a "
                    f"multiple of {self.grid_pages} pages (grid {self.layout.grid} tokens)")
        now = next(self._clock)
        node = self.root
        i = 0
        while i < len(keys) and (step := _step(node, keys, i, now)) is not None:
            child, n = step
            if n < len(child.keys):
                child = self._split(child, n)
            node = child
            i += n
        existing = i
        if existing < owned_from:
            raise PoolError(
                f"insert: pages [{existing}, {owned_from}) should be in the tree (the caller "
                "holds a lock on them) but are missing")
        if existing > owned_from:
            self.pools.kv.free_rows(rows[owned_from * self.page_size: existing * self.page_size])
        if existing < len(keys):
            new = Node(parent=node, keys=list(keys[existing:]), rows=rows[existing * self.page_size:].clone(),
                       start_page=existing, id=next(self._ids), last_access=now)
            node.children[new.keys[0]] = new
            node = new
        mamba_exist = False
        if mamba_slot is not None:
            if node.mamba_slot is not None:
                mamba_exist = True
                assert self.pools.mamba is not None
                self.pools.mamba.slots.free([mamba_slot])
            else:
                node.mamba_slot = mamba_slot
        return InsertResult(node, existing, mamba_exist)

    def _split(self, child: Node, n: int) -> Node:
        """Split ``child`` after its first ``n`` pages; return the new parent fragment."""
        assert 0 < n < len(child.keys) and child.parent is not None
        parent = child.parent
        head = Node(parent=parent, keys=child.keys[:n], rows=child.rows[: n * self.page_size],
                    start_page=child.start_page, id=next(self._ids), lock=child.lock,
                    last_access=child.last_access)
        head.stored = {p for p in child.stored if p is not PoolKind.MAMBA}
        head.pending = {p: j for p, j in child.pending.items() if p is not PoolKind.MAMBA}
        parent.children[head.keys[0]] = head
        child.keys = child.keys[n:]
        child.rows = child.rows[n * self.page_size:]
        child.start_page += n
        child.parent = head
        head.children[child.keys[0]] = child
        self._splits += 1
        return head

    # ---- locks ---------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """Protect ``node``'s pages (and its ancestors') and its state from eviction."""
        n: Node | None = node
        while n is not None and n.parent is not None:
            n.lock += 1
            n = n.parent
        if not node.is_root:
            node.mamba_lock += 1

    def unlock(self, node: Node) -> None:
        if node.is_root:
            return
        if node.lock <= 0 or node.mamba_lock <= 0:
            raise PoolError(f"unlock of an unlocked node {node!r}")
        node.mamba_lock -= 1
        n: Node | None = node
        while n is not None and n.parent is not None:
            n.lock -= 1
            n = n.parent

    # ---- eviction ------------------------------------------------------------------
    def _unlocked(self) -> tuple[list[Node], int]:
        """Unlocked leaves, and how many pages eviction could free (an unlocked node has no
        locked descendant, so every unlocked page can go, leaves first)."""
        leaves: list[Node] = []
        evictable = 0
        for n in self.nodes():
            if n.lock == 0:
                evictable += len(n.keys)
                if not n.children:
                    leaves.append(n)
        return leaves, evictable

    def evictable_pages(self) -> int:
        """Pages that eviction could free now (one walk of the tree)."""
        return self._unlocked()[1]

    def evict_pages(self, n_pages: int, *, all_or_nothing: bool = False) -> int:
        """Evict unlocked leaves, lowest eviction score first, until ``n_pages`` are freed.

        With ``all_or_nothing``, evict nothing unless ``n_pages`` can be freed; one walk of
        the tree finds both the leaves and how much is evictable.
        """
        leaves, evictable = self._unlocked()
        if all_or_nothing and evictable < n_pages:
            return 0
        score, heap = self._by_score(leaves)
        freed = 0
        while heap and freed < n_pages:
            _, _, leaf = heapq.heappop(heap)
            freed += len(leaf.keys)
            parent = self._remove_leaf(leaf)
            if parent is not None and not parent.is_root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (score(parent), parent.id, parent))
        return freed

    def _by_score(self, nodes: list[Node]) -> tuple[Scorer, list[tuple[float, int, Node]]]:
        """The eviction policy's score of ``nodes`` (scored now), and them in a heap, lowest first."""
        score = self.eviction.scorer(nodes, next(self._clock), self.layout)
        heap = [(score(n), n.id, n) for n in nodes]
        heapq.heapify(heap)
        return score, heap

    def evict_states(self, n_slots: int, *, all_or_nothing: bool = False) -> int:
        """Free unlocked states, lowest eviction score first, until ``n_slots`` are freed.

        A state an offload is still reading is never a candidate (the runtime also locks it).
        """
        copied = self.copied_states  # pending, but restorable from its frame: a candidate
        candidates = [n for n in self.nodes()
                      if n.mamba_slot is not None and n.mamba_lock == 0
                      and (PoolKind.MAMBA not in n.pending or n.pending[PoolKind.MAMBA] in copied)]
        if all_or_nothing and len(candidates) < n_slots:
            return 0
        _, heap = self._by_score(candidates)
        freed = 0
        while heap and freed < n_slots:
            _, _, node = heapq.heappop(heap)
            if node.mamba_slot is None or node.mamba_lock:
                continue
            if not node.children and node.lock == 0:
                self._remove_leaf(node)
            else:
                self._free_state(node)
            freed += 1
        return freed

    def evict_for_alloc(self, kind: PoolKind, n: int) -> bool:
        """Evict until ``n`` pages (FULL) or slots (MAMBA) are free; report success.

        When even evicting everything unlocked could not make room, nothing is evicted: a
        request that can never fit does not flush the device cache for nothing.
        """
        if kind is PoolKind.FULL:
            short = n - self.pools.kv.num_free_pages
            if short > 0:
                self.evict_pages(short, all_or_nothing=True)
            return self.pools.kv.num_free_pages >= n
        if kind is PoolKind.MAMBA:
            if self.pools.mamba is None:
                raise PoolError("no mamba pool")
            short = n - self.pools.mamba.num_free
            if short > 0:
                self.evict_states(short, all_or_nothing=True)
            return self.pools.mamba.num_free >= n
        raise ValueError(f"{kind} has no allocator of its own")

    def _free_state(self, node: Node) -> None:
        assert node.mamba_slot is not None and self.pools.mamba is not None
        self.pools.mamba.slots.free([node.mamba_slot])
        node.mamba_slot = None
        node.stored.discard(PoolKind.MAMBA)
        self._evicted_states += 1

    def _remove_leaf(self, leaf: Node) -> Node | None:
        assert not leaf.children and leaf.lock == 0 and leaf.parent is not None
        if leaf.mamba_slot is not None:
            self._free_state(leaf)
        self.pools.kv.free_rows(leaf.rows)
        self._evicted_pages += len(leaf.keys)
        parent = leaf.parent
        del parent.children[leaf.keys[0]]
        leaf.parent = None
        return parent

    def reset(self) -> None:
        """Evict everything (all nodes must be unlocked): the device cache is flushed."""
        locked = [n for n in self.nodes() if n.lock]
        if locked:
            raise PoolError(f"cannot flush the tree: {len(locked)} nodes are locked")
        self.evict_pages(1 << 62)

    # ---- inspection ----------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def locked_nodes(self) -> list[Node]:
        return [n for n in self.nodes() if n.lock or n.mamba_lock]

    def statistics(self) -> TreeStatistics:
        nodes = list(self.nodes())
        return TreeStatistics(
            nodes=len(nodes),
            pages=sum(len(n.keys) for n in nodes),
            states=sum(n.mamba_slot is not None for n in nodes),
            locked_nodes=sum(bool(n.lock or n.mamba_lock) for n in nodes),
            evicted_pages=self._evicted_pages,
            evicted_states=self._evicted_states,
            splits=self._splits,
        )

    def check_consistent(self) -> None:
        """Raise :class:`PoolError` if the tree and the allocators disagree."""
        pages = 0
        slots = 0
        for n in self.nodes():
            if n.rows.numel() != len(n.keys) * self.page_size:
                raise PoolError(f"{n!r}: rows do not match pages")
            if n.lock < 0 or n.mamba_lock < 0 or n.mamba_lock > n.lock:
                raise PoolError(f"{n!r}: bad lock counts")
            child_locks = sum(c.lock for c in n.children.values())
            if n.lock < child_locks:
                raise PoolError(f"{n!r}: lock below its children's")
            if n.mamba_slot is not None:
                slots += 1
                if n.end_page % self.grid_pages:
                    raise PoolError(f"{n!r}: state off the grid")
                if self.pools.mamba is None or not self.pools.mamba.slots.is_allocated(n.mamba_slot):
                    raise PoolError(f"{n!r}: state slot is not allocated")
            pages += len(n.keys)
        used_pages = self.pools.kv.pages.capacity - self.pools.kv.num_free_pages
        if used_pages < pages:
            raise PoolError(f"tree holds {pages} pages but only {used_pages} are allocated")
        if self.pools.mamba is not None:
            used = self.pools.mamba.slots.capacity - self.pools.mamba.num_free
            if used < slots:
                raise PoolError(f"tree holds {slots} states but only {used} slots are allocated")


def _step(node: Node, keys: list[bytes], i: int, now: int) -> tuple[Node, int] | None:
    """The child of ``node`` that ``keys[i:]`` enters (its access stamped ``now``) and the pages
    they share, or None where no child starts with ``keys[i]``."""
    child = node.children.get(keys[i])
    if child is None:
        return None
    child.last_access = now
    return child, _common_len(child.keys, keys, i)


def _common_len(node_keys: list[bytes], keys: list[bytes], start: int) -> int:
    n = 0
    limit = min(len(node_keys), len(keys) - start)
    while n < limit and node_keys[n] == keys[start + n]:
        n += 1
    return n
