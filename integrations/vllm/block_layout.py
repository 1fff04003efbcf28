"""Where vLLM keeps block ``b``: the byte segments behind the per-layer KV cache views.

vLLM (0.32) allocates one int8 buffer for the whole KV cache and describes each group's layers
by a ``KVCacheTensor``: layer ``l``'s page of block ``b`` starts at ``offset + l * layer_stride
+ b * block_stride`` bytes into the buffer, and the cache groups overlay each other from byte 0
(a block id belongs to one group at a time). The per-layer tensors handed to
``register_kv_caches`` are strided views of that buffer (``[blocks, H, N, C]``, or ``[blocks *
r, ...]`` when a block is split into ``r`` kernel blocks). Two families of layouts come out:

* layer-outer (``LBHNC``, the CPU runner's default): every layer owns a region ``[blocks,
  page]``, so with several layers per group a block is one page in each of several regions at
  offsets; the layers at the same position of each group alias the same region;
* block-outer (``BLHNC``): block ``b`` is one run of every layer's page of its group side by
  side (padded to the widest group).

:class:`RawPages` finds, from the views alone (their storage offset, strides and shape), the
*segments*: disjoint ``[num_blocks, block_stride]`` byte runs of the buffer, block ``b`` being
row ``b`` of each, such that every layer's page of block ``b`` lies inside row ``b`` of one
segment. One stored object of block ``b`` is row ``b`` of every segment, whichever group owns
the block. A layout it cannot address (a block's bytes not one run per layer, regions that
partly overlap, a view running past its storage) is refused at registration with a
:class:`~hylinker.components.pool_view.PoolViewError` naming the layer and what it found.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ...components.pool_view import PoolViewError


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    raise PoolViewError(f"a KV cache entry must be a tensor or a list of tensors, got {type(value).__name__}")


@attrs.frozen
class LayerPage:
    """Where one layer view keeps its page of every block, in bytes of its storage."""

    name: str
    offset: int  # block 0's page
    block_stride: int
    page: int  # one run of this many bytes per block


@attrs.frozen
class Segment:
    """Rows ``[num_blocks, block_stride]`` starting at ``offset`` of one storage."""

    storage: int  # the storage's data pointer
    offset: int
    block_stride: int
    layers: tuple[str, ...]


def layer_page(name: str, t: torch.Tensor, num_blocks: int) -> LayerPage:
    """Read one view's page placement, refusing what is not a run of bytes per block."""
    if t.dim() < 1 or t.shape[0] == 0 or t.shape[0] % num_blocks:
        raise PoolViewError(f"{name}: {t.shape[0] if t.dim() else 0} blocks on dim 0, the cache has "
                            f"{num_blocks} (or a whole multiple of kernel blocks)")
    strides = t.stride()
    es = t.element_size()
    found = f"(shape {tuple(t.shape)}, strides {tuple(strides)} x {es} B, storage offset {t.storage_offset() * es} B)"
    if min(strides) < 0 or any(s == 0 and n > 1 for n, s in zip(t.shape, strides)):
        raise PoolViewError(f"{name}: negative or zero strides cannot hold distinct pages {found}")
    ratio = t.shape[0] // num_blocks  # kernel blocks per block
    block = t[:ratio]
    span = (1 + sum((n - 1) * s for n, s in zip(block.shape, block.stride()))) * es
    dense = block.numel() * es
    if span != dense:
        raise PoolViewError(f"{name}: a block's bytes are not one run ({span} B spanned for {dense} B of "
                            f"data) {found}; hylinker addresses block-compact layouts (e.g. LBHNC, BLHNC)")
    block_stride = strides[0] * ratio * es
    if block_stride < dense:
        raise PoolViewError(f"{name}: block stride {block_stride} B is below its page of {dense} B {found}")
    storage = t.untyped_storage()
    offset = t.data_ptr() - storage.data_ptr()
    end = offset + (num_blocks - 1) * block_stride + dense
    if offset < 0 or end > storage.nbytes():
        raise PoolViewError(f"{name}: its last block ends at byte {end} of a storage of {storage.nbytes()} B {found}")
    return LayerPage(name, offset, block_stride, dense)


def find_segments(kv_caches: Mapping[str, Any], num_blocks: int
                  ) -> tuple[list[Segment], dict[int, torch.UntypedStorage]]:
    """The segments behind ``kv_caches`` (see the module docstring), ordered by storage and
    offset, and the storages by data pointer."""
    if num_blocks <= 0:
        raise PoolViewError(f"num_blocks must be positive, got {num_blocks}")
    storages: dict[int, torch.UntypedStorage] = {}
    pages: dict[int, dict[tuple[int, int, int], list[str]]] = {}
    for name, value in kv_caches.items():
        for t in _tensors(value):
            lp = layer_page(name, t, num_blocks)
            storage = t.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
            # layers at the same place (one position of every group) alias: one page
            pages.setdefault(storage.data_ptr(), {}).setdefault((lp.offset, lp.block_stride, lp.page), []).append(name)
    if not storages:
        raise PoolViewError("no KV cache tensors registered")
    segments: list[Segment] = []
    for key in sorted(pages):
        nbytes = storages[key].nbytes()
        current: list[tuple[int, int, int, list[str]]] = []
        for (offset, stride, page), names in sorted(pages[key].items()):
            if current and current[0][1] == stride and offset + page <= current[0][0] + stride:
                current.append((offset, stride, page, names))  # inside the same block rows
                continue
            if current:
                segments.append(_segment(key, current, num_blocks, nbytes))
            current = [(offset, stride, page, names)]
        segments.append(_segment(key, current, num_blocks, nbytes))
    for a, b in itertools.pairwise(segments):
        if a.storage == b.storage and a.offset + num_blocks * a.block_stride > b.offset:
            raise PoolViewError(
                f"{b.layers[0]}: its pages (offset {b.offset} B, block stride {b.block_stride} B) overlap the "
                f"blocks of {a.layers[0]} (offset {a.offset} B, block stride {a.block_stride} B, {num_blocks} "
                f"blocks): block ids would not name one place")
    return segments, storages


def _segment(key: int, pages: list[tuple[int, int, int, list[str]]], num_blocks: int, nbytes: int) -> Segment:
    offset, stride = pages[0][0], pages[0][1]
    names = tuple(n for p in pages for n in p[3])
    if offset + num_blocks * stride > nbytes:
        raise PoolViewError(f"{names[0]}: {num_blocks} blocks of {stride} B from offset {offset} B run past "
                            f"its storage of {nbytes} B")
    return Segment(key, offset, stride, names)


class RawPages:
    """Per segment a ``[num_blocks, block_stride]`` uint8 view (see the module docstring)."""

    def __init__(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        self.segments, storages = find_segments(kv_caches, num_blocks)
        self.num_blocks = num_blocks
        self.raws: list[torch.Tensor] = []
        for seg in self.segments:
            storage = storages[seg.storage]
            flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
            flat.set_(storage, seg.offset, (num_blocks * seg.block_stride,), (1,))
            self.raws.append(flat.view(num_blocks, seg.block_stride))
        self.page_bytes = tuple(r.shape[1] for r in self.raws)

    def geometry(self) -> str:
        return f"pages={list(self.page_bytes)}"


__all__ = ["LayerPage", "RawPages", "Segment", "find_segments", "layer_page"]
