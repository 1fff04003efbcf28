"""Object framing: every stored object is ``header ‖ payload`` in one contiguous buffer.

Header (64 bytes, little endian)::

    magic      4s   b"HYLK"
    version    u16  FORMAT_VERSION (1): XXH3; UNHASHED_VERSION (2): none; DEVICE_SUM_VERSION (3): device sum
    flags      u16  0 in version 1; FLAG_UNHASHED in version 2; FLAG_DEVICE_SUM in version 3
    layout     8s   first 8 bytes of the model layout fingerprint
    key        16s  BLAKE2b-128 digest of the object key
    length     u64  payload bytes
    checksum   u64  XXH3-64 of the payload (version 1); 0 (version 2); the device checksum
                    (``stores/device_checksum.py``) of the payload (version 3)
    reserved   16s  zeros

A reader verifies all of it before a single payload byte is used: a truncated, corrupted,
mis-keyed or other-layout object is rejected with a :class:`FrameError` naming the reason,
and the runtime turns that into a miss. Its length must equal the room the reader expects for
the object (the pool's payload bytes, :func:`check_length`) on every path: a short frame with
an honest header and checksum is refused too, never topped up with whatever its buffers held. The payload starts at offset ``HEADER_BYTES`` (64),
so payload views stay 64-byte aligned inside an aligned staging arena.

**Integrity levels** (:class:`Integrity`). A writer at ``"checksum"`` (the default) seals
version-1 frames with the payload's checksum, byte for byte the frames of every earlier
release. A writer at ``"header"`` seals version-2 frames: ``flags = FLAG_UNHASHED`` and a zero
checksum field, no pass over the payload. A frame says which it is, and a reader verifies by
what it says: version 1 needs flags 0 and a matching payload checksum, version 2 needs exactly
``FLAG_UNHASHED`` and a zero checksum field (any other combination is ``bad_version``, so one
flipped byte cannot turn a hashed frame into an unhashed one).

**Device-summed frames** (version 3, ``FLAG_DEVICE_SUM``): written by device pools at
``"checksum"``, whose payload is checksummed on the device with
:func:`~hylinker.stores.device_checksum.device_checksums` (integer arithmetic, the same value on
CPU and CUDA), so neither side needs the bytes on the host to seal or verify them. :class:`Checksum`
names the three kinds; each is one (version, flags) pair, and version and flags sit in different
bytes, so one damaged byte cannot turn one kind into another (it makes a pair no kind has:
``bad_version``). A host reader verifies a version-3 frame by computing the same function over
the payload on the CPU (:func:`verify_array`, :func:`verify_parts`); a device reader reads the
header with :func:`read_header` and compares the checksum on the device. A ``"header"`` reader still
checks the checksum of a version-1 frame (it never trusts less than the writer recorded); a
``"checksum"`` reader rejects a version-2 frame as ``unhashed`` (it was asked for payload
checksums and the object has none). A release before version 2 rejects version-2 frames as
``bad_version``: clear, never silent.

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
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from .device_checksum import device_checksum

MAGIC = b"HYLK"
FORMAT_VERSION = 1
"""A frame whose payload is hashed with XXH3 (integrity ``"checksum"``, host pools)."""
UNHASHED_VERSION = 2
"""A frame whose payload is not hashed (integrity ``"header"``)."""
DEVICE_SUM_VERSION = 3
"""A frame whose payload carries the device checksum (integrity ``"checksum"``, device pools)."""
FLAG_UNHASHED = 1
FLAG_DEVICE_SUM = 2
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHH8s16sQQ16s")
assert _HEADER.size == HEADER_BYTES
_CHECKSUM = struct.Struct("<Q")
CHECKSUM_OFFSET = 40  # magic 4 + version 2 + flags 2 + layout 8 + key 16 + length 8
DIGEST_OFFSET = 16  # magic 4 + version 2 + flags 2 + layout 8
CHECKSUM_CHUNK_BYTES = 256 << 10
"""Piece size of :func:`copy_checksummed`: a piece and its source fit in a core's L2 cache
(2 MiB here) together, and the Python work per piece (~3 µs) stays small next to its copy."""


class Integrity(enum.Enum):
    """What a frame proves about its payload (see the module doc)."""

    CHECKSUM = "checksum"  # header fields and an XXH3-64 of the payload
    HEADER = "header"  # header fields only: magic, version, layout, key, length

    @classmethod
    def parse(cls, value: object, where: str) -> Integrity:
        """``value`` (a level or its name) as a level; a :class:`ValueError` naming ``where``
        (the setting) otherwise."""
        if isinstance(value, Integrity):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{where} must be one of {[m.value for m in cls]}, got {value!r}") from None


class Checksum(enum.Enum):
    """What a frame's checksum field holds: one (version, flags) pair per kind."""

    XXH3 = (FORMAT_VERSION, 0)  # XXH3-64 of the payload
    NONE = (UNHASHED_VERSION, FLAG_UNHASHED)  # nothing: the field is 0
    DEVICE = (DEVICE_SUM_VERSION, FLAG_DEVICE_SUM)  # device_checksums of the payload

    @classmethod
    def of_level(cls, integrity: Integrity) -> Checksum:
        """The kind a host writer at ``integrity`` seals."""
        return cls.XXH3 if integrity is Integrity.CHECKSUM else cls.NONE


