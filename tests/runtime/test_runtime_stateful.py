"""A stateful property test of the runtime: many requests' phases interleaved, against a store
that fails, corrupts, tears, loses and delays objects at random.

The linker runs on an event loop in its own thread (an anyio blocking portal); each rule calls
into it through the portal, so background work (offloads, loads, touches) keeps running
between and during steps, as in a server. After every step, inside the loop thread:

* the tree agrees with the allocators, and every row and slot is accounted for exactly:
  pool usage = the tree's pages/states + what open requests and their unfinished loads own
  (a leak or a double free breaks the equation; a double free also raises in the allocator);
* every open request stands on a locked node that is still in the tree;
* every page and state the tree holds carries the synthetic content of its page key, i.e.
  exactly what the request that computed it wrote and offloaded, and every committed
  restore is checked the same way right after COMMIT.

At the end of every run all requests are released and offloads drained: no lock is left,
nothing is queued, and after a flush every row and slot is free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import attrs
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hylinker.components.pools import HybridPools
from hylinker.components.radix import Node
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import LoadHandle, Request
from hylinker.runtime.linker.tree_writer import PoolExhaustedError
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import small_hybrid_layout, synthetic_prefill

LAYOUT = small_hybrid_layout()  # P = 4, G = 8
P = LAYOUT.page_size
KV_PAGES = 40
SLOTS = 10
MAX_OPEN = 5
BASES = [np.random.default_rng(100 + i).integers(1, 500, size=48).astype(np.int32) for i in range(3)]

plans = st.builds(
    FaultPlan,
    fail=st.sampled_from([0.0, 0.0, 0.01, 0.05]),
    corrupt=st.sampled_from([0.0, 0.0, 0.02]),
    torn=st.sampled_from([0.0, 0.0, 0.02]),
    vanish=st.sampled_from([0.0, 0.0, 0.02]),
    unavailable=st.sampled_from([0.0, 0.0, 0.02]),
    latency_ms=st.sampled_from([0.0, 0.0, 0.5]),
    jitter_ms=st.sampled_from([0.0, 1.0]),
)


@attrs.define(eq=False)
class Open:
    req: Request
    load: LoadHandle | None = None
    prefilled: bool = False


class LinkerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self.open: dict[str, Open] = {}
        self.ids = 0
        self.linker: Any = None

    # ---- set-up / tear-down ------------------------------------------------------------
    @initialize(plan=plans, seed=st.integers(0, 2**16), queue_depth=st.sampled_from([2, 64]))
    def start(self, plan: FaultPlan, seed: int, queue_depth: int) -> None:
        from hylinker.runtime.linker.facade import Linker

        self.inner = EmbeddedStore(4 << 20)
        self.store = FaultyStore(self.inner, plan, seed=seed)
        self.pools = HybridPools(LAYOUT, kv_pages=KV_PAGES, mamba_slots=SLOTS)
        self.content = SyntheticContent(self.pools)
        config = LinkerConfig(staging_bytes_per_pool=4096, queue_depth=queue_depth,
                              touch_interval_s=0.001)
        self.linker = Linker(LAYOUT, self.pools, self.store, config)
        self._linker_cm = self.portal.wrap_async_context_manager(self.linker)
        self._linker_cm.__enter__()

    def teardown(self) -> None:
        error: BaseException | None = None
        try:
            if self.linker is not None:
                try:
                    for rid in list(self.open):
                        self._release(rid)
                    self.portal.call(self.linker.drain)
                    self.portal.call(self._check_quiet)
                finally:
                    self._linker_cm.__exit__(None, None, None)
                self.linker.flush_device()
                self.pools.check_idle()
                self.portal.call(self.inner.close)
        except BaseException as exc:
            error = exc
            raise
        finally:
            # on a failure, cancel whatever is left so a failing example never hangs
            self._portal_cm.__exit__(type(error) if error else None, error, None)

    def _check_quiet(self) -> None:
        lk = self.linker
        lk.check_idle()  # no request, no lock, tree == allocators
        assert lk.tree.tree.locked_nodes() == []
        for stats in lk.pool_statistics().values():
            assert stats.offload_queue.depth == 0 and stats.load_queue.depth == 0
            assert stats.pending_states == 0
        assert all(not n.pending for n in lk.tree.tree.nodes())

    # ---- helpers -------------------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.portal.call(fn, *args)

    def _pick(self, i: int, want: Callable[[Open], bool]) -> Open | None:
        cands = [o for _, o in sorted(self.open.items()) if want(o)]
        return cands[i % len(cands)] if cands else None

    def _release(self, rid: str) -> None:
        o = self.open.pop(rid)
        self._call(self.linker.release, o.req)
        assert o.req.released and (o.load is None or o.load.finished)

    def _prefix_ok(self, req: Request) -> None:
        problems = self._call(self.content.prefix_problems, self.linker, req)
        assert problems == [], f"{req.id}: wrong restored content {problems}"

    # ---- rules ---------------------------------------------------------------------------
    @precondition(lambda self: self.linker is not None and len(self.open) < MAX_OPEN)
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.sampled_from([8, 16, 20, 32, 40, 48]),
          tail=st.lists(st.integers(1, 9), max_size=12), cancel=st.booleans())
    def admit(self, base: int, cut: int, tail: list[int], cancel: bool) -> None:
        tokens = np.concatenate([BASES[base][:cut], np.array(tail, dtype=np.int32)])
        if len(tokens) < 2:
            return
        self.ids += 1
        rid = f"r{self.ids}"
        req = self._call(self.linker.request, rid, tokens)
        self.open[rid] = Open(req)

        async def lookup() -> None:
            with anyio.CancelScope() as scope:
                if cancel:
                    scope.cancel()  # cancelled at the store probe, if it reaches one
                await self.linker.lookup(req)

        self._call(lookup)
        assert req.looked_up and req.prefix_tokens + req.store_pages * P <= len(tokens) - 1
        self._prefix_ok(req)  # a device hit holds exactly what was computed

    @precondition(lambda self: bool(self.open))
    @rule(i=st.integers(0, 64), cancel=st.booleans())
    def load(self, i: int, cancel: bool) -> None:
        o = self._pick(i, lambda o: o.load is None and not o.prefilled and o.req.load is None
                       and o.req.rows.numel() == o.req.prefix_tokens)
        if o is None:
            return

        async def load() -> LoadHandle | None:
            with anyio.CancelScope() as scope:
                if cancel:
                    scope.cancel()  # cancelled while queueing the reads
                return await self.linker.load(o.req)
            return o.req.load

        o.load = self._call(load)

    @precondition(lambda self: bool(self.open))
    @rule(i=st.integers(0, 64), how=st.sampled_from(["wait", "wait_layer", "commit"]))
    def cancel_a_waiter(self, i: int, how: str) -> None:
        o = self._pick(i, lambda o: o.load is not None and not o.load.finished)
        if o is None:
            return
        load = o.load
        assert load is not None

        async def wait() -> None:
            with anyio.CancelScope() as scope:
                scope.cancel()
                if how == "wait":
                    await load.wait()
                elif how == "wait_layer":
                    await load.wait_layer(0)
                else:
                    await self.linker.commit(load)

        self._call(wait)

    @precondition(lambda self: bool(self.open))
    @rule(i=st.integers(0, 64))
    def commit(self, i: int) -> None:
        o = self._pick(i, lambda o: o.load is not None and not o.load.finished)
        if o is None:
            return
        assert o.load is not None
        before = o.req.prefix_tokens
        n = self._call(self.linker.commit, o.load)
        assert o.load.finished
        if n:
            assert o.req.prefix_tokens == before + n
            self._prefix_ok(o.req)
        else:
            assert o.req.prefix_tokens == before
        o.load = None

    @precondition(lambda self: bool(self.open))
    @rule(i=st.integers(0, 64))
    def abort(self, i: int) -> None:
        o = self._pick(i, lambda o: o.load is not None and not o.load.finished)
        if o is None:
            return
        assert o.load is not None
        self._call(self.linker.abort, o.load)
        o.load = None

    @precondition(lambda self: bool(self.open))
    @rule(i=st.integers(0, 64), cancel=st.booleans())
    def prefill(self, i: int, cancel: bool) -> None:
        o = self._pick(i, lambda o: not o.prefilled and (o.load is None or o.load.finished))
        if o is None:
            return
        o.load = None
        o.prefilled = True

        async def forward() -> None:
            with anyio.CancelScope() as scope:
                if cancel:
                    scope.cancel()  # cancelled while queueing the offload
                # PoolExhaustedError: the device is full of locked work; the request gives up
                with contextlib.suppress(PoolExhaustedError):
                    await synthetic_prefill(self.linker, self.content, o.req)

        self._call(forward)
        self._prefix_ok(o.req)

    @precondition(lambda self: bool(self.open))
    @rule(i=st.integers(0, 64))
    def release(self, i: int) -> None:
        o = self._pick(i, lambda o: True)
        assert o is not None
        self._release(o.req.id)

    @precondition(lambda self: self.linker is not None and len(self.open) < MAX_OPEN)
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.sampled_from([16, 24, 40, 48]),
          tails=st.lists(st.lists(st.integers(1, 9), max_size=6), min_size=1, max_size=3),
          restore=st.sampled_from(["commit", "abort"]), drain=st.booleans(),
          cold=st.booleans())
    def serve(self, base: int, cut: int, tails: list[list[int]], restore: str, drain: bool,
              cold: bool) -> None:
        """Up to three concurrent whole requests sharing a prefix: lookup, restore (commit or
        abort), prefill, release. ``cold``: the device first evicted everything it could, so
        the store has to serve the prefix (and concurrent restores of it race at COMMIT)."""
        lk = self.linker

        async def one(rid: str, tokens: np.ndarray) -> None:
            async with lk.session(rid, tokens) as req:
                await lk.lookup(req)
                load = await lk.load(req)
                if load is not None:
                    if restore == "commit":
                        await lk.commit(load)
                    else:
                        await lk.abort(load)
                problems = self.content.prefix_problems(lk, req)
                assert problems == [], f"{rid}: wrong restored content {problems}"
                with contextlib.suppress(PoolExhaustedError):
                    await synthetic_prefill(lk, self.content, req)
            assert req.released

        async def serve() -> None:
            if cold:
                lk.tree.tree.evict_states(SLOTS)
                lk.tree.tree.evict_pages(KV_PAGES)
            async with anyio.create_task_group() as tg:
                for tail in tails:
                    self.ids += 1
                    tokens = np.concatenate([BASES[base][:cut], np.array(tail, dtype=np.int32)])
                    tg.start_soon(one, f"s{self.ids}", tokens)
            if drain:
                await lk.drain()

        self._call(serve)

    @precondition(lambda self: self.linker is not None)
    @rule()
    def drain(self) -> None:
        self._call(self.linker.drain)

    @precondition(lambda self: self.linker is not None)
    @rule(pages=st.integers(1, KV_PAGES), states=st.integers(0, SLOTS))
    def evict(self, pages: int, states: int) -> None:
        """Device memory pressure: evict unlocked pages and states (LRU)."""
        def evict() -> None:
            tree = self.linker.tree.tree
            tree.evict_states(states)
            tree.evict_pages(pages)

        self._call(evict)

    @precondition(lambda self: self.linker is not None and not self.open)
    @rule()
    def flush(self) -> None:
        """Quiesce and flush the device: locks return to zero, the pools are whole."""
        self._call(self.linker.drain)
        self._call(self._check_quiet)
        self._call(self.linker.flush_device)
        self.pools.check_idle()

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def accounted(self) -> None:
        if self.linker is not None:
            self._call(self._accounted)

    def _accounted(self) -> None:
        lk = self.linker
        tree = lk.tree.tree
        tree.check_consistent()
        assert set(lk._requests) == set(self.open)
        pages = slots = 0
        for o in self.open.values():
            req = o.req
            assert req.rows.numel() % P == 0
            pages += req.rows.numel() // P - req.prefix_pages
            slots += len(req.checkpoints) + (req.working is not None)
            if req.load is not None and not req.load.finished:
                pages += req.load.rows.numel() // P
                slots += len(req.load.states)
            if req.node is not tree.root:
                assert req.node.lock >= 1 and req.node.mamba_lock >= 1
                assert _attached(req.node, tree.root), f"{req.id} stands on an evicted node"
                assert req.state_source == req.node.mamba_slot
        stats = tree.statistics()
        assert self.pools.kv.pages.capacity - self.pools.kv.num_free_pages == stats.pages + pages
        mamba = self.pools.mamba
        assert mamba is not None
        assert mamba.slots.capacity - mamba.num_free == stats.states + slots
        for node in tree.nodes():
            assert self.content.pages_match(node.keys, node.rows) == [], f"{node!r} holds wrong KV"
            if node.mamba_slot is not None:
                assert self.content.state_matches(node.keys[-1], node.mamba_slot), \
                    f"{node!r} holds a wrong state"
        for actor in lk.actors.values():
            assert actor.pending_states >= 0
            assert actor.offload_q.depth >= 0 and actor.load_q.depth >= 0


def _attached(node: Node, root: Node) -> bool:
    while node.parent is not None:
        if node.parent.children.get(node.keys[0]) is not node:
            return False
        node = node.parent
    return node is root


LinkerMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_linker_state_machine = LinkerMachine.TestCase
