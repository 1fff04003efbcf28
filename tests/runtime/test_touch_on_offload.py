"""TOUCH of an offload's path (``LinkerConfig.touch_on_offload``): after an offload below a
stored prefix settles, the prefix is at least as recent in the store's own LRU as the tail the
offload wrote, so the store evicts the tail first and never strands a tail below an evicted
prefix (issue 44; the conversation trace at half the store, docs/figures/stress.md)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hylinker.components.keys import object_keys
from hylinker.components.layout import PoolKind
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import small_hybrid_layout, synthetic_prefill, wait_until

LAYOUT = small_hybrid_layout()
_ids = itertools.count()


@pytest.mark.parametrize("touch_on_offload", [True, False])
async def test_a_prefix_is_refreshed_when_an_offload_below_it_settles(touch_on_offload: bool) -> None:
    tokens = np.random.default_rng(44).integers(1, 30000, size=50).astype(np.int32)
    store = EmbeddedStore(8 << 20)
    pools = HybridPools(LAYOUT, kv_pages=64, mamba_slots=16)
    cfg = LinkerConfig(staging_bytes_per_pool=1 << 16, touch_on_offload=touch_on_offload)
    async with Linker(LAYOUT, pools, store, cfg) as lk:
        content = SyntheticContent(pools)
        for n in (17, 49):  # A: pages 0..3 stored first; then B: pages 0..11 (A's answer EXISTS)
            req = lk.request(f"r{next(_ids)}", tokens[:n])
            names = object_keys(req.page_keys(n // LAYOUT.page_size), PoolKind.FULL, LAYOUT)
            await lk.lookup(req)
            await synthetic_prefill(lk, content, req)
            await lk.release(req)
            await lk.drain()
            lk.flush_device()  # no device hit (and its TOUCH): B finds A in the store only
        prefix, tail = names[:4], names[4:]
        await wait_until(lambda: lk.toucher.pending == 0 and store.statistics().touches == lk.toucher.keys_sent)
        order = {k: i for i, k in enumerate(store.lru_keys())}
        newest_tail = max(order[k] for k in tail)
        oldest_prefix = min(order[k] for k in prefix)
        # with the TOUCH the prefix is newer than the whole tail; without, older than all of it
        assert (oldest_prefix > newest_tail) == touch_on_offload
        assert (max(order[k] for k in prefix) < min(order[k] for k in tail)) == (not touch_on_offload)
        assert lk.statistics().touches == 0  # no device hit's TOUCH

