"""Retries, timeouts and a circuit breaker around any store: what every client of a store uses.

:class:`ResilientStore` wraps a :class:`~hylinker.stores.base.Store` and keeps the protocol, so
the linker, the data plane and engine plugins get the same behaviour by wrapping once:

* **Timeouts.** Every call to the inner store runs under ``call_timeout_s``; a call that runs
  past it answers :attr:`Outcome.UNREACHABLE` for each key (the inner call is cancelled; a
  backend whose calls cannot be cancelled — a blocking client in a thread — still returns
  before the wrapper does, so buffers are never written after the caller regains control).
* **Retries, per key.** Transient outcomes — ``FAILED``, ``UNREACHABLE``, ``LEASED``, a call
  that raised :class:`StoreUnavailableError` or timed out — are retried for the keys that had
  them only, up to ``attempts`` tries, with backoff and jitter (exponential while the store
  answers nothing, the base delay when it answered the other keys), and never past the
  transfer's ``deadline_s`` (one wrapper call is one transfer). Answers that are facts are not
  retried: ``MISSING``, ``EXISTS``, ``FULL``, ``TOO_SMALL``. Data faults (corrupt, torn,
  vanished objects) are found by framing after the get returned ``OK``; the wrapper never sees
  them and the runtime falls back to recompute.
  ``exists`` is retried per key when the inner store can tell a failed key from an absent one
  (:class:`ReportsExistence`: ``exists_outcomes``); otherwise only a whole failed call is.
* **Circuit breaker.** ``failure_threshold`` consecutive attempts in which the store answered
  nothing (every key unreachable, the call raised or timed out, or the caller cancelled it
  before it answered: a lookup that waits less than ``call_timeout_s``) open the breaker: calls are
  answered at once without reaching the store (``exists`` -> all absent, ``put``/``get`` ->
  ``UNREACHABLE``, ``touch`` skipped, ``remove`` raises) and counted as ``rejected_calls``.
  After ``probe_interval_s`` the next call is let through as a probe (one at a time); if the
  store answers, the breaker closes (``resumes``), otherwise it stays open for another interval.
* **Bounded close.** :meth:`ResilientStore.shutdown` makes every new call fail fast and gives
  the calls in flight ``close_grace_s`` before cancelling them, so whoever drains work through
  the wrapper finishes in bounded time even when the store hangs. ``close`` shuts down and then
  closes the inner store only when the wrapper owns it (``owns_inner``).

Everything is counted in :class:`ResilienceStatistics` (:meth:`ResilientStore.resilience`);
:meth:`ResilientStore.statistics` is the inner store's own snapshot, unchanged.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio
import attrs
import numpy as np
import torch

from .base import (
    GetResult,
    Outcome,
    Store,
    StoreCapabilities,
    StoreClosedError,
    StoreError,
    StoreStatistics,
    StoreUnavailableError,
    supports_checksums,
    supports_rows,
    supports_scatter,
)
from .breaker import CircuitBreaker
from .condemned import Condemned, ConditionalRemoveStore, compare_then_remove
from .retry_policy import NO_ANSWER, TRANSIENT, NoAnswer, ResiliencePolicy, ResilienceStatistics
from .rows import CODE, OUTCOMES, RowBatch, RowResults, check_batch

T = TypeVar("T")


@runtime_checkable
class ReportsExistence(Protocol):
    """A store that can say, per key, whether ``exists`` failed rather than found nothing."""

    async def exists_outcomes(self, keys: Sequence[str]) -> list[Outcome]:
        """``OK`` present, ``MISSING`` absent, anything else: the store could not tell."""
        ...


class ResilientStore:
    """Wraps ``inner`` with retries, timeouts and a circuit breaker. See the module doc."""

    def __init__(self, inner: Store, policy: ResiliencePolicy | None = None, *,
                 owns_inner: bool = True, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(inner, Store):
            raise TypeError(f"inner must implement the Store protocol, got {type(inner).__name__}")
        self._inner = inner
        self.policy = policy or ResiliencePolicy()
        self.owns_inner = owns_inner
        self._clock = clock
        self._rng = random.Random(seed)
        self.breaker = CircuitBreaker(self.policy.failure_threshold, self.policy.probe_interval_s, clock)
        caps = inner.capabilities
        # scatter-gather only when the inner store really has it (a wrapper may forward the flag)
        self._capabilities = attrs.evolve(caps, name=f"resilient({caps.name})",
                                          scatter=supports_scatter(inner),
                                          checksums=supports_checksums(inner),
                                          rows=supports_rows(inner))
        self._c = dict.fromkeys(("calls", "attempts", "retries", "retried_keys", "recovered_keys",
                                 "exhausted_keys", "timeouts", "unavailable", "cancelled",
                                 "cancelled_on_shutdown"), 0)
        self._inflight: set[anyio.CancelScope] = set()  # bounded: calls in flight, removed as each ends
        self._idle = anyio.Event()
        self._idle.set()
        self._shutting_down = False
        self._closed = False

    @property
    def inner(self) -> Store:
        return self._inner

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._capabilities

    @property
    def breaker_open(self) -> bool:
        return self.breaker.state != "closed"

    def register(self, region: torch.Tensor) -> None:
        self._inner.register(region)

    def unregister(self, region: torch.Tensor) -> None:
        self._inner.unregister(region)

    # ---- protocol ---------------------------------------------------------------------------
    async def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        self._check_open()
        inner = self._inner
        if isinstance(inner, ReportsExistence):
            outcomes = await self._transfer(
                len(keys), Outcome.UNREACHABLE,
                lambda idx: inner.exists_outcomes([keys[i] for i in idx]))
            return [o is Outcome.OK for o in outcomes]

        async def plain(idx: list[int]) -> list[Outcome]:
            found = await inner.exists([keys[i] for i in idx])
            if len(found) != len(idx):
                raise StoreError(f"exists answered {len(found)} of {len(idx)} keys")
            return [Outcome.OK if here else Outcome.MISSING for here in found]

        outcomes = await self._transfer(len(keys), Outcome.UNREACHABLE, plain)
        return [o is Outcome.OK for o in outcomes]

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        keys, buffers = list(keys), list(buffers)
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        self._check_open()
        return await self._transfer(
            len(keys), Outcome.UNREACHABLE,
            lambda idx: self._inner.put([keys[i] for i in idx], [buffers[i] for i in idx]))

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        keys, buffers = list(keys), list(buffers)
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        self._check_open()
        sizes: dict[int, int] = {}

        async def one(idx: list[int]) -> list[Outcome]:
            res = await self._inner.get([keys[i] for i in idx], [buffers[i] for i in idx])
            if len(res) != len(idx):
                raise StoreError(f"get answered {len(res)} of {len(idx)} keys")
            for i, r in zip(idx, res):
                sizes[i] = r.nbytes
            return [r.outcome for r in res]

        outcomes = await self._transfer(len(keys), Outcome.UNREACHABLE, one)
        return [GetResult(o, sizes.get(i, 0) if o is Outcome.OK else 0) for i, o in enumerate(outcomes)]

    # scatter-gather (in place) and checksum while copying: the same retries and breaker, when
    # the inner store has them
    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        return await self._put_in_parts("put_parts", keys, parts)

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        return await self._get_in_parts("get_parts", keys, parts)

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        return await self._put_in_parts("put_sealed", keys, parts)

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        return await self._get_in_parts("get_checked", keys, parts)

    async def put_rows(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        """A row-described put with the same retries and breaker: the objects that failed
        transiently are retried by index (a sub-batch of the description)."""
        self._check_open()
        check_batch(batch)

        async def one(idx: list[int]) -> list[Outcome]:
            sub = batch if len(idx) == len(batch.keys) else batch.select(idx)
            codes = await self._inner.put_rows(sub, hashed)  # type: ignore[attr-defined]
            if len(codes) != len(idx):
                raise StoreError(f"put_rows answered {len(codes)} of {len(idx)} objects")
            return [OUTCOMES[c] for c in codes.tolist()]

        outcomes = await self._transfer(len(batch.keys), Outcome.UNREACHABLE, one)
        return np.asarray([CODE[o] for o in outcomes], dtype=np.int8)

    async def get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        """A row-described get with the same retries and breaker, retried by index."""
        self._check_open()
        check_batch(batch, get=True)
        assert batch.heads is not None
        out = RowResults.of(len(batch.keys), Outcome.UNREACHABLE)

        async def one(idx: list[int]) -> list[Outcome]:
            whole = len(idx) == len(batch.keys)
            sub = batch if whole else batch.select(idx)
            got = await self._inner.get_rows(sub, hashed)  # type: ignore[attr-defined]
            if len(got.codes) != len(idx):
                raise StoreError(f"get_rows answered {len(got.codes)} of {len(idx)} objects")
            if not whole:  # the sub-batch's headers landed in a copy
                assert batch.heads is not None and sub.heads is not None
                batch.heads[idx] = sub.heads
            out.nbytes[idx] = got.nbytes
            out.checksums[idx] = got.checksums
            return [OUTCOMES[c] for c in got.codes.tolist()]

        outcomes = await self._transfer(len(batch.keys), Outcome.UNREACHABLE, one)
        out.codes[:] = [CODE[o] for o in outcomes]
        return out

    def _parts_call(self, method: str, keys: Sequence[str],
                    parts: Sequence[Sequence[torch.Tensor]]) -> tuple[list[str], list[Sequence[torch.Tensor]], Any]:
        keys, parts = list(keys), list(parts)
        if len(keys) != len(parts):
            raise ValueError(f"{len(keys)} keys but {len(parts)} part lists")
        self._check_open()

        def call(*args: Any) -> Any:  # resolved per attempt, like the plain calls
            return getattr(self._inner, method)(*args)

        return keys, parts, call

    async def _put_in_parts(self, method: str, keys: Sequence[str],
                            parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        keys, parts, call = self._parts_call(method, keys, parts)
        return await self._transfer(
            len(keys), Outcome.UNREACHABLE,
            lambda idx: call([keys[i] for i in idx], [parts[i] for i in idx]))

    async def _get_in_parts(self, method: str, keys: Sequence[str],
                            parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        keys, parts, call = self._parts_call(method, keys, parts)
        landed: dict[int, GetResult] = {}

        async def one(idx: list[int]) -> list[Outcome]:
            res = await call([keys[i] for i in idx], [parts[i] for i in idx])
            if len(res) != len(idx):
                raise StoreError(f"{method} answered {len(res)} of {len(idx)} keys")
            for i, r in zip(idx, res):
                landed[i] = r
            return [r.outcome for r in res]

        outcomes = await self._transfer(len(keys), Outcome.UNREACHABLE, one)
        return [landed[i] if o is Outcome.OK else GetResult(o) for i, o in enumerate(outcomes)]

    async def touch(self, keys: Sequence[str]) -> None:
        """One attempt (a hint is not worth a retry), skipped while the breaker is open."""
        self._check_open()
        keys = list(keys)
        if not keys or self._shutting_down or not self.breaker.admit():
            return
        self._c["calls"] += 1
        outcome = await self._probe_guard(self._attempt(lambda: self._inner.touch(keys)))
        self._settle_breaker(outcome is not NO_ANSWER)

    async def remove(self, keys: Sequence[str]) -> int:
        keys = list(keys)
        return await self._removal(lambda: self._inner.remove(keys))

    async def remove_if(self, keys: Sequence[str], condemned: Sequence[Condemned]) -> int:
        """The inner store's atomic ``remove_if`` under the breaker's rule, where it has one;
        otherwise read, compare and remove through this wrapper (``stores/condemned.py``)."""
        keys, condemned = list(keys), list(condemned)
        inner = self._inner
        if not isinstance(inner, ConditionalRemoveStore):
            return await compare_then_remove(self, keys, condemned)
        return await self._removal(lambda: inner.remove_if(keys, condemned))

    async def _removal(self, call: Callable[[], Awaitable[int]]) -> int:
        self._check_open()
        if self._shutting_down or not self.breaker.admit():
            raise StoreUnavailableError("the store's circuit breaker is open")
        self._c["calls"] += 1
        answer = await self._probe_guard(self._attempt(call))
        if isinstance(answer, NoAnswer):
            self._settle_breaker(False)
            raise StoreUnavailableError("remove got no answer from the store")
        self._settle_breaker(True)
        return answer

    def statistics(self) -> StoreStatistics:
        return self._inner.statistics()

    def resilience(self) -> ResilienceStatistics:
        return ResilienceStatistics(**self._c, **self.breaker.counts, breaker=self.breaker.state)

    async def shutdown(self) -> None:
        """Fail every new call fast; give calls in flight ``close_grace_s``, then cancel them."""
        self._shutting_down = True
        if self._inflight:
            with anyio.move_on_after(self.policy.close_grace_s):
                await self._idle.wait()
        if self._inflight:
            self._c["cancelled_on_shutdown"] += len(self._inflight)
            for scope in list(self._inflight):
                scope.cancel()
            await self._idle.wait()

    async def close(self) -> None:
        if self._closed:
            return
        await self.shutdown()
        self._closed = True
        if self.owns_inner:
            await self._inner.close()

    # ---- the retry loop ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self._capabilities.name} is closed")

    async def _transfer(self, n: int, fallback: Outcome,
                        call: Callable[[list[int]], Awaitable[list[Outcome]]]) -> list[Outcome]:
        """Run ``call`` on the keys that still need it until none is transient, attempts run
        out, or the deadline passes. ``fallback`` answers keys that never got an answer."""
        self._c["calls"] += 1
        outcomes = [fallback] * n
        if n == 0:
            return outcomes
        pol = self.policy
        deadline = self._clock() + pol.deadline_s
        todo = list(range(n))
        retried: set[int] = set()
        silent = 0  # consecutive attempts the store did not answer at all
        for attempt in range(pol.attempts):
            if attempt:
                # the store answered the last attempt (some keys failed): retry those at once,
                # after the base backoff; it did not answer: back off exponentially
                delay = min(pol.backoff_max_s, pol.backoff_s * (2 ** max(0, silent - 1)))
                delay *= 1 + pol.jitter * (2 * self._rng.random() - 1)
                if self._clock() + delay >= deadline:
                    break
                await anyio.sleep(delay)
                self._c["retries"] += 1
                self._c["retried_keys"] += len(todo)
                retried.update(todo)
            if self._shutting_down or not self.breaker.admit():
                break
            left = deadline - self._clock()
            if left <= 0:
                break
            answer = await self._probe_guard(
                self._attempt(functools.partial(call, list(todo)), min(pol.call_timeout_s, left)))
            if isinstance(answer, NoAnswer) or len(answer) != len(todo):
                self._settle_breaker(False)
                silent += 1
                continue
            answered = not all(o is Outcome.UNREACHABLE for o in answer)
            self._settle_breaker(answered)
            silent = 0 if answered else silent + 1
            still: list[int] = []
            for i, o in zip(todo, answer):
                outcomes[i] = o
                if o in TRANSIENT:
                    still.append(i)
                elif i in retried:
                    self._c["recovered_keys"] += 1
            todo = still
            if not todo:
                break
        self._c["exhausted_keys"] += sum(outcomes[i] in TRANSIENT for i in todo)
        return outcomes

    async def _attempt(self, call: Callable[[], Awaitable[T]],
                       timeout: float | None = None) -> T | NoAnswer:
        """One inner call under the call timeout; ``NO_ANSWER`` when it gave none."""
        self._c["attempts"] += 1
        scope = anyio.CancelScope(deadline=anyio.current_time() + (timeout or self.policy.call_timeout_s))
        self._inflight.add(scope)
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        try:
            with scope:
                return await call()
            # reached only when the scope cancelled the call
            if not self._shutting_down:
                self._c["timeouts"] += 1
            return NO_ANSWER
        except StoreClosedError:
            raise
        except StoreError:
            self._c["unavailable"] += 1
            return NO_ANSWER
        except anyio.get_cancelled_exc_class():
            # the caller gave up first (a lookup's own, shorter timeout): the store did not
            # answer in the time it had, which counts toward the breaker like a timeout, so a
            # store that stops answering opens it however short its callers' deadlines are
            if not self._shutting_down:
                self._c["cancelled"] += 1
                self.breaker.failure()
            raise
        finally:
            self._inflight.discard(scope)
            if not self._inflight:
                self._idle.set()

    async def _probe_guard(self, attempt: Awaitable[T]) -> T:
        """Await an attempt; a probe that is cancelled before it settles lets another try."""
        probe = self.breaker.state == "half_open"
        try:
            return await attempt
        except BaseException:
            if probe:
                self.breaker.abandon_probe()
            raise

    def _settle_breaker(self, answered: bool) -> None:
        if answered:
            self.breaker.success()
        else:
            self.breaker.failure()


__all__ = [
    "TRANSIENT",
    "CircuitBreaker",
    "ReportsExistence",
    "ResiliencePolicy",
    "ResilienceStatistics",
    "ResilientStore",
]
