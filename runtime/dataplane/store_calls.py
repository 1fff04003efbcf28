"""A pool actor's store calls: one wrapper every transfer route calls the store through.

:class:`StoreCalls` makes a call (a store that raises, or answers the wrong number of results,
reads as a failure of every key; the call's latency feeds the :class:`LatencyMonitor` the
backpressure reads), tells whether an object
a get answered for can be used (:func:`check_landed`), and keeps the actor's transfer counts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import torch

from ...components.layout import PoolKind
from ...stores import framing
from ...stores.base import GetResult, Outcome, Store, StoreError
from ...stores.condemned import Condemned
from ...stores.rows import RowBatch
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
    (:meth:`StoreCalls.reread_outcome` counts how that went). ``condemn`` (given on a re-read
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


def condemner(job: TransferJob, i: int, head: np.ndarray) -> Callable[[GetResult, framing.FrameFault], None]:
    """``check_landed``'s ``condemn`` for object ``i`` of ``job`` whose first bytes landed in
    ``head``: notes the object as proved bad, as it was read (``stores/condemned.py``)."""
    def condemn(result: GetResult, fault: framing.FrameFault) -> None:
        job.condemned[job.keys[i]] = Condemned.of(result.nbytes, head, fault.value)
    return condemn


class StoreCalls:
    """A pool actor's store, its latency monitor and its transfer counts. See the module doc."""

    def __init__(self, kind: PoolKind, store: Store, latency: LatencyMonitor, *, checksums: bool,
                 integrity: framing.Integrity) -> None:
        self.kind = kind
        self.store = store
        self.latency = latency
        self.checksums = checksums  # the store checksums as it copies (``get_checked`` / ``put_sealed``)
        self.integrity = integrity
        self.counts = dict(objects_offloaded=0, objects_already_stored=0, bytes_offloaded=0,
                           offload_failures=0, objects_loaded=0, bytes_loaded=0, load_misses=0,
                           load_failures=0, verify_failures=0, rereads_recovered=0, rereads_failed=0,
                           staging_restores=0, staging_verify_failures=0)

    async def call(self, call: Callable[[list[str], Any], Awaitable[list[R]]], keys: list[str],
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

    async def rows(self, call: Callable[[RowBatch, bool], Awaitable[R]], batch: RowBatch,
                   unreachable: Callable[[], R]) -> R:
        """One row-described store call; a store that raises reads as ``unreachable()``."""
        start = time.perf_counter()
        try:
            got = await call(batch, self.integrity is framing.Integrity.CHECKSUM)
        except StoreError:
            got = unreachable()
        seconds = time.perf_counter() - start
        self.latency.observe(seconds)
        trace("store", pool=self.kind.value, call=getattr(call, "__name__", "call"), objects=len(batch.keys),
              us=round(seconds * 1e6))
        return got

    async def get_frames(self, keys: list[str], frames: list[torch.Tensor]) -> list[GetResult]:
        """One get of whole frames (a checksumming store's ``get_checked`` where it is used)."""
        if self.checksums:
            return await self.call(self.store.get_checked,  # type: ignore[attr-defined]
                                   keys, [split(f) for f in frames], GetResult(Outcome.UNREACHABLE),
                                   GetResult(Outcome.FAILED))
        return await self.call(self.store.get, keys, frames, GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))

    async def get_parts(self, keys: list[str], parts: list[list[torch.Tensor]]) -> list[GetResult]:
        """One get of objects in parts (a header buffer, then the rows' pieces)."""
        call = self.store.get_checked if self.checksums else self.store.get_parts  # type: ignore[attr-defined]
        return await self.call(call, keys, parts, GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))

    # ---- counts ---------------------------------------------------------------------------
    def reread_outcome(self, ok: list[bool], again: list[int], verified: list[bool]) -> None:
        """Record how the second reads of the objects ``again`` (indices into the job's
        ``ok``) went: ``verified[j]`` marks ``again[j]`` usable, and each is counted recovered
        (a transfer fault the second read cured) or failed (the stored object is bad)."""
        for i, good in zip(again, verified, strict=True):
            ok[i] = good
        n = sum(verified)
        self.counts["rereads_recovered"] += n
        self.counts["rereads_failed"] += len(again) - n
        if again:
            trace("reread", pool=self.kind.value, objects=len(again), recovered=n)

    async def end_load(self, reread: Callable[[TransferJob, list[int], dict[str, int]], Awaitable[list[bool]]],
                       job: TransferJob, codec: PoolCodec, ok: list[bool], again: list[int], faults: dict[str, int],
                       size: int, t0: float, *, report: bool = True) -> LoadResult:
        """End a load: read the objects ``again`` once more (``reread``: the route's), report
        every layer (``report``) if every object landed, count the outcome."""
        if again:
            again.sort()
            self.reread_outcome(ok, again, await reread(job, again, faults))
        if report and job.on_layer is not None and all(ok):  # every object of the job landed
            for layer in codec.layer_ids:
                job.on_layer(layer)
        return self.loaded(job, ok, faults, size, t0)

    def offloaded(self, job: TransferJob, outcomes: list[Outcome], size: int, t0: float) -> OffloadResult:
        c = self.counts
        for o in outcomes:
            if o is Outcome.OK:
                c["objects_offloaded"] += 1
                c["bytes_offloaded"] += size
            elif o is Outcome.EXISTS:
                c["objects_already_stored"] += 1
            else:
                c["offload_failures"] += 1
        trace("offload", pool=self.kind.value, request_id=job.request_id, objects=len(job.keys),
              bytes=len(job.keys) * size, us=round((time.perf_counter() - t0) * 1e6),
              failures=len(outcomes) - outcomes.count(Outcome.OK) - outcomes.count(Outcome.EXISTS))
        return OffloadResult(outcomes)

    def loaded(self, job: TransferJob, ok: list[bool], faults: dict[str, int], size: int, t0: float) -> LoadResult:
        c = self.counts
        n_ok = sum(ok)
        c["objects_loaded"] += n_ok
        c["bytes_loaded"] += n_ok * size
        c["load_misses"] += faults.get(Outcome.MISSING.value, 0)
        verify = sum(v for k, v in faults.items() if k in _FRAME_FAULTS)
        c["verify_failures"] += verify
        c["load_failures"] += len(ok) - n_ok - faults.get(Outcome.MISSING.value, 0) - verify
        trace("load", pool=self.kind.value, request_id=job.request_id, objects=len(job.keys),
              ok=n_ok, faults=faults, us=round((time.perf_counter() - t0) * 1e6))
        return LoadResult(ok, faults)


def split(frame: torch.Tensor) -> list[torch.Tensor]:
    """A staging frame as a checksumming store's parts: header, payload."""
    return [frame[:framing.HEADER_BYTES], frame[framing.HEADER_BYTES:]]
