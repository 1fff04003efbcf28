"""Test doubles for the runtime: device fences, a clock, a gated store, synthetic content.

* :class:`FakeDeviceEvent` — a fence that completes after ``polls`` queries, on
  :meth:`~FakeDeviceEvent.set`, or fails (its ``query`` raises) after :meth:`~FakeDeviceEvent.fail`.
* :class:`FakeClock` — a manual clock for :class:`~hylinker.runtime.dataplane.store_calls.LatencyMonitor`;
  :func:`attach_clock` puts one under a running :class:`~hylinker.runtime.linker.facade.Linker`.
* :class:`GatedStore` — wraps any store; holds put/get calls until released, or lets them
  through at most one per ``drain_interval_s``; records every call's keys.
* :class:`SyntheticContent` — deterministic KV, draft and state content derived from page
  keys, so every restored byte can be checked; :func:`synthetic_prefill` plays the forward of
  one request (extend, working state, checkpoint, insert).
* :func:`small_hybrid_layout` — a tiny hybrid layout (MLA-like KV, two linear layers, a
  draft layer) for tests.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import anyio
import attrs
import numpy as np
import torch

from ..components.layout import MambaLayerSpec, ModelLayout, PoolKind
from ..runtime.dataplane.events import DeviceEvent
from ..runtime.dataplane.store_calls import LatencyMonitor
from ..runtime.linker.facade import Linker, Request
from ..stores.base import (
    GetResult,
    Outcome,
    Store,
    StoreCapabilities,
    StoreStatistics,
    supports_checksums,
    supports_rows,
    supports_scatter,
)
from ..stores.faulty import FaultyStore
from ..stores.resilient import ResilientStore
from ..stores.rows import CODE, RowBatch, RowResults
from .content import SyntheticContent

# ---- device fences ---------------------------------------------------------------------------


class FakeDeviceEvent:
    """A device fence double.

    ``polls``: ``query()`` answers False this many times, then True (``None``: never, until
    :meth:`set`). ``error``: every ``query()`` raises it (as a failed CUDA event would).
    """

    def __init__(self, polls: int | None = 0, *, error: BaseException | str | None = None) -> None:
        if polls is not None and polls < 0:
            raise ValueError(f"polls must be >= 0 or None, got {polls}")
        self.polls = polls
        self.queries = 0
        self._set = False
        self._error: BaseException | None = None
        if error is not None:
            self.fail(error)

    def query(self) -> bool:
        self.queries += 1
        if self._error is not None:
            raise self._error
        if self._set:
            return True
        return self.polls is not None and self.queries > self.polls

    def set(self) -> None:
        """Complete the fence now."""
        self._set = True

    def fail(self, error: BaseException | str = "device error") -> None:
        """Make every later ``query()`` raise ``error``."""
        self._error = RuntimeError(error) if isinstance(error, str) else error

    @property
    def done(self) -> bool:
        return self._error is None and (
            self._set or (self.polls is not None and self.queries > self.polls))


class FakeDeviceCopies:
    """A device copy engine double (``runtime.dataplane.device.DeviceCopies``) for host tensors.

    The copies themselves run at once (CPU), through the device code path (indexing ops, not
    memcpy); what is simulated is their *completion*: every :meth:`record` returns a
    :class:`FakeDeviceEvent` that completes only when the test calls :meth:`complete` (or at
    once with ``auto=True``). ``log`` lists ``"stream"`` (a block on the copy stream began)
    and ``"record"`` in order, and ``on_stream_ops`` counts records made on the stream.
    """

    def __init__(self, *, auto: bool = False) -> None:
        self.auto = auto
        self.events: list[FakeDeviceEvent] = []
        self.log: list[str] = []
        self.staged_bytes = 0
        self._depth = 0
        self.on_stream_ops = 0

    @contextlib.contextmanager
    def _stream(self) -> Iterator[None]:
        self.log.append("stream")
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def on_stream(self) -> contextlib.AbstractContextManager[None]:
        return self._stream()

    @property
    def streaming(self) -> bool:
        """Whether a block on the copy stream is running now (tests check where work ran)."""
        return self._depth > 0

    def record(self) -> DeviceEvent:
        ev = FakeDeviceEvent(polls=0 if self.auto else None)
        self.events.append(ev)
        self.log.append("record")
        self.on_stream_ops += self._depth > 0
        return ev

    def staging(self, nbytes: int) -> torch.Tensor:
        self.staged_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8)

    def complete(self) -> int:
        """Complete every event recorded so far; returns how many were pending."""
        pending = [ev for ev in self.events if not ev.done]
        for ev in pending:
            ev.set()
        return len(pending)

    def pending(self) -> int:
        return sum(not ev.done for ev in self.events)


# ---- clock -----------------------------------------------------------------------------------


class FakeClock:
    """A clock that moves only when told to (seconds, monotonic)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        self.now += seconds


