"""The vLLM connector's device path: vLLM's KV cache in CUDA memory.

A worker whose KV cache lives on a CUDA device moves its pages through the data plane's device
transfers (``runtime/dataplane/device.py``, ``device_transfers.py``) and never with a blocking
copy on the engine's stream:

* save (in ``wait_for_save``, after the step's forward was queued): an event is recorded on the
  engine's stream (the forward's writes); the connector's own copy stream waits for it *on the
  device* and copies the offered pages into pinned staging slots, then records its own event.
  The engine's stream waits for that event on the device, so no later forward (the next step
  may hand the same blocks to another request) writes a block before its bytes left it; the host
  never blocks. The staging data plane reads the slots only once the copy event completed (its
  ``fence``), then seals and writes them off the step as on the CPU path;
* load (``start_load_kv``): the engine plane's pool actors (device pools: a copy stream each,
  pinned staging, the device checksum) write no row before an event recorded on the engine's
  stream completed, and report a request's blocks landed only after its copies completed and
  every object verified; only then does ``get_finished`` tell vLLM the request may run.

The frames written are the CPU path's (staged host bytes, XXH3 at ``checksum``), so an engine on
the CPU and one on a GPU read each other's objects.

:class:`DevicePages` is the seam: :func:`cuda_pages` drives a real copy stream and CUDA events;
tests build one from ``hylinker.testing.fakes.FakeDeviceCopies`` and fake events over CPU
tensors standing in for device memory, so the ordering rules are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import torch

from ...components.layout import PoolKind
from ...runtime.dataplane.device import CudaCopies, DeviceCopies
from ...runtime.dataplane.events import DeviceEvent


@attrs.frozen
class DevicePages:
    """How one worker's device pages are fenced and copied (see the module docstring).

    ``copies``: the save copies' stream, its events and pinned staging. ``engine_fence``: an
    event after the engine's work queued so far. ``copy_after(ev)``: the copy stream waits for
    ``ev`` on the device. ``engine_after(ev)``: the engine's stream waits for ``ev`` on the
    device. ``load_copies``: the engine plane's copy engine per pool (``None``: the data plane's
    default, a CUDA stream per pool actor).
    """

    copies: DeviceCopies
    engine_fence: Callable[[], DeviceEvent]
    copy_after: Callable[[DeviceEvent], None]
    engine_after: Callable[[DeviceEvent], None]
    load_copies: Mapping[PoolKind, DeviceCopies] | None = None

    def staging(self, page_bytes: Sequence[int], slots: int) -> list[torch.Tensor]:
        """``[slots, page]`` pinned staging per raw tensor."""
        return [self.copies.staging(slots * p).view(slots, p) for p in page_bytes]

    def copy_out(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DeviceEvent:
        """Queue ``dst.copy_(src)`` for every pair on the copy stream after the engine's work so
        far; the engine's later work waits for it. Returns the copies' event."""
        fence = self.engine_fence()
        with self.copies.on_stream():
            self.copy_after(fence)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = self.copies.record()
        self.engine_after(done)
        return done


def _cuda_event(ev: DeviceEvent) -> torch.cuda.Event:
    if not isinstance(ev, torch.cuda.Event):
        raise TypeError(f"a CUDA stream waits for a torch.cuda.Event, got {type(ev).__name__}")
    return ev


def cuda_pages(device: torch.device) -> DevicePages:
    """The real device path on ``device``: a copy stream of its own, CUDA events, pinned staging."""
    copies = CudaCopies(device)

    def engine_fence() -> DeviceEvent:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev

    def copy_after(ev: DeviceEvent) -> None:
        copies.stream.wait_event(_cuda_event(ev))

    def engine_after(ev: DeviceEvent) -> None:
        torch.cuda.current_stream(device).wait_event(_cuda_event(ev))

    return DevicePages(copies, engine_fence, copy_after, engine_after)


def device_pages_for(raws: Sequence[torch.Tensor]) -> DevicePages | None:
    """The device path for pages on a CUDA device; ``None`` for host pages (the CPU path)."""
    devices = {r.device for r in raws}
    if len(devices) != 1:
        raise ValueError(f"vLLM's KV cache tensors lie on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cuda":
        return cuda_pages(device)
    return None


__all__ = ["DevicePages", "cuda_pages", "device_pages_for"]
