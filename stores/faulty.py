"""Fault injection: a store wrapper that fails, stalls, tears, corrupts and loses objects.

:class:`FaultyStore` wraps any :class:`~hylinker.stores.base.Store` and injects, driven by a
:class:`FaultPlan` and a seed (same plan, same seed, same call sequence: same faults):

* **failed keys** (``fail``): a key of a put/get answers :attr:`Outcome.FAILED` without
  reaching the inner store; ``exists`` answers False for it.
* **unavailable calls** (``unavailable``): the call raises :class:`StoreUnavailableError`.
* **scheduled failures** (``fail_calls`` ranges of call numbers, ``fail_every`` k-th call):
  the whole call fails the way ``scheduled`` says (``failed`` outcomes, ``unavailable``
  exception, or ``timeout``). Calls are numbered from 1 in arrival order; every data call
  (exists, put, get, touch, remove) counts.
* **latency** (``latency_ms`` plus uniform ``jitter_ms``) before every call.
* **timeouts**: with ``deadline_ms`` set, a call (latency included) that runs past the
  deadline answers :attr:`Outcome.UNREACHABLE` for its keys. ``timeout`` is the probability
  that a call is made to overrun: it waits out the deadline and answers UNREACHABLE. An
  overrun put still lands in the inner store (a timeout is ambiguous, as in real life); an
  overrun get writes nothing the caller may use.
* **torn writes** (``torn``): a put stores only a prefix of the object (a view of the
  caller's buffer, so zero-copy inners still see registered memory).
* **corruption** (``corrupt``): one byte is flipped in what a put stores (in the caller's
  buffer for the duration of the inner call, then restored) or in what a get returns. The byte
  is one that framing verifies (magic, version, flags, layout, key digest, length, checksum
  or payload) — the header's reserved bytes carry no data and are never picked.
* **a corrupt first read** (``corrupt_first_read``, not part of ``uniform``): the first get
  of an object (since it was put) returns it with one verified byte flipped, as a transfer
  fault would; the object in the store is intact and every later get returns it whole.
* **vanishing objects** (``vanish``): a key that ``exists`` reports present is gone by the
  next get (removed from the inner store where it can remove, and masked in any case until
  the key is put again).

Every fault reached is counted in :meth:`FaultyStore.statistics`, a :class:`FaultStatistics`
(a :class:`StoreStatistics` holding the inner store's counters plus the fault counters). With
every rate 0 and no schedule the wrapper is transparent.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

import anyio
import attrs
import torch

from .base import (
    GetResult,
    Outcome,
    Store,
    StoreCapabilities,
    StoreError,
    StoreStatistics,
    StoreUnavailableError,
    check_buffers,
)
from .embedded import InflightCalls, check_keys
from .framing import HEADER_BYTES

T = TypeVar("T")

_SCHEDULED = ("failed", "unavailable", "timeout")
# Header bytes framing.verify checks: magic, version, flags, layout, key, length, checksum (0..48).
_VERIFIED_HEADER = tuple(range(0, 48))


def _probability(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"fault plan {attribute.name}={value!r}: a probability lies in [0, 1]")


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is None:
        return
    if value < 0:
        raise ValueError(f"fault plan {attribute.name}={value!r} must be >= 0")


def _check_ranges(
    _: object, attribute: attrs.Attribute[Any], value: tuple[tuple[int, int], ...]
) -> None:
    for item in value:
        if (
            not isinstance(item, tuple)
            or len(item) != 2
            or not all(isinstance(x, int) for x in item)
            or not 1 <= item[0] <= item[1]
        ):
            raise ValueError(
                f"fault plan {attribute.name}: each range is (first, last) call numbers with "
                f"1 <= first <= last, got {item!r}"
            )


def _to_ranges(value: object) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"fault plan fail_calls must be a sequence of ranges, got {value!r}")
    return tuple(tuple(r) if isinstance(r, (tuple, list)) else r for r in value)


@attrs.frozen
class FaultPlan:
    """What to inject, and how often. Probabilities are per key unless said per call."""

    fail: float = attrs.field(default=0.0, converter=float, validator=_probability)
    unavailable: float = attrs.field(default=0.0, converter=float, validator=_probability)
    timeout: float = attrs.field(default=0.0, converter=float, validator=_probability)
    torn: float = attrs.field(default=0.0, converter=float, validator=_probability)
    corrupt: float = attrs.field(default=0.0, converter=float, validator=_probability)
    vanish: float = attrs.field(default=0.0, converter=float, validator=_probability)
    corrupt_first_read: float = attrs.field(default=0.0, converter=float, validator=_probability)
    latency_ms: float = attrs.field(default=0.0, converter=float, validator=_non_negative)
    jitter_ms: float = attrs.field(default=0.0, converter=float, validator=_non_negative)
    deadline_ms: float | None = attrs.field(
        default=None,
        converter=attrs.converters.optional(float),
        validator=_non_negative,
    )
    fail_calls: tuple[tuple[int, int], ...] = attrs.field(
        default=(), converter=_to_ranges, validator=_check_ranges
    )
    fail_every: int = attrs.field(default=0, converter=int, validator=_non_negative)
    scheduled: str = attrs.field(default="failed", validator=attrs.validators.in_(_SCHEDULED))

    RATE_FIELDS: ClassVar[tuple[str, ...]] = (
        "fail", "unavailable", "timeout", "torn", "corrupt", "vanish",
    )

    @classmethod
    def uniform(cls, rate: float, **overrides: object) -> FaultPlan:
        """One rate for every fault kind (fail, unavailable, timeout, torn, corrupt, vanish)."""
        fields: dict[str, object] = dict.fromkeys(cls.RATE_FIELDS, rate)
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """Parse ``"fail=0.05,latency_ms=2,fail_calls=3-5+9-9,uniform=0.01,..."``.

        ``uniform=R`` sets every rate first; the other fields override it. ``fail_calls``
        takes ``first-last`` ranges joined by ``+``. An empty string is the empty plan.
        """
        fields: dict[str, object] = {}
        uniform: float | None = None
        names = {f.name for f in attrs.fields(cls)}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, raw = item.partition("=")
            name, raw = name.strip(), raw.strip()
            if not sep or not raw:
                raise ValueError(f"fault plan item {item!r} is not name=value")
            if name == "uniform":
                uniform = _parse_float(name, raw)
            elif name not in names:
                raise ValueError(
                    f"unknown fault plan field {name!r}; known: uniform, {', '.join(sorted(names))}"
                )
            elif name == "fail_calls":
                fields[name] = _parse_ranges(raw)
            elif name == "scheduled":
                fields[name] = raw
            elif name == "fail_every":
                try:
                    fields[name] = int(raw)
                except ValueError:
                    raise ValueError(f"fault plan fail_every={raw!r} is not an integer") from None
            else:
                fields[name] = _parse_float(name, raw)
        if uniform is not None:
            return cls.uniform(uniform, **fields)
        return cls(**fields)  # type: ignore[arg-type]

    def describe(self) -> str:
        """The plan as a :meth:`parse` string (fields that differ from the default)."""
        parts: list[str] = []
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if value == field.default:
                continue
            if field.name == "fail_calls":
                parts.append("fail_calls=" + "+".join(f"{a}-{b}" for a, b in value))
            else:
                parts.append(f"{field.name}={value}")
        return ",".join(parts)

    @property
    def is_empty(self) -> bool:
        """True when the plan injects nothing."""
        return self == FaultPlan()


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"fault plan {name}={raw!r} is not a number") from None


def _parse_ranges(raw: str) -> tuple[tuple[int, int], ...]:
    ranges: list[tuple[int, int]] = []
    for part in raw.split("+"):
        first, sep, last = part.partition("-")
        try:
            ranges.append((int(first), int(last) if sep else int(first)))
        except ValueError:
            raise ValueError(
                f"fault plan fail_calls={raw!r}: use first-last ranges joined by '+', e.g. 3-5+9-9"
            ) from None
    return tuple(ranges)


@attrs.frozen
class FaultStatistics(StoreStatistics):
    """The inner store's counters plus every fault injected."""

    calls: int = 0
    failed_keys: int = 0
    unavailable_calls: int = 0
    scheduled_failures: int = 0
    timeouts: int = 0
    delayed_calls: int = 0
    torn_writes: int = 0
    corrupted_writes: int = 0
    corrupted_reads: int = 0
    corrupted_first_reads: int = 0
    vanished: int = 0


