"""The one sub-batch pipeline of every transfer route: sub-batch ``k`` overlaps ``k - 1``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

X = TypeVar("X")


async def pipelined(n: int, first: Callable[[int], Awaitable[X]],
                    then: Callable[[int, X], Coroutine[Any, Any, None]], *, calls_in_flight: int = 1) -> None:
    """``first(k)`` for every sub-batch ``k`` in order, then ``then(k, what first returned)``.

    ``first(k)`` (prepare: gather and seal, or nothing) starts once ``first(k - 1)`` ended and
    ``then(k - 2)`` ended, so it overlaps ``then(k - 1)`` (the store call or the landing of the
    sub-batch before) and never touches a double-buffered half, or a header slot, that a
    sub-batch still in flight uses. ``then(k)`` starts once ``first(k)`` ended and, with
    ``calls_in_flight=1``, ``then(k - 1)`` ended; with ``2`` it may overlap ``then(k - 1)``: two
    store calls in flight, the loop's and threads' preparing of one sub-batch runs while the
    store moves the other's.

    Two lanes run the sub-batches, even ones in one and odd ones in the other, each one after
    the other; one asyncio event per sub-batch says it is prepared (and, one call in flight, one
    that it ended: a handful of Python calls each). A sub-batch that fails still sets its events,
    so the other lane never waits forever. One sub-batch runs inline: no task, no event; with one
    call in flight it yields to the loop once between its two steps, as a task group around its
    first step would, so the loop's other tasks (a plane that is closing, submitters waiting
    for queue space) keep their turn between two jobs of a worker."""
    if calls_in_flight not in (1, 2):
        raise ValueError(f"calls_in_flight is 1 or 2, got {calls_in_flight}")
    if n <= 1:
        if n == 1:
            got = await first(0)
            if calls_in_flight == 1:
                await anyio.lowlevel.checkpoint()  # the loop's other tasks get a turn (see above)
            await then(0, got)
        return
    prepared = [asyncio.Event() for _ in range(n)]
    ended = [asyncio.Event() for _ in range(n)] if calls_in_flight == 1 else None

    async def lane(start: int) -> None:
        for k in range(start, n, 2):
            if k >= 1:
                await prepared[k - 1].wait()
            try:
                got = await first(k)
            finally:
                prepared[k].set()
            try:
                if ended is not None and k >= 1:
                    await ended[k - 1].wait()
                await then(k, got)
            finally:
                if ended is not None:
                    ended[k].set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lane, 1)
        await lane(0)
