"""Device-cache eviction order, as small policy objects the radix tree consults.

When the KV or the state pool runs short, the tree frees unlocked leaves (or unlocked states)
in order of a score, lowest first. A policy turns the current candidates into a scoring
function (:meth:`EvictionPolicy.scorer`); the tree uses the same function for nodes that become
candidates during the same eviction (a parent whose last child went).

* :class:`LRUEviction`: least recently used first.
* :class:`FlopAwareEviction`: Marconi's idea: weigh recency against what a node saves per byte
  it holds. Keeping a node saves recomputing its tokens from the nearest ancestor that has a
  state (a hybrid prefix can only resume from a state), and attention's cost grows with depth:
  a deep, long node saves more compute per byte than a short one near the root. Its score is
  ``recency + alpha * efficiency``, both normalised to ``[0, 1]`` over the candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    from .layout import ModelLayout
    from .radix import Node

Scorer = Callable[["Node"], float]


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders eviction candidates: the lower a node's score, the earlier it goes."""

    name: str

    def scorer(self, candidates: Sequence[Node], clock: int, layout: ModelLayout) -> Scorer:
        """A scoring function for this eviction; ``clock`` is the tree's current access stamp."""
        ...


@attrs.define
class LRUEviction:
    """Least recently used first."""

    name: str = "lru"

    def scorer(self, candidates: Sequence[Node], clock: int, layout: ModelLayout) -> Scorer:
        return lambda node: float(node.last_access)


def recompute_cost(start: int, end: int, layout: ModelLayout, attention_ratio: float) -> float:
    """Relative compute to prefill tokens ``[start, end)``: every layer costs 1 per token, and a
    full-attention layer adds ``attention_ratio * position`` per token (its scores over the
    prefix). Units cancel in :class:`FlopAwareEviction`'s normalisation."""
    n = end - start
    layers = len(layout.full_layers) + len(layout.mamba_layers)
    positions = (end * (end - 1) - start * (start - 1)) / 2  # sum of start..end-1
    return layers * n + len(layout.full_layers) * attention_ratio * positions


def node_bytes(node: Node, layout: ModelLayout) -> int:
    """Device bytes the node holds: its KV (and draft) pages and its state."""
    per_token = layout.kv_row_bytes + layout.draft_row_bytes  # both already span their layers
    state = layout.mamba_state_bytes if node.mamba_slot is not None else 0
    return len(node.keys) * layout.page_size * per_token + state


def _resume_page(node: Node) -> int:
    """First page a recompute of ``node`` starts from: the end of its nearest ancestor with a
    state (for a pure-attention layout, its parent's end)."""
    n = node.parent
    while n is not None and n.parent is not None and n.mamba_slot is None:
        n = n.parent
    return 0 if n is None else n.end_page


@attrs.define
class FlopAwareEviction:
    """Recency plus ``alpha`` × compute saved per byte (Marconi's FLOP-aware eviction)."""

    alpha: float = 1.0
    #: attention's per-token cost at position ``p`` is ``attention_ratio * p`` times a layer's
    #: per-token dense cost (~ 1 / hidden size for standard attention)
    attention_ratio: float = 1 / 4096
    name: str = "flop"

    def __attrs_post_init__(self) -> None:
        if self.alpha < 0 or self.attention_ratio < 0:
            raise ValueError(f"alpha and attention_ratio must be >= 0, got {self.alpha}, {self.attention_ratio}")

    def efficiency(self, node: Node, layout: ModelLayout) -> float:
        """Compute saved per byte held if ``node`` stays.

        A node that holds no bytes (on a state-only layout, a node whose state went) saves
        nothing: 0, not an unbounded ratio. A hybrid node without a state that does hold KV
        keeps its usual value: a later hit loads only the state from the store and reuses
        that KV (measured: valuing such nodes at 0 cost 2-5 points of the bound on the trace).
        """
        held = node_bytes(node, layout)
        if held == 0:
            return 0.0
        P = layout.tree_page
        if layout.is_hybrid:
            start = _resume_page(node) * P
        else:
            start = node.start_page * P
        cost = recompute_cost(start, node.end_page * P, layout, self.attention_ratio)
        return cost / held

    def scorer(self, candidates: Sequence[Node], clock: int, layout: ModelLayout) -> Scorer:
        oldest = min((n.last_access for n in candidates), default=clock)
        span = max(1, clock - oldest)
        best = max((self.efficiency(n, layout) for n in candidates), default=0.0) or 1.0

        def score(node: Node) -> float:
            recency = (node.last_access - oldest) / span
            return recency + self.alpha * min(1.0, self.efficiency(node, layout) / best)

        return score


def eviction_policy(name: str) -> EvictionPolicy:
    """A policy by its name: ``lru`` or ``flop``."""
    if name == "lru":
        return LRUEviction()
    if name == "flop":
        return FlopAwareEviction()
    raise ValueError(f"unknown eviction policy {name!r}; choose from {EVICTION_POLICIES}")


EVICTION_POLICIES = ("lru", "flop")
