"""hylinker as SGLang's external cache linker: ``HylinkerLinker``.

Targets ``sglang==0.5.23`` exactly (the linker API moves between SGLang revisions; any other
version is refused at construction). Launch::

    python -m sglang.launch_server ... --enable-unified-cache-external-linker \\
      --unified-cache-external-linker-config '{"linker": "HylinkerLinker",
        "linker_module_path": "hylinker.integrations.sglang",
        "linker_extra_config": {"store": "mooncake", "master": "127.0.0.1:50051"}}'

SGLang owns the prefix tree, the allocators, the locks and COMMIT; this linker moves pages and
states between SGLang's device pools and a hylinker store, and says what the store can restore.
What it adds over SGLang's own Mooncake linker:

* **integrity**: every object is framed (layout fingerprint, key digest, XXH3 checksum); a
  corrupt, torn, mis-keyed or other-model object fails its load before a byte lands, and is
  removed from the store so the next lookup recomputes instead of failing again;
* **transient store errors are retried** (``load_retries``, exponential backoff) before a load
  fails — in SGLang a failed load aborts the request (503);
* **bounded waits**: no scheduler-thread call waits on the store longer than ``lookup_timeout_s``;
  no store call holds a load or offload longer than ``store_timeout_s``; a store that hangs
  makes later offloads report False at once (their nodes unlock) until it answers again;
* **no re-offload of restored pages**: what a load just restored is not written back when the
  request's insert offloads it;
* MHA full-attention pools (SGLang's linker takes MLA only) and a draft sidecar pool.

Threads: SGLang calls every method on its scheduler thread; one load thread and one offload
thread do the copies; the store lives on the :class:`~hylinker.integrations.store_bridge.StoreBridge`
loop. Offload results are reported one per accepted offload, in submission order.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from ..stores import framing
from ..stores.base import Outcome, Store
from .sglang_config import SGLangLinkerConfig
from .sglang_pools import (
    PoolLayoutError,
    PoolView,
    draft_view,
    full_view,
    layout_fingerprint,
    mamba_view,
)
from .store_bridge import StoreBridge, StoreTimeoutError

try:  # the plugin is loaded inside SGLang's worker; the rest of hylinker never imports it
    import sglang
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        LayerWiseLoadCounter,
        UnifiedCacheLinker,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hylinker.integrations.sglang needs sglang==0.5.23 installed (see README, 'SGLang')") from exc

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
STORED = (Outcome.OK, Outcome.EXISTS)
TRANSIENT = (Outcome.FAILED, Outcome.UNREACHABLE, Outcome.LEASED)
_RESTORED_MEMORY = 1 << 17  # object keys remembered as just restored (not re-offloaded)
_ALIGN = 64


class LoadFailedError(RuntimeError):
    """A load could not restore its objects; SGLang aborts the request (503)."""


@attrs.define
class _Part:
    """One pool's share of a transfer: object keys and their rows ``[n, rows_per_object]``."""

    view: PoolView
    keys: list[str]
    rows: torch.Tensor


@attrs.define
class _LoadJob:
    index: int
    parts: list[_Part]
    ready: Any = None  # a device event the load waits on before writing


@attrs.define
class _OffloadJob:
    parts: list[_Part]
    ready: list[Any]


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


def _placement(parts: Sequence[_Part], base: int, limit: int
               ) -> list[list[tuple[_Part, int, int, int]]]:
    """Cut ``parts`` into batches of ``(part, lo, hi, offset)`` runs that fit ``limit`` bytes."""
    batches: list[list[tuple[_Part, int, int, int]]] = []
    current: list[tuple[_Part, int, int, int]] = []
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


