"""Buffers filled on hylinker's own threads start no OpenMP team (``stores/host_bytes.py``).

A torch op on a thread other than the engine's starts an OpenMP team for that thread; beside the
engine's own team, GNU OpenMP then throttles every team's wait and the engine's forward slows
(docs/figures.md, "Where the miss's time went"). A team is native threads that Python does not
know: each check runs its call on a fresh thread, held alive while the process's threads are
counted, and counts the threads that appeared besides it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hylinker.stores.host_bytes import zero_fill, zeroed
from hylinker.stores.mooncake_rows import HEADER_ARENA_MIN_BYTES, HeaderArenas

NBYTES = 1 << 20  # far above torch's grain (32,768 elements): its fill runs in parallel


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def threads_started_by(fn: Callable[[], Any]) -> int:
    """Native threads that ``fn``, run on a fresh thread, started and left running."""
    before = _tasks()
    ran, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
        ran.set()
        done.wait(10)

    t = threading.Thread(target=body, name="host-bytes-check")
    t.start()
    try:
        assert ran.wait(10)
        started = _tasks() - before - {t.native_id}
    finally:
        done.set()
        t.join()
    if errors:
        raise errors[0]
    return len(started)


@pytest.fixture
def two_intra_op_threads() -> Iterator[None]:
    """torch on two intra-op threads (as vLLM's CPU build on this host), whatever the host has."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def test_the_count_sees_a_team_torch_starts(two_intra_op_threads: None) -> None:
    """The control: torch's own fill on a fresh thread starts a team, and the count sees it."""
    assert threads_started_by(lambda: torch.empty(NBYTES, dtype=torch.uint8).fill_(0)) >= 1


def test_zeroed_starts_no_team(two_intra_op_threads: None) -> None:
    box: list[torch.Tensor] = []
    assert threads_started_by(lambda: box.append(zeroed(NBYTES))) == 0
    assert box[0].numel() == NBYTES and not box[0].any()
    dirty = torch.full((NBYTES,), 7, dtype=torch.uint8)
    assert threads_started_by(lambda: zero_fill(dirty)) == 0
    assert not dirty.any()


class _Client:
    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return 0


class _Batches:
    def __init__(self) -> None:
        self.client = _Client()


def test_a_header_arena_taken_on_a_store_thread_starts_no_team(two_intra_op_threads: None) -> None:
    """The Mooncake store takes its header arenas on anyio's worker threads, during a save or
    a load in vLLM's step: the arena is zeroed there without a team."""
    batches = _Batches()
    arenas = HeaderArenas(batches)  # type: ignore[arg-type]
    got: list[torch.Tensor] = []
    assert threads_started_by(lambda: got.append(arenas.take(4 * HEADER_ARENA_MIN_BYTES // 64))) == 0
    assert got[0].numel() == 4 * HEADER_ARENA_MIN_BYTES and not got[0].any()
    assert batches.client.registered == [(got[0].data_ptr(), got[0].numel())]
