"""The loads of one ``start_layer_wise_loading`` behind SGLang's layer counter, and the offload
fence over SGLang's device events; used by :class:`~hylinker.integrations.sglang.HylinkerLinker`, which it
reaches only through :class:`LoadBatchHooks`.
This module imports no SGLang."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ...runtime.dataplane.sync_plane import SyncLoad
from ...runtime.dataplane.tickets import TransferOutcome

log = logging.getLogger("hylinker.integrations.sglang")


class AllEvents:
    """One fence over several device events (SGLang's ``record_offload_ready``)."""

    def __init__(self, events: Sequence[Any]) -> None:
        self.events = list(events)

    def query(self) -> bool:
        return all(e.query() for e in self.events)


@attrs.frozen
class LoadBatchHooks:
    """What a :class:`LoadBatch` tells its owner, each called from a data-plane thread: a layer
    of the batch's counter index is complete; every load landed whole (their object keys,
    remembered before the engine can insert them again); the batch ended (its outcome, None when
    the data plane raised, and the keys in the order of its transfers)."""

    complete: Callable[[int, int], None]  # (index, layer)
    landed: Callable[[list[str]], None]
    ended: Callable[[int, TransferOutcome | None, list[str]], None]
    observe_seconds: Callable[[float], None] | None = None  # the batch's wall time, when it ends


class LoadBatch:
    """The loads one ``start_layer_wise_loading`` started, behind one counter index: a layer
    completes once every load of the batch landed it; any failure fails the index."""

    def __init__(self, hooks: LoadBatchHooks, index: int, num_layers: int,
                 loads: list[tuple[SyncLoad, list[str]]]) -> None:
        self.hooks = hooks
        self.index = index
        self.loads = loads
        self._lock = threading.Lock()
        self._waiting: dict[int, int] = collections.defaultdict(int)  # layer -> loads still landing it
        self._t0 = time.perf_counter()
        for load, _ in loads:
            for layer in load.layer_ids:
                self._waiting[layer] += 1
        self._open = len(self._waiting)  # layers some load still has to land
        with self._lock:  # layers no load feeds (a load without a state) need nothing
            for layer in range(num_layers):
                if layer not in self._waiting:
                    hooks.complete(index, layer)
        for load, keys in loads:
            for layer in load.layer_ids:
                load.layer(layer).add_done_callback(functools.partial(self._layer, layer))
            load.result.add_done_callback(functools.partial(self._ended, keys))

    def _layer(self, layer: int, future: concurrent.futures.Future[bool]) -> None:
        if not future.result():
            return  # the load failed: _ended fails the index
        with self._lock:
            self._waiting[layer] -= 1
            if self._waiting[layer] == 0:
                self._open -= 1
                if self._open == 0:  # every load landed whole: remembered before SGLang can insert
                    self.hooks.landed([k for _, keys in self.loads for k in keys])
                self.hooks.complete(self.index, layer)

    def _ended(self, keys: list[str], future: concurrent.futures.Future[TransferOutcome]) -> None:
        try:
            outcome: TransferOutcome | None = future.result()
        except Exception as exc:  # a bug in the data plane: fail the load, never hang it
            log.error("HylinkerLinker load raised: %r", exc)
            outcome = None
        if self.hooks.observe_seconds is not None:
            self.hooks.observe_seconds(time.perf_counter() - self._t0)
        self.hooks.ended(self.index, outcome, keys)


def retrieve(future: concurrent.futures.Future[Any]) -> None:
    """A done callback for a future nobody awaits: its exception is retrieved, never logged as
    unhandled."""
    if not future.cancelled():
        future.exception()


__all__ = ["AllEvents", "LoadBatch", "LoadBatchHooks", "retrieve"]
