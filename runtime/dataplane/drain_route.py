"""The two-stage offload's route: rows → sealed frames of its own (stage 1), frames → store (stage 2).

Stage 1 (:meth:`DrainRoute.copy`) gathers a job's objects from the pool's rows into a private
``[n, stride]`` buffer of host memory (pinned for a device pool, the device → host copy on the
actor's copy stream and fenced before sealing; on a host pool a memcpy) and seals each frame
(``stores/framing.py``): from then on the rows are free and only the frames are read. Stage 2
(:meth:`DrainRoute.put`) puts those frames to the store a sub-batch at a time, through the same
call as a staged offload (:meth:`~hylinker.runtime.dataplane.staged_route.StagedRoute.put`), and
returns one outcome per object. The frames are the caller's until the store answered
(``runtime/dataplane/pool_actor.py`` keeps them alive; ``host_staging.py`` charges their bytes).
On a host pool the frames are an extent of the plane's :class:`FrameRegion` (touched and
registered once, ``frame_region.py``), given back once nothing reads them.

A job the actor moves on the device (``device_transfers.py``: device checksums, or a store that
addresses device memory) is not two-staged: it keeps its rows until the store answers.
"""

from __future__ import annotations

import torch

from ...stores import framing
from ...stores.base import Outcome
from .events import DeviceEvent, wait_fence
from .frame_region import FrameRegion
from .staged_route import StagedRoute, seal_frames
from .staging_arena import StagingArena
from .transfer_jobs import TransferJob


class DrainRoute:
    """Stage 1 and stage 2 of a two-stage offload. See the module doc."""

    def __init__(self, arena: StagingArena, staged: StagedRoute) -> None:
        self.arena = arena
        self.staged = staged  # its put: the one store call of a staged offload
        #: host memory the frames are cut from (``frame_region.py``; None: fresh memory per job)
        self.region: FrameRegion | None = None

    def frame_bytes(self, n: int) -> int:
        """Host bytes ``n`` objects take in staging (what the budget charges)."""
        return n * self.arena.stride

    # ---- stage 1 --------------------------------------------------------------------------
    async def copy(self, job: TransferJob) -> torch.Tensor:
        """Copy ``job``'s objects from its rows into new frames and seal them; returns the
        ``[n, stride]`` frames, sealed (on a device: once the copy into them finished)."""
        a = self.arena
        n, size = len(job.keys), a.frame_sizes[job.group]
        if a.copies is not None:
            grid = a.copies.staging(n * a.stride).view(n, a.stride)
            ev = await a.threads.run(self._gather, job, grid)
            await wait_fence(ev, timeout_s=a.fence_timeout_s)  # never seal before the copy landed
            await a.threads.run(self._seal, job, grid)
            return grid
        if self.region is None:
            grid = torch.empty((n, a.stride), dtype=torch.uint8)
        else:
            grid = (await self.region.take(n * a.stride)).view(n, a.stride)
        try:
            if a.inline((0, n), size):
                self._pack(job, grid)
            else:
                await a.threads.run(self._pack, job, grid)
        except BaseException:
            self.give(grid)
            raise
        return grid

    def give(self, grid: torch.Tensor | None) -> None:
        """``grid``'s frames are read no more (the store answered, or they were dropped and no
        load has them pinned): their extent of the region is free again."""
        if grid is not None and self.region is not None:
            self.region.give(grid)

    def _pack(self, job: TransferJob, grid: torch.Tensor) -> None:
        self._gather(job, grid)
        self._seal(job, grid)

    def _gather(self, job: TransferJob, grid: torch.Tensor) -> DeviceEvent | None:
        a = self.arena
        payload = grid[:, framing.HEADER_BYTES: a.frame_sizes[job.group]]
        codec = a.codecs[job.group]
        if a.copies is None:
            codec.gather(job.index, payload)
            return None
        with a.copies.on_stream():  # device -> pinned host frames on the copy stream
            codec.gather(job.index, payload)
            return a.copies.record()

    def _seal(self, job: TransferJob, grid: torch.Tensor) -> None:
        size = self.arena.frame_sizes[job.group]
        frames = grid.numpy()
        seal_frames(self.arena, self.staged.calls, job.keys, [frames[i, :size] for i in range(len(job.keys))],
                    size - framing.HEADER_BYTES)

    # ---- stage 2 --------------------------------------------------------------------------
    async def put(self, job: TransferJob, grid: torch.Tensor) -> list[Outcome]:
        """Put the sealed frames of ``job`` to the store, a sub-batch per call; one outcome
        per object."""
        size = self.arena.frame_sizes[job.group]
        batches = self.arena.batches(len(job.keys))
        out: list[Outcome] = []
        for k, (lo, hi) in enumerate(batches):
            out.extend(await self.staged.put(job, batches, k, [grid[i, :size] for i in range(lo, hi)]))
        return out
