"""Page keys: a chained cryptographic hash per whole page.

``k_{-1} = H(fingerprint ‖ salt ‖ identity)`` (identity: the weights, ``model_revision``, the
integrity level; ``components/identity.py``), ``k_i = H(k_{i-1} ‖ tokens of page i)`` with BLAKE2b-128
over little-endian int32 token ids. Two prompts share ``k_i`` exactly when they share the
first ``i + 1`` pages, the model layout and the tenant salt, so requests with different salts
never share a key. An *object key* names one pool's object for one page on one rank:
``{k_i hex}:{pool}:{rank term}``.

A request's own extra keys (docs/design/decisions.md, "Isolation keys") fold into the same chain: its
salt and adapter into the seed (:func:`request_seed`: every page key changes), each
multimodal input (:class:`MultimodalSpan`) into the pages its placeholder tokens overlap
(:func:`page_keys` ``multimodal=``: those pages and, chained, every later one).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from .layout import ModelLayout, PoolKind

KEY_BYTES = 16
MAX_TOKEN_ID = 2**31 - 1


class TokenError(ValueError):
    """Token ids are not a 1-D sequence of ints in ``[0, 2**31)``."""


def as_tokens(tokens: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int32]:
    """Validate token ids and return them as a contiguous little-endian int32 array."""
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise TokenError(f"token ids are not an array of ints: {exc}") from None
    if arr.ndim != 1:
        raise TokenError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise TokenError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > MAX_TOKEN_ID:
        raise TokenError(f"token ids must lie in [0, {MAX_TOKEN_ID}], got range [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype="<i4")


def _salt_bytes(salt: object, field: str) -> bytes:
    if salt is None:
        return b""
    if isinstance(salt, str):
        return salt.encode()
    if isinstance(salt, bytes):
        return salt
    raise TypeError(f"{field} must be a str or bytes (or None), got {type(salt).__name__}")


def namespace_seed(layout: ModelLayout, salt: bytes | str | None = None, *, identity: bytes = b"") -> bytes:
    """``k_{-1}``: the layout fingerprint, mixed with an optional tenant salt and the
    deployment's ``identity`` (:func:`~hylinker.components.identity.namespace_term`: the
    weights' fingerprint, ``model_revision``, the integrity level; the ``Linker`` always
    passes one)."""
    raw = _salt_bytes(salt, "salt")
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(layout.fingerprint)
    if raw:
        h.update(b"\x00salt\x00")
        h.update(raw)
    if identity:
        h.update(_term(b"identity", identity))
    return h.digest()


def geometry_seed(model: str, geometry: str, salt: str, identity: bytes = b"") -> bytes:
    """The vLLM connector's ``k_{-1}``: the model, the cache geometry (dtype, block size, page
    bytes per group), the tenant salt and ``identity``
    (:func:`~hylinker.components.identity.namespace_term`). Engines agree on keys exactly when
    they agree on all four.

    Why not :func:`namespace_seed`: vLLM describes its cache as KV cache groups, not as a
    :class:`~hylinker.components.layout.ModelLayout`, so there is no layout fingerprint to hash;
    and the bytes hashed here (``model\\0geometry\\0salt\\0identity``) are what the keys vLLM
    deployments have already stored were made of, so they stay as they are."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in (model, geometry, salt):
        h.update(part.encode())
        h.update(b"\x00")
    if identity:
        h.update(identity)
    return h.digest()


def _term(tag: bytes, value: bytes) -> bytes:
    """``tag ‖ len ‖ value``: one unambiguous field of a hashed record."""
    return tag + struct.pack("<Q", len(value)) + value


