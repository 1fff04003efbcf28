"""The prepared device check's own rules (``.ci/gpu-check.py``): a wheel list that misses a
requirement, or carries one the image holds at a version the wheel refuses, is refused naming
it; the device command fits the device tool and installs what is carried."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / ".ci" / "gpu-check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "\n".join([f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n")
    return path


def test_a_requirement_missing_from_the_image_and_the_wheels_is_named(gpu_check: ModuleType, tmp_path: Path) -> None:
    ok = _wheel(tmp_path, "structlog", "26.1.0", ['tomli; python_version < "3.11"', 'jsfetch; sys_platform == "emscripten"'])
    log: list[str] = []
    gpu_check.check_resolves([ok], log)  # markers read for the device: neither applies there
    assert "resolves" in log[0]
    bad = _wheel(tmp_path, "kernels", "0.19.1", ["no-such-package>=1"])
    with pytest.raises(SystemExit, match=r"no-such-package \(for kernels-0.19.1"):
        gpu_check.check_resolves([ok, bad], log)


def test_an_image_package_at_a_refused_version_is_named(gpu_check: ModuleType, tmp_path: Path) -> None:
    structlog = _wheel(tmp_path, "structlog", "26.1.0", [])  # hylinker's own requirement
    wants_new_hub = _wheel(tmp_path, "transformers", "5.25.0", ["huggingface-hub<3.0,>=2.4.0"])
    with pytest.raises(SystemExit, match=r"huggingface-hub 1\.33\.0 \(for transformers-5.25.0.*wants"):
        gpu_check.check_resolves([structlog, wants_new_hub], [])
    hub = _wheel(tmp_path, "huggingface_hub", "2.4.0", [])
    log: list[str] = []
    gpu_check.check_resolves([structlog, wants_new_hub, hub], log)  # carried: its version is the wheel's
    assert "resolves" in log[0]


def test_the_device_command_fits_and_installs_the_carried_wheels(gpu_check: ModuleType) -> None:
    line = gpu_check.device_command()
    assert len(line) <= 2000 and f"{gpu_check.WHEELS}/*.whl" in line and "--run" in line
    assert set(gpu_check.CARRIED) >= {"structlog", "pytest-asyncio"}  # what the image lacks
    assert sum(gpu_check.STAGES.values()) <= 8 * 60
