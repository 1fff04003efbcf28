"""Calls in flight of an in-process store, and the key check every store call starts with.

``close`` waits for the calls in flight, later calls raise :class:`StoreClosedError` (the
embedded, fault-injecting and UMBP stores share this).
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from .base import StoreClosedError


def check_keys(keys: Sequence[str]) -> None:
    """Raise a clear ``ValueError`` unless every key is a non-empty string."""
    for key in keys:
        if not isinstance(key, str) or not key:
            raise ValueError(f"store keys must be non-empty strings, got {key!r}")


class InflightCalls:
    """Counts calls in flight so ``close`` can wait for them; refuses calls after close.

    Used from the event loop thread only.
    """

    def __init__(self, store_name: str) -> None:
        self._name = store_name
        self._count = 0
        self._idle: anyio.Event | None = None
        self.closed = False

    def enter(self) -> None:
        if self.closed:
            raise StoreClosedError(f"{self._name} store is closed")
        self._count += 1

    def exit(self) -> None:
        self._count -= 1
        if self._count == 0 and self._idle is not None:
            self._idle.set()

    def __enter__(self) -> None:
        """``with calls:`` one call in flight (refused once closed)."""
        self.enter()

    def __exit__(self, *exc_info: object) -> None:
        self.exit()

    async def close(self) -> bool:
        """Refuse new calls and wait for those in flight; False if already closed."""
        first = not self.closed
        self.closed = True
        while self._count > 0:
            self._idle = anyio.Event()
            await self._idle.wait()
        self._idle = None
        return first

