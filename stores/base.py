"""The store protocol every backend implements.

A store holds *framed objects* (see :mod:`hylinker.stores.framing`) under string keys. The
runtime moves data in batches: one call carries many keys, each with its own host buffer.

Invariants a caller keeps:

* Buffers are 1-D, contiguous, ``torch.uint8`` CPU tensors (a store that declares
  ``capabilities.device_memory`` also takes device tensors in ``put_parts`` / ``get_parts``). A ``put`` reads exactly
  ``buffer.numel()`` bytes; a ``get`` writes at most ``buffer.numel()`` bytes and reports how
  many it wrote. Buffers must stay alive and untouched until the awaited call returns, even
  if the awaiting task is cancelled (the runtime keeps a reference for that reason).
* Zero-copy backends want buffers that lie inside a region passed to :meth:`Store.register`
  once, up front. Backends that copy accept any buffer; ``register`` is then a no-op.
* Puts are first-writer-wins: a key that exists keeps its first value and the put reports
  :attr:`Outcome.EXISTS`. Objects are immutable once stored.
* After :meth:`Store.close` every call raises :class:`StoreClosedError`; ``close`` waits
  for calls already in flight and is idempotent.

Per-key outcomes are values, not exceptions: a batch can partly succeed. Exceptions are
reserved for misuse (bad buffers, closed store) and for a backend that cannot answer at all
(:class:`StoreUnavailableError`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch


class Outcome(enum.Enum):
    """What happened to one key in a batch call."""

    OK = "ok"  # stored (put) / read (get) / present (exists)
    EXISTS = "exists"  # put: the key already held an object; the first writer won
    MISSING = "missing"  # get: no such key (never stored, evicted or removed)
    FULL = "full"  # put: no room even after eviction; back off
    LEASED = "leased"  # the object is leased by another client; try again later
    TOO_SMALL = "too_small"  # get: the object is larger than the buffer
    UNREACHABLE = "unreachable"  # the store (or its master) did not answer
    FAILED = "failed"  # any other backend error; see the backend's log

    @property
    def ok(self) -> bool:
        return self is Outcome.OK


@attrs.frozen
class GetResult:
    """One key's result of :meth:`Store.get`: the outcome and the bytes written."""

    outcome: Outcome
    nbytes: int = 0
    #: :meth:`ChecksumStore.get_checked` only: XXH3-64 of the payload bytes as they landed in
    #: the caller's buffers (everything after the first part); None elsewhere
    checksum: int | None = None


@attrs.frozen
class StoreCapabilities:
    """What a backend supports. The runtime consults these, never the backend's type."""

    name: str
    touch: bool  # can refresh an object's eviction recency without reading it
    remove: bool  # can delete single keys
    zero_copy: bool  # reads/writes registered buffers directly (no extra host copy)
    max_batch: int = 4096  # keys per call the backend handles well
    scatter: bool = False  # put_parts / get_parts: one object from / into several buffers
    checksums: bool = False  # put_sealed / get_checked: checksums the payload while copying it
    #: put_parts / get_parts also take device (GPU) buffers: registered device pools move in
    #: place, no host staging (Mooncake built with GPU support)
    device_memory: bool = False
    #: put_rows / get_rows: a sub-batch described by pool rows (``stores/rows.py``), outcomes as
    #: arrays; the store copies, checksums and writes the headers itself
    rows: bool = False
    #: the shortest contiguous run of pool memory (one buffer of a scattered object) the store
    #: moves in place as fast as staged: an object whose runs are shorter on average (its
    #: payload over its segments) goes staged, one buffer per object. 0: any run. A store whose
    #: transport pays per buffer (Mooncake over TCP to a peer's segment) sets it
    min_run_bytes: int = 0


@attrs.frozen
class StoreStatistics:
    """A snapshot of a store's counters. Every backend fills what it knows."""

    puts: int = 0
    put_bytes: int = 0
    put_exists: int = 0
    put_failures: int = 0
    gets: int = 0
    get_bytes: int = 0
    get_misses: int = 0
    get_failures: int = 0
    exists_calls: int = 0
    touches: int = 0
    removes: int = 0
    evictions: int = 0
    #: evicted objects a later probe (exists, get) asked for before anything put them again
    evicted_probed_again: int = 0
    #: evicted objects a later TOUCH named (a device hit on a prefix the store had dropped)
    evicted_touched_again: int = 0
    objects: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0


