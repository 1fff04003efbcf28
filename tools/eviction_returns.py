"""The stress run's account of store evictions: how many evicted objects were asked for again,
per pool, and how soon (in the trace's own seconds, :class:`TraceClock`)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ..stores.base import Store
from ..stores.eviction_memory import EvictionMemory

#: the published figure's window: "most within five minutes"
SOON_S = 300.0


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


def _pool(suffix: str) -> str:
    return suffix.partition(":")[0] or "?"


def eviction_returns(store: Store, evictions: int) -> dict[str, Any]:
    """Per pool (the object key's ``:pool:`` part): evicted objects probed or touched again,
    their share of the evictions, the median delay and the share back within :data:`SOON_S`."""
    memory = eviction_memory(store)
    if memory is None:
        return {}
    by_pool: dict[str, list[tuple[float, bool]]] = {}
    for key, delay, touched in memory.returns:
        by_pool.setdefault(_pool(key.partition(":")[2]), []).append((delay, touched))
    evicted: dict[str, int] = {}
    for suffix, n in memory.evicted_by_suffix.items():
        evicted[_pool(suffix)] = evicted.get(_pool(suffix), 0) + n
    out: dict[str, Any] = {"evictions": evictions, "asked_again": len(memory.returns),
                           "asked_again_share": round(len(memory.returns) / evictions, 4) if evictions else 0.0,
                           "pools": {}}
    for pool, rows in sorted(by_pool.items()):
        delays = np.array([d for d, _ in rows])
        out["pools"][pool] = {
            "evicted": evicted.get(pool, 0),
            "asked_again": len(rows),
            "asked_again_share": round(len(rows) / evicted[pool], 4) if evicted.get(pool) else 0.0,
            "by_touch": sum(1 for _, t in rows if t),
            "median_delay_s": round(float(np.median(delays)), 1),
            "within_soon_share": round(float(np.mean(delays <= SOON_S)), 4),
        }
    return out


__all__ = ["SOON_S", "TraceClock", "eviction_memory", "eviction_returns"]