class HylinkerLinker(UnifiedCacheLinker):
    """SGLang 0.5.23 ``UnifiedCacheLinker`` over a hylinker store; see the module docstring."""

    def __init__(self, server_args: Any, params: Any, *, components: Any,
                 extra_config: dict[str, Any] | None = None, forward_stream: Any = None) -> None:
        if sglang.__version__ != SGLANG_VERSION:
            raise RuntimeError(
                f"HylinkerLinker targets sglang=={SGLANG_VERSION}; this is sglang {sglang.__version__}")
        self.config = SGLangLinkerConfig.from_extra_config(extra_config)
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        names = {getattr(c, "name", str(c)) for c in components}
        unsupported = names - {"FULL", "MAMBA"}
        if unsupported:
            raise PoolLayoutError(f"HylinkerLinker supports FULL and MAMBA components, not {sorted(unsupported)}")
        if getattr(params, "mtp_draft_device_pools", None):
            raise PoolLayoutError("packed MTP draft KV is not supported yet")
        views: dict[str, PoolView] = {"kv": full_view(kvcache)}
        if "MAMBA" in names:
            views["mamba"] = mamba_view(params.req_to_token_pool, int(getattr(kvcache, "start_layer", 0) or 0))
        draft = draft_view(getattr(params, "sidecar_draft_device_pools", None) or (), self.page_size)
        if draft is not None:
            views["draft"] = draft
        self._views = views
        self.pools: dict[Any, PoolView] = {PoolName(name): view for name, view in views.items()}
        self.num_layers = max(max(v.counter_layers) for v in views.values()) + 1
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        if "mamba" in views:
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)

        tp_rank = _tp_rank(params)
        cp_rank, pp_rank = int(getattr(params, "attn_cp_rank", 0) or 0), int(getattr(params, "pp_rank", 0) or 0)
        model = str(getattr(server_args, "model_path", "") or "")
        self.fingerprint = layout_fingerprint(views.values(), page_size=self.page_size, model=model)
        ns = hashlib.blake2b(self.fingerprint + b"\0salt\0" + self.config.salt.encode(), digest_size=8).hexdigest()
        self._suffix = {
            name: f":{ns}:{name}:{'rep' if v.replicated else f'tp{tp_rank}'}cp{cp_rank}pp{pp_rank}"
            for name, v in views.items()}
        self._writes = {name: not v.replicated or tp_rank == 0 for name, v in views.items()}
        self.tp_rank = tp_rank

        self._stats: collections.Counter[str] = collections.Counter()
        self._stats_lock = threading.Lock()  # counted from three threads
        self._restored: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._restored_lock = threading.Lock()
        self._pending: dict[str, list[_Part]] = {}
        self._results: collections.deque[bool] = collections.deque()
        self._closed = False
        self._on_device = any(v.device.type != "cpu" for v in views.values())
        self.bridge = StoreBridge(self._open_store, name=f"hylinker-store-tp{tp_rank}")
        try:
            pin = self._on_device and torch.cuda.is_available()
            half = self.config.staging_mb << 19
            self._offload_arena = _Staging(2 * half, pin)
            self._load_arena = _Staging(2 * half, pin)
            self.bridge.register(self._offload_arena.tensor)
            self.bridge.register(self._load_arena.tensor)
        except BaseException:
            self.bridge.close()
            raise
        self._load_q: queue.Queue[_LoadJob | None] = queue.Queue()
        self._offload_q: queue.Queue[_OffloadJob | None] = queue.Queue()
        self._load_thread = threading.Thread(target=self._serve, args=(self._load_q, self._run_load),
                                             name=f"hylinker-load-tp{tp_rank}", daemon=True)
        self._offload_thread = threading.Thread(target=self._serve, args=(self._offload_q, self._run_offload),
                                                name=f"hylinker-offload-tp{tp_rank}", daemon=True)
        self._load_thread.start()
        self._offload_thread.start()
        log.info("HylinkerLinker: store=%s pools=%s tp_rank=%d layers=%d",
                 self.config.store, {n: v.payload_bytes for n, v in views.items()}, tp_rank, self.num_layers)

    async def _open_store(self) -> Store:
        c = self.config
        inner: Store
        if c.store == "embedded":
            from ..stores.embedded import EmbeddedStore

            inner = EmbeddedStore(c.capacity_mb << 20)
        elif c.store == "mooncake":
            from ..stores.mooncake import MooncakeConfig, MooncakeStore

            assert c.master is not None
            inner = await MooncakeStore.open(MooncakeConfig(
                master_address=c.master, segment_bytes=c.segment_mb << 20, protocol=c.protocol,
                rdma_devices=c.rdma_devices, metadata_server=c.metadata_server,
                local_hostname=c.local_hostname,
                detect_exists=False))  # an existing key counts as stored: skip one master RPC per put
        else:
            from ..stores.umbp import UmbpStore

            inner = UmbpStore()
        plan = c.fault_plan
        if plan is None:
            return inner
        from ..stores.faulty import FaultyStore

        return FaultyStore(inner, plan, seed=c.fault_seed)

    # ---- keys -------------------------------------------------------------------------
    def object_keys(self, pool: str, page_keys: Sequence[str]) -> list[str]:
        """Store keys of ``pool``'s objects for SGLang's page keys (on this rank)."""
        suffix = self._suffix[pool]
        return [k + suffix for k in page_keys]

    # ---- lookup -----------------------------------------------------------------------
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        by_name = {str(getattr(t.name, "value", t.name)): t for t in transfers}
        kv = by_name.get("kv")
        if kv is None or not kv.keys or self._closed:
            return []
        pages = list(kv.keys)
        m = len(pages)
        probe = self.object_keys("kv", pages)
        with_state = "mamba" in by_name and "mamba" in self._views
        with_draft = "draft" in self._views
        if with_draft:
            probe += self.object_keys("draft", pages)
        if with_state:
            probe += self.object_keys("mamba", pages)
        self._count("lookups", 1)
        try:
            present = self.bridge.wait(self.bridge.exists(probe), self.config.lookup_timeout_s)
        except Exception as exc:  # a store that fails or hangs: a miss (every rank's MIN agrees)
            self._count("lookup_errors", 1)
            log.warning("HylinkerLinker lookup failed (a miss): %s", exc)
            return []
        if len(present) != len(probe):
            self._count("lookup_errors", 1)
            return []
        kv_ok = np.asarray(present[:m], dtype=bool)
        if with_draft:
            kv_ok &= np.asarray(present[m:2 * m], dtype=bool)
        prefix = int(m if kv_ok.all() else np.argmin(kv_ok))  # KV pages [0, prefix) all present
        if with_state:
            state = present[-m:]
            counts = [n for n in range(1, prefix + 1) if state[n - 1]]
        else:
            counts = list(range(1, prefix + 1))
        if counts:
            self._count("lookup_hits", 1)
            self._touch(pages[:counts[-1]], with_state)
        return counts

    def _touch(self, pages: list[str], with_state: bool) -> None:
        if not self.config.touch or not self.bridge.capabilities.touch:
            return
        keys = self.object_keys("kv", pages)
        if "draft" in self._views:
            keys += self.object_keys("draft", pages)
        if with_state:
            keys += self.object_keys("mamba", pages[-1:])
        self.bridge.touch(keys)  # fire and forget: recency only
        self._count("touches", 1)

    # ---- load -------------------------------------------------------------------------
    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        if self._closed:
            return False
        if rid in self._pending:
            raise RuntimeError(f"HylinkerLinker: a load for rid={rid} is already queued")
        try:
            parts = self._parts(transfers)
        except PoolLayoutError as exc:  # malformed transfers: the same on every rank
            log.error("HylinkerLinker refuses load rid=%s: %s", rid, exc)
            return False
        if not parts:
            return False
        self._pending[rid] = parts
        return True

    def _parts(self, transfers: Sequence[PoolTransfer]) -> list[_Part]:
        by_name = {str(getattr(t.name, "value", t.name)): t for t in transfers}
        unknown = set(by_name) - set(self._views)
        if unknown:
            raise PoolLayoutError(f"transfers for pools this linker does not hold: {sorted(unknown)}")
        kv = by_name.get("kv")
        if kv is None or not kv.keys or kv.device_indices is None:
            return []
        pages = list(kv.keys)
        parts = [_Part(self._views["kv"], self.object_keys("kv", pages),
                       self._views["kv"].object_rows(kv.device_indices, len(pages)))]
        if "draft" in self._views:
            parts.append(_Part(self._views["draft"], self.object_keys("draft", pages), parts[0].rows))
        state = by_name.get("mamba")
        if state is not None and state.keys:
            if state.device_indices is None:
                raise PoolLayoutError("a MAMBA transfer without a slot")
            parts.append(_Part(self._views["mamba"], self.object_keys("mamba", list(state.keys)),
                               self._views["mamba"].object_rows(state.device_indices, len(state.keys))))
        return parts

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        parts = [p for ps in self._pending.values() for p in ps]
        self._pending = {}
        index: int = self.layer_done_counter.update_producer()
        ready = None
        if self._on_device:
            ready = torch.cuda.Event()
            ready.record()
        self._load_q.put(_LoadJob(index, parts, ready))
        self._count("load_batches", 1)
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed: bool = self.layer_done_counter.finish(counter_index)
        return landed

    def cancel_queued_load(self, rid: str) -> bool:
        cancelled = self._pending.pop(rid, None) is not None
        if cancelled:
            self._count("loads_cancelled", 1)
        return cancelled

    def _run_load(self, job: _LoadJob) -> None:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            self._load(job)
            self._count("loads_ok", 1)
        except BaseException as exc:
            self._count("loads_failed", 1)
            log.error("HylinkerLinker load batch %d failed: %s", job.index, exc)
            self.layer_done_counter.fail(job.index, exc)

    def _load(self, job: _LoadJob) -> None:
        need = sum(len(p.keys) * _aligned(framing.framed_size(p.view.payload_bytes)) for p in job.parts)
        arena = self._load_arena
        if need > arena.nbytes or not arena.free():
            arena = _Staging(need, False)  # not registered: the store copies through its own buffers
        batches = _placement(job.parts, 0, arena.nbytes)
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
            self._count("load_retries", 1)
            time.sleep(self.config.retry_backoff_ms * (2 ** attempt) / 1e3)
            retry = self._fetch(arena, keys, frames, [retry])
        if retry:
            self._count("load_retries_exhausted", 1)
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
            self.layer_done_counter.complete(job.index, layer_id)
        self._count("load_scatter_us", _us(t0))
        with self._restored_lock:
            for k in keys:
                self._restored[k] = None
                self._restored.move_to_end(k)
            while len(self._restored) > _RESTORED_MEMORY:
                self._restored.popitem(last=False)
        self._count("objects_loaded", len(keys))
        self._count("bytes_loaded", sum(f.numel() for f in frames))

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
                    self._count("load_timeouts", 1)
                    raise LoadFailedError("the store did not answer a load in time") from None
                self._count("load_get_us", _us(t0))
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
                        self._count("load_missing", 1)
                        raise LoadFailedError(f"object {keys[i]!r} left the store after lookup")
                    else:
                        self._count("load_errors", 1)
                        raise LoadFailedError(f"object {keys[i]!r}: {r.outcome.value}")
                self._count("load_verify_us", _us(t0))
                k += 1
        except BaseException:
            arena.busy.extend(f for _, f in submitted if not f.done())  # still writing into it
            raise
        return retry

    def _verify(self, key: str, frame: torch.Tensor, nbytes: int) -> None:
        try:
            framing.verify_array(frame.numpy(), nbytes, key, self.fingerprint)
        except framing.FrameError as exc:
            self._count("verify_failures", 1)
            self._count(f"verify_{exc.fault.value}", 1)
            if self.bridge.capabilities.remove:
                # gone before this load reports: the next lookup misses it (recompute, not a
                # second 503 racing the removal)
                try:
                    self.bridge.wait(self.bridge.remove([key]), self.config.store_timeout_s)
                except Exception as remove_error:
                    log.warning("HylinkerLinker could not remove damaged object %r: %s", key, remove_error)
            raise LoadFailedError(str(exc)) from None

    # ---- offload ----------------------------------------------------------------------
    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        try:
            parts = [] if self._closed else self._parts(transfers)
        except PoolLayoutError as exc:
            log.error("HylinkerLinker offload with malformed transfers: %s", exc)
            parts = []
        ready: list[Any] = []
        if self._on_device and parts:
            ready = list(self.record_offload_ready())
        if self._closed:
            self._results.append(False)
            return True
        self._offload_q.put(_OffloadJob(parts, ready))
        return True

    def _run_offload(self, job: _OffloadJob) -> None:
        try:
            ok = self._offload(job)
        except BaseException as exc:
            log.error("HylinkerLinker offload failed: %s", exc)
            ok = False
        self._count("offloads_ok" if ok else "offloads_failed")
        self._results.append(ok)

    def _offload(self, job: _OffloadJob) -> bool:
        for event in job.ready:
            event.synchronize()
        if not job.parts:
            return False
        todo: list[_Part] = []
        with self._restored_lock:
            for part in job.parts:
                if not self._writes[part.view.name]:
                    continue  # a rank-replicated pool: rank 0 writes it
                keep = [i for i, k in enumerate(part.keys) if k not in self._restored]
                self._count("objects_skipped_restored", len(part.keys) - len(keep))
                if keep:
                    idx = torch.tensor(keep, dtype=torch.int64)
                    todo.append(_Part(part.view, [part.keys[i] for i in keep], part.rows[idx]))
        if not todo:
            return True
        arena = self._offload_arena
        if not arena.free():
            self._count("offloads_store_stuck", 1)
            return False  # an earlier call still hangs in the store: fail fast, unlock the node
        half = arena.nbytes // 2
        batches = _placement(todo, 0, min(half, _CHUNK_BYTES))  # pack k+1 while k is put
        ok = True
        in_flight: Any = None
        for b, batch in enumerate(batches):
            base = (b % 2) * half
            t0 = time.perf_counter()
            keys, frames = self._pack(arena, batch, base)
            self._count("offload_pack_us", _us(t0))
            if in_flight is not None:
                ok &= self._settle_put(arena, in_flight)
                if not ok:
                    return False
            in_flight = (self.bridge.put(keys, frames), len(keys), sum(f.numel() for f in frames))
        if in_flight is not None:
            ok &= self._settle_put(arena, in_flight)
        return ok

    def _pack(self, arena: _Staging, batch: list[tuple[_Part, int, int, int]], shift: int
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
            self._count("offload_put_wait_us", _us(t0))
        except StoreTimeoutError:
            arena.busy.append(future)
            self._count("offload_timeouts", 1)
            return False
        except Exception as exc:
            log.warning("HylinkerLinker offload put failed: %s", exc)
            return False
        ok = len(outcomes) == n and all(o in STORED for o in outcomes)
        if ok:
            self._count("objects_offloaded", n)
            self._count("bytes_offloaded", nbytes)
        return ok

    def num_completed_offloads(self) -> int:
        return len(self._results)

    def pop_completed_offload(self) -> bool:
        return self._results.popleft()

    # ---- life cycle -------------------------------------------------------------------
    def _serve(self, jobs: queue.Queue[Any], work: Any) -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                work(job)
            finally:
                jobs.task_done()

    def reset(self) -> None:
        """Quiesce: drop queued loads, wait for started transfers, forget their results."""
        self._pending.clear()
        self._load_q.join()
        self._offload_q.join()
        self._results.clear()
        self.layer_done_counter.reset()
        with self._restored_lock:
            self._restored.clear()

    def close(self) -> None:
        if self._closed:
            return
        self.reset()
        self._closed = True
        self._load_q.put(None)
        self._offload_q.put(None)
        self._load_thread.join(timeout=self.config.store_timeout_s + 5)
        self._offload_thread.join(timeout=self.config.store_timeout_s + 5)
        self.bridge.close(timeout_s=self.config.store_timeout_s + 5)
        log.info("HylinkerLinker closed: %s", dict(self._stats))

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[name] += n

    def statistics(self) -> dict[str, int]:
        """Counters: lookups, hits, loads, retries, verify failures, offloads, skipped objects..."""
        with self._stats_lock:
            return dict(self._stats)


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


def _tp_rank(params: Any) -> int:
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank(group=group))
    return 0


__all__ = ["SGLANG_VERSION", "HylinkerLinker", "LoadFailedError"]
