"""A protocol double of AMD mori's ``mori.umbp.UMBPClient`` (amd-mori 1.2.4, the default
in-process client) for machines without its environment.

It reads and writes raw host memory through ``ctypes`` at the addresses and sizes it is given,
as the real client's pointer API does, and keeps each object in a ``bytearray`` (the real client
keeps a DRAM tier of 64 KiB pages).

Every rule below is pinned by a test in ``tests/stores/test_umbp_client.py``, which runs unchanged
against this double (the main suite) and against the real client (``just test-umbp``, in
``.venv-umbp``; see ``docs/guide/umbp.md``), so the two cannot drift. The test pinning each rule is
named in brackets.

* **Capacity is counted in pages** of :data:`PAGE_BYTES` (64 KiB): an object takes
  ``ceil(size / page)`` pages, at least one [test_capacity_is_counted_in_pages].
* **A put needs free pages now**: it does not evict to make room; a put that does not fit the
  free pages answers ``False`` [test_a_put_that_does_not_fit_is_refused].
* **Eviction after a put**: once the used pages pass the high watermark (90 %), the least
  recently used objects are evicted, oldest first, until the used pages are at or below the low
  watermark (70 %) — the object just stored included [test_capacity_is_counted_in_pages,
  test_an_object_above_the_low_watermark_is_evicted_at_once].
* **Reads refresh recency, ``exists`` does not**; a ranged read of a few bytes is a read
  [test_reads_refresh_recency_exists_does_not, test_a_ranged_read_of_a_header_refreshes_recency].
* **First writer wins, silently**: a put of a key already stored answers ``True`` and writes
  nothing; the same key twice in one batch answers ``[True, False]``, the first kept
  [test_first_writer_wins, test_the_same_key_twice_in_one_batch].
* **A get needs the exact size**: a size that differs answers ``False``, like a miss
  [test_a_get_needs_the_exact_size].
* **Ranged I/O**: ``batch_put_ranges_from_ptr`` builds one object of ``object_size`` bytes from
  several (pointer, size, offset) ranges; ``batch_get_ranges_into_ptr`` reads ranges of an
  object; a range past the object's end answers ``False``, a shorter one reads a prefix
  [test_ranged_reads].
* **Bad batches answer ``False`` per key, never raise**: lists of different lengths answer all
  ``False`` (the real client logs a line); a size-0 put answers ``False``
  [test_lists_of_different_lengths_answer_all_false, test_a_size_zero_put_is_refused].
* **The default mode is the embedded pool client**: ``is_distributed()`` is True;
  ``register_memory(ptr, size, loc, device)`` accepts host memory and answers True
  [test_the_default_client_is_the_embedded_pool_client].
* **``clear()`` answers True and then every put fails** for :data:`CLEAR_BLACKOUT_S` seconds
  (seen for at least 7.5 s on 1.2.4; fixed in mori's nightly) [test_after_clear_puts_fail].
* **No ``remove``, no ``close``, no ``touch``** [test_the_client_has_no_remove_close_or_touch].

Test hooks (not part of the real API): :meth:`UMBPClientDouble.drop` (an eviction by the
client's own policy), :attr:`UMBPClientDouble.calls` (call counts per method),
:meth:`UMBPClientDouble.stored_bytes` and :attr:`UMBPClientDouble.registered_regions`.
"""

from __future__ import annotations

import ctypes
import enum
import math
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

PAGE_BYTES = 64 << 10
"""The DRAM tier's page: the unit of capacity (``UMBP_EMBEDDED_DRAM_PAGE_SIZE`` in 1.2.4)."""
HIGH_WATERMARK = 0.9
LOW_WATERMARK = 0.7
DEFAULT_CAPACITY_BYTES = 4 << 30  # 1.2.4's default DRAM tier (the double allocates nothing up front)
CLEAR_BLACKOUT_S = 7.5
REAL_CLIENT_ENV = "HYLINKER_UMBP_REAL"
"""Set to 1 (``just test-umbp`` does) to run the UMBP tests against the real mori client."""


