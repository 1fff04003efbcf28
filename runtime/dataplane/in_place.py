"""In place: the store reads and writes the host pool rows directly (scatter-gather).

One buffer per layer part of each object plus a 64-byte header buffer in the actor's arena
(``put_parts`` / ``get_parts``, or a checksumming store's ``put_sealed`` / ``get_checked``), so a
transfer makes one pass over the bytes instead of three. Over a store with row-described calls
(``put_rows`` / ``get_rows``, ``stores/rows.py``) a sub-batch is one description instead: the
rows as NumPy offsets, the header template and the key digests; the store copies, checksums and
writes the headers, and a load's headers are verified for the whole sub-batch at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import anyio
import attrs
import numpy as np
import torch

from ...stores import framing
from ...stores.base import GetResult, Outcome, StoreError
from ...stores.rows import CODE, OK, OUTCOMES, RowBatch, RowResults, digests_of, expected_headers
from .pool_staging import PoolStaging, check_landed
from .tracing import trace
from .transfer_codec import PoolCodec
from .transfer_jobs import LoadResult, OffloadResult, TransferJob

R = TypeVar("R")

IN_PLACE_CALL_BYTES = 64 << 20
"""The most object bytes one in-place store call moves (~10 ms of copying here: a thread hop
per call costs well under 1% of it)."""


@attrs.frozen(eq=False)
class RowTarget:
    """Where a row-described get writes: per segment (payload order) a flat byte array of whole
    rows, and each object's first row in them."""

    segments: list[np.ndarray]
    starts: np.ndarray  # int64 [n]

    def pieces(self, i: int, codec: PoolCodec) -> list[np.ndarray]:
        """Object ``i``'s payload as views of the segments, in payload order."""
        s, u = int(self.starts[i]), codec.unit
        return [seg[s * rb:(s + u) * rb] for seg, rb in zip(self.segments, codec.row_bytes)]


def pool_rows(job: TransferJob, codec: PoolCodec) -> RowTarget:
    """The pool's own rows of ``job``'s objects (a host pool's ``codec.row_segments``)."""
    assert codec.row_segments is not None
    return RowTarget(codec.row_segments, job.index[:, 0].numpy().astype(np.int64))


def private_rows(memory: np.ndarray, n: int, codec: PoolCodec) -> RowTarget:
    """``n`` objects' rows in private ``memory`` (at least ``n * payload_bytes`` bytes), laid out
    like the pool's segments: segment ``j`` is ``n * unit`` rows, object ``i`` at row ``i * unit``."""
    segments, base = [], 0
    for rb in codec.row_bytes:
        length = n * codec.unit * rb
        segments.append(memory[base:base + length])
        base += length
    return RowTarget(segments, np.arange(n, dtype=np.int64) * codec.unit)


class SubBatchTurns:
    """Which sub-batches of one transfer are prepared (:meth:`InPlaceTransfers._two_in_flight`).

    One asyncio event per sub-batch (a handful of Python calls each; an anyio event costs ten
    times that, and these are made and waited on once per sub-batch)."""

    def __init__(self, n: int) -> None:
        self.prepared = [asyncio.Event() for _ in range(n)]  # headers sealed, ready to move

    def ready(self, k: int) -> None:
        """Sub-batch ``k`` is prepared: ``k + 1`` may start preparing."""
        self.prepared[k].set()


