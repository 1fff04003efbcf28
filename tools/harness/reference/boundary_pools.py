"""Hylinker-shaped pools for the reference engine's boundary states: :func:`allocate_pools` makes
them from a :class:`~hylinker.components.layout.ModelLayout` (``kv[full_layer][row]``,
``conv[i][slot]``, ``temporal[i][slot]``, ``draft[d][row]``), :func:`write_boundary` /
:func:`read_boundary` move a :class:`~hylinker.tools.harness.reference.engine.BoundaryState` in and out
of them, and :func:`max_abs_diff` / :func:`kl_divergence` compare two runs' logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from ....components.layout import ModelLayout
from .engine import BoundaryState, check_tensor


class BoundaryPools(Protocol):
    """The pool tensors the runtime hands over (duck-typed)."""

    @property
    def kv(self) -> torch.Tensor: ...  # [n_full_layers, capacity_tokens, *kv_row_shape]
    @property
    def conv(self) -> Sequence[torch.Tensor]: ...  # per linear layer: [slots, *conv_shape]
    @property
    def temporal(self) -> Sequence[torch.Tensor | None]: ...  # per linear layer: [slots, *shape]
    @property
    def draft(self) -> torch.Tensor | None: ...  # [n_draft_layers, capacity_tokens, *row]


@attrs.frozen(eq=False)
class ReferencePools:
    """A plain holder of pool tensors (what :func:`allocate_pools` returns)."""

    kv: torch.Tensor
    conv: list[torch.Tensor]
    temporal: list[torch.Tensor | None]
    draft: torch.Tensor | None = None


def allocate_pools(
    layout: ModelLayout,
    capacity_tokens: int,
    slots: int,
    *,
    device: torch.device | str = "cpu",
    fill: float | None = None,
) -> ReferencePools:
    """Zeroed pool tensors shaped by ``layout``; ``fill`` poisons them with a value instead."""
    if capacity_tokens <= 0 or slots <= 0:
        raise ValueError(f"capacity_tokens and slots must be positive, got {capacity_tokens}, {slots}")

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype, device=device)
        if fill is not None:
            t.fill_(fill)
        return t

    kv = make((len(layout.full_layers), capacity_tokens, *layout.kv_row_shape), layout.kv_dtype)
    conv = [make((slots, *s.conv_shape), s.conv_dtype) for s in layout.mamba_layers]
    temporal: list[torch.Tensor | None] = [
        None if s.temporal_shape is None or s.temporal_dtype is None
        else make((slots, *s.temporal_shape), s.temporal_dtype)
        for s in layout.mamba_layers
    ]
    draft = None
    if layout.draft_layers and layout.draft_row_shape is not None and layout.draft_dtype is not None:
        draft = make((layout.draft_layers, capacity_tokens, *layout.draft_row_shape), layout.draft_dtype)
    return ReferencePools(kv, conv, temporal, draft)


def _rows_index(rows: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    idx = torch.as_tensor(rows, dtype=torch.long)
    if idx.dim() != 1:
        raise ValueError(f"rows must be 1-D (one row per token), got shape {tuple(idx.shape)}")
    return idx.to(device)


def _write_rows(pool: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if src.dtype != pool.dtype:
        raise ValueError(f"{name}: state dtype {src.dtype} != pool dtype {pool.dtype}")
    if src.shape[0] != pool.shape[0] or src.shape[2:] != pool.shape[2:]:
        raise ValueError(f"{name}: state rows {tuple(src.shape)} do not fit pool {tuple(pool.shape)}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= pool.shape[1]):
        raise IndexError(f"{name}: rows outside [0, {pool.shape[1]})")
    pool.index_copy_(1, idx, src.to(pool.device))


def write_boundary(
    pools: BoundaryPools,
    rows: torch.Tensor | Sequence[int],
    slot: int | None,
    state: BoundaryState,
    *,
    token_start: int = 0,
) -> None:
    """Scatter ``state`` into the pools.

    ``rows[j]`` receives token ``token_start + j`` of the state (KV, and draft KV when the pools
    have a draft pool); ``slot`` (if not ``None``) receives every linear layer's conv and
    temporal state. Dtypes must match exactly (no silent casts: restores are bit-exact).
    """
    idx = _rows_index(rows, pools.kv.device)
    n = idx.numel()
    if token_start < 0 or token_start + n > state.length:
        raise ValueError(
            f"tokens [{token_start}, {token_start + n}) outside the state's {state.length} tokens")
    _write_rows(pools.kv, idx, state.kv[:, token_start:token_start + n], "kv")
    if pools.draft is not None:
        if state.draft is None:
            raise ValueError("the pools have a draft pool but the state carries no draft KV")
        _write_rows(pools.draft, idx.to(pools.draft.device),
                    state.draft[:, token_start:token_start + n], "draft")
    if slot is None:
        return
    if state.conv is None or state.temporal is None:
        raise ValueError("a slot was given but the state has no linear-attention part")
    if len(pools.conv) != len(state.conv) or len(pools.temporal) != len(state.temporal):
        raise ValueError(
            f"pools hold {len(pools.conv)} linear layers, the state {len(state.conv)}")
    for i, (pc, pt, c, t) in enumerate(zip(pools.conv, pools.temporal, state.conv, state.temporal,
                                          strict=True)):
        if not 0 <= slot < pc.shape[0]:
            raise IndexError(f"slot {slot} outside [0, {pc.shape[0]})")
        check_tensor(f"conv[{i}]", c, tuple(pc.shape[1:]), pc.dtype)
        pc[slot].copy_(c)
        if pt is None:
            if t is not None:
                raise ValueError(f"linear layer {i}: the pool has no temporal state, the state has")
            continue
        if t is None:
            raise ValueError(f"linear layer {i}: the state lacks a temporal state")
        check_tensor(f"temporal[{i}]", t, tuple(pt.shape[1:]), pt.dtype)
        pt[slot].copy_(t)


def read_boundary(
    pools: BoundaryPools,
    rows: torch.Tensor | Sequence[int],
    slot: int | None,
) -> BoundaryState:
    """Gather a :class:`BoundaryState` of ``len(rows)`` tokens (``rows[j]`` = token ``j``).

    ``slot=None`` gives a state without its linear-attention part (for pure-attention use or
    negative controls). The result owns its memory (copies, not pool views).
    """
    idx = _rows_index(rows, pools.kv.device)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= pools.kv.shape[1]):
        raise IndexError(f"kv: rows outside [0, {pools.kv.shape[1]})")
    kv = pools.kv.index_select(1, idx)
    draft = None
    if pools.draft is not None:
        draft = pools.draft.index_select(1, idx.to(pools.draft.device))
    conv: tuple[torch.Tensor, ...] | None = None
    temporal: tuple[torch.Tensor | None, ...] | None = None
    if slot is not None:
        for pc in pools.conv:
            if not 0 <= slot < pc.shape[0]:
                raise IndexError(f"slot {slot} outside [0, {pc.shape[0]})")
        conv = tuple(pc[slot].clone() for pc in pools.conv)
        temporal = tuple(None if pt is None else pt[slot].clone() for pt in pools.temporal)
    return BoundaryState(int(idx.numel()), kv, conv, temporal, draft)


def state_nbytes(state: BoundaryState) -> int:
    """Bytes a state occupies (KV + linear states + draft)."""
    n = state.kv.numel() * state.kv.element_size()
    for t in (*(state.conv or ()), *(state.temporal or ()), state.draft):
        if t is not None:
            n += t.numel() * t.element_size()
    return n


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (0.0 for empty tensors)."""
    return float((a - b).abs().max()) if a.numel() else 0.0


def kl_divergence(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) for logprob tensors ``[T, V]``."""
    if logp.shape != logq.shape:
        raise ValueError(f"shape mismatch {tuple(logp.shape)} vs {tuple(logq.shape)}")
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return float(kl.mean()) if kl.numel() else 0.0



__all__ = ["BoundaryPools", "ReferencePools", "allocate_pools", "kl_divergence", "max_abs_diff", "read_boundary", "state_nbytes", "write_boundary"]
