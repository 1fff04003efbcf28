"""Object framing: round trip, and every way a stored object is rejected."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

import pytest
import torch

from hylinker.stores.framing import (
    FORMAT_VERSION,
    HEADER_BYTES,
    FrameError,
    FrameFault,
    framed_size,
    payload_view,
    seal,
    verify,
)

LAYOUT = hashlib.sha256(b"test-framing-layout").digest()
OTHER_LAYOUT = hashlib.sha256(b"another-layout").digest()
KEY = "page/0123abcd/kv/tp0"


def sealed(payload_bytes: int = 256, key: str = KEY, seed: int = 0) -> torch.Tensor:
    frame = torch.empty(framed_size(payload_bytes), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    payload_view(frame).copy_(torch.randint(0, 256, (payload_bytes,), dtype=torch.uint8, generator=gen))
    seal(frame, key, LAYOUT)
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


def test_every_verified_byte_is_guarded() -> None:
    """Flipping any byte framing checks is rejected; flags and reserved bytes carry no data."""
    unverified = set(range(6, 8)) | set(range(48, HEADER_BYTES))
    original = sealed(64)
    for pos in range(original.numel()):
        frame = original.clone()
        frame[pos] ^= 0x01
        if pos in unverified:
            assert torch.equal(verify(frame, frame.numel(), KEY, LAYOUT), payload_view(original))
        else:
            with pytest.raises(FrameError):
                verify(frame, frame.numel(), KEY, LAYOUT)


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
