"""A pytest plugin every hylinker suite loads (``pytest_plugins``): two checks on the run itself.

- **Which hylinker is under test.** The repository root is the package (``package-dir``), so a
  checkout can silently import another install of ``hylinker`` (a fresh clone's editable install,
  a wheel in site-packages) and test code it does not hold. The session stops before collection,
  with one line, when ``hylinker`` does not import from the checkout that holds the suite.
- **What the suite cost in memory.** The peak resident memory of the pytest process and of its
  largest child (engines run in child processes; Linux counts a forked child's inherited pages, so
  a child is never reported below the size its parent had when it forked) is printed at the end of every run, so CI's log
  shows which suite comes near the machine's 24 GiB.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import pytest

import hylinker


def checkout_root(start: Path) -> Path | None:
    """The nearest folder at or above ``start`` that holds hylinker's ``pyproject.toml``."""
    for folder in (start, *start.parents):
        project = folder / "pyproject.toml"
        if project.is_file() and 'name = "hylinker"' in project.read_text(encoding="utf-8"):
            return folder
    return None


def foreign_import(rootpath: Path) -> str | None:
    """Why the imported ``hylinker`` is not this checkout's, or None when it is."""
    root = checkout_root(rootpath.resolve())
    if root is None:
        return None  # not run from a checkout (an installed wheel's user): nothing to compare
    imported = Path(os.path.realpath(os.path.dirname(hylinker.__file__)))
    if imported == Path(os.path.realpath(root)):
        return None
    return (f"hylinker imports from {imported}, not from this checkout {root}: "
            f"run `pip install -e .` in {root} (or fix PYTHONPATH) and rerun")


def pytest_configure(config: pytest.Config) -> None:
    reason = foreign_import(config.rootpath)
    if reason is not None:
        raise pytest.UsageError(reason)


def _peak_mib(who: int) -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(who).ru_maxrss * scale / (1 << 20)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(
        f"peak resident memory: pytest process {_peak_mib(resource.RUSAGE_SELF):.0f} MiB, "
        f"largest child {_peak_mib(resource.RUSAGE_CHILDREN):.0f} MiB")
