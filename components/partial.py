"""Partial restores: how much of a load can be kept when some of its objects failed.

A load reads pages ``first_page .. first_page + n`` of every page pool (KV, draft) and, for a
hybrid layout, the recurrent state at one or more boundaries (the deepest one, plus fallbacks
the store probe found). A prefix of ``k`` pages can be restored when every page object below
``k`` landed and verified in every page pool, ``first_page + k`` lies on the grid, and — hybrid
only — the state at exactly ``k`` landed and verified. The kept prefix is the largest such
``k`` (0: nothing, the request recomputes).
"""

from __future__ import annotations

from collections.abc import Sequence


def restorable_prefixes(page_ok: Sequence[Sequence[bool]], *, n_pages: int, first_page: int,
                        grid_pages: int, states: Sequence[tuple[int, bool]] | None) -> list[int]:
    """Every restorable prefix (pages past ``first_page``, ascending, 0 excluded) of a partly
    failed load: what a rank can offer when ranks agree on one (``runtime/linker/agreement.py``).

    ``page_ok``: per page pool, whether each of the ``n_pages`` objects verified.
    ``states``: ``(pages, verified)`` per state the load read (None: not a hybrid layout).
    """
    good = n_pages
    for oks in page_ok:
        if len(oks) != n_pages:
            raise ValueError(f"a page pool reported {len(oks)} objects for {n_pages} pages")
        good = min(good, next((i for i, ok in enumerate(oks) if not ok), n_pages))
    if states is None:
        return [k for k in range(1, good + 1) if (first_page + k) % grid_pages == 0]
    return sorted({k for k, ok in states if ok and 0 < k <= good and (first_page + k) % grid_pages == 0})


def kept_pages(page_ok: Sequence[Sequence[bool]], *, n_pages: int, first_page: int,
               grid_pages: int, states: Sequence[tuple[int, bool]] | None) -> int:
    """The longest restorable prefix (pages past ``first_page``) of a partly failed load
    (0: nothing, the request recomputes); arguments as :func:`restorable_prefixes`."""
    return max(restorable_prefixes(page_ok, n_pages=n_pages, first_page=first_page,
                                   grid_pages=grid_pages, states=states), default=0)


__all__ = ["kept_pages", "restorable_prefixes"]
