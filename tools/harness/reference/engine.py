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

Token rows: when a layer caches keys and values of the same shape ``[B, H, T, D]`` a token's
row is ``(2, H, D)`` (K stacked on V); otherwise (MLA caches the compressed latent as "keys"
and the shared rotary key as "values") the row is ``(H, Dk + Dv)``, the two concatenated.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import attrs
import torch

from ....components.layout import MambaLayerSpec, ModelLayout
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
# geometry
# ---------------------------------------------------------------------------------------------
@attrs.frozen
class KVRowSpec:
    """How one attention layer's cached keys/values map to one row per token.

    ``indexer_dim``: an indexed (sparse) attention layer (Qwen4-Exp QSA) also caches one
    indexer key per token (``[1, T, indexer_dim]``); its row is then flat,
    ``K ‖ V ‖ indexer key`` (``H*Dk + H*Dv + indexer_dim`` values), so the indexer keys travel
    on the same KV rows and pages as the layer's K/V.
    """

    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    indexer_dim: int = 0

    @property
    def stacked(self) -> bool:
        return self.key_dim == self.value_dim and not self.indexer_dim

    @property
    def row_shape(self) -> tuple[int, ...]:
        if self.indexer_dim:
            return (self.heads * (self.key_dim + self.value_dim) + self.indexer_dim,)
        if self.stacked:
            return (2, self.heads, self.key_dim)
        return (self.heads, self.key_dim + self.value_dim)

    def encode(self, keys: torch.Tensor, values: torch.Tensor,
               indexer: torch.Tensor | None = None) -> torch.Tensor:
        """``keys [1, H, T, Dk]``, ``values [1, H, T, Dv]`` (and ``indexer [1, T, Di]``) ->
        rows ``[T, *row_shape]``."""
        k = keys[0].transpose(0, 1)  # [T, H, Dk]
        v = values[0].transpose(0, 1)
        if self.indexer_dim:
            if indexer is None or tuple(indexer.shape[::2]) != (1, self.indexer_dim):
                raise ValueError(f"an indexed layer's rows need its indexer keys [1, T, {self.indexer_dim}]")
            t = k.shape[0]
            return torch.cat([k.reshape(t, -1), v.reshape(t, -1), indexer[0]], dim=-1).contiguous()
        if self.stacked:
            return torch.stack([k, v], dim=1).contiguous()
        return torch.cat([k, v], dim=-1).contiguous()

    def decode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows ``[T, *row_shape]`` -> ``keys [1, H, T, Dk]``, ``values [1, H, T, Dv]`` and
        the indexer keys ``[1, T, Di]`` (``None`` unless the layer is indexed)."""
        indexer = None
        if self.indexer_dim:
            t, nk = rows.shape[0], self.heads * self.key_dim
            k = rows[:, :nk].reshape(t, self.heads, self.key_dim)
            v = rows[:, nk: nk + self.heads * self.value_dim].reshape(t, self.heads, self.value_dim)
            indexer = rows[:, nk + self.heads * self.value_dim:].unsqueeze(0).contiguous()
        elif self.stacked:
            k, v = rows[:, 0], rows[:, 1]
        else:
            k, v = rows[..., : self.key_dim], rows[..., self.key_dim:]
        return (k.transpose(0, 1).unsqueeze(0).contiguous(),
                v.transpose(0, 1).unsqueeze(0).contiguous(), indexer)


@attrs.frozen
class LinearStateSpec:
    """One linear-attention layer's per-sequence state (no batch dim)."""

    layer_id: int
    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    conv_kernel_size: int
    temporal_shape: tuple[int, ...] | None
    temporal_dtype: torch.dtype | None
    #: channels of each of the layer's conv states, in state order, when it has several
    #: (Inkling: 4). They travel as one conv tensor, concatenated along the channel axis.
    conv_channels: tuple[int, ...] = ()

    @property
    def conv_states(self) -> int:
        """How many conv states the layer keeps (one, unless :attr:`conv_channels` says)."""
        return max(1, len(self.conv_channels))


