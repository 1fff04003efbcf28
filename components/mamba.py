"""Grid rules for recurrent-state checkpoints, as pure functions.

A linear-attention kernel advances its state a chunk (``C`` tokens) at a time, and the
radix tree stores whole pages (``P`` tokens). A state is restorable only at a boundary that
is both a page end and a chunk end of the schedule that produced it, so checkpoints live on
the grid ``G = lcm(C, P)``: the smallest boundary that is a multiple of both.

SGLang uses ``lcm(max(C, P), P)``, which equals ``lcm(C, P)`` unless the page is larger than
the chunk and not a multiple of it: page 96 with chunk 64 gives 96 there, a boundary in the
middle of a chunk, so a prefill resumed there runs another chunk schedule than an
uninterrupted one and the restored state is not bit-exact. Here that pair gives 192.
"""

from __future__ import annotations

import math

# A grid coarser than this many times the larger of chunk and page is refused by layouts: a
# prefix would lose up to that many units of work to the grid (page 100 with chunk 64 would
# restore only every 1,600 tokens).
MAX_GRID_FACTOR = 4


def checkpoint_grid(chunk: int, page: int) -> int:
    """``G = lcm(chunk, page)``: checkpoints exist only at multiples of ``G``.

    Every boundary on this grid is both a page end (the tree can key it) and a chunk end (a
    prefill resumed there runs the very chunks an uninterrupted one runs).
    """
    if chunk <= 0 or page <= 0:
        raise ValueError(f"chunk and page must be positive, got chunk={chunk} page={page}")
    return math.lcm(chunk, page)


def grid_unfit_reason(chunk: int, page: int) -> str | None:
    """Why a layout with this chunk and page should be refused, or ``None`` when it fits.

    It fits when the grid is at most :data:`MAX_GRID_FACTOR` times the larger of the two.
    """
    grid = checkpoint_grid(chunk, page)
    if grid <= MAX_GRID_FACTOR * max(chunk, page):
        return None
    return (f"page_size={page} and chunk_size={chunk} give a checkpoint grid of {grid} tokens "
            f"(lcm), more than {MAX_GRID_FACTOR}x the larger of the two: recurrent states could "
            "only be restored every "
            f"{grid} tokens. Use a page that divides the chunk or is a multiple of it")


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
