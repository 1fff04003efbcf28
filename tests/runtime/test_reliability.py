"""Reliability (issue 11): retries, the circuit breaker, bounded close, races and misuse,
KV backpressure, TOUCH coalescing and partial restores.

The store is the real embedded store, wrapped by the real fault injector and the gated store
of ``hylinker.testing`` where a test needs to hold or fail calls. Time bounds here
(``fail_after``) guard against hangs; they are never the thing measured.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator

import anyio
import attrs
import numpy as np
import pytest
import torch

from hylinker.components.keys import object_key, page_keys
from hylinker.components.layout import PoolKind
from hylinker.components.partial import kept_pages
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker, PhaseError
from hylinker.runtime.linker.tree_writer import PoolExhaustedError
from hylinker.stores.base import Outcome, Store, StoreUnavailableError
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.stores.resilient import ResiliencePolicy, ResilientStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import (
    FakeClock,
    GatedStore,
    small_hybrid_layout,
    synthetic_prefill,
    wait_until,
)

LAYOUT = small_hybrid_layout()  # page 4, grid 8 tokens
P = LAYOUT.page_size
SMALL = 1 << 16
FAST = ResiliencePolicy(backoff_s=0.0, backoff_max_s=0.0)
_ids = itertools.count()


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


def frames(n: int, size: int = 256) -> list[torch.Tensor]:
    return [torch.full((size,), i % 251, dtype=torch.uint8) for i in range(n)]


@attrs.define
class Env:
    linker: Linker
    pools: HybridPools
    store: GatedStore
    inner: EmbeddedStore
    content: SyntheticContent


@contextlib.asynccontextmanager
async def harness(config: LinkerConfig | None = None, *, kv_pages: int = 64, slots: int = 16,
                  wrap: object = None) -> AsyncIterator[Env]:
    inner = EmbeddedStore(8 << 20)
    base: Store = wrap(inner) if callable(wrap) else inner
    store = GatedStore(base)
    pools = HybridPools(LAYOUT, kv_pages=kv_pages, mamba_slots=slots)
    linker = Linker(LAYOUT, pools, store, config or LinkerConfig(staging_bytes_per_pool=SMALL))
    async with linker:
        yield Env(linker, pools, store, inner, SyntheticContent(pools))
        store.open()
        await linker.drain()
    linker.check_idle()
    linker.flush_device()
    pools.check_idle()


async def donate(env: Env, tokens: np.ndarray) -> int:
    lk = env.linker
    req = lk.request(f"donor{next(_ids)}", tokens)
    await lk.lookup(req)
    load = await lk.load(req)
    if load is not None:
        await lk.commit(load)
    depth = await synthetic_prefill(lk, env.content, req)
    await lk.release(req)
    await lk.drain()
    return depth


# ---- the store wrapper --------------------------------------------------------------------


async def test_retries_only_the_keys_that_failed() -> None:
    faulty = FaultyStore(EmbeddedStore(1 << 20), FaultPlan(fail=0.5), seed=3)
    gated = GatedStore(faulty)
    store = ResilientStore(gated, attrs.evolve(FAST, attempts=20))
    keys = [f"k{i}" for i in range(40)]
    assert await store.put(keys, frames(40)) == [Outcome.OK] * 40
    calls = gated.keys["put"]
    assert len(calls) > 1
    for earlier, later in itertools.pairwise(calls):
        assert set(later) < set(earlier)  # each retry carries a strict subset: the failures
    got = await store.get(keys, [torch.zeros(256, dtype=torch.uint8) for _ in keys])
    assert [r.outcome for r in got] == [Outcome.OK] * 40
    # per key too, where the store tells a failed key from an absent one
    direct = ResilientStore(faulty, attrs.evolve(FAST, attempts=20))
    assert await direct.exists(keys) == [True] * 40
    assert direct.resilience().recovered_keys > 0
    r = store.resilience()
    assert r.recovered_keys > 0 and r.exhausted_keys == 0 and r.breaker == "closed"


async def test_answers_are_not_retried() -> None:
    """MISSING is a fact and a corrupt object a data fault: one attempt each."""
    faulty = FaultyStore(EmbeddedStore(1 << 20), FaultPlan(corrupt=1.0), seed=1)
    store = ResilientStore(faulty, FAST)
    await faulty.inner.put(["here"], frames(1))
    got = await store.get(["here", "absent"], [torch.zeros(256, dtype=torch.uint8)] * 2)
    assert [r.outcome for r in got] == [Outcome.OK, Outcome.MISSING]  # corrupt bytes: OK here
    assert store.resilience().attempts == 1 and store.resilience().retries == 0


async def test_exhausted_retries_give_the_failure_back() -> None:
    store = ResilientStore(FaultyStore(EmbeddedStore(1 << 20), FaultPlan(fail=1.0)),
                           attrs.evolve(FAST, attempts=3, failure_threshold=0))
    assert await store.put(["a", "b"], frames(2)) == [Outcome.FAILED] * 2
    r = store.resilience()
    assert (r.attempts, r.retries, r.exhausted_keys) == (3, 2, 2)


async def test_a_call_past_its_timeout_is_unreachable() -> None:
    hung = FaultyStore(EmbeddedStore(1 << 20), FaultPlan(latency_ms=600_000))
    store = ResilientStore(hung, attrs.evolve(FAST, attempts=2, call_timeout_s=0.02, deadline_s=5.0))
    with anyio.fail_after(30):
        assert await store.put(["a"], frames(1)) == [Outcome.UNREACHABLE]
        assert await store.exists(["a"]) == [False]
    assert store.resilience().timeouts == 4


async def test_the_breaker_opens_probes_and_resumes() -> None:
    clock = FakeClock()
    # calls 1..5 raise (the store is down), later calls work
    faulty = FaultyStore(EmbeddedStore(1 << 20), FaultPlan(fail_calls=((1, 5),), scheduled="unavailable"))
    policy = attrs.evolve(FAST, attempts=1, failure_threshold=3, probe_interval_s=1.0)
    store = ResilientStore(faulty, policy, clock=clock)
    for _ in range(3):
        assert await store.put(["a"], frames(1)) == [Outcome.UNREACHABLE]
    assert store.breaker.state == "open"
    calls = faulty.statistics().calls
    assert await store.exists(["a"]) == [False]  # lookups miss fast
    assert await store.put(["a"], frames(1)) == [Outcome.UNREACHABLE]
    await store.touch(["a"])
    with pytest.raises(StoreUnavailableError):
        await store.remove(["a"])
    assert faulty.statistics().calls == calls  # nothing reached the store while open
    for _ in range(2):  # probes at calls 4 and 5 fail: open again
        clock.advance(1.0)
        assert await store.put(["a"], frames(1)) == [Outcome.UNREACHABLE]
        assert store.breaker.state == "open"
    clock.advance(1.0)
    assert await store.put(["a"], frames(1)) == [Outcome.OK]  # call 6 answers: resume
    assert store.breaker.state == "closed"
    r = store.resilience()
    assert (r.breaker_trips, r.probes, r.resumes) == (1, 3, 1)
    assert r.rejected_calls == 4


async def test_shutdown_cancels_hung_calls_after_the_grace() -> None:
    gated = GatedStore(EmbeddedStore(1 << 20), hold_puts=True)
    store = ResilientStore(gated, attrs.evolve(FAST, call_timeout_s=600, close_grace_s=0.05))
    out: list[list[Outcome]] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            async def put() -> None:
                out.append(await store.put(["a"], frames(1)))
            tg.start_soon(put)
            await gated.wait_held(1)
            await store.close()
    assert out == [[Outcome.UNREACHABLE]]
    assert store.resilience().cancelled_on_shutdown == 1


# ---- bounded close ------------------------------------------------------------------------


@pytest.mark.parametrize("copying", [False, True])
@pytest.mark.parametrize("how", ["close", "cancel"])
async def test_close_is_bounded_when_the_store_hangs(how: str, copying: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offloads stuck in a hung store: close() (and a cancelled task, as Ctrl-C does) ends
    anyway, and nothing stays locked or leaks. ``copying``: the close or cancel lands while the
    offload is still in its copy into host staging (a slow first fill of the staging region);
    the copy ends and its job ends failed or at the store's shutdown, never lost (before, a
    cancelled drain worker left the copied job unended and close waited for it forever)."""
    if copying:
        import time

        from hylinker.runtime.dataplane import frame_region

        fill = frame_region.zero_fill

        def slow_fill(buf: torch.Tensor) -> torch.Tensor:
            time.sleep(0.5)  # in the copy thread
            return fill(buf)

        monkeypatch.setattr(frame_region, "zero_fill", slow_fill)
    config = LinkerConfig(staging_bytes_per_pool=SMALL, close_timeout_s=0.05,
                          resilience=attrs.evolve(FAST, call_timeout_s=600, close_grace_s=0.05))
    inner = EmbeddedStore(8 << 20)
    store = GatedStore(inner, hold_puts=True)
    pools = HybridPools(LAYOUT, kv_pages=64, mamba_slots=16)
    linker = Linker(LAYOUT, pools, store, config)
    content = SyntheticContent(pools)
    with anyio.fail_after(60):
        with anyio.CancelScope() as scope:
            async with linker:
                req = linker.request("r", prompt(33))
                await linker.lookup(req)
                await synthetic_prefill(linker, content, req)
                if copying:
                    await anyio.sleep(0.1)  # the copy is filling the region now
                else:
                    await store.wait_held(1)
                if how == "cancel":
                    scope.cancel()
                    await anyio.sleep(1)  # cancelled here
                await linker.close()
                assert linker.statistics().close_timeouts == 1
    linker.check_idle()  # the open request was released, its offload settled unstored
    assert not any(n.stored for n in linker.tree.tree.nodes() if not n.is_root)