@attrs.frozen
class CacheGeometry:
    """What a model's cache holds, layer by layer, measured from a probe forward."""

    model_type: str
    num_layers: int
    full_layers: tuple[int, ...]
    kv: KVRowSpec | None
    linear: tuple[LinearStateSpec, ...]
    stateless_layers: tuple[int, ...]
    # per attention layer (``full_layers`` order): its sliding window, ``None`` for full attention
    kv_windows: tuple[int | None, ...] = ()
    # indexed layers whose cache also keeps the position history its indexer reads
    # (``indexer_position_ids [dims, 1, T]``; Qwen4-Exp keeps it on the first indexed layer),
    # and ``dims``. Not carried: it is rebuilt from the token positions on restore.
    position_history_layers: tuple[int, ...] = ()
    position_history_dims: int = 0

    @property
    def both_layers(self) -> tuple[int, ...]:
        """Layers that carry attention KV and a recurrent state."""
        ids = {s.layer_id for s in self.linear}
        return tuple(i for i in self.full_layers if i in ids)


_GEOMETRY: weakref.WeakKeyDictionary[torch.nn.Module, CacheGeometry] = weakref.WeakKeyDictionary()


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _new_cache(model: torch.nn.Module) -> Any:
    from transformers import DynamicCache

    config: Any = model.config
    return DynamicCache(config=config)


def _forward(model: torch.nn.Module, cache: Any, ids: Sequence[int], start: int) -> torch.Tensor:
    """One forward of ``ids`` at absolute positions ``start..``; returns logprobs ``[T, V]`` fp32."""
    device = _model_device(model)
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    position_ids = torch.arange(start, start + len(ids), dtype=torch.long, device=device)[None]
    with torch.no_grad():
        out = model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _attention_part(model_type: str, i: int, layer: Any) -> tuple[KVRowSpec, int | None] | None:
    """The per-token KV rows a layer caches (and its sliding window), or ``None``."""
    from transformers.cache_utils import CacheLayerMixin

    if not isinstance(layer, CacheLayerMixin):
        return None
    keys, values = layer.keys, layer.values
    if keys is None or values is None or keys.dim() != 4 or keys.shape[-2] == 0:
        return None  # an attention layer the model never wrote (shared KV, ...)
    if keys.shape[-2] != 2:
        raise UnsupportedModelError(
            f"{model_type} layer {i}: caches {keys.shape[-2]} tokens after a 2-token forward")
    if keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype:
        raise UnsupportedModelError(
            f"{model_type} layer {i}: keys {tuple(keys.shape)} and values "
            f"{tuple(values.shape)} differ in heads/length/dtype")
    window = getattr(layer, "sliding_window", None)
    indexer_dim = _indexer_dim(model_type, i, layer, keys)
    if indexer_dim and window is not None:
        raise UnsupportedModelError(
            f"{model_type} layer {i}: an indexed (sparse) attention layer with a sliding window")
    return (KVRowSpec(int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3]), keys.dtype,
                      indexer_dim),
            None if window is None else int(window))


def _indexer_dim(model_type: str, i: int, layer: Any, keys: torch.Tensor) -> int:
    """Width of the indexer key an indexed (sparse) attention layer caches per token (0: none).

    Refused: indexer keys that are not one row per cached token of the layer's dtype."""
    from transformers.cache_utils import DynamicIndexedLayer

    if not isinstance(layer, DynamicIndexedLayer):
        return 0
    idx = layer.indexer_keys
    if idx is None or idx.dim() != 3 or idx.shape[1] != keys.shape[-2] or idx.dtype != keys.dtype:
        got = None if idx is None else (tuple(idx.shape), idx.dtype)
        raise UnsupportedModelError(
            f"{model_type} layer {i}: indexed (sparse) attention whose indexer keys {got} are not "
            f"one {keys.dtype} row per cached token; hylinker carries them on the KV rows")
    return int(idx.shape[2])


