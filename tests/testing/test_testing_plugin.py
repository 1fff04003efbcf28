"""The test kit's pytest plugin (``-p hylinker.testing.plugin`` in the suite's addopts) drives a real
Linker end to end."""

from __future__ import annotations

import numpy as np
import pytest

from hylinker.components.layout import ModelLayout
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import FakeClock, GatedStore, attach_clock, synthetic_prefill


def test_the_plugin_is_loaded_by_its_module_name(pytestconfig: pytest.Config) -> None:
    plugin = pytestconfig.pluginmanager.get_plugin("hylinker.testing.plugin")
    assert plugin is not None and plugin.__name__ == "hylinker.testing.plugin"


async def test_a_prefix_offloaded_through_the_gated_store_restores_byte_exact(
        hylinker_layout: ModelLayout, hylinker_pools: HybridPools, hylinker_store: EmbeddedStore,
        hylinker_gated_store: GatedStore, hylinker_content: SyntheticContent, hylinker_clock: FakeClock) -> None:
    tokens = np.random.default_rng(0).integers(1, 30000, size=10 * hylinker_layout.grid + 3).astype(np.int32)
    hylinker_gated_store.hold(puts=True)
    async with Linker(hylinker_layout, hylinker_pools, hylinker_gated_store,
                      LinkerConfig(staging_bytes_per_pool=1 << 16)) as linker:
        attach_clock(linker, hylinker_clock)
        first = linker.request("first", tokens)
        await linker.lookup(first)
        await synthetic_prefill(linker, hylinker_content, first)
        await linker.release(first)
        await hylinker_gated_store.wait_held(1)
        assert hylinker_store.statistics().objects == 0  # held: nothing reached the store yet
        hylinker_gated_store.open()
        await linker.drain()
        assert hylinker_store.statistics().objects > 0
        hylinker_clock.advance(1.0)
        linker.flush_device()  # the device copy gone: the next request restores from the store
        again = linker.request("again", tokens)
        await linker.lookup(again)
        load = await linker.load(again)
        assert load is not None
        assert await linker.commit(load) > 0
        assert hylinker_content.prefix_problems(linker, again) == []
        await linker.release(again)
