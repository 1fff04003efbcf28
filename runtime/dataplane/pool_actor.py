"""One actor per pool: bounded offload and load queues over a store.

Each actor runs two workers, one per direction, so a restore never waits behind a backlog
of offloads. A worker takes jobs in FIFO order and finishes one before the next, so every
job gets exactly one result, in submission order. Per job it

1. awaits the job's device fence (offload: the forward that wrote the rows is done);
2. chooses the job's route and lets it move the objects a sub-batch at a time: staged through
   the actor's arena (``runtime/dataplane/staged_route.py``), in place over the host rows
   (``runtime/dataplane/in_place.py``, by row-described calls ``runtime/dataplane/rows_route.py``),
   verify-all into private frames (``runtime/dataplane/held_load.py``) or on the device
   (``runtime/dataplane/device_transfers.py``);
3. reports per-object outcomes.

With host staging (``runtime/dataplane/host_staging.py``, a two-stage offload) the offload
direction has two workers: the first copies each job's objects into sealed host frames of its own
(``runtime/dataplane/drain_route.py``) and marks the job copied, its rows free from then on; the
second puts those frames to the store in the same FIFO order and ends the job with the store's
answer.

Every route is built over two objects the actor shares with all of them: the staging arena
(``runtime/dataplane/staging_arena.py``: codecs, arenas, frame sizes, the route decisions, the
held arena) and the store-call wrapper (``runtime/dataplane/store_calls.py``: calls, the landed
check, counts). The arena is registered with the store once (zero-copy backends read and write
it directly) and stays alive as long as the actor: a store call that outlives a cancelled
waiter still writes into live memory. The jobs and their results are in
``runtime/dataplane/transfer_jobs.py``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ...components.layout import PoolKind
from ...stores.base import Outcome, Store
from .device_transfers import DeviceRoute
from .drain_route import DrainRoute
from .events import wait_fence
from .frame_index import DrainingFrames, FrameIndex
from .frame_restore import FrameRestore
from .held_load import HeldRoute
from .host_staging import HostStaging
from .in_place import InPlaceRoute
from .route import LoadRoute, TransferRoute
from .rows_route import RowsRoute
from .staged_route import StagedRoute
from .staging_arena import StagingArena
from .statistics import PoolActorStatistics, QueueStatistics
from .store_calls import LatencyMonitor, StoreCalls
from .transfer_codec import PoolCodec
from .transfer_jobs import LoadResult, OffloadResult, TransferJob, cancel_job

#: a copied job on its way to the store: its sealed frames (None: moved on the device in one
#: stage) and their entry in the staging index (None: not indexed)
_Drained = tuple[TransferJob, torch.Tensor | None, DrainingFrames | None]


class _Queue:
    """A bounded FIFO of jobs with statistics."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.tx: MemoryObjectSendStream[TransferJob]
        self.rx: MemoryObjectReceiveStream[TransferJob]
        self.tx, self.rx = anyio.create_memory_object_stream[TransferJob](bound)
        self.depth = 0
        self.waiting = 0
        self.completed = 0
        self.failed = 0

    async def put(self, job: TransferJob) -> None:
        self.waiting += 1
        try:
            await self.tx.send(job)
        finally:
            self.waiting -= 1
        self.depth += 1

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(self.depth, self.bound, self.waiting, self.completed, self.failed)


