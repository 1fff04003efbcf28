"""Worker threads for copies: a coroutine hands one blocking call to a thread and awaits it.

A sub-batch's copy (the embedded store's slot copies, a pool actor's hashing) is one blocking
call of ~10 ms, handed from the event loop to a thread once per sub-batch. anyio's
``to_thread.run_sync`` makes about 300 Python calls for that hand-off and ``loop.run_in_executor``
about 165 (counted by the profile hook of ``hylinker bench --only calls``); :meth:`WorkerThreads.run`
makes about 30: one queue put, one ``call_soon_threadsafe`` back, one future.

Rules the caller can rely on:

* at most ``threads`` calls run at once (the pool is its own limiter), in the order handed in;
* a call handed in always runs to its end, and a cancelled caller resumes (with its
  cancellation) only after its call returned, so a call never touches a caller's buffer after
  the caller left;
* each call runs in a copy of the caller's context (context variables, e.g. bound log fields);
* :meth:`close` lets the calls handed in before it finish, then stops the threads; a call
  handed in after it raises ``RuntimeError``.

The loop side must be asyncio (hylinker's runtime runs on anyio's asyncio backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio

from .host_bytes import one_openmp_thread

T = TypeVar("T")


class _Call(Generic[T]):
    """One call handed to the pool; ``waiter`` and ``finished`` are touched on the loop only."""

    __slots__ = ("args", "ctx", "finished", "fn", "loop", "waiter")

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.fn = fn
        self.args = args
        self.ctx = contextvars.copy_context()
        self.loop = loop
        self.waiter: asyncio.Future[T] = loop.create_future()
        self.finished = False


def _settle(call: _Call[Any], ok: bool, value: Any) -> None:
    """On the loop: the call returned ``value`` (``ok``) or raised it."""
    call.finished = True
    waiter = call.waiter
    if waiter.done():  # its caller was cancelled; it waits on a fresh waiter, or left
        return
    if ok:
        waiter.set_result(value)
    else:
        waiter.set_exception(value)


class WorkerThreads:
    """``threads`` daemon threads taking blocking calls from one queue (see the module doc)."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self._size = threads
        self._name = name
        self._queue: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def threads(self) -> int:
        return self._size

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread; its result, or what it raised."""
        if self._closed:
            raise RuntimeError(f"{self._name} worker threads are closed")
        if not self._threads:
            self._start()
        call = _Call(fn, args, asyncio.get_running_loop())
        self._queue.put(call)
        try:
            return await call.waiter
        except asyncio.CancelledError:
            if not call.finished:  # the thread still has the call: wait for it, then leave
                call.waiter = call.loop.create_future()
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await call.waiter  # what it raised is dropped: the caller's cancellation wins
            raise

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking calls; the threads finish the calls handed in before, then exit
        (joined up to ``timeout_s`` each)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout_s)

    def _start(self) -> None:
        for i in range(self._size):
            t = threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _work(self) -> None:
        one_openmp_thread()  # a copy here must not start an OpenMP team beside the engine's (host_bytes)
        take = self._queue.get
        while True:
            call = take()
            if call is None:
                return
            try:
                ok, value = True, call.ctx.run(call.fn, *call.args)
            except BaseException as exc:
                ok, value = False, exc
            with contextlib.suppress(RuntimeError):  # the loop closed under the call: nobody waits
                call.loop.call_soon_threadsafe(_settle, call, ok, value)
