"""Restores from draining frames: a load whose objects sit in host staging copies them from there.

A load job's objects that the pool's staging index holds (``runtime/dataplane/frame_index.py``:
sealed frames of a two-stage offload the store has not acknowledged yet) are copied from those
frames, verified like a store read (header and the frame's checksum, ``stores/framing.py``;
where the store sets the checksum as it copies, our frames carry none and their header is
checked: ``framing.verify_own_array``)
and scattered into the job's rows; the frames are pinned while they are read and unpinned
whatever happens (a copy that fails or is cancelled included). A frame that fails
verification leaves the index and its object falls back, with every object the index does not
hold, to the job's usual route (the store); what the store cannot give either, the caller
recomputes, as after any failed read. The layers are reported once every object landed.

A verify-all load (``runtime/dataplane/held_load.py``) writes no row before the whole load
verified: its indexed objects are copied into the job's private frames instead
(:meth:`FrameRestore.into_held`) and verified there, and the held route reads the rest from the
store into the same frames.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ...stores import framing
from .events import DeviceEvent, wait_fence
from .frame_index import DrainingFrames, FrameIndex, Pinned
from .route import LoadRoute
from .staging_arena import StagingArena
from .store_calls import StoreCalls
from .tracing import trace
from .transfer_jobs import LoadResult, TransferJob


class FrameRestore:
    """Serve a load's objects from draining frames first. See the module doc."""

    def __init__(self, arena: StagingArena, calls: StoreCalls, index: FrameIndex) -> None:
        self.arena = arena
        self.calls = calls
        self.index = index
        #: a store that checksums as it copies sets the checksum in its copy only: our frames
        #: carry none, and are checked by their header (``framing.verify_own_array``)
        self.verify = framing.verify_own_array if calls.checksums else framing.verify_array

    async def load(self, job: TransferJob, route: LoadRoute) -> LoadResult:
        """Load ``job``: its indexed objects from their frames, the rest through ``route``."""
        pinned = self.index.pin(job.keys)
        if not pinned:
            return await route.load(job)
        t0 = time.perf_counter()
        a = self.arena
        size = a.frame_sizes[job.group]
        try:
            if a.inline((0, len(pinned)), size):
                landed, bad, ev = self._copy(job, pinned)
            else:
                landed, bad, ev = await a.threads.run(self._copy, job, pinned)
            await wait_fence(ev, timeout_s=a.fence_timeout_s)  # the rows hold them only then
        finally:
            for _i, frames, _row in pinned:
                self.index.unpin(frames)
        self._drop(job, bad)
        ok = [False] * len(job.keys)
        for i in landed:
            ok[i] = True
        c = self.calls.counts
        job.from_staging = len(landed)
        c["staging_restores"] += len(landed)
        c["objects_loaded"] += len(landed)
        c["bytes_loaded"] += len(landed) * size
        trace("load.staging", pool=self.calls.kind.value, request_id=job.request_id, objects=len(pinned),
              restored=len(landed), us=round((time.perf_counter() - t0) * 1e6))
        faults: dict[str, int] = {}
        rest = [i for i in range(len(job.keys)) if not ok[i]]
        if rest:  # the store serves the others (and any frame that did not verify)
            part = TransferJob([job.keys[i] for i in rest], job.index[torch.tensor(rest, dtype=torch.int64)],
                               request_id=job.request_id, group=job.group)
            part.started = True
            result = await route.load(part)
            for j, i in enumerate(rest):
                ok[i] = result.ok[j]
            faults = dict(result.faults)
            job.condemned.update(part.condemned)
        if job.on_layer is not None and all(ok):
            for layer in a.codecs[job.group].layer_ids:
                job.on_layer(layer)
        return LoadResult(ok, faults)

    def _drop(self, job: TransferJob, bad: list[tuple[int, DrainingFrames, str]]) -> None:
        """Frames that failed verification leave the index, counted (on the loop: the index is the loop's)."""
        for i, frames, fault in bad:
            self.index.drop(job.keys[i], frames)
            self.calls.counts["staging_verify_failures"] += 1
            trace("load.staging_verify_failed", pool=self.calls.kind.value, key=job.keys[i], fault=fault)

    async def into_held(self, job: TransferJob, grid: torch.Tensor) -> list[int]:
        """A verify-all load (``runtime/dataplane/held_load.py``): copy the job's indexed objects
        from their draining frames into its private frames ``grid`` and verify them there, like
        a store read into the same frames; no row is written (the ticket lands the frames once
        the whole load verified). Returns the positions that verified; the caller reads the
        others from the store."""
        pinned = self.index.pin(job.keys)
        if not pinned:
            return []
        t0 = time.perf_counter()
        a = self.arena
        size = a.frame_sizes[job.group]
        try:
            if a.inline((0, len(pinned)), size):
                landed, bad = self._copy_held(job, grid, pinned)
            else:
                landed, bad = await a.threads.run(self._copy_held, job, grid, pinned)
        finally:
            for _i, frames, _row in pinned:
                self.index.unpin(frames)
        self._drop(job, bad)
        job.from_staging = len(landed)
        self.calls.counts["staging_restores"] += len(landed)  # objects_loaded: counted with the load
        trace("load.staging", pool=self.calls.kind.value, request_id=job.request_id, objects=len(pinned),
              restored=len(landed), held=True, us=round((time.perf_counter() - t0) * 1e6))
        return landed

    def _copy_held(self, job: TransferJob, grid: torch.Tensor, pinned: list[Pinned]
                   ) -> tuple[list[int], list[tuple[int, DrainingFrames, str]]]:
        """Copy each pinned frame into row ``i`` of ``grid`` and verify the copy."""
        a = self.arena
        size = a.frame_sizes[job.group]
        landed: list[int] = []
        bad: list[tuple[int, DrainingFrames, str]] = []
        for i, frames, row in pinned:
            grid[i, :size].copy_(frames.grid[row, :size])
            try:
                self.verify(grid[i, :size].numpy(), size, job.keys[i], a.fingerprint,
                            integrity=a.integrity, room=size - framing.HEADER_BYTES)
            except framing.FrameError as exc:
                bad.append((i, frames, exc.fault.value))
                continue
            landed.append(i)
        return landed, bad

    def _copy(self, job: TransferJob, pinned: list[Pinned]
              ) -> tuple[list[int], list[tuple[int, DrainingFrames, str]], DeviceEvent | None]:
        """Verify each pinned frame and scatter its payload into the job's rows; returns the
        positions that landed, those whose frame failed verification (with the fault) and, on
        a device, the event their copies complete at."""
        a = self.arena
        codec, size = a.codecs[job.group], a.frame_sizes[job.group]
        room = size - framing.HEADER_BYTES
        landed: list[int] = []
        bad: list[tuple[int, DrainingFrames, str]] = []
        with a.copies.on_stream() if a.copies is not None else contextlib.nullcontext():
            for i, frames, row in pinned:
                key = job.keys[i]
                try:
                    self.verify(frames.grid[row, :size].numpy(), size, key, a.fingerprint,
                                integrity=a.integrity, room=room)
                except framing.FrameError as exc:
                    bad.append((i, frames, exc.fault.value))
                    continue
                codec.scatter(frames.grid[row: row + 1, framing.HEADER_BYTES: size], job.index[i: i + 1], None)
                landed.append(i)
            ev = a.copies.record() if a.copies is not None else None
        return landed, bad, ev


__all__ = ["FrameRestore"]
