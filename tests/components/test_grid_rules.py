"""Checkpoint grid rules: grid size, donation depth, restorable ceiling (hand-computed tables)."""

from __future__ import annotations

import math
import random

import pytest

from hylinker.components.layout import LayoutError, ModelLayout
from hylinker.components.mamba import (
    MAX_GRID_FACTOR,
    checkpoint_depth,
    checkpoint_grid,
    grid_unfit_reason,
    restorable_ceiling,
)


@pytest.mark.parametrize(("chunk", "page", "grid"), [
    (64, 16, 64),
    (64, 64, 64),
    (64, 256, 256),
    (64, 1, 64),
    (128, 64, 128),
    (64, 48, 192),  # lcm(64, 48)
    (32, 96, 96),
    # neither divides the other: SGLang's lcm(max(C, P), P) gives the page (96, 80, 384),
    # a boundary in the middle of a chunk; the grid must be a multiple of both
    (64, 96, 192),
    (32, 80, 160),
    (128, 384, 384),
    (256, 384, 768),
    (48, 64, 192),
])
def test_checkpoint_grid(chunk: int, page: int, grid: int) -> None:
    assert checkpoint_grid(chunk, page) == grid


def _sglang_grid(chunk: int, page: int) -> int:
    return math.lcm(max(chunk, page), page)


def test_grid_is_a_multiple_of_chunk_and_page_and_the_smallest_one() -> None:
    for chunk in (16, 32, 48, 64, 96, 128, 256):
        for page in (1, 16, 32, 48, 64, 80, 96, 128, 192, 256, 384):
            g = checkpoint_grid(chunk, page)
            assert g % chunk == 0 and g % page == 0
            assert not any(b % chunk == 0 and b % page == 0 for b in range(1, g))
            # SGLang's formula differs exactly when the page is larger than the chunk and not a
            # multiple of it
            assert (g != _sglang_grid(chunk, page)) == (page > chunk and page % chunk != 0)


