"""The Mooncake store's row-described calls (``put_rows`` / ``get_rows``, :mod:`hylinker.stores.rows`).

Mooncake copies itself: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` take,
per object, a list of raw pointers and sizes. A :class:`~hylinker.stores.rows.RowBatch` gives them
without a tensor or view per object: per segment ``j`` the base address (``seg.ctypes.data``)
plus ``starts * row_bytes[j]``, ``unit * row_bytes[j]`` bytes long, and one 64-byte header slot
per object in a registered header arena. The ``[n, 1 + S]`` pointer array is built with NumPy and
turned into lists once per client call (``.tolist()``); the size list is the same for every
object. One client call per chunk of objects, cut as the other batch calls are: at most
``max_batch`` keys and ``MooncakeConfig.transfer_queue // workers`` buffers.

Registration. Mooncake wants every pointer inside a registered region. The span of rows a batch
touches is checked once per segment per call (one bisect each, not one per object). The header
arena is the store's own (``[n, 64]`` uint8 rows of a registered tensor, viewed as NumPy): taken
by one call at a time, so calls in flight together use different arenas; registered on first use,
replaced by a larger one when a call needs more rows, unregistered when the store closes. When a
segment's rows are not all inside registered memory the batch takes the slower, always correct
path: one list of buffers per object through ``put_parts`` / ``get_parts`` (which bounce what is
not registered).

Put. Repeated keys in one batch: the first is the writer, the others EXISTS (as ``put_parts``).
Keys already stored answer EXISTS (one ``batch_is_exist``, ``MooncakeConfig.detect_exists``), the
rest are hashed when ``hashed`` (XXH3-64, streamed over each object's row ranges in segment order,
in the worker thread) and their headers written into the arena: the template with each key
digest and checksum (:func:`~hylinker.stores.rows.headers`), so the stored frame is byte for
byte the one :func:`~hylinker.stores.framing.seal_array` makes.

Get. Each object's header lands in the arena and its payload straight into its rows; the OK
objects' headers are then copied into ``batch.heads`` with one NumPy assignment per chunk
(``batch.heads`` is the caller's memory, not registered). A read whose lease ran out mid-transfer
(LEASE_EXPIRED) is made once more. ``hashed``: each whole object's checksum is the XXH3-64 of its
rows as they landed, computed after the read (Mooncake does not hash while it copies).

Where Mooncake differs from the embedded store (the reference, :mod:`hylinker.stores.embedded_rows`):

* An object *larger* than the rows answers INVALID_PARAMS: TOO_SMALL and nothing written, as the
  contract says. An object *shorter* than the rows makes the multi-buffer read fail as a whole
  (TRANSFER_FAIL, nothing written); such objects are then asked their size (``get_size``, one
  master round trip each: a rare path, torn or foreign objects only) and a shorter one is read
  whole into the bounce buffer and its header copied into ``batch.heads``: OK with its size, its
  rows untouched, as the contract says. A TRANSFER_FAIL for an object of the right size stays
  FAILED.
* The checksum of a get is computed in a pass over the landed rows after the client call, not
  while copying (the bytes are read from memory twice; the value is the same).
* A put's bytes are checksummed before the client reads them, from the rows themselves; a row
  changed by someone else during the call would be stored with a stale checksum (the runtime
  never does that: rows being offloaded are not written).
* The fallback path (unregistered rows) writes a shorter object's bytes into the front of its
  rows (``get_parts`` splits what it read), where the registered path writes none.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .base import GetResult, Outcome
from .framing import HEADER_BYTES
from .host_bytes import zeroed
from .mooncake_batches import MooncakeBatches
from .mooncake_client import LEASE_EXPIRED, get_outcome, put_outcome
from .rows import CODE, OK, RowBatch, RowResults, headers, object_buffers, payload_sums

log = logging.getLogger(__name__)

TRANSFER_FAIL = -800
"""Mooncake's TRANSFER_FAIL: a multi-buffer read whose buffers are larger than the object
(and any transfer that failed)."""
HEADER_ARENA_MIN_BYTES = 64 << 10
"""The smallest header arena (1024 headers); a larger one is a power of two."""

_EXISTS, _FAILED, _MISSING, _UNREACHABLE, _TOO_SMALL = (CODE[o] for o in (
    Outcome.EXISTS, Outcome.FAILED, Outcome.MISSING, Outcome.UNREACHABLE, Outcome.TOO_SMALL))


class HeaderArenas:
    """Registered header rows for the row calls: each call takes an arena of at least ``n``
    64-byte rows and gives it back; an arena is used by one call at a time."""

    def __init__(self, batches: MooncakeBatches) -> None:
        self._batches = batches
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []  # bounded: arenas made, at most the calls ever in flight at once
        self.registered = 0  # arenas registered so far (for tests and diagnostics)

    def take(self, n: int) -> torch.Tensor:
        """An arena with room for ``n`` headers (registered; a free one when one is large enough)."""
        need = n * HEADER_BYTES
        with self._lock:
            if self._free and self._free[-1].numel() >= need:
                return self._free.pop()
            small = self._free.pop() if self._free else None
        if small is not None:  # too small for this call: replaced by a larger one
            self._forget(small)
        size = max(HEADER_ARENA_MIN_BYTES, 1 << math.ceil(math.log2(need)))
        arena = zeroed(size)  # taken on a store thread: no OpenMP team there (host_bytes)
        rc = self._batches.client.register_buffer(arena.data_ptr(), size)
        if rc != 0:
            raise RuntimeError(f"Mooncake refused to register a {size}-byte header arena (code {rc})")
        self.registered += 1
        return arena

    def give(self, arena: torch.Tensor) -> None:
        with self._lock:
            self._free.append(arena)
            self._free.sort(key=torch.Tensor.numel)  # the largest last: taken first

    def release(self) -> None:
        """Unregister every arena (the store is closing: no call is in flight)."""
        with self._lock:
            free, self._free = self._free, []
        for arena in free:
            self._forget(arena)

    def _forget(self, arena: torch.Tensor) -> None:
        rc = self._batches.client.unregister_buffer(arena.data_ptr())
        if rc != 0:
            log.warning("mooncake unregister_buffer(header arena %#x) returned %s", arena.data_ptr(), rc)


class MooncakeRows:
    """``put_rows`` / ``get_rows`` on the worker-thread side (see the module doc); the store
    runs :meth:`put` and :meth:`get` in its worker threads, counted for its close."""

    def __init__(self, batches: MooncakeBatches) -> None:
        self.batches = batches
        self.arenas = HeaderArenas(batches)

    # ---- put -----------------------------------------------------------------------------

    def put(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        """One int8 :data:`~hylinker.stores.rows.OUTCOMES` code per object of ``batch``."""
        keys = list(batch.keys)
        if len(set(keys)) < len(keys):  # a key twice: the first occurrence is the writer
            return _first_writes(keys, lambda idx: self.put(batch.select(idx), hashed))
        b = self.batches
        b.gate()
        if not self.inside(batch):
            return self._put_parts(batch, hashed)
        codes = np.full(len(keys), _FAILED, dtype=np.int8)
        outcomes, todo = b._absent(keys)
        if todo is None:
            codes[:] = _UNREACHABLE
            return codes
        if len(todo) < len(keys):
            codes[[i for i, o in enumerate(outcomes) if o is Outcome.EXISTS]] = _EXISTS
            if not todo:
                return codes
        sub = batch if len(todo) == len(keys) else batch.select(todo)
        where = np.asarray(todo, dtype=np.int64)
        heads = headers(sub, payload_sums(sub) if hashed else [0] * len(todo))
        ptrs = pointers(sub)
        sizes = [HEADER_BYTES, *(batch.unit * rb for rb in batch.row_bytes)]
        for chunk in b.chunks(len(todo), len(sizes)):
            lo, hi = chunk.start, chunk.stop
            arena = self.arenas.take(hi - lo)
            try:
                arena.numpy()[:(hi - lo) * HEADER_BYTES] = heads[lo:hi].reshape(-1)
                got = b.client.batch_put_from_multi_buffers(
                    keys_of(sub, lo, hi), _with_heads(ptrs[lo:hi], arena), [sizes] * (hi - lo))
            finally:
                self.arenas.give(arena)
            b.note(got)
            codes[where[lo:hi]] = mapped(got, put_outcome)
        return codes

    def _put_parts(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        """The rows are not all registered: one buffer list per object through ``put_parts``."""
        heads = headers(batch, payload_sums(batch) if hashed else [0] * len(batch.keys))
        got = self.batches.put_parts(list(batch.keys), object_buffers(batch, heads))
        return np.asarray([CODE[o] for o in got], dtype=np.int8)

    # ---- get -----------------------------------------------------------------------------

    def get(self, batch: RowBatch, hashed: bool) -> RowResults:
        """Each object's outcome, bytes and (``hashed``) payload checksum; its header lands in
        ``batch.heads[i]``, its payload in its rows."""
        b = self.batches
        b.gate()
        if not self.inside(batch):
            return self._get_parts(batch, hashed)
        heads = batch.heads
        assert heads is not None
        n = len(batch.keys)
        res = RowResults.of(n, Outcome.FAILED)
        ptrs = pointers(batch)
        sizes = [HEADER_BYTES, *(batch.unit * rb for rb in batch.row_bytes)]
        short: list[int] = []
        for chunk in b.chunks(n, len(sizes)):
            lo, hi = chunk.start, chunk.stop
            arena = self.arenas.take(hi - lo)
            try:
                keys = keys_of(batch, lo, hi)
                plist = _with_heads(ptrs[lo:hi], arena)
                raw = np.asarray(b.client.batch_get_into_multi_buffers(keys, plist, [sizes] * (hi - lo)),
                                 dtype=np.int64)
                again = np.flatnonzero(raw == LEASE_EXPIRED).tolist()
                if again:  # the lease ran out mid-transfer; a second read takes a fresh one
                    raw[again] = b.client.batch_get_into_multi_buffers(
                        [keys[j] for j in again], [plist[j] for j in again], [sizes] * len(again))
                b.note(raw.tolist())
                ok = raw >= 0
                landed = arena.numpy()[:(hi - lo) * HEADER_BYTES].reshape(hi - lo, HEADER_BYTES)
                if ok.all():
                    heads[lo:hi] = landed
                elif ok.any():
                    heads[lo + np.flatnonzero(ok)] = landed[ok]
            finally:
                self.arenas.give(arena)
            res.codes[lo:hi] = mapped(raw, get_outcome)
            res.nbytes[lo:hi] = np.where(ok, raw, 0)
            short += (lo + np.flatnonzero(raw == TRANSFER_FAIL)).tolist()
        if short:
            self._short_objects(batch, short, res)
        if hashed:
            _landed_sums(batch, res)
        return res

    def _short_objects(self, batch: RowBatch, idx: list[int], res: RowResults) -> None:
        """Objects whose read failed as a whole: the shorter ones read whole into the bounce
        buffer (their rows untouched), their headers copied into ``batch.heads``; the larger
        ones (stored since) TOO_SMALL; the others stay FAILED."""
        b = self.batches
        heads = batch.heads
        assert heads is not None
        for i in idx:
            size = int(b.client.get_size(batch.keys[i]))
            if size > batch.object_bytes:
                res.codes[i] = _TOO_SMALL
                continue
            if size <= 0 or size == batch.object_bytes:
                continue  # missing since, or a transfer that really failed: FAILED
            with b.bounce_lock:
                bounce = b.ensure_bounce(size)
                got = int(b.client.batch_get_into([batch.keys[i]], [bounce.data_ptr()], [size])[0])
                if got == size and size >= HEADER_BYTES:
                    heads[i] = bounce.numpy()[:HEADER_BYTES]
            if got == size:
                res.codes[i], res.nbytes[i] = OK, size

    def _get_parts(self, batch: RowBatch, hashed: bool) -> RowResults:
        """The rows are not all registered: one buffer list per object through ``get_parts``
        (its header buffer a view of ``batch.heads[i]``)."""
        heads = batch.heads
        assert heads is not None
        got = self.batches.get_parts(list(batch.keys), object_buffers(batch, heads))
        res = results_of(got)
        if hashed:
            _landed_sums(batch, res)
        return res

    # ---- shared ------------------------------------------------------------------------------

    def inside(self, batch: RowBatch) -> bool:
        """Whether the rows ``batch`` touches lie inside registered regions: one check per
        segment, of the span from its first object's row to its last object's end."""
        if not len(batch.keys):
            return True
        lo = int(batch.starts.min())
        hi = int(batch.starts.max()) + batch.unit
        registered = self.batches.registered
        return all(registered(seg.ctypes.data + lo * rb, (hi - lo) * rb)
                   for seg, rb in zip(batch.segments, batch.row_bytes))


def pointers(batch: RowBatch) -> np.ndarray:
    """``[n, 1 + S]`` int64: column 0 left for the header pointers, then per segment ``j`` the
    address of each object's first row (``seg.ctypes.data + starts * row_bytes[j]``)."""
    bases = np.asarray([seg.ctypes.data for seg in batch.segments], dtype=np.int64)
    rb = np.asarray(batch.row_bytes, dtype=np.int64)
    out = np.empty((len(batch.keys), 1 + len(bases)), dtype=np.int64)
    out[:, 1:] = bases[None, :] + batch.starts[:, None] * rb[None, :]
    return out