def request_seed(seed: bytes, *, salt: bytes | str | None = None, adapter: str | None = None) -> bytes:
    """The seed of one request's chain: ``seed`` (the deployment's) with the request's tenant
    salt and adapter folded in. Neither given (or an empty salt): ``seed`` itself.

    Raises ``TypeError`` for a salt that is not str/bytes or an adapter that is not a str, and
    ``ValueError`` for an empty adapter name.
    """
    raw = _salt_bytes(salt, "salt")
    if adapter is not None and not isinstance(adapter, str):
        raise TypeError(f"adapter must be a str (the adapter's name or id) or None, got {type(adapter).__name__}")
    if adapter == "":
        raise ValueError("adapter must be a non-empty str, or None for the base model")
    if not raw and adapter is None:
        return seed
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"hylinker-request")
    h.update(seed)
    if raw:
        h.update(_term(b"salt", raw))
    if adapter is not None:
        h.update(_term(b"adapter", adapter.encode()))
    return h.digest()


def _span_int(inst: object, attr: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"MultimodalSpan.{attr.name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"MultimodalSpan.{attr.name} must be >= 0, got {value}")


def _span_hash(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, (bytes, str)):
        raise TypeError(f"MultimodalSpan.hash must be bytes or str, got {type(value).__name__}")
    if not value:
        raise ValueError("MultimodalSpan.hash must not be empty")


@attrs.frozen
class MultimodalSpan:
    """One multimodal input of a prompt: its placeholder tokens ``[start, end)`` and a hash of
    its content (bytes, or a str taken as utf-8). Every page the span overlaps, and every page
    after it, gets other keys than the same tokens with another content hash."""

    start: int = attrs.field(validator=_span_int)
    end: int = attrs.field(validator=_span_int)
    hash: bytes | str = attrs.field(validator=_span_hash)

    def __attrs_post_init__(self) -> None:
        if self.end <= self.start:
            raise ValueError(f"MultimodalSpan covers no tokens: end {self.end} <= start {self.start}")

    def term(self) -> bytes:
        """What this span adds to the key of a page it overlaps (16 bytes)."""
        content = self.hash.encode() if isinstance(self.hash, str) else self.hash
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"hylinker-mmspan")
        h.update(struct.pack("<QQ", int(self.start), int(self.end)))
        h.update(content)
        return h.digest()


def check_multimodal(spans: Sequence[MultimodalSpan] | None, n_tokens: int) -> tuple[MultimodalSpan, ...]:
    """Validate a request's multimodal spans against its ``n_tokens`` prompt: each a
    :class:`MultimodalSpan` inside the prompt, sorted by start, none overlapping another
    (None: none)."""
    if spans is None:
        return ()
    if isinstance(spans, (str, bytes, MultimodalSpan)) or not isinstance(spans, Sequence):
        raise TypeError(f"multimodal must be a sequence of MultimodalSpan, got {type(spans).__name__}")
    out = tuple(spans)
    prev_end = 0
    for i, span in enumerate(out):
        if not isinstance(span, MultimodalSpan):
            raise TypeError(f"multimodal[{i}] must be a MultimodalSpan, got {type(span).__name__}")
        if span.end > n_tokens:
            raise ValueError(f"multimodal[{i}] [{span.start}, {span.end}) lies outside the prompt of "
                             f"{n_tokens} tokens")
        if span.start < prev_end:
            raise ValueError(f"multimodal[{i}] [{span.start}, {span.end}) overlaps or precedes the "
                             f"span before it (ending at {prev_end}): spans must be sorted and disjoint")
        prev_end = span.end
    return out


