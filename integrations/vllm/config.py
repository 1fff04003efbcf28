"""``kv_connector_extra_config`` of :class:`hylinker.integrations.vllm.HylinkerConnector`.

The keys every engine plugin takes (:class:`~hylinker.integrations.config.PluginConfig`) plus
``fault_rank``: the tensor-parallel rank whose store the ``faults`` plan wraps (``-1``, the
default: every rank's and the scheduler's), so a test can damage one rank's objects, or make one
rank's store die mid-run (``faults: "fail_calls=N-1000000000,scheduled=unavailable"``: every call
from the N-th on raises), and not the others'.

This module imports neither vLLM nor a store client, so it can be checked anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..config import PluginConfig, PluginConfigError


@attrs.frozen
class VllmConnectorConfig(PluginConfig):
    """The vLLM connector's settings; build with :meth:`from_extra_config`."""

    fault_rank: int = -1  # the TP rank whose store `faults` wraps; -1: every rank

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *,
                          where: str = "kv_connector_extra_config") -> VllmConnectorConfig:
        config = super().from_extra_config(extra, where=where)
        assert isinstance(config, VllmConnectorConfig)
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