_FAULT_COUNTERS = tuple(
    f.name for f in attrs.fields(FaultStatistics) if f.name not in
    {g.name for g in attrs.fields(StoreStatistics)}
)


class FaultyStore:
    """Wraps ``inner`` and injects the faults of ``plan``, deterministically from ``seed``.

    Closing the wrapper closes the inner store.
    """

    def __init__(self, inner: Store, plan: FaultPlan | None = None, seed: int = 0) -> None:
        if not isinstance(inner, Store):
            raise TypeError(f"inner must implement the Store protocol, got {type(inner).__name__}")
        self._inner = inner
        self._plan = plan if plan is not None else FaultPlan()
        self._seed = seed
        self._rng = random.Random(seed)
        self._call_number = 0
        self._vanished: set[str] = set()
        self._read: set[str] = set()  # keys read since their last put (corrupt_first_read)
        self._faults: dict[str, int] = dict.fromkeys(_FAULT_COUNTERS, 0)
        inner_caps = inner.capabilities
        self._capabilities = attrs.evolve(inner_caps, name=f"faulty({inner_caps.name})")
        self._calls = InflightCalls(self._capabilities.name)

    @property
    def inner(self) -> Store:
        return self._inner

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    # ---- protocol -------------------------------------------------------------------------

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._capabilities

    def register(self, region: torch.Tensor) -> None:
        self._inner.register(region)

    def unregister(self, region: torch.Tensor) -> None:
        self._inner.unregister(region)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return [o is Outcome.OK for o in await self.exists_outcomes(keys)]

    async def exists_outcomes(self, keys: Sequence[str]) -> list[Outcome]:
        """``exists`` per key: OK present, MISSING absent, FAILED / UNREACHABLE for an injected
        failure (plain ``exists`` reports those as absent)."""
        check_keys(keys)
        self._calls.enter()
        try:
            scheduled = self._begin_call()
            if scheduled == "timeout":
                await self._overrun()
                return [Outcome.UNREACHABLE] * len(keys)
            if scheduled == "failed":
                return [Outcome.FAILED] * len(keys)
            failed = self._draw_keys(len(keys), self._plan.fail, "failed_keys")
            present = [Outcome.FAILED if failed[i] else Outcome.MISSING for i in range(len(keys))]
            ask = [i for i in range(len(keys)) if not failed[i] and keys[i] not in self._vanished]
            answer = await self._within_deadline(
                lambda: self._inner.exists([keys[i] for i in ask])
            )
            if answer is None:
                for i in ask:
                    present[i] = Outcome.UNREACHABLE
                return present
            gone: list[str] = []
            for i, here in zip(ask, answer, strict=True):
                if here and self._plan.vanish and self._rng.random() < self._plan.vanish:
                    gone.append(keys[i])
                present[i] = Outcome.OK if here else Outcome.MISSING
            if gone:
                await self._vanish(gone)
            return present
        finally:
            self._calls.exit()

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        check_buffers(keys, buffers)
        self._calls.enter()
        try:
            scheduled = self._begin_call()
            if scheduled == "failed":
                return [Outcome.FAILED] * len(keys)
            if scheduled == "timeout":
                await self._inner.put(keys, buffers)  # it lands; the caller never hears
                await self._overrun()
                return [Outcome.UNREACHABLE] * len(keys)
            plan = self._plan
            outcomes = [Outcome.FAILED] * len(keys)
            failed = self._draw_keys(len(keys), plan.fail, "failed_keys")
            send = [i for i in range(len(keys)) if not failed[i]]
            sent: list[torch.Tensor] = []
            flips: list[tuple[torch.Tensor, int, int]] = []  # (buffer, position, old byte)
            for i in send:
                buf = buffers[i]
                if plan.torn and buf.numel() > 0 and self._rng.random() < plan.torn:
                    buf = buf[: self._rng.randrange(0, buf.numel())]
                    self._faults["torn_writes"] += 1
                if plan.corrupt and buf.numel() > 0 and self._rng.random() < plan.corrupt:
                    pos = self._corrupt_position(buf.numel())
                    flips.append((buf, pos, int(buf[pos])))
                    self._faults["corrupted_writes"] += 1
                sent.append(buf)
            for buf, pos, old in flips:
                buf[pos] = old ^ self._flip_mask()
            try:
                answer = await self._within_deadline(
                    lambda: self._inner.put([keys[i] for i in send], sent)
                )
            finally:
                for buf, pos, old in reversed(flips):
                    buf[pos] = old
            for j, i in enumerate(send):
                if answer is None:
                    outcomes[i] = Outcome.UNREACHABLE
                    continue
                outcomes[i] = answer[j]
                if answer[j] is Outcome.OK:
                    self._read.discard(keys[i])
                if keys[i] in self._vanished:
                    # Stored again from the caller's view (the inner may still hold it).
                    self._vanished.discard(keys[i])
                    if answer[j] is Outcome.EXISTS:
                        outcomes[i] = Outcome.OK
            return outcomes
        finally:
            self._calls.exit()

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        check_buffers(keys, buffers)
        self._calls.enter()
        try:
            scheduled = self._begin_call()
            if scheduled == "failed":
                return [GetResult(Outcome.FAILED)] * len(keys)
            if scheduled == "timeout":
                await self._overrun()
                return [GetResult(Outcome.UNREACHABLE)] * len(keys)
            plan = self._plan
            results = [GetResult(Outcome.FAILED)] * len(keys)
            failed = self._draw_keys(len(keys), plan.fail, "failed_keys")
            send: list[int] = []
            for i, key in enumerate(keys):
                if failed[i]:
                    continue
                if key in self._vanished:
                    results[i] = GetResult(Outcome.MISSING)
                    continue
                send.append(i)
            answer = await self._within_deadline(
                lambda: self._inner.get([keys[i] for i in send], [buffers[i] for i in send])
            )
            for j, i in enumerate(send):
                if answer is None:
                    results[i] = GetResult(Outcome.UNREACHABLE)
                    continue
                result = answer[j]
                results[i] = result
                if (
                    result.outcome is Outcome.OK
                    and result.nbytes > 0
                    and plan.corrupt
                    and self._rng.random() < plan.corrupt
                ):
                    self._flip(buffers[i], result.nbytes, "corrupted_reads")
                elif result.outcome is Outcome.OK and result.nbytes > 0 and keys[i] not in self._read:
                    self._read.add(keys[i])
                    if plan.corrupt_first_read and self._rng.random() < plan.corrupt_first_read:
                        self._flip(buffers[i], result.nbytes, "corrupted_first_reads")
            return results
        finally:
            self._calls.exit()

    async def touch(self, keys: Sequence[str]) -> None:
        check_keys(keys)
        self._calls.enter()
        try:
            scheduled = self._begin_call()
            if scheduled == "timeout":
                await self._overrun()
                return
            if scheduled == "failed":
                return
            await self._within_deadline(
                lambda: self._inner.touch([k for k in keys if k not in self._vanished])
            )
        finally:
            self._calls.exit()

    async def remove(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        self._calls.enter()
        try:
            scheduled = self._begin_call()
            if scheduled is not None:
                if scheduled == "timeout":
                    await self._overrun()
                raise StoreUnavailableError(f"injected {scheduled} failure of remove")
            masked = {k for k in keys if k in self._vanished}
            self._vanished.difference_update(masked)
            answer = await self._within_deadline(
                lambda: self._inner.remove([k for k in keys if k not in masked])
            )
            if answer is None:
                raise StoreUnavailableError("remove ran past the fault plan's deadline")
            return answer
        finally:
            self._calls.exit()

    def statistics(self) -> FaultStatistics:
        inner = attrs.asdict(self._inner.statistics(), recurse=False)
        base_names = {f.name for f in attrs.fields(StoreStatistics)}
        fields = {name: value for name, value in inner.items() if name in base_names}
        return FaultStatistics(**fields, **self._faults)

    async def close(self) -> None:
        await self._calls.close()
        await self._inner.close()

    # ---- injection ----------------------------------------------------------------------------

    def _begin_call(self) -> str | None:
        """Number the call; raise or return how it fails as a whole (None: it does not)."""
        self._call_number += 1
        n = self._call_number
        plan = self._plan
        self._faults["calls"] += 1
        scheduled = (plan.fail_every > 0 and n % plan.fail_every == 0) or any(
            first <= n <= last for first, last in plan.fail_calls
        )
        mode: str | None = None
        if scheduled:
            self._faults["scheduled_failures"] += 1
            mode = plan.scheduled
        elif plan.unavailable and self._rng.random() < plan.unavailable:
            mode = "unavailable"
        elif plan.timeout and self._rng.random() < plan.timeout:
            mode = "timeout"
        if mode == "unavailable":
            self._faults["unavailable_calls"] += 1
            raise StoreUnavailableError(
                f"injected unavailable store (call {n}, plan {plan.describe()!r})"
            )
        if mode == "timeout":
            self._faults["timeouts"] += 1
        return mode

    def _draw_keys(self, n: int, rate: float, counter: str) -> list[bool]:
        if not rate:
            return [False] * n
        hits = [self._rng.random() < rate for _ in range(n)]
        self._faults[counter] += sum(hits)
        return hits

    def _delay_s(self) -> float:
        plan = self._plan
        delay = plan.latency_ms
        if plan.jitter_ms:
            delay += self._rng.random() * plan.jitter_ms
        return delay / 1000.0

    async def _within_deadline(self, call: Callable[[], Awaitable[T]]) -> T | None:
        """Await ``call()`` after the injected latency; None if it ran past the deadline."""
        delay = self._delay_s()
        if delay > 0:
            self._faults["delayed_calls"] += 1
        deadline = self._plan.deadline_ms
        if deadline is None:
            if delay > 0:
                await anyio.sleep(delay)
            return await call()
        with anyio.move_on_after(deadline / 1000.0) as scope:
            if delay > 0:
                await anyio.sleep(delay)
            return await call()
        if scope.cancelled_caught:
            self._faults["timeouts"] += 1
        return None

    async def _overrun(self) -> None:
        """An injected timeout: wait out the deadline (if any), then give up."""
        deadline = self._plan.deadline_ms
        await anyio.sleep(deadline / 1000.0 if deadline else 0)

    async def _vanish(self, keys: list[str]) -> None:
        self._faults["vanished"] += len(keys)
        self._vanished.update(keys)
        if self._inner.capabilities.remove:
            with contextlib.suppress(StoreError):  # the mask hides them anyway
                await self._inner.remove(keys)

    def _flip(self, buf: torch.Tensor, nbytes: int, counter: str) -> None:
        """Flip bits of one verified byte among the first ``nbytes`` of a get's buffer."""
        pos = self._corrupt_position(nbytes)
        buf[pos] = int(buf[pos]) ^ self._flip_mask()
        self._faults[counter] += 1

    def _corrupt_position(self, nbytes: int) -> int:
        """A byte that framing verifies, among the first ``nbytes``."""
        if nbytes > HEADER_BYTES and self._rng.random() < 0.5:
            return self._rng.randrange(HEADER_BYTES, nbytes)
        candidates = [p for p in _VERIFIED_HEADER if p < nbytes] or [0]
        return self._rng.choice(candidates)

    def _flip_mask(self) -> int:
        return self._rng.randrange(1, 256)
