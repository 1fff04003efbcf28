"""What a transformers model's cache holds per layer, measured once per model: per-token KV rows
(:class:`KVRowSpec`, full or sliding-window), per-sequence linear states (:class:`LinearStateSpec`),
as a :class:`CacheGeometry`; and the hylinker :class:`ModelLayout` of that geometry
(:func:`layout_for`). Models whose cache hylinker cannot describe are refused with
:class:`~hylinker.tools.harness.reference.models.UnsupportedModelError`.

Token rows: when a layer caches keys and values of the same shape ``[B, H, T, D]`` a token's
row is ``(2, H, D)`` (K stacked on V); otherwise (MLA caches the compressed latent as "keys"
and the shared rotary key as "values") the row is ``(H, Dk + Dv)``, the two concatenated.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ....components.layout import MambaLayerSpec, ModelLayout
from .hf_cache import _forward, _new_cache, _position_history
from .models import UnsupportedModelError

__all__ = ["CacheGeometry", "KVRowSpec", "LinearStateSpec", "cache_geometry", "layout_for"]


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
