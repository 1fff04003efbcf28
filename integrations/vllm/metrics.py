"""Metrics of the vLLM connector, through vLLM's connector-stats path.

vLLM moves connector figures from the engine to its frontend itself: each step the worker's
``get_kv_connector_stats()`` (and the scheduler's) returns a :class:`HylinkerStats` whose
``data`` is plain and serializable; vLLM merges the TP ranks' and the scheduler's with
:meth:`HylinkerStats.aggregate`, sends the result to the frontend, where
:class:`HylinkerPromMetrics` (built by the connector's ``build_prom_metrics``) adds it to
Prometheus families on vLLM's own ``/metrics``, and its periodic stats log prints
:meth:`HylinkerStats.reduce` ("KV Transfer metrics: ...").

The families are hylinker's one set (:mod:`hylinker.runtime.dataplane.metrics`), named ``vllm:hylinker_*``
with vLLM's per-engine labels (``model_name``, ``engine``) first. What each side reports:

* scheduler: lookups by outcome, store hit tokens, loads refused (``loads{outcome="refused"}``);
* worker: loads and offloads by outcome, objects and bytes moved per pool, verification and
  store failures, damaged objects removed, skipped writes, queue depth (staging occupancy),
  store retries/timeouts/breaker, load and offload latencies.

The worker keeps running totals and sends what they grew by since its last report
(:class:`~hylinker.runtime.dataplane.metrics.Increments`), so a report is never counted twice; latencies
travel as lists of seconds. Merging: counters add, latency lists join, gauges take the largest
(the fullest rank, a breaker open on any rank).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ...runtime.dataplane.metrics import (
    FAMILY,
    LATENCY_BUCKETS,
    Figures,
    Increments,
    Naming,
    plane_figures,
    split,
    store_figures,
    store_identity_figures,
)
from ...runtime.dataplane.plane import DataPlane
from ...stores.resilient import CircuitBreaker, ResilientStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .pages import PageTransfers

log = logging.getLogger(__name__)
VLLM = Naming("vllm:hylinker_")
_SEP = "|"
#: the connector's scheduler counters -> metric keys
SCHEDULER_FIGURES = {
    "lookup_hits": ("lookups", "hit"),
    "lookup_errors": ("lookups", "error"),
    "requests_unkeyable": ("lookups", "unkeyable"),  # served without the store (request_keys)
    "hit_tokens": ("hit_tokens", "store"),
    "loads_refused": ("loads", "refused"),
}
#: ``PageTransfers`` counters -> metric keys
WORKER_FIGURES = {
    "loads_ok": ("loads", "ok"),
    "loads_failed": ("loads", "failed"),
    "saves_ok": ("offloads", "ok"),
    "saves_failed": ("offloads", "failed"),
    "saves_skipped": ("objects_skipped", "host_staging_full"),
    "objects_removed": ("bad_objects_removed",),
    "objects_rewritten": ("bad_objects_kept", "rewritten"),
    "objects_kept": ("bad_objects_kept", "unproven"),
}
#: the families vLLM's frontend registers (the Linker's agreement, decline and stored-token figures are not here)
VLLM_KEYS = ("lookups", "hit_tokens", "loads", "offloads", "objects_skipped", "bad_objects_removed", "bad_objects_kept",
             "bytes",
             "objects", "verify_failures", "rereads", "staging_restores", "transfer_failures", "queue_depth", "load_seconds",
             "offload_seconds",
             "store_events", "breaker_open", "info", "store_bytes", "store_objects", "store_capacity_bytes")


def _key(figure: tuple[str, ...]) -> str:
    return _SEP.join(figure)


@dataclass
class HylinkerStats(KVConnectorStats):
    """``data``: ``{"counter": {"family|label..": n}, "gauge": {...: v}, "histogram": {...: [s]}}``."""

    def __post_init__(self) -> None:
        for kind in ("counter", "gauge", "histogram"):
            self.data.setdefault(kind, {})

    def reset(self) -> None:
        fresh: dict[str, Any] = {"counter": {}, "gauge": {}, "histogram": {}}
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, HylinkerStats) or other.is_empty():
            return self
        for k, v in other.data["counter"].items():
            self.data["counter"][k] = self.data["counter"].get(k, 0) + v
        for k, v in other.data["gauge"].items():
            self.data["gauge"][k] = max(v, self.data["gauge"].get(k, v))
        for k, v in other.data["histogram"].items():
            self.data["histogram"].setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in self.data["counter"].items():
            out[f"hylinker_{k}"] = v
        for k, v in self.data["histogram"].items():
            out[f"hylinker_{k}_count"] = len(v)
            out[f"hylinker_{k}_avg_ms"] = round(1e3 * sum(v) / len(v), 3) if v else 0.0
        return out

    def is_empty(self) -> bool:
        return not (self.data["counter"] or self.data["gauge"] or self.data["histogram"])


class StatsReporter:
    """One connector instance's side of the stats path: its running totals become a
    :class:`HylinkerStats` of what grew since the last report (None: nothing new)."""

    def __init__(self) -> None:
        self._increments = Increments()
        self._gauges: dict[str, float] = {}  # bounded: one per gauge series (fixed label values)
        # bounded: the latencies between two reports; report() starts a fresh one
        self._seconds: dict[str, list[float]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self._watched: set[int] = set()  # bounded: the data planes watched (one per worker)
        self._sent: set[tuple[str, ...]] = set()  # counters reported at least once

    def watch(self, plane: DataPlane) -> None:
        """Record ``plane``'s load and offload latencies (once per plane)."""
        if id(plane) not in self._watched:
            self._watched.add(id(plane))
            plane.observers.append(self._observe)

    def _observe(self, direction: str, seconds: float, ok: bool) -> None:
        with self._lock:
            self._seconds[f"{direction}_seconds"].append(seconds)

    def report(self, totals: Figures) -> HylinkerStats | None:
        counters, gauges = split(totals)
        stats = HylinkerStats()
        # a counter seen for the first time travels even at 0: its series exists from the start
        stats.data["counter"] = {_key(k): 0 for k in counters.keys() - self._sent}
        self._sent.update(counters)
        stats.data["counter"].update({_key(k): v for k, v in self._increments.take(counters).items()})
        for k, v in gauges.items():
            if self._gauges.get(_key(k)) != v:  # a gauge travels when it changed
                stats.data["gauge"][_key(k)] = self._gauges[_key(k)] = v
        with self._lock:
            stats.data["histogram"], self._seconds = dict(self._seconds), collections.defaultdict(list)
        return None if stats.is_empty() else stats


