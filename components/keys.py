"""Page keys: a chained cryptographic hash per whole page.

``k_{-1} = H(fingerprint ‖ salt)``, ``k_i = H(k_{i-1} ‖ tokens of page i)`` with BLAKE2b-128
over little-endian int32 token ids. Two prompts share ``k_i`` exactly when they share the
first ``i + 1`` pages, the model layout and the tenant salt, so requests with different salts
never share a key. An *object key* names one pool's object for one page on one rank:
``{k_i hex}:{pool}:{rank term}``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

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


def namespace_seed(layout: ModelLayout, salt: bytes | str | None = None) -> bytes:
    """``k_{-1}``: the layout fingerprint, mixed with an optional tenant salt."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(layout.fingerprint)
    if salt:
        h.update(b"\x00salt\x00")
        h.update(salt.encode() if isinstance(salt, str) else salt)
    return h.digest()


def page_keys(
    tokens: npt.NDArray[np.int32],
    page_size: int,
    parent_key: bytes,
    *,
    start_page: int = 0,
    max_pages: int | None = None,
) -> list[bytes]:
    """Chained keys of the whole pages ``start_page, start_page + 1, ...`` of ``tokens``.

    ``parent_key`` is the key of page ``start_page - 1`` (the namespace seed for page 0).
    A trailing partial page gets no key. ``tokens`` must come from :func:`as_tokens`.
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
    for i in range(start_page, n_pages):
        prev = blake(prev + data[i * step : (i + 1) * step], digest_size=KEY_BYTES).digest()
        out.append(prev)
    return out


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
