"""The :class:`Linker`: what a serving frontend embeds.

One request goes through the phases of the design (docs/design.md §3)::

    req = linker.request("r1", tokens)          # validate, hash nothing yet
    hit = await linker.lookup(req)              # LOOKUP: device match (locked) + store probe
    load = await linker.load(req)               # LOAD = PREPARE + queue; None -> recompute
    if load is not None:
        await load.wait_layer(layer_id)         # optional: layer-wise readiness
        restored = await linker.commit(load)    # COMMIT (0 when the data failed: recompute)
    rows = linker.extend(req, len(tokens))      # rows for the tokens the forward computes
    slot = linker.working_slot(req)             # writable state, copy-on-write of the prefix's
    ... forward writes KV rows, the state, and a checkpoint into linker.checkpoint_slot(req) ...
    await linker.insert(req, depth, checkpoint_slot=..., fence=event)  # donate + OFFLOAD
    await linker.release(req)                   # unlock, free what the request still owns

Store failures never raise: they degrade to recompute (a miss, a dropped load) or to an
unwritten offload, and are counted. A failed device fence fails its offload the same way
(``offload_failures``, traced). Misuse raises: bad tokens (``TokenError``), a phase out of
order or a linker that is not running (``PhaseError``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import numpy.typing as npt
import torch

from ..components.admission import CheckpointPolicy, EndOfPrefill, Prefill
from ..components.eviction import EvictionPolicy
from ..components.keys import as_tokens, namespace_seed, object_keys, page_keys
from ..components.layout import ModelLayout, PoolKind
from ..components.lookup import restorable_page_counts
from ..components.mamba import checkpoint_depth, restorable_ceiling
from ..components.partial import kept_pages
from ..components.pool_rules import pool_rules
from ..components.pools import HybridPools
from ..components.radix import Node
from ..stores.base import Store, StoreError
from ..stores.framing import FrameFault
from ..stores.resilient import ResilienceStatistics, ResilientStore
from .config import LinkerConfig
from .data_plane import (
    DataPlane,
    DataPlaneConfig,
    LoadTicket,
    OffloadTicket,
    Transfer,
    TransferOutcome,
)
from .events import DeviceEvent
from .pool_actor import PoolActor
from .statistics import LinkerStatistics, PoolActorStatistics
from .touch import TouchBatcher
from .tracing import trace
from .tree_actor import PoolExhaustedError, TreeActor


class PhaseError(RuntimeError):
    """A phase was called out of order (e.g. commit before load, use after release)."""


@attrs.frozen
class LookupResult:
    prompt_tokens: int
    device_tokens: int  # usable from the device tree now
    store_tokens: int  # restorable from the store on top of that (0: none)

    @property
    def total_tokens(self) -> int:
        return self.device_tokens + self.store_tokens


@attrs.define(eq=False)
class Request:
    """One sequence's view of the cache. Create with :meth:`Linker.request`."""

    id: str
    tokens: npt.NDArray[np.int32]
    seed: bytes
    node: Node  # locked: the cached prefix this request stands on
    page_size: int
    prefix_pages: int = 0  # pages of the prefix owned by the tree
    rows: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.int64))
    store_pages: int = 0  # found by lookup
    store_keys: list[bytes] = attrs.field(factory=list)
    store_boundaries: list[int] = attrs.field(factory=list)  # every restorable count found
    state_source: int | None = None  # the prefix node's state: copy-on-write source
    working: int | None = None
    checkpoints: list[int] = attrs.field(factory=list)
    load: LoadHandle | None = None
    looked_up: bool = False
    released: bool = False
    releasing: anyio.Event | None = None  # set once a release has finished

    @property
    def prefix_tokens(self) -> int:
        return self.prefix_pages * self.page_size


class LoadHandle:
    """A queued restore: await all of it, or each model layer. The reads, their verification
    and layer readiness are the data plane's (:class:`~hylinker.runtime.data_plane.LoadTicket`)."""

    def __init__(self, linker: Linker, req: Request, pages: int, rows: torch.Tensor,
                 slot: int | None) -> None:
        self.linker = linker
        self.request = req
        self.pages = pages
        self.rows = rows
        self.slot = slot  # the state at ``pages``
        #: (pages, slot) of every state read, ascending; the last one is ``slot``'s
        self.states: list[tuple[int, int]] = [] if slot is None else [(pages, slot)]
        self.keys: dict[PoolKind, list[str]] = {}  # object keys read, per pool, in order
        self.ticket: LoadTicket | None = None
        self.done = anyio.Event()  # every queued read has ended
        self.finished = False  # committed or aborted: rows and slot belong to someone now
        self.claimed_by: str | None = None  # "commit" or "abort" while one of them runs
        self.claim_changed = anyio.Event()  # set (and renewed) when a commit lets go
        self.settled = anyio.Event()  # set once committed or aborted

    def _attach(self, ticket: LoadTicket) -> None:
        self.ticket = ticket
        ticket.add_done_callback(lambda _outcome: self.done.set())

    @property
    def outcome(self) -> TransferOutcome | None:
        """What the reads did, once they ended (``None`` before)."""
        return None if self.ticket is None else self.ticket.outcome

    async def wait(self) -> bool:
        """Wait for every pool's data; True when all of it landed and verified."""
        await self.done.wait()
        out = self.outcome
        return out is not None and out.ok

    async def wait_layer(self, layer_id: int) -> bool:
        """Wait until ``layer_id``'s restored data is in the pools, or the load ended without
        it; True in the first case. The load still has to be committed as a whole."""
        assert self.ticket is not None
        return await self.ticket.wait_layer(layer_id)

    @property
    def tokens(self) -> int:
        return self.pages * self.linker.layout.page_size


