"""The SGLang plugin's suite: runs in `.venv-sglang` (`.ci/sglang-setup.sh`), never in the main
suite's environment (the main suite collects only `tests/`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hylinker.testing.sglang_cache import install_cpu_shims

install_cpu_shims()


@pytest.fixture
def mooncake_master() -> Iterator[object]:
    """A fresh loopback Mooncake master (its own process), stopped after the test."""
    from hylinker.stores.mooncake_master import MooncakeMaster

    master = MooncakeMaster().start()
    try:
        yield master
    finally:
        master.close()
