"""How a load of the SGLang plugin ends: what landed is remembered (the request's insert does not
write it again), what a load proved bad is kept out of later lookups and removed from the store
before the load's failure reaches SGLang, so the next lookup recomputes instead of failing again.

Used by :class:`~hylinker.integrations.sglang.HylinkerLinker` through :class:`LoadBatchHooks`
(``integrations/sglang/loads.py``); called on the data plane's threads. This module imports no
SGLang.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import anyio

from ...components.layout import PoolKind
from ...runtime.dataplane.sync_plane import SyncDataPlane
from ...runtime.dataplane.tickets import TransferOutcome
from ...runtime.dataplane.tracing import trace
from ...stores.base import StoreError
from ...stores.condemned import Condemned, remove_condemned
from ...stores.resilient import ResilientStore
from .loads import LoadBatchHooks, retrieve

log = logging.getLogger("hylinker.integrations.sglang")

RESTORED_MEMORY = 1 << 17  # object keys remembered as just restored (not re-offloaded)
CONDEMNED_MEMORY = 1 << 14  # object keys this plugin proved bad, kept out of its lookups
#: the order a load's objects (and their keys) are listed in: pages, then the state
ORDER = (PoolKind.FULL, PoolKind.DRAFT, PoolKind.SWA, PoolKind.MAMBA)


class LoadFailedError(RuntimeError):
    """A load could not restore its objects; SGLang aborts the request (503)."""


class KeyMemory:
    """The last ``capacity`` object keys remembered, oldest forgotten first; any thread."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._keys: collections.OrderedDict[str, None] = collections.OrderedDict()  # bounded: capacity

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def absent(self, keys: list[str]) -> list[bool]:
        """For each of ``keys``: it is not remembered."""
        with self._lock:
            return [k not in self._keys for k in keys]

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()


class LoadEnds:
    """The hooks of the plugin's load batches: layers complete on SGLang's counter, landed keys
    are remembered in ``restored``, a failed load condemns what it proved bad (``condemned``),
    removes it (within ``store_timeout_s``) and then fails its counter index."""

    def __init__(self, counter: Any, data: SyncDataPlane, store: ResilientStore, store_timeout_s: float,
                 count: Callable[..., None], observe: Callable[[float], None] | None) -> None:
        self.counter = counter  # SGLang's LayerWiseLoadCounter
        self.data = data
        self.store = store
        self.store_timeout_s = store_timeout_s
        self.count = count
        self.restored = KeyMemory(RESTORED_MEMORY)
        #: objects a load of this plugin proved bad, by the key lookups probe: a lookup never
        #: offers them again, even where the store cannot remove them (UMBP) or the removal
        #: failed or found a rewrite, so one bad object aborts at most one batch (docs/design.md)
        self.condemned = KeyMemory(CONDEMNED_MEMORY)
        self.hooks = LoadBatchHooks(complete=self.complete, landed=self.restored.add,
                                    ended=self.ended, observe_seconds=observe)

    def complete(self, index: int, layer: int) -> None:
        # reset may have dropped the index, or the load already failed it
        with contextlib.suppress(KeyError, concurrent.futures.InvalidStateError):
            self.counter.complete(index, layer)

    def ended(self, index: int, outcome: TransferOutcome | None, keys: list[str]) -> None:
        """On the data plane's loop: remember what landed, or remove what did not and fail."""
        trace("sglang.load.end", counter_index=index, ok=bool(outcome is not None and outcome.ok),
              objects=len(keys), faults=outcome.faults if outcome is not None else "error")
        if outcome is not None and outcome.ok:
            self.count("loads_ok")
            return
        self.count("loads_failed")
        error = LoadFailedError(f"load failed: {outcome.faults if outcome is not None else 'error'}")
        log.error("HylinkerLinker load batch %d: %s", index, error)
        # only what this load proved bad is removed, as it was read (stores/condemned.py); an
        # object that failed to arrive proves nothing and stays for every other engine
        condemned = dict(outcome.condemned) if outcome is not None else {}
        self.remember_condemned(keys, outcome)
        if outcome is not None:
            verified = [ok for kind in ORDER for ok in outcome.objects.get(kind, [])]
            self.count("failed_objects_kept",
                       sum(1 for k, ok in zip(keys, verified) if not ok and k not in condemned))
        if not condemned or not self.store.capabilities.remove:
            self.fail(index, error)
            return
        # gone before the failure reports: the next lookup misses it (a recompute, not a second 503)
        self.data.call_store(self.remove_then_fail, condemned, index, error).add_done_callback(retrieve)

    async def remove_then_fail(self, condemned: dict[str, Condemned], index: int, error: BaseException) -> None:
        try:
            with anyio.move_on_after(self.store_timeout_s):
                removed = await remove_condemned(self.store, condemned)
                self.count("bad_objects_removed", removed)
                self.count("bad_objects_rewritten", len(condemned) - removed)
        except StoreError as exc:
            log.warning("HylinkerLinker could not remove %d damaged objects: %s", len(condemned), exc)
        finally:
            self.fail(index, error)

    def remember_condemned(self, keys: list[str], outcome: TransferOutcome | None) -> None:
        """Keep out of later lookups the objects of ``keys`` (in ``ORDER``) that ``outcome``
        proved bad (any of their layer groups)."""
        if outcome is None or not outcome.condemned:
            return
        bad: list[str] = []
        at = 0
        for kind in ORDER:
            n = len(outcome.objects.get(kind, []))
            for key in keys[at:at + n]:
                if any(name in outcome.condemned for name in self.data.plane.store_keys(kind, key)):
                    bad.append(key)
            at += n
        self.condemned.add(bad)

    def fail(self, index: int, error: BaseException) -> None:
        self.counter.fail(index, error)


__all__ = ["CONDEMNED_MEMORY", "ORDER", "RESTORED_MEMORY", "KeyMemory", "LoadEnds", "LoadFailedError"]
