"""Host staging: the byte budget of the two-stage offload and the frames it holds while they drain.

An offload in two stages (``docs/design/host-staging.md`` §4e) first copies its objects from the
pool's rows into sealed frames of its own in host memory (stage 1, ``runtime/dataplane/drain_route.py``),
after which the rows are free again, then puts those frames to the store at the store's pace
(stage 2). :class:`HostStaging` is the one budget every pool actor of a data plane shares: a
submission's frames are charged when it is planned (``DataPlane.prepare_offload``) and released
when the store answered or the frames were dropped. A submission the budget cannot take is
refused (:class:`HostStagingFullError`), so the caller skips the offload and counts it.

The budget's default (:func:`derive_budget`) is twice the bytes of the pools the data plane
offloads (SGLang HiCache's ``--hicache-ratio 2``), capped at a quarter of the host's physical
memory, and never below one object of every pool (the smallest offload there is).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ...stores.config_rules import number_check, owner_field

if TYPE_CHECKING:
    from .frame_region import FrameRegion


class HostStagingFullError(RuntimeError):
    """The host staging budget cannot take this offload's frames now: skip it."""


def physical_memory_bytes() -> int:
    """The host's physical memory in bytes (0 where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def derive_budget(pool_bytes: int, smallest: int, physical: int | None = None) -> int:
    """The default budget: ``2 × pool_bytes``, at most a quarter of ``physical`` memory (the
    host's when None), at least ``smallest`` (one object of every pool)."""
    physical = physical_memory_bytes() if physical is None else physical
    budget = 2 * pool_bytes
    if physical > 0:
        budget = min(budget, physical // 4)
    return max(budget, smallest)


def check_budget(field: str, value: Any, smallest: int, physical: int | None = None) -> int:
    """``value`` as a budget in bytes, or ``ValueError`` naming ``field``: an int (not a bool,
    NaN or a float) > 0 (``stores/config_rules.number_check``), at least ``smallest`` (one object
    of every pool: a budget below it could take no offload at all) and at most the host's
    physical memory."""
    wrong = _bytes_rule(value)
    if wrong is not None:
        raise ValueError(f"{field} {wrong}")
    if value < smallest:
        raise ValueError(f"{field} must be at least {smallest} bytes (one object of every pool), got {value!r}")
    physical = physical_memory_bytes() if physical is None else physical
    if physical > 0 and value > physical:
        raise ValueError(f"{field}={value} exceeds the host's physical memory ({physical} bytes)")
    return int(value)


_bytes_rule = number_check(above=0, integer=True)


def check_optional_budget(field: str, value: Any) -> None:
    """The part of :func:`check_budget` a config can check before it knows the pools: None, or
    a positive int no larger than the host's memory."""
    if value is not None:
        check_budget(field, value, 1)


def optional_budget(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """:func:`check_optional_budget` as an attrs validator naming ``Owner.field`` (the
    ``host_staging_bytes`` of ``LinkerConfig``, ``DataPlaneConfig`` and the plugins' configs)."""
    check_optional_budget(owner_field(instance, attribute), value)


def staging_for(field: str, value: Any, pools: Sequence[tuple[int, int]]) -> HostStaging:
    """The budget of a data plane whose pools hold ``pools[i] = (objects, staged bytes per
    object)``: ``value`` checked (:func:`check_budget`, naming ``field``), or derived when None."""
    smallest = sum(per for _, per in pools)
    total = sum(n * per for n, per in pools)
    staging = HostStaging(derive_budget(total, smallest) if value is None else check_budget(field, value, smallest))
    staging.floor = smallest
    return staging


class HostStaging:
    """The byte budget of host staging and what it has seen. See the module doc."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.floor = 1  # the smallest budget that can take an offload (one object of every pool)
        self.used = 0  # bytes charged by submissions whose store answer has not come
        self.peak = 0
        self.charged = 0  # submissions charged
        self.refused = 0  # submissions the budget could not take
        self.dropped_objects = 0  # frames dropped unput (the plane was told to drop them)
        #: stage 2 stops putting: queued frames end as failed, counted (``DataPlane.drop_staged``)
        self.dropping = False
        #: the touched, registered memory the frames are cut from (``frame_region.py``; the data plane sets it)
        self.region: FrameRegion | None = None

    def try_charge(self, nbytes: int) -> bool:
        """Charge ``nbytes`` if the budget has room for them (False: it has not; nothing charged)."""
        if self.used + nbytes > self.capacity:
            self.refused += 1
            return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self.charged += 1
        return True

    def cap(self, limit: int) -> None:
        """Lower the capacity to ``limit`` bytes, never below :attr:`floor` (a derived budget
        under a user's bound: the SGLang plugin's ``offload_max_inflight_mb``)."""
        self.capacity = max(self.floor, min(self.capacity, limit))

    def hold(self, nbytes: int) -> None:
        """Keep ``nbytes`` charged past their submission's end: frames a load still reads
        (``runtime/dataplane/frame_index.py``); released by :meth:`release` at the last unpin."""
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, "host staging released more bytes than it charged"

    def figures(self) -> dict[str, int]:
        out = {"host_staging_capacity_bytes": self.capacity, "host_staging_used_bytes": self.used,
               "host_staging_peak_bytes": self.peak, "host_staging_refused": self.refused,
               "host_staging_dropped_objects": self.dropped_objects}
        if self.region is not None:
            out.update(self.region.figures())
        return out


__all__ = ["HostStaging", "HostStagingFullError", "check_budget", "check_optional_budget", "derive_budget",
           "physical_memory_bytes", "staging_for"]
