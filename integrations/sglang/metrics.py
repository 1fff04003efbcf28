"""Prometheus metrics of the SGLang plugin, on SGLang's own ``/metrics``.

SGLang keeps its metrics as ``prometheus_client`` objects in the scheduler process and exports
them through a multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``, set by the server when
``--enable-metrics`` is on): the HTTP process reads every process's files. The linker lives in
the scheduler process, so the families, created there, appear on that endpoint beside SGLang's
``sglang:*`` metrics. Without ``--enable-metrics`` nothing is created (one log line).

The families are hylinker's one set (:mod:`hylinker.runtime.dataplane.metrics`, listed in the README,
"Metrics"), named ``sglang:hylinker_*``, each with a ``tp_rank`` label. They are made once per
process and shared by its ranks' linkers.

Byte, verification and store figures are cumulative statistics of the data plane; they are
published as counter increments at most once a second (:meth:`Exporter.publish`), from the
scheduler's per-round ``num_completed_offloads`` call and at close (another process scrapes
the files, so a scrape cannot ask for a publish).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from ...runtime.dataplane.metrics import FAMILIES, Exporter, Naming

log = logging.getLogger(__name__)

SGLANG = Naming("sglang:hylinker_", ("tp_rank",))
#: the families the plugin records (the Linker's agreement, decline and stored-token figures are not its)
SGLANG_KEYS = tuple(f.key for f in FAMILIES if f.key not in (
    "agreement_rounds", "rank_disagreements", "declined_hit_tokens", "stored_tokens"))
#: the plugin's counters that are also Prometheus metrics: counter -> (family, labels)
METRIC_OF: dict[str, tuple[str, ...]] = {
    "lookup_hits": ("lookups", "hit"),
    "lookup_misses": ("lookups", "miss"),
    "lookup_errors": ("lookups", "error"),
    "hit_tokens": ("hit_tokens", "store"),
    "loads_ok": ("loads", "ok"),
    "loads_failed": ("loads", "failed"),
    "loads_cancelled": ("loads", "cancelled"),
    "loads_refused": ("loads", "refused"),
    "offloads_ok": ("offloads", "ok"),
    "offloads_failed": ("offloads", "failed"),
    "offloads_refused": ("offloads", "refused"),
    "offloads_refused_staging": ("objects_skipped", "host_staging_full"),
    "objects_skipped_restored": ("objects_skipped", "restored"),
    "bad_objects_removed": ("bad_objects_removed",),
    "bad_objects_rewritten": ("bad_objects_kept", "rewritten"),
    "failed_objects_kept": ("bad_objects_kept", "unproven"),
}


def create_metrics(enabled: bool, tp_rank: int, figures: Callable[[], Mapping[tuple[str, ...], float]],
                   registry: Any = None) -> Exporter | None:
    """The rank's metrics, or None when SGLang's metrics are off or ``prometheus_client``
    cannot be used (both logged once). ``registry``: default, prometheus_client's global one."""
    if not enabled:
        log.info("HylinkerLinker: SGLang metrics are off (--enable-metrics): no hylinker metrics")
        return None
    try:
        import prometheus_client
    except ImportError as exc:
        log.warning("HylinkerLinker: no metrics (%r)", exc)
        return None
    reg = registry if registry is not None else prometheus_client.REGISTRY
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ and registry is None:
        log.info("HylinkerLinker: PROMETHEUS_MULTIPROC_DIR is unset; metrics stay in this process")
    return Exporter.create(reg, SGLANG, SGLANG_KEYS, who="HylinkerLinker", base_values=(str(tp_rank),),
                           figures=figures, shared=True)


__all__ = ["METRIC_OF", "SGLANG", "SGLANG_KEYS", "create_metrics"]
