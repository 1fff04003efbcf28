"""The runtime: its two layers, the data plane (:mod:`.dataplane`: objects between device pools and
a store) and the linker on top of it (:mod:`.linker`: our own tree with COMMIT). docs/structure.md
maps them; the public API is the package root's ``hylinker``.

Until issue 46 the two layers were top-level packages, and examples (``docs/serving_example.py``)
imported ``hylinker.linker.facade``. Those paths still import, as the very same modules (one class
``Linker``, not two), with a :class:`DeprecationWarning` naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

#: old dotted prefix -> where its modules live now
MOVED = {"hylinker.dataplane": "hylinker.runtime.dataplane", "hylinker.linker": "hylinker.runtime.linker"}


def moved_to(name: str) -> str | None:
    """The module's path now, for a path from before the move; None for any other name."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module already (or now) imported under its new path."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.target} (issue 46); import it from there",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The module ran once, under its new name."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = moved_to(fullname)
        if new is None or importlib.util.find_spec(new) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
