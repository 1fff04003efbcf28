"""The embedded store's row-described calls (``put_rows`` / ``get_rows``, :mod:`hylinker.stores.rows`).

A sub-batch is planned in one step under the index lock: keys already stored answer EXISTS, the
LRU makes room for all of them at once, ``k`` slots are taken a chunk at a time (ascending, so
a batch usually lands in runs of neighbouring slots), and after the copy the ``k`` index entries
are published with one ``update``. The copy (rows to slots, checksum, then every header of the
batch written with one NumPy assignment per chunk) runs outside the lock, inline or in a worker
thread like every other copy of the store (:meth:`EmbeddedStore._run_copy`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .base import Outcome
from .eviction_memory import EvictionMemory
from .framing import HEADER_BYTES
from .rows import CODE, OK, RowBatch, RowResults, check_batch, gather, headers, scatter
from .slab_index import Loc
from .slabs import SizeClass

if TYPE_CHECKING:
    from .calls import InflightCalls
    from .slab_index import SlabIndex

T = TypeVar("T")
_EXISTS, _FULL, _FAILED, _TOO_SMALL, _MISSING = (CODE[o] for o in (
    Outcome.EXISTS, Outcome.FULL, Outcome.FAILED, Outcome.TOO_SMALL, Outcome.MISSING))


class RowTransfers:
    """``put_rows`` / ``get_rows`` of :class:`~hylinker.stores.embedded.EmbeddedStore` (which
    names them itself, so :func:`~hylinker.stores.base.supports_rows` sees where they are defined)."""

    # the store's state (set by EmbeddedStore.__init__)
    _slabs: SlabIndex
    _calls: InflightCalls
    evictions_memory: EvictionMemory

    if TYPE_CHECKING:  # EmbeddedStore's own method
        async def _run_copy(self, copy: Callable[[], T], nbytes: int) -> tuple[bool, T | None]: ...

    async def _put_rows(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        """Store each object of ``batch`` (see :class:`~hylinker.stores.base.RowStore`)."""
        check_batch(batch)
        with self._calls:
            codes = np.full(len(batch.keys), _FAILED, dtype=np.int8)
            todo, locs = self._plan_rows_put(batch, codes)
            if not todo:
                return codes
            sub = batch if len(todo) == len(batch.keys) else batch.select(todo)
            size_class = self._slabs.classes[locs[0][0]]
            slots = [loc[1] for loc in locs]

            def copy() -> None:
                sums = gather(sub, _slot_views(size_class, slots), hashed)
                _write_heads(size_class, slots, headers(sub, sums))

            copied = False
            try:
                copied, _ = await self._run_copy(copy, len(todo) * batch.object_bytes)
            finally:
                self._finish_rows_put(sub.keys, locs, copied)
            codes[todo] = OK if copied else _FAILED
            return codes

    async def _get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        """Read each object of ``batch`` into its rows, its header into ``batch.heads``."""
        check_batch(batch, get=True)
        assert batch.heads is not None
        with self._calls:
            n = len(batch.keys)
            res = RowResults.of(n, Outcome.MISSING)
            plan = self._plan_rows_get(batch, res.codes)
            if not plan:
                return res
            size = batch.object_bytes
            whole = [i for i, loc in plan if loc[2] == size]
            short = [(i, loc) for i, loc in plan if loc[2] != size]
            sub = batch if len(whole) == n else batch.select(whole)
            heads = batch.heads
            copied, sums = False, None
            try:
                def copy() -> list[int]:
                    got: list[int] = []
                    if whole:
                        locs = [loc for _, loc in plan if loc[2] == size]
                        size_class = self._slabs.classes[locs[0][0]]
                        slots = [loc[1] for loc in locs]
                        got = scatter(sub, _slot_views(size_class, slots), hashed)
                        heads[whole] = _read_heads(size_class, slots)
                    for i, (cls, slot, nbytes) in short:  # a shorter object: its header tells why
                        if nbytes >= HEADER_BYTES:
                            heads[i] = self._slabs.classes[cls].view(slot, HEADER_BYTES)
                    return got

                copied, sums = await self._run_copy(copy, len(whole) * batch.object_bytes)
            finally:
                self._slabs.finish_get(plan, copied)
            if not copied:
                res.codes[[i for i, _ in plan]] = _FAILED
                return res
            done = [i for i, _ in plan]
            res.codes[done] = OK
            res.nbytes[done] = [loc[2] for _, loc in plan]
            if whole and hashed and sums:
                res.checksums[whole] = sums
            return res

    # ---- planning (under the index lock) -----------------------------------------------------

    def _plan_rows_put(self, batch: RowBatch, codes: np.ndarray) -> tuple[list[int], list[Loc]]:
        """Reserve slots for the new keys of ``batch`` in one step; codes for the rest."""
        size = batch.object_bytes
        slot_bytes = self._slabs.slot_bytes_of(size)
        index, pending = self._slabs.index, self._slabs.pending
        with self._slabs.lock:
            keys = batch.keys
            if len(set(keys)) == len(keys):  # no key twice in the batch: one comprehension
                todo = [i for i, key in enumerate(keys) if key not in index and key not in pending]
            else:
                seen: set[str] = set()
                todo = []
                for i, key in enumerate(keys):
                    if key not in index and key not in pending and key not in seen:
                        todo.append(i)
                    seen.add(key)
            if len(todo) < len(keys):
                codes[:] = _EXISTS
                codes[todo] = _FAILED
            self._slabs.stats["put_exists"] += len(batch.keys) - len(todo)
            # room for all at once; where the LRU cannot make it, for as many as it can
            k = len(todo)
            if slot_bytes > self._slabs.capacity:
                k = 0
            elif not self._slabs.make_room(k * slot_bytes):
                # the most that fit: a failed try evicts nothing, a successful one evicts what a
                # direct try of that many would (the LRU prefix), so a bisection is exact
                lo, hi = 0, k  # lo fits, hi does not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if self._slabs.make_room(mid * slot_bytes):
                        lo = mid
                    else:
                        hi = mid
                k = lo
            if k < len(todo):
                codes[todo[k:]] = _FULL
                self._slabs.stats["put_failures"] += len(todo) - k
                todo = todo[:k]
            if not todo:
                return [], []
            cls = self._slabs.class_for(slot_bytes)
            slots = self._slabs.allocate_many(cls, len(todo))
            self._slabs.used += len(todo) * slot_bytes
            locs = [(cls, s, size) for s in slots]
            pending.update(zip([batch.keys[i] for i in todo], locs))
        return todo, locs

    def _finish_rows_put(self, keys: list[str] | Any, locs: list[Loc], copied: bool) -> None:
        """Publish the copied batch in one step (most recently used), or free its slots."""
        with self._slabs.lock:
            pending = self._slabs.pending
            for key in keys:
                del pending[key]
            if copied:
                self._slabs.index.update(zip(keys, locs))
                for key in keys:
                    self.evictions_memory.stored(key)
                self._slabs.stats["puts"] += len(locs)
                self._slabs.stats["put_bytes"] += len(locs) * locs[0][2]
                return
            for loc in locs:
                self._slabs.drop(loc)
            self._slabs.stats["put_failures"] += len(locs)

    def _plan_rows_get(self, batch: RowBatch, codes: np.ndarray) -> list[tuple[int, Loc]]:
        """Pin the stored objects of ``batch``; codes for the missing and the too large."""
        plan: list[tuple[int, Loc]] = []
        size = batch.object_bytes
        index, pins = self._slabs.index, self._slabs.pins
        with self._slabs.lock:
            misses = 0
            for i, key in enumerate(batch.keys):
                try:
                    loc = index[key]
                except KeyError:
                    misses += 1
                    self._slabs.stats["evicted_probed_again"] += self.evictions_memory.asked_again(key)
                    continue
                if loc[2] > size:
                    codes[i] = _TOO_SMALL
                    self._slabs.stats["get_failures"] += 1
                    continue
                index.move_to_end(key)
                pin = (loc[0], loc[1])
                if pin in pins:
                    pins[pin] += 1
                else:
                    pins[pin] = 1
                plan += ((i, loc),)
            self._slabs.stats["get_misses"] += misses
        return plan


def _slot_views(size_class: SizeClass, slots: list[int]) -> list[np.ndarray]:
    """Each slot's memory as a row of its chunk's grid (no call per slot)."""
    per = size_class.slots_per_chunk
    grids = size_class.grids
    return [grids[s // per][s % per] for s in slots]  # type: ignore[index]


def _by_chunk(size_class: SizeClass, slots: list[int]) -> list[tuple[np.ndarray, np.ndarray, slice]]:
    """(chunk grid, local slot numbers, positions in ``slots``) per run of ``slots`` in one
    chunk. Slots are taken a chunk at a time, ascending (:meth:`SizeClass.take`), so a batch is
    a few runs: a handful of NumPy calls per batch, slicing per run."""
    if not slots:
        return []
    chunks, local = np.divmod(np.asarray(slots, dtype=np.int64), size_class.slots_per_chunk)
    cuts = [0, *(np.flatnonzero(chunks[1:] != chunks[:-1]) + 1).tolist(), len(slots)]
    first = chunks[cuts[:-1]].tolist()
    out = []
    for c, lo, hi in zip(first, cuts[:-1], cuts[1:]):
        grid = size_class.grids[c]
        assert grid is not None, "slot in a released chunk"
        out.append((grid, local[lo:hi], slice(lo, hi)))
    return out


def _write_heads(size_class: SizeClass, slots: list[int], heads: np.ndarray) -> None:
    for grid, local, sel in _by_chunk(size_class, slots):
        grid[local, :HEADER_BYTES] = heads[sel]


def _read_heads(size_class: SizeClass, slots: list[int]) -> np.ndarray:
    out = np.empty((len(slots), HEADER_BYTES), dtype=np.uint8)
    for grid, local, sel in _by_chunk(size_class, slots):
        out[sel] = grid[local, :HEADER_BYTES]
    return out