def _position_history(model_type: str, cache: Any, length: int) -> tuple[tuple[int, ...], int]:
    """Layers whose cache keeps an indexer's position history after ``length`` tokens at
    positions ``0..length-1``, and its number of position dims. Refused unless it is exactly
    those positions on every dim (text positions), which a restore rebuilds."""
    layers: list[int] = []
    dims: set[int] = set()
    for i, layer in enumerate(cache.layers):
        history = getattr(layer, "indexer_position_ids", None)
        if history is None:
            continue
        if not torch.equal(history, _rebuilt_positions(int(history.shape[0]), length, history.device)):
            raise UnsupportedModelError(
                f"{model_type} layer {i}: the indexer's position history {tuple(history.shape)} is "
                "not the tokens' positions on every dim; hylinker rebuilds it from them")
        layers.append(i)
        dims.add(int(history.shape[0]))
    if len(dims) > 1:
        raise UnsupportedModelError(f"{model_type}: position histories of {sorted(dims)} dims")
    return tuple(layers), dims.pop() if dims else 0


def _rebuilt_positions(dims: int, length: int, device: torch.device) -> torch.Tensor:
    """The position history ``[dims, 1, length]`` of a text sequence (positions ``0..length-1``)."""
    return torch.arange(length, dtype=torch.long, device=device).view(1, 1, length).expand(dims, 1, length)


def _linear_part(model_type: str, i: int, layer: Any) -> LinearStateSpec | None:
    """The per-sequence conv / recurrent state a layer caches, or ``None``."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return None
    n = int(layer.number_of_states)
    if n != 1:
        return _several_conv_states(model_type, i, layer, n)
    conv = layer.conv_states[0]
    rec = layer.recurrent_states[0]
    if conv is None:
        if rec is None:
            raise UnsupportedModelError(
                f"{model_type} layer {i}: a linear-attention cache layer that the model left empty "
                "after a forward; its recurrent state lives outside the cache (in the module), "
                "where hylinker cannot save or restore it")
        raise UnsupportedModelError(f"{model_type} layer {i}: recurrent state without a conv state")
    return LinearStateSpec(
        layer_id=i,
        conv_shape=tuple(conv.shape[1:]),
        conv_dtype=conv.dtype,
        conv_kernel_size=int(layer.conv_kernel_size[0] or conv.shape[-1]),
        temporal_shape=None if rec is None else tuple(rec.shape[1:]),
        temporal_dtype=None if rec is None else rec.dtype,
    )


def _several_conv_states(model_type: str, i: int, layer: Any, n: int) -> LinearStateSpec:
    """A layer with ``n`` conv states (and no recurrent state): one conv tensor whose channel
    axis concatenates them, so that one MAMBA slot carries them all. Their kernel window,
    trailing shape and dtype must agree (they do in every such model transformers ships)."""
    convs = [layer.conv_states[k] for k in range(n)]
    if any(c is None or not isinstance(c, torch.Tensor) for c in convs):
        raise UnsupportedModelError(
            f"{model_type} layer {i}: {n} conv states per layer, not all written by a forward")
    if any(layer.recurrent_states[k] is not None for k in range(n)):
        raise UnsupportedModelError(
            f"{model_type} layer {i}: {n} conv states per layer with recurrent states beside them "
            "(hylinker concatenates several conv states of a conv-only layer)")
    kernels = {int(layer.conv_kernel_size[k] or convs[k].shape[-1]) for k in range(n)}
    tails = {(tuple(c.shape[2:]), c.dtype, c.shape[0]) for c in convs}
    if len(kernels) != 1 or len(tails) != 1:
        raise UnsupportedModelError(
            f"{model_type} layer {i}: {n} conv states per layer that differ in kernel window, "
            f"trailing shape or dtype ({sorted(kernels)}, {sorted(map(str, tails))}); hylinker "
            "concatenates a layer's conv states along their channel axis")
    channels = tuple(int(c.shape[1]) for c in convs)
    return LinearStateSpec(
        layer_id=i,
        conv_shape=(sum(channels), *convs[0].shape[2:]),
        conv_dtype=convs[0].dtype,
        conv_kernel_size=kernels.pop(),
        temporal_shape=None,
        temporal_dtype=None,
        conv_channels=channels,
    )


def _read_conv(cache: Any, spec: LinearStateSpec) -> torch.Tensor | None:
    """The conv state of ``spec``'s layer (its conv states concatenated), batch dim kept."""
    parts = [cache.get_conv_state(spec.layer_id, k) for k in range(spec.conv_states)]
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _write_conv(cache: Any, spec: LinearStateSpec, conv: torch.Tensor) -> None:
    """Load ``conv`` (no batch dim; several conv states concatenated) into the layer."""
    parts = conv.split(list(spec.conv_channels), dim=0) if spec.conv_channels else (conv,)
    for k, part in enumerate(parts):
        cache.update_conv_state(part[None].clone(), spec.layer_id, k,
                                conv_kernel_size=spec.conv_kernel_size)


