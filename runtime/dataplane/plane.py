"""The data plane: loads and offloads between an engine's own pools and a store.

An engine that owns its prefix tree, allocators and locks (SGLang, vLLM, or hylinker's own
:class:`~hylinker.runtime.linker.facade.Linker`) decides *which* rows and slots hold *which* object;
the data plane only moves the bytes, verifies them and says when they landed.

How an engine uses it::

    pools = PoolSet([kv_view(k_bufs, v_bufs, layer_ids=full_ids, page_size=P),
                     state_view(mamba.conv, mamba.temporal, layer_ids=mamba_ids)])
    async with DataPlane(pools, store, namespace=b"model/tp0") as dp:
        present = await dp.exists({PoolKind.FULL: page_keys, PoolKind.MAMBA: [state_key]})
        ticket = await dp.load([Transfer(PoolKind.FULL, page_keys, kv_rows),
                                Transfer(PoolKind.MAMBA, [state_key], [slot])])
        await ticket.wait_layer(layer_id)        # that layer's rows hold verified data
        outcome = await ticket.wait()            # outcome.ok: every object landed
        done = await dp.offload([Transfer(PoolKind.FULL, new_keys, new_rows)], fence=event)
        ...                                      # await done.wait() for its outcome

A synchronous scheduler uses :class:`SyncDataPlane` (the same calls from any thread, results
as ``concurrent.futures.Future``; the event loop runs on a background thread).

Contract (what the caller keeps, what the data plane guarantees):

* A *transfer* names one pool's objects: ``keys[i]`` is stored from / loaded into the rows
  ``index[i]`` (``[n, page_size]`` rows, or flat whole pages; one slot per state). Keys are the
  engine's; equal keys must mean equal bytes (objects are immutable, first writer wins).
* One submission (a list of transfers, at most one per pool) gets one ticket and one outcome.
  Per pool and direction, jobs run in submission order; submissions themselves are queued in
  the order they were made (a bounded queue: a submitter waits while it is full).
* A load writes only the rows its transfers name, and reports a layer landed only after every
  object feeding that layer (every pool, every layer group) arrived and its checksum and
  header were verified. A failed object is reported (``outcome.ok`` false, faults counted);
  its rows may hold partial bytes, so the engine must not use them (recompute or abort).
* *Verify all, then land* (``load(..., verify_all=True)``, per submission): no layer of the
  load is reported landed before every object of it (every pool, every layer group) arrived
  and verified. Staged objects are read into private staging and verified there, and their
  rows are written only then (job by job in group order, each layer reported as its rows are
  written); objects that move in place (host pools, from ``in_place_min_bytes`` up, over any
  store that moves them in place) are
  written into their rows by the store and verified there, and only their report waits. A
  failed load reports no layer at all; it writes no staged object's rows, while in-place
  objects may have left bytes in theirs (never reported, so never used). Its
  ``outcome.objects[pool][i]`` then says whether object ``i`` *verified* (``ok`` is false).
  This is for an engine that runs the forward on reported layers and cannot take a layer back
  (SGLang: a failed load aborts the request, so a half-reported load would have run the
  forward on layers of a request that is then thrown away). It costs the overlap of the
  first layers' compute with later objects' transfer.
* An offload reads its rows only after its ``fence`` completed (the forward wrote them).
* A load with a ``fence`` writes no row before it completed (the engine's stream is past the
  rows' last use).
* :meth:`LoadTicket.cancel` succeeds only before any of the load's jobs started; the rows
  are then untouched. :meth:`DataPlane.reset` cancels queued loads and waits for every
  transfer in flight; :meth:`DataPlane.close` does the same and refuses new work.
* Store failures never raise out of a transfer: they are per-object outcomes. Misuse raises
  (:class:`~hylinker.components.pool_view.PoolViewError`, :class:`DataPlaneClosedError`).

Layer groups: with ``layer_groups = G > 1`` every page or state is stored as ``G`` objects,
each holding a run of consecutive layers (keys ``{key}|g{g}of{G}``); a load fetches group 0
of all its objects first, so the forward's first layers can start while later groups are
still in flight. ``G = 1`` stores one object per page or state holding every layer.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import attrs
import torch

from ...components.layout import PoolKind
from ...components.pool_view import PoolSet, PoolView, PoolViewError
from ...stores.base import Store
from ...stores.resilient import ResilientStore
from ...stores.worker_threads import WorkerThreads
from .device import DeviceCopies
from .events import DeviceEvent
from .frame_region import FrameRegion
from .host_staging import HostStaging, HostStagingFullError, staging_for
from .metrics import (
    LIBRARY,
    PLANE_KEYS,
    Exporter,
    Figures,
    Naming,
    plane_figures,
    store_figures,
    store_identity_figures,
)
from .plane_config import DataPlaneConfig
from .pool_actor import PoolActor
from .probe import probe
from .restore_cost import LoadBandwidth
from .statistics import Backpressure, DataPlaneStatistics, PoolActorStatistics
from .store_calls import LatencyMonitor
from .tickets import LoadTicket, OffloadTicket, TransferOutcome, _Ticket
from .transfer_codec import PoolCodec
from .transfer_jobs import TransferJob, cancel_job, check_keys, group_key, group_keys


class DataPlaneClosedError(RuntimeError):
    """The data plane is not running (not entered yet, closing or closed)."""


@attrs.frozen
class Transfer:
    """One pool's objects of a submission: ``keys[i]`` ↔ rows (or slot) ``index[i]``."""

    pool: PoolKind
    keys: Sequence[str]
    index: Any  # torch.Tensor [n, unit] or flat [n * unit]; or a sequence of ints


