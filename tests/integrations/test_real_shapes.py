"""Pool views, vLLM raw pages and load plans at the layer counts and page sizes real engines use.

Layers per group 1, 2 and >= 8 (Qwen3-Next-80B: 12 per vLLM KV cache group) and pages of 1, 16,
64 tokens (SGLang) and vLLM's hybrid block sizes (384, and 1,056 for Qwen3-Next-80B's geometry).
The vLLM layouts here follow the placement vLLM 0.32 documents on ``KVCacheTensor`` (layer ``l``'s
page of block ``b`` at ``offset + l * layer_stride + b * block_stride``); ``tests/engines/vllm`` derives
them from vLLM's own allocation code as well.
"""

from __future__ import annotations

import pytest
import torch

from hylinker.components.pool_view import PoolViewError, kv_view
from hylinker.integrations import store_host
from hylinker.integrations.config import PluginConfig
from hylinker.integrations.vllm.block_layout import find_segments
from hylinker.integrations.vllm.pages import PageTransfers, RawPages, step_staging_bytes
from hylinker.integrations.vllm.plan import (
    BlockKeys,
    Groups,
    LoadSpec,
    TransferPlan,
    attention_key,
    geometry_seed,
    load_plan,
    restorable_blocks,
    state_key,
)
from hylinker.runtime.dataplane.transfer_codec import PoolCodec
from hylinker.tools.harness.shapes import QWEN3_NEXT_80B, poll_loads

PER_GROUP = [1, 2, 12]
PAGES = [1, 16, 64, 384, QWEN3_NEXT_80B.vllm_block_size()]
TOKEN_BYTES = 2 * 2 * 8 * 2  # K and V, 2 heads x 8 dims, bf16


