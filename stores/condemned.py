"""Removing an object a reader proved bad, and only that object.

A store shared by several engines is shared trust: a reader removes an object only when it
proved the object bad itself, i.e. the object failed verification again after the re-read
(``runtime/dataplane/store_calls.py::check_landed``). A failed, timed-out, unreachable or cancelled
read, or a load error, proves nothing about the object and removes nothing.

And a removal names the exact object condemned. Between a reader's verification and its
remove another engine may have removed the bad object and written a good one under the same
key; removing by key alone would delete that good object. So the reader keeps what it read of
the condemned object (:class:`Condemned`: its size and its first bytes, the 64-byte header,
which holds the key digest, length and payload checksum), and :func:`remove_condemned` removes
a key only while the store still holds an object of that size beginning with those bytes:

* A store that can compare and remove in one step (:class:`ConditionalRemoveStore`: the
  embedded store, under its index lock) does exactly that, atomically.
* Any other store (Mooncake, wrappers) is read again (one get of the condemned size), compared,
  and the matching keys removed. Residual race, accepted and documented in ``docs/design.md``:
  a rewrite that lands between that get and the remove is deleted; the window is one store
  round trip, and the cost is one recompute of that object (never a wrong restore: a reader
  verifies what it loads). A rewrite whose header equals the condemned one byte for byte
  (same key, length and checksum) counts as the condemned object."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
import torch

from .base import Outcome, Store
from .framing import HEADER_BYTES


@attrs.frozen
class Condemned:
    """An object a reader proved bad: its size as the store reported it, the first bytes the
    reader read of it (its header, at most 64 bytes) and the fault it failed with."""

    nbytes: int
    header: bytes
    fault: str

    @classmethod
    def of(cls, nbytes: int, landed: np.ndarray, fault: str) -> Condemned:
        """From the 1-D uint8 buffer the object's first bytes landed in."""
        return cls(nbytes, landed[:min(HEADER_BYTES, max(nbytes, 0))].tobytes(), fault)

    def matches(self, nbytes: int, head: bytes) -> bool:
        """Whether a stored object of ``nbytes`` beginning with ``head`` is the condemned one."""
        return nbytes == self.nbytes and head[:len(self.header)] == self.header


@runtime_checkable
class ConditionalRemoveStore(Store, Protocol):
    """A store that removes ``keys[i]`` only while it holds the object ``condemned[i]`` names,
    comparing and removing in one atomic step; returns how many it removed."""

    async def remove_if(self, keys: Sequence[str], condemned: Sequence[Condemned]) -> int: ...


async def remove_condemned(store: Store, condemned: Mapping[str, Condemned]) -> int:
    """Remove each key of ``condemned`` while the store still holds that exact object (see the
    module doc); returns how many were removed. Store errors propagate (the caller logs them:
    nothing is removed that was not compared)."""
    if not condemned or not store.capabilities.remove:
        return 0
    keys = list(condemned)
    if isinstance(store, ConditionalRemoveStore):
        return await store.remove_if(keys, [condemned[k] for k in keys])
    return await compare_then_remove(store, keys, [condemned[k] for k in keys])


async def compare_then_remove(store: Store, keys: Sequence[str], condemned: Sequence[Condemned]) -> int:
    """The non-atomic :meth:`ConditionalRemoveStore.remove_if`: read each object (one get of its
    condemned size), compare, remove the ones that match (the residual race: module doc)."""
    buffers = [torch.empty(max(c.nbytes, 1), dtype=torch.uint8) for c in condemned]
    results = await store.get(keys, buffers)
    same = [k for k, c, b, r in zip(keys, condemned, buffers, results, strict=True)
            if r.outcome is Outcome.OK and c.matches(r.nbytes, b[:HEADER_BYTES].numpy().tobytes())]
    return await store.remove(same) if same else 0
