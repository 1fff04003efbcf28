"""Engine integrations: hylinker inside serving engines, one package per engine.

* :mod:`hylinker.integrations.sglang`: ``HylinkerLinker``, SGLang 0.5.23's external cache linker;
* :mod:`hylinker.integrations.vllm`: ``HylinkerConnector``, vLLM 0.32's KV connector;
* :mod:`hylinker.integrations.config`: ``PluginConfig``, the ``extra_config`` keys both engines
  share and the store they open (imports no engine);
* :mod:`hylinker.integrations.store_host`: one store per engine process.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_export(package: str, name: str, module: str) -> Callable[[str], Any]:
    """A package's ``__getattr__`` that imports ``name`` from its submodule ``module`` on first
    access, so the engine-free modules of an engine's package import without the engine."""

    def __getattr__(attr: str) -> Any:
        if attr == name:
            return getattr(importlib.import_module(module, package), name)
        raise AttributeError(f"module {package!r} has no attribute {attr!r}")

    return __getattr__
