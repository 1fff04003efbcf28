"""The restore room: LOAD (allocate rows and slots, queue the reads), COMMIT (keep what
verified, a partial restore down to the deepest state that landed, insert it), ABORT, and the
claims that keep a commit and an abort (a release, ``close``) from both settling one load.
:class:`LoadHandle` is what a caller holds; :class:`RestoreRoom` owns every rule about it.
"""

from __future__ import annotations

import time

import anyio
import torch

from ...components.layout import PoolKind
from ...components.partial import restorable_prefixes
from ...stores.base import StoreError
from ...stores.condemned import Condemned, remove_condemned
from ...stores.framing import FrameFault
from ..dataplane.plane import Transfer
from ..dataplane.tickets import LoadTicket, TransferOutcome
from ..dataplane.tracing import trace
from .agreement import Boundaries
from .context import LinkerContext
from .request import LinkerRoom, PhaseError, Request

_FRAME_FAULTS = frozenset(f.value for f in FrameFault)


class LoadHandle:
    """A queued restore: await all of it, or each model layer. The reads, their verification
    and layer readiness are the data plane's (:class:`~hylinker.runtime.dataplane.plane.LoadTicket`)."""

    def __init__(self, page: int, req: Request, pages: int, rows: torch.Tensor,
                 slot: int | None) -> None:
        self.page = page  # tokens per tree page
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
        #: pages every rank agreed to keep (several ranks only; None: decide locally)
        self.agreed_pages: int | None = None
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
        return self.pages * self.page



