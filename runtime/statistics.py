"""Frozen statistics objects: every queue, actor and the linker exposes one."""

from __future__ import annotations

import attrs


@attrs.frozen
class QueueStatistics:
    """A bounded job queue of one pool actor."""

    depth: int  # jobs queued or in progress
    max_depth: int  # bound on queued jobs
    waiting_senders: int  # submitters blocked on a full queue
    completed: int
    failed: int


@attrs.frozen
class PoolActorStatistics:
    pool: str
    offload_queue: QueueStatistics
    load_queue: QueueStatistics
    objects_offloaded: int
    objects_already_stored: int
    bytes_offloaded: int
    offload_failures: int
    objects_loaded: int
    bytes_loaded: int
    load_misses: int
    load_failures: int
    verify_failures: int
    pending_states: int  # MAMBA states held by queued or in-flight offloads
    rereads_recovered: int = 0  # objects that failed verification, then verified when read again
    rereads_failed: int = 0  # ...and failed again: the stored object is bad (counted in verify_failures)
    held_arena_bytes: int = 0  # registered frames for verify-all loads (0 until the first one)
    held_arena_growths: int = 0  # times a larger verify-all load grew it


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
    offloads_skipped: int  # MAMBA backpressure rule
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
    bad_objects_removed: int = 0  # objects that failed to restore, removed so they are rewritten
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
