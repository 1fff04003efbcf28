"""A protocol double of AMD mori's ``mori.umbp.UMBPClient`` for machines without ROCm.

It reads and writes raw host memory through ``ctypes`` at the addresses and sizes it is
given, exactly as the real client's pointer API does, and keeps the objects in its own
``bytearray`` per key (a test double; the real client keeps a DRAM tier).

Documented behaviours it follows, and where they are written down (all in the public
``ROCm/mori`` repository):

* **Method names and arguments** — ``put_from_ptr(key, src, size)``,
  ``get_into_ptr(key, dst, size)``, ``exists(key)``, ``batch_put_from_ptr(keys, ptrs,
  sizes)``, ``batch_put_from_ptr_with_depth(keys, ptrs, sizes, depths)``,
  ``batch_get_into_ptr(keys, ptrs, sizes)``, ``batch_exists(keys)``,
  ``batch_exists_consecutive(keys)``, ``clear()``, ``flush()``, ``is_distributed()``,
  ``register_memory(ptr, size)``, ``deregister_memory(ptr)``; the constructor takes an
  optional ``config`` (``UMBPConfig``). Source: ``src/pybind/pybind_umbp.cpp`` (the
  ``py::class_<IUMBPClient>(m, "UMBPClient")`` binding); exported by
  ``python/mori/umbp/__init__.py``. The binding has **no** ``remove`` and **no** ``close``
  (an older binding had ``remove``; the current ``IUMBPClient`` interface in
  ``src/umbp/include/umbp/umbp_client.h`` has no per-key delete — only ``Clear()``).
* **Pointer based, zero copy**: "All methods are zero-copy and pointer-based"
  (``umbp_client.h``, class comment). Put copies ``size`` bytes from ``src``; get copies into
  ``dst``.
* **Batch results are per key booleans** (``std::vector<bool>``; ``umbp_client.h``).
* **First writer wins**: a put of a key that exists returns ``true`` without writing
  (``src/umbp/local/standalone_client.cpp``: ``if (index_.MayExist(key)) return true;`` in
  ``Put`` and ``BatchPut``). The caller cannot tell "stored" from "already there".
* **A get needs the exact size**: a read whose ``size`` differs from the stored size fails
  ("Reject if caller's buffer size does not match the stored block size";
  ``src/umbp/local/tiers/dram_tier.cpp``, ``DRAMTier::ReadIntoPtr``). A missing key fails
  too; the two are indistinguishable to the caller.
* **Reads refresh LRU recency** (``TouchLRU(key)`` after a successful ``ReadIntoPtr``,
  ``dram_tier.cpp``); there is no separate touch call.
* **When DRAM is full the least recently used entries are evicted** to make room (last-resort
  eviction in ``LocalStorageManager::Write``, ``src/umbp/local/tiers/local_storage_manager.cpp``);
  a put fails (``false``) only when the object cannot fit at all. Modelled only when
  ``capacity_bytes`` is given (no SSD tier here).
* **Registration is a no-op returning true in standalone mode** ("Standalone mode needs no
  registration (CPU-local memcpy), so the default implementation is a no-op returning true";
  ``umbp_client.h``).
* ``batch_exists_consecutive`` "Returns the number of keys that exist consecutively from
  index 0" (``umbp_client.h``).

Where the real client's behaviour on misuse is undefined (mismatched list lengths, null
pointers), the double raises ``ValueError`` so tests notice. Test hooks (not part of the
real API): :meth:`UMBPClientDouble.drop` (an eviction by the client's own policy),
:attr:`UMBPClientDouble.calls` (call counts per method) and
:meth:`UMBPClientDouble.stored_bytes`.
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence


class UMBPClientDouble:
    """In-memory stand-in for ``mori.umbp.UMBPClient`` (standalone mode, DRAM tier only)."""

    def __init__(self, config: object | None = None, *, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.config = config
        self._capacity = capacity_bytes
        self._objects: OrderedDict[str, bytearray] = OrderedDict()  # LRU order, oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}
        self.calls: Counter[str] = Counter()

    # ---- core KV ---------------------------------------------------------------------------

    def put_from_ptr(self, key: str, src: int, size: int) -> bool:
        self.calls["put_from_ptr"] += 1
        _check_one(key, src, size)
        with self._lock:
            return self._put(key, src, size)

    def get_into_ptr(self, key: str, dst: int, size: int) -> bool:
        self.calls["get_into_ptr"] += 1
        _check_one(key, dst, size)
        with self._lock:
            return self._get(key, dst, size)

    def exists(self, key: str) -> bool:
        self.calls["exists"] += 1
        _check_key(key)
        with self._lock:
            return key in self._objects

    # ---- batch ----------------------------------------------------------------------------

    def batch_put_from_ptr(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        self.calls["batch_put_from_ptr"] += 1
        _check_batch(keys, ptrs, sizes)
        with self._lock:
            return [self._put(k, p, s) for k, p, s in zip(keys, ptrs, sizes, strict=True)]

    def batch_put_from_ptr_with_depth(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        depths: Sequence[int],
    ) -> list[bool]:
        """Depth only steers the real client's eviction priority; plain LRU here."""
        self.calls["batch_put_from_ptr_with_depth"] += 1
        _check_batch(keys, ptrs, sizes)
        with self._lock:
            return [self._put(k, p, s) for k, p, s in zip(keys, ptrs, sizes, strict=True)]

    def batch_get_into_ptr(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        self.calls["batch_get_into_ptr"] += 1
        _check_batch(keys, ptrs, sizes)
        with self._lock:
            return [self._get(k, p, s) for k, p, s in zip(keys, ptrs, sizes, strict=True)]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self.calls["batch_exists"] += 1
        for key in keys:
            _check_key(key)
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
            self._used = 0
        return True

    def flush(self) -> bool:
        self.calls["flush"] += 1
        return True

    def is_distributed(self) -> bool:
        return False

    def register_memory(self, ptr: int, size: int) -> bool:
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
            self._used -= len(data)
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

    def _put(self, key: str, src: int, size: int) -> bool:
        if key in self._objects:
            return True  # first writer wins; the put reports success
        if self._capacity is not None:
            if size > self._capacity:
                return False
            while self._used + size > self._capacity:
                _, victim = self._objects.popitem(last=False)
                self._used -= len(victim)
        data = bytearray(size)
        if size:
            ctypes.memmove((ctypes.c_char * size).from_buffer(data), src, size)
        self._objects[key] = data
        self._used += size
        return True

    def _get(self, key: str, dst: int, size: int) -> bool:
        data = self._objects.get(key)
        if data is None or len(data) != size:
            return False
        if size:
            ctypes.memmove(dst, (ctypes.c_char * size).from_buffer(data), size)
        self._objects.move_to_end(key)
        return True


def _check_key(key: object) -> None:
    if not isinstance(key, str):
        raise TypeError(f"UMBP keys are str, got {type(key).__name__}")


def _check_one(key: object, ptr: object, size: object) -> None:
    _check_key(key)
    if not isinstance(ptr, int) or not isinstance(size, int):
        raise TypeError(f"UMBP pointers and sizes are ints, got {ptr!r}, {size!r}")
    if size < 0:
        raise ValueError(f"negative size {size}")
    if ptr == 0 and size > 0:
        raise ValueError(f"null pointer for key {key!r}")


def _check_batch(keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
    if not len(keys) == len(ptrs) == len(sizes):
        raise ValueError(
            f"batch lists differ in length: {len(keys)} keys, {len(ptrs)} ptrs, {len(sizes)} sizes"
        )
    for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
        _check_one(key, ptr, size)
