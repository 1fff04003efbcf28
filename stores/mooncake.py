"""Mooncake Store backend: ``mooncake.store.MooncakeDistributedStore`` behind the async protocol.

Open one with::

    store = await MooncakeStore.open(MooncakeConfig(master_address="127.0.0.1:50051"))
    store.register(staging_region)   # once; later buffers inside it go zero-copy
    ...
    await store.close()

Data path. Buffers that lie inside a region passed to :meth:`MooncakeStore.register` go to
``batch_put_from`` / ``batch_get_into`` as raw pointers (zero-copy). Any other buffer is
copied through an internal registered bounce buffer, so correctness never depends on the
caller registering. Batches are cut into ``max_batch`` keys per client call, and a data call
into at most ``transfer_queue // workers`` buffers (Mooncake's TCP lanes reject the excess).

Row-described calls. ``put_rows`` / ``get_rows`` (``capabilities.rows``, on unless
``MooncakeConfig.row_calls=False``) move a sub-batch given as pool rows through the same
multi-buffer calls, pointers computed with NumPy and headers in a registered arena of the
store's; how, and where that differs from the embedded store: :mod:`hylinker.stores.mooncake_rows`.

Threads. Every client call is synchronous (it releases the GIL) and runs in a worker thread
bounded by a ``CapacityLimiter``; the event loop never blocks. A cancelled put or get waits
for its call's thread to return before the cancellation lands, so its buffers are never
written after it regains control; calls that touch no caller buffer (exists, touch, remove,
replica queries) return at once and leave their thread to finish (a partitioned master holds
one ~4 s in the client's reconnect). A get's own bound is Mooncake's transfer timeout
(``MooncakeConfig.transfer_timeout_s``). :meth:`MooncakeStore.close` refuses new calls, waits for those in
flight, then closes the client; the client is never touched after that (Mooncake crashes the
process if it is).

Return codes map to outcomes as tabled in :mod:`hylinker.stores.mooncake_client`.

First writer wins. The client answers ``0`` for a put of a key that already exists and
keeps the first object (verified: ``get_size`` still reports the first size). To report
:attr:`Outcome.EXISTS` the adapter asks ``batch_is_exist`` first (one extra master RPC per
put batch) and puts only the absent keys; set ``MooncakeConfig.detect_exists=False`` to skip
that and report every accepted put as OK.

Master outage. Puts and gets to a dead master answer -900 at once; existence checks,
removes and ``get_size`` each spend ~4.3 s in the client's reconnect attempt before they
answer -900. After the first -900 the adapter therefore probes the master's TCP port (a
refused connect costs microseconds on loopback) before each call and answers UNREACHABLE /
raises :class:`StoreUnavailableError` without calling the client while the port is closed.
The client itself survives the outage: when a master comes back on the same address it
re-registers and remounts its segment within about a second (its first put may still see
FULL while the segment remounts). Objects stored before the outage are gone — the new
master starts empty.

TOUCH (does any call refresh eviction recency without reading the object?) — yes.
Mooncake's eviction (``MasterService::BatchEvict``) is an approximate LRU ordered by each
object's ``lease_timeout``: it evicts the objects with the smallest lease timeout among
those whose lease has expired. ``GrantLease`` (``lease_timeout = max(old, now + ttl)``) is
called when ``ExistKey`` or ``GetReplicaList`` succeeds (Mooncake docs, "Lease" section and
master source). So ``batch_is_exist`` refreshes recency without moving a byte. Measured
here (40 x 1 MiB objects in a 64 MiB segment, lease TTL 100 ms; touch the 20 oldest; wait
out the lease; write 40 more): with no touch the 20 oldest were all evicted and 14 of the
others survived; after ``batch_is_exist`` on the 20 oldest, 14 of them survived and all
20 untouched ones were evicted. ``get_size``, ``batch_get_replica_desc`` and reads gave the
same result; re-putting an existing key did not (first writer wins, no lease). Hence
``capabilities.touch = True`` and :meth:`MooncakeStore.touch` is one ``batch_is_exist``.
Side effect: a touched (or read, or exists-checked) object is also pinned against eviction
and plain removal for the lease TTL (``--default_kv_lease_ttl``, 10 s by default), which is
why :meth:`MooncakeStore.remove` removes with ``force=True`` by default.

Separate storage process. ``segment_bytes`` is the memory this client contributes to the
cluster; 0 makes a pure client. :class:`MooncakeSegmentHost` (and ``hylinker mooncake
segment``) runs a storage-only client that contributes a segment and issues no requests, so
the runtime can use ``segment_bytes=0`` and move data over the transfer engine (TCP here)
to another process.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np
import torch

from .base import (
    GetResult,
    Outcome,
    StoreCapabilities,
    StoreClosedError,
    StoreStatistics,
    StoreUnavailableError,
    check_buffers,
    count_gets,
    count_puts,
    new_counters,
)
from .host_bytes import one_openmp_thread
from .mooncake_batches import MasterUnreachable, MooncakeBatches
from .mooncake_client import (
    OBJECT_HAS_LEASE,
    RPC_FAIL,
    MooncakeConfig,
    device_memory_support,
    import_mooncake_store,
    setup_client,
    split_address,
)
from .mooncake_master import port_accepts
from .mooncake_rows import MooncakeRows, count_rows
from .rows import CODE, RowBatch, RowResults, check_batch

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class MooncakeStore:
    """The :class:`~hylinker.stores.base.Store` protocol over a Mooncake Store client.

    Build with :meth:`open`; the constructor takes an already set-up client.
    Use from one event loop.
    """

    def __init__(self, client: Any, config: MooncakeConfig) -> None:
        self._client = client
        self._config = config
        # GPU rows registered and moved in place only where the client was built for it
        device_memory, self.device_memory_reason = device_memory_support(config)
        self._capabilities = StoreCapabilities(
            name="mooncake", touch=True, remove=True, zero_copy=True, max_batch=config.max_batch,
            scatter=True, device_memory=device_memory, rows=config.row_calls,
            min_run_bytes=config.min_run_bytes,
        )
        self._limiter = anyio.CapacityLimiter(config.workers)
        self._batches = MooncakeBatches(client, config)  # the worker-thread side
        self._rows = MooncakeRows(self._batches)  # ... of the row-described calls
        self._closed = False
        self._client_closed = False
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._close_lock: anyio.Lock | None = None
        self._counters = new_counters()

    # -- construction --------------------------------------------------------------------

    @classmethod
    async def open(cls, config: MooncakeConfig) -> MooncakeStore:
        """Connect to the master and mount this client's segment.

        Fails fast with :class:`StoreUnavailableError` when the master's port is closed,
        and within ``setup_retries`` x ~4.4 s when it is open but does not answer.
        """
        mooncake_store = import_mooncake_store()
        master = split_address(config.master_address)
        if master is not None:
            reachable = await anyio.to_thread.run_sync(
                port_accepts, master[0], master[1], config.probe_timeout_s
            )
            if not reachable:
                raise StoreUnavailableError(
                    f"Mooncake master {config.master_address} is not accepting connections"
                )
        client = await anyio.to_thread.run_sync(setup_client, mooncake_store, config)
        store = cls(client, config)
        try:
            await anyio.to_thread.run_sync(store._batches.ensure_bounce, config.bounce_bytes)
        except BaseException:
            await anyio.to_thread.run_sync(client.close)
            raise
        return store

    async def __aenter__(self) -> MooncakeStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- protocol ------------------------------------------------------------------------

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._capabilities

    @property
    def config(self) -> MooncakeConfig:
        return self._config

    @property
    def closed(self) -> bool:
        return self._closed

    def register(self, region: torch.Tensor) -> None:
        """Register a host staging region (or, with ``device_memory``, device pool memory)
        with the transfer engine, once, up front."""
        self._check_open()
        if not isinstance(region, torch.Tensor):
            raise TypeError(f"region is {type(region).__name__}, not a torch.Tensor")
        if region.device.type != "cpu" and not self._capabilities.device_memory:
            raise ValueError(f"cannot register {region.device} memory: {self.device_memory_reason}")
        if not region.is_contiguous() or region.numel() == 0:
            raise ValueError("a region must be a non-empty contiguous CPU tensor (or device tensor, with device_memory)")
        start = region.data_ptr()
        end = start + region.numel() * region.element_size()
        starts, regions = self._batches.table
        for lo, hi, _ in regions:
            if start < hi and lo < end:
                if lo <= start and end <= hi:
                    return  # already covered
                raise ValueError("staging region overlaps a registered region")
        rc = self._client.register_buffer(start, end - start)
        if rc != 0:
            raise ValueError(f"Mooncake refused to register {end - start} bytes (code {rc})")
        at = bisect.bisect(starts, start)
        self._batches.set_regions([*regions[:at], (start, end, region), *regions[at:]])

    def unregister(self, region: torch.Tensor) -> None:
        """Forget a region registered with :meth:`register` (about to be freed; no transfer
        may be using it). A region that was never registered is ignored."""
        if self._client is None:
            return
        start = region.data_ptr()
        regions = self._batches.table[1]
        kept = [r for r in regions if r[0] != start]
        if len(kept) == len(regions):
            return
        self._batches.set_regions(kept)
        rc = self._client.unregister_buffer(start)
        if rc != 0:
            log.warning("mooncake unregister_buffer(%#x) returned %s", start, rc)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = self._check_keys(keys)
        self._counters["exists_calls"] += 1
        if not keys:
            return []
        try:
            codes = await self._run(self._batches.is_exist, keys, abandon=True)
        except MasterUnreachable as exc:
            raise self._unavailable("exists") from exc
        if RPC_FAIL in codes:
            raise self._unavailable("exists")
        return [code == 1 for code in codes]

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        keys, buffers = self._batch(keys, buffers)
        if not keys:
            return []
        outcomes = await self._put_first(self._batches.put, keys, buffers)
        count_puts(self._counters, outcomes, [b.numel() for b in buffers])
        return outcomes

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        keys, buffers = self._batch(keys, buffers)
        return await self._get(self._batches.get, keys, buffers) if keys else []

    def _batch(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
        """A put's or get's keys and buffers, checked; an empty batch still needs an open store."""
        check_buffers(keys, buffers)
        if not keys:
            self._check_open()
        return list(keys), list(buffers)

    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        """Store each object from several buffers (``batch_put_from_multi_buffers`` when all
        of an object's buffers lie in registered regions; others are joined and bounced)."""
        sizes = _check_parts(keys, parts, self._capabilities.device_memory)
        keys = list(keys)
        if not keys:
            self._check_open()
            return []
        outcomes = await self._put_first(self._batches.put_parts, keys, [list(p) for p in parts])
        count_puts(self._counters, outcomes, sizes)
        return outcomes

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        """Read each object into several buffers in order (``batch_get_into_multi_buffers``
        when all of them lie in registered regions; others are read whole and split)."""
        _check_parts(keys, parts, self._capabilities.device_memory)
        keys = list(keys)
        if not keys:
            self._check_open()
            return []
        return await self._get(self._batches.get_parts, keys, [list(p) for p in parts])

    async def _put_first(self, put: Callable[..., list[Outcome]], keys: list[str], payloads: Sequence[Any]
                         ) -> list[Outcome]:
        """``put`` each key once: a key repeated inside one batch is written at its first
        occurrence, the rest report EXISTS (or the first's failure)."""
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        unique = sorted(first.values())
        try:
            got = await self._run(put, [keys[i] for i in unique], [payloads[i] for i in unique])
        except MasterUnreachable:
            got = [Outcome.UNREACHABLE] * len(unique)
        by_index = dict(zip(unique, got))
        return [by_index[i] if i in by_index else
                (Outcome.EXISTS if by_index[first[k]] in (Outcome.OK, Outcome.EXISTS) else by_index[first[k]])
                for i, k in enumerate(keys)]

    async def _get(self, get: Callable[..., list[GetResult]], keys: list[str], payloads: Sequence[Any]
                   ) -> list[GetResult]:
        """``get`` the batch; an unreachable master fails every key; counted."""
        try:
            results = await self._run(get, keys, payloads)
        except MasterUnreachable:
            results = [GetResult(Outcome.UNREACHABLE)] * len(keys)
        count_gets(self._counters, results)
        return results

    async def put_rows(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        """Store a row-described sub-batch (:class:`~hylinker.stores.base.RowStore`; how and
        where Mooncake differs: :mod:`hylinker.stores.mooncake_rows`)."""
        check_batch(batch)
        self._check_open()
        if not batch.keys:
            return np.zeros(0, dtype=np.int8)
        try:
            codes = await self._run(self._rows.put, batch, hashed)
        except MasterUnreachable:
            codes = np.full(len(batch.keys), CODE[Outcome.UNREACHABLE], dtype=np.int8)
        count_rows(self._counters, codes, batch.object_bytes, put=True)
        return codes

    async def get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        """Read a row-described sub-batch into its rows and ``batch.heads``."""
        check_batch(batch, get=True)
        self._check_open()
        if not batch.keys:
            return RowResults.of(0, Outcome.OK)
        try:
            res = await self._run(self._rows.get, batch, hashed)
        except MasterUnreachable:
            res = RowResults.of(len(batch.keys), Outcome.UNREACHABLE)
        count_rows(self._counters, res.codes, res.nbytes, put=False)
        return res

    async def replica_endpoints(self, keys: Sequence[str]) -> list[str | None]:
        """Where each object's first memory replica lives: the transport endpoint
        (``host:port``) of the segment holding it, None when absent. An object whose endpoint
        is this client's own ``local_hostname`` is copied with a memcpy; any other crosses the
        transfer engine (TCP here). One ``batch_get_replica_desc`` call; for diagnostics."""
        keys = self._check_keys(keys)
        if not keys:
            return []
        try:
            found = await self._run(self._batches.replica_endpoints, keys, abandon=True)
        except MasterUnreachable:
            return [None] * len(keys)
        return found

    async def touch(self, keys: Sequence[str]) -> None:
        """Refresh eviction recency via ``batch_is_exist`` (grants each object a lease).

        A hint: an unreachable master is logged, not raised.
        """
        keys = self._check_keys(keys)
        if not keys:
            return
        try:
            codes = await self._run(self._batches.is_exist, keys, abandon=True)
        except MasterUnreachable:
            log.debug("mooncake touch skipped: master %s unreachable", self._config.master_address)
            return
        self._counters["touches"] += sum(1 for code in codes if code == 1)

    async def remove(self, keys: Sequence[str]) -> int:
        keys = self._check_keys(keys)
        if not keys:
            return 0
        try:
            codes = await self._run(self._batches.remove, keys, abandon=True)
        except MasterUnreachable as exc:
            raise self._unavailable("remove") from exc
        if RPC_FAIL in codes:
            raise self._unavailable("remove")
        removed = sum(1 for code in codes if code == 0)
        leased = sum(1 for code in codes if code == OBJECT_HAS_LEASE)
        if leased:
            log.info("mooncake remove: %d leased key(s) kept (force_remove is off)", leased)
        self._counters["removes"] += removed
        return removed

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(**{**self._counters, "capacity_bytes": self._config.segment_bytes})

    async def close(self) -> None:
        """Refuse new calls, wait for those in flight, close the client. Idempotent."""
        self._closed = True
        if self._close_lock is None:
            self._close_lock = anyio.Lock()
        async with self._close_lock:
            if self._client_closed:
                return
            while self._in_flight:  # counted by the worker threads themselves
                await anyio.sleep(0.002)
            client, self._client = self._client, None
            self._client_closed = True

            def shut() -> None:
                self._rows.arenas.release()  # the header arenas, while the client is open
                client.close()

            with anyio.CancelScope(shield=True):  # never leave a half-closed client behind
                try:
                    await anyio.to_thread.run_sync(shut)
                except Exception:
                    log.warning("mooncake client close raised", exc_info=True)
            self._batches.set_regions([])
            self._batches.bounce = None
            self._batches.client = None

    # -- plumbing ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the Mooncake store is closed")

    def _check_keys(self, keys: Sequence[str]) -> list[str]:
        self._check_open()
        out = list(keys)
        for key in out:
            if not isinstance(key, str) or not key:
                raise ValueError(f"store keys must be non-empty strings, got {key!r}")
        return out

    def _unavailable(self, what: str) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"Mooncake master {self._config.master_address} unreachable during {what}"
        )

    async def _run(self, fn: Callable[..., _T], *args: Any, abandon: bool = False) -> _T:
        """Run a blocking client call in the bounded pool, counted for close().

        ``abandon``: for calls that touch no caller buffer (existence checks, touches,
        removes, replica queries) a cancelled caller returns at once and the thread finishes
        on its own (a partitioned master holds such a call ~4 s in the client's reconnect);
        it stays counted until it returns, so close() never closes the client under it."""
        self._check_open()
        state = ["queued"]  # -> "running" (the thread took it) or "dropped" (cancelled first)
        with self._count_lock:
            self._in_flight += 1

        def call() -> _T:
            with self._count_lock:
                if state[0] == "dropped":
                    raise anyio.get_cancelled_exc_class()()  # never reached: the caller left
                state[0] = "running"
            one_openmp_thread()  # the bounce copies run here: no OpenMP team (host_bytes)
            try:
                return fn(*args)
            finally:
                with self._count_lock:
                    self._in_flight -= 1

        try:
            # abandon_on_cancel=False elsewhere: a cancelled caller resumes only after the
            # thread returned, so the client never touches its buffers afterwards.
            return await anyio.to_thread.run_sync(call, limiter=self._limiter, abandon_on_cancel=abandon)
        finally:
            with self._count_lock:
                if state[0] == "queued":  # cancelled before a thread took the call
                    state[0] = "dropped"
                    self._in_flight -= 1

def _check_parts(keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]], devices: bool) -> list[int]:
    """Check every buffer like ``check_buffers`` (``devices``: device buffers allowed);
    returns each object's total bytes."""
    if len(keys) != len(parts):
        raise ValueError(f"{len(keys)} keys but {len(parts)} part lists")
    sizes: list[int] = []
    for key, ps in zip(keys, parts):
        if not ps:
            raise ValueError(f"no buffers for {key!r}")
        check_buffers([key] * len(ps), list(ps), devices=devices)
        sizes.append(sum(p.numel() for p in ps))
    return sizes
