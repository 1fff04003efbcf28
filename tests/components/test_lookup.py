"""LOOKUP arithmetic: ALL_PAGES for KV/draft, TRAILING_PAGES for MAMBA, intersect, fail closed."""

from __future__ import annotations

import random

import pytest

from hylinker.components.layout import PoolKind
from hylinker.components.lookup import all_pages, restorable_page_counts, trailing_pages

FULL, MAMBA, DRAFT = PoolKind.FULL, PoolKind.MAMBA, PoolKind.DRAFT


def bits(s: str) -> list[bool]:
    """``"11.1"`` -> present, present, missing, present."""
    return [c == "1" for c in s]


@pytest.mark.parametrize(("b", "expected"), [
    ("", set()),
    ("0", set()),
    ("1", {1}),
    ("1111", {1, 2, 3, 4}),
    ("1101", {1, 2}),
    ("0111", set()),
    ("1110", {1, 2, 3}),
])
def test_all_pages(b: str, expected: set[int]) -> None:
    assert all_pages(bits(b)) == expected


@pytest.mark.parametrize(("b", "expected"), [
    ("", set()),
    ("0000", set()),
    ("0101", {2, 4}),
    ("1000", {1}),
    ("0001", {4}),
    ("1111", {1, 2, 3, 4}),
])
def test_trailing_pages(b: str, expected: set[int]) -> None:
    assert trailing_pages(bits(b)) == expected


# pages a, b, c, d after the device hit; "1" = the pool's object for that page exists.
CASES: list[tuple[str, dict[PoolKind, str], set[int]]] = [
    ("kv abcd, mamba after b and d", {FULL: "1111", MAMBA: "0101"}, {2, 4}),
    ("plus complete draft", {FULL: "1111", MAMBA: "0101", DRAFT: "1111"}, {2, 4}),
    ("draft missing d", {FULL: "1111", MAMBA: "0101", DRAFT: "1110"}, {2}),
    ("draft missing entirely", {FULL: "1111", MAMBA: "0101", DRAFT: "0000"}, set()),
    ("draft missing a", {FULL: "1111", MAMBA: "0101", DRAFT: "0111"}, set()),
    ("kv gap at c", {FULL: "1101", MAMBA: "0101"}, {2}),
    ("kv gap at a", {FULL: "0111", MAMBA: "0101"}, set()),
    ("state only at the gap", {FULL: "1101", MAMBA: "0001"}, set()),
    ("state only at an interior page", {FULL: "1111", MAMBA: "0100"}, {2}),
    ("no states", {FULL: "1111", MAMBA: "0000"}, set()),
    ("states without kv", {FULL: "0000", MAMBA: "1111"}, set()),
    ("pure attention", {FULL: "1110"}, {1, 2, 3}),
    ("pure attention with draft", {FULL: "1111", DRAFT: "1100"}, {1, 2}),
    ("mamba alone", {MAMBA: "0101"}, {2, 4}),
    ("empty probe", {FULL: "", MAMBA: "", DRAFT: ""}, set()),
    ("empty kv", {FULL: ""}, set()),
]


@pytest.mark.parametrize(("pools", "expected"), [(p, e) for _, p, e in CASES], ids=[c for c, _, _ in CASES])
def test_restorable_page_counts(pools: dict[PoolKind, str], expected: set[int]) -> None:
    assert restorable_page_counts({k: bits(v) for k, v in pools.items()}) == expected


def test_no_pools_is_a_caller_error() -> None:
    with pytest.raises(ValueError):
        restorable_page_counts({})


def test_result_never_exceeds_what_every_pool_can_restore() -> None:
    """Randomised fail-closed check: the maximum is loadable from every pool, exactly."""
    rng = random.Random(3)
    for _ in range(500):
        n = rng.randrange(0, 12)
        kv = [rng.random() < 0.9 for _ in range(n)]
        st = [rng.random() < 0.4 for _ in range(n)]
        dr = [rng.random() < 0.9 for _ in range(n)]
        got = restorable_page_counts({FULL: kv, MAMBA: st, DRAFT: dr})
        for m in range(1, n + 1):
            ok = all(kv[:m]) and all(dr[:m]) and st[m - 1]
            assert (m in got) is ok
        assert 0 not in got and all(1 <= m <= n for m in got)


def test_accepts_any_bool_sequence() -> None:
    assert restorable_page_counts({FULL: (True, True), MAMBA: [False, True]}) == {2}
    assert restorable_page_counts({FULL: [1, 1, 0], MAMBA: [0, 1, 1]}) == {2}  # type: ignore[list-item]
