"""The vLLM connector's scheduler-side rules, free of vLLM imports (unit-tested anywhere).

Objects and keys. vLLM hands out blocks of ``block_size`` tokens per KV cache group. Block ``i``
of a token sequence has the chained key ``k_i = H(k_{i-1} ‖ tokens of block i)``
(:func:`~hylinker.components.keys.page_keys`, ``k_{-1}`` = :func:`~hylinker.components.keys.geometry_seed`, folded with
the request's own seed parts by :func:`request_seed`); a block for which the request has extra
keys (vLLM's block-hash extra keys: LoRA adapter, multimodal inputs overlapping the block, the
cache salt on block 0, prompt embeddings) gets ``k_i = H(H(k_{i-1} ‖ tokens) ‖ extras)``
(:func:`fold_extra_keys`), so a key differs wherever vLLM's own block hash differs. Per group:

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
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from ...components.keys import (
    KEY_BYTES,
    as_tokens,
    attention_key,
    geometry_seed,
    page_keys,
    state_key,
)
from ...components.lookup import ALL_PAGES, TRAILING_PAGES, restorable_stops, window


class UnkeyableRequest(ValueError):
    """A request carries something its block keys cannot describe exactly (an extra-key kind or
    value this connector does not know): it is served without the store."""


#: vLLM 0.32's block-hash extra-key kinds (``generate_block_hash_extra_keys``) the keys carry
EXTRA_KEY_KINDS = ("lora", "mm", "cache_salt", "prompt_embeds")


def _encode_value(v: object) -> bytes:
    if isinstance(v, bool) or not isinstance(v, (str, bytes, int)):
        raise UnkeyableRequest(f"an extra-key value of type {type(v).__name__} ({v!r:.60})")
    if isinstance(v, str):
        tag, raw = b"s", v.encode("utf-8", "surrogatepass")
    elif isinstance(v, bytes):
        tag, raw = b"b", v
    else:
        tag, raw = b"i", str(v).encode()
    return tag + len(raw).to_bytes(8, "little") + raw


def encode_extra_keys(keys: Sequence[tuple[object, ...]]) -> bytes:
    """A canonical, process-independent encoding of a block's extra keys: each a tuple whose
    first item is one of :data:`EXTRA_KEY_KINDS`, the rest strings, bytes or integers; anything
    else raises :class:`UnkeyableRequest`."""
    out = [len(keys).to_bytes(4, "little")]
    for key in keys:
        if not isinstance(key, tuple) or not key or key[0] not in EXTRA_KEY_KINDS:
            raise UnkeyableRequest(f"an extra key of unknown kind: {key!r:.80}")
        out.append(len(key).to_bytes(4, "little"))
        out.extend(_encode_value(v) for v in key)
    return b"".join(out)


def fold_extra_keys(key: bytes, encoded: bytes) -> bytes:
    """A block's key with its encoded extra keys folded in (see the module docstring)."""
    return hashlib.blake2b(key + b"\x01extra" + encoded, digest_size=KEY_BYTES).digest()


def request_seed(seed: bytes, parts: Sequence[tuple[object, ...]]) -> bytes:
    """``k_{-1}`` of one request: the deployment's :func:`~hylinker.components.keys.geometry_seed` with the request-wide
    parts that are not block extra keys (the LoRA adapter's weights digest) folded in."""
    return fold_extra_keys(seed, encode_extra_keys(parts)) if parts else seed


#: a request's extra keys of block ``i`` (``extras(i)``), encoded; None where it has none
BlockExtras = Callable[[int], "bytes | None"]


class BlockKeys:
    """A request's chained block keys, extended as its tokens grow. ``extras``: the request's
    per-block extra keys (None: a plain request, none on any block); it may raise
    :class:`UnkeyableRequest`, and then the keys stop at the block before."""

    def __init__(self, seed: bytes, block_size: int, extras: BlockExtras | None = None) -> None:
        self.seed = seed
        self.block_size = block_size
        self.extras = extras
        self.keys: list[bytes] = []

    def extend(self, tokens: Sequence[int], n_blocks: int | None = None) -> list[bytes]:
        """Keys of the first ``n_blocks`` whole blocks of ``tokens`` (all whole blocks if None)."""
        bs = self.block_size
        whole = len(tokens) // bs
        want = whole if n_blocks is None else min(n_blocks, whole)
        if want > len(self.keys):
            lo = len(self.keys) * bs
            arr = as_tokens(np.asarray(tokens[lo: want * bs], dtype=np.int64))
            if self.extras is None:
                parent = self.keys[-1] if self.keys else self.seed
                self.keys.extend(page_keys(arr, bs, parent))
            else:
                self._extend_with_extras(arr, want)
        return self.keys[:want]

    def _extend_with_extras(self, arr: np.ndarray, want: int) -> None:
        """Keys of blocks ``len(self.keys)..want-1`` (``arr``: their tokens): runs of blocks without
        extra keys chained in one :func:`page_keys` call, a block with extra keys folded alone."""
        assert self.extras is not None
        bs = self.block_size
        extras: list[bytes | None] = []
        failure: UnkeyableRequest | None = None
        for i in range(len(self.keys), want):
            try:
                extras.append(self.extras(i))
            except UnkeyableRequest as exc:
                failure = exc  # the keys stop at the block before
                break
        j = 0
        while j < len(extras):
            parent = self.keys[-1] if self.keys else self.seed
            extra = extras[j]
            if extra is not None:
                self.keys.append(fold_extra_keys(page_keys(arr[j * bs:(j + 1) * bs], bs, parent)[0], extra))
                j += 1
                continue
            k = j
            while k < len(extras) and extras[k] is None:
                k += 1
            self.keys.extend(page_keys(arr[j * bs:k * bs], bs, parent))
            j = k
        if failure is not None:
            raise failure


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
    blocks = last - first
    cols = [present[c::per_block] for c in range(per_block)]
    n_attn, n_state = len(groups.attention), len(groups.state)
    needs = [(ALL_PAGES, col) for col in cols[:n_attn]]
    needs += [(TRAILING_PAGES, col) for col in cols[n_attn:n_attn + n_state]]
    needs += [(window(need), col) for (_g, need), col in zip(groups.window, cols[n_attn + n_state:])]
    found = restorable_stops(needs, blocks)
    return first + found[-1] if found else first


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
    "EXTRA_KEY_KINDS",
    "BlockExtras",
    "BlockKeys",
    "Groups",
    "LoadSpec",
    "TransferPlan",
    "UnkeyableRequest",
    "attention_key",
    "encode_extra_keys",
    "fold_extra_keys",
    "geometry_seed",
    "load_plan",
    "request_seed",
    "restorable_blocks",
    "state_key",
    "window_blocks",
]
