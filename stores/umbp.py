"""Adapter over AMD mori UMBP (``mori.umbp.UMBPClient``; package ``amd-mori``, tested with
1.2.4 — see ``docs/guide/umbp.md`` for how it runs here without ROCm).

UMBP's Python client is pointer based: batch put/get/exists over ``(key, address, size)``
lists, answering one boolean per key. What the real 1.2.4 client does (pinned by
``tests/stores/test_umbp_client.py``, which runs against it and against
:mod:`hylinker.testing.umbp_double`) and what the adapter makes of it:

* **Object layout: a 16-byte header, then the payload, in one UMBP object.** A get needs the
  exact object size and a failed get does not say why, so every object carries its size in a
  header (``HYLKSIZE`` + little-endian u64) written with the payload by one ranged put
  (``batch_put_ranges_from_ptr``). A get reads the header and ``buffer.numel()`` payload
  bytes in one ranged read (``batch_get_ranges_into_ptr``): the usual, buffer-sized case is one
  call. A read that fails is followed by a header-only read: no header is MISSING, a larger
  object TOO_SMALL, a smaller one is read again at its size. The header shares the object's
  pages, so it costs no page of its own (a separate size record would take a whole 64 KiB page).
* **Capacity is counted in 64 KiB pages**, an object taking ``ceil((16 + size) / page)``. UMBP
  evicts only after a put passes 90 % of its pages (down to 70 %, the new object included), and
  refuses a put that does not fit the free pages. So an object larger than the low watermark
  (70 % of the tier) would be evicted the moment it is stored: the adapter refuses it as
  :attr:`Outcome.FULL` (counted) without calling the client, and a tier smaller than one page is
  a ``ValueError`` at construction.
* **First writer wins, but silently**: UMBP reports ``True`` for a put of a key it already
  holds. The adapter asks ``batch_exists`` first and answers :attr:`Outcome.EXISTS` for those
  keys (a racing writer between the two calls is reported OK — the object is immutable either
  way). A key repeated inside one batch keeps its first buffer and answers EXISTS (UMBP itself
  answers ``[True, False]``).
* **A size-0 put is refused** (:attr:`Outcome.FAILED`, counted and logged): UMBP stores no empty
  object and the runtime never writes one.
* A put that UMBP refuses (``False``) is :attr:`Outcome.FAILED`: the boolean does not tell
  "full" from other errors.
* **No per-key delete**: ``capabilities.remove`` is False and :meth:`UmbpStore.remove` raises
  :class:`UnsupportedStoreOperation`. The adapter never calls ``clear()``: on 1.2.4 every put
  fails for seconds after it.
* **Touch is a small read**: UMBP has no touch, but every read refreshes an object's recency,
  a ranged read of its 16-byte header included. :meth:`UmbpStore.touch` reads the headers of
  the named keys (16 bytes each, one call), so ``capabilities.touch`` is True. The runtime's
  TOUCH names every object on a hot path (its KV pages and its boundary state): reading the
  boundary object alone keeps only that object, and a prefix whose first pages were evicted is
  not restorable (the measurement is in ``docs/guide/umbp.md``).
* **No close**: :meth:`UmbpStore.close` waits for calls in flight, deregisters the regions it
  registered and drops its reference to the client. Later calls raise :class:`StoreClosedError`.
* **Registration per mode**: the default client (the embedded pool client) takes host memory as
  is; :meth:`UmbpStore.register` passes a region to ``register_memory(ptr, size)`` there. The
  StandaloneProcess mode takes only shared memory from ``UMBPHostMemAllocator``: the adapter
  refuses it with a clear :class:`StoreUnavailableError` rather than handing it torch memory.
* The default configuration (:func:`umbp_config`) is a 256 MiB DRAM tier without prefault and
  without SSD (``UMBPConfig()`` alone allocates and prefaults 4 GiB).
* Every client call is blocking and runs in a worker thread (a capacity limiter bounds how
  many); an exception from the client becomes :class:`StoreUnavailableError`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
import anyio.to_thread
import numpy as np
import structlog
import torch

from .base import (
    GetResult,
    Outcome,
    StoreCapabilities,
    StoreClosedError,
    StoreError,
    StoreStatistics,
    StoreUnavailableError,
    check_buffers,
    count_gets,
    count_puts,
    new_counters,
)
from .calls import InflightCalls, check_keys

_log = structlog.get_logger(__name__)

MORI_PACKAGE = "amd-mori"
MORI_TESTED_VERSION = "1.2.4"
PAGE_BYTES = 64 << 10
"""UMBP's DRAM page (1.2.4's embedded pool client): the unit its capacity is counted in."""
LOW_WATERMARK = 0.7
"""UMBP evicts down to this share of its pages once a put passes 90 %."""
DEFAULT_CAPACITY_BYTES = 256 << 20
HEADER_BYTES = 16
_HEADER_TAG = b"HYLKSIZE"


class UnsupportedStoreOperation(StoreError, NotImplementedError):
    """The backend cannot do this at all (check ``capabilities`` first)."""


class UMBPClientLike(Protocol):
    """The part of ``mori.umbp.UMBPClient`` the adapter uses."""

    def batch_put_ranges_from_ptr(
        self, keys: list[str], object_sizes: list[int], ptrs: list[list[int]],
        sizes: list[list[int]], dst_offsets: list[list[int]],
    ) -> Sequence[bool]: ...

    def batch_get_ranges_into_ptr(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
        src_offsets: list[list[int]],
    ) -> Sequence[bool]: ...

    def batch_exists(self, keys: list[str]) -> Sequence[bool]: ...

    def register_memory(self, ptr: int, size: int) -> bool: ...

    def get_deployment_mode(self) -> object: ...


def load_umbp_module() -> Any:
    """``mori.umbp``, or a clear :class:`StoreUnavailableError` naming the package and what
    failed (not installed, a library missing, the wrong Python)."""
    try:
        import mori.umbp  # type: ignore[import-not-found, unused-ignore]
    except (ImportError, OSError) as exc:
        raise StoreUnavailableError(
            f"the UMBP store needs AMD mori's UMBP client: install the `{MORI_PACKAGE}` package "
            f"(tested: {MORI_TESTED_VERSION}; on a machine without ROCm see docs/guide/umbp.md), or "
            f"pass client= (e.g. hylinker.testing.umbp_double.UMBPClientDouble); importing "
            f"mori.umbp failed: {exc}"
        ) from exc
    return mori.umbp


def umbp_config(capacity_bytes: int = DEFAULT_CAPACITY_BYTES, *, prefault: bool = False) -> Any:
    """A ``mori.umbp.UMBPConfig``: a DRAM tier of ``capacity_bytes``, no SSD tier, prefaulted
    only when asked (``UMBPConfig()`` alone allocates and prefaults 4 GiB)."""
    check_capacity(capacity_bytes)
    config = load_umbp_module().UMBPConfig()
    config.dram.capacity_bytes = capacity_bytes
    config.dram.prefault = prefault
    config.ssd.enabled = False
    return config


def new_umbp_client(capacity_bytes: int = DEFAULT_CAPACITY_BYTES, *, prefault: bool = False) -> Any:
    """A real ``mori.umbp.UMBPClient`` over :func:`umbp_config`; a clear error if it cannot be made."""
    config = umbp_config(capacity_bytes, prefault=prefault)
    try:
        return load_umbp_module().UMBPClient(config)
    except Exception as exc:
        raise StoreUnavailableError(f"creating the UMBP client failed: {exc}") from exc


def check_capacity(capacity_bytes: int) -> None:
    """A tier must hold one page below its low watermark, or every object is evicted at once."""
    if object_pages_limit(capacity_bytes) < 1:
        raise ValueError(
            f"a UMBP DRAM tier of {capacity_bytes} bytes holds no object: it needs at least "
            f"{math.ceil(PAGE_BYTES / LOW_WATERMARK)} bytes ({PAGE_BYTES}-byte pages, evicted "
            f"down to {LOW_WATERMARK:.0%})"
        )


def object_pages(nbytes: int) -> int:
    """Pages one object of ``nbytes`` payload bytes takes (its header included)."""
    return math.ceil((HEADER_BYTES + nbytes) / PAGE_BYTES)


def object_pages_limit(capacity_bytes: int) -> int:
    """The most pages one object may take and stay stored (the low watermark's pages)."""
    return int(LOW_WATERMARK * (capacity_bytes // PAGE_BYTES))


def _is_standalone_process(client: object) -> bool:
    mode = getattr(client, "get_deployment_mode", None)
    return mode is not None and str(mode()).rsplit(".", 1)[-1] == "StandaloneProcess"


def _deregister(client: object, ptr: int) -> None:
    """``deregister_memory(ptr)`` where the client has it; a failure is logged, not raised."""
    deregister = getattr(client, "deregister_memory", None)
    if deregister is not None:
        try:
            deregister(ptr)
        except Exception as exc:
            _log.warning("UMBP deregister_memory failed", ptr=ptr, error=repr(exc))


class UmbpStore:
    """The Store protocol over a mori UMBP client.

    ``client``: a ``UMBPClient`` (or a double); when None one is built by
    :func:`new_umbp_client` with ``capacity_bytes``. ``capacity_bytes`` is the client's DRAM
    tier either way (objects above its low watermark are refused as FULL). ``max_workers``:
    client calls running at once.
    """

    def __init__(
        self,
        client: UMBPClientLike | None = None,
        *,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        max_workers: int = 2,
        name: str = "umbp",
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        check_capacity(capacity_bytes)
        if client is None:
            client = new_umbp_client(capacity_bytes)
        self._client: UMBPClientLike | None = client
        self._max_object_pages = object_pages_limit(capacity_bytes)
        self._max_workers = max_workers
        self._limiter: anyio.CapacityLimiter | None = None
        self._regions: list[tuple[int, torch.Tensor]] = []  # bounded: registered buffers, dropped on unregister
        self._capabilities = StoreCapabilities(name=name, touch=True, remove=False, zero_copy=True)
        self._calls = InflightCalls(name)
        self._stats = new_counters()

    # ---- protocol -------------------------------------------------------------------------

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._capabilities

    def register(self, region: torch.Tensor) -> None:
        if self._client is None or self._calls.closed:
            raise _closed(self._capabilities.name)
        check_buffers(["<region>"], [region])
        if _is_standalone_process(self._client):
            raise StoreUnavailableError(
                "UMBP's StandaloneProcess mode takes only shared memory from "
                "UMBPHostMemAllocator, not a torch region; use the default (embedded) client"
            )
        ptr, size = region.data_ptr(), region.numel()
        try:
            ok = self._client.register_memory(ptr, size)
        except Exception as exc:
            raise StoreUnavailableError(f"UMBP register_memory failed: {exc}") from exc
        if not ok:
            raise StoreUnavailableError(f"UMBP refused to register {size} bytes at {ptr:#x}")
        self._regions.append((ptr, region))

    def unregister(self, region: torch.Tensor) -> None:
        if self._client is None:
            return
        ptr = region.data_ptr()
        if not any(p == ptr for p, _ in self._regions):
            return
        self._regions = [(p, r) for p, r in self._regions if p != ptr]
        _deregister(self._client, ptr)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        check_keys(keys)
        with self._calls:
            self._stats["exists_calls"] += 1
            if not keys:
                return []
            answer: list[bool] = await self._run(self._exists_sync, list(keys))
            return answer

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        outcomes: list[Outcome] = await self._move(self._put_sync, keys, buffers)
        count_puts(self._stats, outcomes, [b.numel() for b in buffers])
        return outcomes

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        results: list[GetResult] = await self._move(self._get_sync, keys, buffers)
        count_gets(self._stats, results)
        return results

    async def _move(self, call: Callable[[list[str], list[int], list[int]], Any], keys: Sequence[str],
                    buffers: Sequence[torch.Tensor]) -> Any:
        """``call`` (put or get) over the buffers' addresses and sizes, in the worker pool."""
        check_buffers(keys, buffers)
        with self._calls:
            if not keys:
                return []
            ptrs = [b.data_ptr() for b in buffers]
            sizes = [b.numel() for b in buffers]
            return await self._run(call, list(keys), ptrs, sizes)

    async def touch(self, keys: Sequence[str]) -> None:
        """Refresh the keys' recency by reading their headers (UMBP has no touch; a read is
        one). Missing keys are ignored."""
        check_keys(keys)
        with self._calls:
            if keys:
                await self._run(self._touch_sync, list(keys))

    async def remove(self, keys: Sequence[str]) -> int:
        """Always raises: UMBP has no per-key delete (``capabilities.remove`` is False)."""
        check_keys(keys)
        self._calls.enter()
        self._calls.exit()
        raise UnsupportedStoreOperation(
            "mori UMBP has no per-key delete (capabilities.remove is False); objects leave "
            "by the client's own eviction"
        )

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(**self._stats)

    async def close(self) -> None:
        if not await self._calls.close():
            return
        client, self._client = self._client, None
        for ptr, _ in self._regions:
            _deregister(client, ptr)
        self._regions.clear()

    # ---- blocking halves (worker threads) -----------------------------------------------------

    def _exists_sync(self, keys: list[str]) -> list[bool]:
        return [bool(x) for x in self._live_client().batch_exists(keys)]

    def _touch_sync(self, keys: list[str]) -> None:
        headers = np.zeros((len(keys), HEADER_BYTES), dtype=np.uint8)
        base = headers.ctypes.data
        self._live_client().batch_get_ranges_into_ptr(
            keys, [[base + i * HEADER_BYTES] for i in range(len(keys))],
            [[HEADER_BYTES] for _ in keys], [[0] for _ in keys])
        del headers  # kept alive until the client returned

    def _put_sync(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[Outcome]:
        client = self._live_client()
        present = client.batch_exists(keys)
        outcomes = [Outcome.EXISTS] * len(keys)
        seen: set[str] = set()
        todo: list[int] = []
        for i, key in enumerate(keys):
            if present[i] or key in seen:
                continue
            seen.add(key)
            if sizes[i] == 0:
                _log.warning("UMBP stores no empty object; put refused", key=key)
                outcomes[i] = Outcome.FAILED
            elif object_pages(sizes[i]) > self._max_object_pages:
                _log.warning("object larger than the UMBP tier keeps; put refused", key=key,
                             size=sizes[i], pages=object_pages(sizes[i]), limit=self._max_object_pages)
                outcomes[i] = Outcome.FULL
            else:
                todo.append(i)
        if not todo:
            return outcomes
        headers = np.zeros((len(todo), HEADER_BYTES), dtype=np.uint8)
        headers[:, :8] = np.frombuffer(_HEADER_TAG, dtype=np.uint8)
        headers[:, 8:].view("<u8")[:, 0] = [sizes[i] for i in todo]
        base = headers.ctypes.data
        stored = client.batch_put_ranges_from_ptr(
            [keys[i] for i in todo],
            [HEADER_BYTES + sizes[i] for i in todo],
            [[base + j * HEADER_BYTES, ptrs[i]] for j, i in enumerate(todo)],
            [[HEADER_BYTES, sizes[i]] for i in todo],
            [[0, HEADER_BYTES] for _ in todo],
        )
        for j, i in enumerate(todo):
            outcomes[i] = Outcome.OK if stored[j] else Outcome.FAILED
        del headers  # kept alive until the client returned
        return outcomes

    def _get_sync(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[GetResult]:
        client = self._live_client()
        headers = np.zeros((len(keys), HEADER_BYTES), dtype=np.uint8)
        base = headers.ctypes.data
        # header + buffer-sized payload in one read; a 0-byte buffer reads the header alone
        whole = [i for i in range(len(keys)) if sizes[i] > 0]
        got = client.batch_get_ranges_into_ptr(
            [keys[i] for i in whole],
            [[base + i * HEADER_BYTES, ptrs[i]] for i in whole],
            [[HEADER_BYTES, sizes[i]] for i in whole],
            [[0, HEADER_BYTES] for _ in whole],
        ) if whole else []
        results = [GetResult(Outcome.MISSING)] * len(keys)
        read = {i for i, ok in zip(whole, got) if ok}
        failed = [i for i in range(len(keys)) if i not in read]
        if failed:  # header alone: missing, or an object of another size
            have = client.batch_get_ranges_into_ptr(
                [keys[i] for i in failed], [[base + i * HEADER_BYTES] for i in failed],
                [[HEADER_BYTES] for _ in failed], [[0] for _ in failed])
            read.update(i for i, ok in zip(failed, have) if ok)
        retry: list[tuple[int, int]] = []
        for i in sorted(read):
            nbytes = _header_size(headers[i])
            if nbytes is None:
                _log.warning("UMBP object without hylinker's header", key=keys[i])
                results[i] = GetResult(Outcome.FAILED)
            elif nbytes > sizes[i]:
                results[i] = GetResult(Outcome.TOO_SMALL)
            elif nbytes == sizes[i] and i not in failed:
                results[i] = GetResult(Outcome.OK, nbytes)
            elif nbytes < sizes[i]:
                retry.append((i, nbytes))
        if retry:
            again = client.batch_get_ranges_into_ptr(
                [keys[i] for i, _ in retry], [[ptrs[i]] for i, _ in retry],
                [[n] for _, n in retry], [[HEADER_BYTES] for _ in retry])
            for (i, nbytes), ok in zip(retry, again, strict=True):
                if ok:
                    results[i] = GetResult(Outcome.OK, nbytes)
        del headers
        return results

    # ---- plumbing -----------------------------------------------------------------------------

    def _live_client(self) -> UMBPClientLike:
        client = self._client
        if client is None:
            raise _closed(self._capabilities.name)
        return client

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self._max_workers)
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except StoreError:
            raise
        except Exception as exc:
            # The exception is chained to the StoreUnavailableError; log it without a traceback.
            _log.warning("UMBP client call failed", call=getattr(fn, "__name__", fn), error=repr(exc))
            raise StoreUnavailableError(f"UMBP client call failed: {exc!r}") from exc


def _header_size(header: np.ndarray) -> int | None:
    """The payload size a header records, None when it is not hylinker's header."""
    if header[:8].tobytes() != _HEADER_TAG:
        return None
    return int(header[8:].view("<u8")[0])


def _closed(name: str) -> StoreError:
    return StoreClosedError(f"{name} store is closed")
