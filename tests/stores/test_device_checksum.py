"""The device checksum (``stores/device_checksum.py``): equal to a plain-Python reference on
CPU, sensitive to the damage it must catch, and (``cuda`` tests, run where torch sees a GPU)
equal on CPU and CUDA and catching a corrupt object on the device."""

from __future__ import annotations

import pytest
import torch

from hylinker.stores import device_checksum as dc
from hylinker.stores.device_checksum import P, device_checksum, device_checksums, verify_on_device


def reference(data: bytes) -> int:
    """The definition in the module doc, with Python integers and no torch."""
    data = data + b"\0" * (-len(data) % 4)
    a = b = 0
    for i in range(len(data) // 4):
        w = int.from_bytes(data[4 * i: 4 * i + 4], "little")
        a = (a + w % P) % P
        b = (b + ((i + 1) % P) * (w % P) % P) % P
    return (a << 32) | b


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 63, 64, 1000, 4096 + 2])
def test_equals_the_reference(n: int) -> None:
    data = _bytes(n, n)
    assert device_checksum(data) == reference(bytes(data.tolist()))


def test_extreme_words_equal_the_reference() -> None:
    """All-ones words (2**32 - 1, above p) and words equal to p: the unsigned reading and the
    modulus hold at the edges."""
    for word in (0xFFFFFFFF, P, P + 1, 1 << 31):
        data = torch.tensor(list(word.to_bytes(4, "little")) * 257, dtype=torch.uint8)
        assert device_checksum(data) == reference(bytes(data.tolist()))


def test_chunked_reduction_equals_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reduced in several chunks (positions carried across them), the value is the same."""
    data = _bytes(4 * 37 + 2, 9)
    whole = device_checksum(data)
    monkeypatch.setattr(dc, "CHUNK_WORDS", 5)
    assert device_checksum(data) == whole == reference(bytes(data.tolist()))


def test_rows_are_checksummed_separately_and_unaligned_views_work() -> None:
    frames = torch.stack([_bytes(64 + 300, s) for s in range(4)])
    sums = device_checksums(frames[:, 64:])
    assert sums.shape == (4,) and sums.dtype == torch.int64
    assert [int(x) for x in sums] == [reference(bytes(f[64:].tolist())) for f in frames]
    odd = _bytes(101, 3)[1:]  # starts one byte into its storage
    assert device_checksum(odd) == reference(bytes(odd.tolist()))


def test_catches_a_flipped_bit_anywhere_and_swapped_words() -> None:
    data = _bytes(256, 4)
    good = device_checksum(data)
    for pos in range(0, 256, 7):
        for bit in (0x01, 0x80):
            bad = data.clone()
            bad[pos] ^= bit
            assert device_checksum(bad) != good
    swapped = data.clone()
    swapped[0:4], swapped[4:8] = data[4:8].clone(), data[0:4].clone()
    assert not torch.equal(data[0:4], data[4:8]) and device_checksum(swapped) != good


def test_verify_on_device_marks_the_corrupt_rows() -> None:
    frames = torch.stack([_bytes(512, s) for s in range(3)])
    expected = device_checksums(frames)
    frames[1, 100] ^= 0x10
    assert verify_on_device(frames, expected).tolist() == [True, False, True]


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="uint8"):
        device_checksums(torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="shape"):
        device_checksums(torch.zeros(2, 2, 2, dtype=torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 4096 + 3, (1 << 20) + 64])
def test_cuda_value_equals_the_cpu_value(n: int) -> None:
    data = _bytes(n, n)
    frames = torch.stack([data, data.flip(0)])
    assert device_checksum(data.cuda()) == device_checksum(data)
    assert device_checksums(frames.cuda()).cpu().tolist() == device_checksums(frames).tolist()


@pytest.mark.cuda
def test_cuda_catches_a_corrupt_object_on_the_device() -> None:
    """Payloads land in device rows; their checksums, taken on the host when written, are
    checked on the device: the one damaged in transit is marked, the others pass."""
    host = torch.stack([_bytes(64 << 10, s) for s in range(4)])
    expected = device_checksums(host)  # what a writer records
    rows = host.cuda()
    rows[2, 12345] ^= 0x04  # damaged on the way into the device rows
    ok = verify_on_device(rows, expected.cuda())
    assert ok.device.type == "cuda" and ok.cpu().tolist() == [True, True, False, True]
