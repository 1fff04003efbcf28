"""LOOKUP arithmetic: per-pool existence bits in, the restorable page counts out.

Bit ``i`` of a pool says whether that pool's object for probed page ``i`` (the ``i``-th whole
page after the device hit) exists in the store.

* FULL and DRAFT need every page of a prefix (ALL_PAGES): ``n`` pages are restorable when
  bits ``0 .. n-1`` are all set.
* MAMBA needs the state keyed by the last page before the boundary (TRAILING_PAGES): ``n`` is
  restorable when bit ``n-1`` is set. A state is valid only at the end of its run.

The result is the intersection of every pool's set; callers take its maximum. The empty set
means a miss: the lookup fails closed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .layout import PoolKind


def all_pages(bits: Sequence[bool]) -> set[int]:
    """``{1 .. k}`` where ``k`` is the length of the leading run of set bits."""
    k = 0
    while k < len(bits) and bits[k]:
        k += 1
    return set(range(1, k + 1))


def trailing_pages(bits: Sequence[bool]) -> set[int]:
    """``{n : bits[n-1]}``."""
    return {i + 1 for i, b in enumerate(bits) if b}


def restorable_page_counts(bits: Mapping[PoolKind, Sequence[bool]]) -> set[int]:
    """Intersect the restorable page counts of every pool in ``bits``."""
    if not bits:
        raise ValueError("no pools to intersect")
    result: set[int] | None = None
    for pool, b in bits.items():
        s = trailing_pages(b) if pool is PoolKind.MAMBA else all_pages(b)
        result = s if result is None else result & s
    assert result is not None
    return result