class InPlaceTransfers(PoolStaging):
    """A pool actor's in-place offload and load paths. See the module doc."""

    def _in_place_batches(self, n: int) -> list[tuple[int, int]]:
        """Sub-batches of an in-place transfer. The payload never passes through staging, so
        one store call takes as many objects as the store handles well, a half arena has
        headers for, and :data:`IN_PLACE_CALL_BYTES` allow (each extra call is one more thread
        hop and, over Mooncake, master round trips; a bounded call stays far inside a resilient
        store's call timeout). Over a store that does not checksum, the runtime hashes the rows
        before each put, so sub-batches ramp up to that size (:func:`_ramped`)."""
        per = max(1, min(self.store.capabilities.max_batch,
                         self.batch * self.stride // framing.HEADER_BYTES,
                         IN_PLACE_CALL_BYTES // self.stride))
        if self.hashes_here:
            return _ramped(n, per)
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]

    async def _two_in_flight(self, batches: list[tuple[int, int]],
                             call: Callable[[int, SubBatchTurns], Awaitable[None]]) -> None:
        """Run ``call(k, turns)`` for every sub-batch ``k``, at most two store calls at a time.

        ``call`` prepares sub-batch ``k`` (seals its headers, hashing the rows where the store
        does not), calls ``turns.ready(k)``, makes its store call, then finishes (verifies a
        load). Two lanes run the sub-batches, even ones in one and odd ones in the other, each
        one after the other; a sub-batch starts once the one before it is prepared. So two store
        calls are in flight at most (one per lane), preparing stays in sub-batch order, and the
        loop's and worker threads' work for one sub-batch (hashing, slot planning, verifying)
        runs while the store moves the bytes of the other lane's, not between two moves.
        Sub-batch ``k`` uses header slot ``k % slots`` (:meth:`_header_slots`, at least 2): the
        sub-batch that used it before, ``k - slots``, has ended, since it is ``k - 2`` or older
        in the same lane, or older than ``k - 1``, which the other lane started only after it.
        Two tasks per transfer, not one per sub-batch; a transfer of one sub-batch runs inline."""
        n = len(batches)
        turns = SubBatchTurns(n)

        async def lane(first: int) -> None:
            for k in range(first, n, 2):
                if k >= 1:
                    await turns.prepared[k - 1].wait()
                try:
                    await call(k, turns)
                finally:
                    turns.ready(k)  # also when it failed: the other lane never waits forever

        if n == 1:
            await lane(0)
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(lane, 1)
            await lane(0)

    def _header_slots(self, batches: list[tuple[int, int]]) -> int:
        """How many sub-batches' headers a direction's arena holds at once (2 to 4)."""
        per = max((hi - lo for lo, hi in batches), default=1)
        return max(2, min(4, 2 * self.batch * self.stride // (per * framing.HEADER_BYTES)))

    def _headers(self, direction: str, batches: list[tuple[int, int]], k: int) -> tuple[list[torch.Tensor], list[np.ndarray]]:
        """Sub-batch ``k``'s 64-byte header buffers: header slot ``k % slots`` of a direction's
        arena, each slot room for the largest sub-batch's headers."""
        hb = framing.HEADER_BYTES
        n, base = self._header_place(batches, k)
        arena, arena_np = self._arenas[direction], self._arenas_np[direction]
        return ([arena[base + i * hb: base + (i + 1) * hb] for i in range(n)],
                [arena_np[base + i * hb: base + (i + 1) * hb] for i in range(n)])

    async def _offload_in_place(self, job: TransferJob, codec: PoolCodec, size: int, t0: float) -> OffloadResult:
        """Seal headers over the pool rows (checksum in place) for sub-batch k while k-1 is
        put straight from the rows: no staging copy."""
        if self.rows:
            return await self._offload_rows(job, codec, size, t0)
        batches = self._in_place_batches(len(job.keys))
        results: list[list[Outcome]] = [[] for _ in batches]
        starts = job.index[:, 0].tolist()

        checksums = self.store_checksums
        payload = size - framing.HEADER_BYTES

        def pack(k: int) -> list[list[torch.Tensor]]:
            lo, hi = batches[k]
            heads, heads_np = self._headers("offload", batches, k)
            parts: list[list[torch.Tensor]] = []
            for i, (key, r0) in enumerate(zip(job.keys[lo:hi], starts[lo:hi])):
                pieces = codec.pieces(r0)
                if checksums:  # the store sets the checksum as it copies the rows
                    framing.seal_header(heads_np[i], key, self.fingerprint, payload)
                else:
                    framing.seal_parts(heads_np[i], [p.numpy() for p in pieces], key, self.fingerprint,
                                       self.integrity)
                parts.append([heads[i], *pieces])
            return parts

        async def put(k: int, parts: list[list[torch.Tensor]]) -> None:
            lo, hi = batches[k]
            call = self.store.put_sealed if checksums else self.store.put_parts  # type: ignore[attr-defined]
            results[k] = await self._store_call(call, job.keys[lo:hi], parts, Outcome.UNREACHABLE, Outcome.FAILED)

        async def pack_put(k: int, turns: SubBatchTurns) -> None:
            if not self.hashes_here or self._inline(batches[k], size):  # headers only, or small: on the loop
                parts = pack(k)
            else:  # hashing the rows: in a thread
                parts = await self.threads.run(pack, k)
            turns.ready(k)
            await put(k, parts)

        await self._two_in_flight(batches, pack_put)
        return self._offloaded(job, [o for r in results for o in r], size, t0)

    async def _load_in_place(self, job: TransferJob, codec: PoolCodec, size: int, t0: float) -> LoadResult:
        """Get sub-batch k straight into the pool rows while sub-batch k-1 is verified there.

        A failed object may leave partial bytes in its rows; the load then reports it failed
        (and no layer of it landed), so the engine never uses those rows. An object that
        failed verification is read once more (:meth:`_reread_in_place`) before that."""
        if self.rows:
            return await self._load_rows(job, codec, size, t0)
        faults: dict[str, int] = {}
        batches = self._in_place_batches(len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]
        again: list[int] = []  # objects to read once more (a fault a transfer can cause)
        starts = job.index[:, 0].tolist()
        pieces_of: dict[int, list[list[torch.Tensor]]] = {}

        async def get(k: int) -> list[GetResult]:
            lo, hi = batches[k]
            heads, _ = self._headers("load", batches, k)
            pieces = [codec.pieces(r0) for r0 in starts[lo:hi]]
            pieces_of[k] = pieces
            return await self._get_parts(job.keys[lo:hi], [[h, *p] for h, p in zip(heads, pieces)])

        def verify(k: int, results: list[GetResult]) -> None:
            lo, hi = batches[k]
            _, heads_np = self._headers("load", batches, k)
            good[k] = self._verify_parts(job.keys[lo:hi], heads_np, pieces_of.pop(k), results, faults,
                                         again.append, lo)

        async def get_verify(k: int, turns: SubBatchTurns) -> None:
            turns.ready(k)
            results = await get(k)
            if not self.hashes_here or self._inline(batches[k], size):  # headers only, or small: on the loop
                verify(k, results)
            else:  # hashing the rows: in a thread
                await self.threads.run(verify, k, results)

        await self._two_in_flight(batches, get_verify)
        return await self._in_place_loaded(job, codec, good, again, faults, size, t0)

    # ---- row-described store calls (stores/rows.py): one description per sub-batch ------------

    def _row_batch(self, job: TransferJob, codec: PoolCodec, lo: int, hi: int,
                   heads: np.ndarray | None = None, target: RowTarget | None = None) -> RowBatch:
        """Sub-batch ``lo:hi`` of ``job`` as rows of ``target``'s segments (default: the pool's,
        ``codec.row_segments`` at the job's rows), NumPy only, no per-object views: what
        ``put_rows`` / ``get_rows`` take."""
        keys = job.keys[lo:hi]
        template = self._templates.get(id(codec))
        if template is None:
            template = self._templates[id(codec)] = framing.header_template(
                self.fingerprint, codec.payload_bytes, self.integrity)
        target = target or pool_rows(job, codec)
        return RowBatch(keys, digests_of(keys), target.segments, codec.row_bytes, codec.unit,
                        target.starts[lo:hi], template, heads)

    def _row_heads(self, batches: list[tuple[int, int]], k: int) -> np.ndarray:
        """Sub-batch ``k``'s headers in the load arena, as one ``[n, 64]`` array."""
        hb = framing.HEADER_BYTES
        n, base = self._header_place(batches, k)
        return self._arenas_np["load"][base: base + n * hb].reshape(n, hb)

    def _header_place(self, batches: list[tuple[int, int]], k: int) -> tuple[int, int]:
        """Sub-batch ``k``'s objects and the byte offset of its headers in a direction's arena
        (header slot ``k % slots``, each slot room for the largest sub-batch's headers)."""
        per = max(hi - lo for lo, hi in batches)
        return batches[k][1] - batches[k][0], (k % self._header_slots(batches)) * per * framing.HEADER_BYTES

    async def _rows_call(self, call: Callable[[RowBatch, bool], Awaitable[R]], batch: RowBatch,
                         unreachable: Callable[[], R]) -> R:
        """One row-described store call; a store that raises reads as ``unreachable()``."""
        start = time.perf_counter()
        try:
            got = await call(batch, self.integrity is framing.Integrity.CHECKSUM)
        except StoreError:
            got = unreachable()
        seconds = time.perf_counter() - start
        self.latency.observe(seconds)
        trace("store", pool=self.kind.value, call=getattr(call, "__name__", "call"), objects=len(batch.keys),
              us=round(seconds * 1e6))
        return got

    async def _offload_rows(self, job: TransferJob, codec: PoolCodec, size: int, t0: float) -> OffloadResult:
        """Offload in place by row-described sub-batches, two store calls in flight."""
        batches = self._in_place_batches(len(job.keys))
        results: list[list[Outcome]] = [[] for _ in batches]
        put_rows = self.store.put_rows  # type: ignore[attr-defined]

        async def put(k: int, turns: SubBatchTurns) -> None:
            lo, hi = batches[k]
            batch = self._row_batch(job, codec, lo, hi)
            turns.ready(k)
            codes = await self._rows_call(put_rows, batch, lambda: np.full(hi - lo, CODE[Outcome.UNREACHABLE]))
            results[k] = ([OUTCOMES[c] for c in codes.tolist()] if len(codes) == hi - lo
                          else [Outcome.FAILED] * (hi - lo))

        await self._two_in_flight(batches, put)
        return self._offloaded(job, [o for r in results for o in r], size, t0)

    async def _load_rows(self, job: TransferJob, codec: PoolCodec, size: int, t0: float) -> LoadResult:
        """Load in place by row-described sub-batches (:meth:`_get_rows_verified`); an object
        that failed verification is read once more into its rows."""
        good, again, faults = await self._get_rows_verified(job, codec, size, pool_rows(job, codec))
        return await self._in_place_loaded(job, codec, good, again, faults, size, t0)

    async def _get_rows_verified(self, job: TransferJob, codec: PoolCodec, size: int,
                                 target: RowTarget) -> tuple[list[list[bool]], list[int], dict[str, int]]:
        """Get every object of ``job`` into ``target``'s rows by row-described sub-batches, two
        store calls in flight; headers verified for the whole sub-batch at once with NumPy
        (every field and the checksum against the store's), and only an object that fails that
        is looked at alone (its fault; it goes to the objects to read again). Returns (per
        sub-batch, which objects verified; the objects to read again; the faults)."""
        faults: dict[str, int] = {}
        batches = self._in_place_batches(len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]
        again: list[int] = []
        get_rows = self.store.get_rows  # type: ignore[attr-defined]
        hashed = self.integrity is framing.Integrity.CHECKSUM

        def verify(k: int, batch: RowBatch, res: RowResults) -> None:
            lo = batches[k][0]
            heads = batch.heads
            assert heads is not None
            fine = (res.codes == OK) & (res.nbytes == size)
            fine &= (heads[:, :framing.CHECKSUM_OFFSET] == expected_headers(batch)).all(axis=1)
            stored = heads[:, framing.CHECKSUM_OFFSET:framing.CHECKSUM_OFFSET + 8].copy().view("<u8")[:, 0]
            fine &= stored == (res.checksums if hashed else 0)
            ok = fine.tolist()
            for i in np.flatnonzero(~fine).tolist():  # the exceptions, one at a time
                ok[i] = self._row_landed(job, codec, target, batch, res, i, lo + i, faults,
                                         partial(again.append, lo + i))
            good[k] = ok

        async def get_verify(k: int, turns: SubBatchTurns) -> None:
            lo, hi = batches[k]
            batch = self._row_batch(job, codec, lo, hi, self._row_heads(batches, k), target)
            turns.ready(k)
            res = await self._rows_call(get_rows, batch, lambda: RowResults.of(hi - lo, Outcome.UNREACHABLE))
            if len(res.codes) != hi - lo:
                res = RowResults.of(hi - lo, Outcome.FAILED)
            verify(k, batch, res)

        await self._two_in_flight(batches, get_verify)
        return good, again, faults

    def _row_landed(self, job: TransferJob, codec: PoolCodec, target: RowTarget, batch: RowBatch,
                    res: RowResults, j: int, i: int, faults: dict[str, int],
                    reread: Callable[[], None] | None) -> bool:
        """Whether object ``i`` of ``job`` (entry ``j`` of a row get's ``batch`` and ``res``) is
        usable: its outcome and, when it arrived, its header and rows in ``target`` verified one
        by one; its fault is counted, and ``reread`` is called for a fault a second read may cure."""
        hashed = self.integrity is framing.Integrity.CHECKSUM
        assert batch.heads is not None
        r = GetResult(OUTCOMES[int(res.codes[j])], int(res.nbytes[j]), int(res.checksums[j]) if hashed else None)
        check = partial(framing.verify_parts, batch.heads[j], r.nbytes, target.pieces(i, codec), job.keys[i],
                        self.fingerprint, integrity=self.integrity)
        condemn = self._condemner(job, i, batch.heads[j]) if reread is None else None
        return check_landed(r, hashed, check, faults, reread, condemn)[0]

    async def _in_place_loaded(self, job: TransferJob, codec: PoolCodec, good: list[list[bool]], again: list[int],
                               faults: dict[str, int], size: int, t0: float) -> LoadResult:
        """End an in-place load: read the objects ``again`` once more, report every layer if
        every object landed, count the outcome."""
        ok = [g for batch in good for g in batch]
        if again:
            await self._reread_in_place(job, codec, sorted(again), ok, faults)
        if job.on_layer is not None and all(ok):
            for layer in codec.layer_ids:
                job.on_layer(layer)
        return self._loaded(job, ok, faults, size, t0)

    async def _get_parts(self, keys: list[str], parts: list[list[torch.Tensor]]) -> list[GetResult]:
        call = self.store.get_checked if self.store_checksums else self.store.get_parts  # type: ignore[attr-defined]
        return await self._store_call(call, keys, parts, GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))

    def _verify_parts(self, keys: list[str], heads_np: list[np.ndarray], pieces: list[list[torch.Tensor]],
                      results: list[GetResult], faults: dict[str, int],
                      reread: Callable[[int], None] | None, first: int,
                      condemned: tuple[TransferJob, list[int]] | None = None) -> list[bool]:
        """Verify objects read in place (header ``heads_np[i]``, rows ``pieces[i]``); the
        objects to read again go to ``reread(first + i)``. ``condemned`` (a re-read): the job
        and each object's index in it, where an object that fails now is noted proved bad."""
        ok: list[bool] = []
        for i, (key, h, p, r) in enumerate(zip(keys, heads_np, pieces, results)):
            verify = partial(framing.verify_parts, h, r.nbytes, [x.numpy() for x in p], key, self.fingerprint,
                             integrity=self.integrity)
            condemn = None if condemned is None else self._condemner(condemned[0], condemned[1][i], h)
            ok.append(check_landed(r, self.store_checksums, verify, faults,
                                   None if reread is None else partial(reread, first + i), condemn)[0])
        return ok

    async def _reread_in_place(self, job: TransferJob, codec: PoolCodec, again: list[int], ok: list[bool],
                               faults: dict[str, int]) -> None:
        """Read the objects ``again`` once more into their rows and verify them there; what
        fails now is counted under its fault (the stored object is bad)."""
        starts = job.index[:, 0].tolist()
        batches = self._in_place_batches(len(again))
        verified: list[bool] = []
        for k, (lo, hi) in enumerate(batches):  # one at a time: the header slots are free now
            which = again[lo:hi]
            heads, heads_np = self._headers("load", batches, k)
            pieces = [codec.pieces(starts[i]) for i in which]
            keys = [job.keys[i] for i in which]
            results = await self._get_parts(keys, [[h, *p] for h, p in zip(heads, pieces)])
            verified += self._verify_parts(keys, heads_np, pieces, results, faults, None, 0, (job, which))
        self._reread_outcome(ok, again, verified)


def _ramped(n: int, per: int) -> list[tuple[int, int]]:
    """Sub-batches of at most ``per`` objects that start small and double (``per/8``, ``per/4``,
    …): the first store call waits only for a small first sub-batch to be hashed, and the
    hashing of the larger ones overlaps the calls before them."""
    out: list[tuple[int, int]] = []
    size = max(1, -(-per // 8))
    lo = 0
    while lo < n:
        hi = min(n, lo + size)
        out.append((lo, hi))
        lo = hi
        size = min(per, 2 * size)
    return out
