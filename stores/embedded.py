"""The embedded store: in-process host memory, the default backend.

Objects live in *slabs*, not in one Python object each. Every object size class (the object
size rounded up to :data:`SLOT_ALIGN` bytes) owns a list of large ``uint8`` chunks, each cut
into equal slots, plus a free-slot list per chunk. The index maps a key to ``(size class,
slot, nbytes)`` and doubles as the LRU order (an ordered dict, oldest first).

Rules:

* **Capacity** counts the slot bytes of the objects held (and of puts still copying). A put
  evicts least-recently-used objects until its object fits; an object that cannot fit even
  in an empty store is :attr:`Outcome.FULL`. A ``get`` and a ``touch`` make an object the most
  recently used. Chunk memory is allocated on demand and kept when it empties (eviction
  refills it at once, without fresh page faults); empty chunks are given back only when the
  memory held would exceed the capacity (e.g. another size class needs room). Memory held
  stays within the capacity plus one chunk per size class.
* **First writer wins**: a key that is stored, or whose put is still copying, answers
  :attr:`Outcome.EXISTS`; a key repeated inside one batch keeps its first buffer.
* **Concurrency**: an index lock is held only to plan a batch (reserve slots, pin the slots
  being read) and to publish it; the byte copies run outside the lock, inline for small
  batches and in a worker thread (bounded by a capacity limiter) for batches that move more
  than ``thread_threshold_bytes``, so large batches never stall the event loop. A put is
  invisible until its copy finished; a slot being read is never evicted or reused while the
  read copies out of it (a ``remove`` during the read frees the slot afterwards).
* :meth:`EmbeddedStore.close` waits for calls in flight; later calls raise
  :class:`StoreClosedError`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import structlog
import torch

from .base import (
    GetResult,
    Outcome,
    StoreCapabilities,
    StoreClosedError,
    StoreStatistics,
    check_buffers,
)
from .calls import InflightCalls, check_keys
from .condemned import Condemned
from .embedded_rows import RowTransfers
from .eviction_memory import DEFAULT_BUDGET_BYTES, EvictionMemory
from .frame_copies import (
    Frame,
    check_parts,
    check_sealed,
    copy_all,
    into_slot,
    land_all,
    out_of_slot,
    seal_all,
)
from .framing import HEADER_BYTES
from .rows import RowBatch, RowResults
from .slab_index import SLOT_ALIGN, Get, Put, SlabIndex
from .worker_threads import WorkerThreads

T = TypeVar("T")

DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_THREAD_THRESHOLD_BYTES = 4 << 20

_log = structlog.get_logger(__name__)


class EmbeddedStore(RowTransfers):
    """In-process host-memory store with a byte capacity and LRU eviction.

    ``capacity_bytes``: the most object bytes held (slot-rounded, see the module docstring).
    ``chunk_bytes``: slab chunk size; a chunk holds at least one slot and never more than
    the capacity. ``thread_threshold_bytes``: batches moving more bytes copy in a worker
    thread. ``max_workers``: worker threads copying at once. ``clock``: the time the eviction
    memory (:attr:`evictions_memory`) stamps evictions with (a replay passes its trace time).
    ``eviction_memory_bytes``: that memory's budget (0: off; ``stores/eviction_memory.py``).
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        thread_threshold_bytes: int = DEFAULT_THREAD_THRESHOLD_BYTES,
        max_workers: int = 2,
        name: str = "embedded",
        clock: Callable[[], float] = time.monotonic,
        eviction_memory_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if chunk_bytes < SLOT_ALIGN:
            raise ValueError(f"chunk_bytes must be at least {SLOT_ALIGN}, got {chunk_bytes}")
        if thread_threshold_bytes < 0:
            raise ValueError(f"thread_threshold_bytes must be >= 0, got {thread_threshold_bytes}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._thread_threshold = thread_threshold_bytes
        self._max_workers = max_workers
        self._workers: WorkerThreads | None = None  # started with the first threaded copy
        self._capabilities = StoreCapabilities(name=name, touch=True, remove=True, zero_copy=False,
                                               scatter=True, checksums=True, rows=True)
        self._calls = InflightCalls(name)
        #: evicted keys asked for again (``evicted_probed_again`` / ``evicted_touched_again``)
        self.evictions_memory = EvictionMemory(clock, eviction_memory_bytes)
        self._slabs = SlabIndex(capacity_bytes, min(chunk_bytes, max(SLOT_ALIGN, capacity_bytes)),
                                self.evictions_memory)
        # the index's state under the names the store's tests look at
        self._classes, self._pins, self._pending = self._slabs.classes, self._slabs.pins, self._slabs.pending
        self._plan_get, self._finish_get = self._slabs.plan_get, self._slabs.finish_get

    # ---- protocol -------------------------------------------------------------------------

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._capabilities

    def on_evict(self, listener: Callable[[list[str]], None] | None) -> None:
        """Call ``listener`` with the keys of every eviction batch (under the store's lock, from
        the thread that put: it must only record them). A connector whose lookups run in another
        process reports them there (``integrations/vllm/index.py``)."""
        self._slabs.on_evict = listener

    def register(self, region: torch.Tensor) -> None:
        """No-op: this store copies, so any host buffer will do."""
        if self._calls.closed:
            raise StoreClosedError(f"{self._capabilities.name} store is closed")

    def unregister(self, region: torch.Tensor) -> None:
        """No-op, like :meth:`register`."""

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        check_keys(keys)
        with self._calls, self._slabs.lock:
            self._slabs.stats["exists_calls"] += 1
            present = [key in self._slabs.index for key in keys]
            for key, held in zip(keys, present):
                if not held:
                    self._slabs.stats["evicted_probed_again"] += self.evictions_memory.asked_again(key)
            return present

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        check_buffers(keys, buffers)

        def copy(plan: list[Put]) -> Callable[[], object]:
            return functools.partial(copy_all, [self._slabs.view(loc) for _, _, loc in plan],
                                     [buffers[i].numpy() for i, _, _ in plan])

        return await self._put_with(keys, buffers, copy)

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        check_buffers(keys, buffers)

        def copy(plan: list[Get]) -> Callable[[], None]:
            return functools.partial(copy_all, [buffers[i].numpy()[: loc[2]] for i, loc in plan],
                                     [self._slabs.view(loc) for _, loc in plan])

        return await self._get_with(keys, buffers, copy)

    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        """Store each object from its buffers (their concatenation), one copy per buffer."""
        sized = check_parts(keys, parts)

        def copy(plan: list[Put]) -> Callable[[], object]:
            targets: list[np.ndarray] = []
            sources: list[np.ndarray] = []
            for i, _, loc in plan:
                t, s = into_slot(self._slabs.view(loc), parts[i], 0)
                targets += t
                sources += s
            return functools.partial(copy_all, targets, sources)

        return await self._put_with(keys, sized, copy)

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        """Read each object into its buffers in order (one copy per buffer, none staged)."""
        sized = check_parts(keys, parts)

        def copy(plan: list[Get]) -> Callable[[], None]:
            targets: list[np.ndarray] = []
            sources: list[np.ndarray] = []
            for i, loc in plan:
                t, s = out_of_slot(self._slabs.view(loc), loc[2], parts[i], 0)
                targets += t
                sources += s
            return functools.partial(copy_all, targets, sources)

        return await self._get_with(keys, sized, copy)

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        """:meth:`put_parts` of frames whose header (``parts[i][0]``, 64 bytes, checksum not
        set) is completed here: the payload parts are copied into the slot while their landed
        bytes are checksummed, then the header is written with that checksum (see
        :class:`~hylinker.stores.base.ChecksumStore`)."""
        sized = check_sealed(keys, parts)

        def copy(plan: list[Put]) -> Callable[[], object]:
            frames: list[Frame] = []
            for i, _, loc in plan:
                dst = self._slabs.view(loc)
                frames.append((dst[:HEADER_BYTES], parts[i][0].numpy(),
                               *into_slot(dst, parts[i][1:], HEADER_BYTES)))
            return functools.partial(seal_all, frames)

        return await self._put_with(keys, sized, copy)

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        """:meth:`get_parts` into ``parts[i]`` = header (64 bytes) ‖ payload buffers; each OK
        result carries the checksum of the payload bytes as they landed in the buffers."""
        sized = check_sealed(keys, parts)

        def copy(plan: list[Get]) -> Callable[[], list[int]]:
            frames: list[Frame] = []
            for i, loc in plan:
                src = self._slabs.view(loc)
                head = min(HEADER_BYTES, loc[2])
                frames.append((parts[i][0].numpy()[:head], src[:head],
                               *out_of_slot(src, loc[2], parts[i][1:], HEADER_BYTES)))
            return functools.partial(land_all, frames)

        return await self._get_with(keys, sized, copy)

    async def put_rows(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        """Store a row-described sub-batch (:class:`~hylinker.stores.base.RowStore`;
        ``stores/embedded_rows.py``)."""
        return await self._put_rows(batch, hashed)

    async def get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        """Read a row-described sub-batch (:class:`~hylinker.stores.base.RowStore`)."""
        return await self._get_rows(batch, hashed)

    async def _put_with(self, keys: Sequence[str], sized: Sequence[Any],
                        copy: Callable[[list[Put]], Callable[[], object]]) -> list[Outcome]:
        """Every put: plan slots for ``sized`` (anything with ``numel()``), run ``copy(plan)()``
        (inline if small, else in a worker thread), publish what was copied, free the rest."""
        with self._calls:
            outcomes, plan = self._slabs.plan_put(keys, sized)
            if not plan:
                return outcomes
            copied = False
            try:
                copied, _ = await self._run_copy(copy(plan), sum(loc[2] for _, _, loc in plan))
            finally:
                self._slabs.finish_put(plan, copied)
            if not copied:
                for i, _, _ in plan:
                    outcomes[i] = Outcome.FAILED
            return outcomes

    async def _get_with(self, keys: Sequence[str], sized: Sequence[Any],
                        copy: Callable[[list[Get]], Callable[[], list[int] | None]]) -> list[GetResult]:
        """Every get: pin the objects that fit, run ``copy(plan)()``, unpin. A copy that
        returns checksums (one per planned object) puts each on its result."""
        with self._calls:
            results, plan = self._slabs.plan_get(keys, sized)
            if not plan:
                return results
            copied, digests = False, None
            try:
                copied, digests = await self._run_copy(copy(plan), sum(loc[2] for _, loc in plan))
            finally:
                self._slabs.finish_get(plan, copied)
            for k, (i, loc) in enumerate(plan):
                results[i] = (GetResult(Outcome.OK, loc[2], None if digests is None else digests[k])
                              if copied else GetResult(Outcome.FAILED))
            return results

    async def touch(self, keys: Sequence[str]) -> None:
        check_keys(keys)
        with self._calls, self._slabs.lock:
            for key in keys:
                if key in self._slabs.index:
                    self._slabs.index.move_to_end(key)
                    self._slabs.stats["touches"] += 1
                else:
                    self._slabs.stats["evicted_touched_again"] += self.evictions_memory.asked_again(key, touched=True)

    async def remove(self, keys: Sequence[str]) -> int:
        return self._remove_where(keys, [None] * len(keys))

    async def remove_if(self, keys: Sequence[str], condemned: Sequence[Condemned]) -> int:
        """Remove each key only while it holds the object ``condemned[i]`` names: compared and
        removed under the index lock, so a rewrite is never removed
        (:class:`~hylinker.stores.condemned.ConditionalRemoveStore`)."""
        return self._remove_where(keys, list(condemned))

    def _remove_where(self, keys: Sequence[str], condemned: Sequence[Condemned | None]) -> int:
        check_keys(keys)
        with self._calls:
            removed = 0
            with self._slabs.lock:
                for key, c in zip(keys, condemned, strict=True):
                    loc = self._slabs.index.get(key)
                    if loc is None or (c is not None and not c.matches(loc[2], self._slabs.view(loc)[:HEADER_BYTES].tobytes())):
                        continue
                    self._slabs.drop(self._slabs.index.pop(key))
                    removed += 1
                self._slabs.stats["removes"] += removed
            return removed

    def statistics(self) -> StoreStatistics:
        with self._slabs.lock:
            counters = dict(self._slabs.stats)
            counters.update(
                objects=len(self._slabs.index), used_bytes=self._slabs.used, capacity_bytes=self._slabs.capacity
            )
        return StoreStatistics(**counters)

    async def close(self) -> None:
        if await self._calls.close():
            self._slabs.clear()
            if self._workers is not None:
                self._workers.close()

    # ---- introspection (tests, benchmarks) ---------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._slabs.capacity

    def allocated_bytes(self) -> int:
        """Bytes of slab chunk memory held now (>= used bytes; chunk granularity)."""
        return self._slabs.allocated_bytes()

    def lru_keys(self) -> list[str]:
        """Keys held, least recently used first."""
        with self._slabs.lock:
            return list(self._slabs.index)

    # ---- copies -------------------------------------------------------------------------------

    async def _run_copy(self, copy: Callable[[], T], nbytes: int) -> tuple[bool, T | None]:
        """Run ``copy()`` inline if ``nbytes`` is small, else in a worker thread: (True, its
        result), or (False, None) if it raised (logged). A cancelled caller still waits for the
        worker thread, so buffers and slots are never touched after this returns."""
        try:
            if nbytes <= self._thread_threshold:
                return True, copy()
            if self._workers is None:
                self._workers = WorkerThreads(self._max_workers, "embedded-store-copy")
            return True, await self._workers.run(copy)
        except Exception:
            _log.exception("embedded store copy failed", nbytes=nbytes)
            return False, None
