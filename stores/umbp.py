"""Adapter over AMD mori UMBP (``mori.umbp.UMBPClient``; package ``amd-mori``, ROCm only).

UMBP's Python client is pointer based: batch put/get/exists over ``(key, address, size)``
lists, answering one boolean per key. What the adapter makes of its documented semantics
(sources are listed in :mod:`hylinker.testing.umbp_double`):

* **First writer wins, but silently**: UMBP reports ``true`` for a put of a key it already
  holds. The adapter asks ``batch_exists`` first and answers :attr:`Outcome.EXISTS` for those
  keys (a racing writer between the two calls is reported OK — the object is immutable
  either way). A key repeated inside one batch keeps its first buffer (UMBP itself would
  let the second overwrite the first within a batch).
* **A get needs the exact object size**, and a failed get does not say whether the key is
  missing or the size differs. So each put also stores a 16-byte *size record* under
  ``key + SIZE_RECORD_SUFFIX``. A get first reads with the buffer's size (the usual case:
  buffers sized for the object, one call); for keys that fail it reads their size records
  and answers MISSING (no record, or the object is gone), TOO_SMALL (object larger than the
  buffer) or retries with the recorded size (buffer larger than the object). With
  ``size_records=False`` nothing extra is stored; a get then needs an exactly sized buffer
  and a size mismatch answers FAILED.
* A put that UMBP refuses (``false``) is :attr:`Outcome.FAILED`: the boolean does not tell
  "full" from other errors.
* **No per-key delete**: ``capabilities.remove`` is False and :meth:`UmbpStore.remove`
  raises :class:`UnsupportedStoreOperation` (a :class:`StoreError` and a
  ``NotImplementedError``) rather than returning a count that would be a lie.
* **No touch**: UMBP refreshes recency on reads only; ``capabilities.touch`` is False and
  ``touch`` is a no-op.
* **No close**: :meth:`UmbpStore.close` waits for calls in flight, deregisters the regions it
  registered and stops using the client (drops its reference); it never calls into a closed
  client. Later calls raise :class:`StoreClosedError`.
* Buffers are handed to UMBP by address (``zero_copy``). In distributed mode they should lie
  in a region passed to :meth:`UmbpStore.register` (``register_memory``); standalone mode
  needs no registration.
* Every client call is blocking and runs in a worker thread (a capacity limiter bounds how
  many); an exception from the client becomes :class:`StoreUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from .embedded import InflightCalls, check_keys

_log = structlog.get_logger(__name__)

SIZE_RECORD_SUFFIX = "\x1fhylinker-size"
"""Suffix of the key under which a put records its object's size."""

_RECORD_BYTES = 16
_RECORD_TAG = b"HYLKSIZE"
MORI_PACKAGE = "amd-mori"


class UnsupportedStoreOperation(StoreError, NotImplementedError):
    """The backend cannot do this at all (check ``capabilities`` first)."""


class UMBPClientLike(Protocol):
    """The part of ``mori.umbp.UMBPClient`` the adapter uses."""

    def batch_put_from_ptr(
        self, keys: list[str], ptrs: list[int], sizes: list[int]
    ) -> Sequence[bool]: ...

    def batch_get_into_ptr(
        self, keys: list[str], ptrs: list[int], sizes: list[int]
    ) -> Sequence[bool]: ...

    def batch_exists(self, keys: list[str]) -> Sequence[bool]: ...

    def register_memory(self, ptr: int, size: int) -> bool: ...


