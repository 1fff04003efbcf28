"""The seeded draws of the fault-injecting store (``stores/faulty.py``): which calls fail as a
whole, which keys fail, how long a call waits, which byte a corruption flips.

Same plan, same seed, same call sequence: same draws. Every fault drawn is counted in
:attr:`FaultDraws.counts` (the fault fields of :class:`~hylinker.stores.fault_plan.FaultStatistics`).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio
import torch
import xxhash

from .base import StoreUnavailableError
from .fault_plan import _FAULT_COUNTERS, FaultPlan
from .framing import HEADER_BYTES

T = TypeVar("T")

# Header bytes framing.verify checks: magic, version, flags, layout, key, length, checksum (0..48).
VERIFIED_HEADER = tuple(range(0, 48))


class FaultDraws:
    """The plan in force, the seeded generator, the call count and the fault counts."""

    def __init__(self, plan: FaultPlan, seed: int) -> None:
        self.plan = plan
        self.rng = random.Random(seed)
        self.calls = 0
        self.counts: dict[str, int] = dict.fromkeys(_FAULT_COUNTERS, 0)

    def begin_call(self) -> str | None:
        """Number the call; raise or return how it fails as a whole (None: it does not)."""
        self.calls += 1
        n = self.calls
        plan = self.plan
        self.counts["calls"] += 1
        scheduled = (plan.fail_every > 0 and n % plan.fail_every == 0) or any(
            first <= n <= last for first, last in plan.fail_calls
        )
        mode: str | None = None
        if scheduled:
            self.counts["scheduled_failures"] += 1
            mode = plan.scheduled
        elif plan.unavailable and self.rng.random() < plan.unavailable:
            mode = "unavailable"
        elif plan.timeout and self.rng.random() < plan.timeout:
            mode = "timeout"
        if mode == "unavailable":
            self.counts["unavailable_calls"] += 1
            raise StoreUnavailableError(
                f"injected unavailable store (call {n}, plan {plan.describe()!r})"
            )
        if mode == "timeout":
            self.counts["timeouts"] += 1
        return mode

    def draw_keys(self, n: int, rate: float, counter: str) -> list[bool]:
        if not rate:
            return [False] * n
        hits = [self.rng.random() < rate for _ in range(n)]
        self.counts[counter] += sum(hits)
        return hits

    def delay_s(self) -> float:
        plan = self.plan
        delay = plan.latency_ms
        if plan.jitter_ms:
            delay += self.rng.random() * plan.jitter_ms
        return delay / 1000.0

    async def within_deadline(self, call: Callable[[], Awaitable[T]]) -> T | None:
        """Await ``call()`` after the injected latency; None if it ran past the deadline."""
        delay = self.delay_s()
        if delay > 0:
            self.counts["delayed_calls"] += 1
        deadline = self.plan.deadline_ms
        if deadline is None:
            if delay > 0:
                await anyio.sleep(delay)
            return await call()
        with anyio.move_on_after(deadline / 1000.0) as scope:
            if delay > 0:
                await anyio.sleep(delay)
            return await call()
        if scope.cancelled_caught:
            self.counts["timeouts"] += 1
        return None

    async def overrun(self) -> None:
        """An injected timeout: wait out the deadline (if any), then give up."""
        deadline = self.plan.deadline_ms
        await anyio.sleep(deadline / 1000.0 if deadline else 0)

    def flip(self, obj: Sequence[torch.Tensor], nbytes: int, counter: str) -> None:
        """Flip bits of one verified byte among the first ``nbytes`` a get wrote into ``obj``."""
        buf, pos = locate(obj, self.corrupt_position(nbytes))
        buf[pos] = int(buf[pos]) ^ self.flip_mask()
        self.counts[counter] += 1

    def corrupt_position(self, nbytes: int) -> int:
        """A byte that framing verifies, among the first ``nbytes``."""
        if nbytes > HEADER_BYTES and self.rng.random() < 0.5:
            return self.rng.randrange(HEADER_BYTES, nbytes)
        candidates = [p for p in VERIFIED_HEADER if p < nbytes] or [0]
        return self.rng.choice(candidates)

    def flip_mask(self) -> int:
        return self.rng.randrange(1, 256)


def prefix(obj: Sequence[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The first ``n`` bytes of the object ``obj`` (views of its buffers; a torn write)."""
    out: list[torch.Tensor] = []
    for p in obj:
        if n <= 0:
            break
        out.append(p[:n])
        n -= p.numel()
    return out or [obj[0][:0]]


def locate(obj: Sequence[torch.Tensor], pos: int) -> tuple[torch.Tensor, int]:
    """The buffer of ``obj`` holding byte ``pos`` of the object, and the byte's place in it."""
    for p in obj:
        if pos < p.numel():
            return p, pos
        pos -= p.numel()
    raise IndexError("position past the object's end")


def landed_checksum(payload: Sequence[torch.Tensor], nbytes: int) -> int:
    """XXH3-64 of the first ``nbytes`` of the payload buffers, as they are now."""
    h = xxhash.xxh3_64()
    for p in payload:
        if nbytes <= 0:
            break
        h.update(p[:nbytes].numpy().data)
        nbytes -= p.numel()
    return h.intdigest()
