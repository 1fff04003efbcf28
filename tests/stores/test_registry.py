"""``stores/registry.py``: a store opened by name, a fault plan wrapped the one way, unknown
names refused, a backend without its client refused with the backend's error."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from hylinker.stores.base import Store, StoreUnavailableError
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.faulty import FaultPlan, FaultyStore
from hylinker.stores.registry import BACKENDS, StoreSpec, open_store, register_store


async def test_embedded_by_name_with_its_settings() -> None:
    ticks = iter(range(1000))
    opened = await open_store(StoreSpec("embedded", 4 << 20, eviction_memory_bytes=0, clock=lambda: float(next(ticks))))
    try:
        assert isinstance(opened.store, EmbeddedStore) and opened.store is opened.backend
        assert not opened.wrapped and opened.master is None
        assert opened.store.capacity_bytes == 4 << 20
        assert not opened.store.evictions_memory.enabled
    finally:
        await opened.store.close()


async def test_a_fault_plan_wraps_the_backend() -> None:
    opened = await open_store(StoreSpec("embedded", 1 << 20, faults=FaultPlan(fail=0.5), fault_seed=7))
    try:
        assert isinstance(opened.store, FaultyStore) and opened.wrapped
        assert isinstance(opened.backend, EmbeddedStore)
    finally:
        await opened.store.close()
        await opened.backend.close()


async def test_an_unknown_store_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown store 'redis'; known: embedded, mooncake, umbp"):
        await open_store(StoreSpec("redis", 1 << 20))


@pytest.mark.skipif(importlib.util.find_spec("mori") is not None, reason="mori's UMBP client is installed here")
async def test_a_backend_without_its_client_raises_its_own_error() -> None:
    with pytest.raises(StoreUnavailableError):
        await open_store(StoreSpec("umbp", 1 << 20))


async def test_a_backend_registers_once() -> None:
    async def adapter(spec: StoreSpec) -> tuple[Store, Any]:
        return EmbeddedStore(spec.capacity_bytes, name="extra"), None

    with pytest.raises(ValueError, match="already registered"):
        register_store("embedded", adapter)
    register_store("extra-test", adapter)
    try:
        opened = await open_store(StoreSpec("extra-test", 1 << 20))
        assert isinstance(opened.store, EmbeddedStore)
        await opened.store.close()
    finally:
        del BACKENDS["extra-test"]
