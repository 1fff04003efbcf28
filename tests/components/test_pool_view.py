"""Pool views over borrowed tensors: construction checks, index checks, codec round trips."""

from __future__ import annotations

import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import (
    PoolSet,
    PoolView,
    PoolViewError,
    kv_view,
    stacked_kv_view,
    state_view,
)
from hylinker.components.pools import HybridPools
from hylinker.runtime.dataplane.transfer_codec import PoolCodec
from hylinker.testing.fakes import small_hybrid_layout

P = 4


def _random_(*tensors: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def mha(rows: int = 32, layers: int = 3, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    k = [torch.empty(rows, 2, 8, dtype=torch.bfloat16) for _ in range(layers)]
    v = [torch.empty(rows, 2, 8, dtype=torch.bfloat16) for _ in range(layers)]
    _random_(*k, *v, seed=seed)
    return k, v


def sglang_state(slots: int = 6, layers: int = 2, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    conv = [torch.empty(layers, slots, 3, 5, dtype=torch.bfloat16), torch.empty(layers, slots, 7, dtype=torch.float16)]
    temporal = torch.empty(layers, slots, 2, 4, 4, dtype=torch.float32)
    _random_(*conv, temporal, seed=seed)
    return conv, temporal


def test_views_borrow_the_engine_tensors() -> None:
    k, v = mha()
    view = kv_view(k, v, layer_ids=[0, 2, 5], page_size=P)
    assert view.layer_ids == [0, 2, 5]
    assert all(lp.parts[0] is k[i] and lp.parts[1] is v[i] for i, lp in enumerate(view.layers))
    assert view.payload_bytes == 3 * 2 * P * 2 * 8 * 2
    conv, temporal = sglang_state()
    sv = state_view(conv, temporal, layer_ids=[1, 3])
    # per layer conv_0[i], conv_1[i], temporal[i]: views of the same storage, no copies
    assert [t.data_ptr() for t in sv.layers[1].parts] == [conv[0][1].data_ptr(), conv[1][1].data_ptr(),
                                                          temporal[1].data_ptr()]
    assert sv.payload_bytes == 2 * (3 * 5 * 2 + 7 * 2 + 2 * 4 * 4 * 4)


def test_hybrid_pools_views_keep_the_stored_format() -> None:
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=4, mamba_slots=2)
    views = pools.views()
    assert set(views) == set(layout.pools)
    for kind, view in views.items():
        assert view.payload_bytes == layout.payload_bytes(kind)
    stacked = views[PoolKind.FULL].stacked
    assert stacked is not None and stacked[0] is pools.kv.tensor


@pytest.mark.parametrize("case", [
    "not_a_tensor", "non_contiguous", "rows_differ", "repeated_layer", "ids_count", "zero_d", "device",
    "v_count", "empty", "draft_rows", "unit_zero",
])
def test_bad_borrowed_tensors_are_refused_at_construction(case: str) -> None:
    k, v = mha()
    with pytest.raises(PoolViewError) as err:
        if case == "not_a_tensor":
            kv_view([k[0], "x", k[2]], layer_ids=[0, 1, 2], page_size=P)  # type: ignore[list-item]
        elif case == "non_contiguous":
            kv_view([k[0], k[1].transpose(1, 2), k[2]], layer_ids=[0, 1, 2], page_size=P)
        elif case == "rows_differ":
            kv_view(k, [v[0], v[1][:16], v[2]], layer_ids=[0, 1, 2], page_size=P)
        elif case == "repeated_layer":
            kv_view(k, v, layer_ids=[0, 1, 1], page_size=P)
        elif case == "ids_count":
            kv_view(k, v, layer_ids=[0, 1], page_size=P)
        elif case == "zero_d":
            kv_view([torch.tensor(1.0)], layer_ids=[0], page_size=P)
        elif case == "device":  # a tensor on another device ("meta" stands in for a GPU)
            kv_view(k, [v[0], v[1], torch.empty(32, 2, 8, dtype=torch.bfloat16, device="meta")],
                    layer_ids=[0, 1, 2], page_size=P)
        elif case == "v_count":
            kv_view(k, v[:2], layer_ids=[0, 1, 2], page_size=P)
        elif case == "empty":
            PoolView(PoolKind.FULL, P, [])
        elif case == "draft_rows":
            PoolSet([kv_view(k, v, layer_ids=[0, 1, 2], page_size=P),
                     kv_view([torch.zeros(16, 4)], layer_ids=[0], page_size=P, kind=PoolKind.DRAFT)])
        elif case == "unit_zero":
            kv_view(k, v, layer_ids=[0, 1, 2], page_size=0)
    assert str(err.value)  # the message names what is wrong


def test_stacked_state_tensors_must_be_layer_major() -> None:
    conv, temporal = sglang_state(layers=2)
    with pytest.raises(PoolViewError, match="layers"):
        state_view(conv, temporal, layer_ids=[1, 3, 5])
    with pytest.raises(PoolViewError, match="temporal"):
        state_view(conv, temporal[:1], layer_ids=[1, 3])


@pytest.mark.parametrize(("index", "match"), [
    (torch.tensor([[0, 1, 2, 3], [4, 5, 6, 40]]), "out of range"),
    (torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6]]), "repeated"),
    (torch.tensor([-4, -3, -2, -1]), "out of range"),
    (torch.tensor([0.0, 1.0, 2.0, 3.0]), "integers"),
    (torch.arange(6), "whole number"),
    (torch.zeros(2, 3, dtype=torch.int64), r"\[n, 4\]"),
    ([[0, 1, 2, "x"]], "integers"),
])
def test_bad_indices_are_refused(index: object, match: str) -> None:
    k, v = mha()
    view = kv_view(k, v, layer_ids=[0, 1, 2], page_size=P)
    with pytest.raises(PoolViewError, match=match):
        view.objects(index)  # type: ignore[arg-type]


