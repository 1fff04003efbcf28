"""Device copies for pools that live on an accelerator (CUDA and HIP builds of torch alike).

A pool actor moves a device pool's objects through pinned host staging, on its *own copy
stream*, never on the engine's compute stream:

* offload — the actor first waits for the engine's fence (the forward that wrote the rows is
  done), then gathers the rows device → pinned staging on the copy stream, records an event
  and waits for it before a single staged byte is sealed or put;
* load — the verified payload is scattered pinned staging → device rows on the copy stream;
  the actor records an event and reports the objects (and their layers) landed only after
  that event completed, and before the staging buffer is reused.

Because "landed" is reported after the device copy finished, the forward can read the rows
as soon as ``wait_layer`` returns, with no cross-stream wait of its own.

:class:`DeviceCopies` is the seam: :class:`CudaCopies` drives real streams and events;
``hylinker.testing.fakes.FakeDeviceCopies`` stands in on machines without a GPU (events that
complete when a test says so), so the ordering rules are tested everywhere; the ``cuda``
pytest marker runs the real path when a GPU is present.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from .events import DeviceEvent


@runtime_checkable
class DeviceCopies(Protocol):
    """Where an actor's device copies run, and how it learns they finished."""

    def on_stream(self) -> contextlib.AbstractContextManager[None]:
        """Make the copy stream current (for the calling thread) while the block runs."""
        ...

    def record(self) -> DeviceEvent:
        """An event that completes when every copy queued on the copy stream so far is done."""
        ...

    def staging(self, nbytes: int) -> torch.Tensor:
        """A host staging buffer the device can copy to and from asynchronously (pinned)."""
        ...


class CudaCopies:
    """A dedicated CUDA stream per actor; pinned staging; events recorded on that stream."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaCopies needs a cuda device, got {device}")
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def _stream(self) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def on_stream(self) -> contextlib.AbstractContextManager[None]:
        return self._stream()

    def record(self) -> DeviceEvent:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8).pin_memory()


def copies_for(device: torch.device) -> DeviceCopies | None:
    """The copy engine for pools on ``device``: ``None`` for host pools (plain memcpy)."""
    if device.type == "cuda":
        return CudaCopies(device)
    return None


__all__ = ["CudaCopies", "DeviceCopies", "copies_for"]
