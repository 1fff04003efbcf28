"""Tickets: one submission's jobs, its outcome, and (loads) its layers as they land.

A :class:`DataPlane` hands out a :class:`LoadTicket` or an :class:`OffloadTicket` per
submission; the pool actors end its jobs, and the ticket turns the jobs' results into one
:class:`TransferOutcome` (per-object flags, faults) and, for a load, into per-layer readiness
(every job feeding a layer landed and verified; verify-all loads land only when every job
verified). The contract is the data plane's (``runtime/dataplane/plane.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import attrs

from ...components.layout import PoolKind
from ...stores.condemned import Condemned
from .events import FenceError
from .tracing import trace
from .transfer_jobs import CANCELLED, STORED, LoadResult, OffloadResult, TransferJob, cancel_job

if TYPE_CHECKING:
    from .plane import DataPlane


@attrs.frozen
class TransferOutcome:
    """What one submission did. ``objects[pool][i]``: object ``i`` landed and verified (load)
    or reached the store (offload, ``OK`` or ``EXISTS``) in every layer group."""

    ok: bool
    objects: dict[PoolKind, list[bool]]
    faults: dict[str, int]  # reason -> objects (load: missing, bad_checksum, ...; offload: full, ...)
    cancelled: bool = False
    #: load: the objects it proved bad (failed verification after the re-read), by store key;
    #: the only objects a reader may remove, and only as they were (``stores/condemned.py``)
    condemned: dict[str, Condemned] = attrs.field(factory=dict)



class _Ticket:
    """Shared by load and offload tickets: the jobs of one submission and their outcome."""

    def __init__(self, plane: DataPlane, ticket_id: int, request_id: str,
                 jobs: list[tuple[PoolKind, int, TransferJob]], sizes: dict[PoolKind, int]) -> None:
        self.plane = plane
        self.id = ticket_id
        self.request_id = request_id
        self.jobs = jobs  # (pool, group, job)
        self._sizes = sizes  # objects per pool
        self._left = len(jobs)
        self._done = anyio.Event()
        self._outcome: TransferOutcome | None = None
        self._done_callbacks: list[Callable[[TransferOutcome], None]] = []
        self._submitted = False
        self.t_submit: float | None = None  # perf_counter at submit: the latency metrics
        self.nbytes = sum(n * plane.object_bytes(pool) for pool, n in sizes.items())  # payload bytes

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def outcome(self) -> TransferOutcome | None:
        return self._outcome

    async def wait(self) -> TransferOutcome:
        """The submission's outcome, once every job of it ended."""
        await self._done.wait()
        assert self._outcome is not None
        return self._outcome

    def add_done_callback(self, fn: Callable[[TransferOutcome], None]) -> None:
        """``fn(outcome)`` on the loop when the submission ends (now, if it has)."""
        if self._outcome is not None:
            fn(self._outcome)
        else:
            self._done_callbacks.append(fn)

    def _job_ended(self, pool: PoolKind, group: int, job: TransferJob) -> None:
        self._left -= 1
        if self._left == 0:
            self._finish()

    def _per_object(self, pool: PoolKind, job: TransferJob) -> tuple[list[bool], dict[str, int]]:
        raise NotImplementedError

    def _finish(self) -> None:
        objects: dict[PoolKind, list[bool]] = {p: [True] * n for p, n in self._sizes.items()}
        faults: dict[str, int] = {}
        cancelled = False
        condemned: dict[str, Condemned] = {}
        for pool, _group, job in self.jobs:
            condemned.update(job.condemned)
            ok, f = self._per_object(pool, job)
            objects[pool] = [a and b for a, b in zip(objects[pool], ok)]
            for k, v in f.items():
                faults[k] = faults.get(k, 0) + v
            cancelled = cancelled or job.cancelled
        ok_all = not cancelled and all(all(v) for v in objects.values())
        self._outcome = TransferOutcome(ok_all, objects, faults, cancelled, condemned)
        self._done.set()
        self.plane._ticket_ended(self)
        callbacks, self._done_callbacks = self._done_callbacks, []
        for fn in callbacks:
            fn(self._outcome)


