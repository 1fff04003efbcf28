"""Model layout: the geometry of every pool, validated, with a stable fingerprint.

A :class:`ModelLayout` says what one tensor-parallel rank keeps per token and per sequence:

* FULL: one KV row per token slot per full-attention layer, of ``kv_row_shape``/``kv_dtype``
  (for MLA the latent vector; for GQA ``(2, kv_heads, head_dim)``).
* MAMBA: one *slot* holds every linear-attention layer's conv state and temporal (recurrent)
  state for one sequence. A layer may have no temporal state (conv only), and a layer may be
  in both lists: it carries attention KV and a recurrent state.
* DRAFT: the draft model's KV; draft layer ``d`` rides with the ``d``-th full-attention
  layer and is indexed by the same token slots.

A purely recurrent model (Mamba2) has a *state-only* layout: no full-attention layer, so no
FULL pool (``kv_row_shape`` is ``()``, ``kv_dtype`` uint8, zero bytes per token) and no DRAFT.
The tree still pages its tokens (page keys, rows as page accounting); the store holds only
MAMBA states at grid boundaries.

The fingerprint hashes everything that decides the bytes of a stored object (shapes, dtypes,
page size, tp/dcp sizes) but not the rank, which goes into object keys instead.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Sequence

import attrs
import torch

from .mamba import checkpoint_grid, grid_unfit_reason
from .ranks import rank_term, replicated_writes


class PoolKind(enum.Enum):
    """The components of a hybrid prefix cache. ``SWA`` (sliding-window attention KV, pages on
    their own rows) is served by the SGLang plugin only; the ``Linker``'s own layouts hold FULL,
    MAMBA and DRAFT."""

    FULL = "kv"
    MAMBA = "mamba"
    DRAFT = "draft"
    SWA = "swa"


_ALLOWED_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


# what a state-only layout's (empty) KV pool is made of: a fixed value, so that it never
# changes the fingerprint
_STATE_ONLY_KV_DTYPE = torch.uint8


class LayoutError(ValueError):
    """A model layout is invalid; the message names the field."""


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _ALLOWED_DTYPES.items():
        if dt == dtype:
            return name
    raise LayoutError(f"unsupported dtype {dtype}; allowed: {sorted(_ALLOWED_DTYPES)}")


def _to_dtype(field: str, value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _ALLOWED_DTYPES.values():
            raise LayoutError(f"{field}: unsupported dtype {value}; allowed: {sorted(_ALLOWED_DTYPES)}")
        return value
    if isinstance(value, str) and value in _ALLOWED_DTYPES:
        return _ALLOWED_DTYPES[value]
    raise LayoutError(f"{field}: unsupported dtype {value!r}; allowed: {sorted(_ALLOWED_DTYPES)}")


def _shape(field: str, value: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(value)
    except TypeError:
        raise LayoutError(f"{field}: shape must be a non-empty tuple of positive ints, got {value!r}") from None
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise LayoutError(f"{field}: shape must be a non-empty tuple of positive ints, got {value!r}")
    return shape


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@attrs.frozen
class MambaLayerSpec:
    """One linear-attention layer's per-sequence state: conv state and optional temporal state."""

    layer_id: int
    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    temporal_shape: tuple[int, ...] | None = None
    temporal_dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        n = _nbytes(self.conv_shape, self.conv_dtype)
        if self.temporal_shape is not None and self.temporal_dtype is not None:
            n += _nbytes(self.temporal_shape, self.temporal_dtype)
        return n