def _schedule_ends(start: int, end: int, chunk: int) -> set[int]:
    """Chunk ends of a prefill of [start, end) cut on the absolute chunk grid."""
    return {min(end, (p // chunk + 1) * chunk) for p in range(start, end)}


@pytest.mark.parametrize(("chunk", "page"), [(64, 96), (64, 16), (64, 256), (32, 80)])
def test_every_grid_boundary_is_a_chunk_end_of_an_uninterrupted_prefill(chunk: int, page: int) -> None:
    # A resumed prefill starts at the boundary; it runs the same chunks as an uninterrupted one
    # only if the boundary is a chunk end of that one. SGLang's grid for 64/96 is not.
    g = checkpoint_grid(chunk, page)
    ends = _schedule_ends(0, 8 * g, chunk)
    assert all(b in ends for b in range(g, 8 * g, g))
    if chunk == 64 and page == 96:
        assert _sglang_grid(chunk, page) not in ends


def _layout(page: int, chunk: int) -> ModelLayout:
    return ModelLayout.create(page_size=page, chunk_size=chunk, full_layers=[0], kv_row_shape=(4,),
                              mamba_layers=[{"layer_id": 1, "conv_shape": (2,), "conv_dtype": "float32"}])


@pytest.mark.parametrize(("page", "chunk", "grid"), [(96, 64, 192), (48, 64, 192), (80, 32, 160),
                                                      (384, 256, 768), (16, 64, 64)])
def test_layouts_with_a_fit_grid_build(page: int, chunk: int, grid: int) -> None:
    assert _layout(page, chunk).grid == grid


@pytest.mark.parametrize(("page", "chunk"), [(100, 64), (60, 64), (96, 80), (17, 64)])
def test_layouts_with_an_unfit_grid_are_refused(page: int, chunk: int) -> None:
    assert checkpoint_grid(chunk, page) > MAX_GRID_FACTOR * max(chunk, page)
    with pytest.raises(LayoutError, match=f"page_size={page} and chunk_size={chunk}") as info:
        _layout(page, chunk)
    assert str(checkpoint_grid(chunk, page)) in str(info.value)
    assert grid_unfit_reason(chunk, page) == str(info.value)


def test_unfit_grid_does_not_matter_without_recurrent_layers() -> None:
    lay = ModelLayout.create(page_size=100, chunk_size=64, full_layers=[0], kv_row_shape=(4,))
    assert lay.grid == 100


@pytest.mark.parametrize(("chunk", "page"), [(0, 16), (64, 0), (-64, 16)])
def test_checkpoint_grid_rejects_non_positive(chunk: int, page: int) -> None:
    with pytest.raises(ValueError):
        checkpoint_grid(chunk, page)


# (prefix, extend, grid, chunk) -> depth, each computed by hand:
# depth = floor((prefix + extend) / G) * G; donate iff depth > prefix and (depth - prefix) % C == 0.
DEPTHS: list[tuple[int, int, int, int, int | None]] = [
    (16384, 4066, 256, 64, 20224),  # 20450 -> 79*256; 3840 = 60 chunks
    (16384, 4066, 64, 64, 20416),  # 20450 -> 319*64; 4032 = 63 chunks
    (0, 100, 64, 64, 64),
    (0, 64, 64, 64, 64),  # exactly one grid step
    (0, 63, 64, 64, None),  # depth 0 is not past the prefix
    (0, 0, 64, 64, None),
    (64, 63, 64, 64, None),  # 127 -> 64 = prefix
    (64, 64, 64, 64, 128),
    (100, 20, 64, 64, None),  # 120 -> 64 < prefix
    (32, 200, 64, 64, None),  # 232 -> 192; 160 is not a whole number of 64-token chunks
    (32, 200, 64, 32, 192),  # same with 32-token chunks: 160 = 5 chunks
    (256, 256, 256, 64, 512),
    (256, 255, 256, 64, None),
    (64, 500, 256, 64, 512),  # prefix off the grid but on a chunk: 448 = 7 chunks
    (96, 500, 256, 64, None),  # 596 -> 512; 416 is 6.5 chunks
    (16320, 100, 64, 64, 16384),
    (1000, 5000, 1024, 128, None),  # 6000 -> 5120; 4120 is not a multiple of 128
    (1024, 5000, 1024, 128, 5120),  # 4096 = 32 chunks
]


@pytest.mark.parametrize(("prefix", "extend", "grid", "chunk", "depth"), DEPTHS)
def test_checkpoint_depth(prefix: int, extend: int, grid: int, chunk: int, depth: int | None) -> None:
    assert checkpoint_depth(prefix, extend, grid, chunk) == depth


def test_known_depths_from_layouts() -> None:
    for page, depth in ((256, 20224), (64, 20416)):
        lay = ModelLayout.create(page_size=page, chunk_size=64, full_layers=[0], kv_row_shape=(4,),
                                 mamba_layers=[{"layer_id": 1, "conv_shape": (2,), "conv_dtype": "float32"}])
        assert checkpoint_depth(16384, 4066, lay.grid, lay.chunk_size) == depth


def _brute_depth(prefix: int, extend: int, grid: int, chunk: int) -> int | None:
    best = None
    for d in range(0, prefix + extend + 1):
        if d % grid == 0:
            best = d
    assert best is not None
    return best if best > prefix and (best - prefix) % chunk == 0 else None


def test_checkpoint_depth_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(400):
        chunk = rng.choice([16, 32, 64])
        page = rng.choice([16, 32, 64, 128])
        grid = checkpoint_grid(chunk, page)
        prefix = rng.randrange(0, 8) * rng.choice([page, chunk, grid]) + rng.choice([0, 0, 0, 1])
        extend = rng.randrange(0, 700)
        got = checkpoint_depth(prefix, extend, grid, chunk)
        assert got == _brute_depth(prefix, extend, grid, chunk)
        if got is not None:
            assert got % grid == 0 and prefix < got <= prefix + extend


@pytest.mark.parametrize("args", [(-1, 10, 64, 64), (0, -1, 64, 64), (0, 10, 0, 64), (0, 10, 64, 0)])
def test_checkpoint_depth_rejects_bad_arguments(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        checkpoint_depth(*args)


@pytest.mark.parametrize(("prompt", "grid", "ceiling"), [
    (16384, 64, 16320),  # one token must run: the full prompt is not restorable
    (16385, 64, 16384),
    (0, 64, 0),
    (1, 64, 0),
    (64, 64, 0),
    (65, 64, 64),
    (129, 64, 128),
    (1000, 256, 768),
    (1025, 256, 1024),
    (20450, 256, 20224),
    (17, 16, 16),
    (16, 16, 0),
])
def test_restorable_ceiling(prompt: int, grid: int, ceiling: int) -> None:
    assert restorable_ceiling(prompt, grid) == ceiling


def test_restorable_ceiling_properties() -> None:
    for grid in (16, 64, 256):
        for prompt in range(0, 5 * grid):
            c = restorable_ceiling(prompt, grid)
            assert c % grid == 0 and (c < prompt or prompt == 0)
            assert c + grid >= prompt  # nothing deeper fits


@pytest.mark.parametrize("args", [(-1, 64), (10, 0), (10, -64)])
def test_restorable_ceiling_rejects_bad_arguments(args: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        restorable_ceiling(*args)