class LoadTicket(_Ticket):
    """A submitted load: await it whole (:meth:`wait`) or per model layer (:meth:`wait_layer`)."""

    def __init__(self, plane: DataPlane, ticket_id: int, request_id: str,
                 jobs: list[tuple[PoolKind, int, TransferJob]], sizes: dict[PoolKind, int], *,
                 verify_all: bool = False) -> None:
        super().__init__(plane, ticket_id, request_id, jobs, sizes)
        self.verify_all = verify_all
        self._land_error: BaseException | None = None
        self._feeds: dict[int, int] = {}  # layer -> jobs feeding it still pending
        for pool, group, _job in jobs:
            for layer in plane.codecs[pool][group].layer_ids:
                self._feeds[layer] = self._feeds.get(layer, 0) + 1
        self._layer_events = {layer: anyio.Event() for layer in self._feeds}
        self._landed: set[int] = set()
        self._layer_callbacks: list[Callable[[int, bool], None]] = []

    @property
    def from_staging(self) -> int:
        """Objects this load copied from draining host-staging frames: landed, verified, but
        the store had not acknowledged them (the caller must not count them as stored)."""
        return sum(job.from_staging for _pool, _group, job in self.jobs)

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self._feeds)

    @property
    def started(self) -> bool:
        """Whether a worker took any of this load's jobs (then it can no longer be cancelled)."""
        return any(job.started for _, _, job in self.jobs)

    def cancel(self) -> bool:
        """Cancel the load if none of its jobs started: True, and no row is ever written.
        False if it already started or ended (it then runs to its outcome)."""
        if self.done or self.started:
            return False
        self.plane._c["loads_cancelled"] += 1
        trace("data.load.cancelled", request_id=self.request_id, ticket=self.id)
        for _, _, job in self.jobs:  # ends now; the workers skip the jobs still queued
            cancel_job(job)
        return True

    async def wait_layer(self, layer_id: int) -> bool:
        """Wait until ``layer_id``'s data landed (True) or the load ended without it (False)."""
        if layer_id not in self._layer_events:
            raise KeyError(f"layer {layer_id} is not restored by this load")
        await self._layer_events[layer_id].wait()
        return layer_id in self._landed

    def add_layer_callback(self, fn: Callable[[int, bool], None]) -> None:
        """``fn(layer_id, landed)`` on the loop once per layer: True when it landed, False
        when the load ended without it. Layers already settled are reported now."""
        for layer, ev in self._layer_events.items():
            if ev.is_set():
                fn(layer, layer in self._landed)
        self._layer_callbacks.append(fn)

    def _settle_layer(self, layer: int, landed: bool) -> None:
        ev = self._layer_events[layer]
        if ev.is_set():
            return
        if landed:
            self._landed.add(layer)
        ev.set()
        for fn in self._layer_callbacks:
            fn(layer, landed)

    def _job_ended(self, pool: PoolKind, group: int, job: TransferJob) -> None:
        if self.verify_all:
            self._left -= 1
            if self._left == 0:  # every job verified (or failed): land all or nothing
                if self._good(job) and all(self._good(j) for _, _, j in self.jobs) and self.plane._tg is not None:
                    self.plane._tg.start_soon(self._land)
                else:
                    self._release()
                    self._finish()
            return
        if self._good(job):  # a layer lands when every job feeding it (pools, groups) landed verified
            for layer in self.plane.codecs[pool][group].layer_ids:
                self._feed(layer)
        super()._job_ended(pool, group, job)

    @staticmethod
    def _good(job: TransferJob) -> bool:
        res = job.completion.value
        return job.completion.error is None and isinstance(res, LoadResult) and res.all_ok and not job.cancelled

    def _feed(self, layer: int) -> None:
        self._feeds[layer] -= 1
        if self._feeds[layer] == 0:
            self._settle_layer(layer, True)

    async def _land(self) -> None:
        """verify_all: every object verified; write the rows job by job (group-major, so the
        first layers land first), each layer reported as its rows are written."""
        try:
            with anyio.CancelScope(shield=True):  # rows are never left half written by a cancel
                for pool, _group, job in self.jobs:
                    await self.plane.actors[pool].land_held(job, self._feed)
        except Exception as exc:  # a bug or a device error: the load fails, the engine recomputes
            self._land_error = exc
            trace("data.load.land_error", request_id=self.request_id, error=repr(exc))
        finally:
            self._release()
            self._finish()

    def _release(self) -> None:
        for pool, _group, job in self.jobs:
            self.plane.actors[pool].release_held(job)

    def _finish(self) -> None:
        super()._finish()
        for layer in self._layer_events:  # a failed or cancelled load releases every waiter
            self._settle_layer(layer, False)

    def _per_object(self, pool: PoolKind, job: TransferJob) -> tuple[list[bool], dict[str, int]]:
        if job.cancelled:
            return [False] * len(job.keys), {CANCELLED: len(job.keys)}
        if self._land_error is not None:
            return [False] * len(job.keys), {"land_error": len(job.keys)}
        res = job.completion.value
        if job.completion.error is not None or not isinstance(res, LoadResult):
            reason = "fence" if isinstance(job.completion.error, FenceError) else "error"
            return [False] * len(job.keys), {reason: len(job.keys)}
        return list(res.ok), dict(res.faults)


