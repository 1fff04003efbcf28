"""A small reference engine: grid-chunked prefill, boundary export/import, pool adapters.

It runs a transformers hybrid model (and optionally a draft model) one sequence at a time:

* :meth:`ReferenceEngine.extend` runs a chunked prefill on the **absolute** chunk grid
  (chunk ends at multiples of ``chunk_tokens``, then the last partial chunk) with explicit
  ``position_ids``, so a sequence restored at a grid boundary continues with exactly the chunks
  an uninterrupted run would have used. That is what makes restored logprobs bit-identical.
* :meth:`ReferenceEngine.export` / :meth:`ReferenceEngine.extend` ``(export_at=...)`` snapshot
  the state at a boundary as plain cloned tensors (:class:`BoundaryState`): per full-attention
  layer one row per token (K/V, or for MLA the cached latents), per linear-attention layer the
  conv state and the recurrent ("temporal") state, and the draft model's K/V rows.
* :meth:`ReferenceEngine.restore` builds fresh caches from such a state (``Cache.update``,
  ``update_conv_state(..., conv_kernel_size=K)``, ``update_recurrent_state``).
* :func:`~hylinker.tools.harness.reference.boundary_pools.write_boundary` / ``read_boundary`` move a state in and out of hylinker-shaped
  pools (``kv[full_layer][row]``, ``conv[i][slot]``, ``temporal[i][slot]``, ``draft[d][row]``),
  and :func:`layout_for` describes that geometry as a :class:`ModelLayout`.

What a model's cache holds per layer (and its token rows) is measured in
``tools/harness/reference/geometry.py``; the transformers cache is created, run and read in
``tools/harness/reference/hf_cache.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import attrs
import torch

from ....components.layout import ModelLayout
from .geometry import (
    CacheGeometry,
    KVRowSpec,
    LinearStateSpec,
    _draft_geometry,
    cache_geometry,
    layout_for,
)
from .hf_cache import (
    _forward,
    _model_device,
    _new_cache,
    _position_history,
    _read_conv,
    _rebuilt_positions,
    _write_conv,
)
from .models import UnsupportedModelError

__all__ = [
    "BoundaryState",
    "CacheGeometry",
    "ExtendResult",
    "KVRowSpec",
    "LinearStateMode",
    "LinearStateSpec",
    "ReferenceEngine",
    "ReferenceSequence",
    "cache_geometry",
    "check_tensor",
    "chunk_schedule",
    "layout_for",
]

LinearStateMode = Literal["load", "zero", "skip"]


# ---------------------------------------------------------------------------------------------
# states and sequences
# ---------------------------------------------------------------------------------------------
@attrs.frozen(eq=False)
class BoundaryState:
    """A restorable state after ``length`` tokens, as plain tensors (owned, not cache views).

    ``kv``: ``[n_full_layers, length, *kv_row_shape]`` (``[0, length]`` uint8 for a purely
    recurrent model: it has no attention layer); ``conv[i]`` / ``temporal[i]``: layer
    ``i`` of the linear layers (layout order), no batch dim, ``None`` when absent (``conv`` and
    ``temporal`` are ``None`` together when the state carries no linear-attention part);
    ``draft``: ``[n_draft_layers, length, *draft_row_shape]`` or ``None``.
    """

    length: int
    kv: torch.Tensor
    conv: tuple[torch.Tensor, ...] | None
    temporal: tuple[torch.Tensor | None, ...] | None
    draft: torch.Tensor | None = None


@attrs.define(eq=False)
class ReferenceSequence:
    """One sequence in flight: its caches, tokens and the logprobs after its last token."""

    cache: Any
    draft_cache: Any | None
    length: int = 0
    tokens: list[int] | None = attrs.field(factory=list)
    last_logprobs: torch.Tensor | None = None
    last_draft_logprobs: torch.Tensor | None = None


@attrs.frozen(eq=False)
class ExtendResult:
    """Logprobs of every extended position (fp32 ``[T, V]``) and the states exported on the way."""

    logprobs: torch.Tensor
    draft_logprobs: torch.Tensor | None
    states: dict[int, BoundaryState]


def chunk_schedule(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut at every multiple of ``chunk_tokens`` (the absolute grid)."""
    if chunk_tokens <= 0 or start < 0 or end < start:
        raise ValueError(f"bad schedule: start={start} end={end} chunk_tokens={chunk_tokens}")
    out: list[tuple[int, int]] = []
    pos = start
    while pos < end:
        nxt = min(end, (pos // chunk_tokens + 1) * chunk_tokens)
        out.append((pos, nxt))
        pos = nxt
    return out


class ReferenceEngine:
    """Chunked prefill / decode with boundary export and import for one model (+ draft).

    ``chunk_tokens`` is the prefill chunk on the absolute grid; make it a multiple of the
    layout's grid ``G`` so every checkpoint boundary is a chunk end.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        draft_model: torch.nn.Module | None = None,
        *,
        chunk_tokens: int = 64,
    ) -> None:
        if not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        self.model = model
        self.draft_model = draft_model
        self.chunk_tokens = chunk_tokens
        self.geometry = cache_geometry(model)
        if self.geometry.kv is None and not self.geometry.linear:
            raise UnsupportedModelError(
                f"{self.geometry.model_type}: no layer caches anything (no KV, no state)")
        self.draft_geometry: CacheGeometry | None = None
        if draft_model is not None:
            if self.geometry.kv is None:
                raise UnsupportedModelError(
                    f"{self.geometry.model_type}: a draft model's KV rides on the target's "
                    "attention layers (its rows), and this model has none (purely recurrent)")
            self.draft_geometry = _draft_geometry(draft_model)
            config: Any = model.config
            draft_config: Any = draft_model.config
            vocab = config.get_text_config().vocab_size
            draft_vocab = draft_config.vocab_size
            if vocab != draft_vocab:
                raise ValueError(f"draft vocab {draft_vocab} != model vocab {vocab}")

    # ---- layout -------------------------------------------------------------------------
    def layout(self, page_size: int, chunk_size: int = 64, **layout_fields: Any) -> ModelLayout:
        """:func:`layout_for` this engine's model and draft model."""
        layout = layout_for(self.model, self.draft_model, page_size, chunk_size, **layout_fields)
        if self.chunk_tokens % layout.grid:
            raise ValueError(
                f"chunk_tokens={self.chunk_tokens} is not a multiple of the layout grid {layout.grid}")
        return layout

    # ---- running --------------------------------------------------------------------------
    def new_sequence(self) -> ReferenceSequence:
        """An empty sequence (length 0)."""
        draft_cache = _new_cache(self.draft_model) if self.draft_model is not None else None
        return ReferenceSequence(cache=_new_cache(self.model), draft_cache=draft_cache)

    def extend(
        self,
        seq: ReferenceSequence,
        tokens: Sequence[int],
        *,
        export_at: Iterable[int] = (),
    ) -> ExtendResult:
        """Prefill ``tokens`` after ``seq.length`` on the grid-chunk schedule.

        ``export_at``: absolute boundaries (chunk ends of this schedule) at which to snapshot
        the state; a boundary that is not a chunk end raises ``ValueError``.
        """
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError("extend needs at least one token")
        start, end = seq.length, seq.length + len(toks)
        schedule = chunk_schedule(start, end, self.chunk_tokens)
        ends = {e for _, e in schedule}
        wanted = sorted(set(export_at))
        bad = [b for b in wanted if b not in ends]
        if bad:
            raise ValueError(
                f"cannot export at {bad}: not chunk ends of the schedule {schedule} "
                f"(chunk_tokens={self.chunk_tokens})")
        logprobs: list[torch.Tensor] = []
        draft_logprobs: list[torch.Tensor] = []
        states: dict[int, BoundaryState] = {}
        for s, e in schedule:
            ids = toks[s - start: e - start]
            logprobs.append(_forward(self.model, seq.cache, ids, s))
            if self.draft_model is not None:
                draft_logprobs.append(_forward(self.draft_model, seq.draft_cache, ids, s))
            seq.length = e
            if seq.tokens is not None:
                seq.tokens.extend(ids)
            if e in wanted:
                states[e] = self.export(seq)
        lp = torch.cat(logprobs)
        dlp = torch.cat(draft_logprobs) if draft_logprobs else None
        seq.last_logprobs = lp[-1]
        seq.last_draft_logprobs = None if dlp is None else dlp[-1]
        return ExtendResult(lp, dlp, states)

    def decode_greedy(self, seq: ReferenceSequence, steps: int) -> tuple[list[int], torch.Tensor]:
        """``steps`` one-token decode steps, each feeding the argmax of the previous logprobs.

        Returns the fed tokens and the logprobs after each (``[steps, V]``).
        """
        if seq.last_logprobs is None:
            raise ValueError("decode needs a sequence that has run at least one token")
        fed: list[int] = []
        out: list[torch.Tensor] = []
        for _ in range(steps):
            tok = int(torch.argmax(seq.last_logprobs))
            fed.append(tok)
            out.append(self.extend(seq, [tok]).logprobs)
        return fed, torch.cat(out) if out else torch.empty(0)

    # ---- export / import -----------------------------------------------------------------
    def export(self, seq: ReferenceSequence) -> BoundaryState:
        """Snapshot ``seq`` at its current length (cloned: later forwards write in place)."""
        if seq.length <= 0:
            raise ValueError("nothing to export: the sequence is empty")
        g = self.geometry
        if g.position_history_layers:  # what a restore rebuilds must be what the cache holds
            layers, _ = _position_history(g.model_type, seq.cache, seq.length)
            if layers != g.position_history_layers:
                raise RuntimeError(f"position history on layers {layers}, expected "
                                   f"{g.position_history_layers}")
        kv = _export_rows(seq.cache, g, seq.length)
        conv: list[torch.Tensor] = []
        temporal: list[torch.Tensor | None] = []
        for spec in g.linear:
            c = _read_conv(seq.cache, spec)
            if c is None:
                raise RuntimeError(f"linear layer {spec.layer_id} holds no conv state after a forward")
            conv.append(c[0].clone())
            r = seq.cache.get_recurrent_state(spec.layer_id)
            temporal.append(None if r is None else r[0].clone())
        draft = None
        if self.draft_geometry is not None:
            draft = _export_rows(seq.draft_cache, self.draft_geometry, seq.length)
        return BoundaryState(seq.length, kv, tuple(conv), tuple(temporal), draft)

    def restore(
        self,
        state: BoundaryState,
        tokens: Sequence[int] | None = None,
        *,
        linear_state: LinearStateMode = "load",
    ) -> ReferenceSequence:
        """A new sequence whose caches hold ``state``; continue it with :meth:`extend`.

        ``linear_state``: ``"load"`` (the real thing), or for negative controls ``"zero"``
        (recurrent states zeroed, conv states loaded; the conv state of a conv-only layer
        zeroed) and ``"skip"`` (no linear state at all).
        ``tokens``: the prefix, for bookkeeping (must have ``state.length`` entries).
        """
        if tokens is not None and len(tokens) != state.length:
            raise ValueError(f"{len(tokens)} prefix tokens for a state of length {state.length}")
        g = self.geometry
        device = _model_device(self.model)
        cache = _new_cache(self.model)
        _import_rows(cache, g, state.kv, state.length, device, "kv")
        if g.linear and linear_state != "skip":
            if state.conv is None or state.temporal is None:
                raise ValueError("state has no linear-attention part (read without a slot?)")
            if len(state.conv) != len(g.linear) or len(state.temporal) != len(g.linear):
                raise ValueError(
                    f"state has {len(state.conv)} conv / {len(state.temporal)} temporal states, "
                    f"model has {len(g.linear)} linear layers")
            for spec, c, t in zip(g.linear, state.conv, state.temporal, strict=True):
                check_tensor(f"conv[{spec.layer_id}]", c, spec.conv_shape, spec.conv_dtype)
                if linear_state == "zero" and spec.temporal_shape is None:
                    c = torch.zeros_like(c)  # a conv-only layer: its conv state is its state
                _write_conv(cache, spec, c.to(device))
                if spec.temporal_shape is None:
                    continue
                if t is None:
                    raise ValueError(f"state lacks the temporal state of layer {spec.layer_id}")
                check_tensor(f"temporal[{spec.layer_id}]", t, spec.temporal_shape, spec.temporal_dtype)
                t = torch.zeros_like(t) if linear_state == "zero" else t
                cache.update_recurrent_state(t.to(device)[None].clone(), spec.layer_id)
        draft_cache = None
        if self.draft_model is not None:
            assert self.draft_geometry is not None
            if state.draft is None:
                raise ValueError("the engine has a draft model but the state carries no draft KV")
            draft_cache = _new_cache(self.draft_model)
            _import_rows(draft_cache, self.draft_geometry, state.draft, state.length,
                         _model_device(self.draft_model), "draft")
        return ReferenceSequence(
            cache=cache, draft_cache=draft_cache, length=state.length,
            tokens=None if tokens is None else [int(t) for t in tokens])


def check_tensor(name: str, t: torch.Tensor, shape: Sequence[int] | None, dtype: torch.dtype | None) -> None:
    if tuple(t.shape) != tuple(shape or ()) or t.dtype != dtype:
        raise ValueError(f"{name}: expected {tuple(shape or ())} {dtype}, got {tuple(t.shape)} {t.dtype}")


def _export_rows(cache: Any, g: CacheGeometry, length: int) -> torch.Tensor:
    """One row per token per attention layer. A sliding-window layer keeps only its last
    ``window - 1`` tokens; rows of tokens before that are zero. They are never read: a restore
    at any boundary replays every row into the layer, which keeps only its window, and the
    window's rows were written from a state that still held them."""
    if g.kv is None:  # purely recurrent: no rows, the shape a state-only layout's pool has
        return torch.empty((0, length), dtype=torch.uint8)
    rows = []
    windows = g.kv_windows or (None,) * len(g.full_layers)
    for i, window in zip(g.full_layers, windows, strict=True):
        layer = cache.layers[i]
        held = length if window is None else min(length, window - 1)
        if layer.keys is None or layer.keys.shape[-2] != held:
            got = None if layer.keys is None else layer.keys.shape[-2]
            raise RuntimeError(f"layer {i} caches {got} tokens, expected {held} of {length}")
        enc = g.kv.encode(layer.keys, layer.values, getattr(layer, "indexer_keys", None))
        if held < length:
            enc = torch.cat([enc.new_zeros((length - held, *enc.shape[1:])), enc])
        rows.append(enc)
    return torch.stack(rows)


def _import_rows(cache: Any, g: CacheGeometry, rows: torch.Tensor, length: int,
                 device: torch.device, name: str) -> None:
    if g.kv is None:
        check_tensor(name, rows, (0, length), torch.uint8)
        return
    check_tensor(name, rows, (len(g.full_layers), length, *g.kv.row_shape), g.kv.dtype)
    for j, i in enumerate(g.full_layers):
        k, v, indexer = g.kv.decode(rows[j].to(device))
        cache.update(k, v, i)
        if indexer is not None:
            cache.update_indexer(indexer, i)
    for i in g.position_history_layers:  # not carried: the tokens' positions, rebuilt
        cache.layers[i].indexer_position_ids = _rebuilt_positions(
            g.position_history_dims, length, device).clone()