# ---- races and misuse ---------------------------------------------------------------------


async def test_two_releases_during_an_abort_do_not_raise() -> None:
    """A session's own release while close() aborts the same load: both return, and close
    releases every other request."""
    async with harness() as env:
        p = prompt(33, seed=1)
        assert await donate(env, p) == 32
        env.linker.flush_device()
        env.store.hold(puts=False, gets=True)
        req = env.linker.request("loading", p)
        await env.linker.lookup(req)
        load = await env.linker.load(req)
        assert load is not None
        other = env.linker.request("other", prompt(20, seed=2))
        await env.linker.lookup(other)
        errors: list[BaseException] = []

        async def release() -> None:
            try:
                await env.linker.release(req)
            except Exception as exc:  # before the fix: "this load is already being aborted"
                errors.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(env.linker.close)
                await wait_until(lambda: load.claimed_by == "abort")
                tg.start_soon(release)
                tg.start_soon(release)
                await anyio.sleep(0.01)
                env.store.open()
        assert errors == []
        assert req.released and other.released
        assert env.linker.leaked() == (0, 0)


async def test_close_while_a_load_waits_for_queue_space_is_a_miss() -> None:
    config = LinkerConfig(staging_bytes_per_pool=SMALL, queue_depth=1)
    async with harness(config) as env:
        ps = [prompt(33, seed=10 + i) for i in range(3)]
        for p in ps:
            assert await donate(env, p) == 32
        env.linker.flush_device()
        env.store.hold(puts=False, gets=True)
        reqs = []
        for i, p in enumerate(ps):
            r = env.linker.request(f"q{i}", p)
            await env.linker.lookup(r)
            reqs.append(r)
        results: dict[int, object] = {}

        async def load(i: int) -> None:
            try:
                results[i] = await env.linker.load(reqs[i])
            except Exception as exc:  # before the fix: ClosedResourceError
                results[i] = exc

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(load, 0)
                await env.store.wait_held(1)
                tg.start_soon(load, 1)
                await wait_until(lambda: 1 in results)  # queued behind the held reads
                tg.start_soon(load, 2)  # every queue is full now: it waits for space
                await wait_until(lambda: any(a.load_q.waiting for a in env.linker.actors.values()))
                tg.start_soon(env.linker.close)
                await anyio.sleep(0.01)
                env.store.open()
        assert results[2] is None
        assert not any(isinstance(r, BaseException) for r in results.values())
        assert env.linker.statistics().load_misses == 1
        assert env.linker.leaked() == (0, 0)