class OffloadTicket(_Ticket):
    """A submitted offload; :meth:`wait` gives which objects reached the store. In two stages
    (``DataPlaneConfig.two_stage_offload``) :meth:`copied` returns once its rows are free."""

    def __init__(self, plane: DataPlane, ticket_id: int, request_id: str,
                 jobs: list[tuple[PoolKind, int, TransferJob]], sizes: dict[PoolKind, int], *,
                 staged_bytes: int = 0) -> None:
        super().__init__(plane, ticket_id, request_id, jobs, sizes)
        self.staged_bytes = staged_bytes  # host staging charged for its frames, released when it ends
        self._copying = {id(job) for _, _, job in jobs}  # jobs whose rows are still read
        self._copied = anyio.Event()
        if not self._copying:
            self._copied.set()
        for _, _, job in jobs:
            job.copied.add_callback(functools.partial(self._job_copied, job))
            job.completion.add_callback(functools.partial(self._job_copied, job))

    @property
    def two_stage(self) -> bool:
        """Whether its rows are freed before the store answers (:meth:`copied`)."""
        return self.plane.host_staging is not None

    def in_frames(self, pool: PoolKind) -> bool:
        """Whether every job of ``pool`` was copied into indexed frames (restorable from host
        staging until the store answered): its states may be evicted once :meth:`copied`."""
        jobs = [job for p, _group, job in self.jobs if p is pool]
        return bool(jobs) and all(job.in_frames for job in jobs)

    async def copied(self) -> None:
        """Return once no job of this offload reads its rows any more: each copied them into
        sealed host frames (stage 1) or ended. The rows and states may be reused from then on;
        the store's answer is still :meth:`wait`'s."""
        await self._copied.wait()

    def _job_copied(self, job: TransferJob, _done: object) -> None:
        self._copying.discard(id(job))
        if not self._copying:
            self._copied.set()

    def _per_object(self, pool: PoolKind, job: TransferJob) -> tuple[list[bool], dict[str, int]]:
        res = job.completion.value
        if job.completion.error is not None or not isinstance(res, OffloadResult):
            reason = "fence" if isinstance(job.completion.error, FenceError) else "error"
            return [False] * len(job.keys), {reason: len(job.keys)}
        faults: dict[str, int] = {}
        for o in res.outcomes:
            if o not in STORED:
                faults[o.value] = faults.get(o.value, 0) + 1
        return [o in STORED for o in res.outcomes], faults
