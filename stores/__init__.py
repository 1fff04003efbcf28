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

__all__ = [
    "FrameError",
    "FrameFault",
    "GetResult",
    "Outcome",
    "Store",
    "StoreCapabilities",
    "StoreClosedError",
    "StoreError",
    "StoreStatistics",
    "StoreUnavailableError",
]
