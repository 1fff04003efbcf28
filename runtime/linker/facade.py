"""The :class:`Linker`: what a serving frontend embeds.

One request goes through the phases of the design (docs/design/phases.md §3)::

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

The rules of each phase live in its own room: :mod:`.lookup_room` (LOOKUP),
:mod:`.touch_room` (TOUCH), :mod:`.restore_room` (LOAD, COMMIT, ABORT, partial restores) and
:mod:`.offload_room` (offload planning, backpressure, settlement) and :mod:`.forward_room` (rows,
slots and checkpoint depths for the forward, the insert's checks); this class validates, holds
the open requests and delegates.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import torch

from ...components.admission import CheckpointPolicy, EndOfPrefill
from ...components.eviction import EvictionPolicy
from ...components.identity import model_identity, namespace_term
from ...components.keys import (
    MultimodalSpan,
    as_tokens,
    check_multimodal,
    namespace_seed,
    request_seed,
)
from ...components.layout import ModelLayout, PoolKind
from ...components.mamba import restorable_ceiling
from ...components.pool_rules import pool_rules
from ...components.pools import HybridPools
from ...components.radix import Node
from ...stores.base import Store
from ...stores.resilient import ResilienceStatistics, ResilientStore
from ..dataplane.events import DeviceEvent
from ..dataplane.metrics import FAMILIES, LIBRARY, PLANE_KEYS, Exporter, Figures
from ..dataplane.plane import DataPlane, DataPlaneConfig
from ..dataplane.pool_actor import PoolActor
from ..dataplane.restore_cost import Rate
from ..dataplane.statistics import PoolActorStatistics
from ..dataplane.tracing import trace
from . import holdings
from .agreement import Agreement, SingleRank
from .config import LinkerConfig
from .context import LinkerContext
from .forward_room import ForwardRoom
from .lookup_room import LookupRoom
from .offload_room import OffloadRoom
from .request import LookupResult, PhaseError, Request
from .restore_room import LoadHandle, RestoreRoom
from .statistics import COUNTERS, LinkerStatistics, linker_figures
from .touch_room import TouchBatcher
from .tree_writer import PoolExhaustedError, TreeWriter

#: the families the Linker exports itself; its data plane exports ``PLANE_KEYS``
LINKER_KEYS = tuple(f.key for f in FAMILIES if f.key not in PLANE_KEYS)


def deployment_seed(layout: ModelLayout, config: LinkerConfig | None = None,
                    salt: bytes | str | None = None) -> bytes:
    """``k_{-1}`` of a :class:`Linker`'s requests (before a request's own salt and adapter): the
    layout, the deployment ``salt`` and the identity of ``config.model_path`` (else
    ``layout.model_name``), ``config.model_revision`` and ``config.integrity``."""
    c = config or LinkerConfig()
    model = model_identity(c.model_path if c.model_path is not None else layout.model_name, c.model_revision)
    return namespace_seed(layout, salt, identity=namespace_term(model, c.integrity.value))


class Linker:
    """Async facade over the tree writer and one pool actor per pool.

    Use as ``async with Linker(layout, pools, store) as linker:``. The store is the caller's:
    the linker never closes it.
    """

    def __init__(self, layout: ModelLayout, pools: HybridPools, store: Store,
                 config: LinkerConfig | None = None, *, salt: bytes | str | None = None,
                 checkpoints: CheckpointPolicy | None = None, eviction: EvictionPolicy | None = None,
                 agreement: Agreement | None = None, registry: Any = None) -> None:
        """``registry``: a ``prometheus_client`` registry to export the linker's and its data
        plane's metrics on (``hylinker_*``, :mod:`.metrics`); default none, nothing exported. A
        registry that already holds them (given twice) degrades to no metrics, logged once."""
        if pools.layout is not layout and pools.layout != layout:
            raise ValueError("pools were built for another layout")
        self.layout = layout
        self.pools = pools
        self.config = config or LinkerConfig()
        #: how this rank agrees with its peers (runtime/linker/agreement.py); one rank: nothing to agree
        self.agreement: Agreement = agreement if agreement is not None else SingleRank()
        if self.agreement.collective and self.agreement.size != layout.tp_size:
            raise ValueError(f"the agreement spans {self.agreement.size} ranks but the layout has "
                             f"tp_size={layout.tp_size}")
        if self.agreement.collective and self.agreement.rank != layout.tp_rank:
            raise ValueError(f"agreement rank {self.agreement.rank} is not the layout's "
                             f"tp_rank={layout.tp_rank}")
        #: the caller's store (never closed here) and what every call goes through
        self.inner_store = store
        self.store: Store = store
        if self.config.resilience is not None:
            self.store = ResilientStore(store, self.config.resilience, owns_inner=False)
        self.page = layout.tree_page  # tokens per tree page (page_size x dcp_size)
        self.grid = layout.grid
        self.grid_pages = self.grid // self.page
        self._default_seed = deployment_seed(layout, self.config, salt)
        #: where prefills donate states (:meth:`checkpoint_depths`); the device tree's eviction order
        self.checkpoints: CheckpointPolicy = checkpoints if checkpoints is not None else EndOfPrefill()
        self.tree = TreeWriter(layout, pools, self._default_seed, eviction)
        self.rules = pool_rules(layout)  # per-pool rules: which pages, which keys, which indices
        c = self.config
        #: request metrics (None: no registry, or it could not take them); the data plane's own
        self.metrics = None if registry is None else Exporter.create(
            registry, LIBRARY, LINKER_KEYS, who="Linker", figures=self.metric_figures, refresh_on_scrape=True)
        #: the engine's prefill rate as observed (:meth:`observe_prefill`), for restores that pay
        self.prefill_rate = Rate()
        # the one data path: the same data plane an engine that owns its tree drives
        self.data = DataPlane(pools.views(), self.store, DataPlaneConfig(
            queue_depth=c.queue_depth, staging_bytes_per_pool=c.staging_bytes_per_pool,
            copy_threads=c.copy_threads, inline_copy_bytes=c.inline_copy_bytes,
            fence_timeout_s=c.fence_timeout_s, latency_high_ms=c.latency_high_ms,
            latency_low_ms=c.latency_low_ms, layer_groups=c.layer_groups, in_place=c.in_place,
            in_place_min_bytes=c.in_place_min_bytes, integrity=c.integrity,
            two_stage_offload=c.two_stage_offload, host_staging_bytes=c.host_staging_bytes),
            fingerprint=layout.fingerprint, registry=registry if self.metrics is not None else None)
        self._requests: dict[str, Request] = {}  # bounded: the live requests; release() drops each
        self._tg: anyio.abc.TaskGroup | None = None
        self._closing = False
        self._c: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.toucher = TouchBatcher(self.store, batch_s=self.config.touch_batch_s)
        # the rooms: each phase's rules live in one of them; the linker checks and delegates
        #: what the rooms share (runtime/linker/context.py): they reach the linker only through it
        self.context = LinkerContext(
            layout=layout, config=self.config, tree=self.tree, rules=self.rules, pools=pools,
            data=self.data, store=self.store, agreement=self.agreement, counters=self._c,
            check_open=self._check_open,
            move_lock=self._move_lock, ceiling_tokens=self.ceiling_tokens,
            prefill_tokens_per_s=self.prefill_tokens_per_s, running=self._running, spawn=self._spawn,
            holders=self._holders)
        self.lookups = LookupRoom(self.context, self.toucher)  # LOOKUP + TOUCH (runtime/linker/lookup_room.py)
        self.restores = RestoreRoom(self.context)  # LOAD, COMMIT, ABORT, partial restores (runtime/linker/restore_room.py)
        #: offload planning, backpressure and settlement (runtime/linker/offload_room.py)
        self.offloads = OffloadRoom(self.context, self.toucher)
        #: rows, slots and checkpoint depths for the forward; the insert's checks (runtime/linker/forward_room.py)
        self.forward = ForwardRoom(self.context, self.offloads, self.checkpoints)

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
            trace("close.timeout", in_flight=self.offloads.in_flight)
            self.data.drop_staged()  # frames still waiting for the store: dropped, counted
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
        if self.metrics is not None:
            self.metrics.close()

    async def drain(self) -> None:
        """Wait until every submitted offload has been acknowledged and its locks dropped."""
        await self.offloads.drain()

    def _spawn(self, fn: Any, *args: Any) -> None:
        assert self._tg is not None, "checked by _check_running before any side effect"
        self._tg.start_soon(fn, *args)

    def _running(self) -> bool:
        return self._tg is not None

    def _holders(self) -> int:
        """Open requests and offloads in flight: what may still give pages back."""
        return len(self._requests) + self.offloads.in_flight

    def _check_running(self) -> None:
        if self._tg is None:
            raise PhaseError("the linker is not running: use `async with Linker(...)`")
        if self._closing:
            raise PhaseError("the linker is closing")

    # ---- requests ------------------------------------------------------------------
    def request(self, request_id: str, tokens: Sequence[int] | npt.NDArray[np.integer],
                *, salt: bytes | str | None = None, adapter: str | None = None,
                multimodal: Sequence[MultimodalSpan] | None = ()) -> Request:
        """Register a request. Its extra keys (docs/design/decisions.md, "Isolation keys") fold into its
        page keys, so the device tree and the store only ever match a request with the same
        ones: ``salt`` (its tenant), ``adapter`` (the LoRA adapter it runs under; None: the base
        model), ``multimodal`` (its inputs' placeholder spans and content hashes, sorted).

        Raises ``TokenError`` on bad token ids, ``TypeError``/``ValueError`` naming the field on
        a bad salt, adapter or span."""
        self._check_running()
        if request_id in self._requests:
            raise PhaseError(f"request {request_id!r} is already open")
        toks = as_tokens(tokens)
        seed = request_seed(self._default_seed, salt=salt, adapter=adapter)
        spans = check_multimodal(multimodal, len(toks))
        req = Request(id=request_id, tokens=toks, seed=seed, node=self.tree.root,
                      page_size=self.page, multimodal=spans)
        self._requests[request_id] = req
        self._c["requests"] += 1
        return req

    @contextlib.asynccontextmanager
    async def session(self, request_id: str, tokens: Sequence[int] | npt.NDArray[np.integer],
                      *, salt: bytes | str | None = None, adapter: str | None = None,
                      multimodal: Sequence[MultimodalSpan] | None = ()) -> AsyncIterator[Request]:
        """``request`` (same extra keys) + ``release`` on exit, even when the task is cancelled."""
        req = self.request(request_id, tokens, salt=salt, adapter=adapter, multimodal=multimodal)
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

    # ---- LOOKUP (runtime/linker/lookup_room.py) ---------------------------------------------------
    async def lookup(self, req: Request) -> LookupResult:
        """Match the device tree (locking the hit) and probe the store above it."""
        return await self.lookups.lookup(req)

    # ---- LOAD / COMMIT / ABORT (runtime/linker/restore_room.py) -------------------------------------
    async def load(self, req: Request) -> LoadHandle | None:
        """PREPARE (allocate rows/slot, evicting if short) and queue the reads.

        Returns ``None`` — a plain miss, the request recomputes — when the store has
        nothing for this request or allocation fails (after waiting ``load_wait_s`` for pages).
        """
        return await self.restores.load(req)

    async def commit(self, load: LoadHandle) -> int:
        """Insert the restored prefix; returns tokens restored (0: dropped, recompute)."""
        return await self.restores.commit(load)

    async def abort(self, load: LoadHandle) -> None:
        """Release what a load allocated (only before COMMIT); waits for in-flight reads.

        If a commit already claimed the load, this waits for that commit to settle instead.
        """
        await self.restores.abort(load)

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
        return self.forward.extend(req, n_tokens)

    def working_slot(self, req: Request) -> int:
        """The request's writable state slot, initialised from the prefix's state (COW)."""
        self._check_open(req)
        return self.forward.working_slot(req)

    def checkpoint_slot(self, req: Request) -> int:
        """A fresh slot the forward copies the state at the checkpoint depth into."""
        self._check_open(req)
        return self.forward.checkpoint_slot(req)

    def checkpoint_depth(self, req: Request, extend_len: int) -> int | None:
        """Where this request's prefill (after its cached prefix) donates a state."""
        return self.forward.checkpoint_depth(req, extend_len)

    def checkpoint_depths(self, req: Request) -> list[int]:
        """Where this request's prefill of the whole prompt donates states, by the linker's
        checkpoint policy (sorted; insert them in this order). Call once per prefill."""
        self._check_open(req)
        return self.forward.checkpoint_depths(req)

    # ---- INSERT + OFFLOAD ------------------------------------------------------------
    async def insert(self, req: Request, n_tokens: int, *, checkpoint_slot: int | None = None,
                     fence: DeviceEvent | None = None, offload: bool | None = None) -> Node:
        """Donate the first ``n_tokens`` (whole pages) and a state at that depth.

        The request keeps a lock on the new node. With write-through on, the node and its
        not-yet-stored ancestors are queued for offload once ``fence`` completes.
        """
        self._check_open(req)
        self.forward.check_insert(req, n_tokens, checkpoint_slot)
        n_pages = n_tokens // self.page
        keys = req.page_keys(n_pages)
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
            await self.offloads.offload(req, res.node, fence)
        return res.node

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
                await self.restores.settle(req.load)  # waits for a commit or abort in progress
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
        restored = sum(a.calls.counts["staging_restores"] for a in self.data.actors.values())
        return LinkerStatistics(**self._c, store_latency_ema_ms=self.latency.ema_ms,
                                dropping=self.latency.dropping, touch_calls=self.toucher.calls,
                                staging_restores=restored)

    def metric_figures(self) -> Figures:
        """The request figures for :mod:`.metrics` (the data plane exports the data path's)."""
        return linker_figures(self.statistics(), self.agreement.rounds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine ran a prefill of ``tokens`` in ``seconds``: the recompute cost that a
        restore must beat (``LinkerConfig.decline_slow_restores``)."""
        self.prefill_rate.observe(tokens, seconds)

    def prefill_tokens_per_s(self) -> float | None:
        """The engine's prefill rate: configured, else observed (None: unknown)."""
        return self.config.prefill_tokens_per_s or self.prefill_rate.per_s

    def resilience_statistics(self) -> ResilienceStatistics | None:
        """Retries, timeouts and breaker counts of the store wrapper (None: no wrapper)."""
        return self.store.resilience() if isinstance(self.store, ResilientStore) else None

    def pool_statistics(self) -> dict[str, PoolActorStatistics]:
        return {k.value: a.statistics() for k, a in self.actors.items()}

    def leaked(self) -> tuple[int, int]:
        """``(KV pages, state slots)`` allocated but held by neither the tree nor an open
        request; both zero when nothing leaked (``runtime/linker/holdings.py``)."""
        return holdings.leaked(self.tree, self.pools, list(self._requests.values()), self.page)

    def check_idle(self) -> None:
        """Raise unless no request is open, nothing is locked and the tree matches the pools."""
        holdings.check_idle(self.tree, self.pools, list(self._requests.values()), self.page)

    def flush_device(self) -> None:
        """Evict the whole device tree (nothing may be locked)."""
        self.tree.reset()


__all__ = ["Linker", "LoadHandle", "LookupResult", "PhaseError", "PoolExhaustedError", "Request"]
