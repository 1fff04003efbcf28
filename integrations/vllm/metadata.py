"""What the vLLM connector's scheduler side hands its workers each step, what the workers report
back, and what the scheduler remembers of each request (``HylinkerConnector``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .index import RankReport
from .plan import BlockKeys, TransferPlan

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class HylinkerConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side."""

    loads: list[TransferPlan] = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)  # promised loads that cannot run
    saves: list[TransferPlan] = field(default_factory=list)
    # no request computes in this step (vLLM steps while requests wait for their loads): the worker
    # may block briefly on its loads in flight instead of returning to an empty step loop
    idle: bool = False


@dataclass
class HylinkerWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's reports of the worker ranks' stores, for the scheduler's index."""

    reports: tuple[RankReport, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HylinkerWorkerMetadata)
        return HylinkerWorkerMetadata(self.reports + other.reports)


@dataclass
class Tracked:
    """Scheduler-side state of one request."""

    request: Request
    keys: BlockKeys  # the request's own keys: its tokens and vLLM's extra keys (request_keys)
    saved_blocks: int = 0  # attention blocks below this are stored, restored or the engine's own hit
    stored_states: set[int] = field(default_factory=set)  # boundaries (in blocks) stored or restored


__all__ = ["HylinkerConnectorMetadata", "HylinkerWorkerMetadata", "Tracked"]
