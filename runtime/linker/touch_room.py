"""TOUCH coalescing: one background task sends every pending touch in batched store calls.

Device hits call :meth:`TouchBatcher.add` (synchronous, never awaits); the batcher's one task
wakes, waits ``batch_s`` so hits that arrive together share a call, and sends the distinct keys
in calls of at most ``capabilities.max_batch`` keys. A store error is traced and forgotten (a
touch is a hint). Instead of one task per hot node, there is one task per linker.
"""

from __future__ import annotations

import anyio

from ...stores.base import Store, StoreError
from ..dataplane.tracing import trace


class TouchBatcher:
    def __init__(self, store: Store, *, batch_s: float) -> None:
        self.store = store
        self.batch_s = batch_s
        self._pending: dict[str, None] = {}  # insertion-ordered set of keys
        self._wake = anyio.Event()
        self._stopped = False
        self._stop = anyio.Event()  # ends the batch window at once: close never waits it out
        self.calls = 0  # store.touch calls made
        self.keys_sent = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, keys: list[str]) -> None:
        if self._stopped:
            return
        pending = self._pending
        for key in keys:  # a key touched again moves to the end: the store sees the latest order
            pending.pop(key, None)
            pending[key] = None
        self._wake.set()

    def stop(self) -> None:
        """Stop taking touches; the task sends nothing more and returns."""
        self._stopped = True
        self._pending.clear()
        self._wake.set()
        self._stop.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            if self._stopped:
                return
            with anyio.move_on_after(self.batch_s):
                await self._stop.wait()
            if self._stopped:
                return
            self._wake = anyio.Event()
            keys, self._pending = list(self._pending), {}
            step = max(1, self.store.capabilities.max_batch)
            for lo in range(0, len(keys), step):
                if self._stopped:
                    return
                batch = keys[lo:lo + step]
                self.calls += 1
                self.keys_sent += len(batch)
                try:
                    await self.store.touch(batch)
                except StoreError as exc:
                    trace("touch.store_error", error=str(exc), keys=len(batch))


__all__ = ["TouchBatcher"]
