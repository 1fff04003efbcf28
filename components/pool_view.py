"""Pool views: an engine's own pool tensors, borrowed, described for transfers.

A serving engine owns its device memory and decides which rows and slots a request gets.
hylinker moves data in and out of those tensors without copying or reallocating them: a
:class:`PoolView` names, per model layer, the tensors ("parts") that hold that layer's data
for one pool, each indexed by row (KV, draft KV) or slot (recurrent state) on dimension 0.

* FULL, MHA: per layer ``[k_buffer[i], v_buffer[i]]``, each ``[rows, heads, head_dim]``.
* FULL, MLA: per layer ``[latent_buffer[i]]``.
* DRAFT: like FULL, on the *same rows* as FULL (:class:`PoolSet` checks the capacity).
* MAMBA: per layer ``[conv_0[i], conv_1[i], ..., temporal[i]]`` from per-layer tensors or from
  stacked ``[L, slots, ...]`` tensors (SGLang's ``mamba_cache.conv[j]`` / ``.temporal``).

One stored *object* is one page (``unit = page_size`` rows) or one state (``unit = 1`` slot).
Its payload is layer-major, then part-major, then row-major: for each layer, for each part,
the ``unit`` rows' bytes. A view over :class:`~hylinker.components.pools.HybridPools` gives
exactly the bytes the project has always stored (``[layer][token][row]`` for a page,
``conv_0 ‖ temporal_0 ‖ conv_1 ‖ ...`` for a state).

Invariants the caller (the engine) keeps:

* the borrowed tensors stay allocated, at the same address and shape, while any transfer
  over the view can run (until ``DataPlane.close()`` returned);
* a row or slot named in a transfer is not written by the engine while a load into it runs,
  and not overwritten before an offload's fence completed and the offload read it;
* every part is contiguous (a row is one run of bytes and consecutive rows are adjacent).

Everything is validated here, at construction, with a :class:`PoolViewError` that names the
layer and part: type, dimensions, dtype, device, capacity, contiguity, repeated layers.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence

import attrs
import numpy as np
import torch

from .layout import ModelLayout, PoolKind


class PoolViewError(ValueError):
    """Borrowed tensors that cannot back a pool view, or a transfer index that does not fit."""


@attrs.frozen(eq=False)
class LayerParts:
    """The tensors that hold one model layer's data in one pool (each indexed on dim 0)."""

    layer_id: int
    parts: tuple[torch.Tensor, ...]


