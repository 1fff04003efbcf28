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
    #: objects a load copied from a draining host-staging frame (counted in objects_loaded too)
    staging_restores: int = 0
    #: draining frames that failed verification: dropped from the index, the load fell back to the store
    staging_verify_failures: int = 0
    staging_frames: int = 0  # objects in draining frames a load can restore from now


@attrs.frozen
class DataPlaneStatistics:
    """A data plane's transfers by outcome and its existence checks (a snapshot); per pool, see
    ``pool_statistics()``. A load or offload counted in ``loads``/``offloads`` at submission
    ends in exactly one of ok, failed or cancelled once it has run (until then in none)."""

    loads: int  # loads submitted
    loads_ok: int
    loads_failed: int
    loads_cancelled: int  # cancelled before or while they ran
    offloads: int  # offloads submitted
    offloads_ok: int
    offloads_failed: int
    exists_calls: int
    exists_errors: int  # existence checks the store could not answer (a lookup that misses)
    offloads_refused_staging: int = 0  # offloads refused: the host staging budget was full


@attrs.frozen
class Backpressure:
    """What an offload's backpressure reads from a data plane (a snapshot,
    ``DataPlane.backpressure()``): nothing else of the data plane's insides."""

    pending_states: int  # MAMBA states held by queued or in-flight offloads (0: no MAMBA pool)
    latency_ema_ms: float  # the store-latency EMA every store call feeds
    dropping: bool  # the EMA is past the high watermark and not yet below the low one
    breaker_open: bool  # the store's circuit breaker is open (False: the store has none)
