"""SGLang's real ``UnifiedRadixCache`` (FULL + MAMBA, FULL + SWA + MAMBA, or a dense model's FULL) on CPU, driven the way
its scheduler does.

For the SGLang plugin's tests and benchmark; needs ``sglang==0.5.23`` (``.ci/sglang-setup.sh``
builds that environment). :class:`SGLangCache` builds SGLang's own pools (a
``HybridLinearKVPool`` with an MLA or MHA full-attention pool, a ``HybridReqToTokenPool`` with a
Mamba2 state pool, a paged token allocator), publishes ``ServerArgs`` for the scheduler, and
creates the linker through SGLang's own factory (``create_unified_cache_linker``), exactly as
SGLang's cache registry does. :meth:`SGLangCache.serve` then runs one request through the
scheduler's steps:

``Req.init_next_round_input`` (match + linker lookup, MIN over ranks) → ``init_load_back``
(linker ``load``) → request slots and KV rows → ``ready_to_load_host_cache`` (linker
``start_layer_wise_loading``) → a synthetic forward that waits on every layer through the
pools' own getters (``get_key_buffer``, ``mamba2_layer_cache``) → ``finish_external_linker_loads``
→ ``release_kv_cache(checkpoint=True)`` (insert + offloads) → ``check_hicache_events``.

The synthetic forward writes bytes that are a pure function of the tokens and the request's
namespace (``extra_key``, ``cache_salt``: what SGLang keys its tree and storage by; a LoRA
adapter's id is part of ``extra_key``): KV row ``p`` of layer ``l`` from a chained hash of
``tokens[:p+1]``, the Mamba state of every layer from a hash of the tokens the tree will key it
by. So a restored row or state can be compared byte for byte with what a recompute under the
request's own namespace would have written (:attr:`Served.restore_mismatches`).
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from .sglang_pools import SGLANG_VERSION, ServerArgsOverlay, build_pools
from .sglang_pools import CacheSpec as CacheSpec
from .sglang_pools import install_cpu_shims as install_cpu_shims
from .sglang_pools import page_keys as page_keys


@attrs.define
class Served:
    """What one request went through."""

    rid: str
    tokens: int
    device_hit: int  # tokens matched in the device tree
    store_hit: int  # tokens the ranks agreed to load (SGLang's host_hit_length)
    loaded: int  # tokens init_load_back queued
    aborted: bool  # the load failed: SGLang finishes the request with 503
    restore_mismatches: list[str]  # restored rows/state that differ from a recompute (must be empty)
    load_s: float = 0.0  # start_layer_wise_loading .. finish_external_linker_loads (the load)
    offload_s: float = 0.0  # release (insert + offloads queued) .. every offload reported and stored
    #: release .. every offload reported to SGLang (its rows unlocked); two stages: before the store has them
    reported_s: float = 0.0


class SGLangCache:
    """One SGLang cache (one rank) with an external linker; see the module docstring."""

    def __init__(self, spec: CacheSpec, linker_config: dict[str, Any] | None, *,
                 backend: str = "dynamic", tp_group: Any = None) -> None:
        """``tp_group``: a ``torch.distributed`` group of this cache's TP ranks (gloo on CPU);
        SGLang then reduces lookups and load/offload results over it, as its scheduler does."""
        install_cpu_shims()
        import sglang
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        if sglang.__version__ != SGLANG_VERSION:
            raise RuntimeError(f"the harness targets sglang=={SGLANG_VERSION}, found {sglang.__version__}")
        self.spec = spec
        P = spec.page_size
        if spec.model not in ("hybrid", "dense", "swa_mamba"):
            raise ValueError(f"CacheSpec.model must be 'hybrid', 'dense' or 'swa_mamba', not {spec.model!r}")
        self.dense = spec.model == "dense"
        self.swa = spec.model == "swa_mamba"
        if self.swa and (P != 1 or spec.kv != "mha"):
            raise ValueError("CacheSpec(model='swa_mamba') needs page_size=1 and kv='mha'")
        D = spec.dcp_size
        if D < 1 or not 0 <= spec.dcp_rank < D:
            raise ValueError(f"bad DCP rank {spec.dcp_rank} of {D}")
        # the tree page: SGLang's tree and allocator page, widened under DCP; SGLang's SWA
        # allocators never widen (kv_cache_configurator.logical_token_capacity)
        W = P if self.swa else P * D
        self.tree_page = W
        self.full_layers = list(range(spec.num_layers)) if self.dense else list(spec.full_layers)
        self.mamba_layers = [] if self.dense else [i for i in range(spec.num_layers) if i not in spec.full_layers]
        self.swa_layers = list(self.mamba_layers) if self.swa else []
        server_args = ServerArgs(
            model_path="dummy", page_size=P,
            enable_unified_cache_external_linker=linker_config is not None,
            unified_cache_external_linker_backend=backend if linker_config is not None else None,
            unified_cache_external_linker_config=linker_config, enable_metrics=spec.enable_metrics)
        server_args._mamba_cache_chunk_size = max(64, W)
        if spec.lora_paths:  # as SGLang's LoRA argument hook leaves them (without loading any)
            from sglang.srt.lora.lora_registry import LoRARef

            server_args.lora_paths = [LoRARef(lora_id=LoRARef.deterministic_id(n, p), lora_name=n, lora_path=p)
                                      for n, p in spec.lora_paths]
        set_global_server_args_for_scheduler(server_args)
        self.server_args = server_args
        self.publish_dcp()
        built = build_pools(spec, W, self.mamba_layers, self.swa_layers)
        self.req_to_token_pool, self.kvcache, self.allocator = built.req_to_token_pool, built.kvcache, built.allocator
        self.draft_pools, components = built.draft_pools, built.components
        self.params = CacheInitParams(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            page_size=W, disable=False, tree_components=components,
            enable_mamba_extra_buffer=spec.mamba_extra_buffer, eviction_policy="lru",
            sliding_window_size=spec.sliding_window if self.swa else None,
            tp_cache_group=tp_group, attn_tp_cache_group=tp_group,
            mtp_draft_device_pools=tuple(self.draft_pools))
        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(spec.tree_core):
            self.cache = UnifiedRadixCache(params=self.params)
        self.linker: Any = None
        if linker_config is not None:
            from sglang.srt.mem_cache.unified_cache.linker_factory import (
                create_unified_cache_linker,
                get_startup_linker_config,
            )

            # the plugin sees spec.model_path (SGLang itself would read a real model's config there)
            self.cache.init_cache_linker(create_unified_cache_linker(
                ServerArgsOverlay(server_args, model_path=spec.model_path), self.params, backend=backend, config=get_startup_linker_config(),
                components=set(self.cache.components), forward_stream=None))
            self.linker = self.cache.linker.cache_linker
            self.kvcache.register_layer_transfer_counter(self.cache.linker.layer_done_counter)
        self._next_rid = 0
        self.translator: Any = None
        if D > 1:
            from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

            self.translator = KVIndexTranslator(
                req_to_token=self.req_to_token_pool.req_to_token, token_to_kv_pool_allocator=self.allocator,
                token_to_kv_pool=self.kvcache, page_size=P, device="cpu")
        self.kv_buffers = self._kv_buffers()
        self.swa_buffers = ([[self.kvcache.swa_kv_pool.k_buffer[i], self.kvcache.swa_kv_pool.v_buffer[i]]
                             for i in range(len(self.swa_layers))] if self.swa else [])

    def publish_dcp(self) -> None:
        """Publish this cache's DCP size and rank in SGLang's ``get_parallel()`` (process-wide, as
        in one SGLang rank process; the caches of other DCP ranks republish theirs)."""
        from sglang.srt.runtime_context import get_parallel

        D = self.spec.dcp_size
        get_parallel().override_permanently(attn_dcp_size=D, dcp_size=D, dcp_enabled=D > 1,
                                            attn_dcp_rank=self.spec.dcp_rank if D > 1 else 0,
                                            dcp_rank=self.spec.dcp_rank if D > 1 else 0)

    def own_rows(self, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of ``locs`` (KV locs as SGLang's tree holds them) this rank holds, and at which
        rows of its pool: every one without DCP; under DCP the owner rule ``loc % dcp_size ==
        dcp_rank`` and SGLang's ``KVIndexTranslator.translate_dcp_read_ids`` for the row."""
        locs = locs.to(torch.int64)
        D = self.spec.dcp_size
        if D == 1:
            return torch.ones(locs.numel(), dtype=torch.bool), locs
        mine = locs % D == self.spec.dcp_rank
        return mine, self.translator.translate_dcp_read_ids(locs[mine]).to(torch.int64)

    # ---- the synthetic model ---------------------------------------------------------
    def _kv_buffers(self) -> list[list[torch.Tensor]]:
        """Per full layer (in ``self.full_layers`` order), then per draft layer: its row-indexed
        buffers (named in ``self.kv_names``)."""
        pool = self.kvcache if self.dense else self.kvcache.full_kv_pool
        layers = [(pool, i) for i in range(len(self.full_layers))] + [(d, 0) for d in self.draft_pools]
        self.kv_names = [f"kv layer {g}" for g in self.full_layers] + [
            f"draft layer {d}" for d in range(len(self.draft_pools))]
        out = []
        for owner, i in layers:
            if hasattr(owner, "k_buffer"):
                out.append([owner.k_buffer[i], owner.v_buffer[i]])
            else:
                out.append([owner.kv_buffer[i]])
        return out

    def state_buffers(self, slot: int) -> list[torch.Tensor]:
        """Byte views of one Mamba slot's state, every layer (temporal, then each conv); none for
        a dense model."""
        if self.dense:
            return []
        cache = self.req_to_token_pool.mamba_pool.mamba_cache
        out = []
        for i in range(len(self.mamba_layers)):
            for s in (cache.temporal, *cache.conv):
                out.append(s[i][slot].view(torch.uint8).reshape(-1))
        return out

    @staticmethod
    def _chain(tokens: Sequence[int], ns: bytes = b"") -> np.ndarray:
        """h[p] = hash of the namespace and tokens[:p+1], as uint64."""
        out = np.empty(len(tokens), dtype=np.uint64)
        h = b"hylinker-harness" + (hashlib.blake2b(ns, digest_size=8).digest() if ns else b"")
        for p, t in enumerate(tokens):
            h = hashlib.blake2b(h + int(t).to_bytes(8, "little", signed=True), digest_size=8).digest()
            out[p] = int.from_bytes(h, "little")
        return out

    @staticmethod
    def _bytes(seeds: np.ndarray, salt: int, width: int) -> np.ndarray:
        """[len(seeds), width] bytes, a pure function of (seed, salt); no NaN bit patterns."""
        words = -(-width // 8)
        mult = (np.arange(1, words + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
        with np.errstate(over="ignore"):
            x = (seeds[:, None] ^ np.uint64(salt * 0xD6E8FEB86659FD93 & 0xFFFFFFFFFFFFFFFF)) * mult[None, :]
        b = np.ascontiguousarray(x).view(np.uint8)[:, :width]
        return b & np.uint8(0x3F)  # keeps bf16/fp16 exponents small: finite values

    def expected_rows(self, tokens: Sequence[int], lo: int, hi: int, ns: bytes = b"") -> list[list[np.ndarray]]:
        """What a forward writes into KV rows of positions [lo, hi): per layer, per buffer."""
        seeds = self._chain(tokens[:hi], ns)[lo:hi]
        out = []
        for li, bufs in enumerate(self.kv_buffers):
            out.append([self._bytes(seeds, 1000 * li + bi + 1, b[0].view(torch.uint8).numel())
                        for bi, b in enumerate(bufs)])
        return out

    def expected_swa_rows(self, tokens: Sequence[int], lo: int, hi: int, ns: bytes = b"") -> list[list[np.ndarray]]:
        """What a forward writes into the sliding-window rows of positions [lo, hi)."""
        seeds = self._chain(tokens[:hi], ns)[lo:hi]
        return [[self._bytes(seeds, 50000 + 1000 * li + bi + 1, b[0].view(torch.uint8).numel())
                 for bi, b in enumerate(bufs)] for li, bufs in enumerate(self.swa_buffers)]

    def swa_rows(self, full_rows: torch.Tensor) -> torch.Tensor:
        """The sliding-window rows SGLang maps these full-attention rows to."""
        return self.allocator.translate_loc_from_full_to_swa(full_rows.to(torch.int64)).to(torch.int64)

    def expected_state(self, tokens: Sequence[int], depth: int, ns: bytes = b"") -> list[np.ndarray]:
        """The state a forward leaves at ``depth`` tokens (per state buffer, flat bytes)."""
        seed = self._chain(tokens[:depth], ns)[-1:] if depth else np.zeros(1, dtype=np.uint64)
        return [self._bytes(seed, 7919 * (i + 1), b.numel())[0]
                for i, b in enumerate(self.state_buffers(0))]

    # ---- one request ----------------------------------------------------------------
    def serve(self, tokens: Sequence[int], rid: str | None = None, *, settle: bool = True,
              before_forward: Any = None, extra_key: str | None = None, cache_salt: str | None = None,
              lora_id: str | None = None) -> Served:
        """Run one request through the scheduler's steps (see the module docstring), in the
        namespace SGLang's ``Req`` builds from ``extra_key``, ``cache_salt`` and ``lora_id``."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams
        from sglang.srt.mem_cache.common import release_kv_cache
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.publish_dcp()
        P = self.tree_page
        if rid is None:
            rid = f"req-{self._next_rid}"
            self._next_rid += 1
        tokens = list(tokens)
        L = len(tokens)
        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
                  extra_key=extra_key, cache_salt=cache_salt, lora_id=lora_id)
        # what the synthetic forward's bytes depend on besides the tokens (b"": no namespace)
        ns = b"" if req.extra_key is None and req.cache_salt is None else \
            repr((req.extra_key, req.cache_salt)).encode()
        req.init_next_round_input(self.cache)
        device_hit = int(req.prefix_len)
        store_hit = int(req.host_hit_length or 0)
        loaded = 0
        if store_hit > 0:
            loaded_len, last_node = self.cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
            req.host_loaded_length, req.last_node = loaded_len, last_node
            req.prefix_len += loaded_len
            loaded = int(loaded_len)
        if self.req_to_token_pool.alloc([req]) is None:
            raise RuntimeError("no request slot")
        prefix_len = int(req.prefix_len)
        prefix_rows = (self.cache.prefix_device_indices(req) if prefix_len
                       else torch.empty(0, dtype=torch.int64))
        extend = L - prefix_len
        n_alloc = -(-extend // P) * P
        new = self.allocator.alloc(n_alloc)
        if new is None:
            self.cache.evict(EvictParams(num_tokens=n_alloc))
            new = self.allocator.alloc(n_alloc)
        if new is None:
            raise RuntimeError("no KV rows")
        rows = torch.cat([prefix_rows.to(torch.int64), new[:extend].to(torch.int64)])
        self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :L] = rows.to(torch.int32)
        req.kv.kv_allocated_len = L
        req.kv.kv_committed_len = L
        if before_forward is not None:
            before_forward(req)
        t_load = time.perf_counter()
        index = self.cache.ready_to_load_host_cache()
        counter = self.cache.linker.layer_done_counter if self.cache.linker is not None else None
        if counter is not None and index is not None and index >= 0:
            counter.set_consumer(index)
        # the forward: each layer waits through SGLang's own getters before using the pools
        for layer in range(self.spec.num_layers):
            if layer in self.full_layers:
                self.kvcache.get_key_buffer(layer)
            else:
                if self.swa:
                    self.kvcache.get_key_buffer(layer)
                self.req_to_token_pool.mamba2_layer_cache(layer)
        failed = self.cache.finish_external_linker_loads([req])
        load_s = time.perf_counter() - t_load if loaded else 0.0
        if counter is not None:
            counter.set_consumer(-1)
        aborted = bool(failed)
        mismatches: list[str] = []
        slot = -1 if self.dense else int(req.kv.mamba_pool_idx)
        if loaded and not aborted:
            mismatches = self._check_restore(tokens, rows, device_hit, prefix_len, slot, ns)
        # write what the forward computed: new KV rows, and the state at the tree's depth
        if extend:
            expected = self.expected_rows(tokens, prefix_len, L, ns)
            new_rows = rows[prefix_len:]
            mine, own = self.own_rows(new_rows)
            for li, bufs in enumerate(self.kv_buffers):
                for bi, b in enumerate(bufs):
                    view = b.view(torch.uint8).view(b.shape[0], -1)
                    view[own] = torch.from_numpy(expected[li][bi][mine.numpy()])
            if self.swa:
                expected = self.expected_swa_rows(tokens, prefix_len, L, ns)
                swa_new = self.swa_rows(new_rows)
                for li, bufs in enumerate(self.swa_buffers):
                    for bi, b in enumerate(bufs):
                        b.view(torch.uint8).view(b.shape[0], -1)[swa_new] = torch.from_numpy(expected[li][bi])
        depth = L // P * P
        if self.spec.mamba_extra_buffer and not self.dense:
            # the forward tracks the state at the last checkpoint boundary (SGLang's grid
            # G = lcm(max(chunk, P), P)) in the ping-pong buffer; the live state runs to L
            grid = math.lcm(max(int(self.server_args._mamba_cache_chunk_size), P), P)
            depth = L // grid * grid
            track = int(req.kv.mamba_ping_pong_track_buffer[0])
            for buf, data in zip(self.state_buffers(track), self.expected_state(tokens, depth, ns)):
                buf.copy_(torch.from_numpy(data))
            req.kv.mamba_last_track_idx = 0
            req.kv.mamba_last_track_seqlen = depth if depth > 0 else None
            req.kv.mamba_prev_track_seqlen = None
            for buf, data in zip(self.state_buffers(slot), self.expected_state(tokens, L, ns)):
                buf.copy_(torch.from_numpy(data))
        else:
            for buf, data in zip(self.state_buffers(slot), self.expected_state(tokens, depth, ns)):
                buf.copy_(torch.from_numpy(data))
        req.finished_reason = FINISH_LENGTH(length=0)
        t_offload = time.perf_counter()
        release_kv_cache(req, self.cache, checkpoint=True)
        self.cache.check_hicache_events()
        offload_s = reported_s = 0.0
        if settle:
            reported_s = self.settle() - t_offload
            offload_s = time.perf_counter() - t_offload
        return Served(rid, L, device_hit, store_hit, loaded, aborted, mismatches, load_s, offload_s, reported_s)

    def _check_restore(self, tokens: list[int], rows: torch.Tensor, lo: int, hi: int,
                       slot: int, ns: bytes = b"") -> list[str]:
        bad = []
        expected = self.expected_rows(tokens, lo, hi, ns)
        mine, restored = self.own_rows(rows[lo:hi])
        for li, bufs in enumerate(self.kv_buffers):
            for bi, b in enumerate(bufs):
                got = b.view(torch.uint8).view(b.shape[0], -1)[restored].numpy()
                if not np.array_equal(got, expected[li][bi][mine.numpy()]):
                    bad.append(f"{self.kv_names[li]} buffer {bi}")
        if self.swa:  # only the window below the boundary is restored (SGLang's SWA component)
            window = min(hi - lo, self.spec.sliding_window)
            swa_lo = hi - window
            expected = self.expected_swa_rows(tokens, swa_lo, hi, ns)
            swa = self.swa_rows(rows[swa_lo:hi])
            for li, bufs in enumerate(self.swa_buffers):
                for bi, b in enumerate(bufs):
                    got = b.view(torch.uint8).view(b.shape[0], -1)[swa].numpy()
                    if not np.array_equal(got, expected[li][bi]):
                        bad.append(f"swa layer {self.swa_layers[li]} buffer {bi}")
        for i, (buf, want) in enumerate(zip(self.state_buffers(slot), self.expected_state(tokens, hi, ns))):
            if not np.array_equal(buf.numpy(), want):
                bad.append(f"state buffer {i}")
        return bad

    # ---- scheduler housekeeping -----------------------------------------------------
    def settle(self, timeout_s: float = 30.0) -> float:
        """Poll ``check_hicache_events`` until every pending offload has reported, and (two-stage
        offload) until the store answered every offload reported before its put ended. Returns
        the ``perf_counter`` time at which the last offload had reported to SGLang."""
        wrapper = self.cache.linker
        if wrapper is None:
            return time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while wrapper.pending_offloads:
            self.cache.check_hicache_events()
            if not wrapper.pending_offloads:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(wrapper.pending_offloads)} offloads did not report")
            time.sleep(0.0005)
        reported = time.perf_counter()
        drained = getattr(self.linker, "wait_drained", None)  # hylinker's linker, not SGLang's own
        if drained is not None and not drained(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("offloads still draining from host staging")
        return reported

    def flush(self) -> None:
        """SGLang's cache flush (``Scheduler.flush_cache``): the device tree and allocators are
        emptied; the store keeps its objects."""
        self.cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()
        if not self.dense:
            self.req_to_token_pool.reset_aux_cache_allocator()

    def evict_all(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=self.spec.kv_pages * self.tree_page,
                                     mamba_num=0 if self.dense else self.spec.mamba_slots))

    # ---- the store under the plugin (for damage tests) -------------------------------
    def stored_bytes(self, key: str, nbytes: int) -> bytes | None:
        """The object under ``key`` as the store holds it (frame included), or None if absent;
        ``nbytes``: a buffer at least that large."""
        from ...stores.base import Outcome

        store = self.linker.store
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        got = self.linker.data.call_store(store.get, [key], [buf]).result(timeout=10)
        return bytes(buf[: got[0].nbytes].numpy()) if got[0].outcome is Outcome.OK else None

    def replace_object(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` in place of what is there, past every check of the plugin."""
        from ...stores.base import Outcome

        store = self.linker.store
        self.linker.data.call_store(store.remove, [key]).result(timeout=10)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        put = self.linker.data.call_store(store.put, [key], [buf]).result(timeout=10)
        assert put == [Outcome.OK], put

    def corrupt_object(self, key: str, nbytes: int, at: int = -1) -> None:
        """Flip one byte (``at``: an index into the stored frame; the last payload byte by default)."""
        data = self.stored_bytes(key, nbytes)
        assert data is not None, f"no object under {key}"
        damaged = bytearray(data)
        damaged[at] ^= 0x5A
        self.replace_object(key, bytes(damaged))

    def leaks(self) -> dict[str, int]:
        """KV rows and Mamba slots in use once the tree holds nothing (must be zero)."""
        kv_total = self.spec.kv_pages * self.tree_page  # widened locs under DCP
        mamba_used = 0 if self.dense else (
            self.spec.mamba_slots - int(self.req_to_token_pool.mamba_allocator.available_size()))
        return {
            "kv_rows": kv_total - int(self.allocator.available_size()),
            "mamba_slots": mamba_used,
            "req_slots": self.spec.max_reqs - int(self.req_to_token_pool.available_size()),
        }

    def close(self) -> None:
        if self.cache.linker is not None:
            self.cache.linker.close()


__all__ = ["CacheSpec", "SGLangCache", "Served", "install_cpu_shims", "page_keys"]