def new_counters() -> dict[str, int]:
    """Mutable counters with one entry per :class:`StoreStatistics` field, all zero."""
    return dict.fromkeys((f.name for f in attrs.fields(StoreStatistics)), 0)


class Closable(Protocol):
    def close(self) -> None: ...


def exit_closes(self: Closable, *exc_info: object) -> None:
    """The ``__exit__`` of an object whose ``close()`` ends it (``__exit__ = exit_closes``)."""
    self.close()


def count_puts(counters: dict[str, int], outcomes: Sequence[Outcome], sizes: Sequence[int]) -> None:
    """Add one put batch's outcomes (``sizes``: bytes of each buffer) to ``counters``."""
    for outcome, size in zip(outcomes, sizes):
        if outcome is Outcome.OK:
            counters["puts"] += 1
            counters["put_bytes"] += size
        elif outcome is Outcome.EXISTS:
            counters["put_exists"] += 1
        else:
            counters["put_failures"] += 1


def count_gets(counters: dict[str, int], results: Sequence[GetResult]) -> None:
    """Add one get batch's results to ``counters``."""
    for result in results:
        if result.outcome is Outcome.OK:
            counters["gets"] += 1
            counters["get_bytes"] += result.nbytes
        elif result.outcome is Outcome.MISSING:
            counters["get_misses"] += 1
        else:
            counters["get_failures"] += 1


class StoreError(Exception):
    """Base class of store exceptions."""


class StoreClosedError(StoreError):
    """The store was used after :meth:`Store.close`."""


class StoreUnavailableError(StoreError):
    """The backend could not be reached or set up at all (e.g. a dead Mooncake master)."""


@runtime_checkable
class Store(Protocol):
    """Async batch key-value store of framed objects. See the module docstring."""

    @property
    def capabilities(self) -> StoreCapabilities: ...

    def register(self, region: torch.Tensor) -> None:
        """Register a host staging region once; later buffers lie inside it."""
        ...

    def unregister(self, region: torch.Tensor) -> None:
        """Forget a region given to :meth:`register`, before it is freed; the caller guarantees
        no call in flight uses it. A region never registered is ignored."""
        ...

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds an object now (a hint: it may vanish before a get)."""
        ...

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        """Store each buffer under its key, first writer wins."""
        ...

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        """Read each key's object into its buffer."""
        ...

    async def touch(self, keys: Sequence[str]) -> None:
        """Mark keys as recently used (no-op where ``capabilities.touch`` is false)."""
        ...

    async def remove(self, keys: Sequence[str]) -> int:
        """Delete keys; returns how many existed."""
        ...

    def statistics(self) -> StoreStatistics:
        """A frozen snapshot of the counters."""
        ...

    async def close(self) -> None:
        """Wait for in-flight calls, release resources; idempotent."""
        ...


@runtime_checkable
class ScatterStore(Store, Protocol):
    """A store that moves one object between the store and *several* buffers (scatter-gather),
    so the runtime can read and write pool rows in place: ``parts[i]`` are object ``i``'s
    buffers, in order; the object is their concatenation. Same outcomes and rules as
    :meth:`Store.put` / :meth:`Store.get` (a get reports the object's bytes; an object larger
    than its parts is ``TOO_SMALL`` and writes nothing). Declared by ``capabilities.scatter``."""

    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]: ...

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]: ...


@runtime_checkable
class ChecksumStore(ScatterStore, Protocol):
    """A scatter-gather store that copies bytes itself and checksums a frame's payload while
    it copies it (:func:`~hylinker.stores.framing.copy_checksummed`), so the runtime need not
    read the pool rows a second time to seal or verify them. Declared by
    ``capabilities.checksums``.

    * :meth:`put_sealed`: like :meth:`put_parts`, but ``parts[i][0]`` is a 64-byte frame header
      from :func:`~hylinker.stores.framing.seal_header` at integrity ``"checksum"`` (a hashed
      frame, checksum not set; the runtime at ``"header"`` never calls it). The store copies
      the payload parts, then writes the header with the checksum of the bytes that landed in
      its memory. The stored object equals what ``seal_parts`` + ``put_parts`` store.
    * :meth:`get_checked`: like :meth:`get_parts`, and each OK result carries ``checksum``, the
      XXH3-64 of the bytes written into ``parts[i][1:]``, computed over those buffers right
      after the copy. The caller compares it with the header's (``verify_parts``)."""

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]: ...

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]: ...


