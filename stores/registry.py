"""Opening a store from a config: ``open_store(spec)``, the one place every front and tool that
opens a store by name goes through (the plugins' ``integrations/config.py``, the stress replay's
``tools/stress/inputs.py``, the demo's ``tools/demo.py``).

A :class:`StoreSpec` names a backend (``kind``) and its settings; a registry maps each kind to
one small adapter that imports its backend only when called (a machine without the Mooncake or
mori UMBP client can open the embedded store). A fault plan, when the spec carries one, is
wrapped around the backend here too, so every caller gets it the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs

from .base import Store
from .faulty import FaultPlan


@attrs.frozen
class StoreSpec:
    """Which store to open and how.

    ``capacity_bytes``: the embedded or UMBP store's capacity, and a Mooncake client's segment
    unless ``mooncake`` names ``segment_bytes``. ``mooncake``: :class:`MooncakeConfig` fields;
    without ``master_address`` (or with None) a loopback master is started and handed back in
    :attr:`OpenedStore.master`. ``faults``: a fault plan wrapped around the store
    (``FaultyStore``, seeded by ``fault_seed``)."""

    kind: str
    capacity_bytes: int
    eviction_memory_bytes: int | None = None  # embedded: None is the store's default
    clock: Callable[[], float] | None = None  # embedded: stamps evictions (None: monotonic)
    mooncake: Mapping[str, Any] = attrs.field(factory=dict)
    faults: FaultPlan | None = None
    fault_seed: int = 0


@attrs.frozen
class OpenedStore:
    """An opened store: ``store`` to use (the fault plan around ``backend`` if there is one),
    ``backend`` itself, and the Mooncake master started for it (the caller stops it)."""

    store: Store
    backend: Store
    master: Any = None

    @property
    def wrapped(self) -> bool:
        return self.store is not self.backend


Adapter = Callable[[StoreSpec], Awaitable[tuple[Store, Any]]]


async def _embedded(spec: StoreSpec) -> tuple[Store, Any]:
    from .embedded import EmbeddedStore

    options: dict[str, Any] = {}
    if spec.eviction_memory_bytes is not None:
        options["eviction_memory_bytes"] = spec.eviction_memory_bytes
    if spec.clock is not None:
        options["clock"] = spec.clock
    return EmbeddedStore(spec.capacity_bytes, **options), None


async def _umbp(spec: StoreSpec) -> tuple[Store, Any]:
    from .umbp import UmbpStore

    return UmbpStore(capacity_bytes=spec.capacity_bytes), None


async def _mooncake(spec: StoreSpec) -> tuple[Store, Any]:
    from .mooncake import MooncakeConfig, MooncakeStore

    options = {"segment_bytes": spec.capacity_bytes, **spec.mooncake}
    master = None
    if options.get("master_address") is None:
        from .mooncake_master import MooncakeMaster

        master = MooncakeMaster().start()
        options["master_address"] = master.address
    try:
        return await MooncakeStore.open(MooncakeConfig(**options)), master
    except BaseException:
        if master is not None:
            master.close()
        raise


#: the backends by name; :func:`register_store` adds one
BACKENDS: dict[str, Adapter] = {"embedded": _embedded, "mooncake": _mooncake, "umbp": _umbp}


def register_store(kind: str, adapter: Adapter) -> None:
    """Make ``open_store`` open ``kind`` with ``adapter`` (a name already taken is refused)."""
    if kind in BACKENDS:
        raise ValueError(f"a store backend named {kind!r} is already registered")
    BACKENDS[kind] = adapter


async def open_store(spec: StoreSpec) -> OpenedStore:
    """The store ``spec`` names, on the calling event loop. Raises ``ValueError`` for an unknown
    kind; a backend that cannot open raises its own error (``StoreUnavailableError`` where its
    client is missing or unreachable), having stopped any master it started."""
    adapter = BACKENDS.get(spec.kind)
    if adapter is None:
        raise ValueError(f"unknown store {spec.kind!r}; known: {', '.join(sorted(BACKENDS))}")
    backend, master = await adapter(spec)
    if spec.faults is None:
        return OpenedStore(backend, backend, master)
    from .faulty import FaultyStore

    return OpenedStore(FaultyStore(backend, spec.faults, seed=spec.fault_seed), backend, master)


__all__ = ["BACKENDS", "OpenedStore", "StoreSpec", "open_store", "register_store"]
