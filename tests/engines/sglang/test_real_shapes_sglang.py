"""SGLang's real ``UnifiedRadixCache`` at Qwen3-Next-80B-A3B's cache geometry, both tree cores.

48 layers (12 full attention, MHA with 2 KV heads of 256; 36 Gated DeltaNet layers with SGLang's
Mamba2 state for 32 value heads x 128 x 128 in fp32 and the conv window of 16 key heads), at
SGLang's page size 64 with its ``extra_buffer`` Mamba strategy and at page 1. A restore after a
flush is compared byte for byte with what a recompute writes (the harness's
``restore_mismatches``); the served prefix is stored as pages of 12 layers and states of 36.
"""

from __future__ import annotations

import pytest
from test_sglang_linker import CORES, assert_clean, plugin

from hylinker.tools.harness.sglang_cache import SGLangCache
from hylinker.tools.harness.shapes import (
    QWEN3_NEXT_80B,
    kimi_linear_sglang_cache_spec,
    sglang_cache_spec,
)


@pytest.mark.parametrize(("core", "page"), [(core, 64) for core in CORES] + [("rust", 1)])
def test_real_geometry_restore_is_byte_exact(caches: list[SGLangCache], core: str, page: int) -> None:
    spec = sglang_cache_spec(QWEN3_NEXT_80B, page_size=page, tree_core=core, kv_pages=512 // page)
    cache = SGLangCache(spec, plugin())
    caches.append(cache)
    g = QWEN3_NEXT_80B
    sizes = {str(name): view.payload_bytes for name, view in cache.linker.pools.items()}
    assert sorted(sizes.values()) == sorted([len(g.full_attention_layers) * g.kv_bytes_per_token() * page,
                                             (g.layers - 12) * g.state_bytes()]), sizes
    prompt = list(range(5000, 5000 + 150))
    first = cache.serve(prompt)
    assert first.store_hit == 0
    cache.flush()
    again = cache.serve(prompt + list(range(9000, 9008)))
    assert again.device_hit == 0 and not again.aborted, again
    assert again.loaded == (128 if page > 1 else 150), again  # page 64: the deepest tracked state, at 128
    assert again.restore_mismatches == []
    assert len(cache.full_layers) == len(g.full_attention_layers) == 12 and len(cache.mamba_layers) == 36
    assert_clean(cache)


def test_kimi_linear_geometry_restore_is_byte_exact(caches: list[SGLangCache]) -> None:
    """Kimi-Linear-48B: 7 MLA layers (576 B per token each) and 20 KDA states, page 64."""
    cache = SGLangCache(kimi_linear_sglang_cache_spec(), plugin())
    caches.append(cache)
    sizes = sorted(view.payload_bytes for view in cache.linker.pools.values())
    assert sizes == sorted([7 * 64 * 576 * 2, 20 * (12288 * 3 * 2 + 32 * 128 * 128 * 4)]), sizes
    prompt = list(range(5000, 5000 + 150))
    cache.serve(prompt)
    cache.flush()
    again = cache.serve(prompt + list(range(9000, 9008)))
    assert again.device_hit == 0 and again.loaded == 128 and not again.aborted, again
    assert again.restore_mismatches == []
    assert_clean(cache)
