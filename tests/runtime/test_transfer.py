"""Transfer codecs: gather/scatter round trips through both paths, every pool and dtype."""

from __future__ import annotations

import pytest
import torch

from hylinker.components.layout import MambaLayerSpec, ModelLayout, PoolKind
from hylinker.components.pools import HybridPools
from hylinker.runtime.dataplane.transfer_codec import PoolCodec


def _layout(kv_dtype: str) -> ModelLayout:
    return ModelLayout.create(
        page_size=4, chunk_size=4, full_layers=[1, 3], kv_row_shape=[2, 3], kv_dtype=kv_dtype,
        mamba_layers=[
            MambaLayerSpec(0, (3, 4), torch.bfloat16, (2, 2, 2), torch.float32),
            MambaLayerSpec(2, (3, 4), torch.float32),  # conv only
        ],
        draft_layers=1, draft_row_shape=[5], draft_dtype="bfloat16")


def _fill_random(pools: HybridPools, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    assert pools.mamba is not None
    tensors = [pools.kv.tensor, *pools.mamba.tensors()]
    if pools.draft is not None:
        tensors.append(pools.draft.tensor)
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
        if t.dtype.is_floating_point and t.element_size() > 1:
            t.nan_to_num_(0.0, 0.0, 0.0)  # keep comparisons meaningful


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn", "float32"])
@pytest.mark.parametrize("kind", [PoolKind.FULL, PoolKind.DRAFT, PoolKind.MAMBA])
@pytest.mark.parametrize("aligned", [True, False], ids=["host-memcpy", "vectorized"])
def test_round_trip_moves_exactly_the_named_objects(kv_dtype: str, kind: PoolKind, aligned: bool) -> None:
    layout = _layout(kv_dtype)
    src = HybridPools(layout, kv_pages=8, mamba_slots=6)
    dst = HybridPools(layout, kv_pages=8, mamba_slots=6)
    _fill_random(src, 1)
    _fill_random(dst, 2)
    before = [t.clone() for t in dst.pool_tensors(kind)]
    codec_src = PoolCodec(src.views()[kind])
    codec_dst = PoolCodec(dst.views()[kind])
    P = layout.page_size
    if kind is PoolKind.MAMBA:
        index = torch.tensor([[4], [1], [3]])
        target = torch.tensor([[0], [5], [2]])
    else:
        pages = torch.tensor([5, 0, 2])
        index = pages[:, None] * P + torch.arange(P)
        target = torch.tensor([1, 7, 3])[:, None] * P + torch.arange(P)
        if not aligned:  # rows that are not one ascending run take the vectorized path
            index = index.flip(1)
            target = target.flip(1)
    payload = torch.zeros(3, layout.payload_bytes(kind), dtype=torch.uint8)
    codec_src.gather(index, payload)
    landed: list[int] = []
    codec_dst.scatter(payload, target, landed.append)
    for t_src, t_dst, t_before in zip(src.pool_tensors(kind), dst.pool_tensors(kind), before):
        dim = 0 if kind is PoolKind.MAMBA else 1
        moved = target.reshape(-1) if kind is not PoolKind.MAMBA else target[:, 0]
        taken = index.reshape(-1) if kind is not PoolKind.MAMBA else index[:, 0]
        assert torch.equal(t_dst.index_select(dim, moved).view(torch.uint8),
                           t_src.index_select(dim, taken).view(torch.uint8))
        untouched = torch.ones(t_dst.shape[dim], dtype=torch.bool)
        untouched[moved] = False
        assert torch.equal(t_dst.index_select(dim, untouched.nonzero()[:, 0]).view(torch.uint8),
                           t_before.index_select(dim, untouched.nonzero()[:, 0]).view(torch.uint8))
    # every model layer the pool feeds is reported once, in order
    assert landed == codec_dst.layer_ids
    expected_layers = {PoolKind.FULL: [1, 3], PoolKind.DRAFT: [1], PoolKind.MAMBA: [0, 2]}[kind]
    assert landed == expected_layers


def test_payload_is_layer_major_per_page() -> None:
    layout = _layout("uint8")
    pools = HybridPools(layout, kv_pages=2, mamba_slots=1)
    kv = pools.kv.tensor
    kv[0].fill_(11)
    kv[1].fill_(22)
    codec = PoolCodec(pools.views()[PoolKind.FULL])
    out = torch.zeros(1, layout.payload_bytes(PoolKind.FULL), dtype=torch.uint8)
    codec.gather(torch.arange(4)[None], out)
    half = out.shape[1] // 2
    assert bool((out[0, :half] == 11).all()) and bool((out[0, half:] == 22).all())
