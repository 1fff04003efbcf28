"""Verify all, then land: a held load writes no row until every job of the load verified.

:class:`HeldRoute` gets every object of a job into private frames (the staging arena's held
arena) and verifies it there; the load's ticket lands the frames (:meth:`HeldRoute.land`) once
every job of the load verified, or drops them (``StagingArena.release_held``). Layer groups
that move in place are read into their rows by the in-place route and verified there; only
their report waits for the rest of the load (``job.in_rows``). Objects still draining in host
staging (two stages) are copied from their frames into the private frames and verified there
(``runtime/dataplane/frame_restore.py``); such a job takes the private-frames path whole.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

from ...stores import framing
from ...stores.base import GetResult, Outcome
from .events import wait_fence
from .frame_restore import FrameRestore
from .in_place import private_rows
from .pipeline import pipelined
from .route import TransferRoute
from .rows_route import RowsRoute
from .staging_arena import StagingArena
from .store_calls import StoreCalls, check_landed, condemner
from .transfer_codec import PoolCodec
from .transfer_jobs import LoadResult, TransferJob


class HeldRoute:
    """A pool actor's verify-all-then-land loads. See the module doc."""

    def __init__(self, arena: StagingArena, calls: StoreCalls, moved: TransferRoute, rows: RowsRoute) -> None:
        self.arena = arena
        self.calls = calls
        self.moved = moved  # the in-place route of the layer groups moved in place
        self.rows = rows  # row-described gets into private rows
        #: two stages: objects still draining are copied from their frames (None: one stage)
        self.from_frames: FrameRestore | None = None

    def _draining(self, job: TransferJob) -> bool:
        """Whether the staging index holds any of ``job``'s objects now."""
        fr = self.from_frames
        return fr is not None and len(fr.index) > 0 and any(fr.index.holds(k) for k in job.keys)

    async def load(self, job: TransferJob) -> LoadResult:
        """Get every object of the job into private frames and verify it; write no row.
        Sub-batch k is verified while k+1 is in flight. Objects that move in place go straight
        into their rows and are verified there; only their report waits for the rest of the load."""
        a = self.arena
        codec = a.codecs[job.group]
        if self._draining(job):  # into private frames: from draining frames, the rest from the store
            return await self._into_frames(job, codec)
        if a.held_in_place_groups[job.group] and codec.host_path(job.index):
            # in place: the store writes the rows and they are verified there; nothing is
            # reported until the whole load verified (a failed load may leave partial bytes
            # in its rows, never reported landed)
            job.in_rows = True
            return await self.moved.load(job)
        t0 = time.perf_counter()
        size = a.frame_sizes[job.group]
        grid = job.staged = await a.held_frames(job)  # n * stride >= n * payload bytes
        if a.row_groups[job.group] and codec.host_path(job.index):
            # private rows laid out like the pool's segments, headers verified per sub-batch;
            # :meth:`land` copies them, one NumPy copy per segment
            target = job.staged_rows = private_rows(grid.numpy().reshape(-1), len(job.keys), codec)
            good, again, faults = await self.rows.get_verified(job, codec, size, target)
            ok = [g for batch in good for g in batch]
            return await self.calls.end_load(self.reread, job, codec, ok, again, faults, size, t0, report=False)
        return await self._from_store(job, codec, list(range(len(job.keys))), [False] * len(job.keys), t0)

    async def _into_frames(self, job: TransferJob, codec: PoolCodec) -> LoadResult:
        """Private frames for the whole job: the draining objects copied and verified there
        (:meth:`FrameRestore.into_held`), the rest read from the store into the same frames."""
        assert self.from_frames is not None
        t0 = time.perf_counter()
        grid = job.staged = await self.arena.held_frames(job)
        ok = [False] * len(job.keys)
        for i in await self.from_frames.into_held(job, grid):
            ok[i] = True
        return await self._from_store(job, codec, [i for i, o in enumerate(ok) if not o], ok, t0)

    async def _from_store(self, job: TransferJob, codec: PoolCodec, todo: list[int], ok: list[bool],
                          t0: float) -> LoadResult:
        """Read objects ``todo`` from the store into the job's private frames and verify them;
        ``ok`` holds what already verified (from draining frames)."""
        a = self.arena
        assert job.staged is not None
        grid, size = job.staged, a.frame_sizes[job.group]
        faults: dict[str, int] = {}
        batches = a.batches(len(todo))
        good: list[list[bool]] = [[] for _ in batches]
        again: list[int] = []  # objects to read once more (a fault a transfer can cause)

        async def get(k: int) -> list[GetResult]:
            which = todo[slice(*batches[k])]
            return await self.calls.call(self.calls.store.get, [job.keys[i] for i in which],
                                         [grid[i, :size] for i in which],
                                         GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))

        def verify(k: int, results: list[GetResult]) -> None:
            good[k] = self._check(job, todo[slice(*batches[k])], results, faults, again.append)

        async def verify_async(k: int, results: list[GetResult]) -> None:
            if a.inline(batches[k], size):
                verify(k, results)
            else:
                await a.threads.run(verify, k, results)

        if todo:
            await pipelined(len(batches), get, verify_async)  # sub-batch k verified while k+1 is read
        for i, g in zip(todo, (g for batch in good for g in batch), strict=True):
            ok[i] = g
        return await self.calls.end_load(self.reread, job, codec, ok, again, faults, size, t0, report=False)

    def _check(self, job: TransferJob, which: list[int] | range, results: list[GetResult], faults: dict[str, int],
               reread: Callable[[int], None] | None) -> list[bool]:
        """Verify objects ``which`` in the job's private frames; a first read sends faults a
        transfer can cause to ``reread``, a re-read (None) notes the object proved bad."""
        a = self.arena
        assert job.staged is not None
        size = a.frame_sizes[job.group]
        frames = job.staged.numpy()
        ok: list[bool] = []
        for i, r in zip(which, results):
            verify = partial(framing.verify_array, frames[i, :size], r.nbytes, job.keys[i], a.fingerprint,
                             integrity=a.integrity, room=size - framing.HEADER_BYTES)
            ok.append(check_landed(r, False, verify, faults, None if reread is None else partial(reread, i),
                                   None if reread is not None else condemner(job, i, frames[i, :framing.HEADER_BYTES]))[0])
        return ok

    async def reread(self, job: TransferJob, again: list[int], faults: dict[str, int]) -> list[bool]:
        """Read the objects ``again`` once more into the same private frames (or rows)."""
        if job.staged_rows is not None:  # in one row-described call
            return await self.rows.reread_into(job, job.staged_rows, again, faults)
        assert job.staged is not None
        size = self.arena.frame_sizes[job.group]
        results = await self.calls.call(self.calls.store.get, [job.keys[i] for i in again],
                                        [job.staged[i, :size] for i in again],
                                        GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))
        return self._check(job, again, results, faults, None)

    async def land(self, job: TransferJob, on_layer: Callable[[int], None]) -> None:
        """Write a held job's verified frames into its rows; ``on_layer(layer_id)`` (on the
        loop) once each layer's rows hold them (device pools: once the copies completed)."""
        a = self.arena
        codec, size = a.codecs[job.group], a.frame_sizes[job.group]
        if job.in_rows:  # already written and verified in place
            for layer in codec.layer_ids:
                on_layer(layer)
            return
        assert job.staged is not None, "land needs a verified held job"
        if job.staged_rows is not None:  # private rows: one copy per segment
            held = job.staged_rows.segments
            if a.inline((0, len(job.keys)), size):
                codec.scatter_segments(held, job.index, on_layer)
            else:
                await a.threads.run(codec.scatter_segments, held, job.index, _on_loop(on_layer))
            return
        payload = job.staged[:, framing.HEADER_BYTES: size]
        if a.copies is not None:
            with a.copies.on_stream():
                codec.scatter(payload, job.index, None)
                ev = a.copies.record()
            await wait_fence(ev, timeout_s=a.fence_timeout_s)
            for layer in codec.layer_ids:
                on_layer(layer)
        elif a.inline((0, len(job.keys)), size):
            codec.scatter(payload, job.index, on_layer)
        else:
            await a.threads.run(codec.scatter, payload, job.index, _on_loop(on_layer))


def _on_loop(on_layer: Callable[[int], None]) -> Callable[[int], None]:
    """``on_layer`` for a worker thread: each call runs on the loop."""
    loop = asyncio.get_running_loop()

    def landed(layer: int) -> None:
        loop.call_soon_threadsafe(on_layer, layer)
    return landed
