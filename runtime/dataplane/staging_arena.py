"""A pool actor's staging: its codecs, the decisions made once from them and the store, and the
memory every transfer route moves bytes through.

:class:`StagingArena` holds one arena per direction (64-byte aligned frames, two halves for
double buffering), the header slots of in-place sub-batches in them, the header templates of
row-described calls, and the held arena of verify-all loads (``runtime/dataplane/held_load.py``). It
also decides, once, which layer groups move in place, by row-described calls, or summed on the
device, and who checksums the payload. The routes (``runtime/dataplane/staged_route.py``,
``in_place.py``, ``rows_route.py``, ``held_load.py``, ``device_transfers.py``) read it; it makes
no store call but registering its memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from ...components.layout import PoolKind
from ...stores import framing
from ...stores.base import (
    Store,
    supports_checksums,
    supports_device_memory,
    supports_rows,
    supports_scatter,
)
from ...stores.host_bytes import zero_fill
from ...stores.worker_threads import WorkerThreads
from .device import DeviceCopies, copies_for
from .transfer_codec import PoolCodec
from .transfer_jobs import TransferJob

log = logging.getLogger(__name__)


class StagingArena:
    """A pool actor's codecs, arenas and route decisions. See the module doc."""

    def __init__(
        self,
        kind: PoolKind,
        codecs: Sequence[PoolCodec],
        store: Store,
        fingerprint: bytes,
        *,
        staging_frames: int,
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
        self.stride = -(-self.frame_bytes // 64) * 64
        self.frames = max(2, staging_frames)
        # objects per sub-batch: two halves, double buffered, at most 32 MiB each
        self.batch = max(1, min(self.frames // 2, (32 << 20) // self.stride))
        self.threads = threads  # the data plane's copy threads (hashing, staging copies)
        self.inline_bytes = inline_bytes
        self.fence_timeout_s = fence_timeout_s
        # filled once here so first use does not pay page faults on the hot path
        self.arenas = {d: self.new_arena() for d in ("offload", "load")}
        self.held: torch.Tensor | None = None  # the held arena: verify-all-then-land loads
        self.held_busy = False  # it carries a verified load waiting to land
        self.held_max_bytes = held_max_bytes  # the held arena grows to fit a load up to this
        self.held_arena_growths = 0
        if held_bytes:  # sized by the engine, ready before the first load
            self.held = self.new_arena(-(-held_bytes // self.stride) * self.stride)
            store.register(self.held)
        self.arenas_np = {d: a.numpy() for d, a in self.arenas.items()}
        self.templates: dict[int, np.ndarray] = {}  # per codec: its objects' header template
        for arena in self.arenas.values():
            store.register(arena)
        self._decide_routes(in_place, in_place_min_bytes)
        self._decide_checksums(integrity)
        if self.scatter:
            moved = [c for c, yes in zip(self.codecs, self.in_place_groups, strict=True) if yes]
            for region in {id(t): t for c in moved for t in c.regions()}.values():
                store.register(region)

    def _decide_routes(self, in_place: bool, in_place_min_bytes: int) -> None:
        """Which layer groups move in place, and how (one decision per group, read by both directions)."""
        store = self.store
        # in place: the store reads and writes host pool rows directly (checksums over the
        # rows), so a transfer makes one pass over the bytes instead of three
        # ... for objects of at least ``in_place_min_bytes``; smaller ones go staged
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

    def _decide_checksums(self, integrity: framing.Integrity) -> None:
        """Who checksums the payload: the store as it copies, the device, or the runtime."""
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
        self.store_checksums = (supports_checksums(self.store) and integrity is framing.Integrity.CHECKSUM
                                and not self.device_sums)
        #: the runtime hashes payloads itself (worth a worker thread for large batches)
        self.hashes_here = (integrity is framing.Integrity.CHECKSUM and not self.store_checksums
                            and not self.device_sums)

    # ---- memory ---------------------------------------------------------------------------
    def new_arena(self, nbytes: int = 0) -> torch.Tensor:
        """Zero-filled staging of ``nbytes`` (default: one direction's arena), pinned on a device."""
        n = nbytes or self.frames * self.stride
        buf = self.copies.staging(n) if self.copies is not None else torch.empty(n, dtype=torch.uint8)
        return zero_fill(buf)  # the held arena grows on the loop: no OpenMP team there (host_bytes)

    def views(self, direction: str, half: int, n: int, size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Frames of ``size`` bytes in one half of a direction's arena (double buffering)."""
        arena, stride = self.arenas[direction], self.stride
        base = half * self.batch * stride
        grid = arena[base: base + n * stride].view(n, stride)
        frames = [arena[base + i * stride: base + i * stride + size] for i in range(n)]
        return grid, frames

    def np_frames(self, direction: str, half: int, n: int, size: int) -> list[np.ndarray]:
        """The same frames as NumPy views: framing and host copies need no tensor per object."""
        arena, stride = self.arenas_np[direction], self.stride
        base = half * self.batch * stride
        return [arena[base + i * stride: base + i * stride + size] for i in range(n)]

    def batches(self, n: int) -> list[tuple[int, int]]:
        """Sub-batches of a staged transfer: one arena half each."""
        return [(lo, min(n, lo + self.batch)) for lo in range(0, n, self.batch)]

    def inline(self, batch: tuple[int, int], size: int) -> bool:
        """Small host copies run on the loop: two thread hops cost more than the copy."""
        return (self.copies is None and self.codec.device.type == "cpu"
                and (batch[1] - batch[0]) * size <= self.inline_bytes)

    # ---- header slots of in-place sub-batches ---------------------------------------------
    def header_slots(self, batches: list[tuple[int, int]]) -> int:
        """How many sub-batches' headers a direction's arena holds at once (2 to 4)."""
        per = max((hi - lo for lo, hi in batches), default=1)
        return max(2, min(4, 2 * self.batch * self.stride // (per * framing.HEADER_BYTES)))

    def header_place(self, batches: list[tuple[int, int]], k: int) -> tuple[int, int]:
        """Sub-batch ``k``'s objects and the byte offset of its headers in a direction's arena
        (header slot ``k % slots``, each slot room for the largest sub-batch's headers): the
        sub-batch that used the slot before has ended (``runtime/dataplane/pipeline.py``)."""
        per = max(hi - lo for lo, hi in batches)
        return batches[k][1] - batches[k][0], (k % self.header_slots(batches)) * per * framing.HEADER_BYTES

    def headers(self, direction: str, batches: list[tuple[int, int]], k: int) -> tuple[list[torch.Tensor], list[np.ndarray]]:
        """Sub-batch ``k``'s 64-byte header buffers in its header slot of a direction's arena."""
        hb = framing.HEADER_BYTES
        n, base = self.header_place(batches, k)
        arena, arena_np = self.arenas[direction], self.arenas_np[direction]
        return ([arena[base + i * hb: base + (i + 1) * hb] for i in range(n)],
                [arena_np[base + i * hb: base + (i + 1) * hb] for i in range(n)])

    def row_heads(self, batches: list[tuple[int, int]], k: int) -> np.ndarray:
        """Sub-batch ``k``'s headers in the load arena, as one ``[n, 64]`` array."""
        hb = framing.HEADER_BYTES
        n, base = self.header_place(batches, k)
        return self.arenas_np["load"][base: base + n * hb].reshape(n, hb)

    def template(self, codec: PoolCodec) -> np.ndarray:
        """The header template of ``codec``'s objects (row-described calls)."""
        template = self.templates.get(id(codec))
        if template is None:
            template = self.templates[id(codec)] = framing.header_template(
                self.fingerprint, codec.payload_bytes, self.integrity)
        return template

    # ---- the held arena -------------------------------------------------------------------
    async def held_frames(self, job: TransferJob) -> torch.Tensor:
        """``[n, stride]`` private frames for a held job: the registered held arena when it is
        free, grown first if the job is larger (up to ``held_max_bytes``), else fresh memory
        (the store then copies through its own buffers, and the first touch of every page is
        paid during the load)."""
        n = len(job.keys)
        need = n * self.stride
        if self.held is None:
            self.held = self.new_arena()
            self.store.register(self.held)
        if not self.held_busy and self.held.numel() < need <= self.held_max_bytes:
            await self._grow_held(need)
        arena = self.held
        if not self.held_busy and need <= arena.numel():
            self.held_busy = True
            job.staged_in_arena = True
            return arena[:need].view(n, self.stride)
        if self.copies is not None:
            return self.copies.staging(need).view(n, self.stride)
        return torch.empty((n, self.stride), dtype=torch.uint8)

    async def _grow_held(self, need: int) -> None:
        """Replace the free held arena with one of at least ``need`` bytes (twice the old size
        if that is more, at most ``held_max_bytes``), filled in a worker thread so the pages
        are touched once here and never during a load, and registered with the store; the old
        arena (free: no job holds frames in it) is then unregistered and dropped. If the store
        refuses the new one, the old one stays."""
        old = self.held
        assert old is not None and not self.held_busy
        size = max(need, min(2 * old.numel(), self.held_max_bytes))
        size = -(-size // self.stride) * self.stride
        self.held_busy = True  # nothing else takes the arena while the new one is filled
        try:
            arena = await self.threads.run(self.new_arena, size)
            try:
                self.store.register(arena)
            except Exception as exc:  # keep the old arena; this load takes fresh memory
                log.warning("held arena of %d bytes not registered (%r); keeping %d bytes", size, exc, old.numel())
                return
            self.held = arena
            self.store.unregister(old)
            self.held_arena_growths += 1
        finally:
            self.held_busy = False

    def release_held(self, job: TransferJob) -> None:
        """Drop a held job's frames (landed, or its load failed)."""
        job.staged = None
        job.staged_rows = None
        if job.staged_in_arena:
            job.staged_in_arena = False
            self.held_busy = False
