"""The offload room: which nodes an insert sends to the store, when it sends nothing
(the backpressure rules), and the one settlement per offload that marks what reached the store
and drops the locks. In two stages (``LinkerConfig.two_stage_offload``, docs/design/host-staging.md)
the locks drop once the data plane copied the nodes' rows into host staging, and the nodes are
marked stored only at the store's answer; a full host staging budget skips the offload. :class:`OffloadRoom` owns every piece of offload bookkeeping: the jobs in
flight, the KV pages they lock, and the idle event :meth:`drain` waits on.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import anyio

from ...components.layout import PoolKind
from ...components.radix import Node
from ...stores.base import StoreError
from ..dataplane.events import DeviceEvent
from ..dataplane.host_staging import HostStagingFullError
from ..dataplane.plane import Transfer
from ..dataplane.tickets import OffloadTicket
from ..dataplane.tracing import trace
from .agreement import AgreementError, page_runs, runs_pages
from .request import LinkerRoom

if TYPE_CHECKING:
    from .context import LinkerContext
    from .request import Request
    from .touch_room import TouchBatcher

_WRITES = "writes"  # a settlement report's entry: which pools the reporting rank writes

#: one pool's part of an offload: the job (None: another rank writes this replicated pool),
#: absolute page -> position of its object, and the object keys
_OffloadPlan = tuple[bool, dict[int, int], list[str]]  # (written by this rank, page -> object, keys)


class OffloadRoom(LinkerRoom):
    """Offload planning, backpressure and settlement for the :class:`~hylinker.runtime.linker.facade.Linker`.

    It works on the :class:`~hylinker.runtime.linker.context.LinkerContext` the linker hands it: the
    counters it moves are ``offloads``, ``offloads_skipped_*``, ``offloads_dropped``,
    ``offload_failures`` and ``offloads_verified_replicas``; ``spawn`` starts its settlements in
    the linker's task group.
    """

    def __init__(self, ctx: LinkerContext, toucher: TouchBatcher | None = None) -> None:
        super().__init__(ctx)
        #: TOUCH of the path an offload settles below (``LinkerConfig.touch_on_offload``)
        self.toucher = toucher
        self.pools = ctx.pools
        self._spawn = ctx.spawn
        self.in_flight = 0  # offloads submitted and not yet settled
        #: KV pages of nodes locked by offloads in flight (two stages: until their rows were copied)
        self.locked_pages = 0
        self.locked_nodes = 0  # node locks the offloads in flight hold (one per node sent)
        self.largest_request_pages = 0  # the most KV pages one request has held (extend)
        self._idle = anyio.Event()
        self._idle.set()
        self._job_ids = itertools.count(1)
        # several ranks: one settlement round per offload call, in call order (the sequencer)
        self._next_turn = 0
        self._turn = 0
        self._turn_changed = anyio.Event()

    async def drain(self) -> None:
        """Wait until every submitted offload has been acknowledged and its locks dropped."""
        await self._idle.wait()

    async def offload(self, req: Request, node: Node, fence: DeviceEvent | None) -> None:
        """Plan what ``node``'s path still lacks in the store, apply the backpressure rules,
        lock the planned nodes and submit; settlement runs as its own task.

        With several ranks every call settles through one agreement round, in call order, even
        when this rank sends nothing (its peers may have): a part is marked stored only where
        every rank reports its own part stored."""
        turn: int | None = None
        if self.agreement.collective:
            turn = self._next_turn
            self._next_turn += 1
        spawned = [False]
        try:
            await self._offload(req, node, fence, turn, spawned)
        finally:
            if turn is not None and not spawned[0]:
                self._begin()
                self._spawn(self._finish, 0, req.id, node, {}, None, [], 0, turn)

    def _begin(self) -> None:
        if self.in_flight == 0:
            self._idle = anyio.Event()
        self.in_flight += 1

    def _plan(self, node: Node) -> dict[PoolKind, list[Node]]:
        """Per pool, the nodes of ``node``'s path it holds that are neither stored nor pending."""
        path = node.path()
        plan: dict[PoolKind, list[Node]] = {}
        for kind, rule in self.rules.items():
            todo = [n for n in path if rule.holds(n) and kind not in n.stored and kind not in n.pending]
            if todo:
                plan[kind] = todo
        return plan

    def _kv_pressed(self, new_pages: int) -> bool:
        """The KV backpressure rule (see :meth:`_offload`): offloads lock too much of a pool
        short of headroom. ``new_pages``: the offload's own pages (one stage only)."""
        kv_limit = self.config.kv_backpressure_share * self.pools.kv.pages.capacity
        reserve = max(kv_limit, self.largest_request_pages)
        # Two stages: the locks last one copy, so only a copy backlog already past the share
        # counts (the new offload's own pages are free again a copy later)
        backlog = self.locked_pages if self.config.two_stage_offload else self.locked_pages + new_pages
        return bool(self.locked_pages) and backlog > kv_limit and self.tree.kv_headroom_pages() < reserve

    async def _wait_for_copies(self, req: Request) -> bool:
        """Two stages: while the KV rule holds, wait (at most ``kv_backpressure_wait_s``) for the
        copies in flight to give their pages back, instead of skipping at once. The request still
        locks its own nodes meanwhile, so the offloads never lock more than the rule allows.
        True when it waited."""
        wait_s = self.config.kv_backpressure_wait_s
        if not (self.config.two_stage_offload and wait_s > 0 and self._kv_pressed(0)):
            return False
        self._c["offloads_waited_kv"] += 1
        trace("offload.waiting", request_id=req.id, reason="kv_backpressure", locked_pages=self.locked_pages)
        with anyio.move_on_after(wait_s):
            while self._kv_pressed(0):
                await self.tree.released()  # an unlock (a copy ended) or pages freed
        return True

    async def _offload(self, req: Request, node: Node, fence: DeviceEvent | None, turn: int | None,
                       spawned: list[bool]) -> None:
        plan = self._plan(node)
        if not plan:
            return
        if await self._wait_for_copies(req):
            plan = self._plan(node)  # another offload may have taken some of its nodes meanwhile
            if not plan:
                return
        self._c["offloads"] += 1
        pressure = self.data.backpressure()
        if pressure.breaker_open:
            # the store is down: lock nothing, send nothing (lookups probe it meanwhile)
            self._c["offloads_skipped_breaker"] += 1
            trace("offload.skipped", request_id=req.id, reason="breaker_open")
            return
        if PoolKind.MAMBA in plan and self.config.mamba_backpressure:
            assert self.pools.mamba is not None
            limit = self.config.mamba_backpressure_share * self.pools.mamba.slots.capacity
            # queued and in-flight states must stay below the limit (3/4 of the pool)
            if pressure.pending_states + len(plan[PoolKind.MAMBA]) >= limit:
                self._c["offloads_skipped_mamba"] += 1
                trace("offload.skipped", request_id=req.id, reason="mamba_backpressure",
                      pending=pressure.pending_states)
                return
        # KV backpressure: nodes stay locked until their offload settles (two stages: until
        # their rows were copied into host staging, one copy, not one store round trip), so a slow store and
        # long prompts could otherwise lock the whole KV pool and make `extend` fail. Skip only
        # while the backlog is large *and* the pool is short of headroom (pages free or
        # evictable) for the largest request seen; a large backlog in a roomy pool threatens no
        # allocation.
        new_pages = sum(len(n.keys) for n in {n.id: n for ns in plan.values() for n in ns}.values())
        if self._kv_pressed(new_pages):
            self._c["offloads_skipped_kv"] += 1
            trace("offload.skipped", request_id=req.id, reason="kv_backpressure",
                  locked_pages=self.locked_pages, pages=new_pages)
            return
        if pressure.dropping:
            self._c["offloads_dropped"] += 1
            trace("offload.dropped", request_id=req.id, reason="latency", ema_ms=pressure.latency_ema_ms)
            return
        jobs: dict[PoolKind, _OffloadPlan] = {}
        transfers: list[Transfer] = []
        for kind, nodes in plan.items():
            # absolute page -> position of its object in the job (MAMBA: the state's key page)
            where: dict[int, int] = {}
            for n in nodes:
                for j in self.rules[kind].pages(n):
                    where[j] = len(where)
            names, index = self.rules[kind].node_objects(nodes)
            if not self.rules[kind].writes:
                # the owner rank writes a replicated pool: settle by what the store holds
                jobs[kind] = (False, where, names)
                continue
            jobs[kind] = (True, where, names)
            transfers.append(Transfer(kind, names, index))
        # MAMBA first: the data plane counts its states as pending before its first await,
        # so no other task passes the backpressure check above on a stale count
        transfers.sort(key=lambda t: t.pool is not PoolKind.MAMBA)
        try:  # two stages: the frames' bytes are charged here, or the budget is full
            ticket = self.data.prepare_offload(transfers, fence=fence, request_id=req.id)
        except HostStagingFullError as exc:
            self._c["offloads_skipped_staging"] += 1
            trace("offload.skipped", request_id=req.id, reason="host_staging_full", error=str(exc))
            return
        job_id = next(self._job_ids)
        locked: dict[int, Node] = {}  # node id -> node, locked once per offload
        for kind, nodes in plan.items():
            for n in nodes:
                n.pending[kind] = job_id
                if n.id not in locked:
                    self.tree.lock(n)
                    locked[n.id] = n
        locked_pages = sum(len(n.keys) for n in locked.values())
        self.locked_pages += locked_pages
        self.locked_nodes += len(locked)
        self._begin()
        try:
            await self.data.submit(ticket)
        finally:
            spawned[0] = True
            self._spawn(self._finish, job_id, req.id, node, jobs, ticket, list(locked.values()),
                        locked_pages, turn)

    async def _finish(self, job_id: int, request_id: str, end: Node, jobs: dict[PoolKind, _OffloadPlan],
                      ticket: OffloadTicket | None, locked: list[Node], locked_pages: int,
                      turn: int | None = None) -> None:
        """Exactly one settlement per offload: mark what reached the store, then unlock (in two
        stages: unlock once the rows were copied into host staging, then mark at the store's answer)."""
        failed = False
        held = [True]  # the locks are still held
        try:
            outcome = None
            local: dict[PoolKind, list[bool] | None] = {}
            try:
                if ticket is not None and ticket.two_stage:
                    await ticket.copied()  # stage 1 ended: no job reads the rows any more
                    if ticket.in_frames(PoolKind.MAMBA):  # restorable from its frame: evictable
                        self.tree.tree.copied_states.add(job_id)
                    self._unlock(locked, locked_pages, held)
                outcome = None if ticket is None else await ticket.wait()
                for kind, (written, where, names) in jobs.items():
                    if not written:
                        # several ranks: verified after the writer reported its write (_agree)
                        local[kind] = None if turn is not None else await self._replica_outcomes(names)
                    elif outcome is None:
                        local[kind] = None
                    else:
                        local[kind] = outcome.objects.get(kind, [False] * len(where))
            except Exception as exc:  # nothing counts as stored; the turn below is still taken
                trace("offload.error", request_id=request_id, error=f"{type(exc).__name__}: {exc}")
                outcome, local = None, {kind: None for kind in jobs}
            if turn is not None:
                local = await self._agree(turn, request_id, end, jobs, local)
            settled = self._settled_nodes(end, locked)
            for kind, (_written, where, _names) in jobs.items():
                stored = local[kind]
                if stored is None or not all(stored):
                    failed = True
                self._settle(kind, job_id, settled, where, stored)
            if outcome is not None and outcome.faults:
                trace("offload.error", request_id=request_id, faults=outcome.faults)
            self._touch_path(end)
        finally:
            if failed:
                self._c["offload_failures"] += 1  # one result per offload, not one per pool
            self._unlock(locked, locked_pages, held)
            self.tree.tree.copied_states.discard(job_id)
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def _unlock(self, locked: list[Node], locked_pages: int, held: list[bool]) -> None:
        """Drop an offload's node locks once (``held[0]`` says whether they are still held)."""
        if not held[0]:
            return
        held[0] = False
        for n in locked:
            self.tree.unlock(n)
        self.locked_pages -= locked_pages
        self.locked_nodes -= len(locked)

    async def _agree(self, turn: int, request_id: str, end: Node, jobs: dict[PoolKind, _OffloadPlan],
                     local: dict[PoolKind, list[bool] | None]) -> dict[PoolKind, list[bool] | None]:
        """Settle one offload across ranks, in turn: each rank reports the pages of ``end``'s
        path whose part it holds in the store (stored before, or written now); a page counts
        as stored where every rank reports it. A replicated pool is reported by its writer
        first; the other ranks then check the store for those objects (``exists``) and report
        again, so nobody marks a replica stored that is not there."""
        while self._turn != turn:
            await self._turn_changed.wait()
        try:
            path = end.path()
            mine: dict[str, set[int]] = {}
            for kind, rule in self.rules.items():
                have = {j for n in path if kind in n.stored for j in rule.pages(n)}
                stored = local.get(kind)
                if kind in jobs and stored is not None:
                    have.update(j for j, pos in jobs[kind][1].items() if stored[pos])
                mine[kind.value] = have
            tag = f"{request_id}#{turn}"
            reports = await self._report(tag, "settle", mine)
            replicated = [k for k in self.rules if k in self.layout.replicated]
            if replicated:
                for kind in replicated:
                    # what every writer of the pool reported (ModelLayout.writes: TP rank 0, or
                    # one per DCP rank); this rank then checks its own objects of those pages
                    writers = [r for r, rep in enumerate(reports) if rep[_WRITES][kind.value]]
                    written = set.intersection(*(reports[r][kind.value] for r in writers)) if writers else set()
                    if kind in jobs and not jobs[kind][0]:
                        where, names = jobs[kind][1], jobs[kind][2]
                        asked = [j for j in where if j in written]
                        present = await self._replica_outcomes([names[where[j]] for j in asked]) if asked else []
                        mine[kind.value] = mine[kind.value] | {j for j, ok in zip(asked, present) if ok}
                reports = await self._report(tag, "verify", mine)
            out: dict[PoolKind, list[bool] | None] = {}
            for kind, (_written, where, _names) in jobs.items():
                agreed = set.intersection(*(r[kind.value] for r in reports))
                out[kind] = [j in agreed for j in where]
                was = local.get(kind)
                if was is not None and all(was) and not all(j in agreed for j in where):
                    self._c["rank_unsettled_offloads"] += 1
            return out
        except AgreementError as exc:
            trace("offload.agreement_error", request_id=request_id, error=str(exc))
            return {kind: None for kind in jobs}
        finally:
            self._turn += 1
            changed, self._turn_changed = self._turn_changed, anyio.Event()
            changed.set()

    async def _report(self, tag: str, phase: str, mine: dict[str, set[int]]) -> list[dict[str, Any]]:
        """Every rank's pages per pool, sent as runs of consecutive pages (a few numbers for a
        long path, so a round stays within one slot), and which pools the rank writes."""
        sent: dict[str, Any] = {kind: page_runs(pages) for kind, pages in mine.items()}
        sent[_WRITES] = {k.value: rule.writes for k, rule in self.rules.items()}
        got: list[dict[str, Any]] = await self.agreement.gather("offloads", phase, tag, sent)
        return [{kind: (v if kind == _WRITES else runs_pages(v)) for kind, v in r.items()} for r in got]

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

    def _touch_path(self, end: Node) -> None:
        """TOUCH what ``end``'s path already held in the store, once its new objects settled.

        An offload writes only what the path lacks, so without this the prefix a conversation
        keeps extending is the *oldest* part of it in the store's recency order, and a store
        that evicts by its own LRU drops the prefix first, leaving the newer pages below it
        unrestorable. Touched after the put, tail first, the path's objects are more recent the
        nearer they are to the root: the store's LRU evicts a path from its tail."""
        if self.toucher is None or not (self.config.touch and self.config.touch_on_offload
                                        and self.store.capabilities.touch):
            return
        # tail first, root last: the store's LRU then evicts this path from its tail
        names = [name for n in reversed(end.path()) for rule in self.rules.values()
                 for name in reversed(rule.stored_names([n]))]
        if names:
            self._c["touch_keys"] += len(names)
            self.toucher.add(names)

    def _settled_nodes(self, end: Node, planned: list[Node]) -> list[Node]:
        """The nodes that may carry an offload's pending marks: the paths of ``end`` and of
        every node it planned (split fragments sit on them). In two stages a planned node may
        have been evicted after its copy (detached: its path is itself), so a fragment split
        off it may be anywhere in the tree: then every node is looked at."""
        on_path = {n.id: n for n in end.path()}
        nodes = {**on_path, **{n.id: n for n in planned}}
        for p in planned:
            if p.id not in on_path:  # on end's path, its own path is a part of end's
                nodes.update((n.id, n) for n in p.path())
        if any(p.parent is None for p in planned):
            nodes.update((n.id, n) for n in self.tree.tree.nodes())
        return list(nodes.values())

    def _settle(self, kind: PoolKind, job_id: int, nodes: list[Node], where: dict[int, int],
                stored: list[bool] | None) -> None:
        """Clear this job's pending marks on ``nodes`` (:meth:`_settled_nodes`); mark
        ``stored`` where every object of the node reached the store. A failure never clears a
        ``stored`` flag an earlier success set."""

        for n in nodes:
            if n.pending.get(kind) != job_id:
                continue
            del n.pending[kind]
            if stored is None:
                continue
            if all(j in where and stored[where[j]] for j in self.rules[kind].pages(n)):
                if kind is PoolKind.FULL and kind not in n.stored:
                    self._c["stored_tokens"] += len(n.keys) * self.page
                n.stored.add(kind)

