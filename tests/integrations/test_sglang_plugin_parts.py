"""The SGLang plugin's parts that need no SGLang: its config keys and its pool views.

The plugin itself runs against SGLang's real cache in `tests/engines/sglang/` (its own environment).
"""

from __future__ import annotations

import types

import pytest
import torch

from hylinker.components.layout import PoolKind
from hylinker.components.pool_view import PoolSet
from hylinker.integrations.config import PluginConfig
from hylinker.integrations.sglang.config import LinkerConfigError, SGLangLinkerConfig
from hylinker.integrations.sglang.pools import PoolLayoutError, draft_pool, full_pool, mamba_pool
from hylinker.runtime.dataplane.plane import Transfer
from hylinker.runtime.dataplane.sync_plane import SyncDataPlane
from hylinker.stores.embedded import EmbeddedStore


def test_config_defaults_and_keys() -> None:
    c = SGLangLinkerConfig.from_extra_config(None)
    assert c.store == "embedded" and c.fault_plan is None
    c = SGLangLinkerConfig.from_extra_config(
        {"store": "mooncake", "master": "127.0.0.1:50051", "segment_mb": 0, "salt": "t1",
         "faults": "fail=0.1,latency_ms=2", "store_timeout_s": 2})
    assert c.master == "127.0.0.1:50051" and c.store_timeout_s == 2.0
    assert c.fault_plan is not None and c.fault_plan.fail == 0.1
    # one parser: the shared PluginConfig keys, plus SGLang's own; its retry rule is the store's
    assert isinstance(c, PluginConfig) and c.resilience().attempts == c.load_retries + 1
    assert c.resilience().deadline_s == 2.0
    assert SGLangLinkerConfig.from_extra_config({"store": "umbp"}).store == "umbp"
    with pytest.raises(LinkerConfigError, match="must be one of"):
        PluginConfig.from_extra_config({"store": "umbp"})  # vLLM's connector does not take it


@pytest.mark.parametrize(("extra", "message"), [
    ({"stor": "embedded"}, "unknown linker_extra_config keys"),
    ({"capacity_mib": 64}, r"did you mean 'capacity_mib' -> 'capacity_mb'\?"),
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
    ({"integrity": "none"}, r"linker_extra_config\['integrity'\] must be one of \['checksum', 'header'\]"),
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


def _mamba(slots: int = 6) -> types.SimpleNamespace:
    cache = types.SimpleNamespace(temporal=torch.randn(2, slots, 3, 4), conv=[torch.randn(2, slots, 5)])
    return types.SimpleNamespace(mamba_pool=types.SimpleNamespace(mamba_cache=cache), mamba_map={0: 0, 2: 1},
                                 mamba_ckpt_pool=None)


@pytest.mark.parametrize("mla", [True, False])
def test_sglang_pools_round_trip_through_the_data_plane(mla: bool) -> None:
    src, dst = _hybrid(mla), _hybrid(mla)
    ms, md = _mamba(), _mamba()
    full, state = full_pool(src), mamba_pool(ms)
    assert full.replicated is mla and full.view.layer_ids == [1, 3] and state.view.layer_ids == [0, 2]
    assert state.view.payload_bytes == 2 * (3 * 4 + 5) * 4
    pages = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23])  # SGLang's flat device indices
    with SyncDataPlane(PoolSet([full.view, state.view]), lambda: EmbeddedStore(16 << 20)) as dp:
        out = dp.offload([Transfer(PoolKind.FULL, ["p0", "p1"], pages),
                          Transfer(PoolKind.MAMBA, ["s"], torch.tensor([4]))]).result(timeout=10)
        assert out.ok
        store = dp.store
        with SyncDataPlane(PoolSet([full_pool(dst).view, mamba_pool(md).view]), lambda: store,
                           own_store=False) as back:
            load = back.load([Transfer(PoolKind.FULL, ["p0", "p1"], torch.arange(8)),
                              Transfer(PoolKind.MAMBA, ["s"], torch.tensor([1]))], verify_all=True)
            assert load.result.result(timeout=10).ok
            assert all(load.layer(layer).result(timeout=1) for layer in (0, 1, 2, 3))
    buffers = ("kv_buffer",) if mla else ("k_buffer", "v_buffer")
    for name in buffers:
        for s, d in zip(getattr(src.full_kv_pool, name), getattr(dst.full_kv_pool, name)):
            assert torch.equal(s[8:12].view(torch.uint8), d[0:4].view(torch.uint8))
            assert torch.equal(s[20:24].view(torch.uint8), d[4:8].view(torch.uint8))
    sc, dc = ms.mamba_pool.mamba_cache, md.mamba_pool.mamba_cache
    assert torch.equal(sc.temporal[:, 4], dc.temporal[:, 1]) and torch.equal(sc.conv[0][:, 4], dc.conv[0][:, 1])