def _with_heads(ptrs: np.ndarray, arena: torch.Tensor) -> list[list[int]]:
    """``ptrs`` (a chunk of :func:`pointers`) with header ``i`` at row ``i`` of ``arena``, as
    the client's list of pointer lists."""
    ptrs[:, 0] = arena.data_ptr() + HEADER_BYTES * np.arange(ptrs.shape[0], dtype=np.int64)
    out: list[list[int]] = ptrs.tolist()
    return out


def keys_of(batch: RowBatch, lo: int, hi: int) -> list[str]:
    keys = batch.keys
    return list(keys[lo:hi]) if lo or hi < len(keys) else list(keys)


def mapped(raw: Sequence[int] | np.ndarray, mapping: Callable[[int], Outcome]) -> np.ndarray:
    """Client return codes as int8 outcome codes: ``mapping`` called once per distinct code."""
    arr = np.asarray(raw, dtype=np.int64)
    out = np.empty(arr.shape, dtype=np.int8)
    for code in np.unique(arr).tolist():
        out[arr == code] = CODE[mapping(code)]
    return out


def _landed_sums(batch: RowBatch, res: RowResults) -> None:
    """The checksums of the whole objects that landed (OK, full size), from their rows."""
    whole = np.flatnonzero((res.codes == OK) & (res.nbytes == batch.object_bytes)).tolist()
    if whole:
        res.checksums[whole] = payload_sums(batch, whole)


