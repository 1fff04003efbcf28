"""The vLLM connector's worker side: vLLM's KV cache as raw pages, moved by the data plane.

vLLM allocates its KV cache as a few raw tensors, each shared by one layer of every KV cache
group (a hybrid model's Mamba pages are padded to the attention page size), and hands out block
ids from one pool across groups: page ``b`` of every raw tensor belongs to whichever group owns
block ``b``. So one *object* is "page ``b`` of every raw tensor": for an attention block that is
every attention layer's K and V of those tokens, for a state block every recurrent layer's state
of its group. :class:`RawPages` finds those raw tensors behind the per-layer tensors vLLM
registers: the byte segments that hold block ``b`` (one per layer position with vLLM's
layer-outer layout, one per buffer with its block-outer one; see
:mod:`~hylinker.integrations.vllm.block_layout`), each viewed as ``[num_blocks, block_stride]``
bytes; the data plane's FULL and MAMBA views both lie on them.

:class:`PageTransfers` runs two data planes on the store host's loop:

* loads go straight into the engine's blocks (vLLM keeps them reserved until the connector
  reports the load finished); a missing or damaged object fails the whole load, which is
  reported so vLLM recomputes the request, and the objects that did not land are removed from
  the store so the next lookup misses instead of failing again;
* saves copy the offered pages into a private staging area before the step returns (vLLM may
  reuse a block in the next step) and then write them to the store from there, off the
  forward's path. The staging area is sized and drained by one host staging budget
  (:class:`~hylinker.runtime.dataplane.host_staging.HostStaging`, ``docs/design/host-staging.md``):
  a save's bytes are charged before its copy and released when the store answered; a save the
  budget cannot take now is skipped and counted (``saves_skipped``, reason
  ``host_staging_full``), never blocks.

A KV cache in CUDA memory takes the device path (:mod:`~hylinker.integrations.vllm.device_pages`):
saves are copied on a copy stream of their own, fenced by the forward's event, into pinned
staging, and the engine's stream waits for that copy on the device before it can reuse a block;
loads land through the data plane's device transfers and are reported only once landed and
verified. Host pages keep the plain copies above.

Objects are planned by rank-free names; this rank's store keys carry its rank
(:func:`~hylinker.integrations.vllm.index.rank_key`), or, for attention pages vLLM replicates
over ranks in a shared store, the rank of the one copy (:class:`~hylinker.integrations.vllm.index.KeyLayout`:
only that rank writes it). For a scheduler that cannot ask the store
itself, :meth:`PageTransfers.take_report` lists the names stored and gone since the last call,
and a load of an object whose save by this rank is still in flight copies it from that save's
staging slot (host pages; the slot stays held until the copy ended) instead of the store, which
may not hold it yet; on device pages it waits for that save, at most ``save_wait_s``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence

import anyio.to_thread
import attrs
import torch

from ...components.layout import PoolKind
from ...components.pool_view import LayerParts, PoolSet, PoolView
from ...runtime.dataplane.events import DeviceEvent
from ...runtime.dataplane.host_staging import HostStaging, derive_budget
from ...runtime.dataplane.plane import DataPlane, DataPlaneConfig, Transfer
from ...runtime.dataplane.tickets import TransferOutcome
from ...runtime.dataplane.tracing import trace
from ...stores.condemned import remove_condemned
from ...stores.framing import Integrity
from ...stores.host_bytes import copy_bytes
from ..store_host import StoreHost
from .block_layout import RawPages
from .device_pages import DevicePages, device_pages_for
from .index import KeyLayout, name_of
from .plan import TransferPlan
from .statistics import TRANSFER_COUNTERS, PageTransferStatistics, counted

log = logging.getLogger("vllm.hylinker")


def step_staging_bytes(pages: RawPages, *, floor_bytes: int, tokens_per_step: int, block_size: int,
                       state_groups: int) -> int:
    """Staging for one request's saves of one full step: the attention blocks a step of
    ``tokens_per_step`` tokens can complete plus one state per state group, or ``floor_bytes``
    if more. At a real geometry one object is every layer of a group (Qwen3-Next-80B: 12 layers,
    26 MB), so a fixed small staging area would skip every save."""
    objects = -(-tokens_per_step // max(1, block_size)) + 1 + state_groups
    return max(floor_bytes, objects * sum(pages.page_bytes))


def derived_staging_bytes(pages: RawPages, step_bytes: int, physical: int | None = None) -> int:
    """The default host staging budget of a worker (``host_staging_bytes`` None): the data
    plane's (:func:`~hylinker.runtime.dataplane.host_staging.derive_budget`: twice the bytes of
    vLLM's pages, at most a quarter of the host's memory), and never below one step's saves
    (``step_bytes``, :func:`step_staging_bytes`)."""
    per_object = sum(pages.page_bytes)
    return max(derive_budget(pages.num_blocks * per_object, per_object, physical), step_bytes)


def _views(raws: Sequence[torch.Tensor], with_state: bool) -> PoolSet:
    layers = [LayerParts(i, (r,)) for i, r in enumerate(raws)]
    views = [PoolView(PoolKind.FULL, 1, layers)]
    if with_state:
        views.append(PoolView(PoolKind.MAMBA, 1, layers))
    return PoolSet(views)


def _without(plan: TransferPlan, names: dict[str, int]) -> TransferPlan:
    """``plan`` less the objects in ``names``."""
    if not names:
        return plan
    kv = [(n, b) for n, b in zip(plan.kv_keys, plan.kv_blocks) if n not in names]
    st = [(n, b) for n, b in zip(plan.state_keys, plan.state_blocks) if n not in names]
    return attrs.evolve(plan, kv_keys=tuple(n for n, _ in kv), kv_blocks=tuple(b for _, b in kv),
                        state_keys=tuple(n for n, _ in st), state_blocks=tuple(b for _, b in st))


def _merged(plan: TransferPlan, staged: dict[str, int], outcome: TransferOutcome | None) -> TransferOutcome:
    """The outcome of ``plan`` whose objects in ``staged`` were copied from staging (landed) and
    the rest loaded with ``outcome`` (None: nothing else to load), per object in plan order."""
    objects: dict[PoolKind, list[bool]] = {}
    for pool, names in ((PoolKind.FULL, plan.kv_keys), (PoolKind.MAMBA, plan.state_keys)):
        rest = iter(outcome.objects.get(pool, []) if outcome is not None else [])
        if names:
            objects[pool] = [True if n in staged else next(rest, False) for n in names]
    if outcome is None:
        return TransferOutcome(True, objects, {})
    return attrs.evolve(outcome, objects=objects)


def _transfers(plan: TransferPlan, kv_index: Sequence[int], state_index: Sequence[int], rank: int,
               layout: KeyLayout) -> list[Transfer]:
    out = []
    if plan.kv_keys:
        out.append(Transfer(PoolKind.FULL, [layout.key(n, rank) for n in plan.kv_keys], list(kv_index)))
    if plan.state_keys:
        out.append(Transfer(PoolKind.MAMBA, [layout.key(n, rank) for n in plan.state_keys], list(state_index)))
    return out


class PageTransfers:
    """Loads into and saves from vLLM's pages; see the module docstring. Thread-safe."""

    def __init__(self, host: StoreHost, pages: RawPages, *, fingerprint: bytes, with_state: bool,
                 staging_bytes: int, rank: int = 0, save_wait_s: float = 10.0,
                 integrity: Integrity = Integrity.CHECKSUM, layout: KeyLayout | None = None,
                 device: DevicePages | None = None) -> None:
        """``device``: how device pages are fenced and copied (default: the CUDA path for pages on
        a CUDA device, none for host pages)."""
        self.host = host
        self.pages = pages
        self.rank = rank
        self.layout = layout if layout is not None else KeyLayout.per_rank(rank + 1)
        #: device pages only: the longest wait of a load for a save of its objects in flight (host
        #: pages read such objects from the save's staging slot instead, :meth:`_from_slots`)
        self.save_wait_s = save_wait_s
        per_object = sum(pages.page_bytes)
        slots = max(1, staging_bytes // per_object)
        self.per_object = per_object
        #: the host staging budget: a save's bytes from its copy to the store's answer
        self.budget = HostStaging(slots * per_object)
        self.device = device if device is not None else device_pages_for(pages.raws)
        self.staging = (self.device.staging(pages.page_bytes, slots) if self.device is not None
                        else [torch.empty((slots, p), dtype=torch.uint8) for p in pages.page_bytes])
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.RLock()  # RLock: a removal's count may come back at once (_removed)
        #: bounded: loads in flight, by request; each is deleted when its result is collected
        self._loads: dict[str, tuple[TransferPlan, concurrent.futures.Future[TransferOutcome]]] = {}
        self._saves: set[concurrent.futures.Future[TransferOutcome]] = set()  # bounded: saves in flight
        self._failed_now: set[str] = set()  # bounded: this step's failed loads, cleared each step
        #: name -> its save in flight and the staging slot holding its bytes until the store answered
        self._saving: dict[str, tuple[concurrent.futures.Future[TransferOutcome], int]] = {}
        self._readers: collections.Counter[int] = collections.Counter()  # slot -> loads reading it now
        self._read_held: set[int] = set()  # slots whose save ended while a load read them: freed at the read's end
        self._stored: list[str] = []  # names stored since the last report
        self._dropped: list[str] = []  # names gone since the last report
        self._evicted: collections.deque[str] = collections.deque()  # appended without our lock
        self.counters: dict[str, int] = dict.fromkeys(TRANSFER_COUNTERS, 0)
        cfg = DataPlaneConfig(staging_bytes_per_pool=max(16 << 20, 4 * per_object), integrity=integrity)
        self._stack = contextlib.ExitStack()
        try:
            self.engine_plane = DataPlane(_views(pages.raws, with_state), host.store, cfg, fingerprint=fingerprint,
                                          copies=None if self.device is None else self.device.load_copies)
            self._stack.enter_context(host.portal.wrap_async_context_manager(self.engine_plane))
            self.staging_plane = DataPlane(_views(self.staging, with_state), host.store, cfg, fingerprint=fingerprint)
            self._stack.enter_context(host.portal.wrap_async_context_manager(self.staging_plane))
        except BaseException:
            self._stack.close()
            raise

    # ---- loads ------------------------------------------------------------------------------------
    def load(self, plan: TransferPlan) -> None:
        """Start restoring ``plan`` into the engine's blocks (asynchronously). On host pages an
        object whose save by this rank is still in flight is copied from that save's staging slot
        (the bytes the step that computed it copied out), never waited for; the rest is read
        from the store."""
        slots, saving = self._from_slots(plan)
        rest = _without(plan, slots)
        transfers = _transfers(rest, rest.kv_blocks, rest.state_blocks, self.rank, self.layout)
        # device pages: no row is written before the engine's work queued so far is done
        fence = self.device.engine_fence() if self.device is not None else None

        async def run() -> TransferOutcome:
            if slots:
                try:
                    await anyio.to_thread.run_sync(self._copy_in, plan, slots)
                finally:
                    self._done_reading(list(slots.values()))
                trace("vllm.load.staged", request_id=plan.request_id, objects=len(slots))
            if saving:  # device pages: an object is still being written by this rank: read it once it landed
                await anyio.to_thread.run_sync(functools.partial(
                    concurrent.futures.wait, saving, timeout=self.save_wait_s))
            if not transfers:
                return _merged(plan, slots, None)
            ticket = await self.engine_plane.load(transfers, request_id=plan.request_id, fence=fence)
            return _merged(plan, slots, await ticket.wait())

        future = self.host.portal.start_task_soon(run)
        with self._lock:
            self.counters["loads"] += 1
            self._loads[plan.request_id] = (plan, future)

    def _from_slots(self, plan: TransferPlan) -> tuple[dict[str, int], list[concurrent.futures.Future[TransferOutcome]]]:
        """The plan's objects whose save by this rank is in flight: on host pages their staging
        slots (name -> slot), each held for reading until :meth:`_done_reading`; on device pages
        their saves, to wait for (the slot's bytes land on the copy stream's time)."""
        with self._lock:
            staged = {n: self._saving[n] for n in plan.kv_keys + plan.state_keys if n in self._saving}
            if self.device is not None:
                return {}, list({future for future, _slot in staged.values()})
            slots = {n: slot for n, (_future, slot) in staged.items()}
            self._readers.update(slots.values())
            self.counters["objects_from_staging"] += len(slots)
        return slots, []

    def _copy_in(self, plan: TransferPlan, slots: dict[str, int]) -> None:
        """Copy the staged objects of ``plan`` from their slots into the engine's blocks."""
        blocks = dict(zip(plan.kv_keys + plan.state_keys, plan.kv_blocks + plan.state_blocks))
        for name, slot in slots.items():
            for raw, st in zip(self.pages.raws, self.staging):
                raw[blocks[name]].copy_(st[slot])

    def _done_reading(self, slots: list[int]) -> None:
        """A load's reads of ``slots`` ended: a slot whose save ended meanwhile is free now."""
        with self._lock:
            self._readers.subtract(slots)
            for slot in slots:
                if self._readers[slot] <= 0:
                    del self._readers[slot]
                    if slot in self._read_held:
                        self._read_held.discard(slot)
                        self._free.append(slot)
                        self.budget.release(self.per_object)

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose loads ended since the last call: (landed and verified, failed). A failed
        load's blocks may hold partial bytes: vLLM must recompute its request."""
        ok_ids: set[str] = set()
        failed_ids: set[str] = set()
        with self._lock:
            failed_ids.update(self._failed_now)
            self._failed_now.clear()
            for rid, (plan, future) in list(self._loads.items()):
                if not future.done():
                    continue
                del self._loads[rid]
                try:
                    outcome: TransferOutcome | None = future.result()
                except Exception as exc:
                    log.warning("hylinker: load of %s raised %r", rid, exc)
                    outcome = None
                if outcome is not None and outcome.ok:
                    ok_ids.add(rid)
                    self.counters["loads_ok"] += 1
                    self.counters["objects_loaded"] += len(plan.kv_keys) + len(plan.state_keys)
                else:
                    failed_ids.add(rid)
                    self.counters["loads_failed"] += 1
                    log.warning("hylinker: load of %s failed (%s); it recomputes", rid,
                                outcome.faults if outcome is not None else "error")
                    if outcome is not None:
                        self._remove_failed(plan, outcome)
        return ok_ids, failed_ids

    def _remove_failed(self, plan: TransferPlan, outcome: TransferOutcome) -> None:
        """Forget the objects that did not land (the next lookup asks the store again) and
        remove from the store those this load proved bad (verification failed after the
        re-read), exactly as read (``stores/condemned.py``), so a later save rewrites them. An
        object that failed to arrive proves nothing and stays for every other engine. Fire and
        forget: a store that cannot answer now keeps them, and a later load fails again."""
        bad = [k for pool, keys in ((PoolKind.FULL, plan.kv_keys), (PoolKind.MAMBA, plan.state_keys))
               for k, ok in zip(keys, outcome.objects.get(pool, [False] * len(keys))) if not ok]
        self._dropped.extend(bad)
        condemned = {key: outcome.condemned[key] for key in (self.layout.key(n, self.rank) for n in bad)
                     if key in outcome.condemned}
        self.counters["objects_kept"] += len(bad) - len(condemned)
        if condemned:
            future = self.host.portal.start_task_soon(remove_condemned, self.host.store, condemned)
            future.add_done_callback(functools.partial(self._removed, len(condemned)))

    def _removed(self, condemned: int, future: concurrent.futures.Future[int]) -> None:
        """Count how a removal went (on the store's thread)."""
        if future.exception() is not None:  # retrieved: never logged as unhandled
            return
        with self._lock:
            self.counters["objects_removed"] += future.result()
            self.counters["objects_rewritten"] += condemned - future.result()

    def fail_now(self, request_ids: Iterable[str]) -> None:
        """Report loads the scheduler promised but could not plan as failed at the next poll."""
        with self._lock:
            for rid in request_ids:
                self._failed_now.add(rid)
                self.counters["loads_failed"] += 1

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block (the GIL released) until a load in flight ends, at most ``timeout_s``; at once if none is."""
        with self._lock:
            pending = [future for _plan, future in self._loads.values()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def loads_in_flight(self) -> int:
        with self._lock:
            return len(self._loads)

    # ---- saves ------------------------------------------------------------------------------------
    def save(self, plans: Iterable[TransferPlan]) -> None:
        """Copy every plan's pages into staging now, then write them to the store off the
        step. A plan the host staging budget cannot take now is skipped (counted, traced with
        reason ``host_staging_full``): never a block of the step. Attention pages
        another rank writes for this one (replicated, see :class:`KeyLayout`) are left out."""
        writes_blocks = self.layout.blocks.writes(self.rank)
        for plan in plans:
            if not writes_blocks:
                plan = attrs.evolve(plan, kv_keys=(), kv_blocks=())
            n = len(plan.kv_blocks) + len(plan.state_blocks)
            if n == 0:
                continue
            with self._lock:
                if not self.budget.try_charge(n * self.per_object):
                    self.counters["saves_skipped"] += 1
                    self._dropped.extend(plan.kv_keys + plan.state_keys)
                    trace("offload.skipped", request_id=plan.request_id, reason="host_staging_full",
                          objects=n, staged_bytes=self.budget.used, budget_bytes=self.budget.capacity)
                    continue
                assert len(self._free) >= n, "host staging: the budget had room but the slots had not"
                slots = [self._free.pop() for _ in range(n)]
            # one row copy per page (a memcpy each): an index_select + index_copy_ of the same
            # pages took ~20x as long here (tools/lab/profile_vllm_restore.py --save-copy), in the step
            pairs = [(st[slot], raw[block]) for raw, st in zip(self.pages.raws, self.staging)
                     for slot, block in zip(slots, plan.blocks)]
            fence = self._copy_out(pairs, slots)
            transfers = _transfers(plan, slots[: len(plan.kv_blocks)], slots[len(plan.kv_blocks):], self.rank,
                                   self.layout)

            async def run(transfers: list[Transfer] = transfers, rid: str = plan.request_id,
                          fence: DeviceEvent | None = fence) -> TransferOutcome:
                # device pages: the staged bytes are read once the copy stream's event completed
                ticket = await self.staging_plane.offload(transfers, request_id=rid, fence=fence)
                return await ticket.wait()

            future = self.host.portal.start_task_soon(run)
            with self._lock:
                self.counters["saves"] += 1
                if not future.done():  # a save already done needs no entry: _saved (added below) runs at once
                    self._saves.add(future)
                    for name, slot in zip(plan.kv_keys + plan.state_keys, slots):
                        self._saving[name] = (future, slot)
            future.add_done_callback(functools.partial(self._saved, plan=plan, slots=slots))

    def _copy_out(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], slots: list[int]) -> DeviceEvent | None:
        """Copy the pages into their staging slots: at once on host pages; on device pages queued
        on the copy stream (the returned event completes when they are staged). A copy that
        cannot be queued gives its slots back before the error goes up."""
        if self.device is None:  # in the step's thread alone: no OpenMP region per page (host_bytes)
            for dst, src in pairs:
                copy_bytes(dst, src)
            return None
        try:
            return self.device.copy_out(pairs)
        except BaseException:
            with self._lock:
                self._free.extend(slots)
                self.budget.release(len(slots) * self.per_object)
            raise

    def _saved(self, future: concurrent.futures.Future[TransferOutcome], *, plan: TransferPlan,
               slots: list[int]) -> None:
        try:
            outcome: TransferOutcome | None = future.result()
        except BaseException:
            outcome = None
        with self._lock:
            self._saves.discard(future)
            read = {slot for slot in slots if self._readers[slot] > 0}  # freed when their loads' reads end
            self._read_held.update(read)
            self._free.extend(slot for slot in slots if slot not in read)
            self.budget.release((len(slots) - len(read)) * self.per_object)
            self.counters["saves_ok" if outcome is not None and outcome.ok else "saves_failed"] += 1
            for pool, names in ((PoolKind.FULL, plan.kv_keys), (PoolKind.MAMBA, plan.state_keys)):
                landed = outcome.objects.get(pool, [False] * len(names)) if outcome is not None else [False] * len(names)
                for name, ok in zip(names, landed):
                    if self._saving.get(name, (None, 0))[0] is future:
                        del self._saving[name]
                    (self._stored if ok else self._dropped).append(name)
                    self.counters["objects_saved"] += int(ok)

    def note_evicted(self, keys: Sequence[str]) -> None:
        """The store evicted ``keys``: its eviction listener, called under the store's lock on
        the loop thread, so it takes no lock of ours (a thread holding ours may wait for the loop)."""
        self._evicted.extend(name_of(k) for k in keys)

    def take_report(self) -> tuple[list[str], list[str]]:
        """Names stored, and names gone, since the last call (see the module docstring)."""
        evicted = []
        while self._evicted:
            evicted.append(self._evicted.popleft())
        with self._lock:
            stored, self._stored = self._stored, []
            dropped, self._dropped = self._dropped, []
        return stored, dropped + evicted

    def saves_in_flight(self) -> int:
        with self._lock:
            return len(self._saves)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for writes in flight; True if none is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = list(self._saves)
            if not pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            concurrent.futures.wait(pending, timeout=left)

    def close(self, timeout_s: float) -> None:
        """Drain writes (bounded), then stop both data planes (loads in flight are waited for:
        their rows must not be written after vLLM frees them)."""
        if not self.drain(timeout_s):
            log.warning("hylinker: %d saves still in flight after %.1f s; cancelling them",
                        self.saves_in_flight(), timeout_s)
        self._stack.close()

    def statistics(self) -> PageTransferStatistics:
        with self._lock:
            return PageTransferStatistics(**counted(self.counters, TRANSFER_COUNTERS))


__all__ = ["PageTransfers", "RawPages", "derived_staging_bytes", "step_staging_bytes"]
