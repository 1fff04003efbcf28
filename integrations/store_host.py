"""One store per engine process, on its own event-loop thread, shared by the plugin's roles.

vLLM builds its KV connector twice in one EngineCore process (the scheduler side and, with the
in-process executor, the worker side). Both must see the same objects — for the embedded store,
the same instance — and stores bind to the event loop that uses them. :class:`StoreHost` owns
one blocking portal (an anyio loop in a daemon thread) and the store opened on it; roles
:func:`acquire` it by settings and :meth:`release` it, and the last release closes the store
(after the data planes on the portal quiesced). Calls from engine threads go through
:attr:`StoreHost.portal` and always carry a deadline, so a store that stops answering costs the
caller that deadline, never a hang.

The scheduler's probes (:meth:`StoreHost.exists`) go through a circuit breaker, the store
wrapper's (:class:`~hylinker.stores.resilient.CircuitBreaker`, its default threshold and probe
interval): ``failure_threshold`` probes in a row that failed or ran out of time open it, and
while it is open a probe is a miss at once. Every ``probe_interval_s`` one probe goes out in the
background (the caller still gets a miss at once); its answer closes the breaker. So a dead store
costs the scheduler ``failure_threshold`` deadlines, then nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.from_thread

from ..stores.base import Store, StoreError
from ..stores.host_bytes import one_openmp_thread
from ..stores.resilient import CircuitBreaker, ResiliencePolicy
from .config import PluginConfig

#: bounded: one per distinct plugin configuration open in this process, removed when it closes
_HOSTS: dict[PluginConfig, StoreHost] = {}
_HOSTS_LOCK = threading.Lock()


class StoreHost:
    """The store for one :class:`PluginConfig`, with its loop thread; see the module docstring."""

    def __init__(self, config: PluginConfig, open_timeout_s: float = 120.0) -> None:
        self.config = config
        self._stack = contextlib.ExitStack()
        self.portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())
        try:
            self.portal.call(one_openmp_thread)  # inline copies run on this loop: no OpenMP team
            future = self.portal.start_task_soon(config.open_store)
            self.store: Store = future.result(open_timeout_s)
        except BaseException:
            self._stack.close()
            raise
        self._users = 0
        self._closed = False
        policy = ResiliencePolicy()
        self._breaker_lock = threading.Lock()  # the scheduler's thread and the loop's
        self.breaker = CircuitBreaker(policy.failure_threshold, policy.probe_interval_s)

    @property
    def users(self) -> int:
        """Roles holding this host now (2 when vLLM's scheduler and worker share the process)."""
        return self._users

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool] | None:
        """Which keys the store holds, or None when it failed, did not answer in time, or its
        breaker is open (a caller treats None as a miss: fail closed). See the module doc."""
        if not keys:
            return []
        with self._breaker_lock:
            admitted = self.breaker.admit()
            probe = self.breaker.state == "half_open"
        if not admitted:
            return None
        future = self.portal.start_task_soon(self._exists_within, list(keys), timeout_s)
        if probe:  # the breaker's probe: answered in the background, a miss now
            future.add_done_callback(_retrieve)
            return None
        try:
            # the call ends by its own deadline (and settles the breaker there); the margin
            # covers the hop onto the loop
            return future.result(timeout_s + 1.0)
        except concurrent.futures.TimeoutError:  # the loop itself is stuck
            future.cancel()
            return None

    async def _exists_within(self, keys: list[str], timeout_s: float) -> list[bool] | None:
        """``store.exists`` within ``timeout_s``, the breaker told how it went (on the loop)."""
        present: list[bool] | None = None
        with anyio.move_on_after(timeout_s):
            try:
                answer = await self.store.exists(keys)
            except (StoreError, OSError):
                pass
            else:
                if len(answer) == len(keys):
                    present = [bool(p) for p in answer]
        with self._breaker_lock:
            if present is None:
                self.breaker.failure()
            else:
                self.breaker.success()
        return present

    def on_evict(self, listener: Callable[[list[str]], None]) -> bool:
        """Have the store call ``listener`` with the keys it evicts (see
        ``EmbeddedStore.on_evict``); False if the store (under any fault wrapper) does not evict
        on its own."""
        store: object = self.store
        while not hasattr(store, "on_evict") and hasattr(store, "inner"):
            store = store.inner
        hook = getattr(store, "on_evict", None)
        if hook is None:
            return False
        hook(listener)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.portal.call(self.store.close)
        finally:
            self._stack.close()


def _retrieve(future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: never logged as unhandled


def acquire(config: PluginConfig) -> StoreHost:
    """The process's store host for ``config`` (opened on first use)."""
    with _HOSTS_LOCK:
        host = _HOSTS.get(config)
        if host is None:
            host = StoreHost(config)
            _HOSTS[config] = host
        host._users += 1
        return host


def release(host: StoreHost) -> None:
    """Drop one user; the last one closes the store and stops its loop."""
    with _HOSTS_LOCK:
        host._users -= 1
        if host._users > 0:
            return
        if _HOSTS.get(host.config) is host:
            del _HOSTS[host.config]
    host.close()


__all__ = ["StoreHost", "acquire", "release"]
