"""Object framing: every stored object is ``header ‖ payload`` in one contiguous buffer.

Header (64 bytes, little endian)::

    magic      4s   b"HYLK"
    version    u16  FORMAT_VERSION
    flags      u16  reserved, 0
    layout     8s   first 8 bytes of the model layout fingerprint
    key        16s  BLAKE2b-128 digest of the object key
    length     u64  payload bytes
    checksum   u64  XXH3-64 of the payload
    reserved   16s  zeros

A reader verifies all of it before a single payload byte is used: a truncated, corrupted,
mis-keyed or other-layout object is rejected with a :class:`FrameError` naming the reason,
and the runtime turns that into a miss. The payload starts at offset ``HEADER_BYTES`` (64),
so payload views stay 64-byte aligned inside an aligned staging arena.

**Checksum while copying.** Hashing a payload in a pass of its own costs as much memory
traffic as copying it (a 1 MiB object is read from DRAM twice). :func:`copy_checksummed`
copies in :data:`CHECKSUM_CHUNK_BYTES` pieces and hashes each piece of the *destination* right
after copying it, while it is still in the core's L2 cache, so the bytes cross DRAM once and
the checksum covers exactly the bytes that landed. A store that copies (the embedded store)
uses it to seal objects as it stores them (:func:`seal_header` + :func:`set_checksum`) and to
report the checksum of what it wrote into the caller's buffers (:func:`verify_parts` with
``landed_checksum``).
"""

from __future__ import annotations

import enum
import hashlib
import struct

import numpy as np
import torch
import xxhash

MAGIC = b"HYLK"
FORMAT_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHH8s16sQQ16s")
assert _HEADER.size == HEADER_BYTES
_CHECKSUM = struct.Struct("<Q")
CHECKSUM_OFFSET = 40  # magic 4 + version 2 + flags 2 + layout 8 + key 16 + length 8
CHECKSUM_CHUNK_BYTES = 256 << 10
"""Piece size of :func:`copy_checksummed`: a piece and its source fit in a core's L2 cache
(2 MiB here) together, and the Python work per piece (~3 µs) stays small next to its copy."""


class FrameFault(enum.Enum):
    """Why a framed object was rejected."""

    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    OTHER_LAYOUT = "other_layout"
    OTHER_KEY = "other_key"
    BAD_LENGTH = "bad_length"
    BAD_CHECKSUM = "bad_checksum"


class FrameError(ValueError):
    """A framed object failed verification."""

    def __init__(self, fault: FrameFault, key: str, detail: str = "") -> None:
        self.fault = fault
        self.key = key
        super().__init__(f"object {key!r} rejected: {fault.value}{': ' + detail if detail else ''}")


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def payload_checksum(payload: torch.Tensor) -> int:
    """XXH3-64 of a contiguous uint8 CPU tensor, without copying it."""
    return xxhash.xxh3_64_intdigest(_as_numpy(payload).data)


def framed_size(payload_bytes: int) -> int:
    return HEADER_BYTES + payload_bytes


def payload_view(frame: torch.Tensor) -> torch.Tensor:
    """The payload part of a frame buffer (a view; write the payload here, then seal)."""
    return frame[HEADER_BYTES:]


def seal(frame: torch.Tensor, key: str, layout_fingerprint: bytes) -> None:
    """Write the header of ``frame`` for the payload already in ``payload_view(frame)``."""
    seal_array(_as_numpy(frame), key, layout_fingerprint)


def verify(frame: torch.Tensor, nbytes: int, key: str, layout_fingerprint: bytes) -> torch.Tensor:
    """Check the first ``nbytes`` of ``frame`` as the object for ``key``; return the payload.

    Raises :class:`FrameError` on any mismatch.
    """
    if not isinstance(frame, torch.Tensor) or frame.dtype != torch.uint8 or frame.dim() != 1:
        raise ValueError(f"frames are contiguous uint8 1-D tensors, got {getattr(frame, 'shape', type(frame))}")
    length = verify_array(_as_numpy(frame), nbytes, key, layout_fingerprint).shape[0]
    return frame[HEADER_BYTES: HEADER_BYTES + length]


def seal_array(frame: np.ndarray, key: str, layout_fingerprint: bytes) -> None:
    """:func:`seal` on a 1-D uint8 NumPy view (the runtime's hot path: no tensor per object)."""
    payload = frame[HEADER_BYTES:]
    frame[:HEADER_BYTES] = np.frombuffer(_HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        layout_fingerprint[:8],
        key_digest(key),
        payload.shape[0],
        xxhash.xxh3_64_intdigest(payload.data),
        b"\0" * 16,
    ), dtype=np.uint8)


def _header_fields(header: np.ndarray, nbytes: int, key: str, layout_fingerprint: bytes) -> tuple[int, int]:
    """Check a header's magic, version, layout and key (one rule for whole and scattered
    objects); its payload length and checksum. Raises :class:`FrameError`."""
    if nbytes < HEADER_BYTES or header.shape[0] < HEADER_BYTES:
        raise FrameError(FrameFault.TRUNCATED, key, f"{nbytes} bytes, header needs {HEADER_BYTES}")
    magic, version, _flags, layout, digest, length, checksum, _ = _HEADER.unpack_from(header.data, 0)
    if magic != MAGIC:
        raise FrameError(FrameFault.BAD_MAGIC, key)
    if version != FORMAT_VERSION:
        raise FrameError(FrameFault.BAD_VERSION, key, f"version {version}")
    if layout != layout_fingerprint[:8]:
        raise FrameError(FrameFault.OTHER_LAYOUT, key)
    if digest != key_digest(key):
        raise FrameError(FrameFault.OTHER_KEY, key)
    return length, checksum


