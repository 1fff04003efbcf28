"""Agreement across tensor-parallel ranks: every rank's linker takes the same decision.

Each rank runs its own :class:`~hylinker.runtime.linker.facade.Linker` over its own pools and its own
store client. A store probe, a read or a write can differ between ranks (a shard evicted, a
transient fault on one rank), so every decision that changes what a request restores, or what
the tree believes is stored, is agreed: each rank contributes what it *can* do and all ranks
take the same answer (the intersection of the sets, its largest member).

An :class:`Agreement` has two **channels**, each with its own ordered stream of rounds:

* ``requests``: LOOKUP and LOAD rounds, issued from the engine's calls;
* ``offloads``: one settlement round per ``insert`` (two with a replicated pool), issued in
  ``insert`` order by the offload room's sequencer, whatever order the writes finish in.

**The ordering rule** (the engine's side): every rank calls ``lookup``, ``load`` and ``insert``
for the same requests in the same order (an engine scheduler is deterministic across TP ranks:
one scheduler decision per step, broadcast or replicated), and with more than one rank calls
``load`` after every ``lookup`` (it returns ``None`` at once when no rank has anything to
load). Within a channel, rounds then line up; the two channels never wait on each other, so an
offload settling late cannot block a lookup. Each round carries ``(phase, request id)`` beside
its value; ranks that reach different rounds all raise :class:`RankMismatchError` instead of
taking a decision over unrelated values.

:class:`SingleRank` is the default: a round returns the rank's own value at once, with no
thread and no copy. :class:`GlooAgreement` runs ``all_gather_object`` over a process group
(gloo on CPU) on one dedicated thread per channel, so the event loop keeps serving while a round
waits for its peers: one ``all_gather`` of a fixed 4 KiB slot per rank in the common case,
``all_gather_object`` (two collectives) when a value is larger.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import anyio
import anyio.lowlevel

#: bytes per rank of a round's fixed slot (a length, then the pickled value)
SLOT_BYTES = 4096
_LEN_BYTES = 4
_TOO_LARGE = (1 << 32) - 1

#: round durations kept per (channel, phase) (:class:`RoundTimes`); older ones only counted
ROUND_WINDOW = 4096

#: how long a round waits for its peers before it fails (seconds; ``GlooAgreement.create``)
DEFAULT_ROUND_TIMEOUT_S = 120.0

Channel = Literal["requests", "offloads"]
CHANNELS: tuple[Channel, ...] = ("requests", "offloads")


class RoundTimes:
    """One (channel, phase)'s round durations: a server agrees on every request for weeks, so
    every round is counted and summed, and only the last ``window`` durations are kept."""

    def __init__(self, window: int = ROUND_WINDOW) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        self.recent.append(seconds)

    def since(self, count: int) -> list[float]:
        """The durations of the rounds after the first ``count`` that are still kept."""
        return list(self.recent)[max(0, len(self.recent) - (self.count - count)):]


class AgreementError(RuntimeError):
    """An agreement round could not be completed."""


class RankMismatchError(AgreementError):
    """Ranks reached different rounds: the ordering rule was broken (or a rank diverged)."""


class Agreement:
    """How one rank's linker agrees with its peers. Subclasses implement :meth:`_gather`."""

    rank: int = 0
    size: int = 1

    def __init__(self, *, round_window: int = ROUND_WINDOW) -> None:
        if round_window < 1:
            raise ValueError(f"round_window must be >= 1, got {round_window}")
        self._round_window = round_window
        #: what each round cost, per (channel, phase): every round counted and summed, the
        #: last ``round_window`` durations kept (bounded: the phases are a fixed set of names)
        self.round_seconds: dict[tuple[str, str], RoundTimes] = {}
        self.rounds = 0

    @property
    def collective(self) -> bool:
        """Whether decisions involve other ranks (False: a single rank, nothing to agree)."""
        return self.size > 1

    async def gather(self, channel: Channel, phase: str, request_id: str, value: Any) -> list[Any]:
        """Every rank's ``value`` for this round, by rank. Raises :class:`RankMismatchError`
        (on every rank) when the ranks' rounds differ."""
        if channel not in CHANNELS:
            raise ValueError(f"unknown agreement channel {channel!r}; use one of {CHANNELS}")
        t0 = time.perf_counter()
        tag = (phase, request_id)
        got = await self._gather(channel, (tag, value))
        self.rounds += 1
        times = self.round_seconds.get((channel, phase))
        if times is None:
            times = self.round_seconds[(channel, phase)] = RoundTimes(self._round_window)
        times.add(time.perf_counter() - t0)
        tags = [t for t, _ in got]
        if any(t != tag for t in tags):
            raise RankMismatchError(
                f"rank {self.rank}: agreement round {channel}/{phase} for {request_id!r} met other "
                f"rounds on other ranks {tags}: every rank must call lookup/load/insert for the "
                "same requests in the same order")
        return [v for _, v in got]

    async def largest_common(self, channel: Channel, phase: str, request_id: str,
                             boundaries: Boundaries) -> int:
        """The largest page count every rank can restore (0 when none is shared)."""
        reports: list[Boundaries] = await self.gather(channel, phase, request_id, boundaries)
        return agreed_boundary(reports)

    async def _gather(self, channel: Channel, item: Any) -> list[Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Stop the rounds' threads (idempotent)."""


class SingleRank(Agreement):
    """One rank: every round is the rank's own value (no thread, no copy)."""

    async def _gather(self, channel: Channel, item: Any) -> list[Any]:
        return [item]


class GlooAgreement(Agreement):
    """Rounds over ``torch.distributed`` process groups, one group and one thread per channel.

    Build it on every rank at the same point (it creates the channels' groups collectively):
    ``GlooAgreement.create()`` after ``torch.distributed.init_process_group("gloo", ...)``.
    """

    def __init__(self, groups: dict[Channel, Any], *, round_window: int = ROUND_WINDOW) -> None:
        import torch.distributed as dist

        super().__init__(round_window=round_window)
        if set(groups) != set(CHANNELS):
            raise ValueError(f"GlooAgreement needs one process group per channel {CHANNELS}")
        if not dist.is_initialized():
            raise AgreementError("torch.distributed is not initialised: call init_process_group first")
        self._dist = dist
        self._groups = dict(groups)
        self.rank = dist.get_rank(groups["requests"])
        self.size = dist.get_world_size(groups["requests"])
        self._threads = {c: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"hylinker-agree-{c}")
                         for c in CHANNELS}
        self._closed = False
        self._lock = threading.Lock()
        self.large_rounds = 0  # rounds whose values did not fit a slot (two collectives)

    @classmethod
    def create(cls, backend: str = "gloo", ranks: Sequence[int] | None = None,
               timeout_s: float = DEFAULT_ROUND_TIMEOUT_S) -> GlooAgreement:
        """Two fresh groups (one per channel) over ``ranks`` (default: the whole world).

        ``timeout_s`` bounds every round: a peer that never reaches a round (it died, or the
        engine broke the ordering rule on one rank) fails the round with :class:`AgreementError`
        after that long, instead of holding the caller for torch's default (30 minutes).
        """
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            raise AgreementError("torch.distributed is not initialised: call init_process_group first")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        timeout = datetime.timedelta(seconds=timeout_s)
        groups: dict[Channel, Any] = {c: dist.new_group(ranks=list(ranks) if ranks is not None else None,
                                                        backend=backend, timeout=timeout) for c in CHANNELS}
        return cls(groups)

    def _round(self, channel: Channel, item: Any) -> list[Any]:
        """One collective in the common case: every rank's pickled value in a fixed slot of
        :data:`SLOT_BYTES`; when any value is larger (every rank sees that from the lengths),
        all ranks fall back to ``all_gather_object`` (two collectives)."""
        import torch

        group = self._groups[channel]
        data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        fits = len(data) <= SLOT_BYTES - _LEN_BYTES
        slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
        slot[:_LEN_BYTES] = torch.tensor(list((len(data) if fits else _TOO_LARGE).to_bytes(_LEN_BYTES, "little")),
                                         dtype=torch.uint8)
        if fits:
            slot[_LEN_BYTES:_LEN_BYTES + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        slots = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in range(self.size)]
        self._dist.all_gather(slots, slot, group=group)
        lengths = [int.from_bytes(bytes(s[:_LEN_BYTES].tolist()), "little") for s in slots]
        if any(n == _TOO_LARGE for n in lengths):
            self.large_rounds += 1
            out: list[Any] = [None] * self.size
            self._dist.all_gather_object(out, item, group=group)
            return out
        return [pickle.loads(s[_LEN_BYTES:_LEN_BYTES + n].numpy().tobytes()) for s, n in zip(slots, lengths)]

    async def _gather(self, channel: Channel, item: Any) -> list[Any]:
        with self._lock:
            if self._closed:
                raise AgreementError("the agreement is closed")
            future = self._threads[channel].submit(self._round, channel, item)
        done = anyio.Event()
        token = anyio.lowlevel.current_token()
        loop_thread = threading.get_ident()

        def wake(_f: concurrent.futures.Future[list[Any]]) -> None:
            if threading.get_ident() == loop_thread:  # the round ended before the callback was set
                done.set()
                return
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                anyio.from_thread.run_sync(done.set, token=token)

        future.add_done_callback(wake)
        # a round once started must finish on every rank: a cancelled caller still waits for it
        with anyio.CancelScope(shield=True):
            await done.wait()
        try:
            return future.result()
        except Exception as exc:  # a peer died, a timeout of the process group
            raise AgreementError(f"rank {self.rank}: agreement round failed: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for pool in self._threads.values():
            pool.shutdown(wait=True)


# ---- what a rank can restore ---------------------------------------------------------------

#: ``(device, device_points, store)``: the rank can restore every page count in ``store``, and
#: from its device tree every count up to ``device`` (``device_points`` None: any of them; a
#: tuple: only those — a hybrid tree restores only where a state sits). 0 is always restorable.
Boundaries = tuple[int, "tuple[int, ...] | None", "tuple[int, ...]"]


def restorable(b: Boundaries, pages: int) -> bool:
    device, points, store = b
    if pages == 0 or pages in store:
        return True
    return pages <= device and (points is None or pages in points)


def agreed_boundary(reports: Sequence[Boundaries]) -> int:
    """The largest page count every report can restore: the MIN over ranks taken over the sets
    of restorable boundaries, not over each rank's longest one."""
    candidates: set[int] = set()
    for device, points, store in reports:
        candidates.update(store)
        candidates.update(points if points is not None else (device,))
    for c in sorted(candidates, reverse=True):
        if all(restorable(r, c) for r in reports):
            return c
    return 0


def page_runs(pages: set[int]) -> tuple[tuple[int, int], ...]:
    """``pages`` as ``(first, end)`` runs of consecutive pages, ascending (end exclusive)."""
    runs: list[tuple[int, int]] = []
    for p in sorted(pages):
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return tuple(runs)


def runs_pages(runs: Sequence[tuple[int, int]]) -> set[int]:
    """The pages of :func:`page_runs`'s runs."""
    return {p for first, end in runs for p in range(first, end)}


__all__ = ["CHANNELS", "ROUND_WINDOW", "Agreement", "AgreementError", "Boundaries", "Channel", "GlooAgreement",
           "RankMismatchError", "RoundTimes", "SingleRank", "agreed_boundary", "page_runs", "restorable",
           "runs_pages"]
