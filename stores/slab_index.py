"""The embedded store's slab and capacity accounting: which key holds which slot, and room.

:class:`SlabIndex` owns the size classes (``stores/slabs.py``), the index of keys to slots (in
LRU order, oldest first), the puts still copying, the slots being read (pins) and the slots
removed while read (freed when their last read ends). It plans a batch under its lock (reserve
or pin slots, evicting least-recently-used objects for room) and publishes it after the copy;
the copies themselves run outside the lock, in :class:`~hylinker.stores.embedded.EmbeddedStore`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .base import GetResult, Outcome, new_counters
from .eviction_memory import EvictionMemory
from .slabs import SizeClass

SLOT_ALIGN = 64
"""Slot sizes are multiples of this many bytes (keeps every object 64-byte aligned)."""

# (size class, slot id, object bytes)
Loc = tuple[int, int, int]
Put = tuple[int, str, Loc]  # (caller's index, key, slot) of a planned put
Get = tuple[int, Loc]  # (caller's index, slot) of a planned get


class SlabIndex:
    """Keys to slots, LRU order and capacity of one embedded store (see the module docstring).

    ``capacity_bytes`` bounds the slot bytes held; ``chunk_bytes`` is the slab chunk size. Every
    attribute is read and written under :attr:`lock` (the store's copies aside, which only touch
    slots reserved or pinned here).
    """

    def __init__(self, capacity_bytes: int, chunk_bytes: int, evictions_memory: EvictionMemory) -> None:
        self.capacity = capacity_bytes
        self.chunk_bytes = chunk_bytes
        self.lock = threading.Lock()
        self.classes: list[SizeClass] = []
        self.class_of: dict[int, int] = {}  # slot bytes -> size class number
        self.index: OrderedDict[str, Loc] = OrderedDict()  # LRU order: oldest first
        self.pending: dict[str, Loc] = {}  # puts still copying
        self.pins: dict[tuple[int, int], int] = {}  # (class, slot) -> reads in flight
        self.doomed: set[tuple[int, int]] = set()  # removed while pinned; free on unpin
        self.used = 0
        self.allocated = 0  # chunk memory held, all size classes
        self.stats = new_counters()
        self.evictions_memory = evictions_memory
        self.on_evict: Callable[[list[str]], None] | None = None

    def allocated_bytes(self) -> int:
        """Bytes of slab chunk memory held now (>= used bytes; chunk granularity)."""
        with self.lock:
            held = sum(c.allocated_bytes() for c in self.classes)
            assert held == self.allocated
            return held

    def clear(self) -> None:
        """Forget every object and give back the chunk memory (the store closed)."""
        with self.lock:
            self.index.clear()
            self.classes.clear()
            self.class_of.clear()
            self.used = 0
            self.allocated = 0

    def plan_put(
        self, keys: Sequence[str], buffers: Sequence[Any]
    ) -> tuple[list[Outcome], list[tuple[int, str, Loc]]]:
        outcomes = [Outcome.FAILED] * len(keys)
        plan: list[tuple[int, str, Loc]] = []
        seen: set[str] = set()
        with self.lock:
            for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
                if key in self.index or key in self.pending or key in seen:
                    outcomes[i] = Outcome.EXISTS
                    self.stats["put_exists"] += 1
                    continue
                seen.add(key)
                nbytes = buf.numel()
                slot_bytes = self.slot_bytes_of(nbytes)
                if slot_bytes > self.capacity or not self.make_room(slot_bytes):
                    outcomes[i] = Outcome.FULL
                    self.stats["put_failures"] += 1
                    continue
                cls = self.class_for(slot_bytes)
                loc = (cls, self.allocate(cls), nbytes)
                self.used += slot_bytes
                self.pending[key] = loc
                plan.append((i, key, loc))
                outcomes[i] = Outcome.OK
        return outcomes, plan

    def finish_put(self, plan: list[tuple[int, str, Loc]], copied: bool) -> None:
        """Publish copied puts (most recently used); give back the slots of failed ones."""
        with self.lock:
            for _, key, loc in plan:
                del self.pending[key]
                if copied:
                    self.index[key] = loc
                    self.evictions_memory.stored(key)
                    self.stats["puts"] += 1
                    self.stats["put_bytes"] += loc[2]
                else:
                    self.drop(loc)
                    self.stats["put_failures"] += 1

    @staticmethod
    def slot_bytes_of(nbytes: int) -> int:
        return max(SLOT_ALIGN, -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN)

    def class_for(self, slot_bytes: int) -> int:
        cls = self.class_of.get(slot_bytes)
        if cls is None:
            cls = len(self.classes)
            self.classes.append(SizeClass(slot_bytes, self.chunk_bytes))
            self.class_of[slot_bytes] = cls
        return cls

    def allocate(self, cls: int) -> int:
        """A free slot of ``cls``; before growing, give back other classes' empty chunks."""
        return self.allocate_many(cls, 1)[0]

    def allocate_many(self, cls: int, k: int) -> list[int]:
        """``k`` free slots of ``cls``, a chunk at a time (``SizeClass.take``); before growing,
        other classes' empty chunks are given back while the memory held would exceed the
        capacity."""
        size_class = self.classes[cls]
        out: list[int] = []
        while len(out) < k:
            if not size_class.has_free_slot():
                for other in self.classes:
                    while self.allocated + size_class.chunk_bytes > self.capacity:
                        freed = other.free_empty_chunk() if other is not size_class else 0
                        if not freed:
                            break
                        self.allocated -= freed
            got, grown = size_class.take(k - len(out))
            self.allocated += grown
            out += got
        return out

    def release(self, cls: int, slot: int) -> None:
        """Free a slot; keep its chunk if emptied, unless memory held exceeds the capacity."""
        size_class = self.classes[cls]
        size_class.release(slot)
        self.used -= size_class.slot_bytes
        while self.allocated > self.capacity:
            freed = size_class.free_empty_chunk()
            if not freed:
                break
            self.allocated -= freed

    def make_room(self, slot_bytes: int) -> bool:
        """Evict LRU objects (never one being read) until ``slot_bytes`` more fit."""
        excess = self.used + slot_bytes - self.capacity
        if excess <= 0:
            return True
        victims: list[str] = []
        freed = 0
        for key, (cls, slot, _) in self.index.items():
            if (cls, slot) in self.pins:
                continue
            victims.append(key)
            freed += self.classes[cls].slot_bytes
            if freed >= excess:
                break
        if freed < excess:
            return False
        for key in victims:
            self.drop(self.index.pop(key))
            self.stats["evictions"] += 1
        self.evictions_memory.evicted(victims)
        if self.on_evict is not None and victims:
            self.on_evict(victims)
        return True

    def drop(self, loc: Loc) -> None:
        """Free an object's slot now, or when the reads copying out of it finish."""
        cls, slot, _ = loc
        if (cls, slot) in self.pins:
            self.doomed.add((cls, slot))
            return
        self.release(cls, slot)

    def view(self, loc: Loc) -> np.ndarray:
        # No lock needed: the slot is reserved (pending) or pinned, so its chunk stays put.
        cls, slot, nbytes = loc
        return self.classes[cls].view(slot, nbytes)

    def plan_get(
        self, keys: Sequence[str], buffers: Sequence[Any]
    ) -> tuple[list[GetResult], list[tuple[int, Loc]]]:
        results = [GetResult(Outcome.MISSING)] * len(keys)
        plan: list[tuple[int, Loc]] = []
        with self.lock:
            for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
                loc = self.index.get(key)
                if loc is None:
                    self.stats["get_misses"] += 1
                    self.stats["evicted_probed_again"] += self.evictions_memory.asked_again(key)
                    continue
                if loc[2] > buf.numel():
                    results[i] = GetResult(Outcome.TOO_SMALL, 0)
                    self.stats["get_failures"] += 1
                    continue
                self.index.move_to_end(key)
                pin = (loc[0], loc[1])
                self.pins[pin] = self.pins.get(pin, 0) + 1
                plan.append((i, loc))
        return results, plan

    def finish_get(self, plan: list[tuple[int, Loc]], copied: bool) -> None:
        with self.lock:
            for _, (cls, slot, nbytes) in plan:
                if copied:
                    self.stats["gets"] += 1
                    self.stats["get_bytes"] += nbytes
                else:
                    self.stats["get_failures"] += 1
                pin = (cls, slot)
                left = self.pins[pin] - 1
                if left:
                    self.pins[pin] = left
                    continue
                del self.pins[pin]
                if pin in self.doomed:
                    self.doomed.discard(pin)
                    self.release(cls, slot)