def _check_states_are_honoured(model: torch.nn.Module, model_type: str,
                               linear: Sequence[LinearStateSpec]) -> None:
    """Refuse a model whose multi-token forward ignores the recurrent state in its cache.

    Two runs of 8 + 8 tokens; before the second forward one of them zeroes every recurrent
    state (the conv state of conv-only layers). A model that honours its cache answers
    differently. The Mamba1 torch path of transformers (Jamba, Zamba, Mamba, Falcon-Mamba)
    restarts its scan from zero on a multi-token continuation: restoring its state could
    never matter, and a chunked prefill is not the model's own function.
    """
    ids = [3 + (7 * i) % 29 for i in range(16)]

    def second_half(zero: bool) -> torch.Tensor:
        cache = _new_cache(model)
        _forward(model, cache, ids[:8], 0)
        if zero:
            for spec in linear:
                states = ([cache.get_conv_state(spec.layer_id, k) for k in range(spec.conv_states)]
                          if spec.temporal_shape is None
                          else [cache.get_recurrent_state(spec.layer_id)])
                for state in states:
                    if state is not None:
                        state.zero_()
        return _forward(model, cache, ids[8:], 8)

    if torch.equal(second_half(False), second_half(True)):
        raise UnsupportedModelError(
            f"{model_type}: a multi-token forward ignores the recurrent state held in its cache "
            "(zeroing it changes nothing), a transformers defect of its torch path: a restored "
            "state could never matter, and a chunked prefill is not the model's own function")