class RestoreRoom(LinkerRoom):
    """LOAD, COMMIT and ABORT for the :class:`~hylinker.runtime.linker.facade.Linker` (its counters,
    tree, rules, data plane and store; a commit moves the request's lock through the linker)."""

    def __init__(self, ctx: LinkerContext) -> None:
        super().__init__(ctx)
        self.waiting = 0  # loads waiting for pages now (LinkerConfig.load_wait_s)


    async def load(self, req: Request) -> LoadHandle | None:
        """PREPARE (allocate rows/slot, evicting if short) and queue the reads.

        Returns ``None`` — a plain miss, the request recomputes — when the store has
        nothing for this request or allocation fails (after waiting ``load_wait_s`` for pages).
        """
        self.ctx.check_open(req)
        if not req.looked_up:
            raise PhaseError("load before lookup")
        if req.load is not None:
            raise PhaseError(f"request {req.id!r} already has a load")
        n = req.store_pages
        collective = self.agreement.collective and req.ranks_load
        if n == 0 and not collective:
            return None
        handle = await self._queue(req) if n else None
        if not collective:
            return handle
        return await self._agree(req, handle)

    async def _queue(self, req: Request) -> LoadHandle | None:
        """Allocate and queue the reads of ``req.store_pages`` pages (None: a miss)."""
        n = req.store_pages
        t0 = time.perf_counter()
        self._c["loads"] += 1
        got = self._allocate(n)
        if got is None and self._may_wait(req, n):
            got = await self._wait_for_pages(req, n)
        if got is None:
            self._c["load_misses"] += 1
            trace("load.miss", request_id=req.id, reason="allocation", pages=n)
            return None
        rows, slot = got
        handle = LoadHandle(self.page, req, n, rows, slot)
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
            await self.settle(handle)
            return None
        # us: allocation and submission (waiting for queue space): the start of the load's span
        trace("load.queued", request_id=req.id, pages=n, first_page=first, slot=slot,
              us=round((time.perf_counter() - t0) * 1e6))
        return handle

    def _allocate(self, n: int) -> tuple[torch.Tensor, int | None] | None:
        """Rows for ``n`` pages and (hybrid) a state slot, evicting if short; None: not now."""
        rows = self.tree.try_alloc_rows(n)
        if rows is None:
            return None
        if not self.layout.is_hybrid:
            return rows, None
        slot = self.tree.try_alloc_slot()
        if slot is None:
            self.tree.free_rows(rows, wake=False)  # rolled back: nothing came free
            return None
        return rows, slot

    def _may_wait(self, req: Request, n: int) -> bool:
        """Whether a load that found no pages should wait for them: waiting is on, this rank
        loads alone (several ranks take every allocation in the same order, never waiting), the
        pool could ever hold the load beside the request's own prefix, and someone that is not
        itself waiting (an open request, an offload in flight) may still give pages back. The
        recompute would need at least the same pages, so waiting for them costs nothing the
        recompute would not."""
        if self.config.load_wait_s <= 0 or self.agreement.collective:
            return False
        if req.prefix_pages + n > self.ctx.pools.kv.pages.capacity:
            return False
        return self._givers() - 1 > 0  # besides this request

    def _givers(self) -> int:
        """Open requests not waiting for pages, and offloads in flight."""
        return self.ctx.holders() - self.waiting

    async def _wait_for_pages(self, req: Request, n: int) -> tuple[torch.Tensor, int | None] | None:
        """Wait (at most ``load_wait_s``) for ``n`` pages and a slot to come back; None: a miss.
        The waiter holds nothing but its prefix's lock while it waits; it tries again at every
        unlock or free, and gives up as soon as only waiters are left (no one else can give
        anything back), at the limit, or when the request or the linker closes."""
        self._c["load_waits"] += 1
        self.waiting += 1
        t0 = time.perf_counter()
        trace("load.wait", request_id=req.id, pages=n)
        got: tuple[torch.Tensor, int | None] | None = None
        ended = "limit"
        try:
            with anyio.move_on_after(self.config.load_wait_s):
                while got is None:
                    await self.tree.released()
                    try:
                        self.ctx.check_open(req)
                    except PhaseError:  # released, or the linker is closing
                        ended = "closing"
                        break
                    got = self._allocate(n)
                    if got is None and self._givers() == 0:  # this request waits too
                        ended = "no_holders"
                        break
        finally:
            self.waiting -= 1
        if got is None:
            self._c["load_waits_recomputed"] += 1
        trace("load.waited", request_id=req.id, pages=n, served=got is not None,
              ended=None if got is not None else ended, us=round((time.perf_counter() - t0) * 1e6))
        return got

    async def _agree(self, req: Request, handle: LoadHandle | None) -> LoadHandle | None:
        """LOAD across ranks: wait for this rank's reads, offer every prefix they (and the
        device tree) can restore, and keep the largest one every rank can. A rank whose load
        does not reach it drops the load; a rank standing deeper moves back to it. Nothing is
        committed here: the caller commits the handle (trimmed to the agreed pages) as usual."""
        first = req.prefix_pages
        offered: tuple[int, ...] = ()
        if handle is not None:
            with anyio.CancelScope(shield=True):  # the round must happen whatever the caller does
                await handle.done.wait()
            offered = tuple(first + k for k in self._restorable(handle))
        points = None
        if self.layout.is_hybrid:
            points = tuple(n.end_page for n in req.node.path() if n.mamba_slot is not None)
        mine: Boundaries = (first, points, offered)
        with anyio.CancelScope(shield=True):
            agreed = await self.agreement.largest_common("requests", "load", req.id, mine)
        local = max(offered, default=first)
        if agreed < local:
            self._c["rank_shortened_loads"] += 1
            trace("load.rank_shortened", request_id=req.id, local=local, agreed=agreed)
        if handle is not None and agreed > first:
            handle.agreed_pages = agreed - first
            return handle
        if handle is not None:  # another rank cannot restore what this one read
            self._c["dropped_loads"] += 1
            self._forget_bad_objects(handle)
            self._free_load(handle)
        if agreed < first:
            keys = self.tree.path_keys(req.node)[:agreed]
            shorter = self.tree.match(keys)
            if shorter.pages != agreed:
                raise AssertionError(f"device tree restores {shorter.pages} pages, agreed {agreed}")
            self.ctx.move_lock(req, shorter.node)
        return None

    async def commit(self, load: LoadHandle) -> int:
        """Insert the restored prefix; returns tokens restored (0: dropped, recompute)."""
        req = load.request
        self.ctx.check_open(req)
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
        """How much of a finished load can be restored (all of it when everything verified;
        with several ranks, what they agreed)."""
        if load.agreed_pages is not None:
            return load.agreed_pages
        return max(self._restorable(load), default=0)

    def _restorable(self, load: LoadHandle) -> list[int]:
        """Every prefix of a finished load that can be restored (pages past the request's)."""
        out = load.outcome
        if out is None or out.cancelled:
            return []
        page_ok = [ok for kind, ok in out.objects.items() if kind is not PoolKind.MAMBA]
        states = None
        if PoolKind.MAMBA in out.objects:
            states = [(b, ok) for (b, _), ok in zip(load.states, out.objects[PoolKind.MAMBA])]
        return restorable_prefixes(page_ok, n_pages=load.pages, first_page=load.request.prefix_pages,
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
        # what the tree adopted came from the store: never write it back; what came from host
        # staging the store has not acknowledged: stays unstored (offloaded again, EXISTS if it landed)
        from_store = load.ticket is None or load.ticket.from_staging == 0
        adopted_pages = ins.existing_pages < len(keys)
        adopted_state = load.slot is not None and not ins.mamba_exist
        if from_store:
            ins.node.stored.update(k for k, rule in self.rules.items()
                                   if rule.stored_by_commit(adopted_pages, adopted_state))
        load.finished = True
        load.settled.set()
        req.load = None
        self.ctx.move_lock(req, ins.node)
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

    async def settle(self, load: LoadHandle) -> None:
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
        """Remove from the store what this load proved bad (failed verification after the
        re-read), exactly as it read it (``stores/condemned.py``): puts are first-writer-wins,
        so a bad object stays bad until removed, and the next offload of those pages writes a
        good one. An object that only failed to arrive (failed, timed-out, unreachable or
        cancelled read) proves nothing and stays for everyone else (``failed_objects_kept``)."""
        out = load.outcome
        if out is None:
            return
        unproven = sum(1 for kind, keys in load.keys.items()
                       for key, ok in zip(keys, out.objects.get(kind, [])) if not ok
                       for name in self.data.store_keys(kind, key) if name not in out.condemned)
        self._c["failed_objects_kept"] += unproven
        if out.condemned and self.store.capabilities.remove and self.ctx.running():
            self.ctx.spawn(self._remove_condemned, dict(out.condemned))

    async def _remove_condemned(self, condemned: dict[str, Condemned]) -> None:
        try:
            removed = await remove_condemned(self.store, condemned)
        except StoreError as exc:
            trace("remove.store_error", error=str(exc), keys=len(condemned))
            return
        self._c["bad_objects_removed"] += removed
        self._c["bad_objects_rewritten"] += len(condemned) - removed
        trace("remove.condemned", removed=removed, kept=len(condemned) - removed,
              faults=sorted({c.fault for c in condemned.values()}))

