"""The linker's frozen statistics and the metric figures read from them."""

from __future__ import annotations

import attrs

from ..dataplane.metrics import Figures


@attrs.frozen
class LinkerStatistics:
    requests: int
    lookups: int
    lookup_prompt_tokens: int
    device_hit_tokens: int
    store_hit_tokens: int  # tokens restored from the store (committed loads)
    loads: int
    load_misses: int  # PREPARE could not allocate: plain miss
    commits: int
    dropped_loads: int  # data failed (missing, corrupt, store error): recomputed
    aborts: int
    inserts: int
    offloads: int
    offloads_skipped_mamba: int  # MAMBA backpressure rule
    offloads_dropped: int  # latency watermark
    offload_failures: int
    touches: int
    touch_keys: int
    verifications: int
    verify_failures: int
    store_latency_ema_ms: float
    dropping: bool
    offloads_skipped_kv: int = 0  # KV backpressure: offload backlog would lock too much of the pool
    offloads_verified_replicas: int = 0  # replicated pools another rank writes, checked in the store
    bad_objects_removed: int = 0  # objects a load proved bad (verification failed after the re-read), removed
    bad_objects_rewritten: int = 0  # proved bad, but the store held another object by the removal: kept
    failed_objects_kept: int = 0  # did not land, not proved bad (failed / timed-out read): left in the store
    close_timeouts: int = 0  # close() gave up waiting for offloads and cut the store's retries
    touch_calls: int = 0  # store.touch calls (touches are batched into these)
    partial_loads: int = 0  # loads that restored a shorter prefix than found (some objects failed)
    partial_pages_lost: int = 0  # pages those loads could not keep
    offloads_skipped_breaker: int = 0  # the store's circuit breaker was open
    rank_shortened_lookups: int = 0  # lookups another rank cut short (agreement across ranks)
    rank_shortened_loads: int = 0  # loads another rank cut short, or dropped
    rank_unsettled_offloads: int = 0  # offload parts left unstored: another rank lacks its part
    lookup_hits: int = 0  # lookups that found device or store tokens
    declined_lookups: int = 0  # lookups whose store hit was declined: recompute was cheaper
    declined_hit_tokens: int = 0  # store hit tokens those lookups gave up
    decline_probes: int = 0  # hits taken though declined, after decline_probe_every declines in a row
    stored_tokens: int = 0  # prompt tokens whose KV pages an offload settled as stored
    load_waits: int = 0  # loads that found no free pages and waited for them (LinkerConfig.load_wait_s)
    load_waits_recomputed: int = 0  # of those, the wait ended without pages (limit, nothing left to free): a miss
    offloads_skipped_staging: int = 0  # two-stage offload: the host staging budget was full
    offloads_waited_kv: int = 0  # two stages: offloads that waited for copies in flight (KV backpressure)
    #: objects loads copied from host-staging frames still draining to the store (the data plane's count)
    staging_restores: int = 0


#: the fields the Linker reads elsewhere than from its counters (the data plane's latency
#: monitor, the touch batcher, the data plane's pool actors)
_NOT_COUNTED = frozenset({"store_latency_ema_ms", "dropping", "touch_calls", "staging_restores"})
#: the Linker's counters: every other field, in field order
COUNTERS: tuple[str, ...] = tuple(f.name for f in attrs.fields(LinkerStatistics) if f.name not in _NOT_COUNTED)


def linker_figures(s: LinkerStatistics, agreement_rounds: int) -> Figures:
    """The Linker's request figures (its data plane publishes the data path's)."""
    return {
        ("lookups", "hit"): s.lookup_hits,  # device or store tokens found
        ("lookups", "miss"): s.lookups - s.lookup_hits,
        ("hit_tokens", "device"): s.device_hit_tokens,
        ("hit_tokens", "store"): s.store_hit_tokens,
        ("declined_hit_tokens",): s.declined_hit_tokens,
        ("stored_tokens",): s.stored_tokens,
        ("load_waits", "served"): s.load_waits - s.load_waits_recomputed,
        ("load_waits", "recomputed"): s.load_waits_recomputed,
        ("objects_skipped", "mamba_backpressure"): s.offloads_skipped_mamba,
        ("objects_skipped", "kv_backpressure"): s.offloads_skipped_kv,
        ("objects_skipped", "store_latency"): s.offloads_dropped,
        ("objects_skipped", "breaker_open"): s.offloads_skipped_breaker,
        ("objects_skipped", "host_staging_full"): s.offloads_skipped_staging,
        ("bad_objects_removed",): s.bad_objects_removed,
        ("bad_objects_kept", "rewritten"): s.bad_objects_rewritten,
        ("bad_objects_kept", "unproven"): s.failed_objects_kept,
        ("agreement_rounds",): agreement_rounds,
        ("rank_disagreements", "lookup"): s.rank_shortened_lookups,
        ("rank_disagreements", "load"): s.rank_shortened_loads,
        ("rank_disagreements", "offload"): s.rank_unsettled_offloads,
    }
