"""The data plane's configuration (``DataPlaneConfig``; ``LinkerConfig`` carries the same fields)."""

from __future__ import annotations

import attrs

from ...stores import framing
from ...stores.config_rules import positive
from .host_staging import check_optional_budget


def _integrity(value: framing.Integrity | str) -> framing.Integrity:
    return framing.Integrity.parse(value, "DataPlaneConfig.integrity")


_positive = positive()


@attrs.frozen
class DataPlaneConfig:
    """The data path's knobs (``LinkerConfig`` carries the same fields for the Linker)."""

    queue_depth: int = 64  # jobs each pool queues per direction before submitters wait
    staging_bytes_per_pool: int = 16 << 20  # host staging per pool and direction
    copy_threads: int = 2  # threads for gather/scatter copies
    inline_copy_bytes: int = 4 << 20  # host sub-batches up to this size copy on the loop
    fence_timeout_s: float = attrs.field(default=60.0, validator=_positive)  # an offload fence pending longer fails the offload
    latency_high_ms: float = attrs.field(default=250.0, validator=_positive)  # store latency EMA watermarks (LatencyMonitor)
    latency_low_ms: float = attrs.field(default=50.0, validator=_positive)  # the low watermark (offloads resume below it)
    layer_groups: int = 1  # objects per page/state, each a run of layers (see module doc)
    #: let a scatter-gather store read/write host pool rows in place (checksums over the rows)
    in_place: bool = True
    #: ...but only objects of at least this many payload bytes; smaller ones go staged, where
    #: per-object work (buffer checks, piece views, one streaming hash each) would dominate
    #: (docs/figures/data-path.md, "Data plane: in place vs staged"); 0 moves every size in place
    in_place_min_bytes: int = 256 << 10
    #: staging per pool for verify-all loads (a whole load is held there until it verified),
    #: allocated and registered with the store at start; 0: ``staging_bytes_per_pool``,
    #: allocated on the first verify-all load.
    verify_all_staging_bytes: int = 0
    #: a verify-all load larger than that arena grows it (registered, kept for later loads)
    #: up to this many bytes per pool; a load larger still gets fresh, unregistered memory
    verify_all_staging_max_bytes: int = 1 << 30
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
    host_staging_bytes: int | None = None

    def __attrs_post_init__(self) -> None:
        for f in attrs.fields(DataPlaneConfig):
            if f.name in ("in_place", "integrity", "two_stage_offload"):
                continue
            if f.name == "host_staging_bytes":
                check_optional_budget("DataPlaneConfig.host_staging_bytes", self.host_staging_bytes)
                continue
            if f.name in ("in_place_min_bytes", "verify_all_staging_bytes", "verify_all_staging_max_bytes"):
                v = getattr(self, f.name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"DataPlaneConfig.{f.name} must be an int >= 0, got {v!r}")
                continue
            if f.validator is None:  # the float fields carry the shared rule themselves
                _positive(self, f, getattr(self, f.name))
        if not isinstance(self.layer_groups, int):
            raise ValueError(f"DataPlaneConfig.layer_groups must be an int, got {self.layer_groups!r}")
