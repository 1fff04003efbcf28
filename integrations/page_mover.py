"""Moving page and state objects between borrowed pools and a store, verified.

:class:`PageMover` is the SGLang plugin's data path (it imports no SGLang): loads read every
object of a batch into staging (gets pipelined in chunks, transient outcomes retried with
backoff), verify every frame, and only then scatter layer by layer; offloads gather and seal
into a double-buffered staging arena and put, chunk k+1 packed while chunk k is in the store.
Every store call is awaited with a deadline; a call that outlives it keeps its staging marked
busy. Objects a load restored are remembered (a bounded LRU) and not written back.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..stores import framing
from ..stores.base import Outcome
from .sglang_config import SGLangLinkerConfig
from .sglang_pools import PoolView
from .store_bridge import StoreBridge, StoreTimeoutError

log = logging.getLogger(__name__)

STORED = (Outcome.OK, Outcome.EXISTS)
TRANSIENT = (Outcome.FAILED, Outcome.UNREACHABLE, Outcome.LEASED)
_RESTORED_MEMORY = 1 << 17  # object keys remembered as just restored (not re-offloaded)
_ALIGN = 64


class LoadFailedError(RuntimeError):
    """A load could not restore its objects; SGLang aborts the request (503)."""


@attrs.define
class Part:
    """One pool's share of a transfer: object keys and their rows ``[n, rows_per_object]``."""

    view: PoolView
    keys: list[str]
    rows: torch.Tensor


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Staging:
    """A registered host arena holding frames back to back (64-byte aligned)."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).fill_(0)
        self.array = self.tensor.numpy()
        self.busy: list[Any] = []  # store calls that outlived their waiter still use it

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def free(self) -> bool:
        self.busy = [f for f in self.busy if not f.done()]
        return not self.busy


def _placement(parts: Sequence[Part], base: int, limit: int
               ) -> list[list[tuple[Part, int, int, int]]]:
    """Cut ``parts`` into batches of ``(part, lo, hi, offset)`` runs that fit ``limit`` bytes."""
    batches: list[list[tuple[Part, int, int, int]]] = []
    current: list[tuple[Part, int, int, int]] = []
    used = 0
    for part in parts:
        stride = _aligned(framing.framed_size(part.view.payload_bytes))
        lo = 0
        n = len(part.keys)
        while lo < n:
            room = (limit - used) // stride
            if room == 0:
                if not current:
                    raise LoadFailedError(f"one {part.view.name} object ({stride} B) exceeds the staging arena")
                batches.append(current)
                current, used = [], 0
                continue
            hi = min(n, lo + room)
            current.append((part, lo, hi, base + used))
            used += (hi - lo) * stride
            lo = hi
    if current:
        batches.append(current)
    return batches


class PageMover:
    """Loads and offloads of :class:`Part` lists through a :class:`StoreBridge`; see the module doc.

    ``writes[pool]``: whether this rank writes that pool (a rank-replicated pool is written by
    rank 0 only). ``on_device``: the pools live on a GPU (copies are synchronized before a layer
    is reported).
    """

    def __init__(self, bridge: StoreBridge, config: SGLangLinkerConfig, fingerprint: bytes, *,
                 num_layers: int, writes: dict[str, bool], on_device: bool) -> None:
        self.bridge = bridge
        self.config = config
        self.fingerprint = fingerprint
        self.num_layers = num_layers
        self._writes = writes
        self._on_device = on_device
        self._stats: collections.Counter[str] = collections.Counter()
        self._stats_lock = threading.Lock()  # counted from three threads
        self._restored: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._restored_lock = threading.Lock()
        pin = on_device and torch.cuda.is_available()
        half = config.staging_mb << 19
        self._offload_arena = _Staging(2 * half, pin)
        self._load_arena = _Staging(2 * half, pin)
        bridge.register(self._offload_arena.tensor)
        bridge.register(self._load_arena.tensor)

    def count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[name] += n

    def statistics(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

    def forget_restored(self) -> None:
        with self._restored_lock:
            self._restored.clear()

    def load(self, parts: list[Part], complete: Callable[[int], None]) -> None:
        """Restore ``parts``; ``complete(layer)`` after each layer landed. Raises
        :class:`LoadFailedError` (nothing landed) when an object is missing or damaged, or a
        transient store error outlasts the retries."""
        need = sum(len(p.keys) * _aligned(framing.framed_size(p.view.payload_bytes)) for p in parts)
        arena = self._load_arena
        if need > arena.nbytes or not arena.free():
            arena = _Staging(need, False)  # not registered: the store copies through its own buffers
        batches = _placement(parts, 0, arena.nbytes)
        assert len(batches) == 1, "a load is staged whole: it is verified before a byte lands"
        placed = batches[0]
        keys: list[str] = []
        frames: list[torch.Tensor] = []
        for part, lo, hi, offset in placed:
            stride = _aligned(framing.framed_size(part.view.payload_bytes))
            size = framing.framed_size(part.view.payload_bytes)
            for i in range(hi - lo):
                keys.append(part.keys[lo + i])
                frames.append(arena.tensor[offset + i * stride: offset + i * stride + size])
        retry = self._fetch(arena, keys, frames, _chunks(frames, _CHUNK_BYTES))
        for attempt in range(self.config.load_retries):
            if not retry:
                break
            self.count("load_retries", 1)
            time.sleep(self.config.retry_backoff_ms * (2 ** attempt) / 1e3)
            retry = self._fetch(arena, keys, frames, [retry])
        if retry:
            self.count("load_retries_exhausted", 1)
            raise LoadFailedError(f"{len(retry)} objects still failing after {self.config.load_retries} retries")
        # every object verified: land them layer by layer
        t0 = time.perf_counter()
        runs: dict[int, list[tuple[PoolView, int, torch.Tensor, torch.Tensor]]] = collections.defaultdict(list)
        for part, lo, hi, offset in placed:
            stride = _aligned(framing.framed_size(part.view.payload_bytes))
            grid = arena.tensor[offset: offset + (hi - lo) * stride].view(hi - lo, stride)
            payload = grid[:, framing.HEADER_BYTES: framing.HEADER_BYTES + part.view.payload_bytes]
            for li, layer in enumerate(part.view.layers):
                runs[layer.counter_layer].append((part.view, li, payload, part.rows[lo:hi]))
        for layer_id in range(self.num_layers):
            for view, li, payload, rows in runs.get(layer_id, ()):
                view.scatter_layer(li, payload, rows)
            if self._on_device:
                torch.cuda.current_stream().synchronize()
            complete(layer_id)
        self.count("load_scatter_us", _us(t0))
        with self._restored_lock:
            for k in keys:
                self._restored[k] = None
                self._restored.move_to_end(k)
            while len(self._restored) > _RESTORED_MEMORY:
                self._restored.popitem(last=False)
        self.count("objects_loaded", len(keys))
        self.count("bytes_loaded", sum(f.numel() for f in frames))

    def _fetch(self, arena: _Staging, keys: list[str], frames: list[torch.Tensor],
               chunks: list[list[int]]) -> list[int]:
        """Get the objects ``chunks`` name (chunk k+1 in flight while chunk k is verified).

        Returns the objects to retry (transient outcomes); raises :class:`LoadFailedError` for a
        missing or damaged object or a store that does not answer in time. Nothing lands here.
        """
        submitted = [(chunk, self.bridge.get([keys[i] for i in chunk], [frames[i] for i in chunk]))
                     for chunk in chunks[:2]]
        retry: list[int] = []
        k = 0
        try:
            while k < len(submitted):
                chunk, future = submitted[k]
                t0 = time.perf_counter()
                try:
                    results = self.bridge.wait(future, self.config.store_timeout_s)
                except StoreTimeoutError:
                    self.count("load_timeouts", 1)
                    raise LoadFailedError("the store did not answer a load in time") from None
                self.count("load_get_us", _us(t0))
                if len(submitted) < len(chunks):  # keep one chunk in flight ahead
                    nxt = chunks[len(submitted)]
                    submitted.append((nxt, self.bridge.get([keys[i] for i in nxt], [frames[i] for i in nxt])))
                if len(results) != len(chunk):  # a store that breaks the protocol: retry all
                    retry.extend(chunk)
                    k += 1
                    continue
                t0 = time.perf_counter()
                for i, r in zip(chunk, results):
                    if r.outcome is Outcome.OK:
                        self._verify(keys[i], frames[i], r.nbytes)
                    elif r.outcome in TRANSIENT:
                        retry.append(i)
                    elif r.outcome is Outcome.MISSING:
                        self.count("load_missing", 1)
                        raise LoadFailedError(f"object {keys[i]!r} left the store after lookup")
                    else:
                        self.count("load_errors", 1)
                        raise LoadFailedError(f"object {keys[i]!r}: {r.outcome.value}")
                self.count("load_verify_us", _us(t0))
                k += 1
        except BaseException:
            arena.busy.extend(f for _, f in submitted if not f.done())  # still writing into it
            raise
        return retry

    def _verify(self, key: str, frame: torch.Tensor, nbytes: int) -> None:
        try:
            framing.verify_array(frame.numpy(), nbytes, key, self.fingerprint)
        except framing.FrameError as exc:
            self.count("verify_failures", 1)
            self.count(f"verify_{exc.fault.value}", 1)
            if self.bridge.capabilities.remove:
                # gone before this load reports: the next lookup misses it (recompute, not a
                # second 503 racing the removal)
                try:
                    self.bridge.wait(self.bridge.remove([key]), self.config.store_timeout_s)
                except Exception as remove_error:
                    log.warning("HylinkerLinker could not remove damaged object %r: %s", key, remove_error)
            raise LoadFailedError(str(exc)) from None

    def offload(self, parts: list[Part]) -> bool:
        """Write ``parts``; True when every object is in the store."""
        if not parts:
            return False
        todo: list[Part] = []
        with self._restored_lock:
            for part in parts:
                if not self._writes[part.view.name]:
                    continue  # a rank-replicated pool: rank 0 writes it
                keep = [i for i, k in enumerate(part.keys) if k not in self._restored]
                self.count("objects_skipped_restored", len(part.keys) - len(keep))
                if keep:
                    idx = torch.tensor(keep, dtype=torch.int64)
                    todo.append(Part(part.view, [part.keys[i] for i in keep], part.rows[idx]))
        if not todo:
            return True
        arena = self._offload_arena
        if not arena.free():
            self.count("offloads_store_stuck", 1)
            return False  # an earlier call still hangs in the store: fail fast, unlock the node
        half = arena.nbytes // 2
        batches = _placement(todo, 0, min(half, _CHUNK_BYTES))  # pack k+1 while k is put
        ok = True
        in_flight: Any = None
        for b, batch in enumerate(batches):
            base = (b % 2) * half
            t0 = time.perf_counter()
            keys, frames = self._pack(arena, batch, base)
            self.count("offload_pack_us", _us(t0))
            if in_flight is not None:
                ok &= self._settle_put(arena, in_flight)
                if not ok:
                    return False
            in_flight = (self.bridge.put(keys, frames), len(keys), sum(f.numel() for f in frames))
        if in_flight is not None:
            ok &= self._settle_put(arena, in_flight)
        return ok

    def _pack(self, arena: _Staging, batch: list[tuple[Part, int, int, int]], shift: int
              ) -> tuple[list[str], list[torch.Tensor]]:
        keys: list[str] = []
        frames: list[torch.Tensor] = []
        for part, lo, hi, offset in batch:
            offset += shift
            size = framing.framed_size(part.view.payload_bytes)
            stride = _aligned(size)
            grid = arena.tensor[offset: offset + (hi - lo) * stride].view(hi - lo, stride)
            part.view.gather(part.rows[lo:hi], grid[:, framing.HEADER_BYTES: size])
            for i in range(hi - lo):
                start = offset + i * stride
                framing.seal_array(arena.array[start: start + size], part.keys[lo + i], self.fingerprint)
                keys.append(part.keys[lo + i])
                frames.append(arena.tensor[start: start + size])
        return keys, frames

    def _settle_put(self, arena: _Staging, in_flight: tuple[Any, int, int]) -> bool:
        future, n, nbytes = in_flight
        t0 = time.perf_counter()
        try:
            outcomes = self.bridge.wait(future, self.config.store_timeout_s)
            self.count("offload_put_wait_us", _us(t0))
        except StoreTimeoutError:
            arena.busy.append(future)
            self.count("offload_timeouts", 1)
            return False
        except Exception as exc:
            log.warning("HylinkerLinker offload put failed: %s", exc)
            return False
        ok = len(outcomes) == n and all(o in STORED for o in outcomes)
        if ok:
            self.count("objects_offloaded", n)
            self.count("bytes_offloaded", nbytes)
        return ok


_CHUNK_BYTES = 8 << 20  # transfers are pipelined in chunks of about this size


def _chunks(frames: Sequence[torch.Tensor], limit: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    used = 0
    for i, f in enumerate(frames):
        if out[-1] and used + f.numel() > limit:
            out.append([])
            used = 0
        out[-1].append(i)
        used += f.numel()
    return out if out[0] else []


def _us(t0: float) -> int:
    return round((time.perf_counter() - t0) * 1e6)


__all__ = ["STORED", "TRANSIENT", "LoadFailedError", "PageMover", "Part"]
