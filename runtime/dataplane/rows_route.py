"""Row-described in place: one description per sub-batch (``put_rows`` / ``get_rows``, ``stores/rows.py``).

A sub-batch is the rows as NumPy offsets, the header template and the key digests; the store
copies, checksums and writes the headers, and a load's headers are verified for the whole
sub-batch at once. Verify-all loads use the same gets into private rows laid out like the
pool's (``runtime/dataplane/held_load.py``). An object that failed verification in the pool's
rows is read once more in parts (``runtime/dataplane/in_place.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import attrs
import numpy as np

from ...stores import framing
from ...stores.base import GetResult, Outcome
from ...stores.rows import CODE, OK, OUTCOMES, RowBatch, RowResults, digests_of, expected_headers
from .in_place import InPlaceRoute, RowTarget, in_place_batches, pool_rows
from .pipeline import pipelined
from .staging_arena import StagingArena
from .store_calls import StoreCalls, check_landed, condemner
from .transfer_codec import PoolCodec
from .transfer_jobs import LoadResult, OffloadResult, TransferJob


class RowsRoute:
    """In place by row-described store calls. See the module doc."""

    def __init__(self, arena: StagingArena, calls: StoreCalls, parts: InPlaceRoute) -> None:
        self.arena = arena
        self.calls = calls
        self.parts = parts  # re-reads into the pool's rows go in parts

    def batch(self, job: TransferJob, codec: PoolCodec, lo: int, hi: int,
              heads: np.ndarray | None = None, target: RowTarget | None = None) -> RowBatch:
        """Sub-batch ``lo:hi`` of ``job`` as rows of ``target``'s segments (default: the pool's,
        ``codec.row_segments`` at the job's rows), NumPy only, no per-object views: what
        ``put_rows`` / ``get_rows`` take."""
        keys = job.keys[lo:hi]
        target = target or pool_rows(job, codec)
        template = self.arena.templates.get(id(codec))
        if template is None:
            template = self.arena.template(codec)
        return RowBatch(keys, digests_of(keys), target.segments, codec.row_bytes, codec.unit,
                        target.starts[lo:hi], template, heads)

    async def offload(self, job: TransferJob) -> OffloadResult:
        """Offload in place by row-described sub-batches, two store calls in flight."""
        a, t0 = self.arena, time.perf_counter()
        codec, size = a.codecs[job.group], a.frame_sizes[job.group]
        batches = in_place_batches(a, len(job.keys))
        results: list[list[Outcome]] = [[] for _ in batches]
        put_rows = self.calls.store.put_rows  # type: ignore[attr-defined]

        async def prepare(k: int) -> RowBatch:
            return self.batch(job, codec, *batches[k])

        async def put(k: int, batch: RowBatch) -> None:
            n = len(batch.keys)
            codes = await self.calls.rows(put_rows, batch, lambda: np.full(n, CODE[Outcome.UNREACHABLE]))
            results[k] = [OUTCOMES[c] for c in codes.tolist()] if len(codes) == n else [Outcome.FAILED] * n

        await pipelined(len(batches), prepare, put, calls_in_flight=2)
        return self.calls.offloaded(job, [o for r in results for o in r], size, t0)

    async def load(self, job: TransferJob) -> LoadResult:
        """Load in place by row-described sub-batches (:meth:`get_verified`); an object that
        failed verification is read once more into its rows."""
        t0 = time.perf_counter()
        codec, size = self.arena.codecs[job.group], self.arena.frame_sizes[job.group]
        good, again, faults = await self.get_verified(job, codec, size, pool_rows(job, codec))
        ok = [g for batch in good for g in batch]
        return await self.calls.end_load(self.reread, job, codec, ok, again, faults, size, t0)

    async def reread(self, job: TransferJob, again: list[int], faults: dict[str, int]) -> list[bool]:
        """Read the objects ``again`` once more into their pool rows, in parts."""
        return await self.parts.reread(job, again, faults)

    async def get_verified(self, job: TransferJob, codec: PoolCodec, size: int,
                           target: RowTarget) -> tuple[list[list[bool]], list[int], dict[str, int]]:
        """Get every object of ``job`` into ``target``'s rows by row-described sub-batches, two
        store calls in flight; headers verified for the whole sub-batch at once with NumPy
        (every field and the checksum against the store's), and only an object that fails that
        is looked at alone (its fault; it goes to the objects to read again). Returns (per
        sub-batch, which objects verified; the objects to read again; the faults)."""
        a = self.arena
        faults: dict[str, int] = {}
        batches = in_place_batches(a, len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]
        again: list[int] = []
        get_rows = self.calls.store.get_rows  # type: ignore[attr-defined]
        hashed = a.integrity is framing.Integrity.CHECKSUM

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
                ok[i] = self.landed(job, codec, target, batch, res, i, lo + i, faults, partial(again.append, lo + i))
            good[k] = ok

        async def prepare(k: int) -> RowBatch:
            lo, hi = batches[k]
            return self.batch(job, codec, lo, hi, a.row_heads(batches, k), target)

        async def get_verify(k: int, batch: RowBatch) -> None:
            n = len(batch.keys)
            res = await self.calls.rows(get_rows, batch, lambda: RowResults.of(n, Outcome.UNREACHABLE))
            if len(res.codes) != n:
                res = RowResults.of(n, Outcome.FAILED)
            verify(k, batch, res)

        await pipelined(len(batches), prepare, get_verify, calls_in_flight=2)
        return good, again, faults

    async def reread_into(self, job: TransferJob, target: RowTarget, again: list[int],
                          faults: dict[str, int]) -> list[bool]:
        """Get the objects ``again`` once more into ``target`` (private rows) in one call and
        verify each; what fails now is counted under its fault (the stored object is bad)."""
        codec = self.arena.codecs[job.group]
        batch = self.batch(job, codec, 0, len(job.keys), None, target).select(again)
        batch = attrs.evolve(batch, heads=np.empty((len(again), framing.HEADER_BYTES), dtype=np.uint8))
        res = await self.calls.rows(self.calls.store.get_rows,  # type: ignore[attr-defined]
                                    batch, lambda: RowResults.of(len(again), Outcome.UNREACHABLE))
        if len(res.codes) != len(again):
            res = RowResults.of(len(again), Outcome.FAILED)
        return [self.landed(job, codec, target, batch, res, j, i, faults, None) for j, i in enumerate(again)]

    def landed(self, job: TransferJob, codec: PoolCodec, target: RowTarget, batch: RowBatch,
               res: RowResults, j: int, i: int, faults: dict[str, int], reread: Callable[[], None] | None) -> bool:
        """Whether object ``i`` of ``job`` (entry ``j`` of a row get's ``batch`` and ``res``) is
        usable: its outcome and, when it arrived, its header and rows in ``target`` verified one
        by one; its fault is counted, and ``reread`` is called for a fault a second read may cure."""
        a = self.arena
        hashed = a.integrity is framing.Integrity.CHECKSUM
        assert batch.heads is not None
        r = GetResult(OUTCOMES[int(res.codes[j])], int(res.nbytes[j]), int(res.checksums[j]) if hashed else None)
        check = partial(framing.verify_parts, batch.heads[j], r.nbytes, target.pieces(i, codec), job.keys[i],
                        a.fingerprint, integrity=a.integrity)
        condemn = condemner(job, i, batch.heads[j]) if reread is None else None
        return check_landed(r, hashed, check, faults, reread, condemn)[0]
