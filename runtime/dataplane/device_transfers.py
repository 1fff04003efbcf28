"""Device pools checksummed and verified on the device, staged or registered in place.

A device pool at integrity ``"checksum"`` writes version-3 frames (``stores/framing.py``): the
payload's checksum is :func:`~hylinker.stores.device_checksum.device_checksums`, integer
arithmetic that gives the same value on CPU and CUDA, so it is computed where the bytes are.

* Offload: on the actor's copy stream the rows are gathered into a device buffer, summed there,
  and (staged) copied to pinned staging; the sums come back to the host in one small copy. Once
  the copy stream's event completed the headers are sealed with them and the objects put.
* Load: the header is read on the host (``framing.read_header``); the payload lands in the rows
  (staged: scattered from staging on the copy stream; registered: the store wrote the rows), is
  gathered back from the rows on the copy stream and compared there with the header's checksum.
  Layers are reported only after that comparison's event completed and every object matched, so
  the forward never sees rows that did not verify. No host hash pass.
* Frames of other kinds are verified by what their header says: XXH3 frames (written by host
  pools) are hashed on the host (staged: in staging; registered: after a copy of the landed rows
  to the host), unhashed frames are read by a ``"header"`` reader only.

Registered: a store that addresses device memory (``capabilities.device_memory``, Mooncake built
with GPU support) reads and writes the rows themselves (``put_parts`` / ``get_parts``: a 64-byte
header buffer in the arena plus one device view per layer part); the actor registered the pool
memory at start. Other stores keep the staged path through pinned memory.

A verify-all load (``hold``) on these paths writes its rows and verifies them there; only its
report waits for the rest of the load (``job.in_rows``), as for host pools moved in place.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import xxhash

from ...stores import framing
from ...stores.base import GetResult, Outcome, Store
from ...stores.device_checksum import device_checksums, verify_on_device
from .events import DeviceEvent, wait_fence
from .pipeline import pipelined
from .staging_arena import StagingArena
from .store_calls import StoreCalls, check_landed, condemner
from .transfer_codec import PoolCodec
from .transfer_jobs import LoadResult, OffloadResult, TransferJob

DEVICE_CALL_BYTES = 32 << 20
"""The most object bytes one registered store call moves: bounds the device buffer the rows are
gathered into for their checksums (and its int64 temporaries)."""
_HB = framing.HEADER_BYTES
_NO_SUM = 1 << 63  # above any device checksum: a header holding it can never match



class _Frames:
    """Objects read as whole frames into pinned staging, then scattered into their rows."""

    def __init__(self, grid: torch.Tensor, size: int) -> None:
        self.grid = grid  # [n, >= size] uint8, pinned
        self.size = size
        self.np = grid.numpy()

    def buffers(self) -> list[Any]:
        return [self.grid[j, :self.size] for j in range(self.grid.shape[0])]

    def call(self, store: Store) -> Callable[..., Awaitable[list[GetResult]]]:
        return store.get

    def header(self, j: int) -> np.ndarray:
        return self.np[j, :self.size]

    def hashed_on_host(self, j: int, nbytes: int, key: str, fingerprint: bytes,
                       integrity: framing.Integrity) -> bool:
        """An XXH3 frame is verified here, in staging, before it lands (raises FrameError)."""
        framing.verify_array(self.np[j, :self.size], nbytes, key, fingerprint, integrity=integrity,
                             room=self.size - _HB)
        return True

    def land(self, codec: PoolCodec, index: torch.Tensor, sel: list[int]) -> None:
        """Queue the scatter of the objects ``sel`` (positions here) into rows ``index``."""
        if not sel:
            return
        pick = torch.tensor(sel, dtype=torch.int64)
        src = self.grid[:, _HB:self.size] if len(sel) == self.grid.shape[0] else self.grid[pick, _HB:self.size]
        codec.scatter(src, index[pick], None)


class _Rows:
    """Objects read by the store straight into their rows: a header buffer each, in the arena."""

    def __init__(self, heads: list[torch.Tensor], heads_np: list[np.ndarray], pieces: list[list[torch.Tensor]]) -> None:
        self.heads, self.heads_np, self.pieces = heads, heads_np, pieces

    def buffers(self) -> list[Any]:
        return [[h, *p] for h, p in zip(self.heads, self.pieces)]

    def call(self, store: Store) -> Callable[..., Awaitable[list[GetResult]]]:
        return store.get_parts  # type: ignore[attr-defined]

    def header(self, j: int) -> np.ndarray:
        return self.heads_np[j]

    def hashed_on_host(self, j: int, nbytes: int, key: str, fingerprint: bytes,
                       integrity: framing.Integrity) -> bool:
        """An XXH3 frame needs its landed rows on the host first: not here."""
        return False

    def land(self, codec: PoolCodec, index: torch.Tensor, sel: list[int]) -> None:
        """The store already wrote the rows."""


class DeviceRoute:
    """A pool actor's device paths with the device checksum. See the module doc."""

    def __init__(self, arena: StagingArena, calls: StoreCalls) -> None:
        self.arena = arena
        self.calls = calls
        self._sides: dict[tuple[str, int], torch.Tensor] = {}  # bounded: one per (pool, side), not per transfer

    def takes(self, job: TransferJob) -> bool:
        """Whether a job moves here: a device pool summed on the device, or registered."""
        a = self.arena
        return a.copies is not None and (a.device_sums or a.in_place_groups[job.group])

    def _in_rows(self, job: TransferJob, codec: PoolCodec) -> bool:
        return self.arena.in_place_groups[job.group] and codec.in_runs(job.index)

    def _device_batches(self, n: int, in_rows: bool) -> list[tuple[int, int]]:
        if not in_rows:
            return self.arena.batches(n)
        per = max(1, min(self.calls.store.capabilities.max_batch, self.arena.batch * self.arena.stride // _HB,
                         DEVICE_CALL_BYTES // self.arena.stride))
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]

    def _side(self, direction: str, half: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pinned host room for ``n`` checksums (int64) and ``n`` verdicts (bool) of one
        sub-batch half: the small copies between the device and the host land here."""
        buf = self._sides.get((direction, half))
        if buf is None or buf.numel() < 16 * n:
            assert self.arena.copies is not None
            buf = self.arena.copies.staging(16 * max(n, self.arena.batch))
            self._sides[(direction, half)] = buf
        return buf[:8 * n].view(torch.int64), buf[8 * n:9 * n].view(torch.bool)

    # ---- offload ------------------------------------------------------------------------
    async def offload(self, job: TransferJob) -> OffloadResult:
        """Sum (and stage) sub-batch k on the copy stream, seal it once that completed, while
        sub-batch k-1 is put."""
        t0 = time.perf_counter()
        codec, size = self.arena.codecs[job.group], self.arena.frame_sizes[job.group]
        copies = self.arena.copies
        assert copies is not None
        in_rows = self._in_rows(job, codec)
        batches = self._device_batches(len(job.keys), in_rows)
        results: list[list[Outcome]] = [[] for _ in batches]
        payload = size - _HB
        starts = job.index[:, 0].tolist() if in_rows else []

        def queue(k: int) -> DeviceEvent:
            lo, hi = batches[k]
            index = job.index[lo:hi]
            with copies.on_stream():
                if self.arena.device_sums:
                    rows = torch.empty((hi - lo, payload), dtype=torch.uint8, device=codec.device)
                    codec.gather(index, rows)
                    self._side("offload", k % 2, hi - lo)[0].copy_(device_checksums(rows), non_blocking=True)
                    if not in_rows:
                        self.arena.views("offload", k % 2, hi - lo, size)[0][:, _HB:size].copy_(rows, non_blocking=True)
                elif not in_rows:
                    codec.gather(index, self.arena.views("offload", k % 2, hi - lo, size)[0][:, _HB:size])
                return copies.record()

        def seal(k: int) -> list[Any]:
            lo, hi = batches[k]
            sums = self._side("offload", k % 2, hi - lo)[0].tolist() if self.arena.device_sums else None
            if in_rows:
                heads, targets = self.arena.headers("offload", batches, k)
            else:
                targets = self.arena.np_frames("offload", k % 2, hi - lo, size)
            for i, key in enumerate(job.keys[lo:hi]):
                if sums is not None:
                    framing.seal_device(targets[i], key, self.arena.fingerprint, payload, sums[i])
                else:
                    framing.seal_header(targets[i], key, self.arena.fingerprint, payload, self.arena.integrity)
            if in_rows:
                return [[heads[i], *codec.pieces(r0)] for i, r0 in enumerate(starts[lo:hi])]
            return self.arena.views("offload", k % 2, hi - lo, size)[1]

        async def prepare(k: int) -> list[Any]:
            ev = await self.arena.threads.run(queue, k)
            # never read the sums or the staged bytes before the copy stream produced them
            await wait_fence(ev, timeout_s=self.arena.fence_timeout_s)
            return seal(k)

        async def put(k: int, buffers: list[Any]) -> None:
            lo, hi = batches[k]
            call = self.calls.store.put_parts if in_rows else self.calls.store.put  # type: ignore[attr-defined]
            results[k] = await self.calls.call(call, job.keys[lo:hi], buffers, Outcome.UNREACHABLE, Outcome.FAILED)

        await pipelined(len(batches), prepare, put)
        return self.calls.offloaded(job, [o for r in results for o in r], size, t0)

    # ---- load ---------------------------------------------------------------------------
    async def load(self, job: TransferJob) -> LoadResult:
        """Get sub-batch k (into staging, or the rows) while sub-batch k-1 lands and is
        verified on the device; report the layers only after every object verified."""
        t0 = time.perf_counter()
        codec, size = self.arena.codecs[job.group], self.arena.frame_sizes[job.group]
        in_rows = self._in_rows(job, codec)
        if job.hold:  # verify-all: the rows are written and verified; the report waits
            job.in_rows = True
        batches = self._device_batches(len(job.keys), in_rows)
        faults: dict[str, int] = {}
        ok = [False] * len(job.keys)
        again: list[int] = []  # objects to read once more (a fault a transfer can cause)
        landings: dict[int, _Frames | _Rows] = {}

        async def fetch(k: int) -> list[GetResult]:
            lo, hi = batches[k]
            landings[k] = self._landing(job, codec, size, in_rows, batches, k, range(lo, hi))
            return await self._read(landings[k], job.keys[lo:hi])

        async def settle(k: int, results: list[GetResult]) -> None:
            lo, hi = batches[k]
            which = list(range(lo, hi))
            verdicts = await self._verify_landed(job, codec, size, which, results, landings.pop(k), k % 2,
                                                 faults, again.append)
            for i, good in zip(which, verdicts):
                ok[i] = good

        await pipelined(len(batches), fetch, settle)
        # the layers are reported only once every object landed and verified on the device
        return await self.calls.end_load(self.reread, job, codec, ok, again, faults, size, t0)

    def _landing(self, job: TransferJob, codec: PoolCodec, size: int, in_rows: bool,
                 batches: list[tuple[int, int]], k: int, which: range | list[int]) -> _Frames | _Rows:
        if in_rows:
            heads, heads_np = self.arena.headers("load", batches, k)
            starts = job.index[:, 0].tolist()
            return _Rows(heads, heads_np, [codec.pieces(starts[i]) for i in which])
        return _Frames(self.arena.views("load", k % 2, len(which), size)[0], size)

    async def _read(self, landing: _Frames | _Rows, keys: list[str]) -> list[GetResult]:
        return await self.calls.call(landing.call(self.calls.store), keys, landing.buffers(),
                                     GetResult(Outcome.UNREACHABLE), GetResult(Outcome.FAILED))

    async def reread(self, job: TransferJob, again: list[int], faults: dict[str, int]) -> list[bool]:
        """Read the objects ``again`` once more (staged: into frames of their own; registered:
        into their rows) and verify them as the first time; what fails now is counted."""
        codec, size = self.arena.codecs[job.group], self.arena.frame_sizes[job.group]
        in_rows = self._in_rows(job, codec)
        verified: list[bool] = []
        batches = self._device_batches(len(again), in_rows)
        for k, (lo, hi) in enumerate(batches):  # one at a time: the arena's slots are free now
            which = again[lo:hi]
            landing: _Frames | _Rows
            if in_rows:
                landing = self._landing(job, codec, size, True, batches, k, which)
            else:
                stride = self.arena.stride
                landing = _Frames(self.arena.new_arena(len(which) * stride).view(len(which), stride), size)
            results = await self._read(landing, [job.keys[i] for i in which])
            verified += await self._verify_landed(job, codec, size, which, results, landing, 0, faults, None)
        return verified

    async def _verify_landed(self, job: TransferJob, codec: PoolCodec, size: int, which: list[int],
                             results: list[GetResult], landing: _Frames | _Rows, half: int,
                             faults: dict[str, int], reread: Callable[[int], None] | None) -> list[bool]:
        """Whether each object ``which[j]`` (read into ``landing``) can be used: header on the
        host, then (on the copy stream) land it and compare the device checksum of its rows
        with the header's; the verdicts are read once that work completed. Faults a transfer
        can cause go to ``reread`` (when given), others are counted in ``faults``."""
        copies = self.arena.copies
        assert copies is not None
        room = size - _HB
        verdicts = [False] * len(which)
        on_device: list[tuple[int, int]] = []  # (position, expected device checksum)
        on_host: list[tuple[int, int]] = []  # (position, expected XXH3): registered rows of XXH3 frames

        def condemn(j: int) -> Callable[[GetResult, framing.FrameFault], None] | None:
            """On a re-read, notes object ``which[j]`` proved bad when it fails again."""
            return None if reread is not None else condemner(job, which[j], landing.header(j))

        def reject(j: int, fault: framing.FrameFault) -> None:
            if reread is not None and fault in framing.REREAD_FAULTS:
                reread(which[j])
                return
            faults[fault.value] = faults.get(fault.value, 0) + 1
            noted = condemn(j)
            if noted is not None and fault in framing.REREAD_FAULTS:
                noted(results[j], fault)

        def headers() -> list[int]:
            landed: list[int] = []
            for j, (i, r) in enumerate(zip(which, results)):
                key = job.keys[i]

                def verify(_: int | None, j: int = j, r: GetResult = r, key: str = key) -> tuple[framing.Checksum, int]:
                    kind, checksum = framing.read_header(landing.header(j), r.nbytes, room, key, self.arena.fingerprint,
                                                         self.arena.integrity)
                    if kind is framing.Checksum.XXH3 and landing.hashed_on_host(j, r.nbytes, key, self.arena.fingerprint,
                                                                                 self.arena.integrity):
                        kind = framing.Checksum.NONE  # verified already
                    return kind, checksum

                usable, got = check_landed(r, False, verify, faults, None if reread is None else partial(reread, i),
                                           condemn(j))
                if not usable or got is None:
                    continue
                kind, checksum = got
                landed.append(j)
                if kind is framing.Checksum.NONE:
                    verdicts[j] = True
                elif kind is framing.Checksum.XXH3:
                    on_host.append((j, checksum))
                else:
                    on_device.append((j, checksum if checksum < _NO_SUM else -1))
            return landed

        def queue() -> tuple[DeviceEvent, torch.Tensor | None]:
            landed = headers()
            host: torch.Tensor | None = None
            with copies.on_stream():
                landing.land(codec, job.index[torch.tensor(which, dtype=torch.int64)], landed)
                if on_device:  # the rows as they landed, summed and compared on the device
                    index = job.index[torch.tensor([which[j] for j, _ in on_device], dtype=torch.int64)]
                    rows = torch.empty((len(on_device), room), dtype=torch.uint8, device=codec.device)
                    codec.gather(index, rows)
                    expected, matched = self._side("load", half, len(on_device))
                    expected.copy_(torch.tensor([c for _, c in on_device], dtype=torch.int64))
                    matched.copy_(verify_on_device(rows, expected.to(codec.device, non_blocking=True)),
                                  non_blocking=True)
                if on_host:  # XXH3 frames in registered rows: their landed bytes come to the host
                    index = job.index[torch.tensor([which[j] for j, _ in on_host], dtype=torch.int64)]
                    host = copies.staging(len(on_host) * room).view(len(on_host), room)
                    codec.gather(index, host)
                return copies.record(), host

        ev, host = await self.arena.threads.run(queue)
        await wait_fence(ev, timeout_s=self.arena.fence_timeout_s)  # landed and compared: read the verdicts
        if on_device:
            matched = self._side("load", half, len(on_device))[1].tolist()
            for (j, _), good in zip(on_device, matched):
                if good:
                    verdicts[j] = True
                else:
                    reject(j, framing.FrameFault.BAD_CHECKSUM)
        if host is not None:
            rows_np = host.numpy()
            for n, (j, checksum) in enumerate(on_host):
                if xxhash.xxh3_64_intdigest(rows_np[n].data) == checksum:
                    verdicts[j] = True
                else:
                    reject(j, framing.FrameFault.BAD_CHECKSUM)
        return verdicts