def results_of(got: Sequence[GetResult]) -> RowResults:
    res = RowResults.of(len(got), Outcome.FAILED)
    res.codes[:] = [CODE[r.outcome] for r in got]
    res.nbytes[:] = [r.nbytes for r in got]
    return res


def _first_writes(keys: list[str], put: Callable[[list[int]], np.ndarray]) -> np.ndarray:
    """A put whose batch names a key twice: ``put`` the first occurrences; a repeat reads
    EXISTS when its first was stored or present, else the first's outcome."""
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    unique = sorted(first.values())
    got = put(unique)
    by_index = dict(zip(unique, got.tolist()))
    out = [by_index.get(i, by_index[first[k]]) for i, k in enumerate(keys)]
    codes = np.asarray(out, dtype=np.int8)
    repeat = np.asarray([i not in by_index for i in range(len(keys))])
    codes[repeat & np.isin(codes, [OK, _EXISTS])] = _EXISTS
    return codes


def count_rows(counters: dict[str, int], codes: np.ndarray, nbytes: np.ndarray | int, put: bool) -> None:
    """Add one row call's outcomes to the store's counters (``nbytes``: a put's object size, a
    get's bytes per object)."""
    ok = codes == OK
    k = int(ok.sum())
    if put:
        exists = int((codes == _EXISTS).sum())
        counters["puts"] += k
        counters["put_bytes"] += k * int(nbytes)
        counters["put_exists"] += exists
        counters["put_failures"] += len(codes) - k - exists
        return
    misses = int((codes == _MISSING).sum())
    counters["gets"] += k
    counters["get_bytes"] += int(np.asarray(nbytes)[ok].sum())
    counters["get_misses"] += misses
    counters["get_failures"] += len(codes) - k - misses