def test_unsupported_pools_are_refused_by_name() -> None:
    draft = draft_pool([types.SimpleNamespace(page_size=4, k_buffer=[torch.zeros(8, 1, 2)],
                                              v_buffer=[torch.zeros(8, 1, 2)])], 4)
    assert draft is not None and draft.view.kind is PoolKind.DRAFT and draft.view.layer_ids == [0]
    assert draft_pool([], 4) is None
    with pytest.raises(PoolLayoutError, match="page size"):
        draft_pool([types.SimpleNamespace(page_size=2, k_buffer=[], v_buffer=[])], 4)
    pool = _mamba()
    pool.mamba_ckpt_pool = object()
    with pytest.raises(PoolLayoutError, match="int8"):
        mamba_pool(pool)
    pool = _mamba()
    pool.mamba_map = {0: 0}
    with pytest.raises(PoolLayoutError, match="layer map"):
        mamba_pool(pool)
    scaled = _hybrid(False)
    scaled.full_kv_pool.k_scale_buffer = [torch.zeros(1)]
    with pytest.raises(PoolLayoutError, match="scaled"):
        full_pool(scaled)


def test_fingerprint_names_the_geometry() -> None:
    def fp(mla: bool, ns: str = "m") -> bytes:
        return PoolSet([full_pool(_hybrid(mla)).view]).fingerprint(ns)

    assert fp(True) == fp(True)
    assert fp(True) != fp(False)
    assert fp(True) != fp(True, "other")


@pytest.mark.parametrize("config", ["sglang", "vllm"])
def test_trace_key_and_environment_variable(monkeypatch: pytest.MonkeyPatch, config: str) -> None:
    """Both plugins' configs: the ``trace`` key and ``HYLINKER_TRACE`` (the shared ``PluginConfig``)."""
    from hylinker.integrations.config import PluginConfig
    from hylinker.integrations.sglang.config import TRACE_ENV

    cls = SGLangLinkerConfig if config == "sglang" else PluginConfig
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert not cls.from_extra_config({}).tracing
    assert cls.from_extra_config({"trace": True}).tracing
    with pytest.raises(LinkerConfigError, match="true or false"):
        cls.from_extra_config({"trace": "yes"})
    monkeypatch.setenv(TRACE_ENV, "1")
    assert cls.from_extra_config({}).tracing  # the switch without a config edit
    monkeypatch.setenv(TRACE_ENV, "0")
    assert not cls.from_extra_config({}).tracing


def test_non_row_major_layouts_and_swa_without_its_pool_are_refused() -> None:
    from hylinker.integrations.sglang.pools import swa_pool

    hnd = _hybrid(False)
    hnd.full_kv_pool.kv_cache_layout = "hnd"
    with pytest.raises(PoolLayoutError, match="hnd"):
        full_pool(hnd)
    with pytest.raises(PoolLayoutError, match="SWAKVPool"):
        swa_pool(_hybrid(False))
