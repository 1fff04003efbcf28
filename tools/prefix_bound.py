"""What the prompts of a workload share: the infinite-cache bound on the prefix hit rate (what a
cache that forgot nothing could restore of each request) and the causal order (which earlier
request each one continues). Works on :class:`~hylinker.tools.workloads.Request` lists."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ..components.mamba import restorable_ceiling

if TYPE_CHECKING:
    from .workloads import Request


def bound_hits_per_request(
    requests: Sequence[Request], *, page_size: int, grid: int
) -> list[int]:
    """What an infinite cache could restore of each of ``requests`` (in the list's order), the
    cache having seen every request that arrived before it.

    The cache holds every whole page of every earlier prompt (and, for a hybrid model, a
    recurrent state at every grid multiple). A prompt of ``L`` tokens reuses the largest
    multiple of ``grid`` that is at most both ``floor((L-1)/grid)*grid`` (one token must be
    forwarded) and the longest page-aligned prefix an earlier prompt covered. For a
    non-hybrid layout pass ``grid=page_size``.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    if grid <= 0 or grid % page_size:
        raise ValueError(f"grid must be a positive multiple of page_size={page_size}, got {grid}")
    seen: set[bytes] = set()
    hits = [0] * len(requests)
    step = page_size * 4
    root = b"hylinker-bound"
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)  # stable for equal arrivals
    for index in order:
        tokens = requests[index].token_ids()
        n_tokens = len(tokens)
        data = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
        prev = root
        matched = 0
        missed = False
        for i in range(n_tokens // page_size):
            prev = xxhash.xxh3_128_digest(prev + data[i * step:(i + 1) * step])
            if missed:
                seen.add(prev)
            elif prev in seen:
                matched += 1
            else:
                missed = True
                seen.add(prev)
        common = matched * page_size
        hits[index] = min(restorable_ceiling(n_tokens, grid), common // grid * grid)
    return hits


def bound_hit_tokens(
    requests: Iterable[Request], *, page_size: int, grid: int
) -> tuple[int, int]:
    """What an infinite cache could restore on ``requests`` in arrival order
    (:func:`bound_hits_per_request`): ``(hit_tokens, prompt_tokens)``."""
    reqs = list(requests)
    hits = bound_hits_per_request(reqs, page_size=page_size, grid=grid)
    return sum(hits), sum(r.prompt_length for r in reqs)


def bound_hit_rate(requests: Iterable[Request], *, page_size: int, grid: int) -> float:
    """``hit_tokens / prompt_tokens`` of :func:`bound_hit_tokens` (0.0 for no prompt tokens)."""
    hit, total = bound_hit_tokens(requests, page_size=page_size, grid=grid)
    return hit / total if total else 0.0


# ---------------------------------------------------------------------------------------------
# Causal order


def causal_parents(requests: Sequence[Request], *, block_tokens: int = 0) -> list[int | None]:
    """For each request, the index of the earlier request it continues, or ``None``.

    Request ``R`` continues ``E`` (an earlier request in list order) when ``R``'s prompt
    extends ``E``'s and is longer: the next turn of a conversation contains the previous
    prompt. Of several such ``E`` the one with the longest prompt wins (ties: the latest).

    Without ``block_tokens`` a prompt extends ``E`` when ``E``'s segments are a prefix of its
    own. A block-granular trace (``block_tokens``, 512 for Mooncake) names blocks, and the
    previous turn's partial last block reappears in the next turn as a new, whole block: there
    ``E``'s whole blocks must be a prefix, and at least two of them (a one-block prompt
    shares only the system prompt every conversation starts with, so nothing says which
    conversation it began).
    """
    if block_tokens < 0:
        raise ValueError(f"block_tokens must be >= 0, got {block_tokens}")
    min_segments = 2 if block_tokens else 1
    # chained hash of the first k segments -> (prompt length, index) of the best earlier E
    known: dict[int, tuple[int, int]] = {}
    parents: list[int | None] = []
    for i, req in enumerate(requests):
        segs = req.prompt.segments
        chain: list[int] = []
        h = 0
        for seg in segs:
            h = hash((h, seg))
            chain.append(h)
        parent: tuple[int, int] | None = None
        for k in range(len(segs), 0, -1):
            got = known.get(chain[k - 1])
            if got is not None and got[0] < req.prompt_length and (parent is None or got > parent):
                parent = got
        parents.append(None if parent is None else parent[1])
        whole = len(segs)
        if block_tokens and segs and segs[-1][1] < block_tokens:
            whole -= 1
        if whole >= min_segments:
            key = chain[whole - 1]
            prev = known.get(key)
            if prev is None or (req.prompt_length, i) >= prev:
                known[key] = (req.prompt_length, i)
    return parents
