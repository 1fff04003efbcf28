"""The reference engine served through a :class:`~hylinker.runtime.linker.facade.Linker`.

:class:`LinkedEngine` is what a serving engine's scheduler does with hylinker, on the tiny
reference model: every prefill goes through the runtime's phases (docs/design/phases.md §2)::

    LOOKUP   device tree match + store probe               linker.lookup(req)
    LOAD     allocate rows/slot, queue the store reads     linker.load(req)
    COMMIT   insert the restored prefix into the tree      linker.commit(load)
    forward  state of the cached prefix (pool rows + the prefix node's state slot) ->
             ReferenceEngine.restore -> chunked prefill of the rest on the absolute grid
    INSERT   write the new tokens' KV/draft rows and the state at the checkpoint depth into the
             pools, donate them (write-through OFFLOAD to the store)
    RELEASE  unlock, free what the request still owns

The engine keeps its own ``DynamicCache`` for the forward; the hylinker pools are the device
memory the cache is restored from and donated to. A restored prefix continues with the very
chunk schedule an uninterrupted run uses (64-token chunks on the absolute grid, explicit
position ids), so its logprobs are bit-identical to a run that never left the device.

A negative control (``linear_state="zero"``/``"skip"``, or ``corrupt``: a function that replaces
the state read from the pools, e.g. with another prefix's) restores the KV but not the real
recurrent state; such a request never donates (it would poison the cache with a wrong state).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import numpy.typing as npt
import torch

from ....components.keys import MultimodalSpan
from ....components.mamba import restorable_ceiling
from ....components.pools import HybridPools
from ....runtime.dataplane.events import record_fence
from ....runtime.linker.facade import Linker, Request
from .boundary_pools import read_boundary, write_boundary
from .engine import (
    BoundaryState,
    ExtendResult,
    LinearStateMode,
    ReferenceEngine,
    ReferenceSequence,
)

__all__ = [
    "LinkedEngine",
    "LinkerPoolViews",
    "PrefillResult",
    "pool_views",
]


@attrs.frozen(eq=False)
class LinkerPoolViews:
    """:class:`HybridPools` seen as the reference engine's ``BoundaryPools`` (same tensors)."""

    kv: torch.Tensor  # [n_full_layers, rows, *kv_row_shape]
    conv: list[torch.Tensor]  # per linear layer: [slots, *conv_shape]
    temporal: list[torch.Tensor | None]  # per linear layer: [slots, *temporal_shape]
    draft: torch.Tensor | None  # [n_draft_layers, rows, *draft_row_shape]


def pool_views(pools: HybridPools) -> LinkerPoolViews:
    """Views of ``pools`` in the shape :func:`read_boundary`/:func:`write_boundary` take."""
    mamba = pools.mamba
    return LinkerPoolViews(
        kv=pools.kv.tensor,
        conv=[] if mamba is None else list(mamba.conv),
        temporal=[] if mamba is None else list(mamba.temporal),
        draft=None if pools.draft is None else pools.draft.tensor,
    )


@attrs.frozen(eq=False)
class PrefillResult:
    """What one prefill through the linker did, and its logprobs.

    ``logprobs[j]`` (fp32 ``[computed_tokens, V]``) is the distribution after prompt token
    ``cached_tokens + j``; the last row is the first generated token's. ``sequence`` is the
    engine's sequence after the prompt: keep decoding it with ``ReferenceEngine.extend``.
    """

    request_id: str
    prompt_tokens: int
    device_tokens: int  # cached on the device at lookup
    store_tokens: int  # restorable from the store at lookup
    restored_tokens: int  # committed from the store (0: none, or the load was dropped)
    cached_tokens: int  # not recomputed: device + restored
    checkpoints: tuple[int, ...]  # depths this prefill donated (state + KV up to there)
    logprobs: torch.Tensor
    draft_logprobs: torch.Tensor | None
    sequence: ReferenceSequence
    restore_s: float  # request admitted -> cached prefix ready in the engine's cache
    ttft_s: float  # request admitted -> first token's logprobs
    linear_state: LinearStateMode = "load"
    # where ttft_s went, in order: "lookup" (hash, device match, store probe), "load" (allocate,
    # store reads, verify, scatter into the pools), "commit", "rebuild" (pool rows and state slot
    # -> the engine's cache), "forward" (prefill of the tokens not cached)
    phases_s: dict[str, float] = attrs.field(factory=dict)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def _tokens(tokens: Sequence[int] | npt.NDArray[np.integer]) -> list[int]:
    return [int(t) for t in tokens]