def verify_array(frame: np.ndarray, nbytes: int, key: str, layout_fingerprint: bytes,
                 landed_checksum: int | None = None) -> np.ndarray:
    """:func:`verify` on a 1-D uint8 NumPy view; returns the payload view. ``landed_checksum``:
    the payload's checksum as computed by whoever wrote it into ``frame``
    (:func:`copy_checksummed`); otherwise the payload is hashed here."""
    length, checksum = _header_fields(frame, nbytes, key, layout_fingerprint)
    room = frame.shape[0] - HEADER_BYTES
    if length != nbytes - HEADER_BYTES or length > room:
        raise FrameError(
            FrameFault.BAD_LENGTH if length <= room else FrameFault.TRUNCATED,
            key,
            f"header says {length} payload bytes, object has {nbytes - HEADER_BYTES}",
        )
    payload = frame[HEADER_BYTES: HEADER_BYTES + length]
    if landed_checksum is None:
        landed_checksum = xxhash.xxh3_64_intdigest(payload.data)
    if landed_checksum != checksum:
        raise FrameError(FrameFault.BAD_CHECKSUM, key)
    return payload


def seal_parts(header: np.ndarray, pieces: list[np.ndarray], key: str, layout_fingerprint: bytes) -> None:
    """Write into ``header`` (64 bytes) the header of the object ``header ‖ pieces...``: the
    same object :func:`seal_array` makes, for a payload scattered over several buffers (pool
    rows read in place by a zero-copy put)."""
    h = xxhash.xxh3_64()
    length = 0
    for p in pieces:
        h.update(p.data)
        length += p.shape[0]
    header[:HEADER_BYTES] = np.frombuffer(_HEADER.pack(
        MAGIC, FORMAT_VERSION, 0, layout_fingerprint[:8], key_digest(key), length, h.intdigest(),
        b"\0" * 16), dtype=np.uint8)


def seal_header(header: np.ndarray, key: str, layout_fingerprint: bytes, length: int) -> None:
    """Write into ``header`` (64 bytes) the header of a ``length``-byte payload whose checksum
    is not known yet: every field but the checksum (0). Whoever copies the payload sets it
    with :func:`set_checksum` once the payload has landed (a store that checksums while
    copying, see :func:`copy_checksummed`)."""
    header[:HEADER_BYTES] = np.frombuffer(_HEADER.pack(
        MAGIC, FORMAT_VERSION, 0, layout_fingerprint[:8], key_digest(key), length, 0,
        b"\0" * 16), dtype=np.uint8)


def set_checksum(header: np.ndarray, checksum: int) -> None:
    """Fill the checksum field of a header made by :func:`seal_header`."""
    header[CHECKSUM_OFFSET:CHECKSUM_OFFSET + 8] = np.frombuffer(_CHECKSUM.pack(checksum), dtype=np.uint8)


def copy_checksummed(targets: list[np.ndarray], sources: list[np.ndarray]) -> int:
    """Copy ``sources[i]`` into ``targets[i]`` (1-D uint8, equal lengths) and return the
    XXH3-64 of the bytes as they landed, in order: the checksum of their concatenation, the
    same value :func:`seal_parts` computes. Copies in :data:`CHECKSUM_CHUNK_BYTES` pieces and
    hashes each landed piece right after its copy, while it is hot in cache: one pass over
    memory instead of two."""
    h = xxhash.xxh3_64()
    step = CHECKSUM_CHUNK_BYTES
    for dst, src in zip(targets, sources, strict=True):
        n = src.shape[0]
        if dst.shape[0] != n:
            raise ValueError(f"copy of {n} bytes into a {dst.shape[0]}-byte buffer")
        if n <= step:
            np.copyto(dst, src, casting="no")
            h.update(dst.data)
            continue
        for lo in range(0, n, step):
            d = dst[lo:lo + step]
            np.copyto(d, src[lo:lo + step], casting="no")
            h.update(d.data)
    return h.intdigest()


def verify_parts(header: np.ndarray, nbytes: int, pieces: list[np.ndarray], key: str,
                 layout_fingerprint: bytes, landed_checksum: int | None = None) -> None:
    """:func:`verify_array` for an object read as ``header ‖ pieces...`` (a zero-copy get into
    pool rows): the header's fields, the length against the pieces, and the checksum over the
    bytes as they landed. ``landed_checksum``: that checksum, when whoever wrote the pieces
    computed it over them as they landed (:func:`copy_checksummed`); otherwise the pieces are
    hashed here. Raises :class:`FrameError`."""
    length, checksum = _header_fields(header, nbytes, key, layout_fingerprint)
    room = sum(p.shape[0] for p in pieces)
    if length != nbytes - HEADER_BYTES or length != room:
        raise FrameError(
            FrameFault.BAD_LENGTH if nbytes - HEADER_BYTES >= room else FrameFault.TRUNCATED, key,
            f"header says {length} payload bytes, object has {nbytes - HEADER_BYTES}, rows hold {room}")
    if landed_checksum is None:
        h = xxhash.xxh3_64()
        for p in pieces:
            h.update(p.data)
        landed_checksum = h.intdigest()
    if landed_checksum != checksum:
        raise FrameError(FrameFault.BAD_CHECKSUM, key)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("frames are contiguous uint8 CPU tensors")
    return t.numpy()
