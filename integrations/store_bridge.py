"""A synchronous bridge from engine threads to hylinker's async stores.

An engine that calls its linker from plain threads (SGLang's scheduler thread, the linker's own
load and offload threads) reaches a :class:`~hylinker.stores.base.Store` through this bridge:
one private event loop in a daemon thread owns the store, and every call returns a
``concurrent.futures.Future``. Callers wait with a deadline (``wait``), so a store that stops
answering costs a caller at most that deadline, never a hang. A call that outlived its waiter
keeps running on the loop; its buffers stay referenced by the future until it returns.

This is the one place where the SGLang plugin meets the async data path; the rest of the plugin
is synchronous code over pool views and staging frames.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import torch

from ..stores.base import GetResult, Outcome, Store, StoreCapabilities

T = TypeVar("T")


class StoreTimeoutError(TimeoutError):
    """A store call did not answer within the caller's deadline."""


class StoreBridge:
    """Owns a store on a private event loop; see the module docstring."""

    def __init__(self, open_store: Callable[[], Awaitable[Store]], *, open_timeout_s: float = 120.0,
                 name: str = "hylinker-store") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.store: Store = self.wait(self._submit(open_store()), open_timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    @staticmethod
    def wait(future: concurrent.futures.Future[T], timeout_s: float) -> T:
        """The future's result, or :class:`StoreTimeoutError` after ``timeout_s``."""
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise StoreTimeoutError(f"store call did not answer within {timeout_s:.3g} s") from None

    @property
    def capabilities(self) -> StoreCapabilities:
        return self.store.capabilities

    def register(self, region: torch.Tensor) -> None:
        self.store.register(region)

    def exists(self, keys: Sequence[str]) -> concurrent.futures.Future[list[bool]]:
        return self._submit(self.store.exists(list(keys)))

    def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> concurrent.futures.Future[list[Outcome]]:
        return self._submit(self.store.put(list(keys), list(buffers)))

    def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> concurrent.futures.Future[list[GetResult]]:
        return self._submit(self.store.get(list(keys), list(buffers)))

    def touch(self, keys: Sequence[str]) -> concurrent.futures.Future[None]:
        return self._submit(self.store.touch(list(keys)))

    def remove(self, keys: Sequence[str]) -> concurrent.futures.Future[int]:
        return self._submit(self.store.remove(list(keys)))

    def call(self, fn: Callable[[Store], Awaitable[T]], timeout_s: float) -> T:
        """Run ``await fn(store)`` on the loop and wait for it."""
        return self.wait(self._submit(fn(self.store)), timeout_s)

    def statistics(self) -> Any:
        return self.store.statistics()

    def close(self, timeout_s: float = 10.0) -> bool:
        """Close the store (waiting at most ``timeout_s``) and stop the loop. Idempotent.

        Returns False when the store did not finish closing in time; the loop thread is a
        daemon, so a store stuck in a call never keeps the process alive.
        """
        if self._closed:
            return True
        self._closed = True
        ok = True
        try:
            self.wait(self._submit(self.store.close()), timeout_s)
        except Exception:
            ok = False
        self._stop_loop()
        return ok

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()


__all__ = ["StoreBridge", "StoreTimeoutError"]
