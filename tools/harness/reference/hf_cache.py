"""The transformers cache of the reference engine, read and written: a fresh ``DynamicCache``, one
forward at absolute positions, the indexer's position history (checked, and rebuilt on a
restore), the conv states of a linear layer. Heavy imports (transformers) happen on first call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .models import UnsupportedModelError

if TYPE_CHECKING:
    from .geometry import LinearStateSpec


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
