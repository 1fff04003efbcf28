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


def verify_array(frame: np.ndarray, nbytes: int, key: str, layout_fingerprint: bytes) -> np.ndarray:
    """:func:`verify` on a 1-D uint8 NumPy view; returns the payload view."""
    if nbytes < HEADER_BYTES or frame.shape[0] < HEADER_BYTES:
        raise FrameError(FrameFault.TRUNCATED, key, f"{nbytes} bytes, header needs {HEADER_BYTES}")
    magic, version, _flags, layout, digest, length, checksum, _ = _HEADER.unpack_from(frame.data, 0)
    if magic != MAGIC:
        raise FrameError(FrameFault.BAD_MAGIC, key)
    if version != FORMAT_VERSION:
        raise FrameError(FrameFault.BAD_VERSION, key, f"version {version}")
    if layout != layout_fingerprint[:8]:
        raise FrameError(FrameFault.OTHER_LAYOUT, key)
    if digest != key_digest(key):
        raise FrameError(FrameFault.OTHER_KEY, key)
    room = frame.shape[0] - HEADER_BYTES
    if length != nbytes - HEADER_BYTES or length > room:
        raise FrameError(
            FrameFault.BAD_LENGTH if length <= room else FrameFault.TRUNCATED,
            key,
            f"header says {length} payload bytes, object has {nbytes - HEADER_BYTES}",
        )
    payload = frame[HEADER_BYTES: HEADER_BYTES + length]
    if xxhash.xxh3_64_intdigest(payload.data) != checksum:
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


def verify_parts(header: np.ndarray, nbytes: int, pieces: list[np.ndarray], key: str,
                 layout_fingerprint: bytes) -> None:
    """:func:`verify_array` for an object read as ``header ‖ pieces...`` (a zero-copy get into
    pool rows): the header's fields, the length against the pieces, and the checksum over the
    bytes as they landed. Raises :class:`FrameError`."""
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
    room = sum(p.shape[0] for p in pieces)
    if length != nbytes - HEADER_BYTES or length != room:
        raise FrameError(
            FrameFault.BAD_LENGTH if nbytes - HEADER_BYTES >= room else FrameFault.TRUNCATED, key,
            f"header says {length} payload bytes, object has {nbytes - HEADER_BYTES}, rows hold {room}")
    h = xxhash.xxh3_64()
    for p in pieces:
        h.update(p.data)
    if h.intdigest() != checksum:
        raise FrameError(FrameFault.BAD_CHECKSUM, key)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("frames are contiguous uint8 CPU tensors")
    return t.numpy()