class LinkedEngine:
    """A :class:`ReferenceEngine` whose prefix cache is hylinker (device tree + store).

    ``forward_in_thread``: run the model in a worker thread so the event loop (and with it the
    pool actors' offloads and loads of other requests) keeps going; forwards are serialized, as
    on one device. ``donate_ceiling``: when a prompt's length ``L`` is a multiple of the grid,
    the prefill's checkpoint sits at ``L``, which the same prompt can never restore (one token
    must run); also donate at ``L - G`` so a resubmitted prompt restores everything it can.
    """

    def __init__(
        self,
        engine: ReferenceEngine,
        linker: Linker,
        *,
        forward_in_thread: bool = False,
        donate_ceiling: bool = True,
    ) -> None:
        layout = linker.layout
        # every restorable boundary (a multiple of the grid) must be a chunk end of the
        # engine's schedule, or a restored run would chunk differently from a fresh one
        if layout.grid % engine.chunk_tokens:
            raise ValueError(
                f"the linker's grid {layout.grid} is not a multiple of the engine's "
                f"chunk_tokens={engine.chunk_tokens}: restored boundaries would not be chunk ends")
        if (layout.draft_layers > 0) != (engine.draft_model is not None):
            raise ValueError("the layout and the engine disagree on the draft model")
        self.engine = engine
        self.linker = linker
        self.views = pool_views(linker.pools)
        self.forward_in_thread = forward_in_thread
        self.donate_ceiling = donate_ceiling
        self._device = anyio.CapacityLimiter(1)

    # ---- the forward, off the event loop when asked --------------------------------
    async def _run(self, fn: Any, *args: Any) -> Any:
        async with self._device:
            if self.forward_in_thread:
                return await anyio.to_thread.run_sync(fn, *args)
            return fn(*args)

    def recompute(self, tokens: Sequence[int] | npt.NDArray[np.integer]) -> ExtendResult:
        """A run that never touches the cache: prefill ``tokens`` from scratch (same chunks)."""
        return self.engine.extend(self.engine.new_sequence(), _tokens(tokens))

    # ---- one prefill through every phase -----------------------------------------
    async def prefill(
        self,
        request_id: str,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        linear_state: LinearStateMode = "load",
        corrupt: Callable[[BoundaryState], BoundaryState] | None = None,
        donate: bool = True,
        salt: bytes | str | None = None,
        adapter: str | None = None,
        multimodal: Sequence[MultimodalSpan] | None = (),
    ) -> PrefillResult:
        """LOOKUP → LOAD → COMMIT → forward → INSERT → RELEASE for one prompt.

        ``linear_state`` other than ``"load"`` is a negative control (the recurrent state of
        the cached prefix is zeroed or skipped), and so is ``corrupt``: the cached prefix's
        state, as read from the pools, is replaced by ``corrupt(state)`` before the engine's
        cache is rebuilt. A negative control never donates. ``donate=False`` computes without
        inserting anything. ``salt``, ``adapter``, ``multimodal``: the request's isolation keys
        (:meth:`Linker.request`); the reference model itself reads only the tokens.
        """
        toks = _tokens(tokens)
        if not toks:
            raise ValueError("a prefill needs at least one token")
        t0 = time.perf_counter()
        linker = self.linker
        req = linker.request(request_id, toks, salt=salt, adapter=adapter, multimodal=multimodal)
        try:
            hit = await linker.lookup(req)
            t_lookup = time.perf_counter()
            restored = 0
            load = await linker.load(req)
            t_load = t_commit = time.perf_counter()
            if load is not None:
                await load.wait()
                t_load = time.perf_counter()
                restored = await linker.commit(load)
                t_commit = time.perf_counter()
            prefix = req.prefix_tokens
            seq = self._restore(req, toks, linear_state, corrupt)
            t_rebuild = time.perf_counter()
            restore_s = t_rebuild - t0
            control = linear_state != "load" or corrupt is not None
            depths = self._donation_depths(req, len(toks)) if donate and not control else []
            slots: dict[int, int | None] = {}
            if depths:
                # what a real engine does before its forward: rows for the prompt, checkpoint slots
                linker.extend(req, len(toks))
                for d in depths:
                    slots[d] = linker.checkpoint_slot(req) if linker.layout.is_hybrid else None
            res: ExtendResult = await self._run(
                lambda: self.engine.extend(seq, toks[prefix:], export_at=depths))
            t_forward = time.perf_counter()
            ttft_s = t_forward - t0
            phases = {"lookup": t_lookup - t0, "load": t_load - t_lookup, "commit": t_commit - t_load,
                      "rebuild": t_rebuild - t_commit, "forward": t_forward - t_rebuild}
            for d in depths:
                start = req.prefix_tokens  # the tree's prefix after the previous insert
                write_boundary(self.views, req.rows[start:d], slots[d], res.states[d],
                               token_start=start)
                # on a GPU the pools were written on the engine's stream: the offload's copy
                # stream reads them only after that work (None on CPU)
                await linker.insert(req, d, checkpoint_slot=slots[d], fence=record_fence(self.views.kv.device))
            return PrefillResult(
                request_id=request_id,
                prompt_tokens=len(toks),
                device_tokens=hit.device_tokens,
                store_tokens=hit.store_tokens,
                restored_tokens=restored,
                cached_tokens=prefix,
                checkpoints=tuple(depths),
                logprobs=res.logprobs,
                draft_logprobs=res.draft_logprobs,
                sequence=seq,
                restore_s=restore_s,
                ttft_s=ttft_s,
                linear_state=linear_state,
                phases_s=phases,
            )
        finally:
            with anyio.CancelScope(shield=True):
                await linker.release(req)

    def _restore(self, req: Request, toks: list[int], linear_state: LinearStateMode,
                 corrupt: Callable[[BoundaryState], BoundaryState] | None = None) -> ReferenceSequence:
        """The engine's sequence for the request's cached prefix (fresh when nothing is cached)."""
        prefix = req.prefix_tokens
        if prefix == 0:
            return self.engine.new_sequence()
        slot = req.state_source
        if self.linker.layout.is_hybrid and slot is None:
            raise RuntimeError(
                f"request {req.id!r}: a cached prefix of {prefix} tokens without a state "
                "(the tree must only match nodes that hold one)")
        state = read_boundary(self.views, req.rows[:prefix], slot)
        if corrupt is not None:
            state = corrupt(state)
        return self.engine.restore(state, toks[:prefix], linear_state=linear_state)

    def _donation_depths(self, req: Request, prompt_len: int) -> list[int]:
        prefix = req.prefix_tokens
        depth = self.linker.checkpoint_depth(req, prompt_len - prefix)
        if depth is None:
            return []
        out = [depth]
        layout = self.linker.layout
        ceiling = restorable_ceiling(prompt_len, layout.grid)
        if (self.donate_ceiling and depth == prompt_len and ceiling > prefix
                and (ceiling - prefix) % layout.chunk_size == 0):
            out.insert(0, ceiling)
        return out