class Linker:
    """Async facade over the tree actor and one pool actor per pool.

    Use as ``async with Linker(layout, pools, store) as linker:``. The store is the caller's:
    the linker never closes it.
    """

    def __init__(self, layout: ModelLayout, pools: HybridPools, store: Store,
                 config: LinkerConfig | None = None, *, salt: bytes | str | None = None,
                 checkpoints: CheckpointPolicy | None = None, eviction: EvictionPolicy | None = None) -> None:
        if pools.layout is not layout and pools.layout != layout:
            raise ValueError("pools were built for another layout")
        self.layout = layout
        self.pools = pools
        self.config = config or LinkerConfig()
        #: the caller's store (never closed here) and what every call goes through
        self.inner_store = store
        self.store: Store = store
        if self.config.resilience is not None:
            self.store = ResilientStore(store, self.config.resilience, owns_inner=False)
        self.page = layout.page_size
        self.grid = layout.grid
        self.grid_pages = self.grid // self.page
        self._default_seed = namespace_seed(layout, salt)
        #: where prefills donate states (:meth:`checkpoint_depths`); the device tree's eviction order
        self.checkpoints: CheckpointPolicy = checkpoints if checkpoints is not None else EndOfPrefill()
        self.tree = TreeActor(layout, pools, self._default_seed, eviction)
        self.rules = pool_rules(layout)  # per-pool rules: which pages, which keys, which indices
        c = self.config
        # the one data path: the same data plane an engine that owns its tree drives
        self.data = DataPlane(pools.views(), self.store, DataPlaneConfig(
            queue_depth=c.queue_depth, staging_bytes_per_pool=c.staging_bytes_per_pool,
            copy_threads=c.copy_threads, inline_copy_bytes=c.inline_copy_bytes,
            fence_timeout_s=c.fence_timeout_s, latency_high_ms=c.latency_high_ms,
            latency_low_ms=c.latency_low_ms, layer_groups=c.layer_groups, in_place=c.in_place),
            fingerprint=layout.fingerprint)
        self._requests: dict[str, Request] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._offloads_in_flight = 0
        self._offload_locked_pages = 0  # KV pages of nodes locked by offloads in flight
        self._offloads_idle = anyio.Event()
        self._offloads_idle.set()
        self._closing = False
        self._job_ids = itertools.count(1)
        self._c: dict[str, int] = {k: 0 for k in (
            "requests", "lookups", "lookup_prompt_tokens", "device_hit_tokens", "store_hit_tokens",
            "loads", "load_misses", "commits", "dropped_loads", "aborts", "inserts", "offloads",
            "offloads_skipped", "offloads_dropped", "offload_failures", "touches", "touch_keys",
            "verifications", "verify_failures", "offloads_skipped_kv", "offloads_verified_replicas",
            "bad_objects_removed", "close_timeouts", "partial_loads", "partial_pages_lost",
            "offloads_skipped_breaker")}
        self.toucher = TouchBatcher(self.store, batch_s=self.config.touch_batch_s)

    @property
    def actors(self) -> dict[PoolKind, PoolActor]:
        return self.data.actors

    @property
    def latency(self) -> Any:
        return self.data.latency

    @latency.setter
    def latency(self, monitor: Any) -> None:
        self.data.latency = monitor

    # ---- lifecycle -----------------------------------------------------------------
    async def __aenter__(self) -> Linker:
        await self.data.__aenter__()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self.toucher.run)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        with anyio.CancelScope(shield=True):
            await self.close()
        assert self._tg is not None
        tg, self._tg = self._tg, None
        try:
            suppress = await tg.__aexit__(*exc)
        except BaseException as err:
            await self.data.__aexit__(type(err), err, err.__traceback__)
            raise
        return bool(await self.data.__aexit__(*exc)) or suppress

    async def close(self) -> None:
        """Quiesce: finish queued offloads and loads, then release every open request.

        Bounded in time: offloads get ``close_timeout_s`` to drain; then the store wrapper stops
        retrying and cancels calls still in flight after its grace period, so the rest fails
        fast (a store that hangs cannot hold ``close`` hostage). Without a resilience policy
        the store's own calls bound it.
        """
        if self._closing:
            return
        self._closing = True
        self.toucher.stop()
        with anyio.move_on_after(self.config.close_timeout_s) as scope:
            await self.drain()
        if scope.cancelled_caught:
            self._c["close_timeouts"] += 1
            trace("close.timeout", in_flight=self._offloads_in_flight)
        if isinstance(self.store, ResilientStore):
            await self.store.shutdown()
        await self.drain()
        await self.data.close()  # loads not started are cancelled; the rest end
        for req in list(self._requests.values()):
            try:
                await self.release(req)
            except Exception as exc:  # one bad request must not keep the others locked
                trace("close.release_error", request_id=req.id, error=repr(exc))
        if isinstance(self.store, ResilientStore):
            await self.store.close()  # the wrapper only: the caller's store stays open

    async def drain(self) -> None:
        """Wait until every submitted offload has been acknowledged and its locks dropped."""
        await self._offloads_idle.wait()

    def _spawn(self, fn: Any, *args: Any) -> None:
        assert self._tg is not None, "checked by _check_running before any side effect"
        self._tg.start_soon(fn, *args)

    def _check_running(self) -> None:
        if self._tg is None:
            raise PhaseError("the linker is not running: use `async with Linker(...)`")
        if self._closing:
            raise PhaseError("the linker is closing")

    # ---- requests ------------------------------------------------------------------
    def request(self, request_id: str, tokens: Sequence[int] | npt.NDArray[np.integer],
                *, salt: bytes | str | None = None) -> Request:
        """Register a request (validates token ids; raises ``TokenError`` on bad input)."""
        self._check_running()
        if request_id in self._requests:
            raise PhaseError(f"request {request_id!r} is already open")
        toks = as_tokens(tokens)
        seed = self._default_seed if salt is None else namespace_seed(self.layout, salt)
        req = Request(id=request_id, tokens=toks, seed=seed, node=self.tree.root,
                      page_size=self.page)
        self._requests[request_id] = req
        self._c["requests"] += 1
        return req

    @contextlib.asynccontextmanager
    async def session(self, request_id: str, tokens: Sequence[int] | npt.NDArray[np.integer],
                      *, salt: bytes | str | None = None) -> AsyncIterator[Request]:
        """``request`` + ``release`` on exit, even when the task is cancelled."""
        req = self.request(request_id, tokens, salt=salt)
        try:
            yield req
        finally:
            with anyio.CancelScope(shield=True):
                await self.release(req)

    def _check_open(self, req: Request) -> None:
        if req.released or self._requests.get(req.id) is not req:
            raise PhaseError(f"request {req.id!r} is not open")
        self._check_running()

    def ceiling_tokens(self, req: Request) -> int:
        return restorable_ceiling(len(req.tokens), self.grid)

    # ---- LOOKUP --------------------------------------------------------------------
    async def lookup(self, req: Request) -> LookupResult:
        """Match the device tree (locking the hit) and probe the store above it."""
        self._check_open(req)
        if req.looked_up:
            raise PhaseError(f"request {req.id!r} was already looked up")
        req.looked_up = True
        t0 = time.perf_counter()
        ceiling_pages = self.ceiling_tokens(req) // self.page
        keys = page_keys(req.tokens, self.page, req.seed, max_pages=ceiling_pages)
        m = self.tree.match(keys)
        self.tree.lock(m.node)
        req.node = m.node
        req.prefix_pages = m.pages
        req.rows = m.rows
        req.state_source = m.node.mamba_slot
        self._c["lookups"] += 1
        self._c["lookup_prompt_tokens"] += len(req.tokens)
        self._c["device_hit_tokens"] += m.pages * self.page
        if m.pages and self.config.touch and self.store.capabilities.touch:
            self._maybe_touch(m.node)
        store_pages = 0
        req.store_boundaries = []
        if self.config.store_lookup and ceiling_pages > m.pages:
            req.store_boundaries = await self._probe(req, keys[m.pages:ceiling_pages], m.pages)
            store_pages = max(req.store_boundaries, default=0)
        req.store_pages = store_pages
        req.store_keys = keys[m.pages: m.pages + store_pages]
        trace("lookup", request_id=req.id, prompt=len(req.tokens), device_pages=m.pages,
              store_pages=store_pages, node=m.node.id, us=round((time.perf_counter() - t0) * 1e6))
        return LookupResult(len(req.tokens), m.pages * self.page, store_pages * self.page)

    async def _probe(self, req: Request, keys: list[bytes], first_page: int) -> list[int]:
        """Every restorable page count above the device hit, ascending ([]: none)."""
        names: dict[PoolKind, list[str]] = {}
        spans: dict[PoolKind, list[int]] = {}
        for kind, rule in self.rules.items():
            pos = rule.probe_positions(first_page, len(keys), self.grid_pages)
            spans[kind] = pos
            names[kind] = object_keys([keys[i] for i in pos], kind, self.layout)
        if not any(names.values()):
            return []
        errors = self.data.statistics()["exists_errors"]
        # a store error, or an answer of the wrong length, is a miss for every key (fail closed)
        present = await self.data.exists(names)
        if self.data.statistics()["exists_errors"] > errors:
            trace("lookup.store_error", request_id=req.id)
            return []
        bits: dict[PoolKind, list[bool]] = {}
        for kind, pos in spans.items():
            b = [False] * len(keys)
            for j, i in enumerate(pos):
                b[i] = present[kind][j]
            bits[kind] = b
        counts = restorable_page_counts(bits)
        return sorted(n for n in counts if n > 0 and (first_page + n) % self.grid_pages == 0)

    def _maybe_touch(self, node: Node) -> None:
        now = time.monotonic()
        if now - node.last_touch < self.config.touch_interval_s:
            return
        node.last_touch = now
        keys = self.tree.path_keys(node)
        names = [name for rule in self.rules.values() for name in rule.touch_names(keys, node)]
        self._c["touches"] += 1
        self._c["touch_keys"] += len(names)
        self.toucher.add(names)

    # ---- LOAD ----------------------------------------------------------------------
    async def load(self, req: Request) -> LoadHandle | None:
        """PREPARE (allocate rows/slot, evicting if short) and queue the reads.

        Returns ``None`` — a plain miss, the request recomputes — when the store has
        nothing for this request or allocation fails.
        """
        self._check_open(req)
        if not req.looked_up:
            raise PhaseError("load before lookup")
        if req.load is not None:
            raise PhaseError(f"request {req.id!r} already has a load")
        n = req.store_pages
        if n == 0:
            return None
        self._c["loads"] += 1
        rows = self.tree.try_alloc_rows(n)
        slot: int | None = None
        if rows is not None and self.layout.is_hybrid:
            slot = self.tree.try_alloc_slot()
            if slot is None:
                self.tree.free_rows(rows)
                rows = None
        if rows is None:
            self._c["load_misses"] += 1
            trace("load.miss", request_id=req.id, reason="allocation", pages=n)
            return None
        handle = LoadHandle(self, req, n, rows, slot)
        if slot is not None:
            # fallback states at shallower boundaries the probe found: if an object above one
            # of them fails, the load still restores the prefix up to it
            for b in reversed([b for b in req.store_boundaries if b < n][-self.config.fallback_states:]
                              if self.config.fallback_states else []):
                extra = self.tree.try_alloc_slot()
                if extra is None:
                    break
                handle.states.insert(0, (b, extra))
        req.load = handle
        first = req.prefix_pages
        transfers: list[Transfer] = []
        for kind, rule in self.rules.items():
            names, index = rule.load_objects(req.store_keys, rows, handle.states)
            handle.keys[kind] = names
            transfers.append(Transfer(kind, names, index))
        handle._attach(self.data.prepare_load(transfers, request_id=req.id))
        assert handle.ticket is not None
        closed = False
        try:
            # a cancelled submission still ends the ticket: jobs that were queued run, the rest end
            await self.data.submit(handle.ticket)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            closed = True  # the linker closed while this load waited for queue space
        if closed:
            self._c["load_misses"] += 1
            trace("load.miss", request_id=req.id, reason="closing", pages=n)
            await self._settle_load(handle)
            return None
        trace("load.queued", request_id=req.id, pages=n, first_page=first, slot=slot)
        return handle

    # ---- COMMIT / ABORT --------------------------------------------------------------
    async def commit(self, load: LoadHandle) -> int:
        """Insert the restored prefix; returns tokens restored (0: dropped, recompute)."""
        req = load.request
        self._check_open(req)
        if load.claimed_by is not None:
            raise PhaseError(f"this load was already {load.claimed_by}ed")
        if req.rows.numel() != req.prefix_tokens:
            raise PhaseError("commit must come before extend: the request already owns rows")
        if req.working is not None or req.checkpoints:
            raise PhaseError("commit must come before working_slot/checkpoint_slot: the working "
                             "state would not start from the restored prefix's state")
        # claim the load while waiting: an abort (a release, close) that arrives meanwhile waits
        # for this commit instead of freeing rows the tree may adopt. The wait itself stays
        # cancellable; everything after it runs without awaiting.
        load.claimed_by = "commit"
        try:
            return await self._commit(load)
        finally:
            if not load.finished:  # cancelled while waiting: the request still owns the load
                load.claimed_by = None
            changed, load.claim_changed = load.claim_changed, anyio.Event()
            changed.set()

    def _kept_pages(self, load: LoadHandle) -> int:
        """How much of a finished load can be restored (all of it when everything verified)."""
        out = load.outcome
        if out is None or out.cancelled:
            return 0
        page_ok = [ok for kind, ok in out.objects.items() if kind is not PoolKind.MAMBA]
        states = None
        if PoolKind.MAMBA in out.objects:
            states = [(b, ok) for (b, _), ok in zip(load.states, out.objects[PoolKind.MAMBA])]
        return kept_pages(page_ok, n_pages=load.pages, first_page=load.request.prefix_pages,
                          grid_pages=self.grid_pages, states=states)

    def _trim_load(self, load: LoadHandle, kept: int) -> None:
        """Keep the first ``kept`` pages and the state at ``kept``; free the rest now."""
        self.tree.free_rows(load.rows[kept * self.page:])
        load.rows = load.rows[: kept * self.page]
        slot = None
        for b, s in load.states:
            if b == kept:
                slot = s
            else:
                self.tree.free_slot(s)
        load.states = [] if slot is None else [(kept, slot)]
        load.slot = slot
        load.pages = kept

    async def _commit(self, load: LoadHandle) -> int:
        req = load.request
        await load.wait()
        out = load.outcome
        faults = {} if out is None else out.faults
        if out is not None:
            rejected = sum(v for k, v in out.faults.items() if k in _FRAME_FAULTS)
            self._c["verifications"] += sum(sum(ok) for ok in out.objects.values()) + rejected
            self._c["verify_failures"] += rejected
        kept = self._kept_pages(load)
        if kept == 0:
            self._c["dropped_loads"] += 1
            self._forget_bad_objects(load)
            self._free_load(load)
            trace("commit.dropped", request_id=req.id, faults=faults)
            return 0
        if kept < load.pages:
            self._c["partial_loads"] += 1
            self._c["partial_pages_lost"] += load.pages - kept
            self._forget_bad_objects(load)
            trace("commit.partial", request_id=req.id, pages=load.pages, kept=kept,
                  faults=faults)
        self._trim_load(load, kept)
        keys = self.tree.path_keys(req.node) + req.store_keys[:kept]
        rows = torch.cat([req.rows, load.rows])
        ins = self.tree.insert(keys, rows, load.slot, owned_from=req.prefix_pages)
        # what the tree adopted came from the store: never write it back
        adopted_pages = ins.existing_pages < len(keys)
        adopted_state = load.slot is not None and not ins.mamba_exist
        ins.node.stored.update(k for k, rule in self.rules.items()
                               if rule.stored_by_commit(adopted_pages, adopted_state))
        load.finished = True
        load.settled.set()
        req.load = None
        self._move_lock(req, ins.node)
        self._c["commits"] += 1
        self._c["store_hit_tokens"] += load.pages * self.page
        trace("commit", request_id=req.id, pages=load.pages, node=ins.node.id,
              mamba_exist=ins.mamba_exist, adopted=len(keys) - ins.existing_pages)
        return load.pages * self.page

    async def abort(self, load: LoadHandle) -> None:
        """Release what a load allocated (only before COMMIT); waits for in-flight reads.

        If a commit already claimed the load, this waits for that commit to settle instead.
        """
        if load.finished:
            raise PhaseError(f"this load was already {load.claimed_by or 'abort'}ed")
        while load.claimed_by == "commit":  # a commit is waiting on the reads: let it finish
            with anyio.CancelScope(shield=True):
                await load.claim_changed.wait()
            if load.finished:
                return  # the commit settled it: nothing here is ours any more
        if load.claimed_by == "abort":
            raise PhaseError("this load is already being aborted")
        load.claimed_by = "abort"
        with anyio.CancelScope(shield=True):
            await load.done.wait()
        self._c["aborts"] += 1
        self._free_load(load)

    async def _settle_load(self, load: LoadHandle) -> None:
        """Abort ``load`` unless someone else already is (or a commit settles it): either way
        return once it is settled. Never raises for a load already on its way out."""
        if load.finished:
            return
        if load.claimed_by == "abort":
            with anyio.CancelScope(shield=True):
                await load.settled.wait()
            return
        await self.abort(load)

    def _free_load(self, load: LoadHandle) -> None:
        load.finished = True
        load.settled.set()
        load.request.load = None
        self.tree.free_rows(load.rows)
        for _, slot in load.states:
            self.tree.free_slot(slot)

    def _forget_bad_objects(self, load: LoadHandle) -> None:
        """Remove what failed to restore (corrupt, torn, unreadable) from the store: puts are
        first-writer-wins, so a bad object stays bad until removed, and the next offload of
        those pages writes a good one."""
        if not self.store.capabilities.remove:
            return
        out = load.outcome
        if out is None or out.cancelled:
            return
        bad = [name for kind, keys in load.keys.items()
               for key, ok in zip(keys, out.objects.get(kind, [])) if not ok
               for name in self.data.store_keys(kind, key)]
        if bad and self._tg is not None:
            self._c["bad_objects_removed"] += len(bad)
            self._tg.start_soon(self._remove_quietly, bad)

    async def _remove_quietly(self, keys: list[str]) -> None:
        try:
            await self.store.remove(keys)
        except StoreError as exc:
            trace("remove.store_error", error=str(exc), keys=len(keys))

    def _move_lock(self, req: Request, node: Node) -> None:
        """The request now stands on ``node``: lock it, unlock the old prefix."""
        own = req.rows[req.prefix_tokens:]
        self.tree.lock(node)
        self.tree.unlock(req.node)
        req.node = node
        req.prefix_pages = node.end_page
        req.rows = torch.cat([self.tree.path_rows(node), own])
        req.state_source = node.mamba_slot
        # the store probe was relative to the old prefix: a later load must not chain its
        # keys onto the new one (that would insert a path of keys no prompt has)
        req.store_pages = 0
        req.store_keys = []
        req.store_boundaries = []

    # ---- the forward's resources -------------------------------------------------------
    def extend(self, req: Request, n_tokens: int) -> torch.Tensor:
        """Make sure ``req.rows`` covers ``n_tokens`` (whole pages); returns ``req.rows``.

        Raises :class:`PoolExhaustedError` when no pages can be freed.
        """
        self._check_open(req)
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 0:
            raise ValueError(f"extend takes a token count >= 0, got {n_tokens!r}")
        self._check_looked_up(req, "extend")
        have = req.rows.numel() // self.page
        need = -(-int(n_tokens) // self.page)
        if need > have:
            req.rows = torch.cat([req.rows, self.tree.alloc_rows(need - have)])
        return req.rows

    def working_slot(self, req: Request) -> int:
        """The request's writable state slot, initialised from the prefix's state (COW)."""
        self._check_open(req)
        self._check_looked_up(req, "working_slot")
        if self.pools.mamba is None:
            raise PhaseError("the layout has no mamba pool")
        if req.working is None:
            req.working = self.tree.alloc_slot()
            if req.state_source is not None:
                self.pools.mamba.copy_slot(req.state_source, req.working)
            else:
                for t in self.pools.mamba.tensors():
                    t[req.working].zero_()
        return req.working

    def checkpoint_slot(self, req: Request) -> int:
        """A fresh slot the forward copies the state at the checkpoint depth into."""
        self._check_open(req)
        self._check_looked_up(req, "checkpoint_slot")
        slot = self.tree.alloc_slot()
        req.checkpoints.append(slot)
        return slot

    @staticmethod
    def _check_looked_up(req: Request, what: str) -> None:
        # before lookup the request stands on no prefix yet: rows taken now would be dropped
        # by lookup (a leak) and a working state would start from zeros under a restored prefix
        if not req.looked_up:
            raise PhaseError(f"{what} before lookup: look the request up first")

    def checkpoint_depth(self, req: Request, extend_len: int) -> int | None:
        """Where this request's prefill (after its cached prefix) donates a state."""
        return checkpoint_depth(req.prefix_tokens, extend_len, self.grid, self.layout.chunk_size)

    def checkpoint_depths(self, req: Request) -> list[int]:
        """Where this request's prefill of the whole prompt donates states, by the linker's
        checkpoint policy (sorted; insert them in this order). Call once per prefill."""
        self._check_open(req)
        keys = page_keys(req.tokens, self.page, req.seed)
        return self.checkpoints.place(Prefill(req.prefix_tokens, len(req.tokens), keys, self.page,
                                              self.grid, self.layout.chunk_size))

    # ---- INSERT + OFFLOAD ------------------------------------------------------------
    async def insert(self, req: Request, n_tokens: int, *, checkpoint_slot: int | None = None,
                     fence: DeviceEvent | None = None, offload: bool | None = None) -> Node:
        """Donate the first ``n_tokens`` (whole pages) and a state at that depth.

        The request keeps a lock on the new node. With write-through on, the node and its
        not-yet-stored ancestors are queued for offload once ``fence`` completes.
        """
        self._check_open(req)
        if req.load is not None and not req.load.finished:
            raise PhaseError("insert while a load is in flight: commit or abort it first")
        if n_tokens % self.page or n_tokens <= 0:
            raise ValueError(f"insert takes whole pages: {n_tokens} is not a positive multiple of {self.page}")
        if n_tokens > len(req.tokens):
            raise ValueError(f"insert of {n_tokens} tokens exceeds the request's {len(req.tokens)}")
        if n_tokens > req.rows.numel():
            raise PhaseError(f"insert of {n_tokens} tokens but only {req.rows.numel()} rows were extended")
        if n_tokens < req.prefix_tokens:
            raise ValueError(f"insert of {n_tokens} tokens is inside the cached prefix ({req.prefix_tokens})")
        if checkpoint_slot is not None:
            if checkpoint_slot not in req.checkpoints:
                raise PhaseError("checkpoint_slot must come from checkpoint_slot(req)")
            if n_tokens % self.grid:
                raise ValueError(f"a checkpoint must sit on the grid ({self.grid} tokens), got depth {n_tokens}")
        elif self.layout.is_hybrid and n_tokens > req.prefix_tokens:
            raise ValueError("a hybrid insert needs the checkpoint at its depth (checkpoint_slot)")
        n_pages = n_tokens // self.page
        keys = page_keys(req.tokens, self.page, req.seed, max_pages=n_pages)
        rows = req.rows[:n_tokens]
        rest = req.rows[n_tokens:].clone()
        res = self.tree.insert(keys, rows, checkpoint_slot, req.prefix_pages)
        if checkpoint_slot is not None:
            req.checkpoints.remove(checkpoint_slot)  # the tree owns it now
        self._c["inserts"] += 1
        req.rows = torch.cat([req.rows[: req.prefix_tokens], rest])
        self._move_lock(req, res.node)
        trace("insert", request_id=req.id, pages=n_pages, node=res.node.id,
              adopted=n_pages - res.existing_pages, mamba_exist=res.mamba_exist)
        if (self.config.offload if offload is None else offload):
            await self._offload(req, res.node, fence)
        return res.node

    async def _offload(self, req: Request, node: Node, fence: DeviceEvent | None) -> None:
        path = node.path()
        plan: dict[PoolKind, list[Node]] = {}
        for kind, rule in self.rules.items():
            todo = [n for n in path if rule.holds(n) and kind not in n.stored and kind not in n.pending]
            if todo:
                plan[kind] = todo
        if not plan:
            return
        self._c["offloads"] += 1
        if isinstance(self.store, ResilientStore) and self.store.breaker_open:
            # the store is down: lock nothing, send nothing (lookups probe it meanwhile)
            self._c["offloads_skipped_breaker"] += 1
            trace("offload.skipped", request_id=req.id, reason="breaker_open")
            return
        if PoolKind.MAMBA in plan and self.config.mamba_backpressure:
            assert self.pools.mamba is not None
            limit = self.config.mamba_backpressure_share * self.pools.mamba.slots.capacity
            # queued and in-flight states must stay below the limit (3/4 of the pool)
            if self.actors[PoolKind.MAMBA].pending_states + len(plan[PoolKind.MAMBA]) >= limit:
                self._c["offloads_skipped"] += 1
                trace("offload.skipped", request_id=req.id, reason="mamba_backpressure",
                      pending=self.actors[PoolKind.MAMBA].pending_states)
                return
        # KV backpressure: nodes stay locked until their offload settles, so a slow store and
        # long prompts could otherwise lock the whole KV pool and make `extend` fail. Skip only
        # while the backlog is large *and* the pool is short of headroom (pages free or
        # evictable); a large backlog in a roomy pool threatens no allocation.
        new_pages = sum(len(n.keys) for n in {n.id: n for ns in plan.values() for n in ns}.values())
        kv_limit = self.config.kv_backpressure_share * self.pools.kv.pages.capacity
        if (self._offload_locked_pages and self._offload_locked_pages + new_pages > kv_limit
                and self.tree.kv_headroom_pages() < kv_limit):
            self._c["offloads_skipped_kv"] += 1
            trace("offload.skipped", request_id=req.id, reason="kv_backpressure",
                  locked_pages=self._offload_locked_pages, pages=new_pages)
            return
        if self.latency.should_drop():
            self._c["offloads_dropped"] += 1
            trace("offload.dropped", request_id=req.id, reason="latency", ema_ms=self.latency.ema_ms)
            return
        job_id = next(self._job_ids)
        jobs: dict[PoolKind, _OffloadPlan] = {}
        transfers: list[Transfer] = []
        locked: dict[int, Node] = {}  # node id -> node, locked once per offload
        for kind, nodes in plan.items():
            # absolute page -> position of its object in the job (MAMBA: the state's key page)
            where: dict[int, int] = {}
            for n in nodes:
                n.pending[kind] = job_id
                if n.id not in locked:
                    self.tree.lock(n)
                    locked[n.id] = n
                for j in self.rules[kind].pages(n):
                    where[j] = len(where)
            names, index = self.rules[kind].node_objects(nodes)
            if not self.rules[kind].writes:
                # the owner rank writes a replicated pool: settle by what the store holds
                jobs[kind] = (False, where, names)
                continue
            jobs[kind] = (True, where, names)
            transfers.append(Transfer(kind, names, index))
        locked_pages = sum(len(n.keys) for n in locked.values())
        self._offload_locked_pages += locked_pages
        if self._offloads_in_flight == 0:
            self._offloads_idle = anyio.Event()
        self._offloads_in_flight += 1
        ticket: OffloadTicket | None = None
        try:
            # MAMBA first: the data plane counts its states as pending before its first await,
            # so no other task passes the backpressure check above on a stale count
            transfers.sort(key=lambda t: t.pool is not PoolKind.MAMBA)
            ticket = self.data.prepare_offload(transfers, fence=fence, request_id=req.id)
            await self.data.submit(ticket)
        finally:
            self._spawn(self._finish_offload, job_id, node, jobs, ticket, list(locked.values()),
                        locked_pages)

    async def _finish_offload(self, job_id: int, end: Node, jobs: dict[PoolKind, _OffloadPlan],
                              ticket: OffloadTicket | None, locked: list[Node], locked_pages: int) -> None:
        """Exactly one settlement per offload: mark what reached the store, then unlock."""
        failed = False
        try:
            outcome = None if ticket is None else await ticket.wait()
            for kind, (written, where, names) in jobs.items():
                stored: list[bool] | None
                if not written:
                    stored = await self._replica_outcomes(names)
                elif outcome is None:
                    stored = None
                else:
                    stored = outcome.objects.get(kind, [False] * len(where))
                if stored is None or not all(stored):
                    failed = True
                self._settle(kind, job_id, end, where, stored)
            if outcome is not None and outcome.faults:
                trace("offload.error", request_id=ticket.request_id if ticket else "", faults=outcome.faults)
        finally:
            if failed:
                self._c["offload_failures"] += 1  # one result per offload, not one per pool
            for n in locked:
                self.tree.unlock(n)
            self._offload_locked_pages -= locked_pages
            self._offloads_in_flight -= 1
            if self._offloads_in_flight == 0:
                self._offloads_idle.set()

    async def _replica_outcomes(self, names: list[str]) -> list[bool]:
        """A replicated pool another rank writes: stored only where the store holds it now (a
        node found missing stays unstored and is planned again by a later insert)."""
        self._c["offloads_verified_replicas"] += 1
        try:
            present = await self.store.exists(names)
        except StoreError as exc:
            trace("offload.replica_check_error", error=str(exc), keys=len(names))
            return [False] * len(names)
        if len(present) != len(names):
            return [False] * len(names)
        return [bool(here) for here in present]

    def _settle(self, kind: PoolKind, job_id: int, end: Node, where: dict[int, int],
                stored: list[bool] | None) -> None:
        """Clear this job's pending marks along ``end``'s path (split fragments included);
        mark ``stored`` where every object of the node reached the store. A failure never
        clears a ``stored`` flag an earlier success set."""

        for n in end.path():
            if n.pending.get(kind) != job_id:
                continue
            del n.pending[kind]
            if stored is None:
                continue
            if all(j in where and stored[where[j]] for j in self.rules[kind].pages(n)):
                n.stored.add(kind)

    # ---- RELEASE -------------------------------------------------------------------
    async def release(self, req: Request) -> None:
        """Unlock the request's prefix and free every row and slot it still owns."""
        if req.released:
            return
        if req.releasing is not None:  # another release is under way: wait for it
            with anyio.CancelScope(shield=True):
                await req.releasing.wait()
            return
        req.releasing = anyio.Event()
        try:
            if req.load is not None and not req.load.finished:
                await self._settle_load(req.load)  # waits for a commit or abort in progress
        finally:
            self._release_now(req)

    def _release_now(self, req: Request) -> None:
        assert req.releasing is not None
        req.released = True
        self._requests.pop(req.id, None)
        own = req.rows[req.prefix_pages * self.page:]
        self.tree.free_rows(own)
        req.rows = req.rows[: req.prefix_pages * self.page]
        for slot in [*req.checkpoints, *([req.working] if req.working is not None else [])]:
            self.tree.free_slot(slot)
        req.checkpoints.clear()
        req.working = None
        self.tree.unlock(req.node)
        req.releasing.set()
        trace("release", request_id=req.id, node=req.node.id)

    # ---- inspection ----------------------------------------------------------------
    def statistics(self) -> LinkerStatistics:
        return LinkerStatistics(**self._c, store_latency_ema_ms=self.latency.ema_ms,
                                dropping=self.latency.dropping, touch_calls=self.toucher.calls)

    def resilience_statistics(self) -> ResilienceStatistics | None:
        """Retries, timeouts and breaker counts of the store wrapper (None: no wrapper)."""
        return self.store.resilience() if isinstance(self.store, ResilientStore) else None

    def pool_statistics(self) -> dict[str, PoolActorStatistics]:
        return {k.value: a.statistics() for k, a in self.actors.items()}

    def leaked(self) -> tuple[int, int]:
        """``(KV pages, state slots)`` allocated but held by neither the tree nor an open
        request; both zero when nothing leaked."""
        stats = self.tree.statistics()
        owned_pages = sum(req.rows.numel() // self.page - req.prefix_pages for req in self._requests.values())
        owned_slots = sum(len(req.checkpoints) + (req.working is not None) for req in self._requests.values())
        for req in self._requests.values():
            if req.load is not None and not req.load.finished:
                owned_pages += req.load.rows.numel() // self.page
                owned_slots += len(req.load.states)
        used_pages = self.pools.kv.pages.capacity - self.pools.kv.num_free_pages
        used_slots = 0 if self.pools.mamba is None else self.pools.mamba.slots.capacity - self.pools.mamba.num_free
        return used_pages - stats.pages - owned_pages, used_slots - stats.states - owned_slots

    def check_idle(self) -> None:
        """Raise unless no request is open, nothing is locked and the tree matches the pools."""
        from ..components.pools import PoolError

        if self._requests:
            raise PoolError(f"{len(self._requests)} requests are still open")
        locked = self.tree.locked_nodes()
        if locked:
            raise PoolError(f"{len(locked)} nodes are still locked: {locked[:3]}")
        self.tree.check_consistent()
        pages, slots = self.leaked()
        if pages:
            raise PoolError(f"{pages} KV pages leaked (allocated but not in the tree)")
        if slots:
            raise PoolError(f"{slots} mamba slots leaked")

    def flush_device(self) -> None:
        """Evict the whole device tree (nothing may be locked)."""
        self.tree.reset()


_FRAME_FAULTS = frozenset(f.value for f in FrameFault)
#: one pool's part of an offload: the job (None: another rank writes this replicated pool),
#: absolute page -> position of its object, and the object keys
_OffloadPlan = tuple[bool, dict[int, int], list[str]]  # (written by this rank, page -> object, keys)

__all__ = ["Linker", "LoadHandle", "LookupResult", "PhaseError", "PoolExhaustedError", "Request"]
