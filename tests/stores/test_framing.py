"""Object framing: round trip, and every way a stored object is rejected."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch

from hylinker.stores.framing import (
    FORMAT_VERSION,
    HEADER_BYTES,
    UNHASHED_VERSION,
    FrameError,
    FrameFault,
    Integrity,
    framed_size,
    payload_view,
    seal,
    seal_header,
    seal_parts,
    verify,
    verify_parts,
)

LAYOUT = hashlib.sha256(b"test-framing-layout").digest()
OTHER_LAYOUT = hashlib.sha256(b"another-layout").digest()
KEY = "page/0123abcd/kv/tp0"


def sealed(payload_bytes: int = 256, key: str = KEY, seed: int = 0,
           integrity: Integrity = Integrity.CHECKSUM) -> torch.Tensor:
    frame = torch.empty(framed_size(payload_bytes), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    payload_view(frame).copy_(torch.randint(0, 256, (payload_bytes,), dtype=torch.uint8, generator=gen))
    seal(frame, key, LAYOUT, integrity)
    return frame


@pytest.mark.parametrize("payload_bytes", [0, 1, 63, 64, 4096, 65536])
def test_round_trip_returns_the_payload(payload_bytes: int) -> None:
    frame = sealed(payload_bytes, seed=payload_bytes)
    expected = payload_view(frame).clone()
    payload = verify(frame, frame.numel(), KEY, LAYOUT)
    assert payload.numel() == payload_bytes
    assert torch.equal(payload, expected)
    if payload_bytes:
        assert payload.data_ptr() == frame.data_ptr() + HEADER_BYTES  # a view, no copy


def test_round_trip_in_a_larger_buffer() -> None:
    frame = sealed(512)
    bigger = torch.zeros(frame.numel() + 1000, dtype=torch.uint8)
    bigger[: frame.numel()] = frame
    payload = verify(bigger, frame.numel(), KEY, LAYOUT)
    assert torch.equal(payload, payload_view(frame))


def _flip(pos: int) -> Callable[[torch.Tensor], int]:
    def mutate(frame: torch.Tensor) -> int:
        frame[pos] ^= 0x5A
        return frame.numel()

    return mutate


def _set_version(frame: torch.Tensor) -> int:
    frame[4:6] = torch.frombuffer(bytearray(struct.pack("<H", FORMAT_VERSION + 1)), dtype=torch.uint8)
    return frame.numel()


def _set_length(frame: torch.Tensor) -> int:
    frame[32:40] = torch.frombuffer(bytearray(struct.pack("<Q", 100)), dtype=torch.uint8)
    return frame.numel()


# (case, mutate(frame) -> nbytes to verify, key, layout, expected fault)
CASES: list[tuple[str, Callable[[torch.Tensor], int], str, bytes, FrameFault]] = [
    ("empty object", lambda f: 0, KEY, LAYOUT, FrameFault.TRUNCATED),
    ("half a header", lambda f: HEADER_BYTES // 2, KEY, LAYOUT, FrameFault.TRUNCATED),
    ("header only, payload lost", lambda f: HEADER_BYTES, KEY, LAYOUT, FrameFault.BAD_LENGTH),
    ("payload cut short", lambda f: f.numel() - 1, KEY, LAYOUT, FrameFault.BAD_LENGTH),
    ("bad magic", _flip(0), KEY, LAYOUT, FrameFault.BAD_MAGIC),
    ("bad magic, last byte", _flip(3), KEY, LAYOUT, FrameFault.BAD_MAGIC),
    ("bad version", _set_version, KEY, LAYOUT, FrameFault.BAD_VERSION),
    ("other layout", lambda f: f.numel(), KEY, OTHER_LAYOUT, FrameFault.OTHER_LAYOUT),
    ("layout byte corrupted", _flip(8), KEY, LAYOUT, FrameFault.OTHER_LAYOUT),
    ("other key", lambda f: f.numel(), "page/0123abcd/kv/tp1", LAYOUT, FrameFault.OTHER_KEY),
    ("key digest corrupted", _flip(20), KEY, LAYOUT, FrameFault.OTHER_KEY),
    ("length field corrupted", _set_length, KEY, LAYOUT, FrameFault.BAD_LENGTH),
    ("checksum corrupted", _flip(44), KEY, LAYOUT, FrameFault.BAD_CHECKSUM),
    ("first payload byte corrupted", _flip(HEADER_BYTES), KEY, LAYOUT, FrameFault.BAD_CHECKSUM),
    ("last payload byte corrupted", _flip(-1), KEY, LAYOUT, FrameFault.BAD_CHECKSUM),
]


@pytest.mark.parametrize(("case", "mutate", "key", "layout", "fault"), CASES, ids=[c[0] for c in CASES])
def test_rejection(
    case: str,
    mutate: Callable[[torch.Tensor], int],
    key: str,
    layout: bytes,
    fault: FrameFault,
) -> None:
    frame = sealed(256)
    nbytes = mutate(frame)
    with pytest.raises(FrameError) as info:
        verify(frame, nbytes, key, layout)
    assert info.value.fault is fault, case
    assert info.value.key == key
    assert fault.value in str(info.value)


def test_frame_buffer_smaller_than_the_header_claims_is_truncated() -> None:
    frame = sealed(256)
    short = frame[: frame.numel() - 10].clone()
    with pytest.raises(FrameError) as info:
        verify(short, frame.numel(), KEY, LAYOUT)
    assert info.value.fault is FrameFault.TRUNCATED


@pytest.mark.parametrize("level", list(Integrity), ids=lambda i: i.value)
def test_every_verified_byte_is_guarded(level: Integrity) -> None:
    """Flipping any byte framing checks is rejected, the flags included; the reserved bytes
    carry no data. An unhashed frame (integrity "header") guards its header only: a flipped
    payload byte goes through, as documented."""
    unverified = set(range(48, HEADER_BYTES))
    original = sealed(64, integrity=level)
    if level is Integrity.HEADER:
        unverified |= set(range(HEADER_BYTES, original.numel()))
    for bit in (0x01, 0x80):
        for pos in range(original.numel()):
            frame = original.clone()
            frame[pos] ^= bit
            if pos in unverified:
                assert verify(frame, frame.numel(), KEY, LAYOUT, level).numel() == 64
            else:
                with pytest.raises(FrameError):
                    verify(frame, frame.numel(), KEY, LAYOUT, level)


def test_a_checksum_frame_is_the_format_of_every_earlier_release() -> None:
    """Integrity "checksum" writes version-1 frames with flags 0: what older releases wrote
    and read."""
    frame = sealed(100)
    version, flags = struct.unpack_from("<HH", frame.numpy().tobytes(), 4)
    assert (version, flags) == (FORMAT_VERSION, 0) == (1, 0)


def test_a_header_frame_says_it_is_unhashed() -> None:
    frame = sealed(100, integrity=Integrity.HEADER)
    version, flags = struct.unpack_from("<HH", frame.numpy().tobytes(), 4)
    checksum = struct.unpack_from("<Q", frame.numpy().tobytes(), 40)[0]
    assert (version, flags, checksum) == (UNHASHED_VERSION, 1, 0)


@pytest.mark.parametrize("writer", list(Integrity), ids=lambda i: f"written-{i.value}")
@pytest.mark.parametrize("reader", list(Integrity), ids=lambda i: f"read-{i.value}")
def test_cross_level_reads_go_by_the_header(writer: Integrity, reader: Integrity) -> None:
    """A hashed frame is checked against its checksum whatever the reader's level; an
    unhashed frame is accepted by a "header" reader and refused as ``unhashed`` by a
    "checksum" reader (never a silent pass)."""
    frame = sealed(256, integrity=writer)
    if writer is Integrity.HEADER and reader is Integrity.CHECKSUM:
        with pytest.raises(FrameError) as info:
            verify(frame, frame.numel(), KEY, LAYOUT, reader)
        assert info.value.fault is FrameFault.UNHASHED and "integrity 'header'" in str(info.value)
        return
    assert torch.equal(verify(frame, frame.numel(), KEY, LAYOUT, reader), payload_view(frame))
    frame[-1] ^= 0x10
    if writer is Integrity.CHECKSUM:  # the header says hashed: a "header" reader checks it too
        with pytest.raises(FrameError) as info:
            verify(frame, frame.numel(), KEY, LAYOUT, reader)
        assert info.value.fault is FrameFault.BAD_CHECKSUM
    else:
        verify(frame, frame.numel(), KEY, LAYOUT, reader)


@pytest.mark.parametrize("level", list(Integrity), ids=lambda i: i.value)
def test_scattered_frames_follow_the_same_levels(level: Integrity) -> None:
    """``seal_parts`` / ``seal_header`` make the frame ``seal`` makes at each level, and
    ``verify_parts`` reads it by its header."""
    whole = sealed(300, integrity=level)
    body = whole.numpy()[HEADER_BYTES:]
    pieces = [body[:100].copy(), body[100:].copy()]
    head = np.zeros(HEADER_BYTES, dtype=np.uint8)
    seal_parts(head, pieces, KEY, LAYOUT, level)
    assert bytes(head) == whole.numpy()[:HEADER_BYTES].tobytes()
    if level is Integrity.HEADER:
        bare = np.zeros(HEADER_BYTES, dtype=np.uint8)
        seal_header(bare, KEY, LAYOUT, 300, level)
        assert bytes(bare) == bytes(head)  # complete: nothing for a store to fill in
    verify_parts(head, whole.numel(), pieces, KEY, LAYOUT, integrity=Integrity.HEADER)
    if level is Integrity.HEADER:
        with pytest.raises(FrameError, match="unhashed"):
            verify_parts(head, whole.numel(), pieces, KEY, LAYOUT, integrity=Integrity.CHECKSUM)


@pytest.mark.parametrize("case", ["hashed flags set", "unhashed flags cleared", "unhashed with checksum",
                                  "unknown version"])
def test_inconsistent_version_flags_and_checksum_are_rejected(case: str) -> None:
    """Version, flags and checksum field must agree, so a damaged header cannot pass as an
    unhashed one (and skip the payload check)."""
    level = Integrity.CHECKSUM if case == "hashed flags set" else Integrity.HEADER
    frame = sealed(64, integrity=level)
    raw = frame.numpy()
    edits = {"hashed flags set": (6, struct.pack("<H", 1)), "unhashed flags cleared": (6, struct.pack("<H", 0)),
             "unhashed with checksum": (40, struct.pack("<Q", 12345)),
             "unknown version": (4, struct.pack("<H", 3))}
    at, data = edits[case]
    raw[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
    for reader in Integrity:
        with pytest.raises(FrameError) as info:
            verify(frame, frame.numel(), KEY, LAYOUT, reader)
        assert info.value.fault is FrameFault.BAD_VERSION


def test_an_unknown_level_names_the_setting() -> None:
    with pytest.raises(ValueError, match=r"X\.integrity must be one of \['checksum', 'header'\], got 'crc'"):
        Integrity.parse("crc", "X.integrity")
    assert Integrity.parse("header", "X") is Integrity.HEADER


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(128, dtype=torch.int8),
        torch.zeros(2, 64, dtype=torch.uint8),
        torch.zeros(256, dtype=torch.uint8)[::2],
    ],
    ids=["int8", "2-d", "strided"],
)
def test_frames_must_be_contiguous_uint8(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="contiguous uint8"):
        verify(bad, 128, KEY, LAYOUT)
