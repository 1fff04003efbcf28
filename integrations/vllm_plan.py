"""The vLLM connector's scheduler-side rules, free of vLLM imports (unit-tested anywhere).

Objects and keys. vLLM hands out blocks of ``block_size`` tokens per KV cache group. Block ``i``
of a token sequence has the chained key ``k_i = H(k_{i-1} ‖ tokens of block i)``
(:func:`~hylinker.components.keys.page_keys`, ``k_{-1}`` = :func:`namespace_seed`). Per group:

* an attention group stores block ``i`` as the object ``{k_i}:kv:g{group}``;
* a recurrent-state group stores the state *after* block ``i`` — at the boundary
  ``(i + 1) · block_size`` — as ``{k_i}:state:g{group}``.

* a sliding-window group stores block ``i`` like an attention group, ``{k_i}:kv:g{group}``.

Hit rule (:func:`restorable_blocks`): a prefix of ``n`` blocks can be restored only when every
full-attention group holds every block from the engine's own hit up to ``n``, every state group
holds the state at exactly ``n · block_size``, and every sliding-window group holds the blocks
its window needs below ``n`` — ``⌈(window − 1) / block_size⌉`` blocks, vLLM's own rule for a
sliding-window prefix hit (``SlidingWindowManager``), not below the engine's own hit;
``n · block_size`` stays below the prompt length (one token must run to produce logits). The
longest such ``n`` wins. A restore loads only those window blocks (vLLM holds the null block
below the window).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs
import numpy as np

from ..components.keys import KEY_BYTES, as_tokens, page_keys


def namespace_seed(model: str, geometry: str, salt: str) -> bytes:
    """``k_{-1}``: the model, the cache geometry (dtype, block size, page bytes per group) and
    the tenant salt. Engines agree on keys exactly when they agree on all three."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in (model, geometry, salt):
        h.update(part.encode())
        h.update(b"\x00")
    return h.digest()


def attention_key(block_key: bytes, group: int) -> str:
    return f"{block_key.hex()}:kv:g{group}"


def state_key(block_key: bytes, group: int) -> str:
    return f"{block_key.hex()}:state:g{group}"


class BlockKeys:
    """A request's chained block keys, extended as its tokens grow."""

    def __init__(self, seed: bytes, block_size: int) -> None:
        self.seed = seed
        self.block_size = block_size
        self.keys: list[bytes] = []

    def extend(self, tokens: Sequence[int], n_blocks: int | None = None) -> list[bytes]:
        """Keys of the first ``n_blocks`` whole blocks of ``tokens`` (all whole blocks if None)."""
        whole = len(tokens) // self.block_size
        want = whole if n_blocks is None else min(n_blocks, whole)
        if want > len(self.keys):
            lo = len(self.keys) * self.block_size
            parent = self.keys[-1] if self.keys else self.seed
            arr = as_tokens(np.asarray(tokens[lo: want * self.block_size], dtype=np.int64))
            self.keys.extend(page_keys(arr, self.block_size, parent))
        return self.keys[:want]


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks a sliding-window group needs below a boundary: ``⌈(window − 1) / block_size⌉``."""
    if sliding_window < 1 or block_size < 1:
        raise ValueError(f"sliding window {sliding_window} and block size {block_size} must be >= 1")
    return max(1, -(-(sliding_window - 1) // block_size))


@attrs.frozen
class Groups:
    """Which KV cache groups hold full-attention blocks, recurrent states, and sliding-window
    blocks (``window``: ``(group, blocks the window needs)``)."""

    attention: tuple[int, ...]
    state: tuple[int, ...]
    window: tuple[tuple[int, int], ...] = ()

    @property
    def per_block(self) -> int:
        return len(self.attention) + len(self.state) + len(self.window)

    @property
    def block_groups(self) -> tuple[int, ...]:
        """Groups whose blocks are saved as they fill (full attention and sliding window)."""
        return self.attention + tuple(g for g, _ in self.window)

    def probe_keys(self, keys: Sequence[bytes], first: int) -> list[str]:
        """Store keys for the blocks ``first..len(keys)-1``: per block, every attention group's
        block, every state group's state after it, then every sliding-window group's block."""
        out: list[str] = []
        for i in range(first, len(keys)):
            out.extend(attention_key(keys[i], g) for g in self.attention)
            out.extend(state_key(keys[i], g) for g in self.state)
            out.extend(attention_key(keys[i], g) for g, _ in self.window)
        return out


def restorable_blocks(groups: Groups, first: int, last: int, present: Sequence[bool]) -> int:
    """The largest ``n`` in ``(first, last]`` restorable from the store, or ``first`` if none.

    ``present`` answers :meth:`Groups.probe_keys` for blocks ``first..last-1``."""
    per_block = groups.per_block
    if len(present) != per_block * (last - first):
        raise ValueError(f"{len(present)} answers for {last - first} blocks of {per_block} objects")
    n_attn = len(groups.attention)
    n_state = len(groups.state)
    runs = [0] * len(groups.window)  # per window group: present blocks in a row ending at i
    best = first
    for i in range(first, last):
        row = present[(i - first) * per_block: (i - first + 1) * per_block]
        if not all(row[:n_attn]):
            break  # an attention block is missing: nothing above it restores
        windows_ok = True
        for w, (_g, need) in enumerate(groups.window):
            runs[w] = runs[w] + 1 if row[n_attn + n_state + w] else 0
            windows_ok = windows_ok and runs[w] >= min(need, i + 1 - first)
        if all(row[n_attn:n_attn + n_state]) and windows_ok:
            best = i + 1  # every state after block i and every window below it is there
    return best


@attrs.frozen
class LoadSpec:
    """One request's restore: attention blocks ``[first, last)`` and the states at ``last``."""

    request_id: str
    first: int
    last: int
    keys: tuple[bytes, ...]  # block keys 0..last-1


