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
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from ..stores.base import Store
from .page_mover import LoadFailedError, PageMover, Part
from .sglang_config import SGLangLinkerConfig
from .sglang_pools import (
    PoolLayoutError,
    PoolView,
    draft_view,
    full_view,
    layout_fingerprint,
    mamba_view,
)
from .store_bridge import StoreBridge

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
_ALIGN = 64


@attrs.define
class _LoadJob:
    index: int
    parts: list[Part]
    ready: Any = None  # a device event the load waits on before writing


@attrs.define
class _OffloadJob:
    parts: list[Part]
    ready: list[Any]


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

        self._pending: dict[str, list[Part]] = {}
        self._results: collections.deque[bool] = collections.deque()
        self._closed = False
        self._on_device = any(v.device.type != "cpu" for v in views.values())
        self.bridge = StoreBridge(self._open_store, name=f"hylinker-store-tp{tp_rank}")
        try:
            self._mover = PageMover(self.bridge, self.config, self.fingerprint, num_layers=self.num_layers,
                                    writes=self._writes, on_device=self._on_device)
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
        self._mover.count("lookups", 1)
        try:
            present = self.bridge.wait(self.bridge.exists(probe), self.config.lookup_timeout_s)
        except Exception as exc:  # a store that fails or hangs: a miss (every rank's MIN agrees)
            self._mover.count("lookup_errors", 1)
            log.warning("HylinkerLinker lookup failed (a miss): %s", exc)
            return []
        if len(present) != len(probe):
            self._mover.count("lookup_errors", 1)
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
            self._mover.count("lookup_hits", 1)
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
        self._mover.count("touches", 1)

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

    def _parts(self, transfers: Sequence[PoolTransfer]) -> list[Part]:
        by_name = {str(getattr(t.name, "value", t.name)): t for t in transfers}
        unknown = set(by_name) - set(self._views)
        if unknown:
            raise PoolLayoutError(f"transfers for pools this linker does not hold: {sorted(unknown)}")
        kv = by_name.get("kv")
        if kv is None or not kv.keys or kv.device_indices is None:
            return []
        pages = list(kv.keys)
        parts = [Part(self._views["kv"], self.object_keys("kv", pages),
                       self._views["kv"].object_rows(kv.device_indices, len(pages)))]
        if "draft" in self._views:
            parts.append(Part(self._views["draft"], self.object_keys("draft", pages), parts[0].rows))
        state = by_name.get("mamba")
        if state is not None and state.keys:
            if state.device_indices is None:
                raise PoolLayoutError("a MAMBA transfer without a slot")
            parts.append(Part(self._views["mamba"], self.object_keys("mamba", list(state.keys)),
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
        self._mover.count("load_batches", 1)
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed: bool = self.layer_done_counter.finish(counter_index)
        return landed

    def cancel_queued_load(self, rid: str) -> bool:
        cancelled = self._pending.pop(rid, None) is not None
        if cancelled:
            self._mover.count("loads_cancelled", 1)
        return cancelled

    def _run_load(self, job: _LoadJob) -> None:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            self._mover.load(job.parts, lambda layer: self.layer_done_counter.complete(job.index, layer))
            self._mover.count("loads_ok", 1)
        except BaseException as exc:
            self._mover.count("loads_failed", 1)
            log.error("HylinkerLinker load batch %d failed: %s", job.index, exc)
            self.layer_done_counter.fail(job.index, exc)

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
            ok = self._offload_job(job)
        except BaseException as exc:
            log.error("HylinkerLinker offload failed: %s", exc)
            ok = False
        self._mover.count("offloads_ok" if ok else "offloads_failed")
        self._results.append(ok)

    def _offload_job(self, job: _OffloadJob) -> bool:
        for event in job.ready:
            event.synchronize()
        return self._mover.offload(job.parts)

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
        self._mover.forget_restored()

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
        log.info("HylinkerLinker closed: %s", self.statistics())

    def statistics(self) -> dict[str, int]:
        """Counters: lookups, hits, loads, retries, verify failures, offloads, skipped objects,
        and the time spent per phase (``*_us``)."""
        return self._mover.statistics()


def _tp_rank(params: Any) -> int:
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank(group=group))
    return 0


__all__ = ["SGLANG_VERSION", "HylinkerLinker", "LoadFailedError"]
