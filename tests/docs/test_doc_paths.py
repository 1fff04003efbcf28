"""Every ``*.py`` path that a page under ``docs/``, the README or a docstring quotes names a file
that exists: a module renamed or moved leaves no stale name behind.

A path is ours unless its first folder is another project's package (SGLang's, vLLM's, ...):
those are quoted from the package's root (``sglang/srt/mem_cache/utils.py``), so a reader can
find them and this test can tell them apart. A bare file name must name one of our files.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import hylinker

ROOT = Path(os.path.realpath(os.path.dirname(hylinker.__file__)))
#: first folders of paths quoted from other projects (their package roots, or a repository root)
OTHER_PROJECTS = ("sglang/", "vllm/", "transformers/", "mooncake/", "mori/", "torch/", "python/",
                  "nanovllm/", "lmcache/")
#: folders that hold no project text
SKIPPED = {".git", "build", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
           ".hypothesis"}
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")


def project_files(suffix: str) -> list[Path]:
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if s not in SKIPPED and not s.startswith(".venv")]
        found += [Path(folder) / f for f in files if f.endswith(suffix)]
    return found


def docstrings(source: Path) -> list[str]:
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except SyntaxError:
        return []
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [d for node in ast.walk(tree) if isinstance(node, kinds)
            if (d := ast.get_docstring(node))]


def stale_paths(text: str, our_names: set[str]) -> list[str]:
    stale = []
    for match in PATH.finditer(text):
        path = match.group(1).removeprefix("hylinker/")
        if path.startswith(OTHER_PROJECTS):
            continue
        if "/" in path:
            if not (ROOT / path).is_file():
                stale.append(path)
        elif path not in our_names:
            stale.append(path)
    return stale


def test_every_quoted_path_exists() -> None:
    sources = project_files(".py")
    our_names = {p.name for p in sources}
    texts = [(p, p.read_text(encoding="utf-8")) for p in project_files(".md")]
    texts += [(p, d) for p in sources for d in docstrings(p)]
    stale = {f"{p.relative_to(ROOT)}: {path}" for p, text in texts
             for path in stale_paths(text, our_names)}
    assert not stale, "quoted paths that do not exist:\n" + "\n".join(sorted(stale))


def test_a_stale_path_is_caught() -> None:
    names = {"pools.py"}
    assert stale_paths("see `sglang_pools.py` and `integrations/sglang/pools.py`", names) == [
        "sglang_pools.py"]
    assert stale_paths("`runtime/linker/nowhere.py`", names) == ["runtime/linker/nowhere.py"]
    assert stale_paths("SGLang's `sglang/srt/mem_cache/utils.py`, our `pools.py`", names) == []
