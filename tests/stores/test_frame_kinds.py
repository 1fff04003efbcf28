"""Frame kinds (``stores/framing.py``): XXH3 (version 1), none (version 2) and the device
checksum (version 3) each are one (version, flags) pair, so no damaged byte changes the kind of
check; host frames keep their bytes; a host reader verifies a device-summed frame with the
device's function on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hylinker.stores import framing
from hylinker.stores.device_checksum import device_checksum
from hylinker.stores.framing import HEADER_BYTES, Checksum, Integrity


def _header(kind: Checksum) -> np.ndarray:
    frame = np.zeros(HEADER_BYTES + 40, dtype=np.uint8)
    frame[HEADER_BYTES:] = np.arange(40, dtype=np.uint8)
    if kind is Checksum.DEVICE:
        framing.seal_device(frame, "k", b"layout!!", 40, device_checksum(torch.from_numpy(frame[HEADER_BYTES:])))
    else:
        framing.seal_array(frame, "k", b"layout!!", Integrity.CHECKSUM if kind is Checksum.XXH3 else Integrity.HEADER)
    return frame


@pytest.mark.parametrize("kind", list(Checksum), ids=lambda c: c.name)
def test_no_one_damaged_header_byte_changes_the_kind_of_check(kind: Checksum) -> None:
    """Every single-byte change of every header byte, read by the most lenient reader
    ("header"): refused, or read as the same kind. Version and flags must agree, so turning a
    frame into another kind takes two bytes."""
    frame = _header(kind)
    assert framing.read_header(frame, frame.shape[0], 40, "k", b"layout!!", Integrity.HEADER)[0] is kind
    for pos in range(HEADER_BYTES):
        for value in range(256):
            if value == frame[pos]:
                continue
            bad = frame.copy()
            bad[pos] = value
            try:
                got, _ = framing.read_header(bad, bad.shape[0], 40, "k", b"layout!!", Integrity.HEADER)
            except framing.FrameError:
                continue
            assert got is kind, (pos, value)
    for other in set(Checksum) - {kind}:  # version and flags both set: the other kind (2 bytes)
        bad = frame.copy()
        bad[4], bad[6] = other.value[0], other.value[1]
        if other is Checksum.NONE:
            bad[framing.CHECKSUM_OFFSET:framing.CHECKSUM_OFFSET + 8] = 0
        assert framing.read_header(bad, bad.shape[0], 40, "k", b"layout!!", Integrity.HEADER)[0] is other


def test_host_frames_are_byte_for_byte_those_of_earlier_releases() -> None:
    """Version 1 (XXH3) and version 2 (unhashed) headers, packed by hand from the format."""
    import hashlib
    import struct

    import xxhash

    payload = np.arange(300, dtype=np.uint16).view(np.uint8)
    digest = hashlib.blake2b(b"k", digest_size=16).digest()
    for level, version, flags, checksum in ((Integrity.CHECKSUM, 1, 0, xxhash.xxh3_64_intdigest(payload.data)),
                                            (Integrity.HEADER, 2, 1, 0)):
        frame = np.zeros(HEADER_BYTES + payload.shape[0], dtype=np.uint8)
        frame[HEADER_BYTES:] = payload
        framing.seal_array(frame, "k", b"layout!!", level)
        assert frame[:HEADER_BYTES].tobytes() == struct.pack(
            "<4sHH8s16sQQ16s", b"HYLK", version, flags, b"layout!!", digest, payload.shape[0], checksum, bytes(16))


def test_a_host_reader_verifies_a_device_summed_frame_with_the_same_function() -> None:
    frame = _header(Checksum.DEVICE)
    payload = framing.verify_array(frame, frame.shape[0], "k", b"layout!!", room=40)
    assert payload.tobytes() == bytes(range(40))
    pieces = [frame[HEADER_BYTES:HEADER_BYTES + 13], frame[HEADER_BYTES + 13:]]
    framing.verify_parts(frame[:HEADER_BYTES], frame.shape[0], pieces, "k", b"layout!!",
                         landed_checksum=12345)  # an XXH3 a checksumming store reported: not used
    frame[-1] ^= 1
    with pytest.raises(framing.FrameError, match="bad_checksum"):
        framing.verify_array(frame, frame.shape[0], "k", b"layout!!", integrity=Integrity.HEADER, room=40)
