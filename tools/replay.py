"""How the stress tool feeds requests to the runtime: like a serving engine, not a firehose.

* :class:`WaitingQueue`: an engine's waiting queue in front of the device pools. A request is
  admitted only when its pages and state slots fit beside the requests already running and
  fewer than ``concurrency`` run; until then it waits. Waiting requests are served in order of
  arrival (their place in the trace), not of when they joined: a next turn that became ready
  late still arrived before the requests behind it in the trace. Replaying "as fast as
  possible" (every request arrives at once) otherwise sends every next turn behind the whole
  rest of the trace, which stretches every reuse distance to the length of the trace. The queue
  is bounded: an arrival that finds ``max_waiting`` requests waiting is rejected (counted).
  A request that could never fit, even alone, is known before the run starts
  (:meth:`WaitingQueue.never_fits`).
* Causal order (:func:`~.prefix_bound.causal_parents`): a request that continues an earlier one
  (the next turn of a conversation) joins the queue only once that request has completed, the
  way a real client sends turn N+1 only after it has read the answer to turn N.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
from collections.abc import AsyncIterator

import anyio
import attrs


@attrs.frozen
class Demand:
    """Device resources a request may hold at once while it runs."""

    pages: int
    slots: int


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests: the arrival is rejected."""


class WaitingQueue:
    """Admission in arrival order against a page and a slot budget (head of line blocks)."""

    def __init__(self, *, pages: int, slots: int, concurrency: int, max_waiting: int) -> None:
        if pages <= 0 or slots < 0 or concurrency <= 0 or max_waiting <= 0:
            raise ValueError(f"bad waiting queue: pages={pages} slots={slots} "
                             f"concurrency={concurrency} max_waiting={max_waiting}")
        self.pages = pages
        self.slots = slots
        self.concurrency = concurrency
        self.max_waiting = max_waiting
        self._free_pages = pages
        self._free_slots = slots
        self._running = 0
        #: (arrival order, tie breaker, demand, admitted event), a heap
        self._waiting: list[tuple[float, int, Demand, anyio.Event]] = []
        self._ties = itertools.count()
        self._progress = anyio.Event()
        #: admitted at once / admitted after waiting / rejected because the queue was full
        self.admitted = 0
        self.waited = 0
        self.rejected = 0
        self.max_depth = 0

    def never_fits(self, demand: Demand) -> bool:
        return demand.pages > self.pages or demand.slots > self.slots

    def _fits(self, demand: Demand) -> bool:
        return (self._running < self.concurrency and demand.pages <= self._free_pages
                and demand.slots <= self._free_slots)

    def _take(self, demand: Demand) -> None:
        self._running += 1
        self._free_pages -= demand.pages
        self._free_slots -= demand.slots
        self.admitted += 1

    def _pump(self) -> None:
        while self._waiting and self._fits(self._waiting[0][2]):
            _, _, demand, ready = heapq.heappop(self._waiting)
            self._take(demand)
            ready.set()

    @contextlib.asynccontextmanager
    async def admitted_for(self, demand: Demand, order: float | None = None) -> AsyncIterator[None]:
        """Hold ``demand`` while the body runs; wait for it first when it does not fit now.

        ``order`` places the request among the waiting ones (lower first; its arrival order);
        by default it joins behind every request waiting now.

        Raises :class:`QueueFullError` when the queue is full and ``ValueError`` for a demand
        that can never fit."""
        if self.never_fits(demand):
            raise ValueError(f"{demand} can never fit in {self.pages} pages / {self.slots} slots")
        key = order if order is not None else math.inf
        ahead = bool(self._waiting) and self._waiting[0][0] <= key
        if not ahead and self._fits(demand):
            self._take(demand)
        else:
            if len(self._waiting) >= self.max_waiting:
                self.rejected += 1
                raise QueueFullError(f"{len(self._waiting)} requests are waiting")
            ready = anyio.Event()
            entry = (key, next(self._ties), demand, ready)
            heapq.heappush(self._waiting, entry)
            self.max_depth = max(self.max_depth, len(self._waiting))
            self.waited += 1
            try:
                await ready.wait()
            except BaseException:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
                else:  # admitted while being cancelled: give it back
                    self._give_back(demand)
                raise
        try:
            yield
        finally:
            self._give_back(demand)

    def _give_back(self, demand: Demand) -> None:
        self._running -= 1
        self._free_pages += demand.pages
        self._free_slots += demand.slots
        self._pump()
        progress, self._progress = self._progress, anyio.Event()
        progress.set()

    async def wait_progress(self, timeout_s: float) -> None:
        """Wait until a running request finishes (or ``timeout_s``)."""
        with anyio.move_on_after(timeout_s):
            await self._progress.wait()

    @property
    def running(self) -> int:
        return self._running


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)