def page_keys(
    tokens: npt.NDArray[np.int32],
    page_size: int,
    parent_key: bytes,
    *,
    start_page: int = 0,
    max_pages: int | None = None,
    multimodal: Sequence[MultimodalSpan] = (),
) -> list[bytes]:
    """Chained keys of the whole pages ``start_page, start_page + 1, ...`` of ``tokens``.

    ``parent_key`` is the key of page ``start_page - 1`` (the namespace seed for page 0).
    A trailing partial page gets no key. ``tokens`` must come from :func:`as_tokens`.
    ``multimodal``: the prompt's spans (sorted, disjoint: :func:`check_multimodal`); a page
    they overlap hashes their :meth:`MultimodalSpan.term` after its tokens.
    """
    if not isinstance(tokens, np.ndarray) or tokens.dtype != np.dtype("<i4") or tokens.ndim != 1 \
            or not tokens.flags.c_contiguous:
        raise TokenError("page_keys needs a contiguous 1-D little-endian int32 array; use as_tokens()")
    n_pages = len(tokens) // page_size
    if max_pages is not None:
        n_pages = min(n_pages, start_page + max_pages)
    data = tokens.data.cast("B") if len(tokens) else memoryview(b"")
    step = page_size * 4
    out: list[bytes] = []
    prev = parent_key
    blake = hashlib.blake2b
    if not multimodal:
        for i in range(start_page, n_pages):
            prev = blake(prev + data[i * step : (i + 1) * step], digest_size=KEY_BYTES).digest()
            out.append(prev)
        return out
    terms = [(s.start, s.end, s.term()) for s in multimodal]
    j = 0  # the first span that may overlap the current page (spans are sorted)
    for i in range(start_page, n_pages):
        lo, hi = i * page_size, (i + 1) * page_size
        while j < len(terms) and terms[j][1] <= lo:
            j += 1
        k, parts = j, []
        while k < len(terms) and terms[k][0] < hi:
            parts.append(terms[k][2])  # starts below hi, ends above lo (k >= j): overlaps
            k += 1
        extra = b"".join(parts)
        prev = blake(prev + data[i * step : (i + 1) * step] + extra, digest_size=KEY_BYTES).digest()
        out.append(prev)
    return out


# ---- object keys: one format per front --------------------------------------------------
# The three fronts name the same thing (one pool's bytes of one page on some ranks) with the
# same parts, page key first, but not in the same words, and keys already stored must keep
# their bytes (docs/design/rules.md, "Key formats"):
# * the Linker: ``{k hex}:{pool}:{rank term}`` — its own chained keys, its own layout;
# * the SGLang plugin: ``{SGLang's page key}:{namespace}:{pool}:{rank term}cp{c}pp{p}`` — the
#   page key is SGLang's (its HiCache hash, shared with other storage backends), so the suffix
#   carries hylinker's namespace (the seed the Linker hashes into its keys) and the context- and
#   pipeline-parallel ranks SGLang splits pools by;
# * the vLLM connector: ``{k hex}:kv:g{group}`` / ``{k hex}:state:g{group}`` (a rank-free name,
#   vLLM's KV cache groups, not pools: the scheduler plans with names), then ``:r{owner rank}``
#   (:func:`rank_key`) on the worker that moves the bytes (replicas share their owner's key).


def object_key_suffix(pool: PoolKind, layout: ModelLayout) -> str:
    """The part of an object key after the page key: ``:{pool}:{rank term}``."""
    return f":{pool.value}:{layout.rank_term(pool)}"


def object_key(page_key: bytes, pool: PoolKind, layout: ModelLayout) -> str:
    """Store key of ``pool``'s object for the page ``page_key`` on this rank."""
    return page_key.hex() + object_key_suffix(pool, layout)


def object_keys(page_keys: Sequence[bytes], pool: PoolKind, layout: ModelLayout) -> list[str]:
    """:func:`object_key` for many pages at once."""
    suffix = object_key_suffix(pool, layout)
    return [k.hex() + suffix for k in page_keys]


def sglang_key_suffix(namespace: str, pool: PoolKind, rank_term: str, cp_rank: int, pp_rank: int) -> str:
    """What the SGLang plugin appends to SGLang's page key (see the comment above)."""
    return f":{namespace}:{pool.value}:{rank_term}cp{cp_rank}pp{pp_rank}"


RANK_MARK = ":r"


def attention_key(block_key: bytes, group: int) -> str:
    """The vLLM connector's name of an attention (or sliding-window) group's block."""
    return f"{block_key.hex()}:kv:g{group}"


def state_key(block_key: bytes, group: int) -> str:
    """The vLLM connector's name of a state group's state after a block."""
    return f"{block_key.hex()}:state:g{group}"


def rank_key(name: str, rank: int) -> str:
    """The store key of rank ``rank``'s shard of the vLLM connector's object ``name``."""
    return f"{name}{RANK_MARK}{rank}"