@attrs.frozen
class TransferPlan:
    """What the worker moves for one request in one step (loads or saves)."""

    request_id: str
    kv_keys: tuple[str, ...] = ()
    kv_blocks: tuple[int, ...] = ()
    state_keys: tuple[str, ...] = ()
    state_blocks: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.kv_keys and not self.state_keys

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.kv_blocks + self.state_blocks


def load_plan(spec: LoadSpec, groups: Groups, block_ids: Sequence[Sequence[int]]) -> TransferPlan:
    """The transfers of ``spec`` into the request's blocks (``block_ids[group][i]``, as vLLM
    allocated them): attention blocks ``first..last-1``; the state block at ``last - 1``."""
    kv_keys: list[str] = []
    kv_blocks: list[int] = []
    for g in groups.attention:
        ids = block_ids[g]
        if len(ids) < spec.last:
            raise ValueError(f"group {g}: {len(ids)} blocks allocated, the load needs {spec.last}")
        for i in range(spec.first, spec.last):
            kv_keys.append(attention_key(spec.keys[i], g))
            kv_blocks.append(int(ids[i]))
    for g, need in groups.window:  # only the blocks the window needs below the boundary
        ids = block_ids[g]
        if len(ids) < spec.last:
            raise ValueError(f"sliding-window group {g}: {len(ids)} blocks allocated, the load needs {spec.last}")
        for i in range(max(spec.first, spec.last - need), spec.last):
            kv_keys.append(attention_key(spec.keys[i], g))
            kv_blocks.append(int(ids[i]))
    st_keys: list[str] = []
    st_blocks: list[int] = []
    for g in groups.state:
        ids = block_ids[g]
        if len(ids) < spec.last:
            raise ValueError(f"group {g}: {len(ids)} state blocks allocated, the load needs {spec.last}")
        st_keys.append(state_key(spec.keys[spec.last - 1], g))
        st_blocks.append(int(ids[spec.last - 1]))
    if 0 in kv_blocks or 0 in st_blocks:
        raise ValueError("a load names the null block 0")
    return TransferPlan(spec.request_id, tuple(kv_keys), tuple(kv_blocks), tuple(st_keys), tuple(st_blocks))


__all__ = [
    "BlockKeys",
    "Groups",
    "LoadSpec",
    "TransferPlan",
    "attention_key",
    "load_plan",
    "namespace_seed",
    "restorable_blocks",
    "state_key",
    "window_blocks",
]
