"""``linker_extra_config`` of :class:`hylinker.integrations.sglang.HylinkerLinker`.

The keys every engine plugin takes (:class:`~hylinker.integrations.config.PluginConfig`: store,
master, segment_mb, capacity_mb, salt, faults, ...) plus what SGLang's life cycle needs: how
hard a load retries a store that fails transiently (a failed load aborts the request in
SGLang) and how long one store transfer may take. ``store`` may also be ``"umbp"`` (AMD mori).
Every key is checked at startup by the one shared parser: an unknown key, a wrong type or an
impossible value is a :class:`LinkerConfigError` naming the key, raised from the linker's
constructor.

This module imports neither SGLang nor a store client, so it can be checked anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from ...runtime.dataplane.host_staging import check_optional_budget, physical_memory_bytes
from ...stores.resilient import ResiliencePolicy
from ..config import TRACE_ENV, PluginConfig, PluginConfigError, range_validators

#: the error the SGLang plugin's config raises (the shared parser's)
LinkerConfigError = PluginConfigError

_positive, _non_negative = range_validators(PluginConfigError)
_BUDGET_KEY = "host_staging_bytes"
#: the least derived host staging budget: twice a small pool's bytes fills at once behind a store
#: that lags (docs/figures/sglang-pool.md: 0.31 MiB refused 51 offloads, 16 MiB none, peak 0.73)
HOST_STAGING_FLOOR_MB = 64


def _budget(inst: Any, attr: Any, value: Any) -> None:
    """The data plane's rule for a host staging budget (``runtime/dataplane/host_staging.py``)."""
    try:
        check_optional_budget(f"[{attr.name!r}]", value)
    except ValueError as exc:
        raise PluginConfigError(str(exc)) from None


@attrs.frozen
class SGLangLinkerConfig(PluginConfig):
    """The SGLang plugin's settings; build with :meth:`from_extra_config`."""

    stores: ClassVar[tuple[str, ...]] = ("embedded", "mooncake", "umbp")
    mooncake_detect_exists: ClassVar[bool] = False  # one master round trip less per put

    load_retries: int = attrs.field(default=3, validator=_non_negative)  # retries of a transient store error
    retry_backoff_ms: float = attrs.field(default=20.0, validator=_non_negative)  # first backoff, doubles
    store_timeout_s: float = attrs.field(default=5.0, validator=_positive)  # longest one store transfer
    touch: bool = True  # refresh store recency of prefixes that hit
    #: the longest the scheduler thread waits on the store's lookups in one scheduler round,
    #: all lookups together (each also within ``lookup_timeout_s``); once spent, the round's
    #: further lookups are misses at once (``lookups_over_budget``)
    lookup_budget_s: float = attrs.field(default=1.0, validator=_positive)
    #: offloads accepted and not yet reported back to SGLang (each keeps its node's rows
    #: locked), and at most half the state pool's slots; beyond it ``offload`` refuses (SGLang
    #: unlocks the node, which stays on the device unpersisted and is offered again on its next hit)
    offload_max_inflight: int = attrs.field(default=256, validator=_positive)
    #: the same bound on the payload bytes those offloads name (one offload alone may pass it)
    offload_max_inflight_mb: int = attrs.field(default=2048, validator=_positive)
    #: the longest close() takes, all of it: writes in flight get ``drain_timeout_s`` but at
    #: most 0.6 of it, then frames still waiting for their put are dropped (counted), and the
    #: store's shutdown and the data plane's close share the rest; SGLang kills a scheduler
    #: still closing 15 s after its shutdown request
    close_timeout_s: float = attrs.field(default=8.0, validator=_positive)
    #: offload in two stages (docs/design/host-staging.md): SGLang's node is reported back, as
    #: not stored (its device rows and state slot unlock), once its bytes are sealed in host
    #: staging, and the frames drain to the store after; the node is marked stored when SGLang
    #: offers it again after the store acknowledged it. Off: the node stays locked until the
    #: store answered
    two_stage_offload: bool = True
    #: the host staging budget in bytes (None: the data plane's default, twice the pools' bytes
    #: and at most a quarter of the host's memory, raised to 64 MiB, capped at
    #: ``offload_max_inflight_mb``); a full budget refuses the offload (``offloads_refused_staging``)
    host_staging_bytes: int | None = attrs.field(default=None, validator=_budget)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *,
                          where: str = "linker_extra_config") -> SGLangLinkerConfig:
        budget = None
        if isinstance(extra, Mapping) and _BUDGET_KEY in extra:  # an int or None: not the parser's str rule
            extra = dict(extra)
            budget = extra.pop(_BUDGET_KEY)
        config = super().from_extra_config(extra, where=where)
        assert isinstance(config, SGLangLinkerConfig)
        if budget is None:
            return config
        try:
            return attrs.evolve(config, host_staging_bytes=budget)
        except PluginConfigError as exc:
            raise PluginConfigError(f"{where}{exc}") from None

    def derived_staging_bytes(self, derived: int) -> int:
        """The host staging budget when ``host_staging_bytes`` is None: the data plane's
        ``derived`` (twice the pools' bytes), at least :data:`HOST_STAGING_FLOOR_MB` (at most a
        quarter of the host's memory), at most ``offload_max_inflight_mb``."""
        floor = HOST_STAGING_FLOOR_MB << 20
        quarter = physical_memory_bytes() // 4
        if quarter > 0:
            floor = min(floor, quarter)
        return min(max(derived, floor), self.offload_max_inflight_mb << 20)

    def resilience(self) -> ResiliencePolicy:
        """The store's one retry rule (``stores/resilient.py``) from these keys: every store
        call of a load or offload is retried per key on transient outcomes, ``load_retries``
        times, and ends within ``store_timeout_s``."""
        backoff = self.retry_backoff_ms / 1e3
        return ResiliencePolicy(attempts=self.load_retries + 1, backoff_s=backoff,
                                backoff_max_s=max(backoff * 8, 0.1), call_timeout_s=self.store_timeout_s,
                                deadline_s=self.store_timeout_s)


__all__ = ["TRACE_ENV", "LinkerConfigError", "SGLangLinkerConfig"]
