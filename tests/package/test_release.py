"""What a release ships: one version source, the license and notices, typing marker, one
Mooncake extra per Mooncake build. (``.ci/wheel-check.sh`` builds and installs the wheel.)"""

from __future__ import annotations

import os
from pathlib import Path

import tomllib

import hylinker

ROOT = Path(hylinker.__file__).resolve().parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_has_one_source_and_the_build_reads_it() -> None:
    from setuptools.config.pyprojecttoml import read_configuration

    assert "version" not in PYPROJECT["project"]
    assert "version" in PYPROJECT["project"]["dynamic"]
    here = Path.cwd()
    os.chdir(ROOT)  # setuptools resolves package-dir from the project's folder
    try:
        expanded = read_configuration(ROOT / "pyproject.toml", expand=True)
    finally:
        os.chdir(here)
    assert expanded["project"]["version"] == hylinker.__version__


def test_license_and_notice_ship_and_name_every_bundled_data_file() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert set(project["license-files"]) == {"LICENSE", "NOTICE"}
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert "Version 2.0, January 2004" in (ROOT / "LICENSE").read_text()
    notice = (ROOT / "NOTICE").read_text()
    bundled = sorted((ROOT / "tools" / "data").iterdir())
    assert bundled
    for path in bundled:
        assert f"tools/data/{path.name}" in notice


def test_the_typing_marker_is_package_data() -> None:
    assert (ROOT / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["hylinker"]


def test_each_mooncake_extra_names_one_distinct_build() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    builds = {name: extras[name] for name in extras if name.startswith("mooncake")}
    assert set(builds) == {"mooncake", "mooncake-cuda12", "mooncake-cuda13"}
    packages = [reqs[0].split(">")[0].split("=")[0].split("<")[0] for reqs in builds.values()]
    assert all(len(reqs) == 1 for reqs in builds.values())
    assert len(set(packages)) == 3 and all(p.startswith("mooncake-transfer-engine") for p in packages)
    # docs/guide/install.md tells which extra goes with which engine
    install = (ROOT / "docs" / "guide" / "install.md").read_text()
    for name in builds:
        assert f"hylinker[{name}]" in install
