"""Gather and scatter between pool rows and staging frames, vectorized per batch.

A *transfer* is one pool's list of objects for one phase: ``index[n, unit]`` says which rows
(KV, DRAFT: ``unit = page_size``) or slot (MAMBA: ``unit = 1``) object ``i`` covers. A
:class:`PoolCodec` over a :class:`~hylinker.components.pool_view.PoolView` turns a batch of such
objects into payload bytes (``[n, payload_bytes]`` uint8) and back — never a Python loop per row:

* device pools (CUDA/HIP): one gather (``index_select``) per layer part on the device, then one
  copy to the host; the reverse on load, layer by layer;
* host pools: one ``memcpy`` per object and part (or per object when the view is stacked),
  straight between the pool and the frame through NumPy views — no intermediate tensor and no
  intra-op thread pool (torch's parallel copies cost more than they save for 16 KiB–1 MiB
  pieces on a busy 2-core host).

Payload layout (the view's, see ``components/pool_view.py``): layer-major, then part-major, then
row-major. A codec may cover a subset of a view's layers (a *layer group*): its objects then
hold only those layers, so a multi-group load lands, verifies and reports group by group.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ...components.pool_view import PoolView


class PoolCodec:
    """Moves one pool's objects (or one layer group of them) between tensors and payload bytes."""

    def __init__(self, view: PoolView) -> None:
        self.view = view
        self.kind = view.kind
        self.unit = view.unit
        self.payload_bytes = view.payload_bytes
        self.device = view.device
        # segments in payload order: (layer id, [capacity, row bytes] byte view of one part)
        self._segments: list[tuple[int, torch.Tensor]] = [
            (lp.layer_id, t.view(torch.uint8).reshape(t.shape[0], -1)) for lp in view.layers for t in lp.parts]
        self._widths = [b.shape[1] * self.unit for _, b in self._segments]
        self._offsets = np.cumsum([0, *self._widths])[:-1].tolist()
        host = self.device.type == "cpu"
        self._host = [b.numpy() for _, b in self._segments] if host else None
        #: host pools: each segment's memory as one flat byte array and its row bytes, what a
        #: row-described store call (``stores/rows.py``) addresses objects in
        self.row_segments = [b.reshape(-1).numpy() for _, b in self._segments] if host else None
        self.row_bytes = [int(b.shape[1]) for _, b in self._segments]
        # stacked views: each part of every layer in one [L, capacity, row bytes] array, so a
        # host copy moves a whole object with one NumPy call per part
        self.non_blocking = False  # device copies: queued on the current (copy) stream
        self._stacked: list[np.ndarray] | None = None
        if host and view.stacked is not None and len({b for lb in view.part_row_bytes for b in lb}) == 1:
            self._stacked = [st.view(torch.uint8).reshape(st.shape[0], st.shape[1], -1).numpy()
                             for st in view.stacked]

    @property
    def run_bytes(self) -> int:
        """The mean contiguous run of one object in pool memory (payload over segments): what
        a scatter-gather store moves per buffer when it moves this object in place."""
        return self.payload_bytes // max(1, len(self._segments))

    def pieces(self, first: int) -> list[torch.Tensor]:
        """One object's payload as views of the pool memory, in payload order (one run of
        ``unit`` rows per layer part): what a scatter-gather store reads or writes in place.
        Ascending-run objects only (:meth:`in_runs`); device pools' pieces are device views."""
        u = self.unit
        return [b[first:first + u].reshape(-1) for _, b in self._segments]

    def regions(self) -> list[torch.Tensor]:
        """The pool memory this codec touches, as byte tensors (to register with a store)."""
        if self.view.stacked is not None:
            return [st.view(torch.uint8).reshape(-1) for st in self.view.stacked]
        return [b.reshape(-1) for _, b in self._segments]

    def use_device_path(self) -> None:
        """Move every object with indexing ops (``index_select`` / ``index_copy_``) and
        non-blocking copies, never by host memcpy: what a device pool needs (the actor runs
        them on its copy stream), and how fake device copies exercise that path on a host."""
        self._host = None
        self._stacked = None
        self.non_blocking = True

    @property
    def layer_ids(self) -> list[int]:
        """Model layer ids this codec's objects feed, in scatter order."""
        return self.view.layer_ids

    # ---- offload ------------------------------------------------------------------------
    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the objects named by ``index[n, unit]`` into ``out[n, payload_bytes]``."""
        if self._host is not None and _runs(index):
            dst = out.numpy()
            starts = index[:, 0].tolist()
            u = self.unit
            if self._stacked is not None:
                n_parts = len(self._stacked)
                for i, r0 in enumerate(starts):
                    d = dst[i].reshape(self._stacked[0].shape[0], n_parts, u, -1)
                    for j, st in enumerate(self._stacked):
                        d[:, j] = st[:, r0:r0 + u]
                return
            for i, r0 in enumerate(starts):
                for src, off, w in zip(self._host, self._offsets, self._widths):
                    dst[i, off:off + w] = src[r0:r0 + u].reshape(-1)
            return
        n = index.shape[0]
        rows = index.reshape(-1).to(self.device)
        for (_, b), off, w in zip(self._segments, self._offsets, self._widths):
            out[:, off:off + w].copy_(b.index_select(0, rows).reshape(n, w), non_blocking=self.non_blocking)

    # ---- load ---------------------------------------------------------------------------
    def in_runs(self, index: torch.Tensor) -> bool:
        """Whether each object's rows are one ascending run (what :meth:`pieces` needs)."""
        return _runs(index)

    def host_path(self, index: torch.Tensor) -> bool:
        """Whether these objects move by plain memcpy between host memory and frames."""
        return self._host is not None and _runs(index)

    def scatter_one(self, payload: np.ndarray, first: int) -> None:
        """Host path: write one object's verified payload into its rows starting at row
        ``first`` (a page's first row, or the state's slot)."""
        assert self._host is not None
        u = self.unit
        if self._stacked is not None:
            n_parts = len(self._stacked)
            src = payload.reshape(self._stacked[0].shape[0], n_parts, u, -1)
            for j, st in enumerate(self._stacked):
                st[:, first:first + u] = src[:, j]
            return
        for dst, off, w in zip(self._host, self._offsets, self._widths):
            dst[first:first + u] = payload[off:off + w].reshape(u, -1)

    def scatter(self, src: torch.Tensor, index: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> None:
        """Write payloads ``src[n, payload_bytes]`` into the objects named by ``index``.

        ``on_layer(layer_id)`` is called as soon as each model layer's data has landed.
        """
        n = index.shape[0]
        u = self.unit
        host = self._host is not None and _runs(index)
        rows = index.reshape(-1).to(self.device)
        starts = index[:, 0].tolist()
        s = src.numpy() if host else None
        last = len(self._segments) - 1
        for k, ((layer, b), off, w) in enumerate(zip(self._segments, self._offsets, self._widths)):
            if host:
                assert self._host is not None and s is not None
                dst = self._host[k]
                for j, r0 in enumerate(starts):
                    dst[r0:r0 + u] = s[j, off:off + w].reshape(u, -1)
            else:
                b.index_copy_(0, rows, src[:, off:off + w].reshape(n * u, -1).to(
                    self.device, non_blocking=self.non_blocking))
            if on_layer is not None and (k == last or self._segments[k + 1][0] != layer):
                on_layer(layer)


    def scatter_segments(self, segments: list[np.ndarray], index: torch.Tensor,
                         on_layer: Callable[[int], None] | None = None) -> None:
        """Host path: write objects held as rows of private ``segments`` (laid out like this
        codec's segments, object ``i`` at row ``i * unit``) into the rows ``index`` names: one
        NumPy copy per segment, none per object. ``on_layer(layer_id)`` as each layer landed."""
        assert self.row_segments is not None
        rows = index.reshape(-1).numpy()
        last = len(self._segments) - 1
        for k, (pool, held, rb) in enumerate(zip(self.row_segments, segments, self.row_bytes)):
            pool.reshape(-1, rb)[rows] = held.reshape(-1, rb)
            layer = self._segments[k][0]
            if on_layer is not None and (k == last or self._segments[k + 1][0] != layer):
                on_layer(layer)


def _runs(index: torch.Tensor) -> bool:
    """Whether each object's rows are one ascending run (true for pages from ``KVPool``)."""
    if index.shape[1] == 1:
        return True
    return bool((np.diff(index.numpy(), axis=1) == 1).all())


__all__ = ["PoolCodec"]