async def test_extend_and_working_slot_before_lookup_are_phase_errors() -> None:
    async with harness() as env:
        p = prompt(33, seed=4)
        assert await donate(env, p) == 32
        req = env.linker.request("early", p)
        for call in (lambda: env.linker.extend(req, 33), lambda: env.linker.working_slot(req),
                     lambda: env.linker.checkpoint_slot(req)):
            with pytest.raises(PhaseError, match="before lookup"):
                call()
        assert env.linker.leaked() == (0, 0)
        await env.linker.lookup(req)  # the device prefix, as it should be
        assert req.prefix_tokens == 32
        await env.linker.release(req)


@pytest.mark.parametrize("bad", [-1, -64, 2.5, True, "8"])
async def test_extend_rejects_a_bad_token_count(bad: object) -> None:
    async with harness() as env:
        req = env.linker.request("neg", prompt(9))
        await env.linker.lookup(req)
        with pytest.raises(ValueError, match="token count"):
            env.linker.extend(req, bad)  # type: ignore[arg-type]
        assert env.linker.extend(req, 0).numel() == 0
        await env.linker.release(req)


# ---- KV backpressure ----------------------------------------------------------------------


@pytest.mark.parametrize("share", [1.0, 0.25, LinkerConfig().kv_backpressure_share])
async def test_kv_backpressure_keeps_extend_alive_under_a_stuck_store(share: float) -> None:
    """Long prompts against a store that acknowledges nothing: without the rule, offload
    locks take the whole KV pool and extend fails; with it, offloads are skipped (counted)."""
    # one stage: the rule is about offloads that hold their pages until the store answers
    # (in two stages the pages are free once copied: tests/runtime/test_two_stage_linker.py)
    config = LinkerConfig(staging_bytes_per_pool=SMALL, kv_backpressure_share=share, two_stage_offload=False,
                          mamba_backpressure=False, close_timeout_s=0.05,
                          resilience=attrs.evolve(FAST, call_timeout_s=600, close_grace_s=0.05))
    failures = 0
    async with harness(config, kv_pages=64, slots=64) as env:
        env.store.hold(puts=True)
        for i in range(12):
            req = env.linker.request(f"long{i}", prompt(65, seed=100 + i))  # 16 pages each
            await env.linker.lookup(req)
            try:
                await synthetic_prefill(env.linker, env.content, req)
            except PoolExhaustedError:
                failures += 1
            await env.linker.release(req)
        stats = env.linker.statistics()
        env.store.open()
    if share == 1.0:
        assert failures > 0 and stats.offloads_skipped_kv == 0
    else:
        assert failures == 0 and stats.offloads_skipped_kv > 0


