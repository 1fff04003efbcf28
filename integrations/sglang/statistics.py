"""What :meth:`HylinkerLinker.statistics` answers: one frozen snapshot. Imports no SGLang."""

from __future__ import annotations

import attrs

#: the plugin's own counters (``HylinkerLinker._count``); every other field is summed or copied
COUNTERS = ("lookups", "lookup_hits", "lookup_misses", "lookup_errors", "lookups_breaker_open",
            "lookups_over_budget", "hit_tokens", "touches",
            "objects_skipped_restored", "loads_refused", "load_batches", "loads_ok", "loads_failed",
            "loads_cancelled", "bad_objects_removed", "bad_objects_rewritten", "failed_objects_kept", "offloads_ok",
            "offloads_failed", "offloads_refused", "offloads_refused_staging", "offloads_abandoned_at_close")
#: summed over the data plane's pools (``PoolActorStatistics``)
POOL_SUMS = ("objects_offloaded", "bytes_offloaded", "objects_already_stored", "objects_loaded",
             "bytes_loaded", "load_misses", "verify_failures", "offload_failures", "rereads_recovered",
             "rereads_failed", "staging_restores", "staging_verify_failures")
#: copied from the store wrapper (``ResilienceStatistics``), each as ``store_<name>``
STORE_COUNTS = ("retries", "retried_keys", "recovered_keys", "exhausted_keys", "timeouts", "cancelled",
                "breaker_trips", "rejected_calls")


@attrs.frozen
class SGLangLinkerStatistics:
    """The plugin's counters, the data plane's per-pool transfers summed over pools, and the
    store's retry rule; a snapshot."""

    # the plugin's own
    lookups: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0
    lookup_errors: int = 0  # lookups that failed or passed lookup_timeout_s: misses
    lookups_breaker_open: int = 0  # misses at once: the store's circuit breaker was open
    lookups_over_budget: int = 0  # misses at once: the round's lookup_budget_s was spent
    hit_tokens: int = 0  # store-restorable tokens offered to SGLang
    touches: int = 0
    objects_skipped_restored: int = 0  # objects a load just restored, not offloaded again
    loads_refused: int = 0  # malformed or unservable loads refused before anything moved
    load_batches: int = 0  # start_layer_wise_loading calls that started loads
    loads_ok: int = 0
    loads_failed: int = 0
    loads_cancelled: int = 0
    bad_objects_removed: int = 0  # objects a load proved bad (verification failed after the re-read), removed
    bad_objects_rewritten: int = 0  # proved bad, but the store held another object by the removal: kept
    failed_objects_kept: int = 0  # did not land, not proved bad (failed / timed-out read): left in the store
    offloads_ok: int = 0
    offloads_failed: int = 0
    offloads_refused: int = 0  # refused at the in-flight bound (offload_max_inflight[_mb])
    #: two stages: accepted, then reported False because host staging could not take its frames
    #: (``host_staging_full``); the node unlocks unstored and is offered again on its next hit
    offloads_refused_staging: int = 0
    #: two stages: puts still at the store when close() gave up waiting (``close_timeout_s``):
    #: never marked stored by this linker (the put may still land in the store)
    offloads_abandoned_at_close: int = 0
    # the in-flight bound's state: offloads accepted and not yet reported back to SGLang
    offloads_in_flight: int = 0
    offload_bytes_in_flight: int = 0  # payload bytes they name
    offloads_in_flight_peak: int = 0  # the most at once since start
    offload_bytes_in_flight_peak: int = 0
    # host staging (two stages; all 0 in one stage): the budget, bytes held now, the most held
    # at once, frames dropped unput at close
    host_staging_capacity_bytes: int = 0
    host_staging_used_bytes: int = 0
    host_staging_peak_bytes: int = 0
    host_staging_dropped_objects: int = 0
    # the touched, registered memory frames are cut from: its blocks' bytes, and offloads whose
    # frames were fresh memory instead (the region at the budget or fragmented)
    host_staging_region_bytes: int = 0
    host_staging_frames_outside: int = 0
    # summed over the data plane's pools
    objects_offloaded: int = 0
    bytes_offloaded: int = 0
    objects_already_stored: int = 0
    objects_loaded: int = 0
    bytes_loaded: int = 0
    load_misses: int = 0
    verify_failures: int = 0
    offload_failures: int = 0
    rereads_recovered: int = 0
    rereads_failed: int = 0
    staging_restores: int = 0  # two stages: objects a load copied from a frame still draining to the store
    staging_verify_failures: int = 0  # such frames that failed their check: dropped, read from the store
    # the store wrapper's
    store_retries: int = 0
    store_retried_keys: int = 0
    store_recovered_keys: int = 0
    store_exhausted_keys: int = 0
    store_timeouts: int = 0
    store_cancelled: int = 0  # store calls a lookup gave up on (count toward the breaker)
    store_breaker_trips: int = 0
    store_rejected_calls: int = 0


#: copied from the data plane's host staging (``HostStaging.figures``)
STAGING_FIGURES = ("host_staging_capacity_bytes", "host_staging_used_bytes", "host_staging_peak_bytes",
                   "host_staging_dropped_objects", "host_staging_region_bytes", "host_staging_frames_outside")

__all__ = ["COUNTERS", "POOL_SUMS", "STAGING_FIGURES", "STORE_COUNTS", "SGLangLinkerStatistics"]
