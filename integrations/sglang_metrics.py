"""Prometheus metrics of the SGLang plugin, on SGLang's own ``/metrics``.

SGLang keeps its metrics as ``prometheus_client`` objects in the scheduler process and exports
them through a multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``, set by the server when
``--enable-metrics`` is on): the HTTP process reads every process's files. The linker lives in
the scheduler process, so the families below, created there, appear on that endpoint beside
SGLang's ``sglang:*`` metrics. Without ``--enable-metrics`` nothing is created (one log line).

The families and their labels are listed in the README (SGLang section, "Metrics"); every one
carries a ``tp_rank`` label.

Byte, verification and store figures are cumulative statistics of the data plane; they are
published as counter increments at most once a second (:meth:`LinkerMetrics.publish`), from the
scheduler's per-round ``num_completed_offloads`` call and at close.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "sglang:hylinker_"
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: the store retry rule's statistics (``ResilienceStatistics`` fields) -> ``event`` label
STORE_EVENTS = {"retries": "retry", "timeouts": "timeout", "breaker_trips": "breaker_trip",
                "rejected_calls": "rejected"}
_families: dict[int, dict[str, Any]] = {}  # per registry: created once per process
_families_lock = threading.Lock()


def _make_families(registry: Any) -> dict[str, Any]:
    from prometheus_client import Counter, Histogram

    def counter(name: str, doc: str, *labels: str) -> Any:
        return Counter(PREFIX + name, doc, ["tp_rank", *labels], registry=registry)

    return {
        "lookups": counter("lookups", "Lookups by outcome.", "outcome"),
        "hit_tokens": counter("hit_tokens", "Tokens the store could restore."),
        "loads": counter("loads", "Loads by outcome.", "outcome"),
        "offloads": counter("offloads", "Offloads by outcome.", "outcome"),
        "skipped": counter("objects_skipped", "Objects not written again.", "reason"),
        "bad_removed": counter("bad_objects_removed", "Damaged objects removed from the store."),
        "bytes": counter("bytes", "Object bytes moved (payload and frame header).", "pool", "direction"),
        "verify_failures": counter("verify_failures", "Objects that did not verify.", "pool"),
        "rereads": counter("rereads", "Objects read again after a failed verification, by outcome.",
                           "pool", "outcome"),
        "store_events": counter("store_events", "Retries, timeouts and breaker trips.", "event"),
        "load_seconds": Histogram(PREFIX + "load_seconds", "Load batch latency.", ["tp_rank"],
                                  buckets=_BUCKETS, registry=registry),
        "offload_seconds": Histogram(PREFIX + "offload_seconds", "Offload latency.", ["tp_rank"],
                                     buckets=_BUCKETS, registry=registry),
    }


class LinkerMetrics:
    """One linker's metrics (its ``tp_rank`` label) over the process's families.

    Every method is safe from any thread and never raises: a metric that fails to record is
    logged once and the linker goes on (a request never fails for a metric).
    """

    def __init__(self, families: Mapping[str, Any], tp_rank: int, interval_s: float = 1.0) -> None:
        self._f = families
        self._rank = str(tp_rank)
        self._interval_s = interval_s
        self._last_publish = 0.0
        self._published: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()
        self._broken = False

    @classmethod
    def create(cls, enabled: bool, tp_rank: int, registry: Any = None) -> LinkerMetrics | None:
        """The metrics, or None when SGLang's metrics are off or ``prometheus_client`` cannot be
        used (both logged once). ``registry``: default, prometheus_client's global registry."""
        if not enabled:
            log.info("HylinkerLinker: SGLang metrics are off (--enable-metrics): no hylinker metrics")
            return None
        try:
            import prometheus_client

            reg = registry if registry is not None else prometheus_client.REGISTRY
            with _families_lock:
                families = _families.get(id(reg))
                if families is None:
                    families = _families[id(reg)] = _make_families(reg)
        except Exception as exc:  # missing package, a name registered by someone else
            log.warning("HylinkerLinker: no metrics (%r)", exc)
            return None
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ and registry is None:
            log.info("HylinkerLinker: PROMETHEUS_MULTIPROC_DIR is unset; metrics stay in this process")
        return cls(families, tp_rank)

    def _safely(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            if not self._broken:
                self._broken = True
                log.warning("HylinkerLinker: a metric failed to record (%r); later failures are not logged", exc)

    def count(self, family: str, n: float = 1, **labels: str) -> None:
        self._safely(lambda: self._f[family].labels(tp_rank=self._rank, **labels).inc(n))

    def observe(self, family: str, seconds: float) -> None:
        self._safely(lambda: self._f[family].labels(tp_rank=self._rank).observe(seconds))

    def publish(self, totals: Callable[[], Mapping[tuple[str, ...], int]], *, force: bool = False) -> None:
        """Add what the cumulative ``totals`` grew by since the last publish, at most once per
        interval (or now, with ``force``). ``totals`` maps ``(family, *label values)`` to a
        running total; its label values are the family's labels after ``tp_rank``."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_publish < self._interval_s:
                return
            self._last_publish = now

            def push() -> None:
                for key, total in totals().items():
                    grown = int(total) - self._published.get(key, 0)
                    if grown > 0:
                        family, *values = key
                        self._f[family].labels(self._rank, *values).inc(grown)
                        self._published[key] = int(total)

            self._safely(push)


__all__ = ["PREFIX", "STORE_EVENTS", "LinkerMetrics"]
