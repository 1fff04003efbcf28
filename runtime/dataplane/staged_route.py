"""Staged: objects pass through the actor's staging arena as whole frames.

Offload is two steps per sub-batch, each a method: :meth:`StagedRoute.seal` copies the rows
into sealed frames in host staging (device rows: on the actor's copy stream into pinned
staging, fenced before sealing) and :meth:`StagedRoute.put` puts those sealed frames to the
store; sub-batch ``k`` is sealed while ``k - 1`` is put (``runtime/dataplane/pipeline.py``). Load gets
sub-batch ``k`` into staging while ``k - 1`` is verified and scattered into its rows.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial

import numpy as np
import torch

from ...stores import framing
from ...stores.base import GetResult, Outcome
from .events import DeviceEvent, wait_fence
from .pipeline import pipelined
from .staging_arena import StagingArena
from .store_calls import StoreCalls, check_landed, condemner, split
from .transfer_jobs import LoadResult, OffloadResult, TransferJob

Batches = list[tuple[int, int]]


class StagedRoute:
    """Whole frames through the staging arena. See the module doc."""

    def __init__(self, arena: StagingArena, calls: StoreCalls) -> None:
        self.arena = arena
        self.calls = calls

    # ---- offload: device -> sealed host frames, then sealed frames -> store ----------------
    async def offload(self, job: TransferJob) -> OffloadResult:
        """Seal sub-batch k (in a thread unless small) while sub-batch k-1 is put."""
        t0 = time.perf_counter()
        size = self.arena.frame_sizes[job.group]
        batches = self.arena.batches(len(job.keys))
        results: list[list[Outcome]] = [[] for _ in batches]

        async def sealed(k: int) -> list[torch.Tensor]:
            return await self.seal(job, batches, k)

        async def put(k: int, frames: list[torch.Tensor]) -> None:
            results[k] = await self.put(job, batches, k, frames)

        await pipelined(len(batches), sealed, put)
        return self.calls.offloaded(job, [o for r in results for o in r], size, t0)

    async def seal(self, job: TransferJob, batches: Batches, k: int) -> list[torch.Tensor]:
        """Copy sub-batch ``k``'s rows into frames in staging half ``k % 2`` and seal them
        (headers; the payload's checksum unless the store sets it as it copies). Returns the
        sealed frames; on a device, only once the copy into them finished."""
        a = self.arena
        if a.inline(batches[k], a.frame_sizes[job.group]):
            return self._pack(job, batches, k)  # small: cheaper than two thread hops
        if a.copies is None:
            return await a.threads.run(self._pack, job, batches, k)
        ev = await a.threads.run(self._gather, job, batches, k)
        # never seal (read) staged bytes before the device copy into them finished
        await wait_fence(ev, timeout_s=a.fence_timeout_s)
        return await a.threads.run(self._seal_frames, job, batches, k)

    async def put(self, job: TransferJob, batches: Batches, k: int, frames: list[torch.Tensor]) -> list[Outcome]:
        """Put sub-batch ``k``'s sealed frames; one outcome per object."""
        lo, hi = batches[k]
        calls = self.calls
        if calls.checksums:
            return await calls.call(calls.store.put_sealed,  # type: ignore[attr-defined]
                                    job.keys[lo:hi], [split(f) for f in frames], Outcome.UNREACHABLE, Outcome.FAILED)
        return await calls.call(calls.store.put, job.keys[lo:hi], frames, Outcome.UNREACHABLE, Outcome.FAILED)

    def _pack(self, job: TransferJob, batches: Batches, k: int) -> list[torch.Tensor]:
        self._gather(job, batches, k)
        return self._seal_frames(job, batches, k)

    def _gather(self, job: TransferJob, batches: Batches, k: int) -> DeviceEvent | None:
        a = self.arena
        lo, hi = batches[k]
        codec, size = a.codecs[job.group], a.frame_sizes[job.group]
        grid, _ = a.views("offload", k % 2, hi - lo, size)
        if a.copies is None:
            codec.gather(job.index[lo:hi], grid[:, framing.HEADER_BYTES: size])
            return None
        with a.copies.on_stream():  # device -> pinned staging on the copy stream
            codec.gather(job.index[lo:hi], grid[:, framing.HEADER_BYTES: size])
            return a.copies.record()

    def _seal_frames(self, job: TransferJob, batches: Batches, k: int) -> list[torch.Tensor]:
        a = self.arena
        lo, hi = batches[k]
        size = a.frame_sizes[job.group]
        payload = size - framing.HEADER_BYTES
        _, frames = a.views("offload", k % 2, hi - lo, size)
        seal_frames(a, self.calls, job.keys[lo:hi], a.np_frames("offload", k % 2, hi - lo, size), payload)
        return frames

    # ---- load -----------------------------------------------------------------------------
    async def load(self, job: TransferJob) -> LoadResult:
        """Get sub-batch k while sub-batch k-1 is verified and scattered in a thread."""
        a = self.arena
        faults: dict[str, int] = {}
        t0 = time.perf_counter()
        codec, size = a.codecs[job.group], a.frame_sizes[job.group]
        batches = a.batches(len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]
        again: list[int] = []  # objects to read once more (a fault a transfer can cause)
        checksums = self.calls.checksums

        def unpack(k: int, results: list[GetResult]) -> DeviceEvent | None:
            """Verify sub-batch k in staging and land it; on a device, returns the event that
            completes when the copies into the rows are done."""
            lo, hi = batches[k]
            frames = a.np_frames("load", k % 2, hi - lo, size)
            index = job.index[lo:hi]
            # host pools: land each object right after verifying it, while it is still in cache
            fused = codec.host_path(index)
            rows = index[:, 0].tolist()
            ok: list[bool] = []
            for i, (key, f, r) in enumerate(zip(job.keys[lo:hi], frames, results)):
                verify = partial(framing.verify_array, f, r.nbytes, key, a.fingerprint, integrity=a.integrity,
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
            grid, _ = a.views("load", k % 2, hi - lo, size)
            sel = [i for i, g in enumerate(ok) if g]
            with a.copies.on_stream() if a.copies is not None else contextlib.nullcontext():
                if len(sel) == len(ok):
                    codec.scatter(grid[:, framing.HEADER_BYTES: size], index, None)
                elif sel:
                    pick = torch.tensor(sel, dtype=torch.int64)
                    codec.scatter(grid[pick, framing.HEADER_BYTES: size], index[pick], None)
                return a.copies.record() if a.copies is not None else None

        async def land(k: int, results: list[GetResult]) -> None:
            if a.inline(batches[k], size):
                unpack(k, results)
                return
            ev = await a.threads.run(unpack, k, results)
            # landed only once the device copies finished; the staging half is reused after
            await wait_fence(ev, timeout_s=a.fence_timeout_s)

        async def get(k: int) -> list[GetResult]:
            lo, hi = batches[k]
            _, frames = a.views("load", k % 2, hi - lo, size)
            return await self.calls.get_frames(job.keys[lo:hi], frames)

        await pipelined(len(batches), get, land)
        ok = [g for batch in good for g in batch]
        return await self.calls.end_load(self.reread, job, codec, ok, again, faults, size, t0)

    async def reread(self, job: TransferJob, again: list[int], faults: dict[str, int]) -> list[bool]:
        """Read the objects ``again`` once more, into frames of their own (the arena's halves
        may hold later sub-batches by now), verify them and land the ones that verify."""
        a = self.arena
        codec, size = a.codecs[job.group], a.frame_sizes[job.group]
        grid = a.new_arena(len(again) * a.stride).view(len(again), a.stride)
        frames = [grid[j, :size] for j in range(len(again))]
        results = await self.calls.get_frames([job.keys[i] for i in again], frames)
        frames_np = grid.numpy()
        verified: list[bool] = []
        for j, (i, r) in enumerate(zip(again, results)):
            verify = partial(framing.verify_array, frames_np[j, :size], r.nbytes, job.keys[i], a.fingerprint,
                             integrity=a.integrity, room=size - framing.HEADER_BYTES)
            verified.append(check_landed(r, self.calls.checksums, verify, faults, None,
                                         condemner(job, i, frames_np[j, :framing.HEADER_BYTES]))[0])
        sel = [j for j, v in enumerate(verified) if v]
        if sel:
            pick = torch.tensor(sel, dtype=torch.int64)
            index = job.index[torch.tensor([again[j] for j in sel], dtype=torch.int64)]
            with a.copies.on_stream() if a.copies is not None else contextlib.nullcontext():
                codec.scatter(grid[pick, framing.HEADER_BYTES: size], index, None)
                ev = a.copies.record() if a.copies is not None else None
            await wait_fence(ev, timeout_s=a.fence_timeout_s)
        return verified


def seal_frames(arena: StagingArena, calls: StoreCalls, keys: list[str], frames: list[np.ndarray],
                payload: int) -> None:
    """Seal ``frames`` (gathered payloads behind room for a header) as the objects ``keys``:
    the whole header, or every field but the checksum where the store sets it as it copies."""
    for key, f in zip(keys, frames):
        if calls.checksums:  # the store sets the checksum as it copies the frame
            framing.seal_header(f, key, arena.fingerprint, payload)
        else:
            framing.seal_array(f, key, arena.fingerprint, arena.integrity)
