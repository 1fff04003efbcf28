"""The data plane's configuration (``DataPlaneConfig``; ``LinkerConfig`` carries the same fields)."""

from __future__ import annotations

import attrs

from ...stores import framing
from ...stores.config_rules import number_rule, positive
from .host_staging import optional_budget


def _integrity(value: framing.Integrity | str) -> framing.Integrity:
    return framing.Integrity.parse(value, "DataPlaneConfig.integrity")


_positive = positive()
_count = number_rule(above=0, integer=True)  # an int > 0 (the counts above keep the float-tolerant rule LinkerConfig has)
_bytes = number_rule(at_least=0, integer=True)  # an int >= 0 (0: the field's documented default)


@attrs.frozen
class DataPlaneConfig:
    """The data path's knobs (``LinkerConfig`` carries the same fields for the Linker)."""

    queue_depth: int = attrs.field(default=64, validator=_positive)  # jobs each pool queues per direction before submitters wait
    staging_bytes_per_pool: int = attrs.field(default=16 << 20, validator=_positive)  # host staging per pool and direction
    copy_threads: int = attrs.field(default=2, validator=_positive)  # threads for gather/scatter copies
    inline_copy_bytes: int = attrs.field(default=4 << 20, validator=_positive)  # host sub-batches up to this size copy on the loop
    fence_timeout_s: float = attrs.field(default=60.0, validator=_positive)  # an offload fence pending longer fails the offload
    latency_high_ms: float = attrs.field(default=250.0, validator=_positive)  # store latency EMA watermarks (LatencyMonitor)
    latency_low_ms: float = attrs.field(default=50.0, validator=_positive)  # the low watermark (offloads resume below it)
    layer_groups: int = attrs.field(default=1, validator=_count)  # objects per page/state, each a run of layers (see module doc)
    #: let a scatter-gather store read/write host pool rows in place (checksums over the rows)
    in_place: bool = True
    #: ...but only objects of at least this many payload bytes; smaller ones go staged, where
    #: per-object work (buffer checks, piece views, one streaming hash each) would dominate
    #: (docs/figures/data-path.md, "Data plane: in place vs staged"); 0 moves every size in place
    in_place_min_bytes: int = attrs.field(default=256 << 10, validator=_bytes)
    #: staging per pool for verify-all loads (a whole load is held there until it verified),
    #: allocated and registered with the store at start; 0: ``staging_bytes_per_pool``,
    #: allocated on the first verify-all load.
    verify_all_staging_bytes: int = attrs.field(default=0, validator=_bytes)
    #: a verify-all load larger than that arena grows it (registered, kept for later loads)
    #: up to this many bytes per pool; a load larger still gets fresh, unregistered memory
    verify_all_staging_max_bytes: int = attrs.field(default=1 << 30, validator=_bytes)
    #: what a frame proves about its payload: ``"checksum"`` (header and an XXH3-64 of the
    #: payload) or ``"header"`` (header only: key, layout, length; no pass over the payload).
    #: Objects are read by what their header says (``stores/framing.py``, "Integrity levels")
    integrity: framing.Integrity = attrs.field(default=framing.Integrity.CHECKSUM, converter=_integrity)
    #: offload in two stages (docs/design/host-staging.md): rows → sealed host frames, then
    #: frames → store; the rows are free once copied (``OffloadTicket.copied``). Off: an offload
    #: reads its rows until the store answered
    two_stage_offload: bool = False
    #: the byte budget of those frames (None: twice the pools' bytes, at most a quarter of the
    #: host's memory; ``runtime/dataplane/host_staging.py``); a full budget refuses an offload
    host_staging_bytes: int | None = attrs.field(default=None, validator=optional_budget)
