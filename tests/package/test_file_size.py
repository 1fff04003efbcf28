"""No product module passes 500 lines (issue 54): a file that long holds more than one
responsibility, and the next small edit makes it longer still. Product means every ``.py`` file
of the package (the checkout's root) outside ``tests/``, hidden folders and build output."""

from __future__ import annotations

import os
from pathlib import Path

import hylinker

ROOT = Path(os.path.realpath(os.path.dirname(hylinker.__file__)))
MAX_LINES = 500
#: folders at the root that hold no product code
NOT_PRODUCT = {"tests", "build"}


def product_files(root: Path) -> list[Path]:
    out = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if parts[0] in NOT_PRODUCT or any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info")
                                          for p in parts):
            continue
        out.append(path)
    return sorted(out)


def too_long(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """``{path relative to root: lines}`` of the product files over ``limit`` lines."""
    counts = {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines()) for p in product_files(root)}
    return {rel: n for rel, n in counts.items() if n > limit}


def test_no_product_file_is_over_500_lines() -> None:
    assert len(product_files(ROOT)) > 100, "the package's modules were not found"
    offenders = too_long(ROOT)
    assert not offenders, "product files over 500 lines (split them by responsibility): " + ", ".join(
        f"{rel} ({n})" for rel, n in sorted(offenders.items(), key=lambda kv: -kv[1]))


def test_the_check_names_a_long_file_and_skips_tests(tmp_path: Path) -> None:
    (tmp_path / "stores").mkdir()
    (tmp_path / "stores" / "long.py").write_text("x = 1\n" * 501, encoding="utf-8")
    (tmp_path / "stores" / "short.py").write_text("x = 1\n" * 500, encoding="utf-8")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_long.py").write_text("x = 1\n" * 900, encoding="utf-8")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "site.py").write_text("x = 1\n" * 900, encoding="utf-8")
    assert too_long(tmp_path) == {"stores/long.py": 501}
