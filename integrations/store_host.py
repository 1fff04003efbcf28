"""One store per engine process, on its own event-loop thread, shared by the plugin's roles.

vLLM builds its KV connector twice in one EngineCore process (the scheduler side and, with the
in-process executor, the worker side). Both must see the same objects — for the embedded store,
the same instance — and stores bind to the event loop that uses them. :class:`StoreHost` owns
one blocking portal (an anyio loop in a daemon thread) and the store opened on it; roles
:func:`acquire` it by settings and :meth:`release` it, and the last release closes the store
(after the data planes on the portal quiesced). Calls from engine threads go through
:attr:`StoreHost.portal` and always carry a deadline, so a store that stops answering costs the
caller that deadline, never a hang.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Sequence

import anyio.from_thread

from ..stores.base import Store, StoreError
from .config import PluginConfig

_HOSTS: dict[PluginConfig, StoreHost] = {}
_HOSTS_LOCK = threading.Lock()


class StoreHost:
    """The store for one :class:`PluginConfig`, with its loop thread; see the module docstring."""

    def __init__(self, config: PluginConfig, open_timeout_s: float = 120.0) -> None:
        self.config = config
        self._stack = contextlib.ExitStack()
        self.portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())
        try:
            future = self.portal.start_task_soon(config.open_store)
            self.store: Store = future.result(open_timeout_s)
        except BaseException:
            self._stack.close()
            raise
        self._users = 0
        self._closed = False

    @property
    def users(self) -> int:
        """Roles holding this host now (2 when vLLM's scheduler and worker share the process)."""
        return self._users

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool] | None:
        """Which keys the store holds, or None when it failed or did not answer in time
        (a caller treats None as a miss: fail closed)."""
        if not keys:
            return []
        future = self.portal.start_task_soon(self.store.exists, list(keys))
        try:
            present = future.result(timeout_s)
        except (StoreError, concurrent.futures.TimeoutError, OSError):
            future.cancel()
            return None
        if len(present) != len(keys):
            return None
        return [bool(p) for p in present]

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