def _row_bytes(t: torch.Tensor) -> int:
    return (t.numel() // max(1, t.shape[0])) * t.element_size() if t.shape[0] else 0


class PoolView:
    """One pool's borrowed tensors. Build it with :func:`kv_view`, :func:`state_view`,
    :func:`stacked_kv_view` or :meth:`HybridPools.views`; never copies a tensor."""

    def __init__(self, kind: PoolKind, unit: int, layers: Sequence[LayerParts], *,
                 stacked: Sequence[torch.Tensor] | None = None) -> None:
        if not isinstance(kind, PoolKind):
            raise PoolViewError(f"kind must be a PoolKind, got {kind!r}")
        if not isinstance(unit, int) or isinstance(unit, bool) or unit <= 0:
            raise PoolViewError(f"{kind.value}: rows per object must be a positive int, got {unit!r}")
        if kind is PoolKind.MAMBA and unit != 1:
            raise PoolViewError("a state object is one slot: unit must be 1 for MAMBA")
        if not layers:
            raise PoolViewError(f"{kind.value}: a pool view needs at least one layer")
        self.kind = kind
        self.unit = unit
        self.layers = tuple(layers)
        ids = [lp.layer_id for lp in self.layers]
        for lid in ids:
            if not isinstance(lid, int) or isinstance(lid, bool) or lid < 0:
                raise PoolViewError(f"{kind.value}: layer ids must be non-negative ints, got {lid!r}")
        if len(set(ids)) != len(ids):
            raise PoolViewError(f"{kind.value}: layer ids repeat: {ids}")
        first = self.layers[0].parts
        if not first:
            raise PoolViewError(f"{kind.value}: layer {ids[0]} has no tensors")
        for lp in self.layers:
            for j, t in enumerate(lp.parts):
                where = f"{kind.value} layer {lp.layer_id} part {j}"
                if not isinstance(t, torch.Tensor):
                    raise PoolViewError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
                if t.dim() < 1:
                    raise PoolViewError(f"{where}: a 0-d tensor has no rows")
                if not t.is_contiguous():
                    raise PoolViewError(f"{where}: must be contiguous (strides {tuple(t.stride())})")
                if t.is_sparse or t.is_quantized:
                    raise PoolViewError(f"{where}: sparse and quantized tensors are not supported")
            if not lp.parts:
                raise PoolViewError(f"{kind.value} layer {lp.layer_id}: no tensors")
            # layers may differ in parts (a conv-only linear layer), never in rows or device
            t0 = first[0]
            for j, t in enumerate(lp.parts):
                where = f"{kind.value} layer {lp.layer_id} part {j}"
                if t.device != t0.device:
                    raise PoolViewError(f"{where}: on {t.device}, layer {ids[0]} is on {t0.device}")
                if t.shape[0] != t0.shape[0]:
                    raise PoolViewError(f"{where}: {t.shape[0]} rows, layer {ids[0]} has {t0.shape[0]}")
                if _row_bytes(t) == 0:
                    raise PoolViewError(f"{where}: zero bytes per row")
        self.capacity = first[0].shape[0]
        if self.capacity < unit:
            raise PoolViewError(f"{kind.value}: {self.capacity} rows cannot hold one {unit}-row object")
        self.device = first[0].device
        #: per layer, bytes of one row of each part
        self.part_row_bytes = tuple(tuple(_row_bytes(t) for t in lp.parts) for lp in self.layers)
        self.stacked = self._check_stacked(stacked)

    def _check_stacked(self, stacked: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...] | None:
        """Optional ``[L, capacity, ...]`` tensors whose ``[l]`` are part ``j`` of layer ``l``:
        lets host copies move every layer of an object with one NumPy call."""
        if stacked is None:
            return None
        out = tuple(stacked)
        if any(len(lp.parts) != len(out) for lp in self.layers):
            raise PoolViewError(f"{self.kind.value}: {len(out)} stacked tensors for "
                                f"{len(self.layers[0].parts)} parts per layer")
        for j, st in enumerate(out):
            if st.dim() < 2 or st.shape[0] != len(self.layers) or not st.is_contiguous():
                raise PoolViewError(f"{self.kind.value}: stacked tensor {j} must be contiguous "
                                    f"[{len(self.layers)}, rows, ...], got {tuple(st.shape)}")
            for lp in self.layers:
                p = lp.parts[j]
                if p.data_ptr() != st[self.layers.index(lp)].data_ptr() or p.shape != st.shape[1:]:
                    raise PoolViewError(f"{self.kind.value}: stacked tensor {j} does not back layer "
                                        f"{lp.layer_id}'s part {j}")
        return out

    # ---- geometry ------------------------------------------------------------------------
    @property
    def layer_ids(self) -> list[int]:
        return [lp.layer_id for lp in self.layers]

    @property
    def payload_bytes(self) -> int:
        """Payload bytes of one whole object (every layer)."""
        return self.unit * sum(sum(b) for b in self.part_row_bytes)

    def tensors(self) -> Iterator[torch.Tensor]:
        for lp in self.layers:
            yield from lp.parts

    def describe(self) -> dict[str, object]:
        """What decides stored bytes, as JSON-able data (device and addresses excluded)."""
        return {
            "kind": self.kind.value,
            "unit": self.unit,
            "layers": self.layer_ids,
            "parts": [[[list(t.shape[1:]), str(t.dtype)] for t in lp.parts] for lp in self.layers],
        }

    def select(self, lo: int, hi: int) -> PoolView:
        """The view of layers ``lo:hi`` (the same tensors): one layer group's objects."""
        if not 0 <= lo < hi <= len(self.layers):
            raise PoolViewError(f"{self.kind.value}: layer range {lo}:{hi} outside 0:{len(self.layers)}")
        stacked = None if self.stacked is None else [st[lo:hi] for st in self.stacked]
        return PoolView(self.kind, self.unit, self.layers[lo:hi], stacked=stacked)

    def layer_groups(self, groups: int) -> list[PoolView]:
        """Split into at most ``groups`` views of consecutive layers (sizes differ by at most one)."""
        if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
            raise PoolViewError(f"layer groups must be a positive int, got {groups!r}")
        n = len(self.layers)
        g = min(groups, n)
        bounds = [round(i * n / g) for i in range(g + 1)]
        return [self.select(a, b) for a, b in itertools.pairwise(bounds)]

    # ---- transfer indices ------------------------------------------------------------------
    def objects(self, index: torch.Tensor | Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        """Check a transfer's rows (or slots) and return them as int64 ``[n, unit]`` on the CPU.

        Accepts ``[n, unit]`` or flat ``[n * unit]`` (whole objects). Refuses out-of-range,
        negative, repeated or fractional indices: a transfer never writes rows it did not name.
        """
        if isinstance(index, torch.Tensor):
            t = index.detach()
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise PoolViewError(f"{self.kind.value}: indices must be integers, got {t.dtype}")
            t = t.to("cpu", torch.int64)
        else:
            try:
                t = torch.as_tensor(np.asarray(index, dtype=np.int64))
            except (TypeError, ValueError) as exc:
                raise PoolViewError(f"{self.kind.value}: indices must be integers: {exc}") from None
        if t.dim() == 1:
            if t.numel() % self.unit:
                raise PoolViewError(f"{self.kind.value}: {t.numel()} indices is not a whole number of "
                                    f"{self.unit}-row objects")
            t = t.reshape(-1, self.unit)
        if t.dim() != 2 or t.shape[1] != self.unit:
            raise PoolViewError(f"{self.kind.value}: indices must be [n, {self.unit}], got {tuple(t.shape)}")
        t = t.contiguous()
        if t.numel():
            a = t.numpy()  # NumPy: these checks run per submission, on the scheduler's path
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= self.capacity:
                raise PoolViewError(f"{self.kind.value}: index out of range [0, {self.capacity}): "
                                    f"min {lo}, max {hi}")
            if _repeats(a):
                raise PoolViewError(f"{self.kind.value}: repeated indices in one transfer")
        return t


def _repeats(a: np.ndarray) -> bool:
    """Whether any index repeats. Objects that are ascending runs (pages) are intervals: sort
    their starts and check the gaps, O(n log n) in objects rather than rows."""
    if a.shape[1] > 1 and bool((np.diff(a, axis=1) == 1).all()):
        starts = np.sort(a[:, 0])
        return bool((np.diff(starts) < a.shape[1]).any())
    flat = np.sort(a, axis=None)
    return bool((flat[1:] == flat[:-1]).any())


# ---- builders ------------------------------------------------------------------------------

def _per_layer(name: str, tensors: Sequence[torch.Tensor], n: int) -> list[torch.Tensor]:
    out = list(tensors)
    if len(out) != n:
        raise PoolViewError(f"{name}: {len(out)} tensors for {n} layers")
    return out


def _layer_ids(layer_ids: Sequence[int], n: int, name: str) -> list[int]:
    ids = list(layer_ids)
    if len(ids) != n:
        raise PoolViewError(f"{name}: {len(ids)} layer ids for {n} layers")
    return ids


def kv_view(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None = None, *,
            layer_ids: Sequence[int], page_size: int, kind: PoolKind = PoolKind.FULL) -> PoolView:
    """Per-layer KV buffers indexed by token row: MHA (``k`` and ``v``) or MLA (``k`` only,
    the latent). ``kind=DRAFT`` for a draft model's KV on the same rows."""
    if kind is PoolKind.MAMBA:
        raise PoolViewError("kv_view builds FULL or DRAFT views; use state_view for MAMBA")
    ks = list(k)
    ids = _layer_ids(layer_ids, len(ks), f"{kind.value} k")
    vs = None if v is None else _per_layer(f"{kind.value} v", v, len(ks))
    layers = [LayerParts(lid, (ks[i],) if vs is None else (ks[i], vs[i])) for i, lid in enumerate(ids)]
    return PoolView(kind, page_size, layers)


def stacked_kv_view(tensor: torch.Tensor, *, layer_ids: Sequence[int], page_size: int,
                    kind: PoolKind = PoolKind.FULL) -> PoolView:
    """A stacked ``[L, rows, *row]`` KV tensor (one part per layer: ``tensor[l]``)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        raise PoolViewError(f"{kind.value}: a stacked KV tensor must be [layers, rows, ...]")
    ids = _layer_ids(layer_ids, tensor.shape[0], kind.value)
    layers = [LayerParts(lid, (tensor[i],)) for i, lid in enumerate(ids)]
    return PoolView(kind, page_size, layers, stacked=[tensor])


def state_view(conv: Sequence[torch.Tensor] | Sequence[Sequence[torch.Tensor]],
               temporal: torch.Tensor | Sequence[torch.Tensor | None] | None = None, *,
               layer_ids: Sequence[int]) -> PoolView:
    """Recurrent-state tensors indexed by slot; per layer ``conv_0 ‖ conv_1 ‖ ... ‖ temporal``.

    Two shapes are accepted:

    * stacked (SGLang): ``conv = [conv_0[L, slots, ...], conv_1[L, slots, ...], ...]`` and
      ``temporal[L, slots, ...]`` (or ``None``);
    * per layer (``HybridPools``): ``conv = [[c_0[slots, ...]], [c_1[slots, ...]], ...]`` — a
      list of per-layer lists — and ``temporal = [t_0 | None, t_1 | None, ...]``.
    """
    ids = list(layer_ids)
    n = len(ids)
    convs = list(conv)
    if not convs:
        raise PoolViewError("mamba: at least one conv tensor is needed")
    if all(isinstance(c, torch.Tensor) for c in convs):  # stacked: conv_j[L, slots, ...]
        stacked_conv = [c for c in convs if isinstance(c, torch.Tensor)]
        for j, c in enumerate(stacked_conv):
            if c.dim() < 2 or c.shape[0] != n:
                raise PoolViewError(f"mamba conv {j}: expected [{n} layers, slots, ...], got {tuple(c.shape)}")
        if temporal is not None and not isinstance(temporal, torch.Tensor):
            raise PoolViewError("mamba: stacked conv tensors need a stacked temporal tensor (or None)")
        if temporal is not None and (temporal.dim() < 2 or temporal.shape[0] != n):
            raise PoolViewError(f"mamba temporal: expected [{n} layers, slots, ...], got {tuple(temporal.shape)}")
        stacked = [*stacked_conv, *([temporal] if temporal is not None else [])]
        layers = [LayerParts(lid, tuple(st[i] for st in stacked)) for i, lid in enumerate(ids)]
        return PoolView(PoolKind.MAMBA, 1, layers, stacked=stacked)
    per_layer = [list(c) if not isinstance(c, torch.Tensor) else [c] for c in convs]
    if len(per_layer) != n:
        raise PoolViewError(f"mamba: {len(per_layer)} per-layer conv lists for {n} layers")
    temps: list[torch.Tensor | None]
    if temporal is None:
        temps = [None] * n
    elif isinstance(temporal, torch.Tensor):
        raise PoolViewError("mamba: per-layer conv tensors need per-layer temporal tensors")
    else:
        temps = list(temporal)
        if len(temps) != n:
            raise PoolViewError(f"mamba: {len(temps)} temporal tensors for {n} layers")
    layers = []
    for i, lid in enumerate(ids):
        t = temps[i]
        layers.append(LayerParts(lid, (*per_layer[i], *([t] if t is not None else []))))
    return PoolView(PoolKind.MAMBA, 1, layers)


class PoolSet(Mapping[PoolKind, PoolView]):
    """The views of one rank, by pool. Checks what ties pools together: DRAFT lies on the
    FULL rows (same capacity, same rows per page), every pool on one device. A MAMBA view
    alone is a state-only set (a purely recurrent model)."""

    def __init__(self, views: Mapping[PoolKind, PoolView] | Sequence[PoolView]) -> None:
        items = list(views.values()) if isinstance(views, Mapping) else list(views)
        self._views: dict[PoolKind, PoolView] = {}
        for v in items:
            if not isinstance(v, PoolView):
                raise PoolViewError(f"expected a PoolView, got {type(v).__name__}")
            if v.kind in self._views:
                raise PoolViewError(f"two views for pool {v.kind.value}")
            self._views[v.kind] = v
        if not self._views:
            raise PoolViewError("a pool set needs at least one view")
        full = self._views.get(PoolKind.FULL)
        draft = self._views.get(PoolKind.DRAFT)
        if draft is not None and full is None:
            raise PoolViewError("draft KV lies on the KV rows: a pool set with a DRAFT view needs a FULL view")
        if draft is not None and full is not None and (
                draft.capacity != full.capacity or draft.unit != full.unit):
            raise PoolViewError(f"draft KV must lie on the KV rows: {draft.capacity} rows of {draft.unit}-row "
                                f"pages vs {full.capacity} of {full.unit}")
        devices = {v.device for v in self._views.values()}
        if len(devices) != 1:
            raise PoolViewError(f"pools on several devices: {sorted(map(str, devices))}")
        self.device = next(iter(devices))

    def __getitem__(self, kind: PoolKind) -> PoolView:
        return self._views[kind]

    def __iter__(self) -> Iterator[PoolKind]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    @property
    def page_size(self) -> int | None:
        """Rows per page object (``None`` for a state-only set, which has no pages)."""
        full = self._views.get(PoolKind.FULL)
        return None if full is None else full.unit

    def fingerprint(self, namespace: bytes | str = b"") -> bytes:
        """SHA-256 over the views' geometry and ``namespace`` (model, rank term): the tag every
        stored object carries, so objects of another geometry are rejected on load."""
        ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
        doc = json.dumps({k.value: v.describe() for k, v in sorted(self._views.items(), key=lambda kv: kv[0].value)},
                         sort_keys=True).encode()
        return hashlib.sha256(doc + b"\0" + ns).digest()

    def check_layout(self, layout: ModelLayout) -> None:
        """Raise unless these views hold exactly the bytes ``layout`` describes per object."""
        if set(self._views) != set(layout.pools):
            raise PoolViewError(f"views for {sorted(k.value for k in self._views)}, layout has "
                                f"{sorted(k.value for k in layout.pools)}")
        for kind, v in self._views.items():
            if v.payload_bytes != layout.payload_bytes(kind):
                raise PoolViewError(f"{kind.value}: views hold {v.payload_bytes} bytes per object, the layout "
                                    f"{layout.payload_bytes(kind)}")
        if self.page_size is not None and self.page_size != layout.page_size:
            raise PoolViewError(f"views use {self.page_size}-row pages, the layout {layout.page_size}")


__all__ = ["LayerParts", "PoolSet", "PoolView", "PoolViewError", "kv_view", "stacked_kv_view", "state_view"]
