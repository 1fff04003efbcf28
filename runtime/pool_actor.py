"""One actor per pool: bounded offload and load queues over a store.

Each actor runs two workers, one per direction, so a restore never waits behind a backlog
of offloads. A worker takes jobs in FIFO order and finishes one before the next, so every
job gets exactly one result, in submission order. Per job it

1. awaits the job's device fence (offload: the forward that wrote the rows is done);
2. moves the objects through its own staging arena, a sub-batch at a time: gather + frame
   (offload) or get + verify + scatter (load) — copies run in a worker thread so the event
   loop keeps serving;
3. reports per-object outcomes.

The arena is registered with the store once (zero-copy backends read and write it directly)
and stays alive as long as the actor: a store call that outlives a cancelled waiter still
writes into live memory.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
import attrs
import numpy as np
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..components.layout import PoolKind
from ..stores import framing
from ..stores.base import (
    GetResult,
    Outcome,
    Store,
    StoreError,
    supports_checksums,
    supports_scatter,
)
from .device import DeviceCopies, copies_for
from .events import DeviceEvent, wait_fence
from .statistics import PoolActorStatistics, QueueStatistics
from .tracing import trace
from .transfer import PoolCodec

T = TypeVar("T")
_FRAME_FAULTS = frozenset(f.value for f in framing.FrameFault)


class Completion(Generic[T]):
    """A one-shot result slot that async code can await."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Completion[T]], None]] = []

    def set(self, value: T) -> None:
        """Set the result; the first ``set`` or ``fail`` wins, later ones are ignored."""
        if self._event.is_set():
            return
        self._value = value
        self._event.set()
        self._run_callbacks()

    def fail(self, error: BaseException) -> None:
        if self._event.is_set():
            return
        self._error = error
        self._event.set()
        self._run_callbacks()

    def add_callback(self, fn: Callable[[Completion[T]], None]) -> None:
        """Call ``fn(self)`` on the loop once the result is set (now, if it already is)."""
        if self._event.is_set():
            fn(self)
        else:
            self._callbacks.append(fn)

    def _run_callbacks(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def value(self) -> T | None:
        return self._value

    @property
    def done(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> T:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


IN_PLACE_CALL_BYTES = 64 << 20
"""The most object bytes one in-place store call moves over a checksumming store (~10 ms of
copying here: a thread hop per call costs well under 1% of it)."""

STORED = (Outcome.OK, Outcome.EXISTS)  # the object is in the store either way


@attrs.frozen
class OffloadResult:
    outcomes: list[Outcome]

    @property
    def ok(self) -> bool:
        return all(o in STORED for o in self.outcomes)


@attrs.frozen
class LoadResult:
    ok: list[bool]  # object i landed and verified
    faults: dict[str, int]  # reason -> count for objects that did not

    @property
    def all_ok(self) -> bool:
        return all(self.ok)


CANCELLED = "cancelled"  # LoadResult fault: the job was cancelled before it started


@attrs.define(eq=False)
class TransferJob:
    keys: list[str]
    index: torch.Tensor  # [n, per]
    fence: DeviceEvent | None = None
    on_layer: Callable[[int], None] | None = None
    completion: Completion[object] = attrs.field(factory=Completion)
    request_id: str = ""
    group: int = 0  # which layer group's codec moves this job's objects
    started: bool = False  # a worker took it: it can no longer be cancelled
    cancelled: bool = False  # cancelled before it started: it ends without touching rows
    #: verify-all-then-land (a load): the worker gets and verifies into ``staged`` and writes
    #: no row; the load's ticket lands every job's ``staged`` once all of them verified
    hold: bool = False
    staged: torch.Tensor | None = None  # [n, stride] verified frames of a held load
    staged_in_arena: bool = False  # ``staged`` is the actor's registered held arena
    in_rows: bool = False  # a held job moved in place: its rows hold it, verified, not reported


def cancel_job(job: TransferJob) -> None:
    """End a load job that has not started: no row is touched, every object reads cancelled."""
    job.cancelled = True
    job.completion.set(LoadResult([False] * len(job.keys), {CANCELLED: len(job.keys)}))


class LatencyMonitor:
    """EMA of store-call latency with a high/low watermark (hysteresis).

    While dropping, no offloads reach the store, so the EMA also decays with wall time
    (half-life ``decay_half_life_s``) to let the state end even without new samples.
    """

    def __init__(self, high_ms: float, low_ms: float, alpha: float = 0.2,
                 decay_half_life_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < low_ms <= high_ms:
            raise ValueError(f"need 0 < low_ms <= high_ms, got low={low_ms} high={high_ms}")
        self.high_ms, self.low_ms, self.alpha = high_ms, low_ms, alpha
        self.half_life = decay_half_life_s
        self.clock = clock
        self._ema_ms = 0.0
        self._stamp = clock()
        self.dropping = False

    def observe(self, seconds: float) -> None:
        self._decay()
        self._ema_ms += self.alpha * (seconds * 1e3 - self._ema_ms)
        self._update()

    @property
    def ema_ms(self) -> float:
        self._decay()
        return self._ema_ms

    def should_drop(self) -> bool:
        self._decay()
        self._update()
        return self.dropping

    def _decay(self) -> None:
        now = self.clock()
        dt = now - self._stamp
        self._stamp = now
        if dt > 0 and self.dropping:
            self._ema_ms *= math.pow(0.5, dt / self.half_life)

    def _update(self) -> None:
        if not self.dropping and self._ema_ms > self.high_ms:
            self.dropping = True
        elif self.dropping and self._ema_ms < self.low_ms:
            self.dropping = False


class _Queue:
    """A bounded FIFO of jobs with statistics."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.tx: MemoryObjectSendStream[TransferJob]
        self.rx: MemoryObjectReceiveStream[TransferJob]
        self.tx, self.rx = anyio.create_memory_object_stream[TransferJob](bound)
        self.depth = 0
        self.waiting = 0
        self.completed = 0
        self.failed = 0

    async def put(self, job: TransferJob) -> None:
        self.waiting += 1
        try:
            await self.tx.send(job)
        finally:
            self.waiting -= 1
        self.depth += 1

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(self.depth, self.bound, self.waiting, self.completed, self.failed)


class PoolActor:
    """Moves one pool's objects between device rows and the store. See the module doc."""

    def __init__(
        self,
        kind: PoolKind,
        codecs: Sequence[PoolCodec],
        store: Store,
        fingerprint: bytes,
        *,
        staging_frames: int,
        queue_depth: int,
        latency: LatencyMonitor,
        thread_limiter: anyio.CapacityLimiter,
        inline_bytes: int = 1 << 20,
        fence_timeout_s: float | None = None,
        in_place: bool = True,
        in_place_min_bytes: int = 0,
        copies: DeviceCopies | None = None,
        held_bytes: int = 0,
    ) -> None:
        if not codecs:
            raise ValueError("a pool actor needs at least one codec")
        self.kind = kind
        self.codecs = list(codecs)  # one per layer group
        self.codec = self.codecs[0]
        # device pools: copies on the actor's own stream through pinned staging (runtime/device.py)
        self.copies = copies if copies is not None else copies_for(self.codec.device)
        if self.copies is not None:
            for c in self.codecs:
                c.use_device_path()
        self.store = store
        self.fingerprint = fingerprint
        self.frame_sizes = [framing.framed_size(c.payload_bytes) for c in self.codecs]
        self.frame_bytes = max(self.frame_sizes)
        # 64-byte aligned frames; one arena per direction so loads never wait for offloads
        stride = -(-self.frame_bytes // 64) * 64
        self.stride = stride
        self.frames = max(2, staging_frames)
        # objects per sub-batch: two halves, double buffered, at most 32 MiB each
        self.batch = max(1, min(self.frames // 2, (32 << 20) // stride))
        # filled once here so first use does not pay page faults on the hot path
        def new_arena(nbytes: int = 0) -> torch.Tensor:
            n = nbytes or self.frames * stride
            buf = self.copies.staging(n) if self.copies is not None else torch.empty(n, dtype=torch.uint8)
            return buf.fill_(0)

        self._arenas = {d: new_arena() for d in ("offload", "load")}
        self._new_arena = new_arena
        self._held_arena: torch.Tensor | None = None  # verify-all-then-land loads
        self._held_busy = False  # it carries a verified load waiting to land
        if held_bytes:  # sized by the engine, ready before the first load
            self._held_arena = new_arena(-(-held_bytes // stride) * stride)
            store.register(self._held_arena)
        self._arenas_np = {d: a.numpy() for d, a in self._arenas.items()}
        for arena in self._arenas.values():
            store.register(arena)
        # in place: the store reads and writes host pool rows directly (checksums over the
        # rows), so a transfer makes one pass over the bytes instead of three
        # ... for objects of at least ``in_place_min_bytes``; smaller ones go staged. One
        # decision per layer group (its object size), made here and read by both directions
        able = supports_scatter(store) and self.codec.device.type == "cpu" and in_place and self.copies is None
        self.in_place_groups = [able and c.payload_bytes >= in_place_min_bytes for c in self.codecs]
        self.scatter = any(self.in_place_groups)
        # a store that checksums while it copies (framing.copy_checksummed): headers only on
        # offload, the landed checksum on load; the bytes cross memory once less per transfer
        # (in place: once in all), no separate hash pass over rows or staging
        self.store_checksums = supports_checksums(store)
        if self.scatter:
            moved = [c for c, yes in zip(self.codecs, self.in_place_groups, strict=True) if yes]
            for region in {id(t): t for c in moved for t in c.regions()}.values():
                store.register(region)
        self.offload_q = _Queue(queue_depth)
        self.load_q = _Queue(queue_depth)
        self.latency = latency
        self.limiter = thread_limiter
        self.inline_bytes = inline_bytes
        self.fence_timeout_s = fence_timeout_s
        self.pending_states = 0
        self._c = dict(objects_offloaded=0, objects_already_stored=0, bytes_offloaded=0,
                       offload_failures=0, objects_loaded=0, bytes_loaded=0, load_misses=0,
                       load_failures=0, verify_failures=0)

    # ---- submission ----------------------------------------------------------------
    def reserve_offload(self, job: TransferJob) -> None:
        """Count a MAMBA job's states as pending now, before the submitter's first await (the
        backpressure rule reads this count); the worker uncounts them when the job ends, and
        :meth:`unreserve_offload` does if it is never queued."""
        if self.kind is PoolKind.MAMBA:
            self.pending_states += len(job.keys)

    def unreserve_offload(self, job: TransferJob) -> None:
        if self.kind is PoolKind.MAMBA:
            self.pending_states -= len(job.keys)

    async def submit_offload(self, job: TransferJob) -> None:
        """Queue a job reserved with :meth:`reserve_offload` (waits while the queue is full)."""
        await self.offload_q.put(job)

    async def submit_load(self, job: TransferJob) -> None:
        await self.load_q.put(job)

    def close_queues(self) -> None:
        self.offload_q.tx.close()
        self.load_q.tx.close()

    # ---- workers -------------------------------------------------------------------
    async def run_offloads(self) -> None:
        await self._serve(self.offload_q, self._offload, counts_states=self.kind is PoolKind.MAMBA)

    async def run_loads(self) -> None:
        await self._serve(self.load_q, self._load, counts_states=False)

    async def _serve(self, queue: _Queue, work: Callable[[TransferJob], Awaitable[object]],
                     *, counts_states: bool) -> None:
        """One worker: jobs in FIFO order, one at a time, exactly one result each."""
        async with queue.rx:
            async for job in queue.rx:
                if job.cancelled:  # cancelled before it started (and already ended): skip it
                    queue.depth -= 1
                    cancel_job(job)
                    continue
                try:
                    job.started = True
                    with anyio.CancelScope(shield=True):  # never abandon a store call mid-flight
                        result = await work(job)
                except Exception as exc:
                    queue.failed += 1
                    job.completion.fail(exc)
                else:
                    queue.completed += 1
                    job.completion.set(result)
                finally:
                    queue.depth -= 1
                    if counts_states:
                        self.pending_states -= len(job.keys)

    def _views(self, direction: str, half: int, n: int, size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Frames of ``size`` bytes in one half of a direction's arena (double buffering)."""
        arena = self._arenas[direction]
        base = half * self.batch * self.stride
        grid = arena[base: base + n * self.stride].view(n, self.stride)
        frames = [arena[base + i * self.stride: base + i * self.stride + size] for i in range(n)]
        return grid, frames

    def _np_frames(self, direction: str, half: int, n: int, size: int) -> list[np.ndarray]:
        """The same frames as NumPy views: framing and host copies need no tensor per object."""
        arena = self._arenas_np[direction]
        base = half * self.batch * self.stride
        return [arena[base + i * self.stride: base + i * self.stride + size] for i in range(n)]

    def _inline(self, batch: tuple[int, int], size: int) -> bool:
        """Small host copies run on the loop: two thread hops cost more than the copy."""
        return (self.copies is None and self.codec.device.type == "cpu"
                and (batch[1] - batch[0]) * size <= self.inline_bytes)

    def _batches(self, n: int) -> list[tuple[int, int]]:
        return [(lo, min(n, lo + self.batch)) for lo in range(0, n, self.batch)]

    def _in_place_batches(self, n: int) -> list[tuple[int, int]]:
        """Sub-batches of an in-place transfer. Over a store that checksums while copying,
        nothing is left to overlap with the store's copy (no staging, no hash pass), so one
        store call takes as many objects as the store handles well, a half arena has headers
        for, and :data:`IN_PLACE_CALL_BYTES` allow (each extra call is one more thread hop in
        the store; a bounded call stays far inside a resilient store's call timeout)."""
        if not self.store_checksums:
            return self._batches(n)
        per = max(1, min(self.store.capabilities.max_batch,
                         self.batch * self.stride // framing.HEADER_BYTES,
                         IN_PLACE_CALL_BYTES // self.stride))
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]

    async def _offload(self, job: TransferJob) -> OffloadResult:
        """Gather + frame sub-batch k in a thread while sub-batch k-1 is being put."""
        await wait_fence(job.fence, timeout_s=self.fence_timeout_s)
        t0 = time.perf_counter()
        codec, size = self.codecs[job.group], self.frame_sizes[job.group]
        if self.in_place_groups[job.group] and codec.host_path(job.index):
            return await self._offload_in_place(job, codec, size, t0)
        batches = self._batches(len(job.keys))
        results: list[list[Outcome]] = [[] for _ in batches]

        def gather(k: int) -> DeviceEvent | None:
            lo, hi = batches[k]
            grid, _ = self._views("offload", k % 2, hi - lo, size)
            if self.copies is None:
                codec.gather(job.index[lo:hi], grid[:, framing.HEADER_BYTES: size])
                return None
            with self.copies.on_stream():  # device -> pinned staging on the copy stream
                codec.gather(job.index[lo:hi], grid[:, framing.HEADER_BYTES: size])
                return self.copies.record()

        checksums = self.store_checksums
        payload = size - framing.HEADER_BYTES

        def seal(k: int) -> list[torch.Tensor]:
            lo, hi = batches[k]
            _, frames = self._views("offload", k % 2, hi - lo, size)
            for key, f in zip(job.keys[lo:hi], self._np_frames("offload", k % 2, hi - lo, size)):
                if checksums:  # the store sets the checksum as it copies the frame
                    framing.seal_header(f, key, self.fingerprint, payload)
                else:
                    framing.seal_array(f, key, self.fingerprint)
            return frames

        def pack(k: int) -> list[torch.Tensor]:
            gather(k)
            return seal(k)

        async def pack_async(k: int) -> list[torch.Tensor]:
            if self.copies is None:
                return await anyio.to_thread.run_sync(pack, k, limiter=self.limiter)
            ev = await anyio.to_thread.run_sync(gather, k, limiter=self.limiter)
            # never seal (read) staged bytes before the device copy into them finished
            await wait_fence(ev, timeout_s=self.fence_timeout_s)
            return await anyio.to_thread.run_sync(seal, k, limiter=self.limiter)

        async def put(k: int, frames: list[torch.Tensor]) -> None:
            lo, hi = batches[k]
            start = time.perf_counter()
            try:
                if checksums:
                    got = await self.store.put_sealed(  # type: ignore[attr-defined]
                        job.keys[lo:hi], [_split(f) for f in frames])
                else:
                    got = await self.store.put(job.keys[lo:hi], frames)
            except StoreError:
                got = [Outcome.UNREACHABLE] * (hi - lo)
            if len(got) != hi - lo:  # a store that breaks the protocol: nothing is known stored
                got = [Outcome.FAILED] * (hi - lo)
            results[k] = got
            self.latency.observe(time.perf_counter() - start)

        ready: tuple[int, list[torch.Tensor]] | None = None
        for k in range(len(batches)):
            if self._inline(batches[k], size):
                frames = pack(k)  # small: cheaper than two thread hops
                if ready is not None:
                    await put(*ready)
            else:
                async with anyio.create_task_group() as tg:
                    if ready is not None:
                        tg.start_soon(put, *ready)
                    frames = await pack_async(k)
            ready = (k, frames)
        if ready is not None:
            await put(*ready)
        outcomes = [o for r in results for o in r]
        return self._offloaded(job, outcomes, size, t0)

    def _offloaded(self, job: TransferJob, outcomes: list[Outcome], size: int, t0: float) -> OffloadResult:
        for o in outcomes:
            if o is Outcome.OK:
                self._c["objects_offloaded"] += 1
                self._c["bytes_offloaded"] += size
            elif o is Outcome.EXISTS:
                self._c["objects_already_stored"] += 1
            else:
                self._c["offload_failures"] += 1
        trace("offload", pool=self.kind.value, request_id=job.request_id, objects=len(job.keys),
              bytes=len(job.keys) * size, us=round((time.perf_counter() - t0) * 1e6),
              failures=sum(o not in (Outcome.OK, Outcome.EXISTS) for o in outcomes))
        return OffloadResult(outcomes)

    async def _load(self, job: TransferJob) -> LoadResult:
        """Get sub-batch k while sub-batch k-1 is verified and scattered in a thread."""
        # the engine's stream must be past every use of the rows this load reuses
        await wait_fence(job.fence, timeout_s=self.fence_timeout_s)
        faults: dict[str, int] = {}
        t0 = time.perf_counter()
        codec, size = self.codecs[job.group], self.frame_sizes[job.group]
        if job.hold:
            return await self._load_held(job, codec, size, t0)
        if self.in_place_groups[job.group] and codec.host_path(job.index):
            return await self._load_in_place(job, codec, size, t0)
        batches = self._batches(len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]
        checksums = self.store_checksums

        def unpack(k: int, results: list[GetResult]) -> DeviceEvent | None:
            """Verify sub-batch k in staging and land it; on a device, returns the event that
            completes when the copies into the rows are done."""
            lo, hi = batches[k]
            frames = self._np_frames("load", k % 2, hi - lo, size)
            index = job.index[lo:hi]
            # host pools: land each object right after verifying it, while it is still in cache
            fused = codec.host_path(index)
            rows = index[:, 0].tolist()
            ok: list[bool] = []
            for i, (key, f, r) in enumerate(zip(job.keys[lo:hi], frames, results)):
                if r.outcome is not Outcome.OK:
                    faults[r.outcome.value] = faults.get(r.outcome.value, 0) + 1
                    ok.append(False)
                    continue
                if checksums and r.checksum is None:  # a store that broke its word: trust nothing
                    faults[Outcome.FAILED.value] = faults.get(Outcome.FAILED.value, 0) + 1
                    ok.append(False)
                    continue
                try:
                    payload = framing.verify_array(f, r.nbytes, key, self.fingerprint,
                                                   landed_checksum=r.checksum if checksums else None)
                except framing.FrameError as exc:
                    faults[exc.fault.value] = faults.get(exc.fault.value, 0) + 1
                    ok.append(False)
                    continue
                if fused:
                    codec.scatter_one(payload, rows[i])
                ok.append(True)
            good[k] = ok
            if fused:
                return None
            grid, _ = self._views("load", k % 2, hi - lo, size)
            sel = [i for i, g in enumerate(ok) if g]
            with self.copies.on_stream() if self.copies is not None else contextlib.nullcontext():
                if len(sel) == len(ok):
                    codec.scatter(grid[:, framing.HEADER_BYTES: size], index, None)
                elif sel:
                    pick = torch.tensor(sel, dtype=torch.int64)
                    codec.scatter(grid[pick, framing.HEADER_BYTES: size], index[pick], None)
                return self.copies.record() if self.copies is not None else None

        async def land(k: int, results: list[GetResult]) -> None:
            ev = await anyio.to_thread.run_sync(unpack, k, results, limiter=self.limiter)
            # landed only once the device copies finished; the staging half is reused after
            await wait_fence(ev, timeout_s=self.fence_timeout_s)

        async def get(k: int) -> list[GetResult]:
            lo, hi = batches[k]
            _, frames = self._views("load", k % 2, hi - lo, size)
            start = time.perf_counter()
            try:
                if checksums:
                    results = await self.store.get_checked(  # type: ignore[attr-defined]
                        job.keys[lo:hi], [_split(f) for f in frames])
                else:
                    results = await self.store.get(job.keys[lo:hi], frames)
            except StoreError:
                results = [GetResult(Outcome.UNREACHABLE)] * (hi - lo)
            if len(results) != hi - lo:  # a store that breaks the protocol: trust nothing
                results = [GetResult(Outcome.FAILED)] * (hi - lo)
            self.latency.observe(time.perf_counter() - start)
            return results

        landed: tuple[int, list[GetResult]] | None = None
        for k in range(len(batches)):
            async with anyio.create_task_group() as tg:
                if landed is not None:
                    if self._inline(batches[landed[0]], size):
                        unpack(*landed)
                    else:
                        tg.start_soon(land, *landed)
                results = await get(k)
            landed = (k, results)
        if landed is not None:
            if self._inline(batches[landed[0]], size):
                unpack(*landed)
            else:
                await land(*landed)
        ok = [g for batch in good for g in batch]
        if job.on_layer is not None and all(ok):  # every object of the job landed
            for layer in codec.layer_ids:
                job.on_layer(layer)
        return self._loaded(job, ok, faults, size, t0)

    def _loaded(self, job: TransferJob, ok: list[bool], faults: dict[str, int], size: int,
                t0: float) -> LoadResult:
        n_ok = sum(ok)
        self._c["objects_loaded"] += n_ok
        self._c["bytes_loaded"] += n_ok * size
        self._c["load_misses"] += faults.get(Outcome.MISSING.value, 0)
        verify = sum(v for k, v in faults.items() if k in _FRAME_FAULTS)
        self._c["verify_failures"] += verify
        self._c["load_failures"] += len(ok) - n_ok - faults.get(Outcome.MISSING.value, 0) - verify
        trace("load", pool=self.kind.value, request_id=job.request_id, objects=len(job.keys),
              ok=n_ok, faults=faults, us=round((time.perf_counter() - t0) * 1e6))
        return LoadResult(ok, faults)

    # ---- in place: the store reads and writes the pool rows (scatter-gather) ----------------
    def _headers(self, direction: str, half: int, n: int) -> tuple[list[torch.Tensor], list[np.ndarray]]:
        """``n`` 64-byte header buffers in one half of a direction's arena."""
        base = half * self.batch * self.stride
        arena, arena_np = self._arenas[direction], self._arenas_np[direction]
        hb = framing.HEADER_BYTES
        return ([arena[base + i * hb: base + (i + 1) * hb] for i in range(n)],
                [arena_np[base + i * hb: base + (i + 1) * hb] for i in range(n)])

    async def _offload_in_place(self, job: TransferJob, codec: PoolCodec, size: int, t0: float) -> OffloadResult:
        """Seal headers over the pool rows (checksum in place) for sub-batch k while k-1 is
        put straight from the rows: no staging copy."""
        batches = self._in_place_batches(len(job.keys))
        results: list[list[Outcome]] = [[] for _ in batches]
        starts = job.index[:, 0].tolist()

        checksums = self.store_checksums
        payload = size - framing.HEADER_BYTES

        def pack(k: int) -> list[list[torch.Tensor]]:
            lo, hi = batches[k]
            heads, heads_np = self._headers("offload", k % 2, hi - lo)
            parts: list[list[torch.Tensor]] = []
            for i, (key, r0) in enumerate(zip(job.keys[lo:hi], starts[lo:hi])):
                pieces = codec.pieces(r0)
                if checksums:  # the store sets the checksum as it copies the rows
                    framing.seal_header(heads_np[i], key, self.fingerprint, payload)
                else:
                    framing.seal_parts(heads_np[i], [p.numpy() for p in pieces], key, self.fingerprint)
                parts.append([heads[i], *pieces])
            return parts

        async def put(k: int, parts: list[list[torch.Tensor]]) -> None:
            lo, hi = batches[k]
            start = time.perf_counter()
            try:
                if checksums:
                    got = await self.store.put_sealed(job.keys[lo:hi], parts)  # type: ignore[attr-defined]
                else:
                    got = await self.store.put_parts(job.keys[lo:hi], parts)  # type: ignore[attr-defined]
            except StoreError:
                got = [Outcome.UNREACHABLE] * (hi - lo)
            if len(got) != hi - lo:
                got = [Outcome.FAILED] * (hi - lo)
            results[k] = got
            self.latency.observe(time.perf_counter() - start)

        ready: tuple[int, list[list[torch.Tensor]]] | None = None
        for k in range(len(batches)):
            if self._inline(batches[k], size):
                parts = pack(k)
                if ready is not None:
                    await put(*ready)
            else:
                async with anyio.create_task_group() as tg:
                    if ready is not None:
                        tg.start_soon(put, *ready)
                    parts = await anyio.to_thread.run_sync(pack, k, limiter=self.limiter)
            ready = (k, parts)
        if ready is not None:
            await put(*ready)
        return self._offloaded(job, [o for r in results for o in r], size, t0)

    async def _load_in_place(self, job: TransferJob, codec: PoolCodec, size: int, t0: float) -> LoadResult:
        """Get sub-batch k straight into the pool rows while sub-batch k-1 is verified there.

        A failed object may leave partial bytes in its rows; the load then reports it failed
        (and no layer of it landed), so the engine never uses those rows."""
        faults: dict[str, int] = {}
        batches = self._in_place_batches(len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]
        starts = job.index[:, 0].tolist()
        pieces_of: dict[int, list[list[torch.Tensor]]] = {}
        checksums = self.store_checksums

        async def get(k: int) -> list[GetResult]:
            lo, hi = batches[k]
            heads, _ = self._headers("load", k % 2, hi - lo)
            pieces = [codec.pieces(r0) for r0 in starts[lo:hi]]
            pieces_of[k] = pieces
            start = time.perf_counter()
            call = self.store.get_checked if checksums else self.store.get_parts  # type: ignore[attr-defined]
            try:
                results = await call(job.keys[lo:hi], [[h, *p] for h, p in zip(heads, pieces)])
            except StoreError:
                results = [GetResult(Outcome.UNREACHABLE)] * (hi - lo)
            if len(results) != hi - lo:
                results = [GetResult(Outcome.FAILED)] * (hi - lo)
            self.latency.observe(time.perf_counter() - start)
            return results

        def verify(k: int, results: list[GetResult]) -> None:
            lo, hi = batches[k]
            _, heads_np = self._headers("load", k % 2, hi - lo)
            ok: list[bool] = []
            for key, h, p, r in zip(job.keys[lo:hi], heads_np, pieces_of.pop(k), results):
                if r.outcome is not Outcome.OK:
                    faults[r.outcome.value] = faults.get(r.outcome.value, 0) + 1
                    ok.append(False)
                    continue
                if checksums and r.checksum is None:  # a store that broke its word: trust nothing
                    faults[Outcome.FAILED.value] = faults.get(Outcome.FAILED.value, 0) + 1
                    ok.append(False)
                    continue
                try:
                    framing.verify_parts(h, r.nbytes, [x.numpy() for x in p], key, self.fingerprint,
                                         landed_checksum=r.checksum if checksums else None)
                except framing.FrameError as exc:
                    faults[exc.fault.value] = faults.get(exc.fault.value, 0) + 1
                    ok.append(False)
                    continue
                ok.append(True)
            good[k] = ok

        landed: tuple[int, list[GetResult]] | None = None
        for k in range(len(batches)):
            async with anyio.create_task_group() as tg:
                if landed is not None:
                    if self._inline(batches[landed[0]], size):
                        verify(*landed)
                    else:
                        tg.start_soon(partial(anyio.to_thread.run_sync, verify, *landed, limiter=self.limiter))
                results = await get(k)
            landed = (k, results)
        if landed is not None:
            if self._inline(batches[landed[0]], size):
                verify(*landed)
            else:
                await anyio.to_thread.run_sync(verify, *landed, limiter=self.limiter)
        ok = [g for batch in good for g in batch]
        if job.on_layer is not None and all(ok):
            for layer in codec.layer_ids:
                job.on_layer(layer)
        return self._loaded(job, ok, faults, size, t0)

    # ---- verify all, then land: the rows are written only once the whole load verified ------
    def _held_frames(self, job: TransferJob) -> torch.Tensor:
        """``[n, stride]`` private frames for a held job: the registered held arena when it is
        free and large enough, else fresh memory (the store copies through its own buffers)."""
        n = len(job.keys)
        if self._held_arena is None:
            self._held_arena = self._new_arena()
            self.store.register(self._held_arena)
        arena = self._held_arena
        if not self._held_busy and n * self.stride <= arena.numel():
            self._held_busy = True
            job.staged_in_arena = True
            return arena[: n * self.stride].view(n, self.stride)
        if self.copies is not None:
            return self.copies.staging(n * self.stride).view(n, self.stride)
        return torch.empty((n, self.stride), dtype=torch.uint8)

    async def _load_held(self, job: TransferJob, codec: PoolCodec, size: int, t0: float) -> LoadResult:
        """Get every object of the job into private frames and verify it; write no row.
        Sub-batch k is verified while k+1 is in flight. The ticket lands the frames
        (:meth:`land_held`) once every job of the load verified, or drops them
        (:meth:`release_held`). Objects that move in place go straight into their rows and
        are verified there; only their report waits for the rest of the load."""
        if self.in_place_groups[job.group] and codec.host_path(job.index):
            # in place: the store writes the rows and they are verified there; nothing is
            # reported until the whole load verified (a failed load may leave partial bytes
            # in its rows, never reported landed)
            job.in_rows = True
            return await self._load_in_place(job, codec, size, t0)
        faults: dict[str, int] = {}
        grid = self._held_frames(job)
        job.staged = grid
        batches = self._batches(len(job.keys))
        good: list[list[bool]] = [[] for _ in batches]

        async def get(k: int) -> list[GetResult]:
            lo, hi = batches[k]
            frames = [grid[i, :size] for i in range(lo, hi)]
            start = time.perf_counter()
            try:
                results = await self.store.get(job.keys[lo:hi], frames)
            except StoreError:
                results = [GetResult(Outcome.UNREACHABLE)] * (hi - lo)
            if len(results) != hi - lo:  # a store that breaks the protocol: trust nothing
                results = [GetResult(Outcome.FAILED)] * (hi - lo)
            self.latency.observe(time.perf_counter() - start)
            return results

        def verify(k: int, results: list[GetResult]) -> None:
            lo, hi = batches[k]
            frames = grid.numpy()
            ok: list[bool] = []
            for i, r in zip(range(lo, hi), results):
                if r.outcome is not Outcome.OK:
                    faults[r.outcome.value] = faults.get(r.outcome.value, 0) + 1
                    ok.append(False)
                    continue
                try:
                    framing.verify_array(frames[i, :size], r.nbytes, job.keys[i], self.fingerprint)
                except framing.FrameError as exc:
                    faults[exc.fault.value] = faults.get(exc.fault.value, 0) + 1
                    ok.append(False)
                    continue
                ok.append(True)
            good[k] = ok

        async def verify_async(k: int, results: list[GetResult]) -> None:
            if self._inline(batches[k], size):
                verify(k, results)
            else:
                await anyio.to_thread.run_sync(verify, k, results, limiter=self.limiter)

        fetched: tuple[int, list[GetResult]] | None = None
        for k in range(len(batches)):
            async with anyio.create_task_group() as tg:
                if fetched is not None:
                    tg.start_soon(verify_async, *fetched)
                results = await get(k)
            fetched = (k, results)
        if fetched is not None:
            await verify_async(*fetched)
        ok = [g for batch in good for g in batch]
        return self._loaded(job, ok, faults, size, t0)

    async def land_held(self, job: TransferJob, on_layer: Callable[[int], None]) -> None:
        """Write a held job's verified frames into its rows; ``on_layer(layer_id)`` (on the
        loop) once each layer's rows hold them (device pools: once the copies completed)."""
        codec, size = self.codecs[job.group], self.frame_sizes[job.group]
        if job.in_rows:  # already written and verified in place
            for layer in codec.layer_ids:
                on_layer(layer)
            return
        assert job.staged is not None, "land_held needs a verified held job"
        payload = job.staged[:, framing.HEADER_BYTES: size]
        if self.copies is not None:
            with self.copies.on_stream():
                codec.scatter(payload, job.index, None)
                ev = self.copies.record()
            await wait_fence(ev, timeout_s=self.fence_timeout_s)
            for layer in codec.layer_ids:
                on_layer(layer)
        elif self._inline((0, len(job.keys)), size):
            codec.scatter(payload, job.index, on_layer)
        else:
            def landed(layer: int) -> None:
                anyio.from_thread.run_sync(on_layer, layer)

            await anyio.to_thread.run_sync(codec.scatter, payload, job.index, landed, limiter=self.limiter)

    def release_held(self, job: TransferJob) -> None:
        """Drop a held job's frames (landed, or its load failed)."""
        job.staged = None
        if job.staged_in_arena:
            job.staged_in_arena = False
            self._held_busy = False

    def statistics(self) -> PoolActorStatistics:
        return PoolActorStatistics(
            pool=self.kind.value,
            offload_queue=self.offload_q.statistics(),
            load_queue=self.load_q.statistics(),
            pending_states=self.pending_states,
            **self._c,
        )


def _split(frame: torch.Tensor) -> list[torch.Tensor]:
    """A staging frame as a checksumming store's parts: header, payload."""
    return [frame[:framing.HEADER_BYTES], frame[framing.HEADER_BYTES:]]
