"""The stress run's account of store evictions: how many evicted objects were asked for again,
per pool, and how soon (in the trace's own seconds, :class:`TraceClock`)."""

from __future__ import annotations

from typing import Any

import attrs

from ..stores.base import Store
from ..stores.eviction_memory import SOON_S, EvictionMemory


@attrs.define
class TraceClock:
    """The replay's simulated time: the arrival (trace seconds) of the latest request started.
    The embedded store stamps its evictions with it, so delays read in trace time even when
    the replay compresses hours into a minute."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def reached(self, arrival_s: float) -> None:
        self.now = max(self.now, arrival_s)


def eviction_memory(store: Store) -> EvictionMemory | None:
    """The eviction memory of ``store`` or of the store a wrapper forwards to; None if none."""
    seen: Any = store
    for _ in range(8):
        memory = getattr(seen, "evictions_memory", None)
        if isinstance(memory, EvictionMemory):
            return memory
        seen = getattr(seen, "inner", None)
        if seen is None:
            return None
    return None


def eviction_returns(store: Store, evictions: int) -> dict[str, Any]:
    """Per pool (the object key's ``:pool:`` part): evicted objects probed or touched again,
    their share of the evictions, the median delay (of a sample past
    ``eviction_memory.SAMPLE``) and the share back within :data:`SOON_S`; ``forgotten``: the
    evictions the memory's byte budget dropped (their returns are not counted)."""
    memory = eviction_memory(store)
    if memory is None or not memory.enabled:
        return {}
    asked = memory.asked
    out: dict[str, Any] = {"evictions": evictions, "asked_again": asked,
                           "asked_again_share": round(asked / evictions, 4) if evictions else 0.0,
                           "forgotten": memory.dropped, "pools": {}}
    for pool, r in sorted(memory.pools.items()):
        if not r.asked:
            continue
        out["pools"][pool] = {
            "evicted": r.evicted,
            "asked_again": r.asked,
            "asked_again_share": round(r.asked / r.evicted, 4) if r.evicted else 0.0,
            "by_touch": r.touched,
            "median_delay_s": round(r.median_delay_s(), 1),
            "within_soon_share": round(r.soon / r.asked, 4),
        }
    return out


__all__ = ["SOON_S", "TraceClock", "eviction_memory", "eviction_returns"]