def layer_outer(per_group: int, block: int, num_blocks: int, *, block_outer: bool = False, device: str = "cpu"
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, list[str]]]:
    """A hybrid cache like vLLM's: an attention group and a state group of ``per_group`` layers
    each, overlaid on one int8 buffer (the state page padded to the attention page) on ``device``."""
    page = block * TOKEN_BYTES
    layers = per_group
    buf = torch.zeros(num_blocks * page * layers, dtype=torch.int8, device=device)
    block_stride, layer_stride = (page * layers, page) if block_outer else (page, page * num_blocks)
    kv: dict[str, torch.Tensor] = {}
    groups: dict[str, list[str]] = {"attn": [], "state": []}
    for l_ in range(layers):
        a = f"model.layers.{4 * l_ + 3}.self_attn.attn"
        s = f"model.layers.{4 * l_}.linear_attn"
        kv[a] = torch.as_strided(buf.view(torch.bfloat16), (num_blocks, 2, block, 16),
                                 (block_stride // 2, page // 4, 16, 1), l_ * layer_stride // 2)
        kv[s] = torch.as_strided(buf, (num_blocks, 1, 1, page), (block_stride, page, page, 1), l_ * layer_stride)
        groups["attn"].append(a)
        groups["state"].append(s)
    return buf, kv, groups


def _block(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[b].contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("block", PAGES)
@pytest.mark.parametrize("per_group", PER_GROUP)
@pytest.mark.parametrize("block_outer", [False, True], ids=["layer-outer", "block-outer"])
def test_raw_pages_segments_cover_every_layer(per_group: int, block: int, block_outer: bool) -> None:
    nb = 3
    buf, kv, groups = layer_outer(per_group, block, nb, block_outer=block_outer)
    segments, _ = find_segments(kv, nb)
    assert len(segments) == (1 if block_outer else per_group)
    pages = RawPages(kv, nb)
    assert sum(pages.page_bytes) == per_group * block * TOKEN_BYTES  # every layer's page, once
    for names in groups.values():
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
        want = {n: _block(kv[n], 0).clone() for n in names}
        for r in pages.raws:
            r[2].copy_(r[0])
        assert all(torch.equal(_block(kv[n], 2), w) for n, w in want.items())


def test_overlapping_or_truncated_layouts_are_refused_naming_the_layer() -> None:
    buf = torch.zeros(10 * 64, dtype=torch.int8)
    a = buf[:8 * 64].view(8, 64)
    b = buf[32:32 + 8 * 64].view(8, 64)  # starts inside a's blocks, other rows: no single place
    with pytest.raises(PoolViewError, match=r"^b: .*overlap the blocks of a"):
        RawPages({"a": a, "b": b}, 8)
    with pytest.raises(PoolViewError, match=r"^a: .*blocks on dim 0"):
        RawPages({"a": a}, 3)
    with pytest.raises(PoolViewError, match="no KV cache tensors"):
        RawPages({}, 3)


def test_staging_holds_one_step_of_one_request_at_the_real_geometry() -> None:
    """12 layers per group at Qwen3-Next-80B's block: a 64 MiB floor would skip every save."""
    block = QWEN3_NEXT_80B.vllm_block_size()
    buf = torch.zeros(2 * 12 * block * QWEN3_NEXT_80B.kv_bytes_per_token(), dtype=torch.int8)
    page = block * QWEN3_NEXT_80B.kv_bytes_per_token()
    kv = {f"l{i}": buf[i * 2 * page:(i + 1) * 2 * page].view(2, 1, 1, page) for i in range(12)}
    pages = RawPages(kv, 2)
    assert sum(pages.page_bytes) == 12 * page > 24 << 20  # 26 MB an object
    staging = step_staging_bytes(pages, floor_bytes=64 << 20, tokens_per_step=4096, block_size=block, state_groups=3)
    assert staging == (4 + 1 + 3) * 12 * page
    assert step_staging_bytes(pages, floor_bytes=1 << 40, tokens_per_step=4096, block_size=block,
                              state_groups=3) == 1 << 40


@pytest.mark.parametrize("per_group", PER_GROUP)
def test_page_transfers_round_trip_many_layers_per_group(per_group: int) -> None:
    nb, block = 6, 64
    buf, kv, groups = layer_outer(per_group, block, nb)
    buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    pages = RawPages(kv, nb)
    want = {n: _block(kv[n], 1).clone() for n in groups["attn"]}
    want.update({n: _block(kv[n], 2).clone() for n in groups["state"]})
    host = store_host.acquire(PluginConfig.from_extra_config({"capacity_mb": 64}, where="test"))
    pt = PageTransfers(host, pages, fingerprint=b"r" * 32, with_state=True, staging_bytes=4 * sum(pages.page_bytes))
    try:
        pt.save([TransferPlan("a", ("k1",), (1,), ("s2",), (2,))])
        assert pt.drain(30.0) and pt.statistics().saves_ok == 1
        pt.load(TransferPlan("b", ("k1",), (4,), ("s2",), (5,)))
        done, bad = poll_loads(pt, 60.0)
        assert done == {"b"} and not bad
        for n in groups["attn"]:
            assert torch.equal(_block(kv[n], 4), want[n]), n
        for n in groups["state"]:
            assert torch.equal(_block(kv[n], 5), want[n]), n
        assert not torch.equal(_block(kv[groups["attn"][-1]], 3), want[groups["attn"][-1]])  # control
    finally:
        pt.close(5.0)
        store_host.release(host)


@pytest.mark.parametrize("page", [1, 16, 64, 384])
@pytest.mark.parametrize("layers", [1, 2, 12])
def test_pool_view_round_trip_at_real_layer_counts_and_pages(layers: int, page: int) -> None:
    rows = 3 * page
    g = torch.Generator().manual_seed(layers * 1000 + page)
    k1 = [torch.randint(-99, 99, (rows, 2, 256), generator=g).to(torch.bfloat16) for _ in range(layers)]
    v1 = [torch.randint(-99, 99, (rows, 2, 256), generator=g).to(torch.bfloat16) for _ in range(layers)]
    k2 = [torch.zeros_like(t) for t in k1]
    v2 = [torch.zeros_like(t) for t in v1]
    ids = list(range(3, 4 * layers, 4))
    src = kv_view(k1, v1, layer_ids=ids, page_size=page)
    dst = kv_view(k2, v2, layer_ids=ids, page_size=page)
    assert src.payload_bytes == layers * 2 * page * 2 * 256 * 2
    index = torch.tensor([[2 * page + i for i in range(page)]])
    target = torch.tensor([[i for i in range(page)]])
    out = torch.zeros(1, src.payload_bytes, dtype=torch.uint8)
    PoolCodec(src).gather(index, out)
    landed: list[int] = []
    PoolCodec(dst).scatter(out, target, landed.append)
    assert landed == ids
    for a, b in zip((*k1, *v1), (*k2, *v2)):
        assert torch.equal(b[:page], a[2 * page:]) and not bool(b[page:].any())


@pytest.mark.parametrize("block", PAGES)
def test_load_plans_at_engine_block_sizes(block: int) -> None:
    seed = geometry_seed("m", "g", "")
    tokens = list(range(4 * block - 1))  # 3 whole blocks and a partial one
    keys = tuple(BlockKeys(seed, block).extend(tokens))
    assert len(keys) == 3
    groups = Groups(attention=(3,), state=(0, 1, 2))
    present = [True] * 4 * 3  # every attention block and state stored: restore 3 blocks
    assert restorable_blocks(groups, 0, 3, present) == 3
    spec = LoadSpec("r", 0, 3, keys)
    block_ids = [[0, 0, 11], [0, 0, 12], [0, 0, 13], [5, 6, 7]]
    plan = load_plan(spec, groups, block_ids)
    assert plan.kv_keys == tuple(attention_key(k, 3) for k in keys) and plan.kv_blocks == (5, 6, 7)
    assert plan.state_keys == tuple(state_key(keys[2], g) for g in (0, 1, 2))
    assert plan.state_blocks == (11, 12, 13)
