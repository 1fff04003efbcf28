"""The embedded store's copy routines: plain copies between caller buffers and slots, and the
checksumming copies of ``put_sealed`` / ``get_checked`` (:func:`~hylinker.stores.framing.copy_checksummed`),
plus the buffer checks of the scatter-gather calls. They run on the event loop for small
batches and in the store's worker threads for large ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .base import check_buffers
from .framing import HEADER_BYTES, copy_checksummed, set_checksum


class Sized:
    """Stands for an object made of several buffers where only its size matters."""

    def __init__(self, nbytes: int) -> None:
        self._n = nbytes

    def numel(self) -> int:
        return self._n


def check_parts(keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Any]:
    """Check every buffer like ``check_buffers``; one size stand-in per object."""
    if len(keys) != len(parts):
        raise ValueError(f"{len(keys)} keys but {len(parts)} part lists")
    sized: list[Any] = []
    every_key: list[str] = []
    every_buffer: list[torch.Tensor] = []
    for key, ps in zip(keys, parts):
        if not ps:
            raise ValueError(f"no buffers for {key!r}")
        every_key.extend([key] * len(ps))
        every_buffer.extend(ps)
    check_buffers(every_key, every_buffer)  # one pass over the batch, not one call per object
    for ps in parts:
        sized.append(Sized(sum(p.numel() for p in ps)))
    return sized


def check_sealed(keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Any]:
    """:func:`_check_parts`, and every object's first part is a 64-byte frame header."""
    sized = check_parts(keys, parts)
    for key, ps in zip(keys, parts):
        if ps[0].numel() != HEADER_BYTES:
            raise ValueError(f"the first part for {key!r} must be a {HEADER_BYTES}-byte frame header, "
                             f"got {ps[0].numel()} bytes")
    return sized


def into_slot(dst: np.ndarray, parts: Sequence[torch.Tensor], off: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Put side: ``parts`` laid end to end in slot memory ``dst`` from byte ``off``, as
    (targets in the slot, sources)."""
    targets: list[np.ndarray] = []
    sources: list[np.ndarray] = []
    for p in parts:
        n = p.numel()
        targets.append(dst[off:off + n])
        sources.append(p.numpy())
        off += n
    return targets, sources


def out_of_slot(src: np.ndarray, nbytes: int, parts: Sequence[torch.Tensor],
                off: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Get side: an object of ``nbytes`` in slot memory ``src``, from byte ``off``, read into
    ``parts`` in order, as (targets in the parts, sources in the slot); stops where the
    object ends."""
    targets: list[np.ndarray] = []
    sources: list[np.ndarray] = []
    for p in parts:
        n = min(p.numel(), nbytes - off)
        if n <= 0:
            break
        targets.append(p.numpy()[:n])
        sources.append(src[off:off + n])
        off += n
    return targets, sources


# (header target, header source, payload targets, payload sources) of one object
Frame = tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]


def seal_all(frames: list[Frame]) -> None:
    """Put side: copy each payload checksumming the landed bytes, then write its header with
    that checksum (a reader never sees a checksum that the bytes before it do not match)."""
    for head_dst, head_src, targets, sources in frames:
        digest = copy_checksummed(targets, sources)
        np.copyto(head_dst, head_src, casting="no")
        set_checksum(head_dst, digest)


def land_all(frames: list[Frame]) -> list[int]:
    """Get side: copy each header and payload; the checksum of each payload as it landed."""
    digests: list[int] = []
    for head_dst, head_src, targets, sources in frames:
        np.copyto(head_dst, head_src, casting="no")
        digests.append(copy_checksummed(targets, sources))
    return digests


def copy_all(targets: list[np.ndarray], sources: list[np.ndarray]) -> None:
    for dst, src in zip(targets, sources, strict=True):
        np.copyto(dst, src, casting="no")
