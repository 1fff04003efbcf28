"""The connector's startup checks and group rules against vLLM's own config and spec classes (no
engine started): pipeline parallelism is refused by name, an unknown KV cache group kind is
refused by name, and a sliding-window group needs what vLLM's own sliding-window prefix rule
needs (``SlidingWindowManager``)."""

from __future__ import annotations

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from hylinker.integrations.config import PluginConfigError
from hylinker.integrations.vllm.cache_groups import cache_groups
from hylinker.integrations.vllm.connector import HylinkerConnector

BS = 384
SPEC = {"block_size": BS, "num_kv_heads": 1, "head_size": 64, "dtype": torch.bfloat16}


def _kv_cache_config(*specs: object) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def _vllm_config(extra: dict[str, object], **parallel: int) -> VllmConfig:
    ktc = KVTransferConfig(kv_connector="HylinkerConnector", kv_connector_module_path="hylinker.integrations.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return VllmConfig(parallel_config=ParallelConfig(**parallel), cache_config=CacheConfig(block_size=BS),
                      kv_transfer_config=ktc)


@pytest.mark.parametrize("window", [2, 383, 384, 385, 1000, 4096])
def test_sliding_window_group_needs_what_vllms_own_prefix_rule_needs(window: int) -> None:
    mamba = MambaSpec(block_size=BS, shapes=((4, 64),), dtypes=(torch.float32,))
    groups = cache_groups(_kv_cache_config(FullAttentionSpec(**SPEC), SlidingWindowSpec(**SPEC, sliding_window=window),
                                      mamba), BS)
    assert groups.attention == (0,) and groups.state == (2,)
    assert groups.window == ((1, max(1, SlidingWindowManager._contiguous_blocks_for_hit(window, BS, False))),)


def test_an_unknown_group_kind_stops_startup_naming_it() -> None:
    chunked = ChunkedLocalAttentionSpec(**SPEC, attention_chunk_size=1024)
    with pytest.raises(ValueError, match="group 1 is ChunkedLocalAttentionSpec"):
        cache_groups(_kv_cache_config(FullAttentionSpec(**SPEC), chunked), BS)


def test_pipeline_parallelism_stops_startup_naming_it() -> None:
    config = _kv_cache_config(FullAttentionSpec(**SPEC))
    with pytest.raises(ValueError, match="pipeline_parallel_size 2"):
        HylinkerConnector(_vllm_config({"store": "embedded"}, pipeline_parallel_size=2), KVConnectorRole.SCHEDULER,
                          config)


def test_a_bad_extra_config_key_stops_startup_naming_it() -> None:
    config = _kv_cache_config(FullAttentionSpec(**SPEC))
    with pytest.raises(PluginConfigError, match="fault_rnk"):
        HylinkerConnector(_vllm_config({"fault_rnk": 1}), KVConnectorRole.SCHEDULER, config)


def test_a_store_that_cannot_be_reached_stops_startup_naming_it() -> None:
    config = _kv_cache_config(FullAttentionSpec(**SPEC))
    extra = {"store": "mooncake", "master": "127.0.0.1:9", "segment_mb": 0}  # nothing listens there
    with pytest.raises(RuntimeError, match=r"scheduler side, rank 0\): cannot open store 'mooncake' at 127.0.0.1:9"):
        HylinkerConnector(_vllm_config(extra), KVConnectorRole.SCHEDULER, config)
