"""The test kit's pytest plugin (registered through its ``pytest11`` entry point) drives a real
Linker end to end."""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import hylinker
from hylinker.components.layout import ModelLayout
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing import plugin as plugin_module
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import FakeClock, GatedStore, attach_clock, synthetic_prefill

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(os.path.realpath(os.path.dirname(hylinker.__file__)))


def test_the_plugin_is_registered_once(pytestconfig: pytest.Config) -> None:
    kits = [p for p in pytestconfig.pluginmanager.get_plugins()
            if getattr(p, "__name__", None) == "hylinker.testing.plugin"]
    assert len(kits) == 1


def test_the_plugin_is_a_pytest11_entry_point() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["entry-points"]["pytest11"] == {"hylinker": "hylinker.testing.plugin"}
    # where the installed metadata already carries it (pip install -e . after the change), it
    # loads this checkout's module
    for entry in metadata.entry_points(group="pytest11"):
        if entry.name == "hylinker":
            assert entry.load() is plugin_module


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