@attrs.frozen
class ModelLayout:
    """Validated geometry of one rank's pools. Build it with :meth:`create`."""

    page_size: int
    chunk_size: int
    full_layers: tuple[int, ...]
    kv_row_shape: tuple[int, ...]
    kv_dtype: torch.dtype
    mamba_layers: tuple[MambaLayerSpec, ...] = ()
    draft_layers: int = 0
    draft_row_shape: tuple[int, ...] | None = None
    draft_dtype: torch.dtype | None = None
    tp_rank: int = 0
    tp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    replicated: frozenset[PoolKind] = frozenset()
    model_name: str = ""

    @classmethod
    def create(
        cls,
        *,
        page_size: int,
        chunk_size: int = 64,
        full_layers: Sequence[int],
        kv_row_shape: Sequence[int] | None = None,
        kv_dtype: torch.dtype | str = torch.bfloat16,
        mamba_layers: Sequence[MambaLayerSpec | dict[str, object]] = (),
        draft_layers: int = 0,
        draft_row_shape: Sequence[int] | None = None,
        draft_dtype: torch.dtype | str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        dcp_rank: int = 0,
        dcp_size: int = 1,
        replicated: Sequence[PoolKind | str] = (),
        model_name: str = "",
    ) -> ModelLayout:
        """Validate every field and build the layout; raises :class:`LayoutError`.

        ``full_layers`` may be empty only for a state-only layout (``mamba_layers`` given,
        ``kv_row_shape`` omitted, no draft layers); ``kv_row_shape`` is required otherwise.
        """
        for name, val in (("page_size", page_size), ("chunk_size", chunk_size),
                          ("tp_size", tp_size), ("dcp_size", dcp_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise LayoutError(f"{name} must be a positive int, got {val!r}")
        for name, val in (("tp_rank", tp_rank), ("dcp_rank", dcp_rank), ("draft_layers", draft_layers)):
            if not isinstance(val, int) or isinstance(val, bool):
                raise LayoutError(f"{name} must be an int, got {val!r}")
        if not 0 <= tp_rank < tp_size:
            raise LayoutError(f"tp_rank must lie in [0, tp_size={tp_size}), got {tp_rank}")
        if not 0 <= dcp_rank < dcp_size:
            raise LayoutError(f"dcp_rank must lie in [0, dcp_size={dcp_size}), got {dcp_rank}")
        if dcp_size > 1:
            # DCP reuses the TP ranks: each run of dcp_size consecutive TP ranks is one DCP group
            # (vLLM's grouping), so the TP rank decides the DCP rank
            if tp_size % dcp_size:
                raise LayoutError(f"dcp_size={dcp_size} must divide tp_size={tp_size}: DCP groups are "
                                  "runs of consecutive TP ranks")
            if dcp_rank != tp_rank % dcp_size:
                raise LayoutError(f"dcp_rank={dcp_rank} does not match tp_rank={tp_rank}: a DCP group is "
                                  f"dcp_size consecutive TP ranks, so dcp_rank = tp_rank % dcp_size = "
                                  f"{tp_rank % dcp_size}")
        fl = tuple(full_layers)
        if not fl and not mamba_layers:
            raise LayoutError("full_layers and mamba_layers are both empty: a layout needs at least "
                              "one full-attention or recurrent layer")
        if len(set(fl)) != len(fl) or any(
                not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in fl):
            raise LayoutError(f"full_layers must be distinct non-negative ints, got {fl!r}")
        specs: list[MambaLayerSpec] = []
        for i, m in enumerate(mamba_layers):
            if isinstance(m, dict):
                try:
                    m = MambaLayerSpec(**m)  # type: ignore[arg-type]
                except TypeError as exc:
                    raise LayoutError(f"mamba_layers[{i}]: {exc}") from None
            if not isinstance(m, MambaLayerSpec):
                raise LayoutError(f"mamba_layers[{i}]: expected a MambaLayerSpec or a dict, got {m!r}")
            if not isinstance(m.layer_id, int) or isinstance(m.layer_id, bool) or m.layer_id < 0:
                raise LayoutError(f"mamba_layers[{i}].layer_id must be a non-negative int, got {m.layer_id!r}")
            conv_shape = _shape(f"mamba_layers[{i}].conv_shape", m.conv_shape)
            conv_dtype = _to_dtype(f"mamba_layers[{i}].conv_dtype", m.conv_dtype)
            if (m.temporal_shape is None) != (m.temporal_dtype is None):
                raise LayoutError(f"mamba_layers[{i}]: give temporal_shape and temporal_dtype together")
            t_shape = None if m.temporal_shape is None else _shape(
                f"mamba_layers[{i}].temporal_shape", m.temporal_shape)
            t_dtype = None if m.temporal_dtype is None else _to_dtype(
                f"mamba_layers[{i}].temporal_dtype", m.temporal_dtype)
            specs.append(MambaLayerSpec(m.layer_id, conv_shape, conv_dtype, t_shape, t_dtype))
        ml = [s.layer_id for s in specs]
        if len(set(ml)) != len(ml):
            raise LayoutError(f"mamba_layers ids must be distinct, got {ml!r}")
        # an id in both lists is a layer that carries both attention KV and a recurrent state
        # (Falcon-H1, Zamba): its KV rides in the FULL pool, its state in the MAMBA slot
        if specs:
            # the tree keys widened pages under DCP: states sit on the grid of the widened page
            reason = grid_unfit_reason(chunk_size, page_size * dcp_size)
            if reason is not None:
                raise LayoutError(reason)
        if draft_layers < 0 or draft_layers > len(fl):
            raise LayoutError(
                f"draft_layers={draft_layers} must lie in [0, {len(fl)}] (one full-attention layer each)")
        d_shape: tuple[int, ...] | None = None
        d_dtype: torch.dtype | None = None
        if draft_layers:
            if draft_row_shape is None:
                raise LayoutError("draft_row_shape is required when draft_layers > 0")
            d_shape = _shape("draft_row_shape", draft_row_shape)
            d_dtype = _to_dtype("draft_dtype", draft_dtype if draft_dtype is not None else kv_dtype)
        if fl:
            if kv_row_shape is None:
                raise LayoutError("kv_row_shape is required when full_layers is given")
            row_shape = _shape("kv_row_shape", kv_row_shape)
            row_dtype = _to_dtype("kv_dtype", kv_dtype)
        else:  # state-only: no FULL pool, no bytes per token
            if kv_row_shape is not None and tuple(kv_row_shape):
                raise LayoutError(f"kv_row_shape={tuple(kv_row_shape)!r} without full_layers: a "
                                  "state-only layout holds no KV rows")
            row_shape, row_dtype = (), _STATE_ONLY_KV_DTYPE
        rep: set[PoolKind] = set()
        for r in replicated:
            try:
                rep.add(r if isinstance(r, PoolKind) else PoolKind(r))
            except ValueError:
                raise LayoutError(f"replicated: unknown pool {r!r}; use kv, mamba or draft") from None
        return cls(
            page_size=page_size,
            chunk_size=chunk_size,
            full_layers=fl,
            kv_row_shape=row_shape,
            kv_dtype=row_dtype,
            mamba_layers=tuple(specs),
            draft_layers=draft_layers,
            draft_row_shape=d_shape,
            draft_dtype=d_dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dcp_rank=dcp_rank,
            dcp_size=dcp_size,
            replicated=frozenset(rep),
            model_name=model_name,
        )

    # ---- derived geometry -------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return bool(self.mamba_layers)

    @property
    def tree_page(self) -> int:
        """Tokens per tree page (one page key): ``dcp_size`` kernel pages of ``page_size`` rows,
        since decode-context parallelism interleaves a page's tokens over the DCP ranks and each
        rank holds ``page_size`` of them (``page_size`` itself without DCP)."""
        return self.page_size * self.dcp_size

    def folds(self, pool: PoolKind) -> bool:
        """Whether ``pool`` is indexed by token and so DCP-folded: each DCP rank holds every
        ``dcp_size``-th token of a page (KV and draft KV). A state is per sequence, never folded."""
        return self.dcp_size > 1 and pool is not PoolKind.MAMBA

    @property
    def state_only(self) -> bool:
        """No full-attention layer: the store holds only MAMBA states (a purely recurrent model)."""
        return not self.full_layers

    @property
    def grid(self) -> int:
        """Token granularity of restorable boundaries (the tree page for pure attention)."""
        return checkpoint_grid(self.chunk_size, self.tree_page) if self.is_hybrid else self.tree_page

    @property
    def pools(self) -> tuple[PoolKind, ...]:
        out = [] if self.state_only else [PoolKind.FULL]
        if self.is_hybrid:
            out.append(PoolKind.MAMBA)
        if self.draft_layers:
            out.append(PoolKind.DRAFT)
        return tuple(out)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one token's KV across all full-attention layers."""
        return len(self.full_layers) * _nbytes(self.kv_row_shape, self.kv_dtype)

    @property
    def draft_row_bytes(self) -> int:
        if not self.draft_layers or self.draft_row_shape is None or self.draft_dtype is None:
            return 0
        return self.draft_layers * _nbytes(self.draft_row_shape, self.draft_dtype)

    @property
    def mamba_state_bytes(self) -> int:
        return sum(s.nbytes for s in self.mamba_layers)

    def payload_bytes(self, pool: PoolKind) -> int:
        """Payload size of one stored object of ``pool`` (a page for KV/DRAFT, a state for MAMBA)."""
        if pool is PoolKind.FULL:
            return self.page_size * self.kv_row_bytes
        if pool is PoolKind.DRAFT:
            return self.page_size * self.draft_row_bytes
        return self.mamba_state_bytes

    def writes(self, pool: PoolKind) -> bool:
        """Whether this rank writes ``pool`` to the store: a sharded pool every rank, a replicated
        one only its first holder (TP rank 0; for a DCP-folded pool the first DCP group, one
        writer per DCP rank, since each DCP rank holds other tokens)."""
        return replicated_writes(self.tp_rank, replicated=pool in self.replicated, dcp_size=self.dcp_size,
                                 folded=self.folds(pool))

    def rank_term(self, pool: PoolKind) -> str:
        """Which ranks share ``pool``'s objects: ``tp<r>`` (sharded) or ``rep`` (replicated),
        plus ``dcp<d>`` for a DCP-folded pool (each DCP rank holds its own tokens)."""
        return rank_term(self.tp_rank, replicated=pool in self.replicated,
                         dcp_rank=self.dcp_rank if self.folds(pool) else None)

    def describe(self) -> dict[str, object]:
        """Everything that decides stored bytes, as JSON-able data (rank excluded)."""
        return {
            "page_size": self.page_size,
            "chunk_size": self.chunk_size,
            "full_layers": list(self.full_layers),
            "kv_row_shape": list(self.kv_row_shape),
            "kv_dtype": _dtype_name(self.kv_dtype),
            "mamba_layers": [
                {
                    "layer_id": s.layer_id,
                    "conv_shape": list(s.conv_shape),
                    "conv_dtype": _dtype_name(s.conv_dtype),
                    "temporal_shape": None if s.temporal_shape is None else list(s.temporal_shape),
                    "temporal_dtype": None if s.temporal_dtype is None else _dtype_name(s.temporal_dtype),
                }
                for s in self.mamba_layers
            ],
            "draft_layers": self.draft_layers,
            "draft_row_shape": None if self.draft_row_shape is None else list(self.draft_row_shape),
            "draft_dtype": None if self.draft_dtype is None else _dtype_name(self.draft_dtype),
            "tp_size": self.tp_size,
            "dcp_size": self.dcp_size,
            "replicated": sorted(p.value for p in self.replicated),
            "model_name": self.model_name,
        }

    @property
    def fingerprint(self) -> bytes:
        """SHA-256 of :meth:`describe`; seeds every page key and every object header."""
        return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).digest()
