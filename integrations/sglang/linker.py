"""hylinker as SGLang's external cache linker: ``HylinkerLinker``.

Targets ``sglang==0.5.23`` exactly (the linker API moves between SGLang revisions; any other
version is refused at construction). Launch::

    python -m sglang.launch_server ... --enable-unified-cache-external-linker \\
      --unified-cache-external-linker-backend dynamic \\
      --unified-cache-external-linker-config '{"linker": "HylinkerLinker",
        "linker_module_path": "hylinker.integrations.sglang",
        "linker_extra_config": {"store": "mooncake", "master": "127.0.0.1:50051"}}'

SGLang owns the prefix tree, the allocators, the locks and COMMIT; this linker says what the
store can restore and moves pages and states between SGLang's device pools and the store over
the project's one data path: a :class:`~hylinker.runtime.dataplane.sync_plane.SyncDataPlane` over
pool views of SGLang's tensors (``integrations/sglang/pools.py``), its store wrapped in a
:class:`~hylinker.stores.resilient.ResilientStore`. What it adds over SGLang's own linker:

* **integrity**: every object is framed (layout fingerprint, key, XXH3 checksum). Loads are
  *verify all, then land*: every object of a request's load is read and verified before any
  row is written, so a corrupt, torn, mis-keyed or other-model object fails its load with the
  request's rows untouched and no layer reported; it is removed from the store before the
  failure is reported, so the next lookup recomputes instead of failing again;
* **transient store errors are retried** per key (``load_retries``, backoff) before a load
  fails — in SGLang a failed load aborts the request (503);
* **bounded waits**: a lookup waits at most ``lookup_timeout_s``, and all lookups of one
  scheduler round at most ``lookup_budget_s``; a store transfer ends within
  ``store_timeout_s``; after repeated silence (lookups given up on count) the store's circuit
  breaker answers at once (lookups miss, offloads report False, nodes unlock) until the store
  answers a probe again;
* **bounded offloads**: at most ``offload_max_inflight`` offloads (``offload_max_inflight_mb``
  of payload) accepted and not yet reported back; beyond it ``offload`` refuses (SGLang unlocks);
* **two-stage offload** (``two_stage_offload``, on by default): an offload is reported back,
  as not stored, once its bytes are sealed in host staging (SGLang unlocks its rows then); the
  frames drain to the store after, within ``host_staging_bytes`` (docs/design/sglang.md);
* **no re-offload of restored pages** when the request's insert offloads them;
* MHA full-attention pools (SGLang's linker takes MLA only), dense models (component FULL
  alone: SGLang's linker refuses them), decode-context parallelism and packed MTP/DSPARK draft
  KV (SGLang's linker refuses both for FULL + MAMBA), and a draft sidecar pool.

Without ``--unified-cache-external-linker-backend dynamic`` (its default is ``mooncake``) SGLang
hands the JSON to its own Mooncake linker and never imports this module.

Threads: SGLang calls every method on its scheduler thread; the data plane's loop thread runs
the transfers. Offload results are reported one per accepted offload, in submission order.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ...components.layout import PoolKind
from ...components.lookup import ALL_PAGES, TRAILING_PAGES, restorable_stops, window
from ...components.pool_view import PoolSet, PoolViewError
from ...runtime.dataplane.events import record_fence
from ...runtime.dataplane.host_staging import HostStagingFullError
from ...runtime.dataplane.metrics import (
    Figures,
    plane_figures,
    store_figures,
    store_identity_figures,
)
from ...runtime.dataplane.plane import DataPlaneConfig
from ...runtime.dataplane.sync_plane import SyncDataPlane, SyncLoad
from ...runtime.dataplane.tickets import TransferOutcome
from ...runtime.dataplane.tracing import trace
from ...stores.base import Store
from ...stores.resilient import ResilientStore
from .config import SGLangLinkerConfig
from .identity import deployment_term
from .load_ends import LoadEnds, LoadFailedError
from .loads import AllEvents, LoadBatch
from .metrics import METRIC_OF, create_metrics
from .offloads import OffloadBound, named_bytes
from .placement import engine_pools, key_suffix, writes
from .placement import tp_rank as _tp_rank  # a module global: the suites set a rank by patching it
from .statistics import COUNTERS, POOL_SUMS, STAGING_FIGURES, STORE_COUNTS, SGLangLinkerStatistics
from .store_probe import StoreProbe
from .transfers import TransferNames

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


class HylinkerLinker(UnifiedCacheLinker):
    """SGLang 0.5.23 ``UnifiedCacheLinker`` over hylinker's data plane; see the module docstring."""

    def __init__(self, server_args: Any, params: Any, *, components: Any,
                 extra_config: dict[str, Any] | None = None, forward_stream: Any = None) -> None:
        if sglang.__version__ != SGLANG_VERSION:
            raise RuntimeError(
                f"HylinkerLinker targets sglang=={SGLANG_VERSION}; this is sglang {sglang.__version__}")
        self.config = SGLangLinkerConfig.from_extra_config(extra_config)
        # one JSON line per phase event on stderr (SGLang's server log), or in the trace_file
        self.config.start_tracing("linker_extra_config")
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        pools, (self.dcp_size, self.dcp_rank) = engine_pools(params, components, self.page_size)
        views = PoolSet([p.view for p in pools.values()])
        self._kinds = set(pools)
        self.pools: dict[Any, Any] = {PoolName(kind.value): pool.view for kind, pool in pools.items()}
        self.num_layers = max(max(p.view.layer_ids) for p in pools.values()) + 1
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        if PoolKind.MAMBA in pools:
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)

        tp_rank = _tp_rank(params)
        cp_rank, pp_rank = int(getattr(params, "attn_cp_rank", 0) or 0), int(getattr(params, "pp_rank", 0) or 0)
        model = str(getattr(server_args, "model_path", "") or "")
        dcp = f"|dcp={self.dcp_size}" if self.dcp_size > 1 else ""
        identity = deployment_term(server_args, self.config.model_revision, self.config.integrity)
        self.fingerprint = views.fingerprint(
            f"sglang|model={model}|page={self.page_size}{dcp}|salt={self.config.salt}|id={identity.hex()}")
        ns = hashlib.blake2b(self.fingerprint, digest_size=8).hexdigest()
        self._suffix = {kind: key_suffix(kind, p, ns, tp_rank, self.dcp_rank, cp_rank, pp_rank)
                        for kind, p in pools.items()}
        self._writes = {kind: writes(p, tp_rank, self.dcp_size) for kind, p in pools.items()}
        self._payload = {kind: p.view.payload_bytes for kind, p in pools.items()}
        self.tp_rank = tp_rank
        # SGLang's own switch: with --enable-metrics these appear on the server's /metrics
        self.metrics = create_metrics(bool(getattr(server_args, "enable_metrics", False)), tp_rank,
                                      self._metric_totals)

        self._lock = threading.Lock()  # the counters: scheduler and loop threads
        self._c: collections.Counter[str] = collections.Counter()  # bounded: the names in COUNTERS
        self._pending: dict[str, tuple[SyncLoad, list[str]]] = {}  # bounded: held loads until started or cancelled
        # accepted offloads' results, in order, and the bound on them (offloads.py); an offload
        # that carries a state keeps a state slot locked: at most half the slots are
        limit = self.config.offload_max_inflight
        if PoolKind.MAMBA in pools:
            limit = min(limit, max(1, pools[PoolKind.MAMBA].view.capacity // 2))
        self._offloads = OffloadBound(limit, self.config.offload_max_inflight_mb << 20)
        self._closed = False
        self._device = views.device
        self._on_device = views.device.type != "cpu"
        # staging_mb per pool, for each direction and for the frames a whole load is verified
        # in (registered once, up front). Its size also sets how many objects one store call
        # moves (half of it, at most 32 MiB): fewer, larger calls cost fewer master round trips
        biggest = max(v.payload_bytes for v in views.values())
        staging = max(self.config.staging_mb << 20, 4 * biggest)
        plane_config = DataPlaneConfig(staging_bytes_per_pool=staging, verify_all_staging_bytes=staging,
                                       integrity=self.config.integrity_level,
                                       two_stage_offload=self.config.two_stage_offload,
                                       host_staging_bytes=self.config.host_staging_bytes)
        self.data = SyncDataPlane(views, self._open_store, plane_config, fingerprint=self.fingerprint)
        #: two stages: the data plane's host staging budget (derived: config.derived_staging_bytes)
        self.host_staging = self.data.plane.host_staging
        if self.host_staging is not None and self.config.host_staging_bytes is None:
            derived = self.config.derived_staging_bytes(self.host_staging.capacity)
            self.host_staging.capacity = max(self.host_staging.floor, derived)
        self._draining: set[concurrent.futures.Future[TransferOutcome]] = set()  # two stages: puts not yet answered
        store = self.data.store
        assert isinstance(store, ResilientStore)
        self.store: ResilientStore = store
        #: how loads end: layers completed, restored keys remembered, bad objects condemned (load_ends.py)
        self._ends = LoadEnds(self.layer_done_counter, self.data, store, self.config.store_timeout_s,
                              self._count, self._observe_load)
        self._condemned = self._ends.condemned  # kept out of lookups (test_blast_radius.py)
        #: object keys and rows of SGLang's transfers (transfers.py); the lookup's store calls (store_probe.py)
        self._names = TransferNames(pools, self._suffix, self._writes, self.data, self._ends.restored, self._count)
        self._probe = StoreProbe(self.config, self.data, store, self._names, self._count)
        log.info("HylinkerLinker: store=%s pools=%s tp_rank=%d layers=%d", self.config.store,
                 {k.value: v.payload_bytes for k, v in views.items()}, tp_rank, self.num_layers)

    async def _open_store(self) -> Store:
        """The configured store (fault plan wrapped around it) under the one retry rule."""
        return ResilientStore(await self.config.open_store(), self.config.resilience())

    # ---- keys -------------------------------------------------------------------------
    def object_keys(self, pool: str, page_keys: Sequence[str]) -> list[str]:
        """Store keys of ``pool``'s objects for SGLang's page keys (on this rank)."""
        return self._names.object_keys(pool, page_keys)

    def rows(self, pool: str, indices: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``pool`` for SGLang's transfer indices: the indices themselves, or
        under DCP the rows this DCP rank holds of the widened KV locs (``pools.DcpShare``)."""
        return self._names.rows(pool, indices)

    def _count(self, name: str, n: int = 1) -> None:
        assert name in COUNTERS, name
        with self._lock:
            self._c[name] += n
        metric = METRIC_OF.get(name)
        if metric is not None and self.metrics is not None:
            self.metrics.count(metric[0], n, *metric[1:])

    def _metric_totals(self) -> Figures:
        """The data plane's and the store's cumulative figures, as metrics keys (see
        ``runtime/dataplane/metrics.py``); the plugin counts loads and offloads itself."""
        return {**plane_figures(self.data.pool_statistics()), **store_figures(self.store.resilience()),
                **store_identity_figures(self.store, self.data.plane.config.integrity.value)}

    def _publish_metrics(self, force: bool = False) -> None:
        if self.metrics is not None and not self._closed:
            self.metrics.publish(force=force)

    # ---- lookup -----------------------------------------------------------------------
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        by_name = {str(getattr(t.name, "value", t.name)): t for t in transfers}
        kv = by_name.get("kv")
        if kv is None or not kv.keys or self._closed:
            return []
        pages = list(kv.keys)
        probe = {PoolKind.FULL: self.object_keys("kv", pages)}
        with_state = "mamba" in by_name and PoolKind.MAMBA in self._kinds
        swa = by_name.get("swa") if PoolKind.SWA in self._kinds else None
        if swa is not None:  # every tail page: a window may end at any of them
            probe[PoolKind.SWA] = self.object_keys("swa", pages)
        if PoolKind.DRAFT in self._kinds:
            probe[PoolKind.DRAFT] = self.object_keys("draft", pages)
        if with_state:
            probe[PoolKind.MAMBA] = self.object_keys("mamba", pages)
        self._count("lookups")
        present = self._probe.ask(rid, probe)
        if present is None:  # a miss (every rank's MIN agrees)
            return []
        if len(self._condemned):  # most lookups find nothing remembered
            for kind, names in probe.items():
                present[kind] = [ok and fresh for ok, fresh in zip(present[kind], self._condemned.absent(names))]
        needs = [(ALL_PAGES, present[PoolKind.FULL])]
        if PoolKind.DRAFT in present:
            needs.append((ALL_PAGES, present[PoolKind.DRAFT]))
        if with_state:
            needs.append((TRAILING_PAGES, present[PoolKind.MAMBA]))
        trailing = 0
        if swa is not None:
            # SGLang's rule for a TRAILING_PAGES pool: a stop n needs the window's pages below it,
            # as many as the lookup's SWA transfer names (the window, or the tail if shorter)
            trailing = max(1, len(swa.keys or ()))
            needs.append((window(trailing), present[PoolKind.SWA]))
        counts = restorable_stops(needs, len(pages))
        trace("sglang.lookup", request_id=rid, pages=len(pages), hit_pages=counts[-1] if counts else 0,
              stops=len(counts), state=with_state, swa_window=trailing)
        if counts:
            self._count("lookup_hits")
            self._count("hit_tokens", counts[-1] * self.page_size)
            self._probe.touch(pages[:counts[-1]], with_state, trailing)
        else:
            self._count("lookup_misses")
        return counts

    # ---- load -------------------------------------------------------------------------
    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        if self._closed:
            return False
        if rid in self._pending:
            raise RuntimeError(f"HylinkerLinker: a load for rid={rid} is already queued")
        try:
            trs, keys = self._names.transfers(transfers, offload=False)
            if not trs:
                self._count("loads_refused")
                trace("sglang.load.refused", request_id=rid, reason="no objects")
                return False
            # held until start_layer_wise_loading; verified whole before a row is written
            self._pending[rid] = (self.data.load(trs, request_id=rid, start=False, verify_all=True), keys)
        except PoolViewError as exc:  # malformed transfers: the same on every rank
            log.error("HylinkerLinker refuses load rid=%s: %s", rid, exc)
            self._count("loads_refused")
            trace("sglang.load.refused", request_id=rid, reason=str(exc))
            return False
        trace("sglang.load.queued", request_id=rid, objects=len(keys))
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        rids, loads = list(self._pending), list(self._pending.values())
        self._pending = {}
        index: int = self.layer_done_counter.update_producer()
        self._count("load_batches")
        trace("sglang.load.start", counter_index=index, request_ids=rids)
        LoadBatch(self._ends.hooks, index, self.num_layers, loads)
        # on a device: no row is written before the forward stream is past the rows' last use
        fence = record_fence(self._device) if self._on_device else None
        self.data.start(*(load for load, _ in loads), fence=fence)
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed: bool = self.layer_done_counter.finish(counter_index)
        return landed

    def cancel_queued_load(self, rid: str) -> bool:
        held = self._pending.pop(rid, None)
        if held is None:
            return False
        self.data.cancel(held[0])  # held, never started: it ends here, untouched
        self._count("loads_cancelled")
        return True

    def _observe_load(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe("load_seconds", seconds)

    # ---- offload ----------------------------------------------------------------------
    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        nbytes = named_bytes(transfers, self._payload)
        if not self._closed and self._offloads.refuses(nbytes):
            # refused: SGLang unlocks the node, which stays on the device unpersisted
            self._count("offloads_refused")
            trace("sglang.offload.refused", session_id=session_id or "",
                  in_flight=len(self._offloads.results), bytes_in_flight=self._offloads.bytes)
            return False
        result = self._offloads.accept(nbytes)
        if self._closed:
            result.set_result(False)
            return True
        try:
            trs, keys = self._names.transfers(transfers, offload=True)
        except PoolViewError as exc:
            log.error("HylinkerLinker offload with malformed transfers: %s", exc)
            trs, keys = [], []
        if not keys:
            self._offloaded(result, False)
            return True
        fence = AllEvents(self.record_offload_ready()) if self._on_device and trs else None
        t0 = time.perf_counter()
        trace("sglang.offload", session_id=session_id or "", objects=sum(len(t.keys) for t in trs),
              skipped=len(keys) - sum(len(t.keys) for t in trs))
        if self.host_staging is None or not trs:
            done = self.data.offload(trs, fence=fence, request_id=session_id or "")
            done.add_done_callback(lambda f: self._offloaded(result, _ok(f), t0))
            return True
        # two stages: SGLang hears at the copy (its node unlocks), the counters at the store's answer
        copied: concurrent.futures.Future[bool] = concurrent.futures.Future()
        done = self.data.offload(trs, fence=fence, request_id=session_id or "", copied=copied)
        with self._lock:
            self._draining.add(done)
        copied.add_done_callback(lambda f: self._copied(result, f, session_id or ""))
        written = [key for t in trs for key in t.keys]
        done.add_done_callback(lambda f: self._offloaded(None, _ok(f), t0, f, written))
        return True

    def _copied(self, result: concurrent.futures.Future[bool], copied: concurrent.futures.Future[bool],
                session_id: str) -> None:
        """Stage 1 ended: SGLang's result, popped next round, unlocks its node. Always False ("not
        stored"): SGLang's only other answer would mark the node stored before the store
        acknowledged it, and a failed put would then never be offered again (design: sglang.md)."""
        exc = copied.exception()
        if isinstance(exc, HostStagingFullError):
            self._count("offloads_refused_staging")
            trace("sglang.offload.skipped", session_id=session_id, reason="host_staging_full", error=str(exc))
        result.set_result(False)

    def _offloaded(self, result: concurrent.futures.Future[bool] | None, ok: bool, t0: float | None = None,
                   done: concurrent.futures.Future[TransferOutcome] | None = None,
                   written: Sequence[str] = ()) -> None:
        if done is not None:  # two stages: the store answered a drained offload
            with self._lock:
                self._draining.discard(done)
            if isinstance(done.exception(), HostStagingFullError):
                return  # never ran: counted at the copy (offloads_refused_staging)
            if ok:  # stored: the node's next offer writes nothing and reports True
                self._ends.restored.add(written)
        self._count("offloads_ok" if ok else "offloads_failed")
        if t0 is not None and self.metrics is not None:
            self.metrics.observe("offload_seconds", time.perf_counter() - t0)
        if result is not None:
            result.set_result(ok)

    def wait_drained(self, timeout_s: float | None = None) -> bool:
        """Wait until every offload reported back to SGLang also has the store's answer (two
        stages: its frames drained from host staging); False if ``timeout_s`` passed first."""
        with self._lock:
            draining: list[concurrent.futures.Future[TransferOutcome]] = list(self._draining)
        _, left = concurrent.futures.wait(draining, timeout=timeout_s)
        return not left

    def num_completed_offloads(self) -> int:
        self._probe.new_round()  # called once per scheduler round
        self._publish_metrics()  # called every scheduler round; publishes at most once a second
        return self._offloads.completed()

    def pop_completed_offload(self) -> bool:
        return self._offloads.pop()

    # ---- life cycle -------------------------------------------------------------------
    def reset(self, timeout_s: float | None = None) -> None:
        """Quiesce: drop queued loads, wait for started transfers (at most ``timeout_s``, by
        default twice the store timeout, the data plane's quiesce and the results together),
        forget their results."""
        for held, _ in self._pending.values():
            self.data.cancel(held)
        self._pending.clear()
        wait_s = self.config.store_timeout_s * 2 if timeout_s is None else timeout_s
        end = time.monotonic() + wait_s
        if not self._closed:
            self.data.reset(timeout_s=wait_s)
        concurrent.futures.wait(list(self._offloads.results), timeout=_left(end))
        self._offloads.clear()
        self.layer_done_counter.reset()
        self._ends.restored.clear()

    def close(self) -> None:
        """Drain, then stop, all within ``close_timeout_s`` (SGLang kills a scheduler whose
        close outlasts its 15 s shutdown wait): writes in flight get ``drain_timeout_s``, at
        most :data:`CLOSE_DRAIN_SHARE` of the bound; frames still waiting for their put are then
        dropped (failed, counted, never marked stored), puts still at the store are abandoned
        (``offloads_abandoned_at_close``) and everything after shares what is left."""
        if self._closed:
            return
        t0 = time.monotonic()
        end = t0 + self.config.close_timeout_s
        drain_end = t0 + min(self.config.drain_timeout_s, self.config.close_timeout_s * CLOSE_DRAIN_SHARE)
        phases: dict[str, float] = {}
        with self._lock:
            draining = list(self._draining)
        pending: list[concurrent.futures.Future[Any]] = [f for f in self._offloads.results if not f.done()]
        pending += draining
        if pending:  # writes in flight get their share of the bound, then the store fails fast
            concurrent.futures.wait(pending, timeout=_left(drain_end))
        if self.host_staging is not None and any(not f.done() for f in draining):
            # frames still waiting for their put are dropped: failed, counted, never marked stored
            with contextlib.suppress(Exception):
                self.data.drop_staged()
        phases["drain"] = time.monotonic() - t0
        with contextlib.suppress(Exception):  # the last figures; a dead store must not stop close
            self._publish_metrics(force=True)
        # a dead master makes each store step slow (Mooncake's put cannot be abandoned, its
        # segment unmount RPC retries): what is left past the bound finishes in the background
        try:
            self.data.call_store(self.store.shutdown).result(
                timeout=min(self.store.policy.close_grace_s + 5, _left(end)))
        except Exception as exc:
            log.warning("HylinkerLinker: store shutdown: %r", exc)
        self.reset(timeout_s=_left(end))
        phases["shutdown"] = time.monotonic() - t0
        with self._lock:
            abandoned = sum(not f.done() for f in self._draining)
        if abandoned:  # their put is still at the store: never marked stored here
            self._count("offloads_abandoned_at_close", abandoned)
        self._closed = True
        closer = threading.Thread(target=self.data.close, name="hylinker-close", daemon=True)
        closer.start()
        closer.join(timeout=_left(end))
        phases["close"] = time.monotonic() - t0
        if closer.is_alive() or abandoned:
            log.warning("HylinkerLinker: close gave up after %.1f s (close_timeout_s): %d puts still at "
                        "the store, the data plane %s", phases["close"], abandoned,
                        "still closing" if closer.is_alive() else "closed")
        log.info("HylinkerLinker closed in %s s: %s",
                 {k: round(v, 3) for k, v in phases.items()}, dict(self._c))

    def statistics(self) -> SGLangLinkerStatistics:
        """The plugin's counters (lookups, hits, loads, offloads, skipped objects), the data
        plane's per-pool transfers summed, and the store's retry rule (retries, exhausted keys,
        timeouts, breaker trips)."""
        with self._lock:
            out = {name: self._c[name] for name in COUNTERS}
        out.update(self._offloads.figures())
        if self.host_staging is not None:
            figures = self.host_staging.figures()
            out.update({name: figures[name] for name in STAGING_FIGURES})
        pools = self.data.pool_statistics().values()
        out.update({name: sum(int(getattr(p, name)) for p in pools) for name in POOL_SUMS})
        res = self.store.resilience()
        out.update({f"store_{name}": int(getattr(res, name)) for name in STORE_COUNTS})
        return SGLangLinkerStatistics(**out)


#: the most of ``close_timeout_s`` the writes in flight may take (the rest: store and data plane)
CLOSE_DRAIN_SHARE = 0.6


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), never negative."""
    return max(0.0, deadline - time.monotonic())


def _ok(future: concurrent.futures.Future[TransferOutcome]) -> bool:
    try:
        return bool(future.result().ok)
    except Exception:
        return False


__all__ = ["SGLANG_VERSION", "HylinkerLinker", "LoadFailedError"]
