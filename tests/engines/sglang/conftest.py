"""The SGLang plugin's suite: runs in `.venv-sglang` (`.ci/sglang-setup.sh`), never in the main
suite's environment (the main suite collects only `tests/`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from hylinker.tools.harness.sglang_cache import SGLangCache, install_cpu_shims

install_cpu_shims()

pytest_plugins = ["hylinker.tests.support.engine_fixtures"]


@pytest.fixture
def caches() -> Iterator[list[SGLangCache]]:
    """SGLang caches a test built (append them): each is closed after the test."""
    made: list[SGLangCache] = []
    yield made
    for cache in made:
        cache.close()


@pytest.fixture(autouse=True)
def collect_cycles() -> Iterator[None]:
    """SGLang's cache objects hold their pools' tensors in reference cycles, which Python's cyclic
    collector frees by allocation count, not by bytes: without a collection after each test the
    suite's process kept every test's pools (~0.4-2.6 GB each) and peaked at 14 GB."""
    yield
    gc.collect()
