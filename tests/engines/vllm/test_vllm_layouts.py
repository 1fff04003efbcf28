"""The connector's worker side addresses every KV cache layout vLLM's own allocation builds.

No engine: the per-layer specs of a model go through vLLM's grouping
(``get_kv_cache_groups``), its KV cache config (``get_kv_cache_config_from_groups``) and the
allocation both model runners call (``vllm.v1.worker.utils.allocate_kv_cache``, optionally with
kernel blocks), in vLLM's layer-outer (``LBHNC``, the CPU default) and block-outer (``BLHNC``)
layouts, with 1, 2 and >= 8 layers per group. For every group, copying the object of one block
(row ``b`` of every segment :class:`RawPages` found) into another block must make every layer
view of that group read the same bytes there, and leave every other byte of the buffer alone.
A copy of the first segment only (what the connector stored before segments) must not
(positive control). One case round-trips through :class:`PageTransfers` and its store.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from hylinker.components.pool_view import PoolViewError
from hylinker.integrations import store_host
from hylinker.integrations.config import PluginConfig
from hylinker.integrations.vllm.pages import PageTransfers, RawPages
from hylinker.integrations.vllm.plan import TransferPlan
from hylinker.tools.harness.shapes import QWEN3_NEXT_80B, gdn_state_shapes, poll_loads

BF16 = torch.bfloat16


def _attention(block: int, heads: int = 2, dim: int = 256) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=dim, dtype=BF16)


def qwen3_next_specs(per_group: int, tp: int = 1) -> dict[str, Any]:
    """Qwen3-Next-80B's per-layer specs at ``4 * per_group`` layers (full attention every 4th):
    its real heads, head dims and state shapes; the attention block raised (as vLLM does) so an
    attention page holds a state page."""
    g = QWEN3_NEXT_80B
    shapes = gdn_state_shapes(g, tp)
    state = MambaSpec(block_size=g.vllm_block_size(tp), shapes=shapes, dtypes=(BF16, torch.float32))
    attn = _attention(g.vllm_block_size(tp), g.num_kv_heads // tp, g.head_dim)
    return {(f"model.layers.{i}.self_attn.attn" if (i + 1) % 4 == 0 else f"model.layers.{i}.linear_attn"):
            (attn if (i + 1) % 4 == 0 else state) for i in range(4 * per_group)}


def llama_specs(layers: int, block: int) -> dict[str, Any]:
    return {f"model.layers.{i}.self_attn.attn": _attention(block, 2, 128) for i in range(layers)}


def mla_specs(layers: int, block: int) -> dict[str, Any]:  # Kimi/DeepSeek MLA: latent 512 + rope 64
    return {f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576,
                                                                dtype=BF16) for i in range(layers)}


def sliding_specs(per_group: int) -> dict[str, Any]:  # two attention groups of different block sizes
    out: dict[str, Any] = {}
    for i in range(2 * per_group):
        out[f"model.layers.{i}.self_attn.attn"] = (
            _attention(64, 2, 128) if i % 2 else SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=128,
                                                                   dtype=BF16, sliding_window=128))
    return out


def allocate(specs: dict[str, Any], layout: str, num_blocks: int, *, kernel: int | None = None
             ) -> tuple[Any, dict[str, torch.Tensor]]:
    vc = VllmConfig(cache_config=CacheConfig(block_size=16))
    vc.cache_config.kv_cache_layout = layout
    groups = get_kv_cache_groups(vc, dict(specs))
    vc.cache_config.num_gpu_blocks_override = num_blocks
    cfg = get_kv_cache_config_from_groups(vc, groups, 1 << 40)
    kernels = None if kernel is None else [min(kernel, g.kv_cache_spec.block_size) for g in cfg.kv_cache_groups]
    kv = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[layout], kernels)
    return cfg, kv


def _block_bytes(view: torch.Tensor, num_blocks: int, block: int) -> torch.Tensor:
    ratio = view.shape[0] // num_blocks
    return view[block * ratio:(block + 1) * ratio].contiguous().view(torch.uint8).flatten()


def check_every_group_moves_exactly(cfg: Any, kv: dict[str, torch.Tensor]) -> RawPages:
    nb = cfg.num_blocks
    pages = RawPages(kv, nb)
    buf = next(iter(kv.values())).untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8)
    flat.set_(buf, 0, (buf.nbytes(),), (1,))
    src, dst = 1, nb - 1
    for gi, group in enumerate(cfg.kv_cache_groups):
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
        expect = {n: _block_bytes(kv[n], nb, src).clone() for n in group.layer_names}
        assert all(not torch.equal(e, _block_bytes(kv[n], nb, dst)) for n, e in expect.items())
        obj = [r[src].clone() for r in pages.raws]
        rows = {(r.data_ptr() - flat.data_ptr()) + dst * r.stride(0): r.shape[1] for r in pages.raws}
        before = flat.clone()
        pages.raws[0][dst].copy_(obj[0])
        if len(pages.raws) > 1:  # positive control: one segment leaves a layer of this group unrestored
            assert any(not torch.equal(e, _block_bytes(kv[n], nb, dst)) for n, e in expect.items()), gi
        for r, o in zip(pages.raws, obj):
            r[dst].copy_(o)
        for n, e in expect.items():
            assert torch.equal(_block_bytes(kv[n], nb, dst), e), (gi, n)
        assert len(rows) == len(pages.raws)
        at = 0  # every byte outside block dst's rows is as it was
        for start, width in sorted(rows.items()):
            assert torch.equal(flat[at:start], before[at:start]), f"group {gi}: bytes before {start} changed"
            at = start + width
        assert torch.equal(flat[at:], before[at:]), f"group {gi}: bytes after block {dst}'s rows changed"
    return pages


CASES = {
    "llama": lambda k: llama_specs(k, 16),
    "llama-page64": lambda k: llama_specs(k, 64),
    "mla": lambda k: mla_specs(k, 64),
    "sliding+full": sliding_specs,
    "qwen3_next": qwen3_next_specs,
    "qwen3_next-tp2": lambda k: qwen3_next_specs(k, tp=2),  # one rank's shard: 1 KV head, 8 / 16 heads
}


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("per_group", [1, 2, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_raw_pages_address_vllms_allocation(case: str, per_group: int, layout: str) -> None:
    if case.startswith("qwen3_next") and per_group == 8:
        per_group = 12  # the real model: 48 layers, 12 per group
    specs = CASES[case](per_group)
    cfg, kv = allocate(specs, layout, 3)
    pages = check_every_group_moves_exactly(cfg, kv)
    group_bytes = [sum(_block_bytes(kv[n], cfg.num_blocks, 0).numel() for n in g.layer_names)
                   for g in cfg.kv_cache_groups]
    assert sum(pages.page_bytes) >= max(group_bytes)
    if layout == "LBHNC":  # one segment per layer position: the layers of a group at offsets
        assert len(pages.raws) == max(len(g.layer_names) for g in cfg.kv_cache_groups)


@pytest.mark.parametrize("per_group", [1, 2, 8])
def test_raw_pages_address_kernel_block_views(per_group: int) -> None:
    """Blocks of 64 tokens split into 32-token kernel blocks: the views hold 2 rows per block."""
    cfg, kv = allocate(llama_specs(per_group, 64), "LBHNC", 5, kernel=32)
    assert next(iter(kv.values())).shape[0] == 10
    check_every_group_moves_exactly(cfg, kv)


def test_a_layout_hylinker_cannot_address_names_the_layer() -> None:
    """``LHBNC`` splits a page by head across the layer's region: refused at registration,
    naming the layer and its strides."""
    cfg, kv = allocate(llama_specs(2, 16), "LHBNC", 4)
    with pytest.raises(PoolViewError, match=r"model\.layers\.\d+\.self_attn\.attn: a block's bytes are not one run.*strides"):
        RawPages(kv, cfg.num_blocks)
    cfg, kv = allocate(llama_specs(2, 16), "LBHNC", 4)
    with pytest.raises(PoolViewError, match="blocks on dim 0"):
        RawPages(kv, cfg.num_blocks + 1)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_page_transfers_round_trip_the_real_qwen3_next_layout(layout: str) -> None:
    """48 layers at Qwen3-Next-80B's shapes: a state block and an attention block saved through
    the data plane and loaded into other blocks read back exactly in every layer of their group."""
    cfg, kv = allocate(qwen3_next_specs(12), layout, 5)
    nb = cfg.num_blocks
    pages = RawPages(kv, nb)
    for r in pages.raws:
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8))
    attn = next(g for g in cfg.kv_cache_groups if "self_attn" in g.layer_names[0])
    state = cfg.kv_cache_groups[0]
    want = {n: _block_bytes(kv[n], nb, 1).clone() for n in attn.layer_names}
    want.update({n: _block_bytes(kv[n], nb, 2).clone() for n in state.layer_names})
    host = store_host.acquire(PluginConfig.from_extra_config({"capacity_mb": 512}, where="test"))
    pt = PageTransfers(host, pages, fingerprint=b"g" * 32, with_state=True, staging_bytes=4 * sum(pages.page_bytes))
    try:
        pt.save([TransferPlan("a", ("k1",), (1,), ("s2",), (2,))])
        assert pt.drain(60.0) and pt.statistics().saves_ok == 1
        pt.load(TransferPlan("b", ("k1",), (3,), ("s2",), (4,)))
        done, bad = poll_loads(pt, 60.0)
        assert done == {"b"} and not bad
        for n in attn.layer_names:
            assert torch.equal(_block_bytes(kv[n], nb, 3), want[n]), n
        for n in state.layer_names:
            assert torch.equal(_block_bytes(kv[n], nb, 4), want[n]), n
    finally:
        pt.close(10.0)
        store_host.release(host)