_KINDS = {c.value: c for c in Checksum}


class FrameFault(enum.Enum):
    """Why a framed object was rejected."""

    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    OTHER_LAYOUT = "other_layout"
    OTHER_KEY = "other_key"
    BAD_LENGTH = "bad_length"
    BAD_CHECKSUM = "bad_checksum"
    UNHASHED = "unhashed"  # a "checksum" reader got a frame written without a payload checksum


REREAD_FAULTS = frozenset(FrameFault) - {FrameFault.UNHASHED}
"""Faults a damaged transfer can cause: a load reads such an object once more before it
declares it bad. ``unhashed`` needs a consistent version-2 header, which a flipped byte does
not make."""


class FrameError(ValueError):
    """A framed object failed verification."""

    def __init__(self, fault: FrameFault, key: str, detail: str = "") -> None:
        self.fault = fault
        self.key = key
        super().__init__(f"object {key!r} rejected: {fault.value}{': ' + detail if detail else ''}")


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def key_digests(keys: Sequence[str]) -> bytes:
    """:func:`key_digest` of every key, concatenated (16 bytes each)."""
    return b"".join([hashlib.blake2b(k.encode(), digest_size=16).digest() for k in keys])


def payload_checksum(payload: torch.Tensor) -> int:
    """XXH3-64 of a contiguous uint8 CPU tensor, without copying it."""
    return xxhash.xxh3_64_intdigest(_as_numpy(payload).data)


def framed_size(payload_bytes: int) -> int:
    return HEADER_BYTES + payload_bytes


def payload_view(frame: torch.Tensor) -> torch.Tensor:
    """The payload part of a frame buffer (a view; write the payload here, then seal)."""
    return frame[HEADER_BYTES:]


def seal(frame: torch.Tensor, key: str, layout_fingerprint: bytes,
         integrity: Integrity = Integrity.CHECKSUM) -> None:
    """Write the header of ``frame`` for the payload already in ``payload_view(frame)``."""
    seal_array(_as_numpy(frame), key, layout_fingerprint, integrity)


def verify(frame: torch.Tensor, nbytes: int, key: str, layout_fingerprint: bytes,
           integrity: Integrity = Integrity.CHECKSUM, *, room: int | None = None) -> torch.Tensor:
    """Check the first ``nbytes`` of ``frame`` as the object for ``key``; return the payload.
    ``room``: the payload bytes the reader expects (:func:`check_length`); ``None`` for a
    reader with no expectation of its own (a store's tests, reading objects of many sizes),
    which takes the object's own size.

    Raises :class:`FrameError` on any mismatch.
    """
    if not isinstance(frame, torch.Tensor) or frame.dtype != torch.uint8 or frame.dim() != 1:
        raise ValueError(f"frames are contiguous uint8 1-D tensors, got {getattr(frame, 'shape', type(frame))}")
    expected = nbytes - HEADER_BYTES if room is None else room
    length = verify_array(_as_numpy(frame), nbytes, key, layout_fingerprint, integrity=integrity,
                          room=expected).shape[0]
    return frame[HEADER_BYTES: HEADER_BYTES + length]


def _pack(key: str, layout_fingerprint: bytes, length: int, kind: Checksum, checksum: int) -> np.ndarray:
    """A header of ``kind`` with ``checksum`` (0 for :attr:`Checksum.NONE`)."""
    version, flags = kind.value
    return np.frombuffer(_HEADER.pack(MAGIC, version, flags, layout_fingerprint[:8], key_digest(key), length,
                                      checksum, b"\0" * 16), dtype=np.uint8)


def seal_array(frame: np.ndarray, key: str, layout_fingerprint: bytes,
               integrity: Integrity = Integrity.CHECKSUM) -> None:
    """:func:`seal` on a 1-D uint8 NumPy view (the runtime's hot path: no tensor per object)."""
    payload = frame[HEADER_BYTES:]
    hashed = integrity is Integrity.CHECKSUM
    frame[:HEADER_BYTES] = _pack(key, layout_fingerprint, payload.shape[0], Checksum.of_level(integrity),
                                 xxhash.xxh3_64_intdigest(payload.data) if hashed else 0)