class DataPlane:
    """Per-pool actors over a :class:`PoolSet` and a store. See the module docstring.

    Use as ``async with DataPlane(pools, store) as dp:``. The store is the caller's: the data
    plane never closes it.
    """

    def __init__(self, pools: PoolSet | Mapping[PoolKind, PoolView], store: Store,
                 config: DataPlaneConfig | None = None, *, fingerprint: bytes | None = None,
                 namespace: bytes | str = b"", copies: Mapping[PoolKind, DeviceCopies] | None = None,
                 registry: Any = None, naming: Naming = LIBRARY, label_values: Sequence[str] = ()) -> None:
        """``copies``: a device copy engine per pool (default: a CUDA stream for CUDA pools,
        none for host pools); tests pass ``testing.fakes.FakeDeviceCopies`` here.
        ``registry``: a ``prometheus_client`` registry to export the data path's metrics on
        (:mod:`.metrics`; default none: nothing exported), named by ``naming`` with
        ``label_values`` for its base labels."""
        self.pools = pools if isinstance(pools, PoolSet) else PoolSet(pools)
        self.store = store
        self.config = config or DataPlaneConfig()
        self.fingerprint = fingerprint if fingerprint is not None else self.pools.fingerprint(namespace)
        self.latency = LatencyMonitor(self.config.latency_high_ms, self.config.latency_low_ms)
        #: load bandwidth observed so far (restores that pay for themselves: runtime/dataplane/restore_cost.py)
        self.bandwidth = LoadBandwidth()
        self._threads = WorkerThreads(self.config.copy_threads, "hylinker-copy")
        self.groups = self.config.layer_groups
        self.codecs: dict[PoolKind, list[PoolCodec]] = {
            kind: [PoolCodec(v) for v in view.layer_groups(self.groups)] for kind, view in self.pools.items()}
        self.actors: dict[PoolKind, PoolActor] = {}
        for kind, codecs in self.codecs.items():
            biggest = max(c.payload_bytes for c in codecs)
            frames = max(1, self.config.staging_bytes_per_pool // (biggest + 64))
            self.actors[kind] = PoolActor(
                kind, codecs, store, self.fingerprint, staging_frames=frames,
                queue_depth=self.config.queue_depth, latency=self.latency, threads=self._threads,
                inline_bytes=self.config.inline_copy_bytes, fence_timeout_s=self.config.fence_timeout_s,
                in_place=self.config.in_place,
                in_place_min_bytes=self.config.in_place_min_bytes, copies=None if copies is None else copies.get(kind),
                held_bytes=self.config.verify_all_staging_bytes,
                held_max_bytes=self.config.verify_all_staging_max_bytes, integrity=self.config.integrity)
        #: the two-stage offload's byte budget, shared by the actors (None: offloads in one stage)
        self.host_staging: HostStaging | None = None
        if self.config.two_stage_offload:
            self.host_staging = staging_for(
                "DataPlaneConfig.host_staging_bytes", self.config.host_staging_bytes,
                [(v.capacity // v.unit, len(self.codecs[k]) * self.actors[k].arena.stride) for k, v in self.pools.items()])
            staging = self.host_staging
            staging.region = FrameRegion(store, self._threads, lambda: staging.capacity)
            for actor in self.actors.values():
                actor.stage_through(staging)
        self._tg: anyio.abc.TaskGroup | None = None
        self._closing = False
        self._ids = itertools.count(1)
        self._open: set[_Ticket] = set()  # bounded: tickets in flight; each is discarded when it ends
        self._idle = anyio.Event()
        self._idle.set()
        self._submit_lock = {"load": anyio.Lock(), "offload": anyio.Lock()}
        self._c: dict[str, int] = dict.fromkeys(
            ("loads", "loads_ok", "loads_failed", "loads_cancelled", "offloads", "offloads_ok",
             "offloads_failed", "exists_calls", "exists_errors", "offloads_refused_staging"), 0)
        #: ``fn(direction, seconds, ok)`` when a load or offload ends (not cancelled), on the loop
        self.observers: list[Callable[[str, float, bool], None]] = []
        #: the data path's metrics (None: no registry, or it could not take them: logged once)
        self.metrics: Exporter | None = None
        if registry is not None:
            self.metrics = Exporter.create(registry, naming, PLANE_KEYS, who="DataPlane", base_values=label_values,
                                           figures=self.metric_figures, refresh_on_scrape=True)
        if self.metrics is not None:
            metrics = self.metrics
            self.observers.append(lambda direction, seconds, ok: metrics.observe(f"{direction}_seconds", seconds))

    # ---- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> DataPlane:
        if self._tg is not None or self._closing:
            raise DataPlaneClosedError("a data plane runs once")
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        for actor in self.actors.values():
            self._tg.start_soon(actor.run_offloads)
            self._tg.start_soon(actor.run_loads)
            if actor.host_staging is not None:
                self._tg.start_soon(actor.run_drain)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        with anyio.CancelScope(shield=True):
            await self.close()
        assert self._tg is not None
        tg, self._tg = self._tg, None
        try:
            return await tg.__aexit__(*exc)
        finally:
            self._threads.close()  # every actor has ended: no copy is in flight

    @property
    def running(self) -> bool:
        return self._tg is not None and not self._closing

    def _check_running(self) -> None:
        if self._tg is None:
            raise DataPlaneClosedError("the data plane is not running: use `async with DataPlane(...)`")
        if self._closing:
            raise DataPlaneClosedError("the data plane is closing")

    async def reset(self) -> None:
        """Quiesce: cancel loads that have not started, wait for every transfer in flight."""
        for t in list(self._open):
            if isinstance(t, LoadTicket):
                t.cancel()
        await self.drain()

    async def drain(self) -> None:
        """Wait until every submitted transfer ended."""
        await self._idle.wait()

    async def close(self) -> None:
        """Refuse new work, cancel loads that have not started, wait for the rest; idempotent."""
        if self._closing:
            await self.drain()
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            await self.reset()
        for actor in self.actors.values():
            actor.close_queues()
        if self.metrics is not None:
            self.metrics.close()

    # ---- probe ------------------------------------------------------------------------------
    async def exists(self, keys: Mapping[PoolKind, Sequence[str]]) -> dict[PoolKind, list[bool]]:
        """Which objects the data plane can serve now, per pool: in a draining host-staging
        frame, else in the store, asked in one call (every layer group of an object must be
        present). A store error or a wrong-length answer is a miss for every key it was asked
        about (fail closed), counted as ``exists_errors`` (``runtime/dataplane/probe.py``)."""
        self._check_running()
        return await probe(self, keys)

    # ---- submissions ---------------------------------------------------------------------------
    def _jobs(self, transfers: Sequence[Transfer], fence: DeviceEvent | None, request_id: str,
              hold: bool = False) -> tuple[list[tuple[PoolKind, int, TransferJob]], dict[PoolKind, int]]:
        seen: set[PoolKind] = set()
        jobs: list[tuple[PoolKind, int, TransferJob]] = []
        sizes: dict[PoolKind, int] = {}
        checked: list[tuple[PoolKind, list[str], torch.Tensor]] = []
        for tr in transfers:
            if not isinstance(tr, Transfer):
                raise TypeError(f"expected a Transfer, got {type(tr).__name__}")
            if tr.pool not in self.actors:
                raise PoolViewError(f"no {tr.pool.value} pool in this data plane")
            if tr.pool in seen:
                raise PoolViewError(f"two transfers for pool {tr.pool.value} in one submission")
            seen.add(tr.pool)
            keys = check_keys(tr.keys, tr.pool)
            index = self.pools[tr.pool].objects(tr.index)
            if index.shape[0] != len(keys):
                raise PoolViewError(f"{tr.pool.value}: {len(keys)} keys for {index.shape[0]} objects")
            if keys:
                checked.append((tr.pool, keys, index))
        for pool, keys, index in checked:
            sizes[pool] = len(keys)
            groups = len(self.codecs[pool])
            for g in range(groups):
                names = group_keys(keys, g, groups)
                jobs.append((pool, g, TransferJob(names, index, fence=fence, request_id=request_id, group=g,
                                                  hold=hold)))
        # group-major: every pool's group 0 first, so the first layers land first
        jobs.sort(key=lambda item: item[1])
        return jobs, sizes

    async def load(self, transfers: Sequence[Transfer], *, request_id: str = "",
                   verify_all: bool = False, fence: DeviceEvent | None = None) -> LoadTicket:
        """Queue a load (rows are written only by this load until its ticket is done).
        ``verify_all``: verify every object of the submission before any row is written
        (module docstring). ``fence``: no row is written before it completed (the engine's
        stream is past every use of the rows the load reuses)."""
        ticket = self.prepare_load(transfers, request_id=request_id, verify_all=verify_all, fence=fence)
        await self.submit(ticket)
        return ticket

    async def offload(self, transfers: Sequence[Transfer], *, fence: DeviceEvent | None = None,
                      request_id: str = "") -> OffloadTicket:
        """Queue an offload; its rows are read once ``fence`` completed."""
        ticket = self.prepare_offload(transfers, fence=fence, request_id=request_id)
        await self.submit(ticket)
        return ticket

    def prepare_load(self, transfers: Sequence[Transfer], *, request_id: str = "",
                     verify_all: bool = False, fence: DeviceEvent | None = None) -> LoadTicket:
        """Validate a load and build its ticket without queueing it (then :meth:`submit`):
        a caller holds the ticket before the first await, so a cancelled submission still
        leaves it a ticket that ends."""
        self._check_running()
        jobs, sizes = self._jobs(transfers, fence, request_id, hold=verify_all)
        self._c["loads"] += 1
        return LoadTicket(self, next(self._ids), request_id, jobs, sizes, verify_all=verify_all)

    def prepare_offload(self, transfers: Sequence[Transfer], *, fence: DeviceEvent | None = None,
                        request_id: str = "") -> OffloadTicket:
        """Like :meth:`prepare_load`, for an offload. In two stages its frames' bytes are
        charged to host staging now (released when it ends); a full budget raises
        :class:`HostStagingFullError` and nothing is queued (``offloads_refused_staging``)."""
        self._check_running()
        jobs, sizes = self._jobs(transfers, fence, request_id)
        staged = 0
        if self.host_staging is not None:
            staged = sum(self.actors[pool].drain.frame_bytes(len(job.keys)) for pool, _group, job in jobs)
            if not self.host_staging.try_charge(staged):
                self._c["offloads_refused_staging"] += 1
                raise HostStagingFullError(f"host staging holds {self.host_staging.used} of "
                                           f"{self.host_staging.capacity} bytes; this offload needs {staged}")
        self._c["offloads"] += 1
        return OffloadTicket(self, next(self._ids), request_id, jobs, sizes, staged_bytes=staged)

    def drop_staged(self) -> None:
        """Stop putting staged frames: every offload still waiting for stage 2 ends failed, its
        frames released and counted (``HostStaging.dropped_objects``). For a close that gave up
        waiting on the store; a no-op in one stage."""
        if self.host_staging is not None:
            self.host_staging.dropping = True
            for actor in self.actors.values():
                actor.drop_queued()

    async def submit(self, ticket: LoadTicket | OffloadTicket) -> None:
        """Queue a prepared ticket's jobs (waits while a queue is full). If this is cancelled
        or the plane closes meanwhile, the jobs not yet queued end as failed (a load's as
        cancelled); the ticket ends either way."""
        if ticket.plane is not self or ticket._submitted:
            raise ValueError("a ticket is submitted once, to the plane that prepared it")
        ticket._submitted = True
        ticket.t_submit = time.perf_counter()
        if self._closing:
            self._track(ticket)
            for _pool, _group, job in ticket.jobs:
                if isinstance(ticket, LoadTicket):
                    cancel_job(job)
                else:
                    job.completion.fail(DataPlaneClosedError("the data plane is closing"))
            if not ticket.jobs:
                ticket._finish()
            return
        await self._submit(ticket, "load" if isinstance(ticket, LoadTicket) else "offload")

    def _track(self, ticket: _Ticket) -> None:
        if not self._open:
            self._idle = anyio.Event()
        self._open.add(ticket)
        for pool, group, job in ticket.jobs:
            job.completion.add_callback(functools.partial(_job_ended, ticket, pool, group, job))

    async def _submit(self, ticket: _Ticket, direction: str) -> None:
        if not ticket.jobs:
            ticket._finish()
            return
        self._track(ticket)
        offload = direction == "offload"
        if offload:  # before the first await: the MAMBA backpressure count is never stale
            for pool, _group, job in ticket.jobs:
                self.actors[pool].reserve_offload(job)
        queued = 0
        try:
            async with self._submit_lock[direction]:  # submissions enter the queues in order
                for pool, _group, job in ticket.jobs:
                    actor = self.actors[pool]
                    if direction == "load":
                        await actor.submit_load(job)
                    else:
                        await actor.submit_offload(job)
                    queued += 1
        finally:
            for pool, _group, job in ticket.jobs[queued:]:  # never queued: end them here
                if offload:
                    self.actors[pool].unreserve_offload(job)
                    job.completion.fail(DataPlaneClosedError("the submission was interrupted"))
                else:
                    cancel_job(job)

    def _ticket_ended(self, ticket: _Ticket) -> None:
        self._open.discard(ticket)
        if isinstance(ticket, OffloadTicket) and self.host_staging is not None:
            self.host_staging.release(ticket.staged_bytes)
        assert ticket.outcome is not None
        kind = "loads" if isinstance(ticket, LoadTicket) else "offloads"
        if ticket.outcome.ok:
            self._c[f"{kind}_ok"] += 1
        elif not ticket.outcome.cancelled:
            self._c[f"{kind}_failed"] += 1
        if ticket.t_submit is not None and not ticket.outcome.cancelled:
            seconds = time.perf_counter() - ticket.t_submit
            if kind == "loads" and ticket.outcome.ok:
                self.bandwidth.observe(ticket.nbytes, seconds)
            for observer in self.observers:
                observer("load" if kind == "loads" else "offload", seconds, ticket.outcome.ok)
        if self.metrics is not None:
            self.metrics.publish()
        if not self._open:
            self._idle.set()

    def object_bytes(self, pool: PoolKind) -> int:
        """Payload bytes of one object of ``pool`` (all its layer groups)."""
        return sum(c.payload_bytes for c in self.codecs[pool])

    def store_keys(self, pool: PoolKind, key: str) -> list[str]:
        """The store keys that hold object ``key`` of ``pool`` (one per layer group)."""
        g = len(self.codecs[pool])
        return [group_key(key, j, g) for j in range(g)]

    # ---- inspection ---------------------------------------------------------------------------
    def pending_objects(self, pool: PoolKind) -> int:
        """Objects of ``pool`` in queued or running offloads (MAMBA: states held for writing)."""
        return self.actors[pool].pending_states if pool is PoolKind.MAMBA else self.actors[pool].offload_q.depth

    def backpressure(self) -> Backpressure:
        """What offload backpressure reads, now: pending MAMBA states, the store-latency
        monitor's state (its drop watermark updated first), whether the store's breaker is open."""
        mamba = self.actors.get(PoolKind.MAMBA)
        dropping = self.latency.should_drop()
        return Backpressure(pending_states=0 if mamba is None else mamba.pending_states,
                            latency_ema_ms=self.latency.ema_ms, dropping=dropping,
                            breaker_open=isinstance(self.store, ResilientStore) and self.store.breaker_open)

    def statistics(self) -> DataPlaneStatistics:
        return DataPlaneStatistics(**self._c)

    def pool_statistics(self) -> dict[str, PoolActorStatistics]:
        return {k.value: a.statistics() for k, a in self.actors.items()}

    def metric_figures(self) -> Figures:
        """The data path's figures for :mod:`.metrics`: per pool, by outcome, the store's, what runs."""
        res = self.store.resilience() if isinstance(self.store, ResilientStore) else None
        return {**plane_figures(self.pool_statistics(), self.statistics()), **store_figures(res),
                **store_identity_figures(self.store, self.config.integrity.value)}


def _job_ended(ticket: _Ticket, pool: PoolKind, group: int, job: TransferJob, _done: object) -> None:
    ticket._job_ended(pool, group, job)


__all__ = [
    "DataPlane",
    "DataPlaneClosedError",
    "DataPlaneConfig",
    "LoadTicket",
    "OffloadTicket",
    "Transfer",
    "TransferOutcome",
    "group_key",
]
