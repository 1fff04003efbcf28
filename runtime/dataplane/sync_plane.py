"""The synchronous facade of the data plane, for a scheduler that is not asyncio.

:class:`SyncDataPlane` runs a :class:`~hylinker.runtime.dataplane.plane.DataPlane` on an event loop in
a background thread (an anyio blocking portal). Every call is thread-safe and returns at once
with a ``concurrent.futures.Future`` (or a :class:`SyncLoad`, which has one future per layer:
the shape of SGLang's layer-wise load counter); transfers are handed to the loop by a hand-off
thread, so a scheduler thread never waits for the loop thread to queue work; :meth:`SyncDataPlane.reset` and
:meth:`SyncDataPlane.close` block until every transfer is quiesced. With ``completion_fifo=True``
offload outcomes also queue in submission order (:meth:`SyncDataPlane.pop_completed_offloads`);
without it nothing is kept of a finished offload but the future the caller holds (issue 53).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import queue
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.from_thread

try:  # where sniffio is installed, anyio asks it which loop runs; otherwise asyncio's own answer
    import sniffio
except ImportError:  # pragma: no cover - depends on the environment
    sniffio = None  # type: ignore[assignment]

from ...components.layout import PoolKind
from ...components.pool_view import PoolSet, PoolView
from ...stores.base import Store
from ...stores.host_bytes import one_openmp_thread
from .events import DeviceEvent
from .plane import (
    DataPlane,
    DataPlaneClosedError,
    DataPlaneConfig,
    LoadTicket,
    Transfer,
    TransferOutcome,
)
from .statistics import DataPlaneStatistics, PoolActorStatistics
from .transfer_jobs import CANCELLED

T = TypeVar("T")


class SyncLoad:
    """A load submitted through :class:`SyncDataPlane`. Thread-safe.

    ``result`` resolves to the :class:`TransferOutcome`; ``layer(layer_id)`` is a future that
    resolves to True when that layer landed, False when the load ended without it (it never
    raises and never hangs: a failed or cancelled load resolves every layer to False).
    """

    def __init__(self, layer_ids: Sequence[int], result: concurrent.futures.Future[TransferOutcome]) -> None:
        self.result = result
        self._layers = {layer: concurrent.futures.Future[bool]() for layer in layer_ids}
        self._ticket: LoadTicket | None = None
        self._cancel_requested = False
        self._run: Callable[[], Any] | None = None  # held until SyncDataPlane.start
        self._fence: DeviceEvent | None = None  # rows are written only after it completed
        self._cancelled: Callable[[], None] | None = None
        self._lock = threading.Lock()

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self._layers)

    def layer(self, layer_id: int) -> concurrent.futures.Future[bool]:
        if layer_id not in self._layers:
            raise KeyError(f"layer {layer_id} is not restored by this load")
        return self._layers[layer_id]

    def wait_layer(self, layer_id: int, timeout: float | None = None) -> bool:
        return self.layer(layer_id).result(timeout)

    def _settle(self, layer: int, landed: bool) -> None:
        fut = self._layers.get(layer)
        if fut is not None and not fut.done():
            fut.set_result(landed)

    def _settle_all(self) -> None:
        for layer in self._layers:
            self._settle(layer, False)

    def _fail(self, exc: BaseException) -> None:
        """The load could not be started (the plane closed first): every layer and the
        result end, so nobody waits on it."""
        self._settle_all()
        _fail_future(self.result, exc)


class SyncDataPlane:
    """A :class:`DataPlane` for synchronous callers (a scheduler thread).

    The event loop runs on a background thread started by the constructor; every method is
    thread-safe and returns at once with a ``concurrent.futures.Future`` (or a
    :class:`SyncLoad`), except :meth:`reset` and :meth:`close`, which block until every
    transfer is quiesced. ``store_factory`` builds the store on the loop thread (stores bind to
    the loop that uses them; it may be a coroutine function); the facade closes it on
    :meth:`close` when ``own_store``.

    ``completion_fifo``: offload outcomes also queue in submission order, and
    :meth:`pop_completed_offloads` returns those of the oldest offloads that ended, stopping at
    the first still running. The caller must pop them (the queue holds every outcome, and its
    transfers, until then), so it is off by default: a caller that waits on each future keeps
    nothing per finished offload.
    """

    def __init__(self, pools: PoolSet | Mapping[PoolKind, PoolView],
                 store_factory: Callable[[], Store] | Callable[[], Awaitable[Store]],
                 config: DataPlaneConfig | None = None, *, fingerprint: bytes | None = None,
                 namespace: bytes | str = b"", own_store: bool = True, registry: Any = None,
                 completion_fifo: bool = False) -> None:
        """``registry``: a ``prometheus_client`` registry for the data path's metrics
        (:class:`DataPlane`'s; default none)."""
        self._stack = contextlib.ExitStack()
        self._portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())
        try:
            self._portal.call(one_openmp_thread)  # inline copies run on this loop: no OpenMP team
            self.store: Store = self._portal.call(_call, store_factory)
            if own_store:  # closed on the loop thread, after the data plane quiesced
                self._stack.callback(self._portal.call, self.store.close)
            self.plane = DataPlane(pools, self.store, config, fingerprint=fingerprint, namespace=namespace,
                                   registry=registry)
            self._stack.enter_context(self._portal.wrap_async_context_manager(self.plane))
        except BaseException:
            self._stack.close()
            raise
        self._loop_thread = self._portal.call(threading.get_ident)
        self._loop: asyncio.AbstractEventLoop = self._portal.call(asyncio.get_running_loop)
        self._handoff: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._relay = threading.Thread(target=self._hand_off, name="hylinker-handoff", daemon=True)
        self._relay.start()
        #: offloads in submission order, until popped (``completion_fifo`` only)
        self._completion_fifo = completion_fifo
        self._fifo: deque[concurrent.futures.Future[TransferOutcome]] = deque()
        self._fifo_lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> SyncDataPlane:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check(self) -> None:
        if self._closed:
            raise DataPlaneClosedError("the data plane is closed")

    def _spawn(self, run: Callable[[], Coroutine[Any, Any, None]], failed: Callable[[BaseException], None]) -> None:
        """Start ``run`` in the data plane's task group without the caller waiting for the loop.

        The caller only queues it for the hand-off thread, which wakes the loop. Waking the loop
        from the caller's thread held SGLang's scheduler thread up to 1.6-3.9 ms in some offload
        calls on two busy cores (measured): the woken loop thread takes the GIL, and the caller
        waits for it to give it back. One hand-off thread, and the loop runs thread-safe callbacks first in,
        first out, so tasks start in call order: submission order is queue order. If the plane
        is gone by then, ``failed`` gets the error instead: nothing is left waiting."""
        self._handoff.put((run, failed))

    def _hand_off(self) -> None:
        """The hand-off thread: forwards queued work to the loop in order until ``None``."""
        while True:
            item = self._handoff.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # a flush: everything before it is forwarded
                self._loop.call_soon_threadsafe(item.set)
                continue
            run, failed = item
            try:
                self._loop.call_soon_threadsafe(self._start, run, failed)
            except RuntimeError as exc:  # the loop thread has stopped
                failed(DataPlaneClosedError(f"the data plane is closed: {exc}"))

    def _start(self, run: Callable[[], Coroutine[Any, Any, None]], failed: Callable[[BaseException], None]) -> None:
        """On the loop thread, in a plain callback: anyio is told which loop it runs on."""
        token = sniffio.current_async_library_cvar.set("asyncio") if sniffio is not None else None
        try:
            tg = self.plane._tg
            if tg is None:
                raise DataPlaneClosedError("the data plane is closed")
            tg.start_soon(run)
        except BaseException as exc:
            failed(exc)
        finally:
            if token is not None:
                sniffio.current_async_library_cvar.reset(token)

    def _flush(self) -> None:
        """Wait until every hand-off queued so far reached the loop (and its task started
        there before anything the caller does next on the loop)."""
        if self._relay.is_alive():
            done = threading.Event()
            self._handoff.put(done)
            done.wait()

    # ---- calls ----------------------------------------------------------------------------------
    def exists(self, keys: Mapping[PoolKind, Sequence[str]]) -> concurrent.futures.Future[dict[PoolKind, list[bool]]]:
        self._check()
        return self._portal.start_task_soon(self.plane.exists, keys)

    def load(self, transfers: Sequence[Transfer], *, request_id: str = "", start: bool = True,
             verify_all: bool = False, fence: DeviceEvent | None = None) -> SyncLoad:
        """Queue a load; bad input raises here (in the caller's thread).

        ``start=False`` keeps it held until :meth:`start` (SGLang's ``load`` then
        ``start_layer_wise_loading``); a held load can be cancelled and never touches a row.
        ``verify_all``: no row is written until every object of the load verified
        (:class:`~hylinker.runtime.dataplane.plane.DataPlane`, "verify all, then land").
        ``fence``: no row is written before it completed; a held load may get it at
        :meth:`start` instead (recorded when the engine starts the loads).
        """
        self._check()
        # validate in the caller's thread: misuse raises where it happened
        self.plane._jobs(transfers, None, request_id)
        layers = sorted({layer for tr in transfers for layer in self.plane.pools[tr.pool].layer_ids})
        result: concurrent.futures.Future[TransferOutcome] = concurrent.futures.Future()
        handle = SyncLoad(layers, result)
        handle._fence = fence

        def cancelled() -> None:
            self.plane._c["loads_cancelled"] += 1
            handle._settle_all()
            result.set_result(TransferOutcome(
                False, {tr.pool: [False] * len(tr.keys) for tr in transfers},
                {CANCELLED: sum(len(tr.keys) for tr in transfers)}, True))

        async def run() -> None:
            try:
                # the ticket exists before the first await: a cancel from now on goes to it
                ticket = self.plane.prepare_load(transfers, request_id=request_id, verify_all=verify_all,
                                                 fence=handle._fence)
            except BaseException as exc:
                handle._settle_all()
                result.set_exception(exc)
                return
            with handle._lock:
                if handle._cancel_requested:
                    cancelled()
                    return
                handle._ticket = ticket
            ticket.add_layer_callback(handle._settle)

            def finished(outcome: TransferOutcome) -> None:
                handle._settle_all()
                result.set_result(outcome)

            ticket.add_done_callback(finished)
            try:
                await self.plane.submit(ticket)
            except Exception as exc:  # the plane closed under it: the load ends, failed
                handle._fail(exc)

        handle._cancelled = cancelled
        if start:
            self._spawn(run, handle._fail)
        else:
            handle._run = run
        return handle

    def start(self, *loads: SyncLoad, fence: DeviceEvent | None = None) -> None:
        """Queue held loads (``load(..., start=False)``), in the order given; ``fence`` (if
        given) replaces theirs: no row of them is written before it completed."""
        self._check()
        for load in loads:
            with load._lock:
                if fence is not None:
                    load._fence = fence
                run, load._run = load._run, None
            if run is not None:
                self._spawn(run, load._fail)

    def cancel(self, load: SyncLoad) -> bool:
        """Cancel a load that has not started: True, and its rows are never written."""
        self._check()
        with load._lock:
            if load._ticket is None:
                if load.result.done() or load._cancel_requested:
                    return False
                load._cancel_requested = True
                if load._run is not None:  # held, never started: it ends here
                    load._run = None
                    assert load._cancelled is not None
                    load._cancelled()
                return True
        ticket = load._ticket
        return bool(self._portal.call(ticket.cancel))

    def offload(self, transfers: Sequence[Transfer], *, fence: DeviceEvent | None = None,
                request_id: str = "", copied: concurrent.futures.Future[bool] | None = None,
                ) -> concurrent.futures.Future[TransferOutcome]:
        """Queue an offload; the future (and the FIFO) gets its outcome. ``copied``, if given,
        resolves once no job reads the offload's rows any more (``OffloadTicket.copied``: in
        two stages, its frames are sealed in host staging; in one stage, it ended): True, or
        False if the offload already ended failed by then; it fails as the outcome does when
        the offload never ran (a full host staging budget: ``HostStagingFullError``)."""
        self._check()
        self.plane._jobs(transfers, fence, request_id)
        result: concurrent.futures.Future[TransferOutcome] = concurrent.futures.Future()
        ends: list[concurrent.futures.Future[Any]] = [result] if copied is None else [result, copied]

        async def run() -> None:
            try:
                ticket = await self.plane.offload(transfers, fence=fence, request_id=request_id)
                if copied is not None:
                    await ticket.copied()
                    copied.set_result(ticket.outcome.ok if ticket.outcome is not None else True)
                result.set_result(await ticket.wait())
            except BaseException as exc:
                for end in ends:
                    _fail_future(end, exc)

        failed = functools.partial(_fail_all, ends)
        if not self._completion_fifo:
            self._spawn(run, failed)
            return result
        with self._fifo_lock:  # FIFO order = submission order = queue order (tasks start in order)
            self._fifo.append(result)
            self._spawn(run, failed)
        return result

    def drop_staged(self) -> None:
        """``DataPlane.drop_staged`` on the loop: offloads still waiting for their put end
        failed, their frames released and counted (two stages; a no-op otherwise)."""
        if not self._closed:
            self._portal.call(self.plane.drop_staged)

    def _check_fifo(self) -> None:
        if not self._completion_fifo:
            raise RuntimeError("offload outcomes are queued only for a SyncDataPlane built with "
                               "completion_fifo=True (otherwise wait on each offload's future)")

    def num_completed_offloads(self) -> int:
        self._check_fifo()
        with self._fifo_lock:
            n = 0
            for f in self._fifo:
                if not f.done():
                    break
                n += 1
            return n

    def pop_completed_offloads(self) -> list[TransferOutcome]:
        """Outcomes of the oldest ended offloads, in submission order (a failed submission
        reads as an outcome with ``ok`` false)."""
        self._check_fifo()
        out: list[TransferOutcome] = []
        with self._fifo_lock:
            while self._fifo and self._fifo[0].done():
                f = self._fifo.popleft()
                try:
                    out.append(f.result())
                except Exception as exc:
                    out.append(TransferOutcome(False, {}, {type(exc).__name__: 1}))
        return out

    def call_store(self, fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``await fn(*args)`` on the data plane's loop (a store call: ``touch``,
        ``remove``...); the caller waits on the future with its own deadline. Callable from
        any thread, the loop's own included (a transfer's done callback)."""
        self._check()
        if threading.get_ident() != self._loop_thread:
            return self._portal.start_task_soon(fn, *args)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def run() -> None:
            try:
                future.set_result(await fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise

        assert self.plane._tg is not None
        self.plane._tg.start_soon(run)
        return future

    def statistics(self) -> DataPlaneStatistics:
        return self._portal.call(self.plane.statistics)

    def pool_statistics(self) -> dict[str, PoolActorStatistics]:
        return dict(self._portal.call(self.plane.pool_statistics))

    def reset(self, timeout_s: float | None = None) -> bool:
        """Cancel loads that have not started and wait for every transfer in flight: at most
        ``timeout_s`` (None: no bound). False if transfers were still running then (a store
        call that cannot be abandoned: they end on the loop, on their own)."""
        self._check()
        self._flush()
        done = self._portal.start_task_soon(self.plane.reset)
        try:
            done.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Quiesce every transfer, stop the loop thread (and close the store if owned)."""
        if self._closed:
            return
        self._closed = True
        self._handoff.put(None)  # the hand-off thread forwards what is queued, then ends
        self._relay.join()
        while True:  # queued by another thread after the end marker: fails, never hangs
            try:
                item = self._handoff.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, threading.Event):
                item.set()
            elif item is not None:
                item[1](DataPlaneClosedError("the data plane is closed"))
        try:
            self._portal.call(self.plane.close)
        finally:
            self._stack.close()  # leaves the DataPlane, closes an owned store, stops the thread


async def _call(fn: Callable[[], Store] | Callable[[], Awaitable[Store]]) -> Store:
    store = fn()
    if inspect.isawaitable(store):
        return await store
    return store



def _fail_all(futures: Sequence[concurrent.futures.Future[Any]], exc: BaseException) -> None:
    for future in futures:
        _fail_future(future, exc)


def _fail_future(future: concurrent.futures.Future[Any], exc: BaseException) -> None:
    """End ``future`` with ``exc`` unless it already ended (it may have, meanwhile)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_exception(exc)

__all__ = ["SyncDataPlane", "SyncLoad"]