def load_umbp_client_class() -> Any:
    """``mori.umbp.UMBPClient``, or a clear :class:`StoreUnavailableError` naming the package."""
    try:
        from mori.umbp import UMBPClient  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise StoreUnavailableError(
            f"the UMBP store needs AMD mori's UMBP client: install the `{MORI_PACKAGE}` package "
            f"(ROCm only), or pass client= (e.g. hylinker.testing.umbp_double.UMBPClientDouble); "
            f"importing mori.umbp failed: {exc}"
        ) from exc
    return UMBPClient


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

    ``client``: a ``UMBPClient`` (or a double); when None one is built from ``config`` (a
    ``mori.umbp.UMBPConfig``, default config when None). ``size_records``: store a size
    record per object so gets may use larger buffers (see the module docstring).
    ``max_workers``: client calls running at once.
    """

    def __init__(
        self,
        client: UMBPClientLike | None = None,
        *,
        config: object | None = None,
        size_records: bool = True,
        max_workers: int = 2,
        name: str = "umbp",
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if client is None:
            cls = load_umbp_client_class()
            try:
                client = cls() if config is None else cls(config)
            except Exception as exc:
                raise StoreUnavailableError(f"creating the UMBP client failed: {exc}") from exc
        elif config is not None:
            raise ValueError("pass either client= or config=, not both")
        self._client: UMBPClientLike | None = client
        self._size_records = size_records
        self._max_workers = max_workers
        self._limiter: anyio.CapacityLimiter | None = None
        self._regions: list[tuple[int, torch.Tensor]] = []
        self._capabilities = StoreCapabilities(name=name, touch=False, remove=False, zero_copy=True)
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
        self._calls.enter()
        try:
            self._stats["exists_calls"] += 1
            if not keys:
                return []
            answer = await self._run(self._exists_sync, list(keys))
            return answer
        finally:
            self._calls.exit()

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        check_buffers(keys, buffers)
        self._calls.enter()
        try:
            if not keys:
                return []
            ptrs = [b.data_ptr() for b in buffers]
            sizes = [b.numel() for b in buffers]
            outcomes: list[Outcome] = await self._run(self._put_sync, list(keys), ptrs, sizes)
            count_puts(self._stats, outcomes, sizes)
            return outcomes
        finally:
            self._calls.exit()

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        check_buffers(keys, buffers)
        self._calls.enter()
        try:
            if not keys:
                return []
            ptrs = [b.data_ptr() for b in buffers]
            sizes = [b.numel() for b in buffers]
            results: list[GetResult] = await self._run(self._get_sync, list(keys), ptrs, sizes)
            count_gets(self._stats, results)
            return results
        finally:
            self._calls.exit()

    async def touch(self, keys: Sequence[str]) -> None:
        """No-op: UMBP refreshes recency on reads only (``capabilities.touch`` is False)."""
        check_keys(keys)
        self._calls.enter()
        self._calls.exit()

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
            todo.append(i)
        if not todo:
            return outcomes
        wkeys = [keys[i] for i in todo]
        wptrs = [ptrs[i] for i in todo]
        wsizes = [sizes[i] for i in todo]
        records = np.zeros((len(todo), _RECORD_BYTES), dtype=np.uint8)
        if self._size_records:
            records[:, :8] = np.frombuffer(_RECORD_TAG, dtype=np.uint8)
            records[:, 8:].view("<u8")[:, 0] = wsizes
            base = records.ctypes.data
            wkeys += [keys[i] + SIZE_RECORD_SUFFIX for i in todo]
            wptrs += [base + j * _RECORD_BYTES for j in range(len(todo))]
            wsizes += [_RECORD_BYTES] * len(todo)
        stored = client.batch_put_from_ptr(wkeys, wptrs, wsizes)
        for j, i in enumerate(todo):
            outcomes[i] = Outcome.OK if stored[j] else Outcome.FAILED
        del records  # kept alive until the client returned
        return outcomes

    def _get_sync(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[GetResult]:
        client = self._live_client()
        got = client.batch_get_into_ptr(keys, ptrs, sizes)
        results = [
            GetResult(Outcome.OK, sizes[i]) if got[i] else GetResult(Outcome.MISSING)
            for i in range(len(keys))
        ]
        failed = [i for i in range(len(keys)) if not got[i]]
        if not failed:
            return results
        if not self._size_records:
            present = client.batch_exists([keys[i] for i in failed])
            for i, here in zip(failed, present, strict=True):
                if here:
                    _log.warning("UMBP object is not buffer-sized", key=keys[i], size=sizes[i])
                    results[i] = GetResult(Outcome.FAILED)
            return results
        records = np.zeros((len(failed), _RECORD_BYTES), dtype=np.uint8)
        base = records.ctypes.data
        have = client.batch_get_into_ptr(
            [keys[i] + SIZE_RECORD_SUFFIX for i in failed],
            [base + j * _RECORD_BYTES for j in range(len(failed))],
            [_RECORD_BYTES] * len(failed),
        )
        retry: list[tuple[int, int]] = []
        for j, i in enumerate(failed):
            if not have[j] or records[j, :8].tobytes() != _RECORD_TAG:
                continue  # MISSING
            nbytes = int(records[j, 8:].view("<u8")[0])
            if nbytes > sizes[i]:
                results[i] = GetResult(Outcome.TOO_SMALL)
            elif nbytes < sizes[i]:
                retry.append((i, nbytes))
            # nbytes == sizes[i]: the exact read failed, so the object is gone: MISSING
        if retry:
            again = client.batch_get_into_ptr(
                [keys[i] for i, _ in retry], [ptrs[i] for i, _ in retry], [n for _, n in retry]
            )
            for (i, nbytes), ok in zip(retry, again, strict=True):
                if ok:
                    results[i] = GetResult(Outcome.OK, nbytes)
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


def _closed(name: str) -> StoreError:
    return StoreClosedError(f"{name} store is closed")