def _header_fields(header: np.ndarray, nbytes: int, key: str, layout_fingerprint: bytes,
                   integrity: Integrity) -> tuple[int, Checksum, int]:
    """Check a header's magic, version and flags, layout and key (one rule for whole and
    scattered objects); its payload length, checksum kind and checksum (an unhashed frame is
    refused by a ``"checksum"`` reader). Raises :class:`FrameError`."""
    if nbytes < HEADER_BYTES or header.shape[0] < HEADER_BYTES:
        raise FrameError(FrameFault.TRUNCATED, key, f"{nbytes} bytes, header needs {HEADER_BYTES}")
    magic, version, flags, layout, digest, length, checksum, _ = _HEADER.unpack_from(header.data, 0)
    if magic != MAGIC:
        raise FrameError(FrameFault.BAD_MAGIC, key)
    kind = _KINDS.get((version, flags))
    if kind is None or (kind is Checksum.NONE and checksum != 0):
        raise FrameError(FrameFault.BAD_VERSION, key, f"version {version}, flags {flags:#x}")
    if layout != layout_fingerprint[:8]:
        raise FrameError(FrameFault.OTHER_LAYOUT, key)
    if digest != key_digest(key):
        raise FrameError(FrameFault.OTHER_KEY, key)
    if kind is Checksum.NONE and integrity is Integrity.CHECKSUM:
        raise FrameError(FrameFault.UNHASHED, key, "written at integrity 'header', read at 'checksum'")
    return length, kind, checksum


def _payload_checksum(kind: Checksum, pieces: list[np.ndarray], landed_checksum: int | None) -> int:
    """The checksum of kind ``kind`` (not NONE) of the payload ``pieces``, computed on the host.
    ``landed_checksum``: the XXH3 whoever wrote the pieces computed as they landed (used for
    XXH3 frames only; a device-summed frame is summed here, with the device's function)."""
    if kind is Checksum.XXH3:
        if landed_checksum is not None:
            return landed_checksum
        h = xxhash.xxh3_64()
        for p in pieces:
            h.update(p.data)
        return h.intdigest()
    whole = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    return device_checksum(torch.from_numpy(whole))


def check_length(length: int, nbytes: int, room: int, key: str) -> None:
    """The one length rule of every verifying path: an object is usable only if its header's
    payload ``length``, the payload the store delivered (``nbytes`` minus the header) and the
    ``room`` the reader expects (the pool's payload bytes per object, never a size the store
    reported) are all equal. A shorter object, however self-consistent, is refused: its
    reader would otherwise use the rest of its buffers as payload (bytes of an earlier load).
    Raises :class:`FrameError` (``truncated`` when the object is short of the room,
    ``bad_length`` otherwise)."""
    if length != nbytes - HEADER_BYTES or length != room:
        raise FrameError(
            FrameFault.BAD_LENGTH if nbytes - HEADER_BYTES >= room else FrameFault.TRUNCATED, key,
            f"header says {length} payload bytes, object has {nbytes - HEADER_BYTES}, the reader expects {room}")


def verify_array(frame: np.ndarray, nbytes: int, key: str, layout_fingerprint: bytes,
                 landed_checksum: int | None = None,
                 integrity: Integrity = Integrity.CHECKSUM, *, room: int) -> np.ndarray:
    """:func:`verify` on a 1-D uint8 NumPy view; returns the payload view. ``room``: the payload
    bytes the reader expects (:func:`check_length`). ``landed_checksum``: the payload's checksum
    as computed by whoever wrote it into ``frame`` (:func:`copy_checksummed`); otherwise the
    payload is hashed here, if the frame says it is hashed. ``integrity``: the reader's level (a
    ``"checksum"`` reader refuses unhashed frames)."""
    length, kind, checksum = _header_fields(frame, nbytes, key, layout_fingerprint, integrity)
    check_length(length, nbytes, room, key)
    if length > frame.shape[0] - HEADER_BYTES:
        raise FrameError(FrameFault.TRUNCATED, key, f"{length} payload bytes in a {frame.shape[0]}-byte frame")
    payload = frame[HEADER_BYTES: HEADER_BYTES + length]
    if kind is Checksum.NONE:  # unhashed frame, "header" reader: the header is all there is
        return payload
    if _payload_checksum(kind, [payload], landed_checksum) != checksum:
        raise FrameError(FrameFault.BAD_CHECKSUM, key)
    return payload