def test_flat_page_rows_become_objects() -> None:
    k, v = mha()
    view = kv_view(k, v, layer_ids=[0, 1, 2], page_size=P)
    out = view.objects(torch.arange(8, 16, dtype=torch.int32))
    assert out.dtype == torch.int64 and out.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]


def _round_trip(src: PoolView, dst: PoolView, index: torch.Tensor, target: torch.Tensor) -> list[int]:
    out = torch.zeros(index.shape[0], src.payload_bytes, dtype=torch.uint8)
    PoolCodec(src).gather(index, out)
    landed: list[int] = []
    PoolCodec(dst).scatter(out, target, landed.append)
    return landed


@pytest.mark.parametrize("aligned", [True, False], ids=["host-memcpy", "vectorized"])
def test_mha_round_trip_moves_exactly_the_named_rows(aligned: bool) -> None:
    k1, v1 = mha(seed=1)
    k2, v2 = mha(seed=2)
    before = [t.clone() for t in (*k2, *v2)]
    src = kv_view(k1, v1, layer_ids=[0, 2, 5], page_size=P)
    dst = kv_view(k2, v2, layer_ids=[0, 2, 5], page_size=P)
    index = torch.tensor([5, 0, 2])[:, None] * P + torch.arange(P)
    target = torch.tensor([1, 7, 3])[:, None] * P + torch.arange(P)
    if not aligned:
        index, target = index.flip(1), target.flip(1)
    assert _round_trip(src, dst, index, target) == [0, 2, 5]
    moved = target.reshape(-1)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[moved] = False
    for a, b, old in zip((*k1, *v1), (*k2, *v2), before):
        assert torch.equal(b[moved].view(torch.uint8), a[index.reshape(-1)].view(torch.uint8))
        assert torch.equal(b[untouched].view(torch.uint8), old[untouched].view(torch.uint8))


def test_stacked_state_round_trip_and_layout() -> None:
    conv1, t1 = sglang_state(seed=1)
    conv2, t2 = sglang_state(seed=2)
    src = state_view(conv1, t1, layer_ids=[1, 3])
    dst = state_view(conv2, t2, layer_ids=[1, 3])
    assert _round_trip(src, dst, torch.tensor([[4]]), torch.tensor([[0]])) == [1, 3]
    for a, b in zip((*conv1, t1), (*conv2, t2)):
        assert torch.equal(b[:, 0].view(torch.uint8), a[:, 4].view(torch.uint8))
    # payload: layer 1's conv_0, conv_1, temporal, then layer 3's
    out = torch.zeros(1, src.payload_bytes, dtype=torch.uint8)
    PoolCodec(src).gather(torch.tensor([[2]]), out)
    first = conv1[0][0, 2].reshape(-1).view(torch.uint8)
    assert torch.equal(out[0, : first.numel()], first)


def test_layer_groups_split_consecutive_layers() -> None:
    k, v = mha(layers=5)
    view = kv_view(k, v, layer_ids=[0, 1, 2, 3, 4], page_size=P)
    groups = view.layer_groups(2)
    assert [g.layer_ids for g in groups] == [[0, 1], [2, 3, 4]]
    assert sum(g.payload_bytes for g in groups) == view.payload_bytes
    assert [g.layer_ids for g in view.layer_groups(9)] == [[i] for i in range(5)]
    with pytest.raises(PoolViewError):
        view.layer_groups(0)


def test_views_that_do_not_match_the_layout_are_refused() -> None:
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=4, mamba_slots=2)
    views = dict(pools.views())
    kv = pools.kv.tensor
    # the engine's KV in another dtype (and so another byte size per row) than the layout says
    wrong = torch.zeros(kv.shape, dtype=torch.float64 if kv.element_size() != 8 else torch.float32)
    views[PoolKind.FULL] = stacked_kv_view(wrong, layer_ids=layout.full_layers, page_size=layout.page_size)
    with pytest.raises(PoolViewError, match="bytes per object"):
        PoolSet(views).check_layout(layout)
    del views[PoolKind.DRAFT]
    with pytest.raises(PoolViewError, match="views for"):
        PoolSet(views).check_layout(layout)
