"""Gather and scatter between pool rows and staging frames, vectorized per batch.

A *transfer* is one pool's list of objects for one phase: ``index[n, per]`` says which device
rows (KV, DRAFT: ``per = page_size``) or slot (MAMBA: ``per = 1``) object ``i`` covers.
A codec turns a batch of such objects into payload bytes (``[n, payload_bytes]`` uint8) and
back — never a Python loop per row:

* device pools (CUDA/HIP): one gather (``index_select``) per pool tensor on the device, then
  one copy to the host; the reverse on load, layer by layer;
* host pools: one ``memcpy`` per page (or state) and tensor, straight between the pool and the
  frame through NumPy views — no intermediate tensor, and no intra-op thread pool (torch's
  parallel copies cost more than they save for 16 KiB–1 MiB pieces on a busy 2-core host).

Payload layouts:

* KV / DRAFT page: ``[layer][token][*row]`` for the page's ``P`` tokens, layer-major, so a
  page object holds every layer and the scatter can still land layer by layer.
* MAMBA state: ``conv_0 ‖ temporal_0 ‖ conv_1 ‖ ...`` in layout order, raw bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
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
            # per tensor: [slots, bytes of one slot]
            self._bytes = [t.view(torch.uint8).reshape(t.shape[0], -1) for t in self.tensors]
        else:
            t = pools.kv.tensor if kind is PoolKind.FULL else pools.draft.tensor  # type: ignore[union-attr]
            self.tensors = [t]
            self.tensor_layers = list(layout.full_layers[: t.shape[0]])
            self.row_shape = tuple(t.shape[2:])
            # [layer, row, bytes of one row]
            self._bytes = [t.view(torch.uint8).reshape(t.shape[0], t.shape[1], -1)]
            self.layer_page_bytes = layout.page_size * self._bytes[0].shape[2]
        self.device = self.tensors[0].device
        self._host = [b.numpy() for b in self._bytes] if self.device.type == "cpu" else None

    @property
    def layer_ids(self) -> list[int]:
        """Model layer ids this pool feeds, in scatter order (duplicates removed)."""
        return list(dict.fromkeys(self.tensor_layers))

    # ---- offload ------------------------------------------------------------------------
    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the objects named by ``index[n, per]`` into ``out[n, payload_bytes]``."""
        if self._host is not None and _runs(index):
            dst = out.numpy()
            if self.kind is PoolKind.MAMBA:
                for i, slot in enumerate(index[:, 0].tolist()):
                    off = 0
                    for src in self._host:
                        w = src.shape[1]
                        dst[i, off:off + w] = src[slot]
                        off += w
                return
            src = self._host[0]
            per = index.shape[1]
            for i, r0 in enumerate(index[:, 0].tolist()):
                dst[i].reshape(src.shape[0], per, src.shape[2])[:] = src[:, r0:r0 + per]
            return
        n = index.shape[0]
        if self.kind is PoolKind.MAMBA:
            slots = index[:, 0].to(self.device)
            off = 0
            for b in self._bytes:
                w = b.shape[1]
                out[:, off:off + w].copy_(b.index_select(0, slots))
                off += w
            return
        b = self._bytes[0]
        rows = index.reshape(-1).to(self.device)
        g = b.index_select(1, rows).reshape(b.shape[0], n, -1).transpose(0, 1)  # [n, L, P*row]
        out.copy_(g.reshape(n, -1))

    # ---- load ---------------------------------------------------------------------------
    def host_path(self, index: torch.Tensor) -> bool:
        """Whether these objects move by plain memcpy between host memory and frames."""
        return self._host is not None and _runs(index)

    def scatter_one(self, payload: np.ndarray, first: int) -> None:
        """Host path: write one object's verified payload into its rows starting at row
        ``first`` (a page's first row, or the state's slot)."""
        assert self._host is not None
        if self.kind is PoolKind.MAMBA:
            off = 0
            for dst in self._host:
                w = dst.shape[1]
                dst[first] = payload[off:off + w]
                off += w
            return
        dst = self._host[0]
        per = self.layout.page_size
        dst[:, first:first + per] = payload.reshape(dst.shape[0], per, dst.shape[2])

    def scatter(self, src: torch.Tensor, index: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> None:
        """Write payloads ``src[n, payload_bytes]`` into the objects named by ``index``.

        ``on_layer(layer_id)`` is called as soon as each model layer's data has landed.
        """
        n = index.shape[0]
        host = self._host is not None and _runs(index)
        if self.kind is PoolKind.MAMBA:
            slots_l = index[:, 0].tolist()
            slots = index[:, 0].to(self.device)
            off = 0
            for i, b in enumerate(self._bytes):
                w = b.shape[1]
                if host:
                    assert self._host is not None
                    s = src.numpy()
                    for j, slot in enumerate(slots_l):
                        self._host[i][slot] = s[j, off:off + w]
                else:
                    b.index_copy_(0, slots, src[:, off:off + w].to(self.device))
                off += w
                layer = self.tensor_layers[i]
                last_of_layer = i + 1 == len(self._bytes) or self.tensor_layers[i + 1] != layer
                if on_layer is not None and last_of_layer:
                    on_layer(layer)
            return
        b = self._bytes[0]
        lb = self.layer_page_bytes
        per = index.shape[1]
        if host:
            assert self._host is not None
            dst = self._host[0]
            s = src.numpy()
            starts = index[:, 0].tolist()
            for layer in range(b.shape[0]):
                for j, r0 in enumerate(starts):
                    dst[layer, r0:r0 + per] = s[j, layer * lb:(layer + 1) * lb].reshape(per, -1)
                if on_layer is not None:
                    on_layer(self.tensor_layers[layer])
            return
        rows = index.reshape(-1).to(self.device)
        for layer in range(b.shape[0]):
            part = src[:, layer * lb:(layer + 1) * lb].to(self.device)
            b[layer].index_copy_(0, rows, part.reshape(n * per, -1))
            if on_layer is not None:
                on_layer(self.tensor_layers[layer])


def _runs(index: torch.Tensor) -> bool:
    """Whether each object's rows are one ascending run (true for pages from ``KVPool``)."""
    if index.shape[1] == 1:
        return True
    return bool((index[:, 1:] - index[:, :-1] == 1).all())


__all__ = ["PoolCodec"]

