"""Runtime knobs, validated up front."""

from __future__ import annotations

import attrs

from ...stores.config_rules import non_negative, number_rule, positive, share
from ...stores.framing import Integrity
from ...stores.resilient import ResiliencePolicy
from ..dataplane.host_staging import optional_budget

_positive = positive()
_share = share()


_size = number_rule(at_least=0, integer=True)


def _integrity(value: Integrity | str) -> Integrity:
    return Integrity.parse(value, "LinkerConfig.integrity")


@attrs.frozen
class LinkerConfig:
    """How the runtime behaves; every field has a production default."""

    #: jobs each pool actor queues per direction before submitters wait
    queue_depth: int = attrs.field(default=64, validator=_positive)
    #: host staging bytes per pool actor and direction (at least one object is always kept)
    staging_bytes_per_pool: int = attrs.field(default=16 << 20, validator=_positive)
    #: worker threads for gather/scatter copies
    copy_threads: int = attrs.field(default=2, validator=_positive)
    #: host sub-batches up to this many bytes are copied on the event loop (no thread hop)
    inline_copy_bytes: int = attrs.field(default=4 << 20, validator=_positive)
    #: write new nodes through to the store after insert
    offload: bool = True
    #: skip an offload that carries a state while queued states hold >= this share of the pool
    mamba_backpressure: bool = True
    mamba_backpressure_share: float = attrs.field(default=0.75, validator=_share)  # that share, in (0, 1]
    #: drop offloads while the store latency EMA is above ``latency_high_ms``, until below low
    latency_high_ms: float = attrs.field(default=250.0, validator=_positive)
    latency_low_ms: float = attrs.field(default=50.0, validator=_positive)  # offloads resume below this EMA
    #: send TOUCH for a device-hit node at most once per interval
    touch: bool = True
    touch_interval_s: float = attrs.field(default=5.0, validator=_positive)  # that interval
    #: after an offload settles, TOUCH what its path already held in the store, so a path's
    #: prefix is never older than its tail in the store's own recency (runtime/linker/offload_room.py)
    touch_on_offload: bool = True
    #: a device fence still pending after this long fails its offload (FenceError)
    fence_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    #: objects per page/state, each holding a run of layers: a load lands (and reports) the
    #: first group's layers before later groups arrive (``runtime/dataplane/plane.py``)
    layer_groups: int = attrs.field(default=1, validator=_positive)
    #: let a scatter-gather store read/write host pool rows in place (no staging copy)
    in_place: bool = True
    #: ...for objects of at least this many payload bytes; smaller ones go staged (0: all)
    in_place_min_bytes: int = attrs.field(default=256 << 10, validator=_size)
    #: look up the store on admission
    store_lookup: bool = True
    #: retries, timeouts and the circuit breaker every store call goes through
    #: (``stores.resilient``); None talks to the store directly
    resilience: ResiliencePolicy | None = attrs.field(factory=ResiliencePolicy)
    #: skip an offload while pages locked by queued offloads would pass this share of the KV pool
    #: *and* the pages free or evictable have fallen below that share, or below the largest
    #: request seen if that is more (KV backpressure; docs/design/phases.md §3)
    kv_backpressure_share: float = attrs.field(default=0.125, validator=_share)
    #: two stages: an offload the KV rule would skip first waits up to this long for the copies in
    #: flight to give their pages back (``offloads_waited_kv``); 0: skip at once
    kv_backpressure_wait_s: float = attrs.field(default=1.0, validator=non_negative())
    #: ``close()`` waits this long for queued offloads before it stops the store's retries and
    #: cancels calls still in flight (after ``resilience.close_grace_s``)
    close_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    #: a load that finds no free pages (rows, a state slot) waits up to this long for them while
    #: offloads in flight or other requests hold pages that will come back, instead of recomputing
    #: a prefix whose prefill would need the same pages; past it the load is a plain miss
    #: (``load_waits_recomputed``). 0: never wait (docs/design/phases.md, "LOAD")
    load_wait_s: float = attrs.field(default=1.0, validator=non_negative())
    #: a hybrid load also reads up to this many states at shallower boundaries the probe found,
    #: so a failed object above one of them still leaves that prefix restorable
    fallback_states: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    #: offload in two stages (docs/design/host-staging.md): a node's rows are unlocked once
    #: copied into sealed host frames, and the node is marked stored at the store's answer;
    #: off: the node stays locked until the store answers
    two_stage_offload: bool = True
    #: the byte budget of those host frames (None: twice the bytes of the pools, at most a
    #: quarter of the host's memory; ``runtime/dataplane/host_staging.py``). A full budget skips
    #: the offload (``offloads_skipped_staging``)
    host_staging_bytes: int | None = attrs.field(default=None, validator=optional_budget)
    #: TOUCH batches: how long the toucher waits to gather touches into one call
    touch_batch_s: float = attrs.field(default=0.005, validator=_positive)
    #: what a stored object's frame proves: ``"checksum"`` (header and a payload checksum) or
    #: ``"header"`` (key, layout, length; no payload hash); ``DataPlaneConfig.integrity``
    integrity: Integrity = attrs.field(default=Integrity.CHECKSUM, converter=_integrity)
    #: the checkpoint served (a local directory or a hub name; None: the layout's
    #: ``model_name``), fingerprinted once at start-up into every key (``components/identity.py``)
    model_path: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.instance_of(str)))
    #: the operator's name for the weights served, also in every key: change it to retire every
    #: stored object of the model (e.g. after an update in place the fingerprint cannot see)
    model_revision: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    #: restores that pay for themselves (``runtime/dataplane/restore_cost.py``): a lookup declines a store
    #: hit whose load, at the bandwidth observed so far, would take longer than ``restore_margin``
    #: times recomputing its tokens. Off by default
    decline_slow_restores: bool = False
    #: the engine's prefill rate, tokens per second (None: what ``Linker.observe_prefill`` saw)
    prefill_tokens_per_s: float | None = attrs.field(
        default=None, validator=positive(optional=True))
    restore_margin: float = attrs.field(default=1.0, validator=_positive)  # load time / recompute time above which a hit is declined
    #: after this many declines in a row the next store hit is taken anyway (a probe): the
    #: bandwidth is measured only by loads, so without probes an estimate made while the store was
    #: slow would decline every later hit even after the store recovered
    decline_probe_every: int = attrs.field(default=16, validator=attrs.validators.ge(1))

    def __attrs_post_init__(self) -> None:
        if self.latency_low_ms > self.latency_high_ms:
            raise ValueError(
                f"LinkerConfig.latency_low_ms={self.latency_low_ms} exceeds "
                f"latency_high_ms={self.latency_high_ms}")
