"""In place: the store reads and writes the host pool rows directly (scatter-gather).

One buffer per layer part of each object plus a 64-byte header buffer in the actor's arena
(``put_parts`` / ``get_parts``, or a checksumming store's ``put_sealed`` / ``get_checked``), so a
transfer makes one pass over the bytes instead of three. Over a store with row-described calls
(``put_rows`` / ``get_rows``, ``stores/rows.py``) a sub-batch is one description instead
(``runtime/dataplane/rows_route.py``). Two store calls are in flight
(``runtime/dataplane/pipeline.py``); sub-batch ``k`` has header slot ``k % slots`` of the arena.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import attrs
import numpy as np
import torch

from ...stores import framing
from ...stores.base import GetResult, Outcome
from .pipeline import pipelined
from .staging_arena import StagingArena
from .store_calls import StoreCalls, check_landed, condemner
from .transfer_codec import PoolCodec
from .transfer_jobs import LoadResult, OffloadResult, TransferJob

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


def in_place_batches(arena: StagingArena, n: int) -> list[tuple[int, int]]:
    """Sub-batches of an in-place transfer. The payload never passes through staging, so
    one store call takes as many objects as the store handles well, a half arena has
    headers for, and :data:`IN_PLACE_CALL_BYTES` allow (each extra call is one more thread
    hop and, over Mooncake, master round trips; a bounded call stays far inside a resilient
    store's call timeout). Over a store that does not checksum, the runtime hashes the rows
    before each put, so sub-batches ramp up to that size (:func:`_ramped`)."""
    per = max(1, min(arena.store.capabilities.max_batch,
                     arena.batch * arena.stride // framing.HEADER_BYTES,
                     IN_PLACE_CALL_BYTES // arena.stride))
    if arena.hashes_here:
        return _ramped(n, per)
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


async def _nothing(k: int) -> None:
    """A sub-batch with nothing to prepare before its store call."""


class InPlaceRoute:
    """Objects in parts over the pool rows: headers in the arena. See the module doc."""

    def __init__(self, arena: StagingArena, calls: StoreCalls) -> None:
        self.arena = arena
        self.calls = calls

    async def offload(self, job: TransferJob) -> OffloadResult:
        """Seal headers over the pool rows (checksum in place) for sub-batch k while k-1 is
        put straight from the rows: no staging copy."""
        a, t0 = self.arena, time.perf_counter()
        codec, size = a.codecs[job.group], a.frame_sizes[job.group]
        batches = in_place_batches(a, len(job.keys))
        results: list[list[Outcome]] = [[] for _ in batches]
        starts = job.index[:, 0].tolist()
        checksums = self.calls.checksums
        payload = size - framing.HEADER_BYTES

        def pack(k: int) -> list[list[torch.Tensor]]:
            lo, hi = batches[k]
            heads, heads_np = a.headers("offload", batches, k)
            parts: list[list[torch.Tensor]] = []
            for i, (key, r0) in enumerate(zip(job.keys[lo:hi], starts[lo:hi])):
                pieces = codec.pieces(r0)
                if checksums:  # the store sets the checksum as it copies the rows
                    framing.seal_header(heads_np[i], key, a.fingerprint, payload)
                else:
                    framing.seal_parts(heads_np[i], [p.numpy() for p in pieces], key, a.fingerprint, a.integrity)
                parts.append([heads[i], *pieces])
            return parts

        async def prepare(k: int) -> list[list[torch.Tensor]]:
            if not a.hashes_here or a.inline(batches[k], size):  # headers only, or small: on the loop
                return pack(k)
            return await a.threads.run(pack, k)  # hashing the rows: in a thread

        async def put(k: int, parts: list[list[torch.Tensor]]) -> None:
            lo, hi = batches[k]
            call = self.calls.store.put_sealed if checksums else self.calls.store.put_parts  # type: ignore[attr-defined]
            results[k] = await self.calls.call(call, job.keys[lo:hi], parts, Outcome.UNREACHABLE, Outcome.FAILED)

        await pipelined(len(batches), prepare, put, calls_in_flight=2)
        return self.calls.offloaded(job, [o for r in results for o in r], size, t0)

    async def load(self, job: TransferJob) -> LoadResult:
        """Get sub-batch k straight into the pool rows while sub-batch k-1 is verified there.

        A failed object may leave partial bytes in its rows; the load then reports it failed
        (and no layer of it landed), so the engine never uses those rows. An object that
        failed verification is read once more (:meth:`reread`) before that."""
        a, t0 = self.arena, time.perf_counter()
        codec, size = a.codecs[job.group], a.frame_sizes[job.group]
        faults: dict[str, int] = {}
        batches = in_place_batches(a, len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]
        again: list[int] = []  # objects to read once more (a fault a transfer can cause)
        starts = job.index[:, 0].tolist()

        def verify(k: int, results: list[GetResult], pieces: list[list[torch.Tensor]]) -> None:
            lo, hi = batches[k]
            _, heads_np = a.headers("load", batches, k)
            good[k] = self.verify_parts(job.keys[lo:hi], heads_np, pieces, results, faults, again.append, lo)

        async def get_verify(k: int, _: None) -> None:
            lo, hi = batches[k]
            heads, _h = a.headers("load", batches, k)
            pieces = [codec.pieces(r0) for r0 in starts[lo:hi]]
            results = await self.calls.get_parts(job.keys[lo:hi], [[h, *p] for h, p in zip(heads, pieces)])
            if not a.hashes_here or a.inline(batches[k], size):  # headers only, or small: on the loop
                verify(k, results, pieces)
            else:  # hashing the rows: in a thread
                await a.threads.run(verify, k, results, pieces)

        await pipelined(len(batches), _nothing, get_verify, calls_in_flight=2)
        ok = [g for batch in good for g in batch]
        return await self.calls.end_load(self.reread, job, codec, ok, again, faults, size, t0)

    def verify_parts(self, keys: list[str], heads_np: list[np.ndarray], pieces: list[list[torch.Tensor]],
                     results: list[GetResult], faults: dict[str, int],
                     reread: Callable[[int], None] | None, first: int,
                     condemned: tuple[TransferJob, list[int]] | None = None) -> list[bool]:
        """Verify objects read in place (header ``heads_np[i]``, rows ``pieces[i]``); the
        objects to read again go to ``reread(first + i)``. ``condemned`` (a re-read): the job
        and each object's index in it, where an object that fails now is noted proved bad."""
        a = self.arena
        ok: list[bool] = []
        for i, (key, h, p, r) in enumerate(zip(keys, heads_np, pieces, results)):
            verify = partial(framing.verify_parts, h, r.nbytes, [x.numpy() for x in p], key, a.fingerprint,
                             integrity=a.integrity)
            condemn = None if condemned is None else condemner(condemned[0], condemned[1][i], h)
            ok.append(check_landed(r, self.calls.checksums, verify, faults,
                                   None if reread is None else partial(reread, first + i), condemn)[0])
        return ok

    async def reread(self, job: TransferJob, again: list[int], faults: dict[str, int]) -> list[bool]:
        """Read the objects ``again`` once more into their rows and verify them there."""
        a = self.arena
        codec = a.codecs[job.group]
        starts = job.index[:, 0].tolist()
        batches = in_place_batches(a, len(again))
        verified: list[bool] = []
        for k, (lo, hi) in enumerate(batches):  # one at a time: the header slots are free now
            which = again[lo:hi]
            heads, heads_np = a.headers("load", batches, k)
            pieces = [codec.pieces(starts[i]) for i in which]
            keys = [job.keys[i] for i in which]
            results = await self.calls.get_parts(keys, [[h, *p] for h, p in zip(heads, pieces)])
            verified += self.verify_parts(keys, heads_np, pieces, results, faults, None, 0, (job, which))
        return verified


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