def real_client_wanted() -> bool:
    return os.environ.get(REAL_CLIENT_ENV) == "1"


def umbp_test_client(capacity_bytes: int = 64 << 20) -> Any:
    """A UMBP client of ``capacity_bytes`` for a test: the real ``mori.umbp.UMBPClient`` when
    ``HYLINKER_UMBP_REAL=1`` (an environment that cannot load it fails the test, never skips
    it), the double otherwise."""
    if real_client_wanted():
        from ..stores.umbp import new_umbp_client

        return new_umbp_client(capacity_bytes)
    return UMBPClientDouble(capacity_bytes=capacity_bytes)


class DeploymentMode(enum.Enum):
    """``mori.umbp.UMBPDeploymentMode``'s members."""

    Local = 0
    StandaloneProcess = 1
    Distributed = 2


class UMBPClientDouble:
    """In-memory stand-in for ``mori.umbp.UMBPClient`` (embedded pool client, DRAM tier)."""

    def __init__(
        self,
        config: object | None = None,
        *,
        capacity_bytes: int | None = None,
        mode: DeploymentMode = DeploymentMode.Distributed,
    ) -> None:
        if capacity_bytes is None:
            dram = getattr(config, "dram", None)
            capacity_bytes = int(getattr(dram, "capacity_bytes", DEFAULT_CAPACITY_BYTES))
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.config = config
        self._pages_total = capacity_bytes // PAGE_BYTES
        self._mode = mode
        self._objects: OrderedDict[str, bytearray] = OrderedDict()  # LRU order, oldest first
        self._pages_used = 0
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}
        self._puts_refused_until = 0.0
        self.calls: Counter[str] = Counter()

    # ---- core KV ---------------------------------------------------------------------------

    def put_from_ptr(self, key: str, src: int, size: int) -> bool:
        return self.batch_put_from_ptr([key], [src], [size])[0]

    def get_into_ptr(self, key: str, dst: int, size: int) -> bool:
        return self.batch_get_into_ptr([key], [dst], [size])[0]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    # ---- batch ----------------------------------------------------------------------------

    def batch_put_from_ptr(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        self.calls["batch_put_from_ptr"] += 1
        if not _same_lengths(keys, ptrs, sizes):
            return [False] * len(keys)
        with self._lock:
            seen: set[str] = set()
            out = []
            for key, ptr, size in zip(keys, ptrs, sizes):
                out.append(key not in seen and self._put(key, size, [(ptr, size, 0)]))
                seen.add(key)
            return out

    def batch_put_ranges_from_ptr(
        self,
        keys: Sequence[str],
        object_sizes: Sequence[int],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
    ) -> list[bool]:
        self.calls["batch_put_ranges_from_ptr"] += 1
        if not _same_lengths(keys, object_sizes, ptrs, sizes, dst_offsets):
            return [False] * len(keys)
        with self._lock:
            seen: set[str] = set()
            out = []
            for i, key in enumerate(keys):
                ranges = list(zip(ptrs[i], sizes[i], dst_offsets[i]))
                fits = len(ranges) == len(ptrs[i]) == len(sizes[i]) == len(dst_offsets[i]) and all(
                    off >= 0 and n >= 0 and off + n <= object_sizes[i] for _, n, off in ranges)
                out.append(key not in seen and fits and self._put(key, object_sizes[i], ranges))
                seen.add(key)
            return out

    def batch_get_into_ptr(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        self.calls["batch_get_into_ptr"] += 1
        if not _same_lengths(keys, ptrs, sizes):
            return [False] * len(keys)
        with self._lock:
            out = []
            for key, ptr, size in zip(keys, ptrs, sizes):
                data = self._objects.get(key)
                out.append(data is not None and len(data) == size and self._read(key, [(ptr, size, 0)]))
            return out

    def batch_get_ranges_into_ptr(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> list[bool]:
        self.calls["batch_get_ranges_into_ptr"] += 1
        if not _same_lengths(keys, ptrs, sizes, src_offsets):
            return [False] * len(keys)
        with self._lock:
            return [self._read(key, list(zip(ptrs[i], sizes[i], src_offsets[i])))
                    for i, key in enumerate(keys)]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self.calls["batch_exists"] += 1
        with self._lock:
            return [key in self._objects for key in keys]

    def batch_exists_consecutive(self, keys: Sequence[str]) -> int:
        self.calls["batch_exists_consecutive"] += 1
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._objects:
                    return i
            return len(keys)

    # ---- lifecycle / introspection ----------------------------------------------------------

    def clear(self) -> bool:
        self.calls["clear"] += 1
        with self._lock:
            self._objects.clear()
            self._pages_used = 0
            self._puts_refused_until = time.monotonic() + CLEAR_BLACKOUT_S
        return True

    def flush(self) -> bool:
        self.calls["flush"] += 1
        return True

    def supports_ranged_io(self) -> bool:
        return True

    def is_distributed(self) -> bool:
        return self._mode is DeploymentMode.Distributed

    def get_deployment_mode(self) -> DeploymentMode:
        return self._mode

    def register_memory(self, ptr: int, size: int, loc: object = None, device: int = -1) -> bool:
        self.calls["register_memory"] += 1
        if not isinstance(ptr, int) or not isinstance(size, int) or ptr == 0 or size < 0:
            raise ValueError(f"register_memory needs a non-null int address and size, got {ptr}, {size}")
        self._registered[ptr] = size
        return True

    def deregister_memory(self, ptr: int) -> None:
        self.calls["deregister_memory"] += 1
        self._registered.pop(ptr, None)

    # ---- test hooks (not part of UMBPClient) -------------------------------------------------

    def drop(self, key: str) -> bool:
        """Evict ``key`` as the client's own policy would; True if it was there."""
        with self._lock:
            data = self._objects.pop(key, None)
            if data is None:
                return False
            self._pages_used -= _pages(len(data))
            return True

    def stored_bytes(self, key: str) -> bytes | None:
        """A copy of what is stored under ``key`` (None if nothing)."""
        with self._lock:
            data = self._objects.get(key)
            return None if data is None else bytes(data)

    @property
    def registered_regions(self) -> dict[int, int]:
        return dict(self._registered)

    # ---- internals ----------------------------------------------------------------------------

    def _put(self, key: str, size: int, ranges: list[tuple[int, int, int]]) -> bool:
        if key in self._objects:
            return True  # first writer wins; the put reports success
        if size <= 0 or time.monotonic() < self._puts_refused_until:
            return False
        need = _pages(size)
        if self._pages_used + need > self._pages_total:
            return False
        data = bytearray(size)
        view = (ctypes.c_char * size).from_buffer(data)
        for ptr, n, off in ranges:
            if n:
                ctypes.memmove(ctypes.addressof(view) + off, ptr, n)
        self._objects[key] = data
        self._pages_used += need
        if self._pages_used > HIGH_WATERMARK * self._pages_total:
            while self._objects and self._pages_used > LOW_WATERMARK * self._pages_total:
                _, victim = self._objects.popitem(last=False)
                self._pages_used -= _pages(len(victim))
        return True

    def _read(self, key: str, ranges: list[tuple[int, int, int]]) -> bool:
        data = self._objects.get(key)
        if data is None or not ranges or any(off < 0 or n <= 0 or off + n > len(data) for _, n, off in ranges):
            return False
        view = (ctypes.c_char * len(data)).from_buffer(data)
        for ptr, n, off in ranges:
            ctypes.memmove(ptr, ctypes.addressof(view) + off, n)
        self._objects.move_to_end(key)
        return True


def _pages(size: int) -> int:
    return max(1, math.ceil(size / PAGE_BYTES))


def _same_lengths(*lists: Sequence[object]) -> bool:
    return len({len(x) for x in lists}) == 1
