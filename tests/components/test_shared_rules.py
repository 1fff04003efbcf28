"""The rules the three fronts share (components/lookup.py's window and stops, components/ranks.py):
each against a plain reading of its definition, and the fronts' own entry points against them."""

from __future__ import annotations

import random

import pytest

from hylinker.components.layout import PoolKind
from hylinker.components.lookup import (
    ALL_PAGES,
    TRAILING_PAGES,
    PageNeed,
    restorable_stops,
    stops,
    window,
)
from hylinker.components.ranks import rank_term, replicated_writes, writes
from hylinker.integrations.vllm.plan import Groups, restorable_blocks


def reference(need: PageNeed, bits: list[bool]) -> set[int]:
    """The module docstring's words, one stop at a time."""
    out = set()
    for n in range(1, len(bits) + 1):
        if need is ALL_PAGES:
            ok = all(bits[:n])
        elif need is TRAILING_PAGES:
            ok = bits[n - 1]
        else:
            ok = all(bits[max(0, n - need.window):n])
        if ok:
            out.add(n)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_each_need_matches_its_definition(seed: int) -> None:
    rng = random.Random(seed)
    bits = [rng.random() < 0.8 for _ in range(rng.randrange(0, 14))]
    for need in (ALL_PAGES, TRAILING_PAGES, window(1), window(2), window(rng.randrange(1, 9))):
        assert stops(need, bits) == reference(need, bits), (need, bits)


def test_window_examples() -> None:
    b = [c == "1" for c in "0110111"]
    assert stops(window(2), b) == {3, 6, 7}
    assert stops(window(1), b) == {2, 3, 5, 6, 7}
    assert stops(window(3), [True, True, False]) == {1, 2}  # fewer probed pages than the window: all of them


def test_a_need_is_well_formed() -> None:
    with pytest.raises(ValueError, match="window"):
        window(0)
    with pytest.raises(ValueError, match="window"):
        PageNeed(ALL_PAGES.need, 3)


def test_restorable_stops_intersects_and_checks_lengths() -> None:
    full = [True, True, True, False]
    state = [False, True, True, True]
    assert restorable_stops([(ALL_PAGES, full), (TRAILING_PAGES, state)], 4) == [2, 3]
    assert restorable_stops([], 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="3 bits for 4"):
        restorable_stops([(ALL_PAGES, full[:3])], 4)


@pytest.mark.parametrize("seed", range(30))
def test_vllm_restorable_blocks_is_the_shared_rule(seed: int) -> None:
    """vLLM's entry point against the brute-force per-group reading (its own docstring's rule)."""
    rng = random.Random(seed)
    groups = Groups(attention=tuple(range(rng.randrange(0, 3))), state=tuple(range(rng.randrange(0, 2))),
                    window=tuple((9, rng.randrange(1, 5)) for _ in range(rng.randrange(0, 2))))
    first, last = rng.randrange(0, 3), rng.randrange(3, 10)
    present = [rng.random() < 0.85 for _ in range(groups.per_block * (last - first))]
    per = groups.per_block
    cols = [present[c::per] for c in range(per)] if per else []
    want = first
    for n in range(1, last - first + 1):
        ok = all(all(c[:n]) for c in cols[:len(groups.attention)])
        ok = ok and all(c[n - 1] for c in cols[len(groups.attention):len(groups.attention) + len(groups.state)])
        for (_g, need), c in zip(groups.window, cols[len(groups.attention) + len(groups.state):]):
            ok = ok and all(c[max(0, n - need):n])
        if ok:
            want = first + n
    assert restorable_blocks(groups, first, last, present) == want


@pytest.mark.parametrize(("rank", "replicas", "expected"), [(0, 1, True), (3, 1, True), (0, 4, True),
                                                             (2, 4, False), (4, 4, True), (5, 2, False)])
def test_consecutive_replicas_the_first_writes(rank: int, replicas: int, expected: bool) -> None:
    assert writes(rank, replicas=replicas) is expected


@pytest.mark.parametrize(("rank", "copies", "expected"), [(0, 1, True), (1, 1, False), (1, 2, True), (2, 2, False)])
def test_repeating_copies_the_first_group_writes(rank: int, copies: int, expected: bool) -> None:
    assert writes(rank, copies=copies) is expected


def test_writer_rule_refuses_nonsense() -> None:
    for bad in ({"replicas": 0}, {"copies": 0}):
        with pytest.raises(ValueError):
            writes(0, **bad)
    with pytest.raises(ValueError, match="rank"):
        writes(-1)


def test_replicated_writes_and_rank_term() -> None:
    assert replicated_writes(5, replicated=False)
    assert not replicated_writes(1, replicated=True)
    assert replicated_writes(1, replicated=True, dcp_size=2, folded=True)
    assert not replicated_writes(1, replicated=True, dcp_size=2, folded=False)
    assert not replicated_writes(2, replicated=True, dcp_size=2, folded=True)
    assert rank_term(3, replicated=False) == "tp3"
    assert rank_term(3, replicated=True, dcp_rank=1) == "repdcp1"


def test_the_layout_and_sglang_agree_on_the_writer_and_the_term() -> None:
    """ModelLayout and the SGLang plugin's placement ask the same rule: same answers for the
    same rank, replication and DCP placement."""
    from hylinker.integrations.sglang.placement import key_suffix
    from hylinker.integrations.sglang.placement import writes as sglang_writes
    from hylinker.integrations.sglang.pools import DcpShare, SGLangPool

    class View:
        unit = 1

    for replicated in (False, True):
        for tp_rank in range(4):
            pool = SGLangPool(View(), replicated, None)  # type: ignore[arg-type]
            assert sglang_writes(pool, tp_rank, 1) is replicated_writes(tp_rank, replicated=replicated)
            term = rank_term(tp_rank, replicated=replicated)
            assert key_suffix(PoolKind.FULL, pool, "ns", tp_rank, 0, 0, 0) == f":ns:kv:{term}cp0pp0"
            dcp = SGLangPool(View(), replicated, DcpShare(2, tp_rank % 2, 1, lambda *a: None))  # type: ignore[arg-type]
            assert sglang_writes(dcp, tp_rank, 2) is replicated_writes(tp_rank, replicated=replicated, dcp_size=2,
                                                                       folded=True)
