"""Views over SGLang's device pools, and the codec between them and staging frames.

The plugin borrows SGLang's tensors; it never allocates pool memory. A :class:`PoolView` is one
pool seen as *objects*: a KV or draft page (``rows_per_object = page_size`` token rows) or a
Mamba state (one slot). Each pool layer holds one or more row-indexed buffers:

* FULL, MLA: the latent buffer ``kv_buffer[i]`` (identical on every TP rank: rank-replicated);
* FULL, MHA: ``k_buffer[i]`` and ``v_buffer[i]`` (per rank);
* MAMBA: ``temporal[i]`` and each ``conv[j][i]`` of the Mamba cache (per rank);
* DRAFT: a sidecar MHA pool's ``k_buffer[d]``/``v_buffer[d]`` on the same KV rows.

An object's payload is layer-major: for each layer, for each of its buffers, the object's rows
(``[layer][buffer][row]``). One ``index_select`` per buffer gathers a whole batch; a load lands
one layer at a time (``index_copy_`` per buffer) so the forward can start on layer 0 while later
layers are still being written. Every pool layer names the index the engine's
``LayerWiseLoadCounter`` uses for it (global layer id minus the stage's first layer).

This module imports no SGLang: the builders read the attributes they need from SGLang's pool
objects (checked against ``sglang==0.5.23``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch


class PoolLayoutError(ValueError):
    """SGLang's pools have a shape the plugin does not support (the message says which)."""


@attrs.frozen
class PoolLayer:
    counter_layer: int  # index into the engine's layer counter
    buffers: tuple[torch.Tensor, ...]  # row-indexed: buffer[row, ...]


