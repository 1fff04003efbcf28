"""Buffers filled on hylinker's own threads start no OpenMP team (``stores/host_bytes.py``).

A torch op on a thread other than the engine's starts an OpenMP team for that thread; beside the
engine's own team, GNU OpenMP then throttles every team's wait and the engine's forward slows
(docs/figures/vllm-peers.md). A team is native threads that Python does not
know: each check runs its call on a fresh thread, held alive while the process's threads are
counted, and counts the threads that appeared besides it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from hylinker.stores.host_bytes import copy_bytes, zero_fill, zeroed
from hylinker.stores.mooncake_rows import HEADER_ARENA_MIN_BYTES, HeaderArenas
from hylinker.testing.threads import tasks, threads_started_by

NBYTES = 1 << 20  # far above torch's grain (32,768 elements): its fill runs in parallel


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


# ---- copies on hylinker's own threads: capped at one OpenMP thread (one_openmp_thread) -------------

COPY_ELEMENTS = 1 << 20  # one copy far above torch's grain: uncapped, it runs on a team


def _team_threads() -> int:
    """Native threads Python does not know: OpenMP teams (and other native helpers)."""
    known = {t.native_id for t in threading.enumerate()}
    return len(tasks() - known)


async def _copies_on_worker_threads() -> int:
    """Team threads that two worker threads' large copies left running (the threads exist first)."""
    from hylinker.stores.worker_threads import WorkerThreads

    src = torch.ones(COPY_ELEMENTS, dtype=torch.uint8)
    dst = torch.empty(COPY_ELEMENTS, dtype=torch.uint8)
    src_rows = src.view(16, -1)
    rows, index = torch.empty_like(src_rows), torch.arange(16)
    threads = WorkerThreads(2, "omp-check")
    try:
        await asyncio.gather(*(threads.run(lambda: None) for _ in range(4)))
        before = _team_threads()
        for _ in range(4):
            await asyncio.gather(threads.run(dst.copy_, src), threads.run(rows.index_copy_, 0, index, src_rows))
        assert torch.equal(dst, src) and torch.equal(rows, src_rows)
        return _team_threads() - before
    finally:
        threads.close(5)


def test_copies_on_worker_threads_start_no_team_and_leave_the_callers_width(two_intra_op_threads: None) -> None:
    assert asyncio.run(_copies_on_worker_threads()) == 0
    assert torch.get_num_threads() == 2  # the cap is the worker thread's own, not the process's


def test_the_team_count_sees_uncapped_worker_threads(two_intra_op_threads: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: without the cap the same copies start a team on the worker threads."""
    monkeypatch.setattr("hylinker.stores.worker_threads.one_openmp_thread", lambda: None)
    assert asyncio.run(_copies_on_worker_threads()) >= 1


@pytest.mark.parametrize("layers", [1, 2, 8])
def test_an_offload_and_a_load_through_the_sync_plane_start_no_team(two_intra_op_threads: None,
                                                                    layers: int) -> None:
    """End to end on the facade the engines use: 128 KiB pages per layer part offloaded and loaded
    back (exact) through its loop thread and copy workers, and no team appears in the process."""
    from hylinker.components.layout import PoolKind
    from hylinker.components.pool_view import PoolSet, kv_view
    from hylinker.runtime.dataplane.plane import DataPlaneConfig, Transfer
    from hylinker.runtime.dataplane.sync_plane import SyncDataPlane
    from hylinker.stores.embedded import EmbeddedStore

    page, pages = 16, 8
    g = torch.Generator().manual_seed(layers)
    k = [torch.randint(0, 256, (page * pages, 8192), generator=g, dtype=torch.uint8) for _ in range(layers)]
    v = [torch.randint(0, 256, (page * pages, 8192), generator=g, dtype=torch.uint8) for _ in range(layers)]
    pools = PoolSet([kv_view(k, v, layer_ids=list(range(layers)), page_size=page)])
    rows = torch.arange(page * 2).reshape(2, page)  # pages 0 and 1 out, into pages 2 and 3
    source = [t[: 2 * page].clone() for t in (*k, *v)]
    config = DataPlaneConfig(inline_copy_bytes=1)  # every copy on the copy workers
    with SyncDataPlane(pools, lambda: EmbeddedStore(64 << 20), config, namespace="omp") as dp:
        assert dp.offload([Transfer(PoolKind.FULL, ["w0", "w1"], rows)]).result(30).ok
        before = _team_threads()
        for i in range(3):
            assert dp.offload([Transfer(PoolKind.FULL, [f"o{i}a", f"o{i}b"], rows)]).result(30).ok
            assert dp.load([Transfer(PoolKind.FULL, ["w0", "w1"], rows + 2 * page)]).result.result(30).ok
        started = _team_threads() - before
    assert started == 0
    assert all(torch.equal(t[2 * page: 4 * page], s) for t, s in zip((*k, *v), source))


def test_copy_bytes_starts_no_team_and_copies(two_intra_op_threads: None) -> None:
    src = torch.randint(0, 255, (NBYTES,), dtype=torch.uint8)
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    assert threads_started_by(lambda: copy_bytes(dst, src)) == 0
    assert torch.equal(dst, src)
