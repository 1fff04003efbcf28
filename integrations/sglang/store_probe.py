"""The SGLang plugin's questions to the store on a lookup: which objects it holds, within the
lookup's time (``lookup_timeout_s``, and all lookups of one scheduler round within
``lookup_budget_s``; at once while the store's breaker is open), and the touch that keeps a hit
prefix hot. Used by :meth:`HylinkerLinker.lookup <hylinker.integrations.sglang.HylinkerLinker.lookup>`,
on SGLang's scheduler thread; imports no SGLang."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ...components.layout import PoolKind
from ...runtime.dataplane.sync_plane import SyncDataPlane
from ...runtime.dataplane.tracing import trace
from ...stores.resilient import ResilientStore
from .config import SGLangLinkerConfig
from .loads import retrieve
from .transfers import TransferNames

log = logging.getLogger("hylinker.integrations.sglang")


class StoreProbe:
    """``exists`` and ``touch`` of a lookup over the data plane, with this round's budget."""

    def __init__(self, config: SGLangLinkerConfig, data: SyncDataPlane, store: ResilientStore,
                 names: TransferNames, count: Callable[..., None]) -> None:
        self.config = config
        self.data = data
        self.store = store
        self.names = names
        self.count = count
        self.budget_s = config.lookup_budget_s  # what this scheduler round has left

    def new_round(self) -> None:
        """A scheduler round begins: its lookups get ``lookup_budget_s`` again."""
        self.budget_s = self.config.lookup_budget_s

    def ask(self, rid: str, probe: dict[PoolKind, list[str]]) -> dict[PoolKind, list[bool]] | None:
        """Which of ``probe``'s objects the store holds, or None (a miss): at once while the
        store's breaker is open or this round's ``lookup_budget_s`` is spent, else within
        ``lookup_timeout_s`` and the budget left. A lookup given up on cancels its store call,
        which counts toward the breaker (``stores/resilient.py``)."""
        if self.store.breaker_open:
            # when a probe is due the call goes out in the background (bounded by
            # store_timeout_s), and the breaker closes when the store answers it
            if self.store.breaker.probe_due():
                self.data.exists(probe).add_done_callback(retrieve)
            self.count("lookups_breaker_open")
            return None
        wait = min(self.config.lookup_timeout_s, self.budget_s)
        if wait <= 0:
            self.count("lookups_over_budget")
            return None
        t0 = time.perf_counter()
        future = self.data.exists(probe)
        try:
            return future.result(timeout=wait)
        except Exception as exc:  # a store that fails or hangs
            future.cancel()
            self.count("lookup_errors")
            log.warning("HylinkerLinker lookup failed (a miss): %r", exc)
            trace("sglang.lookup.error", request_id=rid, error=repr(exc))
            return None
        finally:
            self.budget_s -= time.perf_counter() - t0

    def touch(self, pages: list[str], with_state: bool, swa_pages: int = 0) -> None:
        """Tell the store the hit prefix is hot: every KV (and draft) page, the SWA window's
        pages, the boundary state; fire and forget."""
        if not self.config.touch or not self.store.capabilities.touch:
            return
        keys = self.names.object_keys("kv", pages)
        if PoolKind.DRAFT in self.names.kinds:
            keys += self.names.object_keys("draft", pages)
        if swa_pages:
            keys += self.names.object_keys("swa", pages[-swa_pages:])
        if with_state:
            keys += self.names.object_keys("mamba", pages[-1:])
        future = self.data.call_store(self.store.touch, keys)  # fire and forget: recency only
        future.add_done_callback(retrieve)
        self.count("touches")


__all__ = ["StoreProbe"]
