"""Stores: the async batch protocol, object framing and the backends."""

from .base import (
    GetResult,
    Outcome,
    Store,
    StoreCapabilities,
    StoreClosedError,
    StoreError,
    StoreStatistics,
    StoreUnavailableError,
)
from .framing import FrameError, FrameFault
from .resilient import ResiliencePolicy, ResilienceStatistics, ResilientStore

__all__ = [
    "FrameError",
    "FrameFault",
    "GetResult",
    "Outcome",
    "ResiliencePolicy",
    "ResilienceStatistics",
    "ResilientStore",
    "Store",
    "StoreCapabilities",
    "StoreClosedError",
    "StoreError",
    "StoreStatistics",
    "StoreUnavailableError",
]
