"""Shared fixtures.

Mooncake: ``mooncake_master`` is one loopback master for the whole session; ``mooncake_store``
is a fresh :class:`~hylinker.stores.mooncake.MooncakeStore` per test, connected to it with its
own 64 MiB segment. Tests share the master, so use unique key prefixes (``uuid4().hex``).
Without mooncake installed these fixtures skip, except in CI (``CI=true``), where they fail.

Hypothesis: in CI the search is derandomized (the same examples every run), so whether a
submission lands never depends on luck; local runs explore new examples each time and keep any
failure in ``.hypothesis/`` to replay it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import settings

from hylinker.stores.base import Store

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")

MOONCAKE_SEGMENT_BYTES = 64 << 20
MOONCAKE_LEASE_TTL_MS = 1000  # short, so eviction tests need not wait 10 s


def mooncake_missing_reason() -> str | None:
    """Why mooncake cannot run here, or None when it can."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mooncake not importable: {exc}"
    from hylinker.stores.mooncake_master import MooncakeMasterError, find_master_binary

    try:
        find_master_binary()
    except MooncakeMasterError as exc:
        return str(exc)
    return None


def require_mooncake() -> None:
    """Skip (or, in CI, fail) the calling test/fixture when mooncake is unavailable."""
    reason = mooncake_missing_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the mooncake tests: {reason} (run .ci/mooncake-setup.sh)")
    pytest.skip(reason)


KIT = "hylinker.testing.plugin"


def pytest_configure(config: pytest.Config) -> None:
    """The test kit registers through its ``pytest11`` entry point once this checkout is installed
    (``pip install -e .``); an install from before the entry point, or a run with plugin autoload
    off, gets it here, once (pytest refuses a module registered twice)."""
    if not any(getattr(p, "__name__", None) == KIT for p in config.pluginmanager.get_plugins()):
        config.pluginmanager.import_plugin(KIT)


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[object]:
    """A loopback ``mooncake_master`` shared by the session (a ``MooncakeMaster``)."""
    require_mooncake()
    from hylinker.stores.mooncake_master import MooncakeMaster

    master = MooncakeMaster(lease_ttl_ms=MOONCAKE_LEASE_TTL_MS)
    master.start()
    try:
        yield master
    finally:
        master.close()


@pytest.fixture
async def mooncake_store(mooncake_master: object) -> AsyncIterator[Store]:
    """An open ``MooncakeStore`` on the session master, closed after the test."""
    from hylinker.stores.mooncake import MooncakeConfig, MooncakeStore
    from hylinker.stores.mooncake_master import MooncakeMaster

    assert isinstance(mooncake_master, MooncakeMaster)
    if not mooncake_master.running:  # a test stopped it; bring the session master back
        mooncake_master.start()
    store = await MooncakeStore.open(
        MooncakeConfig(
            master_address=mooncake_master.address,
            segment_bytes=MOONCAKE_SEGMENT_BYTES,
            bounce_bytes=4 << 20,
            workers=2,
        )
    )
    try:
        yield store
    finally:
        await store.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``cuda`` tests run whenever torch sees a GPU (so ``just test`` on a GPU machine runs
    them) and skip cleanly elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the real device path runs where torch sees a GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