def scheduler_totals(counters: dict[str, int]) -> Figures:
    out: Figures = {fig: counters.get(name, 0) for name, fig in SCHEDULER_FIGURES.items()}
    out["lookups", "miss"] = counters.get("lookups", 0) - counters.get("lookup_hits", 0) - counters.get(
        "lookup_errors", 0)
    return out


def worker_totals(counters: dict[str, int], planes: list[DataPlane]) -> Figures:
    """The worker's figures: its counters and every data plane's (per pool, summed)."""
    out: Figures = {fig: counters.get(name, 0) for name, fig in WORKER_FIGURES.items()}
    for plane in planes:
        for k, v in plane_figures(plane.pool_statistics()).items():
            out[k] = out.get(k, 0) + v
    if planes and isinstance(planes[0].store, ResilientStore):  # one store under both planes
        out.update(store_figures(planes[0].store.resilience()))
    if planes:
        out.update(store_identity_figures(planes[0].store, planes[0].config.integrity.value))
    return out


def breaker_figures(breaker: CircuitBreaker) -> Figures:
    """The scheduler's probe breaker (``StoreHost``): its trips and refused probes, open or not."""
    return {("store_events", "breaker_trip"): breaker.counts["breaker_trips"],
            ("store_events", "rejected"): breaker.counts["rejected_calls"],
            ("breaker_open",): 0 if breaker.state == "closed" else 1}


def report(reporter: StatsReporter, counters: dict[str, int], transfers: PageTransfers | None,
           breaker: CircuitBreaker | None = None) -> HylinkerStats | None:
    """One connector instance's report: the worker's (it has ``transfers``) or the scheduler's
    (with its store host's probe ``breaker``)."""
    if transfers is not None:
        return reporter.report(worker_totals(dict(transfers.counters), [transfers.engine_plane, transfers.staging_plane]))
    totals = scheduler_totals(counters)
    if breaker is not None:
        totals.update(breaker_figures(breaker))
    return reporter.report(totals)


class HylinkerPromMetrics(KVConnectorPromMetrics):
    """The frontend's families (``vllm:hylinker_*``), fed the merged stats of every step."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}  # bounded: VLLM_KEYS's families
        self._unknown: set[str] = set()  # families reported but not registered (logged once each)
        for key in VLLM_KEYS:
            f = FAMILY[key]
            kwargs: dict[str, Any] = {"name": VLLM.name(f), "documentation": f.doc,
                                      "labelnames": [*labelnames, *f.labels]}
            if f.kind == "counter":
                self._families[key] = self._counter_cls(**kwargs)
            elif f.kind == "gauge":
                self._families[key] = self._gauge_cls(**kwargs)
            else:
                self._families[key] = self._histogram_cls(buckets=list(LATENCY_BUCKETS), **kwargs)

    def _child(self, key: str, engine_idx: int) -> Any:
        family, *labels = key.split(_SEP)
        metric = self._families.get(family)
        if metric is None:  # a figure without a family here: never a reason to fail a step
            if family not in self._unknown:
                self._unknown.add(family)
                log.warning("hylinker: vLLM stats carry %r, which has no family here; not exported", family)
            return None
        return metric.labels(*self.per_engine_labelvalues[engine_idx], *labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, n in transfer_stats_data.get("counter", {}).items():
            child = self._child(key, engine_idx)  # made at 0 when first reported
            if child is not None and n > 0:
                child.inc(n)
        for key, v in transfer_stats_data.get("gauge", {}).items():
            child = self._child(key, engine_idx)
            if child is not None:
                child.set(v)
        for key, seconds in transfer_stats_data.get("histogram", {}).items():
            child = self._child(key, engine_idx)
            for s in seconds if child is not None else ():
                child.observe(s)


__all__ = ["VLLM", "VLLM_KEYS", "HylinkerPromMetrics", "HylinkerStats", "StatsReporter", "breaker_figures", "report", "scheduler_totals",
           "worker_totals"]
