"""The repository root is the package (``package-dir = {"hylinker" = "."}``): two guards on that.

- ``packages`` in ``pyproject.toml`` is a hand list; a folder that holds an ``__init__.py`` and is
  missing from it ships nowhere (an installed wheel fails to import it) while every checkout test
  passes.
- A checkout that imports another install of ``hylinker`` tests code it does not hold: the suite
  plugin (:mod:`hylinker.tests.support.suite_checks`) stops such a session before collection.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import hylinker
from hylinker.tests.support.suite_checks import checkout_root, foreign_import

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(os.path.realpath(os.path.dirname(hylinker.__file__)))
#: folders at the root that hold tests or tooling outside the package, never shipped
NOT_SHIPPED = {"tests", "build"}


def package_folders(root: Path) -> set[str]:
    found: set[str] = set()
    for init in root.rglob("__init__.py"):
        parts = init.parent.relative_to(root).parts
        if any(p.startswith(".") or p in NOT_SHIPPED or p.endswith(".egg-info") for p in parts[:1]):
            continue
        if any(p.startswith(".") or p == "__pycache__" for p in parts):
            continue
        found.add(".".join(("hylinker", *parts)))
    return found


def test_packages_list_every_folder_with_an_init() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(project["tool"]["setuptools"]["packages"])
    on_disk = package_folders(ROOT)
    assert on_disk - listed == set(), "folders with __init__.py missing from pyproject's packages"
    assert listed - on_disk == set(), "pyproject lists packages with no __init__.py"


def test_this_checkout_is_the_one_imported() -> None:
    assert foreign_import(ROOT) is None
    assert checkout_root(ROOT / "components") == ROOT


def test_another_checkout_is_named_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "hylinker"\n', encoding="utf-8")
    (tmp_path / "tests").mkdir()
    reason = foreign_import(tmp_path / "tests")
    assert reason is not None
    assert str(tmp_path) in reason and "pip install -e ." in reason
    # a folder that is no hylinker checkout (an installed wheel's user) is not judged
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "pyproject.toml").write_text('[project]\nname = "other"\n', encoding="utf-8")
    assert checkout_root(other) == tmp_path
    assert foreign_import(Path("/")) is None


#: the tracked top-level entries, each with its reason in docs/structure.md ("The tree, and why")
TOP_LEVEL = {
    "runtime", "components", "stores", "tests", "tools", "pyproject.toml", "Justfile",  # the brief's
    "__init__.py", "__main__.py", "py.typed",  # the root is the package
    "integrations", "testing",  # the engine plugins and the public test kit
    "README.md", "LICENSE", "NOTICE", "CHANGELOG.md",  # the release files
    "docs", ".ci", ".gitignore",
}


def test_the_top_level_is_the_documented_list() -> None:
    import subprocess

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tracked = {line.split("/", 1)[0] for line in out.splitlines() if line}
    assert tracked == TOP_LEVEL, (sorted(tracked - TOP_LEVEL), sorted(TOP_LEVEL - tracked))
    documented = (ROOT / "docs" / "structure.md").read_text(encoding="utf-8")
    assert f"holds {len(TOP_LEVEL)} tracked entries" in documented
    for name in TOP_LEVEL:
        assert f"`{name}" in documented, name