def cache_geometry(model: torch.nn.Module) -> CacheGeometry:
    """Measure what ``model``'s ``DynamicCache`` holds per layer (probe forward of 2 tokens).

    Each cache layer has two facets, read independently: an attention part (per-token K/V
    rows, full or sliding-window) and a linear part (a conv state, or several concatenated, and
    an optional recurrent state per sequence). A layer may have either, both (Falcon-H1, Zamba) or neither (MoE/MLP
    blocks, shared-KV consumers). Raises :class:`UnsupportedModelError` for caches hylinker
    cannot describe: indexed (sparse) attention, several conv states of one layer that cannot
    be concatenated, attention layers with different row shapes.
    """
    cached = _GEOMETRY.get(model)
    if cached is not None:
        return cached
    model_type = str(getattr(model.config, "model_type", type(model).__name__))
    cache = _new_cache(model)
    try:
        _forward(model, cache, [0, 0], 0)
    except (ValueError, RuntimeError, TypeError, NotImplementedError, IndexError) as exc:
        raise UnsupportedModelError(f"{model_type}: probe forward with a cache failed: {exc}") from exc
    full: list[int] = []
    kv_specs: list[KVRowSpec] = []
    windows: list[int | None] = []
    linear: list[LinearStateSpec] = []
    stateless: list[int] = []
    for i, layer in enumerate(cache.layers):
        attention = _attention_part(model_type, i, layer)
        state = _linear_part(model_type, i, layer)
        if attention is not None:
            full.append(i)
            kv_specs.append(attention[0])
            windows.append(attention[1])
        if state is not None:
            linear.append(state)
        if attention is None and state is None:
            stateless.append(i)
    if linear:
        _check_states_are_honoured(model, model_type, linear)
    if kv_specs and any(s != kv_specs[0] for s in kv_specs):
        raise UnsupportedModelError(
            f"{model_type}: attention layers cache different row shapes: {sorted(set(kv_specs), key=str)}")
    history_layers, history_dims = _position_history(model_type, cache, 2)
    geometry = CacheGeometry(
        model_type=model_type,
        num_layers=len(cache.layers),
        full_layers=tuple(full),
        kv=kv_specs[0] if kv_specs else None,
        linear=tuple(linear),
        stateless_layers=tuple(stateless),
        kv_windows=tuple(windows),
        position_history_layers=history_layers,
        position_history_dims=history_dims,
    )
    _GEOMETRY[model] = geometry
    return geometry


def _draft_geometry(draft_model: torch.nn.Module) -> CacheGeometry:
    g = cache_geometry(draft_model)
    if g.linear or g.kv is None:
        raise UnsupportedModelError(
            f"draft model {g.model_type}: needs full-attention layers only, got "
            f"{len(g.full_layers)} attention and {len(g.linear)} linear layers")
    return g


def layout_for(
    model: torch.nn.Module,
    draft_model: torch.nn.Module | None,
    page_size: int,
    chunk_size: int = 64,
    **layout_fields: Any,
) -> ModelLayout:
    """The hylinker :class:`ModelLayout` of ``model`` (+ ``draft_model``) for one sequence.

    FULL rows are :attr:`KVRowSpec.row_shape` per full-attention layer; one MAMBA slot holds
    every linear layer's conv and temporal state; draft layer ``d`` rides with the ``d``-th
    full-attention layer. ``layout_fields`` go to :meth:`ModelLayout.create` (tp sizes, ...).
    """
    g = cache_geometry(model)
    if g.kv is None and not g.linear:
        raise UnsupportedModelError(f"{g.model_type}: no layer caches anything (no KV, no state)")
    draft_layers = 0
    draft_row: tuple[int, ...] | None = None
    draft_dtype: torch.dtype | None = None
    if draft_model is not None:
        dg = _draft_geometry(draft_model)
        assert dg.kv is not None
        if len(dg.full_layers) > len(g.full_layers):
            raise UnsupportedModelError(
                f"draft model has {len(dg.full_layers)} attention layers but {g.model_type} has "
                f"only {len(g.full_layers)} full-attention layers to carry them")
        draft_layers, draft_row, draft_dtype = len(dg.full_layers), dg.kv.row_shape, dg.kv.dtype
    fields: dict[str, Any] = {"model_name": f"{g.model_type}-reference"}
    fields.update(layout_fields)
    return ModelLayout.create(
        page_size=page_size,
        chunk_size=chunk_size,
        full_layers=g.full_layers,
        kv_row_shape=None if g.kv is None else g.kv.row_shape,
        kv_dtype=torch.uint8 if g.kv is None else g.kv.dtype,
        mamba_layers=[
            MambaLayerSpec(s.layer_id, s.conv_shape, s.conv_dtype, s.temporal_shape, s.temporal_dtype)
            for s in g.linear
        ],
        draft_layers=draft_layers,
        draft_row_shape=draft_row,
        draft_dtype=draft_dtype,
        **fields,
    )


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
