"""hylinker's pytest plugin: the test kit as fixtures, for the tests of an engine that embeds hylinker.

It registers through a ``pytest11`` entry point (``hylinker``): every pytest run where hylinker
is installed has its fixtures, with no ``-p`` flag (``-p no:hylinker`` turns it off). Every
fixture is named ``hylinker_*``.

* ``hylinker_layout`` — :func:`~hylinker.testing.fakes.small_hybrid_layout`: two full-attention
  layers, two linear-attention layers, one draft layer, page 4, chunk 8.
* ``hylinker_pools`` — :class:`~hylinker.components.pools.HybridPools` over it (64 pages, 16 slots).
* ``hylinker_store`` — a fresh 8 MiB :class:`~hylinker.stores.embedded.EmbeddedStore`, closed after
  the test.
* ``hylinker_gated_store`` — a :class:`~hylinker.testing.fakes.GatedStore` over ``hylinker_store``
  (holds nothing until told); opened after the test so no held call outlives it.
* ``hylinker_content`` — :class:`~hylinker.testing.content.SyntheticContent` over ``hylinker_pools``.
* ``hylinker_clock`` — a :class:`~hylinker.testing.fakes.FakeClock` at 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from ..components.layout import ModelLayout
from ..components.pools import HybridPools
from ..stores.embedded import EmbeddedStore
from .content import SyntheticContent
from .fakes import FakeClock, GatedStore, small_hybrid_layout


@pytest.fixture
def hylinker_layout() -> ModelLayout:
    return small_hybrid_layout()


@pytest.fixture
def hylinker_pools(hylinker_layout: ModelLayout) -> HybridPools:
    return HybridPools(hylinker_layout, kv_pages=64, mamba_slots=16)


@pytest.fixture
def hylinker_store() -> Iterator[EmbeddedStore]:
    store = EmbeddedStore(8 << 20)
    try:
        yield store
    finally:
        asyncio.run(store.close())  # after the test: no event loop runs here


@pytest.fixture
def hylinker_gated_store(hylinker_store: EmbeddedStore) -> Iterator[GatedStore]:
    gated = GatedStore(hylinker_store)
    try:
        yield gated
    finally:
        gated.open()


@pytest.fixture
def hylinker_content(hylinker_pools: HybridPools) -> SyntheticContent:
    return SyntheticContent(hylinker_pools)


@pytest.fixture
def hylinker_clock() -> FakeClock:
    return FakeClock()
