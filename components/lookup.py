"""The hit rule: per-pool existence bits in, the restorable page counts (stops) out — the one
rule the ``Linker`` (``runtime/linker/lookup_room.py``), the SGLang plugin
(``integrations/sglang/linker.py``) and the vLLM connector (``integrations/vllm/plan.py``) apply.

Bit ``i`` of a pool says whether that pool's object for probed page ``i`` (the ``i``-th whole
page after the engine's own hit) exists in the store. Each pool needs, for a stop at ``n``
pages, one of three things (SGLang's words for them):

* ALL_PAGES (full-attention KV, draft KV): every page below ``n`` — bits ``0 .. n-1`` all set;
* TRAILING_PAGES (a recurrent state): the state keyed by the last page before the stop —
  bit ``n-1``; a state is valid only at the end of its run;
* a window (sliding-window KV of ``w`` pages): the ``w`` pages below the stop, or all of them
  when fewer were probed — bits ``max(0, n-w) .. n-1``.

The stops are the intersection of every pool's set; callers take the largest. The empty set
means a miss: the lookup fails closed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from .layout import PoolKind


class Need(enum.Enum):
    """What one pool needs below a stop."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    WINDOW = "window"


@attrs.frozen
class PageNeed:
    """One pool's need; ``window``: the pages a WINDOW pool needs below a stop (>= 1)."""

    need: Need
    window: int = 0

    def __attrs_post_init__(self) -> None:
        if (self.need is Need.WINDOW) != (self.window >= 1):
            raise ValueError(f"{self.need.value} with a window of {self.window} pages: only a WINDOW need "
                             "has a window, of at least one page")


ALL_PAGES = PageNeed(Need.ALL_PAGES)
TRAILING_PAGES = PageNeed(Need.TRAILING_PAGES)


def window(pages: int) -> PageNeed:
    """A sliding window's need: the ``pages`` pages below a stop."""
    return PageNeed(Need.WINDOW, pages)


def stops(need: PageNeed, bits: Sequence[bool]) -> set[int]:
    """The page counts ``n`` in ``1 .. len(bits)`` one pool can restore."""
    if need.need is Need.TRAILING_PAGES:
        return {i + 1 for i, b in enumerate(bits) if b}
    if need.need is Need.ALL_PAGES:
        k = 0
        while k < len(bits) and bits[k]:
            k += 1
        return set(range(1, k + 1))
    out: set[int] = set()
    run = 0  # set bits in a row ending at page n-1
    for i, b in enumerate(bits):
        run = run + 1 if b else 0
        if run >= min(need.window, i + 1):
            out.add(i + 1)
    return out


def restorable_stops(pools: Sequence[tuple[PageNeed, Sequence[bool]]], pages: int) -> list[int]:
    """The page counts in ``1 .. pages`` every pool can restore, ascending (each pool's bits
    cover the ``pages`` probed pages)."""
    result = set(range(1, pages + 1))
    for need, bits in pools:
        if len(bits) != pages:
            raise ValueError(f"{len(bits)} bits for {pages} probed pages")
        result &= stops(need, bits)
    return sorted(result)


def all_pages(bits: Sequence[bool]) -> set[int]:
    """``{1 .. k}`` where ``k`` is the length of the leading run of set bits."""
    return stops(ALL_PAGES, bits)


def trailing_pages(bits: Sequence[bool]) -> set[int]:
    """``{n : bits[n-1]}``."""
    return stops(TRAILING_PAGES, bits)


def restorable_page_counts(bits: Mapping[PoolKind, Sequence[bool]]) -> set[int]:
    """Intersect the restorable page counts of every pool in ``bits`` (the ``Linker``'s pools:
    FULL/DRAFT all pages, MAMBA trailing pages)."""
    if not bits:
        raise ValueError("no pools to intersect")
    result: set[int] | None = None
    for pool, b in bits.items():
        s = stops(TRAILING_PAGES if pool is PoolKind.MAMBA else ALL_PAGES, b)
        result = s if result is None else result & s
    assert result is not None
    return result
