"""Grid rules for recurrent-state checkpoints, as pure functions.

A linear-attention kernel advances its state a chunk (``C`` tokens) at a time, and the
radix tree stores whole pages (``P`` tokens). A state is restorable only at a boundary that
is both a page end and a chunk end of the schedule that produced it, so checkpoints live on
the grid ``G = lcm(max(C, P), P)``.
"""

from __future__ import annotations

import math


def checkpoint_grid(chunk: int, page: int) -> int:
    """``G = lcm(max(chunk, page), page)``: checkpoints exist only at multiples of ``G``."""
    if chunk <= 0 or page <= 0:
        raise ValueError(f"chunk and page must be positive, got chunk={chunk} page={page}")
    return math.lcm(max(chunk, page), page)


def checkpoint_depth(prefix_len: int, extend_len: int, grid: int, chunk: int) -> int | None:
    """Where a prefill of ``extend_len`` tokens after a cached ``prefix_len`` donates a state.

    The depth sits on the absolute grid, ``floor((prefix + extend) / G) * G``; the prefill
    donates only if that lies past the prefix and a whole number of chunks after it (the
    kernel's state exists only at chunk ends of this prefill). Returns ``None`` otherwise.
    """
    if prefix_len < 0 or extend_len < 0 or grid <= 0 or chunk <= 0:
        raise ValueError(
            f"bad arguments: prefix_len={prefix_len} extend_len={extend_len} grid={grid} chunk={chunk}")
    depth = (prefix_len + extend_len) // grid * grid
    if depth > prefix_len and (depth - prefix_len) % chunk == 0:
        return depth
    return None


def restorable_ceiling(prompt_len: int, grid: int) -> int:
    """Deepest restorable prefix of a prompt: ``floor((L - 1) / G) * G`` (one token must run)."""
    if prompt_len < 0 or grid <= 0:
        raise ValueError(f"bad arguments: prompt_len={prompt_len} grid={grid}")
    if prompt_len == 0:
        return 0
    return (prompt_len - 1) // grid * grid