class PoolActor:
    """Moves one pool's objects between device rows and the store. See the module doc."""

    def __init__(self, kind: PoolKind, codecs: Sequence[PoolCodec], store: Store, fingerprint: bytes, *,
                 queue_depth: int, latency: LatencyMonitor, drain_puts: int = 1, **staging: Any) -> None:
        """``queue_depth``: jobs each direction queues before submitters wait; ``drain_puts``:
        copied jobs put to the store at once (two stages); ``latency``: the
        monitor every store call feeds; ``staging``: the keyword arguments of
        :class:`~hylinker.runtime.dataplane.staging_arena.StagingArena`."""
        self.kind = kind
        self.arena = arena = StagingArena(kind, codecs, store, fingerprint, **staging)
        self.calls = calls = StoreCalls(kind, store, latency, checksums=arena.store_checksums,
                                        integrity=arena.integrity)
        self.copies = arena.copies
        self.staged = StagedRoute(arena, calls)
        parts = InPlaceRoute(arena, calls)
        self.rows = RowsRoute(arena, calls, parts)
        self.in_place: TransferRoute = self.rows if arena.rows else parts
        self.held = HeldRoute(arena, calls, self.in_place, self.rows)
        self.device = DeviceRoute(arena, calls)
        self.offload_q = _Queue(queue_depth)
        self.load_q = _Queue(queue_depth)
        self.pending_states = 0
        self.drain = DrainRoute(arena, self.staged)
        #: the data plane's host staging budget: offloads in two stages (None: one stage)
        self.host_staging: HostStaging | None = None
        #: draining frames by store key, and the loads that read them (None: one stage, or a
        #: store that sets the checksum as it copies: a staged frame then has none to verify)
        self.frames: FrameIndex | None = None
        self.from_frames: FrameRestore | None = None
        # copied jobs, FIFO, from the copy worker to the drain worker (the budget bounds them)
        self._drain_tx: MemoryObjectSendStream[_Drained]
        self._drain_rx: MemoryObjectReceiveStream[_Drained]
        self._drain_tx, self._drain_rx = anyio.create_memory_object_stream[_Drained](math.inf)
        #: copied jobs whose frames are put at once (stage 2); 1: one put after the other
        self.drain_puts = drain_puts
        self._in_order: set[anyio.Event] = set()  # the ends of the jobs draining now

    def stage_through(self, staging: HostStaging) -> None:
        """Offload in two stages through ``staging`` (the plane's shared budget); index the
        draining frames where they can be verified like a store read."""
        self.host_staging = staging
        self.drain.region = staging.region
        self.frames = FrameIndex(staging)
        self.from_frames = self.held.from_frames = FrameRestore(self.arena, self.calls, self.frames)

    @property
    def latency(self) -> LatencyMonitor:
        """The store-latency monitor this actor's calls feed (shared by the data plane)."""
        return self.calls.latency

    @latency.setter
    def latency(self, monitor: LatencyMonitor) -> None:
        self.calls.latency = monitor

    # ---- the choice of route ------------------------------------------------------------
    def _moves_in_place(self, job: TransferJob) -> bool:
        return self.arena.in_place_groups[job.group] and self.arena.codecs[job.group].host_path(job.index)

    def offload_route(self, job: TransferJob) -> TransferRoute:
        """How ``job``'s objects are offloaded: on the device, in place, or staged."""
        if self.device.takes(job):  # summed on the device, or registered device rows
            return self.device
        return self.in_place if self._moves_in_place(job) else self.staged

    def load_route(self, job: TransferJob) -> LoadRoute:
        """How ``job``'s objects are loaded: on the device, held (verify all), in place, or staged."""
        if self.device.takes(job):  # verified on the device (verify-all included)
            return self.device
        if job.hold:
            return self.held
        return self.in_place if self._moves_in_place(job) else self.staged

    # ---- submission ----------------------------------------------------------------
    def reserve_offload(self, job: TransferJob) -> None:
        """Count a MAMBA job's states as pending now, before the submitter's first await (the
        backpressure rule reads this count); the worker uncounts them when the job ends, and
        :meth:`unreserve_offload` does if it is never queued."""
        if self.kind is PoolKind.MAMBA:
            self.pending_states += len(job.keys)

    def unreserve_offload(self, job: TransferJob) -> None:
        if self.kind is PoolKind.MAMBA:
            self.pending_states -= len(job.keys)

    async def submit_offload(self, job: TransferJob) -> None:
        """Queue a job reserved with :meth:`reserve_offload` (waits while the queue is full)."""
        await self.offload_q.put(job)

    async def submit_load(self, job: TransferJob) -> None:
        await self.load_q.put(job)

    def close_queues(self) -> None:
        self.offload_q.tx.close()
        self.load_q.tx.close()

    # ---- workers -------------------------------------------------------------------
    async def run_offloads(self) -> None:
        if self.host_staging is not None:
            await self._copy_offloads()
            return
        await self._serve(self.offload_q, self._offload, counts_states=self.kind is PoolKind.MAMBA)

    def _states_released(self, job: TransferJob) -> None:
        if self.kind is PoolKind.MAMBA:
            self.pending_states -= len(job.keys)

    async def _copy_offloads(self) -> None:
        """Two stages, the first: per job in FIFO order, await its fence, copy its objects
        into sealed frames (its rows are free from then on: ``job.copied``) and pass
        it to :meth:`run_drain`. A job moved on the device passes uncopied (one stage)."""
        queue = self.offload_q
        async with queue.rx, self._drain_tx:
            try:
                await self._copy_each(queue)
            finally:  # cancelled: jobs never copied end failed (a plane waits for every job)
                self._fail_uncopied(queue)

    async def _copy_each(self, queue: _Queue) -> None:
        async for job in queue.rx:
            job.started = True
            frames: torch.Tensor | None = None
            try:
                with anyio.CancelScope(shield=True):  # a copy is never abandoned mid-flight
                    await wait_fence(job.fence, timeout_s=self.arena.fence_timeout_s)
                    if not self.device.takes(job):
                        frames = await self.drain.copy(job)
            except Exception as exc:  # a failed fence or copy: the job fails, never put
                queue.failed += 1
                queue.depth -= 1
                self._states_released(job)
                job.completion.fail(exc)
                continue
            entry = None
            if frames is not None:
                if self.frames is not None:  # sealed: restorable before the rows are reused
                    entry = self.frames.add(job.keys, frames, self.arena.frame_sizes[job.group],
                                            self.drain.frame_bytes(len(job.keys)))
                    job.in_frames = True
                    self._states_released(job)  # a state restorable from its frame is not pending
                job.copied.set(None)
            try:
                self._drain_tx.send_nowait((job, frames, entry))  # unbounded: never waits
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._end_unput(job, frames, entry)  # the drain stopped (cancelled): never put
                continue
            if self.host_staging is not None and self.host_staging.dropping:  # copied after the drop
                self.drop_queued()

    def _fail_uncopied(self, queue: _Queue) -> None:
        """Jobs still queued when the copy worker stops (cancelled) end failed, never copied."""
        while True:
            try:
                job = queue.rx.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            queue.failed += 1
            queue.depth -= 1
            self._states_released(job)
            job.completion.fail(RuntimeError("the offload worker stopped before this job was copied"))

    async def run_drain(self) -> None:
        """Two stages, the second: put copied jobs' frames to the store, up to
        :attr:`drain_puts` jobs at once, each ending with the store's answer in FIFO order
        (frames dropped unput, as failed, once the plane drops staging: :meth:`drop_queued`)."""
        queue = self.offload_q
        room = anyio.Semaphore(self.drain_puts)
        previous: anyio.Event | None = None
        async with self._drain_rx, anyio.create_task_group() as tg:
            try:
                while True:
                    await room.acquire()  # a job is taken only when it can start at once
                    try:
                        item = await self._drain_rx.receive()
                    except anyio.EndOfStream:
                        break
                    ended = anyio.Event()
                    self._in_order.add(ended)
                    tg.start_soon(self._drain_job, queue, item, previous, ended, room)
                    previous = ended
            finally:  # cancelled: copied jobs not yet put end failed, unput
                self._end_queued()

    async def _drain_job(self, queue: _Queue, item: _Drained, previous: anyio.Event | None,
                         ended: anyio.Event, room: anyio.Semaphore) -> None:
        job, frames, entry = item
        # a state not restorable from a frame (not indexed) stays counted until the store
        # answers: the tree keeps it from eviction until then (RadixTree.evict_states)
        try:
            await self._end_job(queue, job, functools.partial(self._drain_one, job, frames),
                                counts_states=entry is None, after=previous)
        finally:
            self._retire(frames, entry)
            ended.set()
            self._in_order.discard(ended)
            room.release()

    def _retire(self, frames: torch.Tensor | None, entry: DrainingFrames | None) -> None:
        """The drain ended a job: its indexed frames leave the index (given back to the region
        at once, or at the last unpin); frames never indexed are given back now."""
        if entry is not None:
            assert self.frames is not None
            self.frames.retire(entry)  # pinned: its bytes stay charged to the last unpin
        else:
            self.drain.give(frames)

    def drop_queued(self) -> None:
        """Staging is dropped (``DataPlane.drop_staged``): copied jobs not yet at the store end
        failed now, their frames counted dropped; jobs whose put is at the store end with its
        answer, no longer waiting for the jobs before them (a close does not wait for order)."""
        staging = self.host_staging
        if staging is None:
            return
        for ended in list(self._in_order):
            ended.set()
        self._end_queued()

    def _end_queued(self) -> None:
        """Copied jobs waiting for the drain end failed now, unput (:meth:`_end_unput`)."""
        while True:
            try:
                job, frames, entry = self._drain_rx.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            self._end_unput(job, frames, entry)

    def _end_unput(self, job: TransferJob, frames: torch.Tensor | None, entry: DrainingFrames | None) -> None:
        """End a copied job whose frames are never put: failed, its objects counted dropped."""
        if self.host_staging is not None:
            self.host_staging.dropped_objects += len(job.keys)
        self.offload_q.completed += 1
        self.offload_q.depth -= 1
        if entry is None:
            self._states_released(job)
        job.completion.set(self.calls.offloaded(job, [Outcome.FAILED] * len(job.keys),
                                                self.arena.frame_sizes[job.group], time.perf_counter()))
        self._retire(frames, entry)

    async def _drain_one(self, job: TransferJob, frames: torch.Tensor | None) -> OffloadResult:
        if frames is None:
            return await self.device.offload(job)
        t0 = time.perf_counter()
        size = self.arena.frame_sizes[job.group]
        staging = self.host_staging
        assert staging is not None
        if staging.dropping:
            staging.dropped_objects += len(job.keys)
            return self.calls.offloaded(job, [Outcome.FAILED] * len(job.keys), size, t0)
        return self.calls.offloaded(job, await self.drain.put(job, frames), size, t0)

    async def run_loads(self) -> None:
        await self._serve(self.load_q, self._load, counts_states=False)

    async def _serve(self, queue: _Queue, work: Callable[[TransferJob], Awaitable[object]],
                     *, counts_states: bool) -> None:
        """One worker: jobs in FIFO order, one at a time, exactly one result each."""
        async with queue.rx:
            async for job in queue.rx:
                if job.cancelled:  # cancelled before it started (and already ended): skip it
                    queue.depth -= 1
                    cancel_job(job)
                    continue
                job.started = True
                await self._end_job(queue, job, functools.partial(work, job), counts_states=counts_states)

    async def _end_job(self, queue: _Queue, job: TransferJob, work: Callable[[], Awaitable[object]], *,
                       counts_states: bool, after: anyio.Event | None = None) -> None:
        """Run ``work`` (shielded: a store call is never abandoned mid-flight) and end ``job``
        with its result or its error, once ``after`` is set (the job before it ended):
        exactly one result, in FIFO order."""
        error: Exception | None = None
        result: object = None
        try:
            with anyio.CancelScope(shield=True):
                try:
                    result = await work()
                except Exception as exc:
                    error = exc
                if after is not None:
                    await after.wait()
            if error is not None:
                queue.failed += 1
                job.completion.fail(error)
            else:
                queue.completed += 1
                job.completion.set(result)
        finally:
            queue.depth -= 1
            if counts_states:
                self._states_released(job)

    async def _offload(self, job: TransferJob) -> OffloadResult:
        await wait_fence(job.fence, timeout_s=self.arena.fence_timeout_s)
        return await self.offload_route(job).offload(job)

    async def _load(self, job: TransferJob) -> LoadResult:
        # the engine's stream must be past every use of the rows this load reuses
        await wait_fence(job.fence, timeout_s=self.arena.fence_timeout_s)
        route = self.load_route(job)
        if self.from_frames is not None and len(self.frames or ()) and route is not self.device and not job.hold:
            return await self.from_frames.load(job, route)  # draining frames first, then the store
        return await route.load(job)

    # ---- verify-all loads: the ticket lands or drops them ---------------------------------
    async def land_held(self, job: TransferJob, on_layer: Callable[[int], None]) -> None:
        """Write a held job's verified frames into its rows (:meth:`HeldRoute.land`)."""
        await self.held.land(job, on_layer)

    def release_held(self, job: TransferJob) -> None:
        """Drop a held job's frames (landed, or its load failed)."""
        self.arena.release_held(job)

    def statistics(self) -> PoolActorStatistics:
        held = self.arena.held
        return PoolActorStatistics(
            pool=self.kind.value,
            offload_queue=self.offload_q.statistics(),
            load_queue=self.load_q.statistics(),
            pending_states=self.pending_states,
            held_arena_bytes=0 if held is None else held.numel(),
            held_arena_growths=self.arena.held_arena_growths,
            staging_frames=0 if self.frames is None else len(self.frames),
            **self.calls.counts,
        )
