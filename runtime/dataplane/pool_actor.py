"""One actor per pool: bounded offload and load queues over a store.

Each actor runs two workers, one per direction, so a restore never waits behind a backlog
of offloads. A worker takes jobs in FIFO order and finishes one before the next, so every
job gets exactly one result, in submission order. Per job it

1. awaits the job's device fence (offload: the forward that wrote the rows is done);
2. moves the objects through its own staging arena, a sub-batch at a time: gather + frame
   (offload) or get + verify + scatter (load) — copies run in a worker thread so the event
   loop keeps serving;
3. reports per-object outcomes.

The arena is registered with the store once (zero-copy backends read and write it directly)
and stays alive as long as the actor: a store call that outlives a cancelled waiter still
writes into live memory.

This module holds the actor, its queues, its workers and the staged paths (through the
arena). What the paths share lives in ``runtime/dataplane/pool_staging.py``, the in-place paths in
``runtime/dataplane/in_place.py``, the verify-all-then-land loads in ``runtime/dataplane/held_load.py``, and the
jobs and their results in ``runtime/dataplane/transfer_jobs.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ...components.layout import PoolKind
from ...stores import framing
from ...stores.base import GetResult, Outcome, Store
from .device_transfers import DeviceTransfers
from .events import DeviceEvent, wait_fence
from .pool_staging import check_landed
from .statistics import PoolActorStatistics, QueueStatistics
from .transfer_codec import PoolCodec
from .transfer_jobs import LoadResult, OffloadResult, TransferJob, cancel_job


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


class PoolActor(DeviceTransfers):
    """Moves one pool's objects between device rows and the store. See the module doc."""

    def __init__(self, kind: PoolKind, codecs: Sequence[PoolCodec], store: Store, fingerprint: bytes, *,
                 queue_depth: int, **staging: Any) -> None:
        """``queue_depth``: jobs each direction queues before submitters wait; ``staging``:
        the keyword arguments of :class:`~hylinker.runtime.dataplane.pool_staging.PoolStaging`."""
        super().__init__(kind, codecs, store, fingerprint, **staging)
        self.offload_q = _Queue(queue_depth)
        self.load_q = _Queue(queue_depth)
        self.pending_states = 0

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
        await self._serve(self.offload_q, self._offload, counts_states=self.kind is PoolKind.MAMBA)

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
                try:
                    job.started = True
                    with anyio.CancelScope(shield=True):  # never abandon a store call mid-flight
                        result = await work(job)
                except Exception as exc:
                    queue.failed += 1
                    job.completion.fail(exc)
                else:
                    queue.completed += 1
                    job.completion.set(result)
                finally:
                    queue.depth -= 1
                    if counts_states:
                        self.pending_states -= len(job.keys)

    async def _offload(self, job: TransferJob) -> OffloadResult:
        """Gather + frame sub-batch k in a thread while sub-batch k-1 is being put."""
        await wait_fence(job.fence, timeout_s=self.fence_timeout_s)
        t0 = time.perf_counter()
        codec, size = self.codecs[job.group], self.frame_sizes[job.group]
        if self.device_route(job):  # summed on the device, or registered device rows
            return await self._offload_device(job, codec, size, t0)
        if self.in_place_groups[job.group] and codec.host_path(job.index):
            return await self._offload_in_place(job, codec, size, t0)
        batches = self._batches(len(job.keys))
        results: list[list[Outcome]] = [[] for _ in batches]

        def gather(k: int) -> DeviceEvent | None:
            lo, hi = batches[k]
            grid, _ = self._views("offload", k % 2, hi - lo, size)
            if self.copies is None:
                codec.gather(job.index[lo:hi], grid[:, framing.HEADER_BYTES: size])
                return None
            with self.copies.on_stream():  # device -> pinned staging on the copy stream
                codec.gather(job.index[lo:hi], grid[:, framing.HEADER_BYTES: size])
                return self.copies.record()

        checksums = self.store_checksums
        payload = size - framing.HEADER_BYTES

        def seal(k: int) -> list[torch.Tensor]:
            lo, hi = batches[k]
            _, frames = self._views("offload", k % 2, hi - lo, size)
            for key, f in zip(job.keys[lo:hi], self._np_frames("offload", k % 2, hi - lo, size)):
                if checksums:  # the store sets the checksum as it copies the frame
                    framing.seal_header(f, key, self.fingerprint, payload)
                else:
                    framing.seal_array(f, key, self.fingerprint, self.integrity)
            return frames

        def pack(k: int) -> list[torch.Tensor]:
            gather(k)
            return seal(k)

        async def pack_async(k: int) -> list[torch.Tensor]:
            if self.copies is None:
                return await self.threads.run(pack, k)
            ev = await self.threads.run(gather, k)
            # never seal (read) staged bytes before the device copy into them finished
            await wait_fence(ev, timeout_s=self.fence_timeout_s)
            return await self.threads.run(seal, k)

        async def put(k: int, frames: list[torch.Tensor]) -> None:
            lo, hi = batches[k]
            if checksums:
                results[k] = await self._store_call(self.store.put_sealed,  # type: ignore[attr-defined]
                                                    job.keys[lo:hi], [_split(f) for f in frames],
                                                    Outcome.UNREACHABLE, Outcome.FAILED)
            else:
                results[k] = await self._store_call(self.store.put, job.keys[lo:hi], frames,
                                                    Outcome.UNREACHABLE, Outcome.FAILED)

        ready: tuple[int, list[torch.Tensor]] | None = None
        for k in range(len(batches)):
            if self._inline(batches[k], size):
                frames = pack(k)  # small: cheaper than two thread hops
                if ready is not None:
                    await put(*ready)
            else:
                async with anyio.create_task_group() as tg:
                    if ready is not None:
                        tg.start_soon(put, *ready)
                    frames = await pack_async(k)
            ready = (k, frames)
        if ready is not None:
            await put(*ready)
        outcomes = [o for r in results for o in r]
        return self._offloaded(job, outcomes, size, t0)

    async def _load(self, job: TransferJob) -> LoadResult:
        """Get sub-batch k while sub-batch k-1 is verified and scattered in a thread."""
        # the engine's stream must be past every use of the rows this load reuses
        await wait_fence(job.fence, timeout_s=self.fence_timeout_s)
        faults: dict[str, int] = {}
        t0 = time.perf_counter()
        codec, size = self.codecs[job.group], self.frame_sizes[job.group]
        if self.device_route(job):  # verified on the device (verify-all included)
            return await self._load_device(job, codec, size, t0)
        if job.hold:
            return await self._load_held(job, codec, size, t0)
        if self.in_place_groups[job.group] and codec.host_path(job.index):
            return await self._load_in_place(job, codec, size, t0)
        batches = self._batches(len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]
        again: list[int] = []  # objects to read once more (a fault a transfer can cause)
        checksums = self.store_checksums

        def unpack(k: int, results: list[GetResult]) -> DeviceEvent | None:
            """Verify sub-batch k in staging and land it; on a device, returns the event that
            completes when the copies into the rows are done."""
            lo, hi = batches[k]
            frames = self._np_frames("load", k % 2, hi - lo, size)
            index = job.index[lo:hi]
            # host pools: land each object right after verifying it, while it is still in cache
            fused = codec.host_path(index)
            rows = index[:, 0].tolist()
            ok: list[bool] = []
            for i, (key, f, r) in enumerate(zip(job.keys[lo:hi], frames, results)):
                verify = partial(framing.verify_array, f, r.nbytes, key, self.fingerprint, integrity=self.integrity,
                                 room=size - framing.HEADER_BYTES)
                usable, payload = check_landed(r, checksums, verify, faults, partial(again.append, lo + i))
                if not usable:
                    ok.append(False)
                    continue
                if fused:
                    assert payload is not None
                    codec.scatter_one(payload, rows[i])
                ok.append(True)
            good[k] = ok
            if fused:
                return None
            grid, _ = self._views("load", k % 2, hi - lo, size)
            sel = [i for i, g in enumerate(ok) if g]
            with self.copies.on_stream() if self.copies is not None else contextlib.nullcontext():
                if len(sel) == len(ok):
                    codec.scatter(grid[:, framing.HEADER_BYTES: size], index, None)
                elif sel:
                    pick = torch.tensor(sel, dtype=torch.int64)
                    codec.scatter(grid[pick, framing.HEADER_BYTES: size], index[pick], None)
                return self.copies.record() if self.copies is not None else None

        async def land(k: int, results: list[GetResult]) -> None:
            ev = await self.threads.run(unpack, k, results)
            # landed only once the device copies finished; the staging half is reused after
            await wait_fence(ev, timeout_s=self.fence_timeout_s)

        async def get(k: int) -> list[GetResult]:
            lo, hi = batches[k]
            _, frames = self._views("load", k % 2, hi - lo, size)
            return await self._get_frames(job.keys[lo:hi], frames)

        landed: tuple[int, list[GetResult]] | None = None
        for k in range(len(batches)):
            async with anyio.create_task_group() as tg:
                if landed is not None:
                    if self._inline(batches[landed[0]], size):
                        unpack(*landed)
                    else:
                        tg.start_soon(land, *landed)
                results = await get(k)
            landed = (k, results)
        if landed is not None:
            if self._inline(batches[landed[0]], size):
                unpack(*landed)
            else:
                await land(*landed)
        ok = [g for batch in good for g in batch]
        if again:
            await self._reread_staged(job, codec, size, sorted(again), ok, faults)
        if job.on_layer is not None and all(ok):  # every object of the job landed
            for layer in codec.layer_ids:
                job.on_layer(layer)
        return self._loaded(job, ok, faults, size, t0)

    async def _get_frames(self, keys: list[str], frames: list[torch.Tensor]) -> list[GetResult]:
        """One get of whole frames (a checksumming store's ``get_checked`` where it is used)."""
        if self.store_checksums:
            return await self._store_call(self.store.get_checked,  # type: ignore[attr-defined]
                                          keys, [_split(f) for f in frames],
                                          GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))
        return await self._store_call(self.store.get, keys, frames,
                                      GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))

    async def _reread_staged(self, job: TransferJob, codec: PoolCodec, size: int, again: list[int],
                             ok: list[bool], faults: dict[str, int]) -> None:
        """Read the objects ``again`` once more, into frames of their own (the arena's halves
        may hold later sub-batches by now), verify them and land the ones that verify; what
        fails now is counted under its fault (the stored object is bad)."""
        grid = self._new_arena(len(again) * self.stride).view(len(again), self.stride)
        frames = [grid[j, :size] for j in range(len(again))]
        results = await self._get_frames([job.keys[i] for i in again], frames)
        frames_np = grid.numpy()
        verified: list[bool] = []
        for j, (i, r) in enumerate(zip(again, results)):
            verify = partial(framing.verify_array, frames_np[j, :size], r.nbytes, job.keys[i], self.fingerprint,
                             integrity=self.integrity, room=size - framing.HEADER_BYTES)
            verified.append(check_landed(r, self.store_checksums, verify, faults, None,
                                         self._condemner(job, i, frames_np[j, :framing.HEADER_BYTES]))[0])
        sel = [j for j, v in enumerate(verified) if v]
        if sel:
            pick = torch.tensor(sel, dtype=torch.int64)
            index = job.index[torch.tensor([again[j] for j in sel], dtype=torch.int64)]
            with self.copies.on_stream() if self.copies is not None else contextlib.nullcontext():
                codec.scatter(grid[pick, framing.HEADER_BYTES: size], index, None)
                ev = self.copies.record() if self.copies is not None else None
            await wait_fence(ev, timeout_s=self.fence_timeout_s)
        self._reread_outcome(ok, again, verified)

    def statistics(self) -> PoolActorStatistics:
        return PoolActorStatistics(
            pool=self.kind.value,
            offload_queue=self.offload_q.statistics(),
            load_queue=self.load_q.statistics(),
            pending_states=self.pending_states,
            held_arena_bytes=0 if self._held_arena is None else self._held_arena.numel(),
            held_arena_growths=self.held_arena_growths,
            **self._c,
        )


def _split(frame: torch.Tensor) -> list[torch.Tensor]:
    """A staging frame as a checksumming store's parts: header, payload."""
    return [frame[:framing.HEADER_BYTES], frame[framing.HEADER_BYTES:]]
