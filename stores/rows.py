"""A sub-batch described by rows, not by buffers: what a store's ``put_rows`` / ``get_rows`` take.

A :class:`RowBatch` names ``n`` objects of one shape by their rows in the pool: object ``i``'s
payload is, for every segment ``j`` (one layer part of the pool, in payload order), the
``unit`` rows of ``segments[j]`` from row ``starts[i]``, laid end to end. With the 64-byte
header in front (``template`` with ``digests[i]`` and the payload's checksum filled in, see
:func:`~hylinker.stores.framing.header_template`) that is exactly the frame
:func:`~hylinker.stores.framing.seal_array` makes. The runtime computes the description with
NumPy once per sub-batch (no tensor, view or list of buffers per object); the store copies each
object between the rows and its slot with one routine (:func:`gather` / :func:`scatter`), which
also checksums it, and writes the headers of the whole batch at once.

Outcomes come back as arrays: one :data:`OUTCOMES` code per object (``codes``), and for a get
the object's bytes and the checksum of its payload (0 where not computed).

Rules (checked by :func:`check_batch`, misuse raises ``ValueError``): every segment is a 1-D
contiguous ``uint8`` array whose length is a whole number of rows; every object's rows lie
inside every segment (``0 <= starts[i]`` and ``starts[i] + unit <= rows``); one key, digest
and start per object; the template's length field is the payload's length. So no copy ever
reads or writes outside a row of the pool or a slot of the store.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch
import xxhash

from .base import Outcome, bad_key
from .framing import CHECKSUM_OFFSET, DIGEST_OFFSET, HEADER_BYTES, key_digests

OUTCOMES: tuple[Outcome, ...] = tuple(Outcome)
"""Outcome codes: ``OUTCOMES[code]``."""
CODE = {o: i for i, o in enumerate(OUTCOMES)}
OK = CODE[Outcome.OK]


@attrs.frozen(eq=False)
class RowBatch:
    """``n`` objects of one shape, by their rows (see the module doc)."""

    keys: Sequence[str]
    digests: np.ndarray  # uint8 [n, 16]: BLAKE2b-128 of each key (framing.key_digest)
    segments: Sequence[np.ndarray]  # per segment: the pool memory, 1-D uint8
    row_bytes: Sequence[int]  # per segment: bytes of one row
    unit: int  # rows per object
    starts: np.ndarray  # int64 [n]: each object's first row
    template: np.ndarray  # uint8 [64]: framing.header_template of this shape
    heads: np.ndarray | None = None  # get: uint8 [n, 64] where the headers land

    @property
    def payload_bytes(self) -> int:
        return self.unit * sum(self.row_bytes)

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    def select(self, idx: Sequence[int]) -> RowBatch:
        """The objects ``idx`` of this batch (a retry of some of them)."""
        pick = np.asarray(idx, dtype=np.int64)
        return attrs.evolve(self, keys=[self.keys[i] for i in idx], digests=self.digests[pick],
                            starts=self.starts[pick], heads=None if self.heads is None else self.heads[pick])


@attrs.frozen(eq=False)
class RowResults:
    """A ``get_rows`` answer: per object, its outcome code, bytes and payload checksum."""

    codes: np.ndarray  # int8 [n]
    nbytes: np.ndarray  # int64 [n]
    checksums: np.ndarray  # uint64 [n]; 0 where not computed

    @classmethod
    def of(cls, n: int, outcome: Outcome) -> RowResults:
        return cls(np.full(n, CODE[outcome], dtype=np.int8), np.zeros(n, dtype=np.int64),
                   np.zeros(n, dtype=np.uint64))


def digests_of(keys: Sequence[str]) -> np.ndarray:
    """The key digests of ``keys`` as a ``[n, 16]`` array."""
    return np.frombuffer(key_digests(keys), dtype=np.uint8).reshape(len(keys), 16)


def check_batch(batch: RowBatch, *, get: bool = False) -> None:
    """Raise a clear ``ValueError`` unless ``batch`` keeps the rules of the module doc."""
    n = len(batch.keys)
    bad, key = bad_key(batch.keys)
    if bad:
        raise ValueError(f"store keys must be non-empty strings, got {key!r}")
    if batch.digests.shape != (n, 16) or batch.digests.dtype != np.uint8:
        raise ValueError(f"{n} keys need digests of shape ({n}, 16) uint8, got {batch.digests.shape}")
    if batch.starts.shape != (n,) or batch.starts.dtype != np.int64:
        raise ValueError(f"{n} keys need int64 starts of shape ({n},), got {batch.starts.shape} {batch.starts.dtype}")
    if not isinstance(batch.unit, int) or batch.unit <= 0:
        raise ValueError(f"rows per object must be a positive int, got {batch.unit!r}")
    if not batch.segments or len(batch.segments) != len(batch.row_bytes):
        raise ValueError(f"{len(batch.segments)} segments but {len(batch.row_bytes)} row sizes")
    lo = int(batch.starts.min()) if n else 0
    hi = int(batch.starts.max()) + batch.unit if n else 0
    for j, (seg, rb) in enumerate(zip(batch.segments, batch.row_bytes)):
        if (not isinstance(seg, np.ndarray) or seg.dtype != np.uint8 or seg.ndim != 1
                or not seg.flags.c_contiguous):
            raise ValueError(f"segment {j} must be a contiguous 1-D uint8 array")
        if rb <= 0 or seg.shape[0] % rb:
            raise ValueError(f"segment {j}: {seg.shape[0]} bytes is not a whole number of {rb}-byte rows")
        if lo < 0 or hi > seg.shape[0] // rb:
            raise ValueError(f"rows out of range: objects cover rows [{lo}, {hi}), segment {j} has "
                             f"{seg.shape[0] // rb}")
    t = batch.template
    if t.shape != (HEADER_BYTES,) or t.dtype != np.uint8:
        raise ValueError(f"the header template must be {HEADER_BYTES} uint8 bytes")
    length = int(t[32:40].view("<u8")[0])
    if length != batch.payload_bytes:
        raise ValueError(f"the header template says {length} payload bytes, the rows hold {batch.payload_bytes}")
    if get and (batch.heads is None or batch.heads.shape != (n, HEADER_BYTES) or batch.heads.dtype != np.uint8):
        raise ValueError(f"a get needs heads of shape ({n}, {HEADER_BYTES}) uint8 for its headers")


def source_offsets(batch: RowBatch) -> list[list[int]]:
    """Per object, per segment: the byte offset of its first row in the segment."""
    rb = np.asarray(batch.row_bytes, dtype=np.int64)
    out: list[list[int]] = (batch.starts[:, None] * rb[None, :]).tolist()
    return out


def _layout(batch: RowBatch) -> tuple[list[int], list[int]]:
    """Per segment: its offset in the object (after the header) and its width in bytes."""
    widths = [batch.unit * rb for rb in batch.row_bytes]
    offsets = np.cumsum([HEADER_BYTES, *widths])[:-1].tolist()
    return offsets, widths


def gather(batch: RowBatch, slots: Sequence[np.ndarray], hashed: bool) -> list[int]:
    """Put side: copy each object's rows into its slot's payload (``slots[i]``, a view of at
    least ``object_bytes``); return each payload's XXH3-64, hashed right after its copy while
    it is in cache (0s when not ``hashed``). One Python loop per object: the per-segment copies
    are slice assignments."""
    return _copy_rows(batch, slots, hashed, into_slots=True)


def scatter(batch: RowBatch, slots: Sequence[np.ndarray], hashed: bool) -> list[int]:
    """Get side: copy each slot's payload into the object's rows; each payload's XXH3-64,
    hashed from the slot right after it was copied out (a host copy lands the bytes it read),
    or 0s when not ``hashed``."""
    return _copy_rows(batch, slots, hashed, into_slots=False)


def _copy_rows(batch: RowBatch, slots: Sequence[np.ndarray], hashed: bool, *, into_slots: bool) -> list[int]:
    """Copy between each object's rows and its slot's payload (``into_slots``: rows to slot);
    each payload's XXH3-64 hashed from the slot right after its copy, while it is in cache."""
    offsets, widths = _layout(batch)
    segs = batch.segments
    end = batch.object_bytes
    sums = [0] * len(slots)
    hash_of = xxhash.xxh3_64_intdigest
    for i, (slot, row_off) in enumerate(zip(slots, source_offsets(batch))):
        for seg, o, w, s in zip(segs, offsets, widths, row_off):
            if into_slots:
                slot[o:o + w] = seg[s:s + w]
            else:
                seg[s:s + w] = slot[o:o + w]
        if hashed:
            sums[i] = hash_of(slot[HEADER_BYTES:end].data)
    return sums


