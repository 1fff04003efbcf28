"""Slab memory of the embedded store: one size class's chunks of equal slots and their free
lists (the rules are in :mod:`hylinker.stores.embedded`'s module doc)."""

from __future__ import annotations

import heapq

import numpy as np
import torch


class SizeClass:
    """The slab of one slot size: chunks of equal slots and their free lists."""

    __slots__ = ("chunks", "empty", "free", "grids", "live", "partial", "partial_set",
                 "released", "slot_bytes", "slots_per_chunk")

    def __init__(self, slot_bytes: int, chunk_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots_per_chunk = max(1, chunk_bytes // slot_bytes)
        self.chunks: list[np.ndarray | None] = []
        self.grids: list[np.ndarray | None] = []  # per chunk: [slots, slot bytes] view of it
        self.free: list[list[int]] = []  # per chunk: free local slot numbers
        self.live: list[int] = []  # per chunk: occupied slots
        # heap of the chunk numbers with a free slot, each once: exactly ``partial_set``
        # (a chunk leaves both when it fills or is released, enters both when a slot frees)
        self.partial: list[int] = []
        self.partial_set: set[int] = set()
        self.released: list[int] = []  # chunk numbers whose memory was released
        self.empty: set[int] = set()  # allocated chunks with no occupied slot

    @property
    def chunk_bytes(self) -> int:
        return self.slots_per_chunk * self.slot_bytes

    def has_free_slot(self) -> bool:
        return bool(self.partial)

    def allocate(self) -> tuple[int, int]:
        """Take a free slot (lowest chunk first, so high chunks drain).

        Returns ``(slot id, bytes of chunk memory newly allocated)``.
        """
        slots, grown = self.take(1)
        return slots[0], grown

    def take(self, k: int) -> tuple[list[int], int]:
        """Up to ``k`` free slots of one chunk (the lowest with room, or a new one), ascending,
        so consecutive frees come back as a run. Returns ``(slot ids, bytes newly allocated)``."""
        grown = 0
        if not self.partial:
            self._new_chunk()
            grown = self.chunk_bytes
        c = self.partial[0]
        self.empty.discard(c)
        free = self.free[c]
        m = min(k, len(free))
        local = sorted(free[len(free) - m:])
        del free[len(free) - m:]
        self.live[c] += m
        if not free:
            heapq.heappop(self.partial)
            self.partial_set.discard(c)
        base = c * self.slots_per_chunk
        return [base + x for x in local], grown

    def release(self, slot: int) -> None:
        c, local = divmod(slot, self.slots_per_chunk)
        self.free[c].append(local)
        self.live[c] -= 1
        if c not in self.partial_set:
            self.partial_set.add(c)
            heapq.heappush(self.partial, c)
        if self.live[c] == 0:
            self.empty.add(c)

    def free_empty_chunk(self) -> int:
        """Give one empty chunk's memory back; returns the bytes freed (0 if none is empty)."""
        if not self.empty:
            return 0
        c = max(self.empty)
        self.empty.discard(c)
        self.chunks[c] = None
        self.grids[c] = None
        self.free[c] = []
        if c in self.partial_set:  # an empty chunk has free slots: take it out of the heap too
            self.partial_set.discard(c)
            self.partial.remove(c)
            heapq.heapify(self.partial)
        self.released.append(c)
        return self.chunk_bytes

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        c, local = divmod(slot, self.slots_per_chunk)
        chunk = self.chunks[c]
        assert chunk is not None, "slot in a released chunk"
        start = local * self.slot_bytes
        return chunk[start : start + nbytes]

    def allocated_bytes(self) -> int:
        return sum(self.chunk_bytes for ch in self.chunks if ch is not None)

    def _new_chunk(self) -> int:
        memory = torch.empty(self.chunk_bytes, dtype=torch.uint8).numpy()
        grid = memory.reshape(self.slots_per_chunk, self.slot_bytes)
        if self.released:
            c = self.released.pop()
            self.chunks[c] = memory
            self.grids[c] = grid
            self.live[c] = 0
        else:
            c = len(self.chunks)
            self.chunks.append(memory)
            self.grids.append(grid)
            self.free.append([])
            self.live.append(0)
        self.free[c] = list(range(self.slots_per_chunk - 1, -1, -1))
        self.empty.add(c)
        self.partial_set.add(c)
        heapq.heappush(self.partial, c)
        return c