def verify_own_array(frame: np.ndarray, nbytes: int, key: str, layout_fingerprint: bytes,
                     integrity: Integrity = Integrity.CHECKSUM, *, room: int) -> np.ndarray:
    """The header check of :func:`verify_array` (magic, version, layout, key, length) on a
    frame this process sealed with :func:`seal_header` and still owns (a two-stage offload's
    draining frame, whose checksum a store that checksums as it copies sets only in its own
    copy): the payload is not hashed, since its bytes never left this process. Returns the
    payload view."""
    length, _kind, _checksum = _header_fields(frame, nbytes, key, layout_fingerprint, integrity)
    check_length(length, nbytes, room, key)
    if length > frame.shape[0] - HEADER_BYTES:
        raise FrameError(FrameFault.TRUNCATED, key, f"{length} payload bytes in a {frame.shape[0]}-byte frame")
    return frame[HEADER_BYTES: HEADER_BYTES + length]


def seal_parts(header: np.ndarray, pieces: list[np.ndarray], key: str, layout_fingerprint: bytes,
               integrity: Integrity = Integrity.CHECKSUM) -> None:
    """Write into ``header`` (64 bytes) the header of the object ``header ‖ pieces...``: the
    same object :func:`seal_array` makes, for a payload scattered over several buffers (pool
    rows read in place by a zero-copy put)."""
    length = sum(p.shape[0] for p in pieces)
    kind = Checksum.of_level(integrity)
    checksum = 0 if kind is Checksum.NONE else _payload_checksum(kind, pieces, None)
    header[:HEADER_BYTES] = _pack(key, layout_fingerprint, length, kind, checksum)


def seal_header(header: np.ndarray, key: str, layout_fingerprint: bytes, length: int,
                integrity: Integrity = Integrity.CHECKSUM) -> None:
    """Write into ``header`` (64 bytes) the header of a ``length``-byte payload whose checksum
    is not known yet: every field but the checksum (0). Whoever copies the payload sets it
    with :func:`set_checksum` once the payload has landed (a store that checksums while
    copying, see :func:`copy_checksummed`). At ``integrity="header"`` the header is complete:
    an unhashed frame, nothing to set."""
    header[:HEADER_BYTES] = _pack(key, layout_fingerprint, length, Checksum.of_level(integrity), 0)


def seal_device(header: np.ndarray, key: str, layout_fingerprint: bytes, length: int, checksum: int) -> None:
    """Write into ``header`` (64 bytes) a version-3 header for a ``length``-byte payload whose
    device checksum (:func:`~hylinker.stores.device_checksum.device_checksums`, computed where
    the payload lives) is ``checksum``."""
    header[:HEADER_BYTES] = _pack(key, layout_fingerprint, length, Checksum.DEVICE, checksum)


def header_template(layout_fingerprint: bytes, length: int, integrity: Integrity = Integrity.CHECKSUM) -> np.ndarray:
    """The header every object of one shape shares at ``integrity``: every field but the key
    digest (bytes :data:`DIGEST_OFFSET` to +16) and the checksum, both zero. A store that moves a
    batch described by rows (:mod:`hylinker.stores.rows`) writes it with each object's digest
    and checksum filled in: the frame :func:`seal_array` makes, byte for byte."""
    t = _pack("", layout_fingerprint, length, Checksum.of_level(integrity), 0).copy()
    t[DIGEST_OFFSET:DIGEST_OFFSET + 16] = 0
    return t


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
                 layout_fingerprint: bytes, landed_checksum: int | None = None,
                 integrity: Integrity = Integrity.CHECKSUM) -> None:
    """:func:`verify_array` for an object read as ``header ‖ pieces...`` (a zero-copy get into
    pool rows): the header's fields, the length against the pieces, and the checksum over the
    bytes as they landed. ``landed_checksum``: that checksum, when whoever wrote the pieces
    computed it over them as they landed (:func:`copy_checksummed`); otherwise the pieces are
    hashed here (if the frame says it is hashed). Raises :class:`FrameError`."""
    kind, checksum = read_header(header, nbytes, sum(p.shape[0] for p in pieces), key, layout_fingerprint, integrity)
    if kind is not Checksum.NONE and _payload_checksum(kind, pieces, landed_checksum) != checksum:
        raise FrameError(FrameFault.BAD_CHECKSUM, key)


def read_header(header: np.ndarray, nbytes: int, room: int, key: str, layout_fingerprint: bytes,
                integrity: Integrity = Integrity.CHECKSUM) -> tuple[Checksum, int]:
    """Check the header of an object of ``nbytes`` read into ``header`` and ``room`` payload
    bytes of buffers: every field and the length; return what its checksum field holds and the
    checksum, for whoever verifies the payload (on the host, or on the device where it landed).
    Raises :class:`FrameError`."""
    length, kind, checksum = _header_fields(header, nbytes, key, layout_fingerprint, integrity)
    check_length(length, nbytes, room, key)
    return kind, checksum


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("frames are contiguous uint8 CPU tensors")
    return t.numpy()
