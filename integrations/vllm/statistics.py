"""What the vLLM connector's ``statistics()`` answer: frozen snapshots. Imports no vLLM."""

from __future__ import annotations

from typing import Any

import attrs

#: the scheduler side's counters (``HylinkerConnector.counters``)
SCHEDULER_COUNTERS = ("lookups", "lookup_hits", "lookup_errors", "hit_tokens", "loads_planned", "loads_refused",
                      "kv_saves_planned", "state_saves_planned", "requests_unkeyable")
#: the worker side's counters (``PageTransfers.counters``)
TRANSFER_COUNTERS = ("loads", "loads_ok", "loads_failed", "saves", "saves_ok", "saves_failed", "saves_skipped",
                     "objects_saved", "objects_loaded", "objects_from_staging", "objects_removed", "objects_rewritten", "objects_kept")


@attrs.frozen
class PageTransferStatistics:
    """A worker's loads and saves between vLLM's pages and the store; a snapshot."""

    loads: int = 0  # load plans started
    loads_ok: int = 0
    loads_failed: int = 0  # failed or timed out: vLLM recomputes the request
    saves: int = 0  # save plans started
    saves_ok: int = 0
    saves_failed: int = 0
    saves_skipped: int = 0  # the host staging budget was full (reason host_staging_full): not saved
    objects_saved: int = 0
    objects_loaded: int = 0
    objects_from_staging: int = 0  # loaded from the staging slot of this rank's save in flight, not the store
    objects_removed: int = 0  # objects a load proved bad (verification failed after the re-read), removed
    objects_rewritten: int = 0  # proved bad, but the store held another object by the removal: kept
    objects_kept: int = 0  # did not land, not proved bad (failed / timed-out read): left in the store


@attrs.frozen
class VLLMConnectorStatistics(PageTransferStatistics):
    """One connector instance's counters: the scheduler's (lookups, plans) and, on a worker, its page
    transfers'. Each counter lives on one side; the other side reads 0."""

    lookups: int = 0
    lookup_hits: int = 0
    lookup_errors: int = 0  # lookups that failed or timed out: misses
    hit_tokens: int = 0  # store-restorable tokens offered to vLLM beyond its own cache
    loads_planned: int = 0
    loads_refused: int = 0  # loads refused before anything moved
    kv_saves_planned: int = 0
    state_saves_planned: int = 0
    requests_unkeyable: int = 0  # requests served without the store (no key for their extra inputs)


def counted(counters: dict[str, int], names: tuple[str, ...]) -> dict[str, Any]:
    """The named counters out of a counter dict (every name must be there)."""
    return {name: counters[name] for name in names}


__all__ = ["SCHEDULER_COUNTERS", "TRANSFER_COUNTERS", "PageTransferStatistics", "VLLMConnectorStatistics",
           "counted"]
