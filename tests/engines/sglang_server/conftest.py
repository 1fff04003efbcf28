"""The SGLang server suite: runs in `.venv-sglang-server` (`.ci/sglang-server-setup.sh`), never in
the main suite's environment (the main suite collects only `tests/`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hylinker.tests.support.sglang_server import build_tiny_gpt2

pytest_plugins = ["hylinker.tests.support.engine_fixtures"]


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight GPT-2 and its tokenizer, built locally (SGLang runs dense models on CPU)."""
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))