@runtime_checkable
class RowStore(Store, Protocol):
    """A store that moves a sub-batch given as a :class:`~hylinker.stores.rows.RowBatch`
    (host pool rows, a header template, key digests), declared by ``capabilities.rows``.

    * :meth:`put_rows`: store each object as ``header ‖ rows`` (the frame ``seal_array`` makes),
      first writer wins; ``hashed``: checksum each payload while copying it and write the
      checksum into its header (integrity ``"checksum"``), else leave the template's (0).
      Returns one :data:`~hylinker.stores.rows.OUTCOMES` code per object.
    * :meth:`get_rows`: read each object's payload into its rows and its header into
      ``batch.heads[i]``; ``hashed``: each OK result's checksum is the payload's XXH3-64,
      hashed while copying. An object larger than the rows is ``TOO_SMALL`` and writes nothing;
      a shorter one lands its header only (its length field tells the reader)."""

    async def put_rows(self, batch: Any, hashed: bool) -> Any: ...

    async def get_rows(self, batch: Any, hashed: bool) -> Any: ...


_DATA_CALLS = ("put", "get", "put_parts", "get_parts", "put_sealed", "get_checked")


def supports_rows(store: Store) -> bool:
    """Whether ``store`` declares and implements :class:`RowStore`, and no subclass changed
    another data call after the class that defines the row calls (a store subclassed to change
    how ``get_checked`` lands, say, is moved through the calls it changed, never around them)."""
    if not (store.capabilities.rows and isinstance(store, RowStore)):
        return False
    mro = type(store).__mro__

    def owner(name: str) -> int:
        return next((i for i, k in enumerate(mro) if name in vars(k)), len(mro))

    rows = max(owner("put_rows"), owner("get_rows"))
    return all(owner(name) >= rows for name in _DATA_CALLS)


def supports_checksums(store: Store) -> bool:
    """Whether ``store`` declares and implements :class:`ChecksumStore`."""
    return bool(store.capabilities.checksums) and isinstance(store, ChecksumStore)


def supports_scatter(store: Store) -> bool:
    """Whether ``store`` declares and implements scatter-gather (wrappers that forward the
    inner store's capabilities without the methods do not count)."""
    return bool(store.capabilities.scatter) and isinstance(store, ScatterStore)


def supports_device_memory(store: Store) -> bool:
    """Whether ``store`` reads and writes device buffers in place (scatter-gather over device
    pool rows): the flag and scatter-gather both."""
    return bool(store.capabilities.device_memory) and supports_scatter(store)


def bad_key(keys: Sequence[object]) -> tuple[bool, object]:
    """``(True, key)`` for the first key that is not a non-empty string, else ``(False, None)``.
    A handful of calls per batch, not one per key (the batch path's rule of
    ``check_buffers``)."""
    kinds = set(map(type, keys))
    if kinds <= {str} and "" not in set(keys):
        return False, None
    for key in keys:  # something is off: find it
        if not isinstance(key, str) or not key:
            return True, key
    return False, None


def check_buffers(keys: Sequence[str], buffers: Sequence[torch.Tensor], *, devices: bool = False) -> None:
    """Raise a clear ``ValueError`` unless ``buffers`` fit the protocol's rules (``devices``:
    device buffers are allowed too, for a store that declares ``device_memory``)."""
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
    for key, buf in zip(keys, buffers):
        if not isinstance(key, str) or not key:
            raise ValueError(f"store keys must be non-empty strings, got {key!r}")
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"buffer for {key!r} is {type(buf).__name__}, not a torch.Tensor")
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(
                f"buffer for {key!r} must be a contiguous 1-D uint8 tensor, got "
                f"dtype={buf.dtype} shape={tuple(buf.shape)} contiguous={buf.is_contiguous()}"
            )
        if buf.device.type != "cpu" and not devices:
            raise ValueError(f"buffer for {key!r} is on {buf.device}; stores take host buffers")