def attach_clock(linker: Linker, clock: Callable[[], float]) -> LatencyMonitor:
    """Replace the linker's store-latency monitor with one reading ``clock`` (same
    watermarks); every pool actor shares it. Returns the new monitor."""
    old = linker.latency
    monitor = LatencyMonitor(old.high_ms, old.low_ms, old.alpha, old.half_life, clock=clock)
    linker.latency = monitor
    for actor in linker.actors.values():
        actor.latency = monitor
    return monitor


# ---- gated store -----------------------------------------------------------------------------

_METHODS = ("exists", "put", "get", "touch", "remove")


class GatedStore:
    """Wraps ``inner``; holds and paces put/get calls, and records every call.

    * ``hold_puts`` / ``hold_gets``: calls of that kind wait at the gate, in arrival order,
      until :meth:`release` lets some through or :meth:`open` lets all through.
    * ``drain_interval_s``: after the gate, at most one put/get call starts per interval (a
      store that drains slowly). :meth:`open` removes the pacing too.
    * ``fail_puts`` / ``fail_gets``: ``True`` fails every key of such calls, a string fails
      the keys that contain it (``":mamba:"``), without reaching the inner store.
    * ``calls[method]`` counts calls; ``keys[method]`` lists each call's keys, in call order.
    * ``shielded``: a held call ignores cancellation until the gate lets it through (a client
      call in a thread that cannot be abandoned, as Mooncake's put, which reads the buffers).

    Closing the wrapper closes the inner store.
    """

    def __init__(self, inner: Store, *, hold_puts: bool = False, hold_gets: bool = False,
                 drain_interval_s: float | None = None) -> None:
        if drain_interval_s is not None and drain_interval_s <= 0:
            raise ValueError(f"drain_interval_s must be positive, got {drain_interval_s}")
        self.inner = inner
        self.hold_puts = hold_puts
        self.hold_gets = hold_gets
        self.drain_interval_s = drain_interval_s
        self.calls: collections.Counter[str] = collections.Counter()
        self.keys: dict[str, list[list[str]]] = {m: [] for m in _METHODS}
        self._held: collections.deque[anyio.Event] = collections.deque()
        self._next_start = 0.0
        self.completed: collections.Counter[str] = collections.Counter()
        self.fail_puts: bool | str = False
        self.fail_gets: bool | str = False
        self.shielded = False

    # ---- control ---------------------------------------------------------------------
    def hold(self, *, puts: bool = True, gets: bool = False) -> None:
        """Start holding new calls of the given kinds at the gate."""
        self.hold_puts = puts
        self.hold_gets = gets

    def release(self, n: int = 1) -> int:
        """Let the ``n`` oldest held calls through; returns how many were released."""
        done = 0
        while self._held and done < n:
            self._held.popleft().set()
            done += 1
        return done

    def open(self) -> None:
        """Stop holding and pacing; release every held call."""
        self.hold_puts = self.hold_gets = False
        self.drain_interval_s = None
        self.release(len(self._held))

    @property
    def held(self) -> int:
        """Calls waiting at the gate now."""
        return len(self._held)

    async def wait_held(self, n: int, timeout_s: float = 5.0) -> None:
        """Wait until at least ``n`` calls are held at the gate."""
        with anyio.fail_after(timeout_s):
            while len(self._held) < n:
                await anyio.sleep(0.001)

    def put_keys(self) -> list[str]:
        """Every key ever put, flattened in call order."""
        return [k for call in self.keys["put"] for k in call]

    def touched_keys(self) -> list[list[str]]:
        return list(self.keys["touch"])

    async def _gate(self, gated: bool) -> None:
        if gated:
            ev = anyio.Event()
            self._held.append(ev)
            try:
                with anyio.CancelScope(shield=self.shielded):
                    await ev.wait()
            except BaseException:
                if ev in self._held:
                    self._held.remove(ev)
                raise
        while self.drain_interval_s is not None:
            now = time.monotonic()
            if now >= self._next_start:
                self._next_start = now + self.drain_interval_s
                return
            await anyio.sleep(min(self._next_start - now, 0.005))

    @staticmethod
    def _failing(keys: Sequence[str], rule: bool | str) -> set[int]:
        if rule is True:
            return set(range(len(keys)))
        if isinstance(rule, str) and rule:
            return {i for i, k in enumerate(keys) if rule in k}
        return set()

    def _record(self, method: str, keys: Sequence[str]) -> None:
        self.calls[method] += 1
        self.keys[method].append(list(keys))

    # ---- the store protocol ---------------------------------------------------------------
    @property
    def capabilities(self) -> StoreCapabilities:
        """In front of a backend, the plain protocol only (it stands for a store that has no
        scatter-gather, checksumming or row calls: the staged path); in front of a wrapper
        (a ``FaultyStore`` or ``ResilientStore``), the calls that wrapper offers, so the gate
        replaces it call for call (the SGLang suite's ``swap_inner``)."""
        inner = self.inner
        mirror = isinstance(inner, (FaultyStore, ResilientStore))
        return attrs.evolve(inner.capabilities, scatter=mirror and supports_scatter(inner),
                            checksums=mirror and supports_checksums(inner), rows=mirror and supports_rows(inner))

    def register(self, region: torch.Tensor) -> None:
        self.inner.register(region)

    def unregister(self, region: torch.Tensor) -> None:
        self.inner.unregister(region)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self._record("exists", keys)
        out = await self.inner.exists(keys)
        self.completed["exists"] += 1
        return out

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        self._record("put", keys)
        await self._gate(self.hold_puts)
        failed = self._failing(keys, self.fail_puts)
        send = [i for i in range(len(keys)) if i not in failed]
        got = await self.inner.put([keys[i] for i in send], [buffers[i] for i in send]) if send else []
        out = [Outcome.FAILED] * len(keys)
        for i, o in zip(send, got):
            out[i] = o
        self.completed["put"] += 1
        return out

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        self._record("get", keys)
        await self._gate(self.hold_gets)
        failed = self._failing(keys, self.fail_gets)
        send = [i for i in range(len(keys)) if i not in failed]
        got = await self.inner.get([keys[i] for i in send], [buffers[i] for i in send]) if send else []
        out = [GetResult(Outcome.FAILED)] * len(keys)
        for i, r in zip(send, got):
            out[i] = r
        self.completed["get"] += 1
        return out

    # scatter-gather, checksumming and row calls: offered where the inner store offers them
    # (so a gated store replaces the store it wraps call for call), gated, failed and recorded
    # as the put or get they are
    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        return await self._put_objects("put_parts", keys, parts)

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        return await self._put_objects("put_sealed", keys, parts)

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        return await self._get_objects("get_parts", keys, parts)

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        return await self._get_objects("get_checked", keys, parts)

    async def put_rows(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        self._record("put", batch.keys)
        await self._gate(self.hold_puts)
        failed = self._failing(batch.keys, self.fail_puts)
        send = [i for i in range(len(batch.keys)) if i not in failed]
        out = np.full(len(batch.keys), CODE[Outcome.FAILED], dtype=np.int8)
        if send:
            out[send] = await self.inner.put_rows(batch.select(send), hashed)  # type: ignore[attr-defined]
        self.completed["put"] += 1
        return out

    async def get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        self._record("get", batch.keys)
        await self._gate(self.hold_gets)
        failed = self._failing(batch.keys, self.fail_gets)
        send = [i for i in range(len(batch.keys)) if i not in failed]
        out = RowResults.of(len(batch.keys), Outcome.FAILED)
        if send:
            sub = batch.select(send)
            got = await self.inner.get_rows(sub, hashed)  # type: ignore[attr-defined]
            assert batch.heads is not None and sub.heads is not None
            batch.heads[send] = sub.heads
            out.codes[send], out.nbytes[send], out.checksums[send] = got.codes, got.nbytes, got.checksums
        self.completed["get"] += 1
        return out

    async def _put_objects(self, method: str, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        self._record("put", keys)
        await self._gate(self.hold_puts)
        failed = self._failing(keys, self.fail_puts)
        send = [i for i in range(len(keys)) if i not in failed]
        got = await getattr(self.inner, method)([keys[i] for i in send], [parts[i] for i in send]) if send else []
        out = [Outcome.FAILED] * len(keys)
        for i, o in zip(send, got):
            out[i] = o
        self.completed["put"] += 1
        return out

    async def _get_objects(self, method: str, keys: Sequence[str],
                           parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        self._record("get", keys)
        await self._gate(self.hold_gets)
        failed = self._failing(keys, self.fail_gets)
        send = [i for i in range(len(keys)) if i not in failed]
        got = await getattr(self.inner, method)([keys[i] for i in send], [parts[i] for i in send]) if send else []
        out = [GetResult(Outcome.FAILED)] * len(keys)
        for i, r in zip(send, got):
            out[i] = r
        self.completed["get"] += 1
        return out

    async def touch(self, keys: Sequence[str]) -> None:
        self._record("touch", keys)
        await self.inner.touch(keys)
        self.completed["touch"] += 1

    async def remove(self, keys: Sequence[str]) -> int:
        self._record("remove", keys)
        out = await self.inner.remove(keys)
        self.completed["remove"] += 1
        return out

    def statistics(self) -> StoreStatistics:
        return self.inner.statistics()

    async def close(self) -> None:
        self.open()
        await self.inner.close()


# ---- layouts and synthetic content ------------------------------------------------------------


def small_hybrid_layout(*, page_size: int = 4, chunk_size: int = 8, draft: bool = True,
                        hybrid: bool = True, tp_rank: int = 0, tp_size: int = 1,
                        replicated: Sequence[PoolKind | str] = ()) -> ModelLayout:
    """Two full-attention layers (bf16 rows ``[2, 4]``), two linear layers (fp32 conv
    ``[3, 8]`` + temporal ``[2, 4, 4]``) and one draft layer; grid ``lcm(C, P)``."""
    mamba = [MambaLayerSpec(0, (3, 8), torch.float32, (2, 4, 4), torch.float32),
             MambaLayerSpec(2, (3, 8), torch.float32, (2, 4, 4), torch.float32)] if hybrid else []
    return ModelLayout.create(
        page_size=page_size, chunk_size=chunk_size, full_layers=[1, 3], kv_row_shape=[2, 4],
        kv_dtype="bfloat16", mamba_layers=mamba, draft_layers=1 if draft else 0,
        draft_row_shape=[2, 4] if draft else None, tp_rank=tp_rank, tp_size=tp_size,
        replicated=replicated)


async def synthetic_prefill(linker: Linker, content: SyntheticContent, req: Request, *,
                            fence: DeviceEvent | None = None, offload: bool | None = None) -> int:
    """Play the forward of ``req`` after its cached prefix: extend to the prompt, write the
    synthetic content of every new whole page, take the working state (copy-on-write), donate
    a checkpoint at the grid depth and insert. Returns the inserted depth (0: nothing)."""
    layout = linker.layout
    page = layout.page_size
    n = len(req.tokens)
    keys = req.page_keys()
    rows = linker.extend(req, n)
    first, whole = req.prefix_pages, n // page
    content.write_pages(keys[first:whole], rows[first * page: whole * page])
    if layout.is_hybrid:
        linker.working_slot(req)
        depth = linker.checkpoint_depth(req, n - req.prefix_tokens)
        if depth is None:
            return 0
        slot = linker.checkpoint_slot(req)
        content.write_state(keys[depth // page - 1], slot)
        await linker.insert(req, depth, checkpoint_slot=slot, fence=fence,
                            offload=offload)
        return depth
    depth = whole * page
    if depth <= req.prefix_tokens:
        return 0
    await linker.insert(req, depth, fence=fence, offload=offload)
    return depth


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0,
                     poll_s: float = 0.001) -> None:
    """Poll ``predicate`` on the event loop until it holds (``TimeoutError`` after
    ``timeout_s``)."""
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(poll_s)


__all__ = [
    "FakeClock",
    "FakeDeviceEvent",
    "GatedStore",
    "SyntheticContent",
    "attach_clock",
    "small_hybrid_layout",
    "synthetic_prefill",
    "wait_until",
]
