"""SGLang's offloads in flight, and the bound that refuses beyond it. Imports no SGLang.

SGLang locks a node's rows for each offload the linker accepts, until the linker reports that
offload's result (one result per accepted offload, in submission order, popped by SGLang every
round). A store that stops draining would otherwise pile up accepted offloads, each holding its
rows (and one data-plane task) — 2,000 behind a queue of depth 4 in issue 42. :class:`OffloadBound`
keeps the results FIFO and refuses an offload once ``max_count`` offloads, or ``max_bytes`` of
their payload, are in flight; SGLang then unlocks the node at once, which stays on the device,
unpersisted, and is offered again on its next hit.

Every tensor-parallel rank takes the same decision: "in flight" is accepted and not yet popped,
SGLang pops the count all ranks agreed on (a MIN over ranks), and the bytes are what the
offload names on every rank alike (:func:`named_bytes`), so the ranks' FIFOs stay aligned.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

from ...components.layout import PoolKind

_KINDS = {kind.value: kind for kind in PoolKind}


def named_bytes(transfers: Sequence[Any], payload: Mapping[PoolKind, int]) -> int:
    """The payload bytes SGLang's offload transfers name (``payload``: bytes per object of each
    pool this linker holds; a DRAFT sidecar rides on the KV pages)."""
    total = 0
    for t in transfers:
        kind = _KINDS.get(str(getattr(t.name, "value", t.name)))
        if kind is None or kind not in payload or not t.keys:
            continue
        total += len(t.keys) * payload[kind]
        if kind is PoolKind.FULL:
            total += len(t.keys) * payload.get(PoolKind.DRAFT, 0)
    return total


class OffloadBound:
    """The results FIFO of accepted offloads and the bound on it; see the module doc."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.results: collections.deque[concurrent.futures.Future[bool]] = collections.deque()
        self._bytes: collections.deque[int] = collections.deque()
        self.bytes = 0  # payload bytes in flight
        self.peak = 0
        self.peak_bytes = 0

    def refuses(self, nbytes: int) -> bool:
        """Whether an offload of ``nbytes`` would pass the bound (one alone may pass the bytes)."""
        held = len(self.results)
        return held >= self.max_count or (held > 0 and self.bytes + nbytes > self.max_bytes)

    def accept(self, nbytes: int) -> concurrent.futures.Future[bool]:
        """An accepted offload's result, last in the FIFO."""
        result: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self.results.append(result)
        self._bytes.append(nbytes)
        self.bytes += nbytes
        self.peak = max(self.peak, len(self.results))
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return result

    def completed(self) -> int:
        """How many results at the head of the FIFO are ready."""
        n = 0
        for f in self.results:
            if not f.done():
                break
            n += 1
        return n

    def pop(self) -> bool:
        """The oldest result (ready: SGLang pops only what :meth:`completed` counted)."""
        self.bytes -= self._bytes.popleft()
        return self.results.popleft().result()

    def clear(self) -> None:
        self.results.clear()
        self._bytes.clear()
        self.bytes = 0

    def figures(self) -> dict[str, int]:
        """The bound's state, as ``SGLangLinkerStatistics`` fields."""
        return {"offloads_in_flight": len(self.results), "offload_bytes_in_flight": self.bytes,
                "offloads_in_flight_peak": self.peak, "offload_bytes_in_flight_peak": self.peak_bytes}


__all__ = ["OffloadBound", "named_bytes"]