class PoolView:
    """One pool as a list of layers of row-indexed buffers; see the module docstring."""

    def __init__(self, name: str, layers: Sequence[PoolLayer], *, rows_per_object: int,
                 replicated: bool) -> None:
        if not layers:
            raise PoolLayoutError(f"pool {name!r} has no layers")
        self.name = name
        self.layers = list(layers)
        self.rows_per_object = rows_per_object
        self.replicated = replicated
        self.device = layers[0].buffers[0].device
        # byte views [rows, row_bytes]; .view never copies, so writes land in SGLang's memory
        self._bytes: list[list[torch.Tensor]] = []
        self._spans: list[list[tuple[int, int]]] = []  # per layer, per buffer: (offset, width)
        offset = 0
        for layer in self.layers:
            views, spans = [], []
            for t in layer.buffers:
                if t.device != self.device:
                    raise PoolLayoutError(f"pool {name!r}: buffers on {t.device} and {self.device}")
                try:
                    b = t.view(torch.uint8).view(t.shape[0], -1)
                except RuntimeError as exc:
                    raise PoolLayoutError(f"pool {name!r}: a buffer is not row-contiguous ({exc})") from None
                views.append(b)
                width = rows_per_object * b.shape[1]
                spans.append((offset, width))
                offset += width
            self._bytes.append(views)
            self._spans.append(spans)
        self.payload_bytes = offset
        self.rows = min(b.shape[0] for views in self._bytes for b in views)
        # host pools move by plain memcpy through NumPy views (no index_select temporaries)
        self._host = ([[b.numpy() for b in views] for views in self._bytes]
                      if self.device.type == "cpu" else None)

    @property
    def counter_layers(self) -> list[int]:
        return [layer.counter_layer for layer in self.layers]

    def describe(self) -> dict[str, Any]:
        """What decides the bytes of an object (for the layout fingerprint)."""
        return {
            "name": self.name,
            "rows_per_object": self.rows_per_object,
            "replicated": self.replicated,
            "layers": [[layer.counter_layer, [[list(t.shape[1:]), str(t.dtype)] for t in layer.buffers]]
                       for layer in self.layers],
        }

    def object_rows(self, indices: torch.Tensor, n_objects: int) -> torch.Tensor:
        """``indices`` (SGLang's device indices of one transfer) as ``[n_objects, rows]`` int64."""
        flat = indices.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
        if flat.numel() != n_objects * self.rows_per_object:
            raise PoolLayoutError(
                f"pool {self.name!r}: {flat.numel()} indices for {n_objects} objects of "
                f"{self.rows_per_object} rows")
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.rows):
            raise PoolLayoutError(f"pool {self.name!r}: index out of range [0, {self.rows})")
        return flat.view(n_objects, self.rows_per_object)

    # ---- offload ------------------------------------------------------------------------
    def gather(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the objects ``rows[n, per]`` into ``out[n, payload_bytes]`` (host uint8)."""
        n = rows.shape[0]
        if self._host is not None and _runs(rows):
            dst = out.numpy()
            per = self.rows_per_object
            for i, r0 in enumerate(rows[:, 0].tolist()):  # one memcpy per object and buffer
                for host_views, spans in zip(self._host, self._spans):
                    for hb, (off, width) in zip(host_views, spans):
                        dst[i, off:off + width] = hb[r0:r0 + per].reshape(-1)
            return
        flat = rows.reshape(-1).to(self.device)
        target = out if self.device.type == "cpu" else torch.empty(
            (n, self.payload_bytes), dtype=torch.uint8, device=self.device)
        for views, spans in zip(self._bytes, self._spans):
            for b, (off, width) in zip(views, spans):
                target[:, off:off + width].copy_(b.index_select(0, flat).view(n, width))
        if target is not out:
            out.copy_(target)

    # ---- load ---------------------------------------------------------------------------
    def scatter_layer(self, layer: int, src: torch.Tensor, rows: torch.Tensor) -> None:
        """Write layer ``layer`` of the payloads ``src[n, payload_bytes]`` into ``rows``."""
        n = rows.shape[0]
        per = self.rows_per_object
        if self._host is not None and src.device.type == "cpu" and _runs(rows):
            s = src.numpy()
            for i, r0 in enumerate(rows[:, 0].tolist()):  # one memcpy per object and buffer
                for hb, (off, width) in zip(self._host[layer], self._spans[layer]):
                    hb[r0:r0 + per] = s[i, off:off + width].reshape(per, -1)
            return
        flat = rows.reshape(-1).to(self.device)
        for b, (off, width) in zip(self._bytes[layer], self._spans[layer]):
            part = src[:, off:off + width].reshape(n * per, b.shape[1])
            if part.device != self.device:
                part = part.to(self.device, non_blocking=True)
            b.index_copy_(0, flat, part)


def _runs(rows: torch.Tensor) -> bool:
    """Whether each object's rows are one ascending run (whole pages from SGLang's allocator)."""
    if rows.shape[1] == 1:
        return True
    return bool((rows[:, 1:] - rows[:, :-1] == 1).all())


def layout_fingerprint(views: Iterable[PoolView], *, page_size: int, model: str) -> bytes:
    """16 bytes naming everything that decides stored bytes (not the rank, not the salt)."""
    doc = {"page_size": page_size, "model": model, "pools": [v.describe() for v in views]}
    return hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(), digest_size=16).digest()


# ---- builders over SGLang's pool objects ---------------------------------------------------
def full_view(kvcache: Any) -> PoolView:
    """FULL from a ``HybridLinearKVPool``: plain MLA (``kv_buffer``) or MHA (``k_buffer``/``v_buffer``)."""
    pool = getattr(kvcache, "full_kv_pool", None)
    mapping = getattr(kvcache, "full_attention_layer_id_mapping", None)
    if pool is None or mapping is None:
        raise PoolLayoutError("expected a hybrid KV pool with full_kv_pool and full_attention_layer_id_mapping")
    start = int(getattr(kvcache, "start_layer", 0) or 0)
    if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "native_k_scale_buffer", None) is not None:
        raise PoolLayoutError("scaled KV caches are not supported yet")
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        layers = [PoolLayer(g - start, (pool.k_buffer[i], pool.v_buffer[i])) for g, i in sorted(mapping.items())]
        replicated = False
    elif hasattr(pool, "kv_buffer"):
        if getattr(pool, "use_dsa", False):
            raise PoolLayoutError("DSA (sparse MLA) pools are not supported yet")
        layers = [PoolLayer(g - start, (pool.kv_buffer[i],)) for g, i in sorted(mapping.items())]
        replicated = True  # the MLA latent is the same on every TP rank
    else:
        raise PoolLayoutError(f"unsupported full-attention pool {type(pool).__name__}")
    return PoolView("kv", layers, rows_per_object=int(kvcache.page_size), replicated=replicated)


def mamba_view(req_to_token_pool: Any, start_layer: int = 0) -> PoolView:
    """MAMBA from a ``HybridReqToTokenPool``: ``temporal[i]`` and each ``conv[j][i]`` per slot."""
    if getattr(req_to_token_pool, "mamba_ckpt_pool", None) is not None:
        raise PoolLayoutError("int8 Mamba checkpoints are not supported yet")
    for side in ("short_conv_pool", "ngram_pool"):
        if getattr(getattr(req_to_token_pool, side, None), "enabled", False):
            raise PoolLayoutError(f"Mamba side states ({side}) are not supported yet")
    cache = req_to_token_pool.mamba_pool.mamba_cache
    mapping = req_to_token_pool.mamba_map
    states = [s for s in (cache.temporal, *cache.conv) if s.numel() > 0]
    layers = [PoolLayer(g - start_layer, tuple(s[i] for s in states)) for g, i in sorted(mapping.items())]
    return PoolView("mamba", layers, rows_per_object=1, replicated=False)


def draft_view(draft_pools: Sequence[Any], page_size: int) -> PoolView | None:
    """DRAFT from SGLang's sidecar draft pools (MHA), riding the KV rows; None without one."""
    layers: list[PoolLayer] = []
    for pool in draft_pools:
        if int(getattr(pool, "page_size", page_size)) != page_size:
            raise PoolLayoutError("draft KV page size must match the tree page size")
        if not (hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer")):
            raise PoolLayoutError(f"unsupported draft pool {type(pool).__name__}")
        for i in range(len(pool.k_buffer)):
            layers.append(PoolLayer(len(layers), (pool.k_buffer[i], pool.v_buffer[i])))
    if not layers:
        return None
    return PoolView("draft", layers, rows_per_object=page_size, replicated=False)


__all__ = ["PoolLayer", "PoolLayoutError", "PoolView", "draft_view", "full_view", "layout_fingerprint",
           "mamba_view"]