# ---- TOUCH coalescing ---------------------------------------------------------------------


async def test_touches_of_many_hot_nodes_share_one_call() -> None:
    async with harness(LinkerConfig(staging_bytes_per_pool=SMALL, touch_batch_s=0.05)) as env:
        ps = [prompt(17, seed=200 + i) for i in range(6)]
        for p in ps:
            await donate(env, p)
        # the donations' own touches sent and answered: none left in the batch window (on a loaded
        # host a donation may end after the window began, its touch then still pending here)
        await wait_until(lambda: env.linker.toucher.pending == 0
                         and env.store.completed["touch"] == env.store.calls["touch"])
        before = env.store.calls["touch"]
        touches_before = env.linker.statistics().touches
        for p in ps:  # six device hits on six nodes in one tick
            req = env.linker.request(f"hot{next(_ids)}", p)
            assert (await env.linker.lookup(req)).device_tokens == 16
            await env.linker.release(req)
        assert env.linker.statistics().touches == len(ps) + touches_before
        await wait_until(lambda: env.store.calls["touch"] > before)
        await anyio.sleep(0.1)
        assert env.store.calls["touch"] == before + 1  # before: one task and call per node
        assert len(env.store.keys["touch"][-1]) == len(ps) * (4 + 4 + 1)


# ---- partial restores ---------------------------------------------------------------------


def test_kept_pages_takes_the_longest_verified_prefix_with_a_state() -> None:
    ok, bad = True, False
    # pages 0..5, page 4 failed; states at 2, 4 and 6 pages (grid 2 pages)
    pages = [[ok, ok, ok, ok, bad, ok]]
    assert kept_pages(pages, n_pages=6, first_page=0, grid_pages=2, states=[(2, ok), (4, ok), (6, ok)]) == 4
    assert kept_pages(pages, n_pages=6, first_page=0, grid_pages=2, states=[(2, ok), (4, bad), (6, ok)]) == 2
    assert kept_pages(pages, n_pages=6, first_page=0, grid_pages=2, states=[(6, ok)]) == 0
    assert kept_pages(pages, n_pages=6, first_page=1, grid_pages=2, states=None) == 3  # on the grid
    assert kept_pages([[ok] * 6, [ok] * 6], n_pages=6, first_page=0, grid_pages=2, states=[(6, ok)]) == 6
    with pytest.raises(ValueError):
        kept_pages([[ok]], n_pages=2, first_page=0, grid_pages=1, states=None)


async def test_a_load_with_a_failed_object_keeps_the_prefix_below_it() -> None:
    p = prompt(49, seed=300)
    async with harness() as env:
        assert await donate(env, p[:17]) == 16  # state at 16 tokens (4 pages)
        assert await donate(env, p) == 48  # state at 48 (12 pages)
        env.linker.flush_device()
        keys = page_keys(p, P, env.linker._default_seed)
        env.store.fail_gets = object_key(keys[6], PoolKind.FULL, LAYOUT)  # page 6 is lost
        req = env.linker.request("partial", p)
        assert (await env.linker.lookup(req)).store_tokens == 48
        load = await env.linker.load(req)
        assert load is not None
        assert await env.linker.commit(load) == 16  # before: 0, the whole load dropped
        assert env.content.prefix_problems(env.linker, req) == []
        st = env.linker.statistics()
        assert (st.partial_loads, st.partial_pages_lost, st.dropped_loads) == (1, 8, 0)
        # a failed get proves nothing about the object: it stays for every other reader
        assert (st.bad_objects_removed, st.failed_objects_kept) == (0, 1)
        await env.linker.release(req)
        env.store.fail_gets = False
        assert await env.store.exists([object_key(keys[6], PoolKind.FULL, LAYOUT)]) == [True]


