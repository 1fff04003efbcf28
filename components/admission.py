"""Checkpoint admission: where a prefill donates recurrent states, as small policy objects.

A hybrid prefix can only be restored where a state exists, so *where* a prefill checkpoints
decides what later prompts can reuse. Every state costs a slot on the device and one object
(~64 KV pages' worth of bytes in Kimi-like geometries) in the store, so "everywhere" is not an
answer: a policy picks a few depths.

A policy sees one :class:`Prefill` and returns sorted depths. Every depth it returns is valid
for that prefill: on the grid ``G``, past the cached prefix, a whole number of chunks after it,
and inside the prompt (:func:`valid_depth`). Policies are pure and synchronous; one may
remember what it saw (the branch-point policy remembers page keys), so call
:meth:`CheckpointPolicy.place` exactly once per prefill.

* :class:`EndOfPrefill`: the end of the prefill (and ``L - G`` when the prompt ends on the
  grid, or a resubmitted prompt could restore nothing).
* :class:`BranchPoints`: Marconi-style: also where this prompt leaves every earlier prompt (a
  branch point of the prefix tree, the state later siblings need) and, for a workload that
  shares prefixes in blocks, the last whole block (where the next turn's shared part ends).
* :class:`SpeculativeCheckpoints`: another policy's depths plus a budgeted number of extra
  states at regular depths, for branches that have not been seen yet.
* :class:`EveryBoundary`: a state at every grid boundary (the upper bound on reuse and on cost).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from .mamba import checkpoint_depth


@attrs.frozen
class Prefill:
    """One prefill, as an admission policy sees it."""

    prefix_tokens: int  # the cached prefix (device + restored) the prefill starts from
    prompt_tokens: int  # L
    keys: Sequence[bytes]  # page keys of the prompt's whole pages (chained, so a key names a prefix)
    page: int
    grid: int  # G: states exist only at multiples of it
    chunk: int  # the linear-attention kernel chunk

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError(f"prefix {self.prefix_tokens} must lie in [0, {self.prompt_tokens}]")
        if self.page <= 0 or self.grid <= 0 or self.chunk <= 0 or self.grid % self.page:
            raise ValueError(f"bad geometry: page={self.page} grid={self.grid} chunk={self.chunk}")
        if len(self.keys) > self.prompt_tokens // self.page:
            raise ValueError(f"{len(self.keys)} page keys for a prompt of {self.prompt_tokens} tokens")


def valid_depth(prefill: Prefill, depth: int) -> bool:
    """A depth this prefill can donate a state at."""
    return (prefill.prefix_tokens < depth <= prefill.prompt_tokens and depth % prefill.grid == 0
            and (depth - prefill.prefix_tokens) % prefill.chunk == 0)


@runtime_checkable
class CheckpointPolicy(Protocol):
    """Where prefills donate states. ``place`` is called once per prefill."""

    name: str

    def place(self, prefill: Prefill) -> list[int]:
        """Sorted, valid depths (possibly none) at which this prefill donates a state."""
        ...


@attrs.define
class EndOfPrefill:
    """A state at the end of each prefill, and at ``L - G`` for a prompt that ends on the grid
    (the same prompt resubmitted restores at most ``L - G``: one token must run)."""

    name: str = "end"

    def place(self, prefill: Prefill) -> list[int]:
        end = checkpoint_depth(prefill.prefix_tokens, prefill.prompt_tokens - prefill.prefix_tokens,
                               prefill.grid, prefill.chunk)
        if end is None:
            return []
        depths = {end}
        if end == prefill.prompt_tokens and valid_depth(prefill, end - prefill.grid):
            depths.add(end - prefill.grid)
        return sorted(depths)


@attrs.define
class BranchPoints:
    """Marconi-style admission: end of prefill, the branch point, and the last whole block.

    The branch point is where this prompt leaves every earlier prompt: the deepest grid depth
    within its leading pages that earlier prompts also had. A later prompt that shares the same
    prefix and then diverges restores from there. The policy remembers the page keys of the
    last ``memory_pages`` pages it saw (oldest forgotten first); a key names a whole prefix (keys
    are chained), so a set of keys is a prefix tree. With ``block_tokens`` (a workload known to
    share prefixes in blocks, e.g. 512 for Mooncake traces) it donates at the prompt's last
    whole block instead of inside the partial block after it: the next turn of the conversation
    shares exactly the whole blocks, and a state that no other prompt can reach is a slot on the
    device and a megabyte in the store for nothing.
    """

    block_tokens: int = 0
    memory_pages: int = 1 << 20
    name: str = "marconi"
    _seen: OrderedDict[bytes, None] = attrs.field(factory=OrderedDict, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.block_tokens < 0 or self.memory_pages <= 0:
            raise ValueError(f"block_tokens must be >= 0 and memory_pages > 0, got "
                             f"{self.block_tokens}, {self.memory_pages}")

    def shared_pages(self, keys: Sequence[bytes]) -> int:
        """Leading pages of ``keys`` that an earlier prompt had."""
        n = 0
        while n < len(keys) and keys[n] in self._seen:
            n += 1
        return n

    def place(self, prefill: Prefill) -> list[int]:
        depths = set(EndOfPrefill().place(prefill))
        if depths:
            end = max(depths)
            branch = self.shared_pages(prefill.keys) * prefill.page // prefill.grid * prefill.grid
            if branch < end and valid_depth(prefill, branch):
                depths.add(branch)
            if self.block_tokens:
                # later prompts share whole blocks only: a state inside the last, partial block
                # could serve nothing but the same prompt again, so it moves to the block's start
                depths = {d for d in depths if d % self.block_tokens == 0 or d == branch}
                last_block = (prefill.prompt_tokens - 1) // self.block_tokens * self.block_tokens
                last_block = last_block // prefill.grid * prefill.grid
                if valid_depth(prefill, last_block):
                    depths.add(last_block)
        self._remember(prefill.keys)
        return sorted(depths)

    def _remember(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._seen[k] = None
            self._seen.move_to_end(k)
        while len(self._seen) > self.memory_pages:
            self._seen.popitem(last=False)


@attrs.define
class SpeculativeCheckpoints:
    """``base``'s depths plus speculative states for branches nobody has taken yet.

    Candidates are the grid depths at multiples of ``every_tokens`` inside the prefill (the
    shallowest first: a shallow prefix is shared by more future prompts than a deep one). The
    budget: at most one extra state per ``every_tokens`` computed tokens and at most
    ``max_extra`` per prefill, so the bytes a prefill stores stay proportional to its work.
    """

    base: CheckpointPolicy = attrs.field(factory=BranchPoints)
    every_tokens: int = 4096
    max_extra: int = 2
    name: str = "speculative"

    def __attrs_post_init__(self) -> None:
        if self.every_tokens <= 0 or self.max_extra < 0:
            raise ValueError(f"every_tokens must be > 0 and max_extra >= 0, got "
                             f"{self.every_tokens}, {self.max_extra}")

    def place(self, prefill: Prefill) -> list[int]:
        depths = set(self.base.place(prefill))
        computed = prefill.prompt_tokens - prefill.prefix_tokens
        budget = min(self.max_extra, computed // self.every_tokens)
        end = max(depths, default=prefill.prefix_tokens)
        step = self.every_tokens
        d = (prefill.prefix_tokens // step + 1) * step
        while budget > 0 and d < end:
            g = d // prefill.grid * prefill.grid
            if g not in depths and valid_depth(prefill, g):
                depths.add(g)
                budget -= 1
            d += step
        return sorted(depths)


@attrs.define
class EveryBoundary:
    """A state at every grid boundary the prefill passes (stores the most, reuses the most)."""

    name: str = "grid"

    def place(self, prefill: Prefill) -> list[int]:
        end = EndOfPrefill().place(prefill)
        if not end:
            return []
        first = prefill.prefix_tokens // prefill.grid * prefill.grid + prefill.grid
        return sorted({d for d in range(first, max(end) + 1, prefill.grid) if valid_depth(prefill, d)}
                      | set(end))


def checkpoint_policy(name: str, *, block_tokens: int = 0) -> CheckpointPolicy:
    """A policy by its name: ``end``, ``marconi``, ``speculative`` or ``grid``."""
    if name == "end":
        return EndOfPrefill()
    if name == "marconi":
        return BranchPoints(block_tokens=block_tokens)
    if name == "speculative":
        return SpeculativeCheckpoints(BranchPoints(block_tokens=block_tokens))
    if name == "grid":
        return EveryBoundary()
    raise ValueError(f"unknown checkpoint policy {name!r}; choose from {CHECKPOINT_POLICIES}")


CHECKPOINT_POLICIES = ("end", "marconi", "speculative", "grid")
