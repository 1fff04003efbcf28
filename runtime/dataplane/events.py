"""Device events as awaitables.

The engine hands hylinker a *fence*: something with ``query() -> bool`` that becomes true when
the device work writing (or reading) a pool's rows is done — a ``torch.cuda.Event`` (CUDA and
HIP builds alike) or a test double. :func:`wait_fence` polls it with exponential backoff so the
event loop never blocks. ``None`` means "already complete" (CPU tensors). A fence whose
``query`` raises is a :class:`FenceError`: an error, never a miss.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import anyio
import torch


class FenceError(RuntimeError):
    """A device fence failed (the device reported an error)."""


@runtime_checkable
class DeviceEvent(Protocol):
    def query(self) -> bool: ...


async def wait_fence(
    fence: DeviceEvent | None,
    *,
    first_poll_s: float = 20e-6,
    max_poll_s: float = 2e-3,
    timeout_s: float | None = None,
) -> None:
    """Wait until ``fence`` completes without blocking the loop.

    A fence still pending after ``timeout_s`` is a :class:`FenceError` too: a pool actor must
    not stall forever behind a device that never answers.
    """
    if fence is None:
        return
    delay = first_poll_s
    try:
        with anyio.fail_after(timeout_s):  # None: no deadline
            while True:
                try:
                    done = fence.query()
                except Exception as exc:  # the device said no
                    raise FenceError(f"device fence failed: {exc}") from exc
                if done:
                    return
                await anyio.sleep(delay)
                delay = min(delay * 2, max_poll_s)
    except TimeoutError:
        raise FenceError(f"device fence still pending after {timeout_s} s") from None


def record_fence(device: torch.device) -> DeviceEvent | None:
    """A fence for work queued so far on ``device``'s current stream (``None`` on CPU)."""
    if device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev
    return None
