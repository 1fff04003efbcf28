"""The code map (``docs/structure.md``) is true: no module imports across the layers it forbids.

Every ``.py`` file of the package is parsed (not imported), and every import of a hylinker
module outside an ``if TYPE_CHECKING:`` block is checked against :data:`MAY_IMPORT`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("components", "stores", "runtime/dataplane", "runtime/linker", "integrations", "testing", "tools", "tests/support")

#: package -> the other packages its modules may import (docs/structure.md, last column)
MAY_IMPORT: dict[str, set[str]] = {
    "components": set(),
    "stores": set(),
    "runtime/dataplane": {"components", "stores"},
    "runtime/linker": {"components", "stores", "runtime/dataplane"},
    "integrations": {"components", "stores", "runtime/dataplane"},
    "testing": {"components", "stores", "runtime/dataplane", "runtime/linker"},
    "tools": {"components", "stores", "runtime/dataplane", "runtime/linker", "integrations", "testing"},
    # never shipped: what only the suites use (tools never import it)
    "tests/support": {"components", "stores", "runtime/dataplane", "runtime/linker", "integrations", "testing", "tools"},
    "runtime": set(),
    "__init__": {"components", "stores", "runtime/dataplane", "runtime/linker"},
    "__main__": {"tools"},
}


def _modules() -> list[Path]:
    files = [ROOT / "__init__.py", ROOT / "__main__.py", ROOT / "runtime" / "__init__.py"]
    for pkg in PACKAGES:
        files += sorted((ROOT / pkg).rglob("*.py"))
    return files


def _owner(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] in ("runtime", "tests") and len(rel.parts) > 2:
        return "/".join(rel.parts[:2])
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _type_only(tree: ast.Module) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def _runtime_imports(path: Path, rel: Path) -> Iterator[tuple[int, list[list[str]]]]:
    """Each hylinker import of ``path`` outside ``if TYPE_CHECKING:`` (module or function level):
    its line and the module paths below ``hylinker`` it may name (``from m import a`` names ``m``
    and ``m.a``); ``rel``: where the module lives in the package."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_only(tree)
    here = list(rel.parent.parts)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "hylinker":
                mod = node.module.split(".")[1:]
            else:
                continue
            yield node.lineno, [m for m in [mod, *([*mod, a.name] for a in node.names)] if m]
        elif isinstance(node, ast.Import):
            yield node.lineno, [a.name.split(".")[1:] for a in node.names
                                if a.name.split(".")[0] == "hylinker" and "." in a.name]


def imported_packages(path: Path, rel: Path | None = None) -> dict[str, int]:
    """The hylinker packages ``path`` imports at run time -> the first line that does; ``rel``:
    where the module lives in the package (default: where ``path`` is)."""
    found: dict[str, int] = {}
    for line, targets in _runtime_imports(path, rel or path.relative_to(ROOT)):
        for t in targets:
            pkg = "/".join(t[:2]) if t[0] in ("runtime", "tests") and len(t) > 1 else t[0]
            if pkg in PACKAGES:
                found.setdefault(pkg, line)
    return found


def test_every_package_is_mapped() -> None:
    assert {_owner(p) for p in _modules()} <= set(MAY_IMPORT)
    doc = (ROOT / "docs" / "structure.md").read_text()
    for pkg in PACKAGES:
        assert f"`{pkg}/`" in doc, f"docs/structure.md has no row for {pkg}/"


def _is_module(dotted: list[str]) -> bool:
    """Whether ``hylinker.<dotted>`` is a module or package of this checkout."""
    where = ROOT.joinpath(*dotted)
    return where.is_dir() or where.with_suffix(".py").is_file()


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_stay_in_their_layer(path: Path) -> None:
    owner = _owner(path)
    allowed = MAY_IMPORT[owner] | {owner}
    # a path that names no module of the package (a move left a relative import behind) fails
    # here, not only when the importing function first runs
    missing = sorted({".".join(targets[0]) for _, targets in _runtime_imports(path, path.relative_to(ROOT))
                      if targets and not _is_module(targets[0])})
    assert not missing, f"{path.relative_to(ROOT)} imports hylinker packages that do not exist: {missing}"
    crossing = {pkg: line for pkg, line in imported_packages(path).items() if pkg not in allowed}
    assert not crossing, (f"{path.relative_to(ROOT)} imports {sorted(crossing)} (lines "
                          f"{sorted(crossing.values())}); {owner} may import only {sorted(MAY_IMPORT[owner])}")


def test_the_checker_sees_a_crossing(tmp_path: Path) -> None:
    """The parse finds relative, absolute and function-level imports, and skips type-only ones."""
    fake = tmp_path / "probe.py"
    text = ("from typing import TYPE_CHECKING\n"
            "from ..runtime.linker import facade\n"
            "if TYPE_CHECKING:\n    from ..tools import cli\n"
            "def f():\n    import hylinker.integrations.vllm.connector\n")
    fake.write_text(text)
    assert imported_packages(fake, Path("stores/probe.py")) == {"runtime/linker": 2, "integrations": 6}
    assert imported_packages(fake, Path("stores/sub/probe.py")) == {"stores": 2, "integrations": 6}  # ..runtime.linker is stores.runtime.linker


#: packages whose modules import each other without a cycle (type-only imports aside; module-level
#: and function-level imports both count): a cycle is two modules that cannot be read apart
CYCLE_FREE = ("components", "stores", "runtime/dataplane", "runtime/linker", "integrations", "testing", "tools", "tests/support")


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, rel: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` (dotted, below ``hylinker``) that ``path`` imports at run time."""
    found = {".".join(t) for _, targets in _runtime_imports(path, rel) for t in targets} & known
    found.discard(_module_name(rel))
    return found


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> the modules it imports) as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n):], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_no_import_cycles() -> None:
    files = {_module_name(p.relative_to(ROOT)): p for pkg in CYCLE_FREE for p in (ROOT / pkg).rglob("*.py")}
    known = set(files)
    graph = {m: imported_modules(p, p.relative_to(ROOT), known) for m, p in files.items()}
    cycle = import_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_checker_sees_a_planted_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
                                   "def f():\n    from hylinker.tools import a\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    known = {"tools.a", "tools.b", "tools.c"}
    graph = {f"tools.{n}": imported_modules(tmp_path / f"{n}.py", Path(f"tools/{n}.py"), known) for n in "abc"}
    assert graph == {"tools.a": {"tools.b"}, "tools.b": {"tools.a"}, "tools.c": set()}
    assert import_cycle(graph) == ["tools.a", "tools.b", "tools.a"]
    del graph["tools.b"]
    assert import_cycle(graph) is None
