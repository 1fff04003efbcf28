"""The SGLang plugin's parts that need no SGLang: its config keys and its pool codec.

The plugin itself runs against SGLang's real cache in `tests_sglang/` (its own environment).
"""

from __future__ import annotations

import types

import pytest
import torch

from hylinker.integrations.sglang_config import LinkerConfigError, SGLangLinkerConfig
from hylinker.integrations.sglang_pools import (
    PoolLayoutError,
    draft_view,
    full_view,
    layout_fingerprint,
    mamba_view,
)


def test_config_defaults_and_keys() -> None:
    c = SGLangLinkerConfig.from_extra_config(None)
    assert c.store == "embedded" and c.fault_plan is None
    c = SGLangLinkerConfig.from_extra_config(
        {"store": "mooncake", "master": "127.0.0.1:50051", "segment_mb": 0, "salt": "t1",
         "faults": "fail=0.1,latency_ms=2", "store_timeout_s": 2})
    assert c.master == "127.0.0.1:50051" and c.store_timeout_s == 2.0
    assert c.fault_plan is not None and c.fault_plan.fail == 0.1


@pytest.mark.parametrize(("extra", "message"), [
    ({"stor": "embedded"}, "unknown linker_extra_config keys"),
    ({"store": "redis"}, "must be one of"),
    ({"store": "mooncake"}, "HOST:PORT"),
    ({"store": "mooncake", "master": "localhost"}, "HOST:PORT"),
    ({"master": "127.0.0.1:1"}, "only applies"),
    ({"segment_mb": "64"}, "must be an integer"),
    ({"capacity_mb": True}, "must be an integer"),
    ({"capacity_mb": 0}, "must be > 0"),
    ({"load_retries": -1}, ">= 0"),
    ({"touch": 1}, "true or false"),
    ({"faults": "explode=1"}, "unknown fault plan field"),
    ({"protocol": "udp"}, "tcp"),
])
def test_config_errors_name_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(LinkerConfigError, match=message):
        SGLangLinkerConfig.from_extra_config(extra)


def _hybrid(mla: bool, rows: int = 32, page: int = 4) -> types.SimpleNamespace:
    if mla:
        full = types.SimpleNamespace(kv_buffer=[torch.randn(rows, 1, 24).to(torch.bfloat16) for _ in range(2)])
    else:
        full = types.SimpleNamespace(k_buffer=[torch.randn(rows, 2, 8) for _ in range(2)],
                                     v_buffer=[torch.randn(rows, 2, 8) for _ in range(2)])
    return types.SimpleNamespace(full_kv_pool=full, full_attention_layer_id_mapping={1: 0, 3: 1},
                                 start_layer=0, page_size=page)


@pytest.mark.parametrize("mla", [True, False])
def test_full_view_round_trips_pages_layer_by_layer(mla: bool) -> None:
    src, dst = _hybrid(mla), _hybrid(mla)
    view, back = full_view(src), full_view(dst)
    assert view.replicated is mla and view.counter_layers == [1, 3]
    rows = view.object_rows(torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]), 2)
    out = torch.zeros(2, view.payload_bytes, dtype=torch.uint8)
    view.gather(rows, out)
    dest = back.object_rows(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), 2)
    for layer in range(len(back.layers)):
        back.scatter_layer(layer, out, dest)
    for s, d in zip(view.layers, back.layers):
        for sb, db in zip(s.buffers, d.buffers):
            assert torch.equal(sb[8:12].view(torch.uint8), db[0:4].view(torch.uint8))
            assert torch.equal(sb[20:24].view(torch.uint8), db[4:8].view(torch.uint8))
    with pytest.raises(PoolLayoutError, match="indices for 3 objects"):
        view.object_rows(torch.arange(8), 3)
    with pytest.raises(PoolLayoutError, match="out of range"):
        view.object_rows(torch.tensor([30, 31, 32, 33]), 1)


def test_mamba_and_draft_views() -> None:
    cache = types.SimpleNamespace(temporal=torch.randn(2, 6, 3, 4), conv=[torch.randn(2, 6, 5)])
    pool = types.SimpleNamespace(mamba_pool=types.SimpleNamespace(mamba_cache=cache), mamba_map={0: 0, 2: 1},
                                 mamba_ckpt_pool=None)
    view = mamba_view(pool)
    assert view.rows_per_object == 1 and view.counter_layers == [0, 2]
    assert view.payload_bytes == 2 * (3 * 4 + 5) * 4
    out = torch.zeros(1, view.payload_bytes, dtype=torch.uint8)
    view.gather(view.object_rows(torch.tensor([4]), 1), out)
    before = cache.temporal[:, 4].clone(), cache.conv[0][:, 4].clone()
    view.scatter_layer(0, out, view.object_rows(torch.tensor([1]), 1))
    view.scatter_layer(1, out, view.object_rows(torch.tensor([1]), 1))
    assert torch.equal(cache.temporal[:, 1], before[0]) and torch.equal(cache.conv[0][:, 1], before[1])
    draft = draft_view([types.SimpleNamespace(page_size=4, k_buffer=[torch.zeros(8, 1, 2)],
                                              v_buffer=[torch.zeros(8, 1, 2)])], 4)
    assert draft is not None and draft.counter_layers == [0] and not draft.replicated
    assert draft_view([], 4) is None
    with pytest.raises(PoolLayoutError, match="page size"):
        draft_view([types.SimpleNamespace(page_size=2, k_buffer=[], v_buffer=[])], 4)
    pool.mamba_ckpt_pool = object()
    with pytest.raises(PoolLayoutError, match="int8"):
        mamba_view(pool)


def test_fingerprint_names_the_geometry() -> None:
    a = layout_fingerprint([full_view(_hybrid(True))], page_size=4, model="m")
    assert a == layout_fingerprint([full_view(_hybrid(True))], page_size=4, model="m")
    assert a != layout_fingerprint([full_view(_hybrid(False))], page_size=4, model="m")
    assert a != layout_fingerprint([full_view(_hybrid(True))], page_size=4, model="other")
