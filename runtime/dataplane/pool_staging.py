"""What every transfer path of a pool actor shares: the codecs, the store, the staging arenas
and their sub-batches, the store-latency monitor and the transfer counts.

:class:`PoolStaging` holds that state; the in-place paths (``runtime/dataplane/in_place.py``), the
verify-all-then-land loads (``runtime/dataplane/held_load.py``) and the actor with its queues, workers and
staged paths (``runtime/dataplane/pool_actor.py``) build on it, in that order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import anyio
import numpy as np
import torch

from ...components.layout import PoolKind
from ...stores import framing
from ...stores.base import (
    GetResult,
    Outcome,
    Store,
    StoreError,
    supports_checksums,
    supports_device_memory,
    supports_rows,
    supports_scatter,
)
from ...stores.condemned import Condemned
from ...stores.host_bytes import zero_fill
from ...stores.worker_threads import WorkerThreads
from .device import DeviceCopies, copies_for
from .tracing import trace
from .transfer_codec import PoolCodec
from .transfer_jobs import LoadResult, OffloadResult, TransferJob

_FRAME_FAULTS = frozenset(f.value for f in framing.FrameFault)


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


R = TypeVar("R")
V = TypeVar("V")
X = TypeVar("X")


async def pipelined(n: int, first: Callable[[int], Awaitable[X]],
                    then: Callable[[int, X], Coroutine[Any, Any, None]]) -> None:
    """``first(k)`` for every ``k`` in order, each overlapped with ``then(k - 1, ...)``."""
    ready: tuple[int, X] | None = None
    for k in range(n):
        async with anyio.create_task_group() as tg:
            if ready is not None:
                tg.start_soon(then, *ready)
            got = await first(k)
        ready = (k, got)
    if ready is not None:
        await then(*ready)


def check_landed(result: GetResult, checksums: bool, verify: Callable[[int | None], V],
                 faults: dict[str, int], reread: Callable[[], None] | None = None,
                 condemn: Callable[[GetResult, framing.FrameFault], None] | None = None) -> tuple[bool, V | None]:
    """Whether an object a get answered for can be used, and what ``verify`` returned for it.

    Not OK: counted in ``faults`` under its outcome. A checksumming store that gave no
    checksum broke its word: counted as failed, nothing trusted. Else ``verify(checksum)``
    (the landed checksum, or None where the runtime hashes itself) raising a
    :class:`~hylinker.stores.framing.FrameError` is counted under its fault, or, for a fault a
    damaged transfer can cause (``framing.REREAD_FAULTS``) when ``reread`` is given, not
    counted: ``reread()`` is called so the caller reads the object once more
    (:meth:`PoolStaging._reread_outcome` counts how that went). ``condemn`` (given on a re-read
    only): called with the result and the fault of an object that failed verification again,
    proved bad (not for ``unhashed``: a frame of the other level is not bad, only not ours)."""
    fault: str
    if result.outcome is not Outcome.OK:
        fault = result.outcome.value
    elif checksums and result.checksum is None:
        fault = Outcome.FAILED.value
    else:
        try:
            return True, verify(result.checksum if checksums else None)
        except framing.FrameError as exc:
            if reread is not None and exc.fault in framing.REREAD_FAULTS:
                reread()
                return False, None
            if condemn is not None and exc.fault in framing.REREAD_FAULTS:
                condemn(result, exc.fault)
            fault = exc.fault.value
    faults[fault] = faults.get(fault, 0) + 1
    return False, None


class PoolStaging:
    """A pool actor's codecs, store, staging arenas and counts. See the module doc."""

    def __init__(
        self,
        kind: PoolKind,
        codecs: Sequence[PoolCodec],
        store: Store,
        fingerprint: bytes,
        *,
        staging_frames: int,
        latency: LatencyMonitor,
        threads: WorkerThreads,
        inline_bytes: int = 1 << 20,
        fence_timeout_s: float | None = None,
        in_place: bool = True,
        in_place_min_bytes: int = 0,
        copies: DeviceCopies | None = None,
        held_bytes: int = 0,
        held_max_bytes: int = 1 << 30,
        integrity: framing.Integrity = framing.Integrity.CHECKSUM,
    ) -> None:
        if not codecs:
            raise ValueError("a pool actor needs at least one codec")
        self.kind = kind
        self.codecs = list(codecs)  # one per layer group
        self.codec = self.codecs[0]
        # device pools: copies on the actor's own stream through pinned staging (runtime/dataplane/device.py)
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
            return zero_fill(buf)  # the held arena grows on the loop: no OpenMP team there (host_bytes)

        self._arenas = {d: new_arena() for d in ("offload", "load")}
        self._new_arena = new_arena
        self._held_arena: torch.Tensor | None = None  # verify-all-then-land loads
        self._held_busy = False  # it carries a verified load waiting to land
        self.held_max_bytes = held_max_bytes  # the held arena grows to fit a load up to this
        self.held_arena_growths = 0
        if held_bytes:  # sized by the engine, ready before the first load
            self._held_arena = new_arena(-(-held_bytes // stride) * stride)
            store.register(self._held_arena)
        self._arenas_np = {d: a.numpy() for d, a in self._arenas.items()}
        self._templates: dict[int, np.ndarray] = {}  # per codec: its objects' header template
        for arena in self._arenas.values():
            store.register(arena)
        # in place: the store reads and writes host pool rows directly (checksums over the
        # rows), so a transfer makes one pass over the bytes instead of three
        # ... for objects of at least ``in_place_min_bytes``; smaller ones go staged. One
        # decision per layer group (its object size), made here and read by both directions
        able = supports_scatter(store) and self.codec.device.type == "cpu" and in_place and self.copies is None
        # ... and whose runs the store moves in place as fast as staged (a transport that pays
        # per buffer: ``StoreCapabilities.min_run_bytes``)
        runs = [c.run_bytes >= store.capabilities.min_run_bytes for c in self.codecs]
        self.in_place_groups = [able and c.payload_bytes >= in_place_min_bytes and ok
                                for c, ok in zip(self.codecs, runs, strict=True)]
        if self.copies is not None and in_place and supports_device_memory(store):
            # device pools over a store that addresses device memory: the rows are registered
            # and moved in place whatever the size (runtime/dataplane/device_transfers.py)
            self.in_place_groups = [True] * len(self.codecs)
        #: verify-all loads keep the size rule: below it they verify in private staging and
        #: write no row unless the whole load verified (runtime/dataplane/held_load.py)
        self.held_in_place_groups = list(self.in_place_groups)
        #: in-place transfers as row-described store calls (``put_rows`` / ``get_rows``): the
        #: store copies, checksums and writes headers per sub-batch, no buffer list per object,
        #: so nothing per object is left to save by staging: offloads and loads move in place
        #: at every size whose runs the store moves well (``row_groups``; the others staged,
        #: verify-all loads of them in private frames)
        self.rows = able and supports_rows(store)
        self.row_groups = [self.rows and ok for ok in runs]
        if self.rows:
            self.in_place_groups = list(self.row_groups)
        self.scatter = any(self.in_place_groups)
        # a store that checksums while it copies (framing.copy_checksummed): headers only on
        # offload, the landed checksum on load; the bytes cross memory once less per transfer
        # (in place: once in all), no separate hash pass over rows or staging
        # ... at integrity "checksum" only: at "header" nothing hashes the payload (plain
        # put/get, unhashed frames; a hashed frame written by a "checksum" writer is still
        # hashed here when read, framing.verify_array)
        self.integrity = integrity
        #: device pools at "checksum": version-3 frames, summed and verified on the device
        #: (runtime/dataplane/device_transfers.py); no XXH3 on their path, so no checksumming store calls
        self.device_sums = self.copies is not None and integrity is framing.Integrity.CHECKSUM
        self.store_checksums = (supports_checksums(store) and integrity is framing.Integrity.CHECKSUM
                                and not self.device_sums)
        #: the runtime hashes payloads itself (worth a worker thread for large batches)
        self.hashes_here = (integrity is framing.Integrity.CHECKSUM and not self.store_checksums
                            and not self.device_sums)
        if self.scatter:
            moved = [c for c, yes in zip(self.codecs, self.in_place_groups, strict=True) if yes]
            for region in {id(t): t for c in moved for t in c.regions()}.values():
                store.register(region)
        self.latency = latency
        self.threads = threads  # the data plane's copy threads (hashing, staging copies)
        self.inline_bytes = inline_bytes
        self.fence_timeout_s = fence_timeout_s
        self._c = dict(objects_offloaded=0, objects_already_stored=0, bytes_offloaded=0,
                       offload_failures=0, objects_loaded=0, bytes_loaded=0, load_misses=0,
                       load_failures=0, verify_failures=0, rereads_recovered=0, rereads_failed=0)

    @staticmethod
    def _condemner(job: TransferJob, i: int, head: np.ndarray) -> Callable[[GetResult, framing.FrameFault], None]:
        """``check_landed``'s ``condemn`` for object ``i`` of ``job`` whose first bytes landed in
        ``head``: notes the object as proved bad, as it was read (``stores/condemned.py``)."""
        def condemn(result: GetResult, fault: framing.FrameFault) -> None:
            job.condemned[job.keys[i]] = Condemned.of(result.nbytes, head, fault.value)
        return condemn

    def _reread_outcome(self, ok: list[bool], again: list[int], verified: list[bool]) -> None:
        """Record how the second reads of the objects ``again`` (indices into the job's
        ``ok``) went: ``verified[j]`` marks ``again[j]`` usable, and each is counted recovered
        (a transfer fault the second read cured) or failed (the stored object is bad)."""
        for i, good in zip(again, verified, strict=True):
            ok[i] = good
        n = sum(verified)
        self._c["rereads_recovered"] += n
        self._c["rereads_failed"] += len(again) - n
        if again:
            trace("reread", pool=self.kind.value, objects=len(again), recovered=n)

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

    async def _store_call(self, call: Callable[[list[str], Any], Awaitable[list[R]]], keys: list[str],
                          buffers: Any, unreachable: R, broken: R) -> list[R]:
        """One store call of a transfer: a store that raises reads as ``unreachable`` for every
        key, one that answers the wrong number of results as ``broken`` for every key (nothing
        it said is trusted); the call's latency feeds the monitor."""
        start = time.perf_counter()
        try:
            got = await call(keys, buffers)
        except StoreError:
            got = [unreachable] * len(keys)
        if len(got) != len(keys):
            got = [broken] * len(keys)
        seconds = time.perf_counter() - start
        self.latency.observe(seconds)
        trace("store", pool=self.kind.value, call=getattr(call, "__name__", "call"), objects=len(keys),
              us=round(seconds * 1e6))
        return got

    def _inline(self, batch: tuple[int, int], size: int) -> bool:
        """Small host copies run on the loop: two thread hops cost more than the copy."""
        return (self.copies is None and self.codec.device.type == "cpu"
                and (batch[1] - batch[0]) * size <= self.inline_bytes)

    def _batches(self, n: int) -> list[tuple[int, int]]:
        return [(lo, min(n, lo + self.batch)) for lo in range(0, n, self.batch)]

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
              failures=len(outcomes) - outcomes.count(Outcome.OK) - outcomes.count(Outcome.EXISTS))
        return OffloadResult(outcomes)

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