async def test_faults_never_restore_a_wrong_state() -> None:
    """Mixed faults through the whole linker: everything restored verifies, nothing leaks."""
    plan = FaultPlan.uniform(0.05)
    async with harness(wrap=lambda s: FaultyStore(s, plan, seed=7)) as env:
        for round_ in range(3):
            for i in range(8):
                p = prompt(41 + 8 * i, seed=400 + i)
                req = env.linker.request(f"m{round_}-{i}", p)
                await env.linker.lookup(req)
                load = await env.linker.load(req)
                if load is not None:
                    await env.linker.commit(load)
                assert env.content.prefix_problems(env.linker, req) == []
                await synthetic_prefill(env.linker, env.content, req)
                await env.linker.release(req)
            await env.linker.drain()
            env.linker.flush_device()
        r = env.linker.resilience_statistics()
        assert r is not None and r.retries > 0


async def test_a_store_that_is_down_trips_the_breaker_and_the_linker_resumes() -> None:
    """Down: lookups miss fast, offloads are skipped and counted. Back: hits again."""
    policy = attrs.evolve(FAST, attempts=1, failure_threshold=2, probe_interval_s=0.05)
    plan = FaultPlan(fail_calls=((1, 10_000),), scheduled="unavailable")
    faulty: list[FaultyStore] = []

    def wrap(inner: Store) -> Store:
        faulty.append(FaultyStore(inner, plan))
        return faulty[0]

    async with harness(LinkerConfig(staging_bytes_per_pool=SMALL, resilience=policy), wrap=wrap) as env:
        lk = env.linker
        p = prompt(33, seed=500)
        await donate(env, p)  # lookup fails (1), offload fails (2): the breaker opens
        assert lk.store.breaker_open  # type: ignore[attr-defined]
        await donate(env, prompt(33, seed=501))
        st = lk.statistics()
        assert st.offloads_skipped_breaker >= 1
        calls = faulty[0].statistics().calls
        req = lk.request("down", p)
        assert (await lk.lookup(req)).store_tokens == 0  # a miss, without reaching the store
        await lk.release(req)
        assert faulty[0].statistics().calls == calls
        faulty[0]._plan = FaultPlan()  # the store comes back
        await anyio.sleep(0.06)
        lk.flush_device()
        assert await donate(env, p) == 32  # a lookup probes, the breaker closes, offload runs
        assert not lk.store.breaker_open  # type: ignore[attr-defined]
        lk.flush_device()
        req = lk.request("back", p)
        assert (await lk.lookup(req)).store_tokens == 32
        await lk.release(req)
        r = lk.resilience_statistics()
        assert r is not None and r.breaker_trips == 1 and r.resumes == 1


# ---- integrity levels and second reads through the Linker -----------------------------------


@pytest.mark.parametrize("level", ["checksum", "header"])
async def test_linker_integrity_level_and_a_corrupt_first_read(level: str) -> None:
    """``LinkerConfig.integrity`` reaches the data plane; at "checksum" every object's first
    read is damaged (fault plan) and read again, so the whole prefix is restored and verified;
    at "header" objects are unhashed frames and restore as well."""
    with pytest.raises(ValueError, match=r"LinkerConfig\.integrity must be one of"):
        LinkerConfig(integrity="sha")
    plan = FaultPlan(corrupt_first_read=1.0 if level == "checksum" else 0.0)
    config = LinkerConfig(staging_bytes_per_pool=SMALL, integrity=level)
    p = prompt(33, seed=410)
    async with harness(config, wrap=lambda s: FaultyStore(s, plan, seed=2)) as env:
        assert env.linker.data.config.integrity.value == level
        assert await donate(env, p) == 32
        env.linker.flush_device()
        req = env.linker.request("reader", p)
        assert (await env.linker.lookup(req)).store_tokens == 32
        load = await env.linker.load(req)
        assert load is not None
        assert await env.linker.commit(load) == 32
        assert env.content.prefix_problems(env.linker, req) == []
        stats = env.linker.pool_statistics()
        recovered = sum(s.rereads_recovered for s in stats.values())
        assert recovered == (sum(s.objects_loaded for s in stats.values()) if level == "checksum" else 0)
        assert sum(s.rereads_failed + s.verify_failures for s in stats.values()) == 0
        assert env.linker.statistics().dropped_loads == 0
        await env.linker.release(req)
