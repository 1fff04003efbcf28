"""Verify all, then land: a held load writes no row until every job of the load verified."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial

import attrs
import numpy as np
import torch

from ...stores import framing
from ...stores.base import GetResult, Outcome
from ...stores.rows import RowResults
from .events import wait_fence
from .in_place import InPlaceTransfers, RowTarget, private_rows
from .pool_staging import check_landed, pipelined
from .transfer_codec import PoolCodec
from .transfer_jobs import LoadResult, TransferJob

log = logging.getLogger(__name__)


class HeldLoads(InPlaceTransfers):
    """A pool actor's verify-all-then-land loads. See the module doc."""

    async def _held_frames(self, job: TransferJob) -> torch.Tensor:
        """``[n, stride]`` private frames for a held job: the registered held arena when it is
        free, grown first if the job is larger (up to ``held_max_bytes``), else fresh memory
        (the store then copies through its own buffers, and the first touch of every page is
        paid during the load)."""
        n = len(job.keys)
        need = n * self.stride
        if self._held_arena is None:
            self._held_arena = self._new_arena()
            self.store.register(self._held_arena)
        if not self._held_busy and self._held_arena.numel() < need <= self.held_max_bytes:
            await self._grow_held(need)
        arena = self._held_arena
        if not self._held_busy and need <= arena.numel():
            self._held_busy = True
            job.staged_in_arena = True
            return arena[:need].view(n, self.stride)
        if self.copies is not None:
            return self.copies.staging(need).view(n, self.stride)
        return torch.empty((n, self.stride), dtype=torch.uint8)

    async def _grow_held(self, need: int) -> None:
        """Replace the free held arena with one of at least ``need`` bytes (twice the old size
        if that is more, at most ``held_max_bytes``), filled in a worker thread so the pages
        are touched once here and never during a load, and registered with the store; the old
        arena (free: no job holds frames in it) is then unregistered and dropped. If the store
        refuses the new one, the old one stays."""
        old = self._held_arena
        assert old is not None and not self._held_busy
        size = max(need, min(2 * old.numel(), self.held_max_bytes))
        size = -(-size // self.stride) * self.stride
        self._held_busy = True  # nothing else takes the arena while the new one is filled
        try:
            arena = await self.threads.run(self._new_arena, size)
            try:
                self.store.register(arena)
            except Exception as exc:  # keep the old arena; this load takes fresh memory
                log.warning("held arena of %d bytes not registered (%r); keeping %d bytes", size, exc, old.numel())
                return
            self._held_arena = arena
            self.store.unregister(old)
            self.held_arena_growths += 1
        finally:
            self._held_busy = False

    async def _load_held(self, job: TransferJob, codec: PoolCodec, size: int, t0: float) -> LoadResult:
        """Get every object of the job into private frames and verify it; write no row.
        Sub-batch k is verified while k+1 is in flight. The ticket lands the frames
        (:meth:`land_held`) once every job of the load verified, or drops them
        (:meth:`release_held`). Objects that move in place go straight into their rows and
        are verified there; only their report waits for the rest of the load."""
        if self.held_in_place_groups[job.group] and codec.host_path(job.index):
            # in place: the store writes the rows and they are verified there; nothing is
            # reported until the whole load verified (a failed load may leave partial bytes
            # in its rows, never reported landed)
            job.in_rows = True
            return await self._load_in_place(job, codec, size, t0)
        if self.row_groups[job.group] and codec.host_path(job.index):
            return await self._load_held_rows(job, codec, size, t0)
        faults: dict[str, int] = {}
        grid = await self._held_frames(job)
        job.staged = grid
        batches = self._batches(len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]
        again: list[int] = []  # objects to read once more (a fault a transfer can cause)

        async def get(k: int) -> list[GetResult]:
            lo, hi = batches[k]
            frames = [grid[i, :size] for i in range(lo, hi)]
            return await self._store_call(self.store.get, job.keys[lo:hi], frames,
                                          GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))

        def check(which: list[int] | range, results: list[GetResult], reread: bool) -> list[bool]:
            frames = grid.numpy()
            ok: list[bool] = []
            for i, r in zip(which, results):
                verify = partial(framing.verify_array, frames[i, :size], r.nbytes, job.keys[i], self.fingerprint,
                                 integrity=self.integrity, room=size - framing.HEADER_BYTES)
                ok.append(check_landed(r, False, verify, faults, partial(again.append, i) if reread else None,
                                       None if reread else self._condemner(job, i, frames[i, :framing.HEADER_BYTES]))[0])
            return ok

        def verify(k: int, results: list[GetResult]) -> None:
            good[k] = check(range(*batches[k]), results, True)

        async def verify_async(k: int, results: list[GetResult]) -> None:
            if self._inline(batches[k], size):
                verify(k, results)
            else:
                await self.threads.run(verify, k, results)

        await pipelined(len(batches), get, verify_async)  # sub-batch k verified while k+1 is read
        ok = [g for batch in good for g in batch]
        if again:  # read once more into the same private frames
            again.sort()
            results = await self._store_call(self.store.get, [job.keys[i] for i in again],
                                             [grid[i, :size] for i in again],
                                             GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))
            self._reread_outcome(ok, again, check(again, results, False))
        return self._loaded(job, ok, faults, size, t0)

    async def _load_held_rows(self, job: TransferJob, codec: PoolCodec, size: int, t0: float) -> LoadResult:
        """A held job over a store with row-described calls: every object is got into private
        rows laid out like the pool's segments (in the held arena), by sub-batches whose
        headers are verified at once, as an in-place load does; no pool row is written until
        :meth:`land_held` copies them, one NumPy copy per segment."""
        n = len(job.keys)
        grid = await self._held_frames(job)  # n * stride >= n * payload bytes
        job.staged = grid
        target = job.staged_rows = private_rows(grid.numpy().reshape(-1), n, codec)
        good, again, faults = await self._get_rows_verified(job, codec, size, target)
        ok = [g for batch in good for g in batch]
        if again:  # read once more into the same private rows, in one call
            again.sort()
            self._reread_outcome(ok, again, await self._reread_rows(job, codec, size, target, again, faults))
        return self._loaded(job, ok, faults, size, t0)

    async def _reread_rows(self, job: TransferJob, codec: PoolCodec, size: int, target: RowTarget,
                           again: list[int], faults: dict[str, int]) -> list[bool]:
        """Get the objects ``again`` once more into ``target`` and verify each; what fails now is
        counted under its fault (the stored object is bad)."""
        batch = self._row_batch(job, codec, 0, len(job.keys), None, target).select(again)
        batch = attrs.evolve(batch, heads=np.empty((len(again), framing.HEADER_BYTES), dtype=np.uint8))
        res = await self._rows_call(self.store.get_rows,  # type: ignore[attr-defined]
                                    batch, lambda: RowResults.of(len(again), Outcome.UNREACHABLE))
        if len(res.codes) != len(again):
            res = RowResults.of(len(again), Outcome.FAILED)
        return [self._row_landed(job, codec, target, batch, res, j, i, faults, None) for j, i in enumerate(again)]

    async def land_held(self, job: TransferJob, on_layer: Callable[[int], None]) -> None:
        """Write a held job's verified frames into its rows; ``on_layer(layer_id)`` (on the
        loop) once each layer's rows hold them (device pools: once the copies completed)."""
        codec, size = self.codecs[job.group], self.frame_sizes[job.group]
        if job.in_rows:  # already written and verified in place
            for layer in codec.layer_ids:
                on_layer(layer)
            return
        assert job.staged is not None, "land_held needs a verified held job"
        if job.staged_rows is not None:  # private rows: one copy per segment
            held = job.staged_rows.segments
            if self._inline((0, len(job.keys)), size):
                codec.scatter_segments(held, job.index, on_layer)
            else:
                loop = asyncio.get_running_loop()

                def landed_layer(layer: int) -> None:  # in the worker thread: on_layer runs on the loop
                    loop.call_soon_threadsafe(on_layer, layer)

                await self.threads.run(codec.scatter_segments, held, job.index, landed_layer)
            return
        payload = job.staged[:, framing.HEADER_BYTES: size]
        if self.copies is not None:
            with self.copies.on_stream():
                codec.scatter(payload, job.index, None)
                ev = self.copies.record()
            await wait_fence(ev, timeout_s=self.fence_timeout_s)
            for layer in codec.layer_ids:
                on_layer(layer)
        elif self._inline((0, len(job.keys)), size):
            codec.scatter(payload, job.index, on_layer)
        else:
            loop = asyncio.get_running_loop()

            def landed(layer: int) -> None:  # in the worker thread: on_layer runs on the loop
                loop.call_soon_threadsafe(on_layer, layer)

            await self.threads.run(codec.scatter, payload, job.index, landed)

    def release_held(self, job: TransferJob) -> None:
        """Drop a held job's frames (landed, or its load failed)."""
        job.staged = None
        job.staged_rows = None
        if job.staged_in_arena:
            job.staged_in_arena = False
            self._held_busy = False
