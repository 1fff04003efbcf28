"""Pytest fixtures the engine suites share (``tests/engines/sglang/``, ``tests/engines/sglang_server/``): each
suite's root ``conftest.py`` loads them with ``pytest_plugins = ["hylinker.tests.support.engine_fixtures"]``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def mooncake_master() -> Iterator[object]:
    """A fresh loopback Mooncake master (its own process), stopped after the test."""
    from hylinker.stores.mooncake_master import MooncakeMaster

    master = MooncakeMaster().start()
    try:
        yield master
    finally:
        master.close()


__all__ = ["mooncake_master"]
