"""``HylinkerConnector``: hylinker as vLLM 0.32's KV connector, for hybrid and attention models.

Load it with::

    --kv-transfer-config '{"kv_connector": "HylinkerConnector",
        "kv_connector_module_path": "hylinker.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "mooncake", "master": "127.0.0.1:50051", "segment_mb": 0}}'

(``extra_config`` keys: :class:`~hylinker.integrations.vllm.config.VllmConnectorConfig`.) vLLM
builds one instance per role: the *scheduler* side decides hits, loads and saves
(:mod:`~hylinker.integrations.vllm.plan` holds its rules), one *worker* side per tensor-parallel
rank moves that rank's pages (:mod:`~hylinker.integrations.vllm.pages`) under keys that carry
the rank. The scheduler learns what every rank holds from the store itself (Mooncake) or, for a
store inside each worker (embedded), from the reports the workers send with vLLM's connector
output each step (:mod:`~hylinker.integrations.vllm.index`); so both stores work in vLLM's
default process model, where the scheduler and the workers are different processes.

What it guarantees:

* a hit of ``T`` tokens is offered only when every attention block from the engine's own hit up
  to ``T`` and every recurrent state group's state at exactly ``T`` are in the store for every
  tensor-parallel rank, and ``T < prompt length``;
* loads are asynchronous (vLLM copies a checkpoint state into the running block *before*
  ``start_load_kv``, so a synchronous state load would land too late, silently);
* boundary states are saved from the blocks vLLM offers in ``boundary_state_offloads``, in the
  step that offers them; attention blocks when they fill; both are copied before
  ``wait_for_save`` returns and written to the store off the step; restored blocks and blocks the
  store already held are not written again; the null block is never read or written;
* a failed or damaged load is reported in ``failed_recving``: with
  ``kv_load_failure_policy: "recompute"`` vLLM recomputes the request, and the connector does not
  offer that request a store hit again. vLLM counts a load finished only when every rank reported
  it and fails it when any rank failed it, so a load that fails on one rank recomputes on all;
* ``shutdown`` waits for writes in flight, at most ``drain_timeout_s``.

Limits: pipeline parallel size 1; attention groups must be full attention (MHA or MLA); states
exist only where vLLM takes them (``mamba_cache_mode: "align"``, at block boundaries where a
prefill chunk ends).
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import attrs
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ...components.identity import model_identity, namespace_term
from ...runtime.dataplane.host_staging import check_budget
from ...runtime.dataplane.tracing import trace
from .. import store_host
from . import metrics as vllm_metrics
from .cache_groups import cache_geometry, cache_groups, key_layout
from .config import VllmConnectorConfig
from .index import (
    ObjectLookup,
    RankReport,
    StoreIndex,
    StoreProbe,
)
from .metadata import HylinkerConnectorMetadata, HylinkerWorkerMetadata, Tracked
from .pages import PageTransfers, RawPages, derived_staging_bytes, step_staging_bytes
from .plan import (
    LoadSpec,
    TransferPlan,
    UnkeyableRequest,
    attention_key,
    geometry_seed,
    load_plan,
    restorable_blocks,
    state_key,
)
from .request_keys import request_block_keys
from .statistics import SCHEDULER_COUNTERS, VLLMConnectorStatistics, counted

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.hylinker")  # under vLLM's logger: its format and level
#: longest a worker blocks in a step that computes nothing, waiting for a load in flight to end.
#: vLLM steps back to back while a request waits for its load; each empty step holds the GIL,
#: which the load's threads need between their store calls (a 4 K-token restore on Mooncake took
#: ~4x as long). Blocking releases the GIL and returns as soon as a load ends.
IDLE_LOAD_WAIT_S = 0.005


class HylinkerConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector over hylinker's data plane; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("HylinkerConnector needs vLLM's KV cache config (vLLM >= 0.32)")
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.config = VllmConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        # one JSON line per phase event (stderr, or the trace_file), with vLLM's request id
        self.config.start_tracing("kv_connector_extra_config")
        self.stats = vllm_metrics.StatsReporter()  # figures for vLLM's stats path (metrics)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError(f"HylinkerConnector: pipeline_parallel_size {parallel.pipeline_parallel_size} "
                             "is not supported (each pipeline stage holds other layers); use 1")
        if getattr(parallel, "decode_context_parallel_size", 1) != 1:
            raise ValueError("HylinkerConnector: decode_context_parallel_size must be 1")
        self.ranks = parallel.tensor_parallel_size
        if ktc.kv_load_failure_policy != "recompute":
            log.warning("hylinker: kv_load_failure_policy is %r; a failed load then fails its request. "
                        "Set it to \"recompute\" to recompute instead.", ktc.kv_load_failure_policy)
        self.block_size = vllm_config.cache_config.block_size
        self.groups = cache_groups(kv_cache_config, self.block_size)
        self.rank = 0
        self.host: store_host.StoreHost | None = None
        self.lookup: ObjectLookup
        self.layout = key_layout(vllm_config, self.ranks, shared_store=self.config.store != "embedded")
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = get_tensor_model_parallel_rank() if self.ranks > 1 else 0
            self.host = self._open_store(role, self.config.for_rank(self.rank))
            self.lookup = StoreIndex(self.ranks)  # unused on this side
        elif self.config.store == "embedded":
            self.lookup = StoreIndex(self.ranks)  # each worker's store, known from its reports
        else:
            self.host = self._open_store(role, self.config.for_scheduler())
            self.lookup = StoreProbe(self.host, self.layout)
        self.incarnation = uuid.uuid4().hex
        geometry = cache_geometry(vllm_config, kv_cache_config)
        model = str(vllm_config.model_config.model)
        self.seed = geometry_seed(model, geometry, self.config.salt, namespace_term(
            model_identity(model, self.config.model_revision), self.config.integrity))
        self.counters: dict[str, int] = dict.fromkeys(SCHEDULER_COUNTERS, 0)
        # scheduler side
        # bounded: the scheduler's live requests (these four); _forget drops each when it finishes
        self._requests: dict[str, Tracked] = {}
        self._pending: dict[str, LoadSpec] = {}
        self._no_store_hit: set[str] = set()
        self._unkeyable: set[str] = set()  # requests served without the store (request_keys)
        self._step = HylinkerConnectorMetadata()
        # worker side
        self._transfers: PageTransfers | None = None
        self._closed = False
        log.info("hylinker: %s connector (rank %d of %d), groups attention=%s state=%s, block %d, store %s, "
                 "attention pages written by ranks %s", role.name.lower(), self.rank, self.ranks,
                 self.groups.attention, self.groups.state, self.block_size, self.config.store,
                 list(self.layout.blocks.copies()))

    def _open_store(self, role: KVConnectorRole, config: VllmConnectorConfig) -> store_host.StoreHost:
        """This process's store; one that cannot be opened stops startup, naming it."""
        try:
            return store_host.acquire(config)
        except Exception as exc:
            where = f" at {config.master}" if config.master else ""
            raise RuntimeError(f"HylinkerConnector ({role.name.lower()} side, rank {self.rank}): cannot open "
                               f"store {config.store!r}{where}: {exc}") from exc

    # ================================ scheduler side ================================
    def _tracked(self, request: Request) -> Tracked | None:
        """The request's state; None for a request its keys cannot describe (no store for it)."""
        rid = request.request_id
        t = self._requests.get(rid)
        if t is None or t.request is not request:
            if rid in self._unkeyable:
                return None
            try:
                t = Tracked(request, request_block_keys(self.seed, self.block_size, request))
            except UnkeyableRequest as exc:
                self._refuse(rid, exc)
                return None
            self._requests[rid] = t
        return t

    def _keys(self, tracked: Tracked, n_blocks: int) -> list[bytes] | None:
        """The request's first ``n_blocks`` block keys; None (and no store for it from now on)
        where its extra keys cannot be described."""
        try:
            return tracked.keys.extend(tracked.request.all_token_ids, n_blocks)
        except UnkeyableRequest as exc:
            self._refuse(tracked.request.request_id, exc)
            return None

    def _refuse(self, rid: str, exc: UnkeyableRequest) -> None:
        """Serve ``rid`` without the store: no lookup, no load, no save; counted and logged."""
        if rid in self._unkeyable:
            return
        self.counters["requests_unkeyable"] += 1
        self._unkeyable.add(rid)
        self._requests.pop(rid, None)
        self._pending.pop(rid, None)
        log.warning("hylinker: request %s is served without the store: %s", rid, exc)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self.block_size
        tracked = self._tracked(request)
        if tracked is None:
            return 0, False
        local = num_computed_tokens // bs
        tracked.saved_blocks = max(tracked.saved_blocks, local)
        last = (request.num_tokens - 1) // bs  # one token must run
        self._pending.pop(request.request_id, None)
        if last <= local or request.request_id in self._no_store_hit:
            return 0, False
        keys = self._keys(tracked, last)
        if keys is None:
            return 0, False
        names = self.groups.probe_keys(keys, local)
        self.counters["lookups"] += 1
        present = self.lookup.exists(names, self.config.lookup_timeout_s)
        if present is None:
            self.counters["lookup_errors"] += 1
            return 0, False
        per_block = self.groups.per_block
        n_attn = len(self.groups.attention)
        # blocks the store already holds are not written again
        stored = local
        while stored < last and all(present[(stored - local) * per_block:(stored - local) * per_block + n_attn]):
            stored += 1
        tracked.saved_blocks = max(tracked.saved_blocks, stored)
        n = restorable_blocks(self.groups, local, last, present)
        if n <= local:
            return 0, False
        self._pending[request.request_id] = LoadSpec(request.request_id, local, n, tuple(keys[:n]))
        self.counters["lookup_hits"] += 1
        self.counters["hit_tokens"] += (n - local) * bs
        trace("vllm.lookup", request_id=request.request_id, device_tokens=local * bs, store_tokens=(n - local) * bs)
        return (n - local) * bs, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._tracked(request)
        spec = self._pending.pop(request.request_id, None)
        if num_external_tokens == 0 or spec is None or tracked is None:
            return
        try:
            plan = load_plan(spec, self.groups, blocks.get_block_ids())
        except ValueError as exc:
            log.warning("hylinker: cannot load %s: %s; it recomputes", request.request_id, exc)
            self.counters["loads_refused"] += 1
            self._step.failed_loads.append(request.request_id)
            return
        tracked.saved_blocks = max(tracked.saved_blocks, spec.last)
        tracked.stored_states.add(spec.last)
        self.counters["loads_planned"] += 1
        self._step.loads.append(plan)
        trace("vllm.load.planned", request_id=request.request_id, kv_objects=len(plan.kv_keys),
              state_objects=len(plan.state_keys))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        step, self._step = self._step, HylinkerConnectorMetadata()
        step.idle = scheduler_output.total_num_scheduled_tokens == 0
        block_state = scheduler_output.kv_connector_block_state
        if block_state is None:
            return step
        bs = self.block_size
        kv: dict[str, tuple[list[str], list[int]]] = {}
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests.get(rid)
            if tracked is None:
                continue
            tokens = tracked.request.all_token_ids
            n_full = min(tracked.request.num_computed_tokens + n_sched, len(tokens)) // bs
            if n_full <= tracked.saved_blocks:
                continue
            block_ids = block_state.get_block_ids(rid)
            if block_ids is None:
                continue
            keys = self._keys(tracked, n_full)
            if keys is None:
                continue
            names: list[str] = []
            ids: list[int] = []
            for g in self.groups.block_groups:
                for i in range(tracked.saved_blocks, min(n_full, len(block_ids[g]), len(keys))):
                    if block_ids[g][i] != 0:  # never the null block
                        names.append(attention_key(keys[i], g))
                        ids.append(block_ids[g][i])
            tracked.saved_blocks = n_full
            if names:
                kv[rid] = (names, ids)
        states: dict[str, tuple[list[str], list[int]]] = {}
        for rid, offers in block_state.boundary_state_offloads.items():
            tracked = self._requests.get(rid)
            if tracked is None or rid in self._unkeyable:
                continue
            for group, block, n_tokens in offers:
                boundary = n_tokens // bs
                if (group not in self.groups.state or block == 0 or n_tokens % bs or boundary == 0
                        or boundary in tracked.stored_states):
                    continue
                keys = self._keys(tracked, boundary)
                if keys is None or len(keys) < boundary:
                    continue
                names, ids = states.setdefault(rid, ([], []))
                names.append(state_key(keys[boundary - 1], group))
                ids.append(block)
            for group, _block, n_tokens in offers:
                if group in self.groups.state and n_tokens % bs == 0 and rid in states:
                    tracked.stored_states.add(n_tokens // bs)
        for rid in sorted((kv.keys() | states.keys()) - self._unkeyable):
            kn, kb = kv.get(rid, ([], []))
            sn, sb = states.get(rid, ([], []))
            self.counters["kv_saves_planned"] += len(kn)
            self.counters["state_saves_planned"] += len(sn)
            self.lookup.planned(kn + sn)
            step.saves.append(TransferPlan(rid, tuple(kn), tuple(kb), tuple(sn), tuple(sb)))
            trace("vllm.save.planned", request_id=rid, kv_objects=len(kn), state_objects=len(sn))
        return step

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        failed = getattr(connector_output, "failed_recving", None) or ()
        self._no_store_hit.update(failed)  # a damaged prefix is not offered to that request again
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, HylinkerWorkerMetadata):
            for report in meta.reports:
                self.lookup.apply(report)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves copied their pages before the step ended

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
        self._pending.pop(rid, None)
        self._no_store_hit.discard(rid)
        self._unkeyable.discard(rid)

    # ================================ worker side ================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._kv_cache_config is not None and self.host is not None
        pages = RawPages(kv_caches, self._kv_cache_config.num_blocks)
        fingerprint = hashlib.sha256(self.seed + pages.geometry().encode()).digest()
        budget = self.config.host_staging_bytes
        if budget is not None:  # at least one object: a smaller budget could take no save at all
            budget = check_budget("kv_connector_extra_config['host_staging_bytes']", budget, sum(pages.page_bytes))
        else:
            budget = derived_staging_bytes(pages, step_staging_bytes(
                pages, floor_bytes=sum(pages.page_bytes),
                tokens_per_step=self._vllm_config.scheduler_config.max_num_batched_tokens,
                block_size=self.block_size, state_groups=len(self.groups.state)))
        self._transfers = PageTransfers(self.host, pages, fingerprint=fingerprint,
                                        with_state=bool(self.groups.state), staging_bytes=budget,
                                        rank=self.rank,
                                        integrity=self.config.integrity_level, layout=self.layout)
        for plane in (self._transfers.engine_plane, self._transfers.staging_plane):
            self.stats.watch(plane)
        self.host.on_evict(self._transfers.note_evicted)
        log.info("hylinker: rank %d registered %d raw KV tensors, pages of %s bytes", self.rank,
                 len(pages.raws), pages.page_bytes)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._transfers is None:
            return None
        stored, dropped = self._transfers.take_report()
        if not stored and not dropped:
            return None
        return HylinkerWorkerMetadata((RankReport(self.rank, self.incarnation, tuple(stored), tuple(dropped)),))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HylinkerConnectorMetadata)
        if self._transfers is None:
            return
        for plan in meta.loads:
            self._transfers.load(plan)
        self._transfers.fail_now(meta.failed_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request runs only after get_finished reported it

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # pages are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HylinkerConnectorMetadata)
        if self._transfers is not None and meta.saves:
            self._transfers.save(meta.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._transfers is None:
            return KVConnectorTransferResults()
        meta = self._connector_metadata
        if isinstance(meta, HylinkerConnectorMetadata) and meta.idle:
            self._transfers.wait_for_loads(IDLE_LOAD_WAIT_S)
        ok, failed = self._transfers.finished_loads()
        for rid in ok | failed:
            trace("vllm.load.done", request_id=rid, ok=rid in ok)
        return KVConnectorTransferResults(finished_recving=ok | failed, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving

    # ---- metrics: vLLM's connector-stats path (integrations/vllm/metrics.py) ----
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return vllm_metrics.report(self.stats, self.counters, self._transfers,
                                   None if self.host is None else self.host.breaker)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return vllm_metrics.HylinkerStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return vllm_metrics.HylinkerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def statistics(self) -> VLLMConnectorStatistics:
        """This instance's counters: the scheduler's, or on a worker its page transfers' too."""
        out = counted(self.counters, SCHEDULER_COUNTERS)
        if self._transfers is not None:
            out.update(attrs.asdict(self._transfers.statistics()))
        return VLLMConnectorStatistics(**out)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        start = time.monotonic()
        try:
            if self._transfers is not None:
                self._transfers.close(self.config.drain_timeout_s)
        finally:
            if self.host is not None:
                store_host.release(self.host)
        if self._transfers is not None:
            log.info("hylinker: rank %d worker shut down in %.2f s; statistics %s", self.rank,
                     time.monotonic() - start, attrs.asdict(self.statistics()))


__all__ = ["HylinkerConnector", "HylinkerConnectorMetadata", "HylinkerWorkerMetadata"]
