"""What a store's eviction cost: the evicted objects that were asked for again, and how soon.

A store that evicts by its own recency cannot tell a cold object from one the device keeps
hitting (its device hits reach the store only as TOUCH). :class:`EvictionMemory` remembers
the keys a store evicted and when (by the store's clock), and counts the evicted keys a later
probe (``exists``, ``get``) or touch named again: the first such call per eviction is counted
and its delay kept, so an operator can read how many evictions were of objects still in
demand and how soon the demand came back. A key put again is forgotten (the store holds it).
Bounded: past ``limit`` remembered keys the oldest evictions are forgotten uncounted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

#: evicted keys remembered at most (about 100 bytes each)
DEFAULT_LIMIT = 1 << 22


class EvictionMemory:
    """Evicted keys and their eviction times; the calls that named one again.

    Not thread-safe: the store calls it under its own lock.
    """

    def __init__(self, clock: Callable[[], float], limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._clock = clock
        self._limit = limit
        self._evicted: OrderedDict[str, float] = OrderedDict()
        #: (key, seconds from its eviction to the first probe or touch naming it, touched)
        self.returns: list[tuple[str, float, bool]] = []
        #: evictions by the part of the key after its first ``:`` (hylinker's ``pool:rank``)
        self.evicted_by_suffix: dict[str, int] = {}

    def evicted(self, keys: Iterable[str]) -> None:
        now = self._clock()
        by_suffix = self.evicted_by_suffix
        for key in keys:
            suffix = key.partition(":")[2]
            by_suffix[suffix] = by_suffix.get(suffix, 0) + 1
            self._evicted[key] = now
            self._evicted.move_to_end(key)
        while len(self._evicted) > self._limit:
            self._evicted.popitem(last=False)

    def stored(self, key: str) -> None:
        """``key`` was put again: later calls naming it find it."""
        self._evicted.pop(key, None)

    def asked(self, key: str, *, touched: bool = False) -> int:
        """A probe (or, ``touched``, a touch) named ``key``, which the store does not hold:
        1 if it was evicted and not asked for since (recorded), else 0."""
        at = self._evicted.pop(key, None)
        if at is None:
            return 0
        self.returns.append((key, self._clock() - at, touched))
        return 1


__all__ = ["DEFAULT_LIMIT", "EvictionMemory"]
