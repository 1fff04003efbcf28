"""``kv_connector_extra_config`` of :class:`hylinker.integrations.vllm.HylinkerConnector`.

The keys every engine plugin takes (:class:`~hylinker.integrations.config.PluginConfig`) plus
``fault_rank``: the tensor-parallel rank whose store the ``faults`` plan wraps (``-1``, the
default: every rank's and the scheduler's), so a test can damage one rank's objects, or make one
rank's store die mid-run (``faults: "fail_calls=N-1000000000,scheduled=unavailable"``: every call
from the N-th on raises), and not the others'; and ``host_staging_bytes``: the byte budget of each
worker's host staging, where saves wait for the store (``docs/design/host-staging.md``; None, the
default: derived, twice the bytes of vLLM's pages, at most a quarter of the host's memory, at
least one step's saves); a save is skipped only when it is full. It replaces ``staging_mb`` here.

This module imports neither vLLM nor a store client, so it can be checked anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ...runtime.dataplane.host_staging import check_optional_budget
from ..config import PluginConfig, PluginConfigError


@attrs.frozen
class VllmConnectorConfig(PluginConfig):
    """The vLLM connector's settings; build with :meth:`from_extra_config`."""

    fault_rank: int = -1  # the TP rank whose store `faults` wraps; -1: every rank
    #: bytes of host staging per worker, where saves wait for the store (a save is skipped only when it is full);
    #: None: twice vLLM's pages, at most a quarter of host memory. vLLM ignores `staging_mb`
    host_staging_bytes: int | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *,
                          where: str = "kv_connector_extra_config") -> VllmConnectorConfig:
        budget = None
        if isinstance(extra, Mapping) and "host_staging_bytes" in extra:
            # an int or None, which the shared parser (types from the defaults) cannot say
            extra = dict(extra)
            budget = extra.pop("host_staging_bytes")
            try:
                check_optional_budget(f"{where}['host_staging_bytes']", budget)
            except ValueError as exc:
                raise PluginConfigError(str(exc)) from None
        config = super().from_extra_config(extra, where=where)
        assert isinstance(config, VllmConnectorConfig)
        if budget is not None:
            config = attrs.evolve(config, host_staging_bytes=budget)
        if config.fault_rank < -1:
            raise PluginConfigError(f"{where}['fault_rank'] must be a rank or -1, got {config.fault_rank}")
        return config

    def for_rank(self, rank: int) -> VllmConnectorConfig:
        """The settings of rank ``rank``'s store: without the fault plan unless it is that rank's."""
        if self.fault_rank in (-1, rank):
            return self
        return attrs.evolve(self, faults="")

    def for_scheduler(self) -> VllmConnectorConfig:
        """The settings of the scheduler side's store (its probe of a shared store): without the
        fault plan when the plan names one rank (that rank's store dies, not the scheduler's)."""
        if self.fault_rank == -1:
            return self
        return attrs.evolve(self, faults="")


__all__ = ["VllmConnectorConfig"]
