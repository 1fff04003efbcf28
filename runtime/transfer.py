"""Gather and scatter between pool rows and staging frames, vectorized per batch.

A *transfer* is one pool's list of objects for one phase: ``index[n, per]`` says which device
rows (KV, DRAFT: ``per = page_size``) or slot (MAMBA: ``per = 1``) object ``i`` covers.
A codec turns a batch of such objects into payload bytes (``[n, payload_bytes]`` uint8) and
back, with one indexing operation per pool tensor — no Python loop per row.

Payload layouts:

* KV / DRAFT page: ``[layer][token][*row]`` for the page's ``P`` tokens, layer-major, so a
  page object holds every layer and the scatter can still land layer by layer.
* MAMBA state: ``conv_0 ‖ temporal_0 ‖ conv_1 ‖ ...`` in layout order, raw bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..components.layout import ModelLayout, PoolKind
from ..components.pools import HybridPools


class PoolCodec:
    """Moves one pool's objects between device tensors and payload bytes."""

    def __init__(self, kind: PoolKind, layout: ModelLayout, pools: HybridPools) -> None:
        self.kind = kind
        self.layout = layout
        self.payload_bytes = layout.payload_bytes(kind)
        if kind is PoolKind.MAMBA:
            assert pools.mamba is not None
            self.tensors = pools.mamba.tensors()
            owners: list[int] = []
            for spec in layout.mamba_layers:
                owners.append(spec.layer_id)
                if spec.temporal_shape is not None:
                    owners.append(spec.layer_id)
            self.tensor_layers = owners
            self.slot_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        else:
            t = pools.kv.tensor if kind is PoolKind.FULL else pools.draft.tensor  # type: ignore[union-attr]
            self.tensors = [t]
            n_layers = t.shape[0]
            self.tensor_layers = list(layout.full_layers[:n_layers])
            self.row_shape = tuple(t.shape[2:])
            self.layer_page_bytes = layout.page_size * t[0, 0].numel() * t.element_size()
        self.device = self.tensors[0].device

    @property
    def layer_ids(self) -> list[int]:
        """Model layer ids this pool feeds, in scatter order (duplicates removed)."""
        return list(dict.fromkeys(self.tensor_layers))

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the objects named by ``index[n, per]`` into ``out[n, payload_bytes]``."""
        n = index.shape[0]
        if self.kind is PoolKind.MAMBA:
            slots = index[:, 0].to(self.device)
            off = 0
            for t, b in zip(self.tensors, self.slot_bytes):
                out[:, off:off + b].copy_(_bytes_of(t[slots].reshape(n, -1)))
                off += b
            return
        t = self.tensors[0]
        rows = index.reshape(-1).to(self.device)
        g = t[:, rows]  # [L, n*P, *row]
        g = g.reshape(t.shape[0], n, -1).transpose(0, 1)  # [n, L, P*row]
        out.copy_(_bytes_of(g.contiguous().reshape(n, -1)))

    def scatter(self, src: torch.Tensor, index: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> None:
        """Write payloads ``src[n, payload_bytes]`` into the objects named by ``index``.

        ``on_layer(layer_id)`` is called as soon as each model layer's data has landed.
        """
        n = index.shape[0]
        if self.kind is PoolKind.MAMBA:
            slots = index[:, 0].to(self.device)
            off = 0
            done: set[int] = set()
            for i, (t, b) in enumerate(zip(self.tensors, self.slot_bytes)):
                part = src[:, off:off + b].contiguous().to(self.device)
                t[slots] = part.view(t.dtype).reshape(n, *t.shape[1:])
                off += b
                layer = self.tensor_layers[i]
                last_of_layer = i + 1 == len(self.tensors) or self.tensor_layers[i + 1] != layer
                if on_layer is not None and last_of_layer and layer not in done:
                    done.add(layer)
                    on_layer(layer)
            return
        t = self.tensors[0]
        rows = index.reshape(-1).to(self.device)
        lb = self.layer_page_bytes
        for layer in range(t.shape[0]):
            part = src[:, layer * lb:(layer + 1) * lb].contiguous().to(self.device)
            t[layer, rows] = part.view(t.dtype).reshape(-1, *self.row_shape)
            if on_layer is not None:
                on_layer(self.tensor_layers[layer])


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as ``[rows, bytes]`` uint8 on the host."""
    b = x.contiguous().view(torch.uint8)
    return b.cpu() if b.device.type != "cpu" else b
