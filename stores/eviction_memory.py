"""What a store's eviction cost: the evicted objects that were asked for again, and how soon.

A store that evicts by its own recency cannot tell a cold object from one the device keeps
hitting (its device hits reach the store only as TOUCH). :class:`EvictionMemory` remembers
the keys a store evicted and when (by the store's clock), and counts the evicted keys a later
probe (``exists``, ``get``) or touch named again: the first such call per eviction is counted,
per pool, with its delay (:class:`PoolReturns`), so an operator can read how many evictions
were of objects still in demand and how soon the demand came back. A key put again is
forgotten (the store holds it).

Bounded in bytes, not in keys: a server that runs for weeks evicts billions of keys (issue 53).
The remembered keys, and a uniform sample of the delays for the median, are held within
``budget_bytes`` (an estimate, :data:`ENTRY_BYTES` per key plus the key's own size; a test
checks it against ``tracemalloc``); past it the oldest evictions are forgotten and counted in
``dropped`` (a return of one of them is not seen). Nothing is kept per return: counts and the
sample. A budget of 0 turns the memory off (every call is a no-op).
"""

from __future__ import annotations

import math
import random
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable

import attrs

#: the default budget: a few MB of evicted keys (about 20,000 of hylinker's keys)
DEFAULT_BUDGET_BYTES = 4 << 20
#: bytes an ``OrderedDict`` entry costs beside its key: hash slot, linked-list node, float
ENTRY_BYTES = 120
#: delays sampled per pool for the median (a uniform reservoir sample: exact up to this many)
SAMPLE = 4096
#: pools named at most; further names count as ``"other"`` (a key whose second ``:`` part is
#: not a pool name must not grow the table)
MAX_POOLS = 16
#: "most within five minutes": returns at most this many seconds after their eviction
SOON_S = 300.0


def check_budget(value: object, name: str = "eviction_memory_bytes") -> int:
    """``value`` as a budget in bytes: an int >= 0, else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or value != int(value):
        raise ValueError(f"{name} must be a whole number of bytes >= 0 (0: off), got {value!r}")
    return int(value)


def key_pool(key: str) -> str:
    """The pool a key names: its part between the first and second ``:`` (hylinker's
    ``hash:pool:rank``), ``"?"`` when there is none."""
    return key.partition(":")[2].partition(":")[0] or "?"


@attrs.define
class PoolReturns:
    """One pool's evictions and the evicted objects asked for again (streaming counts)."""

    evicted: int = 0
    asked: int = 0
    touched: int = 0  # of ``asked``: named again by a touch
    soon: int = 0  # of ``asked``: within :data:`SOON_S` of their eviction
    #: a uniform sample of the delays (seconds), at most :data:`SAMPLE`
    delays: array[float] = attrs.field(factory=lambda: array("d"))

    def median_delay_s(self) -> float:
        return float(sorted(self.delays)[len(self.delays) // 2]) if self.delays else 0.0


class EvictionMemory:
    """Evicted keys and their eviction times, within a byte budget; the calls that named one
    again, counted per pool.

    Not thread-safe: the store calls it under its own lock.
    """

    def __init__(self, clock: Callable[[], float], budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self._clock = clock
        self.budget_bytes = check_budget(budget_bytes)
        self._evicted: OrderedDict[str, float] = OrderedDict()  # bounded: by budget_bytes, oldest first out
        self._key_bytes = 0
        self._sample_bytes = 0
        self._random = random.Random(0)  # the reservoir's draws: the same run, the same sample
        #: evictions forgotten to stay within the budget (their returns are not seen)
        self.dropped = 0
        #: per pool (:func:`key_pool`; at most :data:`MAX_POOLS` names, then ``"other"``)
        self.pools: dict[str, PoolReturns] = {}

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def bytes(self) -> int:
        """What the memory holds now, by its estimate (at most ``budget_bytes``)."""
        return self._key_bytes + self._sample_bytes

    @property
    def remembered(self) -> int:
        return len(self._evicted)

    @property
    def asked(self) -> int:
        return sum(p.asked for p in self.pools.values())

    def _pool(self, key: str) -> PoolReturns:
        name = key_pool(key)
        pool = self.pools.get(name)
        if pool is None:
            if len(self.pools) >= MAX_POOLS - 1:  # the last name is "other"
                name = "other"
                pool = self.pools.get(name)
            if pool is None:
                pool = self.pools[name] = PoolReturns()
        return pool

    def evicted(self, keys: Iterable[str]) -> None:
        if not self.enabled:
            return
        now = self._clock()
        remembered = self._evicted
        for key in keys:
            self._pool(key).evicted += 1
            old = remembered.pop(key, None)
            if old is None:
                self._key_bytes += sys.getsizeof(key) + ENTRY_BYTES
            remembered[key] = now
        while remembered and self.bytes > self.budget_bytes:
            key, _ = remembered.popitem(last=False)
            self._key_bytes -= sys.getsizeof(key) + ENTRY_BYTES
            self.dropped += 1

    def stored(self, key: str) -> None:
        """``key`` was put again: later calls naming it find it."""
        if self._evicted.pop(key, None) is not None:
            self._key_bytes -= sys.getsizeof(key) + ENTRY_BYTES

    def asked_again(self, key: str, *, touched: bool = False) -> int:
        """A probe (or, ``touched``, a touch) named ``key``, which the store does not hold:
        1 if it was evicted and not asked for since (counted), else 0."""
        at = self._evicted.pop(key, None)
        if at is None:
            return 0
        self._key_bytes -= sys.getsizeof(key) + ENTRY_BYTES
        delay = self._clock() - at
        pool = self._pool(key)
        pool.asked += 1
        pool.touched += touched
        pool.soon += delay <= SOON_S
        if len(pool.delays) < SAMPLE and self.bytes + pool.delays.itemsize <= self.budget_bytes:
            pool.delays.append(delay)
            self._sample_bytes += pool.delays.itemsize
        elif pool.delays:  # reservoir sampling: each delay so far kept with the same chance
            slot = self._random.randrange(pool.asked)
            if slot < len(pool.delays):
                pool.delays[slot] = delay
        return 1


__all__ = ["DEFAULT_BUDGET_BYTES", "ENTRY_BYTES", "MAX_POOLS", "SAMPLE", "SOON_S", "EvictionMemory",
           "PoolReturns", "check_budget", "key_pool"]
