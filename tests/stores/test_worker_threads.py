"""The copy threads' rules (stores/worker_threads.py): results and errors come back, at most
``threads`` calls run at once, a cancelled caller resumes only after its call returned, context
variables reach the thread, close lets queued calls finish and refuses new ones."""

from __future__ import annotations

import contextvars
import threading
import time

import anyio
import anyio.to_thread
import pytest

from hylinker.stores.worker_threads import WorkerThreads

TAG: contextvars.ContextVar[str] = contextvars.ContextVar("TAG", default="none")


async def test_result_error_and_thread() -> None:
    pool = WorkerThreads(2, "t")
    try:
        assert await pool.run(lambda a, b: a + b, 2, 3) == 5
        assert await pool.run(threading.current_thread) is not threading.current_thread()
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 // 0)
        TAG.set("request-7")
        assert await pool.run(TAG.get) == "request-7"  # the caller's context, copied
    finally:
        pool.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
async def test_at_most_threads_calls_at_once(threads: int) -> None:
    pool = WorkerThreads(threads, "t")
    lock = threading.Lock()
    running, peak = [0], [0]

    def work() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(4 * threads):
                tg.start_soon(pool.run, work)
    finally:
        pool.close()
    assert peak[0] == threads


async def test_a_cancelled_caller_resumes_only_after_its_call_returned() -> None:
    pool = WorkerThreads(1, "t")
    started, release = threading.Event(), threading.Event()
    ended: list[float] = []

    def copy() -> str:
        started.set()
        release.wait(5)
        time.sleep(0.05)  # still writing the caller's buffer after the cancel
        ended.append(time.monotonic())
        return "done"

    left: list[float] = []
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                async def caller() -> None:
                    try:
                        await pool.run(copy)
                    finally:
                        left.append(time.monotonic())

                tg.start_soon(caller)
                await anyio.to_thread.run_sync(started.wait, 5)
                scope.cancel()
                release.set()
        assert scope.cancelled_caught
        assert ended and left and left[0] >= ended[0]  # the call had returned when the caller left
        assert await pool.run(lambda: "next") == "next"  # the thread is free again
    finally:
        pool.close()


async def test_close_finishes_queued_calls_and_refuses_new_ones() -> None:
    pool = WorkerThreads(1, "t")
    done: list[int] = []

    def work(i: int) -> None:
        time.sleep(0.01)
        done.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(pool.run, work, i)
    pool.close()
    assert done == [0, 1, 2]  # in the order handed in (one thread)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.run(work, 9)
    with pytest.raises(ValueError):
        WorkerThreads(0, "t")