def payload_sums(batch: RowBatch, idx: Sequence[int] | None = None) -> list[int]:
    """XXH3-64 of each object's payload (of the objects ``idx``; default all), from its rows: its
    row range of every segment, in segment order, streamed into one hash (no copy; for a store
    that does not copy the bytes itself, e.g. Mooncake, or a wrapper that seals for it)."""
    offsets = source_offsets(batch)
    widths = [batch.unit * rb for rb in batch.row_bytes]
    segs = batch.segments
    new = xxhash.xxh3_64
    sums: list[int] = []
    for offs in offsets if idx is None else [offsets[i] for i in idx]:
        h = new()
        for seg, o, w in zip(segs, offs, widths):
            h.update(seg[o:o + w].data)
        sums.append(h.intdigest())
    return sums


def object_buffers(batch: RowBatch, heads: np.ndarray) -> list[list[torch.Tensor]]:
    """Each object of the batch as buffers, for the parts calls: header row ``heads[i]``, then a
    view of each segment's rows (no copy)."""
    widths = [batch.unit * rb for rb in batch.row_bytes]
    return [[torch.from_numpy(heads[i]), *(torch.from_numpy(seg[o:o + w])
                                           for seg, o, w in zip(batch.segments, offs, widths))]
            for i, offs in enumerate(source_offsets(batch))]


def headers(batch: RowBatch, checksums: Sequence[int]) -> np.ndarray:
    """The ``[n, 64]`` headers of the batch: the template, each digest and checksum."""
    n = len(batch.keys)
    heads = np.empty((n, HEADER_BYTES), dtype=np.uint8)
    heads[:] = batch.template
    heads[:, DIGEST_OFFSET:DIGEST_OFFSET + 16] = batch.digests
    heads[:, CHECKSUM_OFFSET:CHECKSUM_OFFSET + 8] = np.asarray(checksums, dtype="<u8").view(np.uint8).reshape(n, 8)
    return heads


def expected_headers(batch: RowBatch) -> np.ndarray:
    """What a loaded batch's headers must hold in their first :data:`CHECKSUM_OFFSET` bytes."""
    return headers(batch, [0] * len(batch.keys))[:, :CHECKSUM_OFFSET]
