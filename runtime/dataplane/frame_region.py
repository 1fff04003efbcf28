"""The host memory a two-stage offload's frames are cut from: touched once, registered once.

Stage 1 of a two-stage offload (``runtime/dataplane/drain_route.py``) copies a job's objects
into frames of its own, and stage 2 puts them. Frames in fresh memory cost twice on that path,
measured with ``hylinker bench-sglang --stages 2 1`` (docs/figures/sglang.md): every 4 KiB page of
a new allocation faults on first touch (~10 µs a page on a virtual machine that returns free
memory to its host: 0.4 GB/s), and a store that moves registered memory without a copy
(Mooncake) copies unregistered frames through its bounce buffer first. So the frames come from
a :class:`FrameRegion`: blocks of host memory zero-filled once in a worker thread (every page
touched) and registered with the store once, from which each job takes one contiguous extent
and gives it back when its frames are no longer read.

Invariants the callers keep:

* An extent is given back (:meth:`FrameRegion.give`) exactly once, and only when nothing reads
  its frames any more: the store answered the job's put (data calls are never abandoned
  mid-copy: ``stores/mooncake.py``), and no load has them pinned
  (``runtime/dataplane/frame_index.py`` gives them back at the last unpin).
* The region never holds more than the host staging budget (``HostStaging.capacity``) in
  blocks. A job that finds no free extent and no room to grow gets fresh memory
  (:attr:`FrameRegion.outside`, counted): slower, never refused, never wrong.
* Blocks are kept once touched (like a host cache pool): memory grows to the staging peak,
  never past the budget, and is released when the data plane is dropped.
* All calls come from the data plane's event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from ...stores.base import Store
from ...stores.host_bytes import zero_fill
from ...stores.worker_threads import WorkerThreads

log = logging.getLogger(__name__)

#: extents start on a 64-byte boundary, like the frames in them (a job's extent is its frames:
#: ``n × stride``, a multiple of 64, so the region's blocks never need more than the budget)
ALIGN = 64
#: blocks grow in steps of at least this (a single larger job gets a block of its own size)
BLOCK_BYTES = 64 << 20


class _Block:
    """One registered, touched block and its free extents, sorted by offset, never adjacent."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.starts: list[int] = [0]
        self.sizes: list[int] = [memory.numel()]

    def take(self, nbytes: int) -> int | None:
        """The offset of a free extent of ``nbytes`` (first fit), now taken; None if none fits."""
        for i, size in enumerate(self.sizes):
            if size >= nbytes:
                start = self.starts[i]
                if size == nbytes:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += nbytes
                    self.sizes[i] -= nbytes
                return start
        return None

    def give(self, start: int, nbytes: int) -> None:
        """Free ``[start, start + nbytes)``, merged with the free extents beside it."""
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:  # merge with the one before
            i -= 1
            self.sizes[i] += nbytes
        else:
            self.starts.insert(i, start)
            self.sizes.insert(i, nbytes)
        if i + 1 < len(self.starts) and self.starts[i] + self.sizes[i] == self.starts[i + 1]:
            self.sizes[i] += self.sizes.pop(i + 1)
            del self.starts[i + 1]

    @property
    def free_bytes(self) -> int:
        return sum(self.sizes)


class FrameRegion:
    """Touched, registered host memory for draining frames, within a byte bound. See the module doc."""

    def __init__(self, store: Store, threads: WorkerThreads, limit: Callable[[], int],
                 block_bytes: int = BLOCK_BYTES) -> None:
        """``limit()``: the most bytes the blocks may hold together (the host staging budget,
        read at each growth, so a lowered budget applies); ``block_bytes``: the smallest growth step."""
        self.store = store
        self.threads = threads
        self.limit = limit
        self.block_bytes = block_bytes
        self.blocks: list[_Block] = []
        self._taken: dict[int, tuple[_Block, int, int]] = {}  # data_ptr -> (block, start, bytes)
        self.reserved = 0  # bytes of every block
        self.taken_bytes = 0  # bytes of extents handed out and not given back
        self.growths = 0
        self.outside = 0  # jobs whose frames are fresh memory (no extent, no room to grow)
        self.unregistered = 0  # blocks the store refused to register (kept: touched, copied through)

    async def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory for one job's frames: an extent of a block (grown first if
        no extent fits and the limit has room), else fresh memory, counted in :attr:`outside`."""
        size = -(-nbytes // ALIGN) * ALIGN
        for block in self.blocks:
            start = block.take(size)
            if start is not None:
                return self._hand_out(block, start, size, nbytes)
        grow = max(size, self.block_bytes)
        limit = self.limit()
        if self.reserved + grow > limit:
            grow = size  # the last room under the limit, if the job fits in it
        if self.reserved + grow <= limit:
            block = await self._grow(grow)
            start = block.take(size)
            assert start is not None
            return self._hand_out(block, start, size, nbytes)
        self.outside += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, memory: torch.Tensor) -> None:
        """``memory`` (from :meth:`take`) is read no more: its extent is free again. Fresh
        memory is left to the garbage collector."""
        found = self._taken.pop(memory.data_ptr(), None)
        if found is None:
            return
        block, start, size = found
        block.give(start, size)
        self.taken_bytes -= size

    def _hand_out(self, block: _Block, start: int, size: int, nbytes: int) -> torch.Tensor:
        memory = block.memory[start: start + nbytes]
        self._taken[memory.data_ptr()] = (block, start, size)
        self.taken_bytes += size
        return memory

    async def _grow(self, nbytes: int) -> _Block:
        memory = await self.threads.run(zero_fill, torch.empty(nbytes, dtype=torch.uint8))
        try:
            self.store.register(memory)
        except Exception as exc:  # still touched: only the zero-copy put is lost
            self.unregistered += 1
            log.warning("host staging block of %d bytes not registered with the store (%r)", nbytes, exc)
        block = _Block(memory)
        self.blocks.append(block)
        self.reserved += nbytes
        self.growths += 1
        return block

    def figures(self) -> dict[str, int]:
        return {"host_staging_region_bytes": self.reserved, "host_staging_region_taken_bytes": self.taken_bytes,
                "host_staging_region_growths": self.growths, "host_staging_frames_outside": self.outside}


__all__ = ["ALIGN", "BLOCK_BYTES", "FrameRegion"]
