"""A payload checksum computed with torch integer ops, so it runs where the bytes are (CPU or
CUDA) and gives the same value on both.

XXH3 (the checksum of host pools' frames, ``stores/framing.py``) runs on the host only. This
checksum is built for device pools: it is the checksum of version-3 frames (``stores/framing.py``), computed on the
copy stream over the rows (``runtime/dataplane/device_transfers.py``), so a store that reads and writes
device memory directly never brings the bytes to the host, and a staged device pool needs no
host hash pass (docs/design/runtime.md §4, §5).

Definition. The payload is read as little-endian unsigned 32-bit words ``w_0 .. w_{m-1}`` (the
last word zero-padded); with the Mersenne prime ``p = 2**31 - 1``::

    A = (sum_i w_i mod p) mod p
    B = (sum_i ((i + 1) mod p) * (w_i mod p) mod p) mod p
    checksum = (A << 32) | B   (a 63-bit value; 0 <= A, B < p)

Every product is below ``2**62`` and every partial sum of at most :data:`CHUNK_WORDS` terms
below ``2**63``, so int64 arithmetic never overflows and the integer sums are exact whatever
order a device reduces them in: the value is deterministic and equal on CPU and CUDA. It
catches any change of one word (``A`` moves unless the word changed by a multiple of ``p``,
which needs at least two flipped bits) and the exchange of two differing words (``B`` weighs
each word by its position).
"""

from __future__ import annotations

import torch

P = (1 << 31) - 1
"""The modulus: the Mersenne prime 2**31 - 1."""
CHUNK_WORDS = 1 << 22
"""Words reduced per step over all rows together (16 MiB of payload): bounds each int64
temporary to 32 MiB however many rows a batch has."""


def device_checksums(payloads: torch.Tensor) -> torch.Tensor:
    """The checksum of each row of ``payloads`` (``[n, nbytes]`` or ``[nbytes]`` uint8, on any
    device), as an int64 tensor ``[n]`` (or a 0-dim one) on the same device. No host sync."""
    if payloads.dtype != torch.uint8:
        raise ValueError(f"payloads are uint8 tensors, got {payloads.dtype}")
    if payloads.dim() not in (1, 2):
        raise ValueError(f"payloads are [nbytes] or [n, nbytes], got shape {tuple(payloads.shape)}")
    single = payloads.dim() == 1
    rows = payloads.reshape(1, -1) if single else payloads
    n, nbytes = rows.shape
    pad = -nbytes % 4
    if pad:
        rows = torch.cat([rows, rows.new_zeros((n, pad))], dim=1)
    if rows.shape[1] == 0:  # empty payloads: A = B = 0
        zero = torch.zeros(n, dtype=torch.int64, device=rows.device)
        return zero[0] if single else zero
    rows = rows.contiguous()
    if rows.storage_offset() % 4:
        rows = rows.clone()  # an int32 view needs a 4-byte aligned start
    words = rows.view(torch.int32)  # [n, m]: little endian on CPU and CUDA alike
    m = words.shape[1]
    a_sum = torch.zeros(n, dtype=torch.int64, device=rows.device)
    b_sum = torch.zeros(n, dtype=torch.int64, device=rows.device)
    step = max(1, CHUNK_WORDS // n)
    for lo in range(0, m, step):
        w = (words[:, lo:lo + step].to(torch.int64) & 0xFFFFFFFF) % P  # unsigned word mod p
        pos = torch.arange(lo + 1, lo + 1 + w.shape[1], dtype=torch.int64, device=rows.device) % P
        a_sum = (a_sum + w.sum(dim=1)) % P
        b_sum = (b_sum + ((w * pos) % P).sum(dim=1)) % P
    out = (a_sum << 32) | b_sum
    return out[0] if single else out


def device_checksum(payload: torch.Tensor) -> int:
    """:func:`device_checksums` of one payload, as a Python int (syncs with its device)."""
    return int(device_checksums(payload.reshape(-1)).item())


def verify_on_device(payloads: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Which rows of ``payloads`` match their ``expected`` checksums (int64 ``[n]``, on the
    payloads' device): a bool tensor ``[n]`` on that device, computed there."""
    got = device_checksums(payloads)
    return got == expected.to(device=got.device, dtype=torch.int64)


__all__ = ["CHUNK_WORDS", "P", "device_checksum", "device_checksums", "verify_on_device"]
