"""Each rule the three fronts share (the ``Linker``, the SGLang plugin, the vLLM connector) is
written once (docs/design/rules.md): these checks fail when a second copy appears in product code.

They read the source (AST), so they hold without any engine installed."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: not product code: the tests, the lab's one-off studies, the docs' examples
SKIP = ("tests", "docs", "tools/lab")

#: the rules' functions and the one module that may define each
OWNERS = {
    # the hit rule
    "stops": "components/lookup.py",
    "restorable_stops": "components/lookup.py",
    "restorable_page_counts": "components/lookup.py",
    "all_pages": "components/lookup.py",
    "trailing_pages": "components/lookup.py",
    # the writer rule and the rank term
    "replicated_writes": "components/ranks.py",
    # the key seeds and the key formats
    "namespace_seed": "components/keys.py",
    "geometry_seed": "components/keys.py",
    "object_key": "components/keys.py",
    "object_key_suffix": "components/keys.py",
    "sglang_key_suffix": "components/keys.py",
    "attention_key": "components/keys.py",
    "state_key": "components/keys.py",
    "rank_key": "components/keys.py",
}
#: defs that keep a front's own name for a rule must delegate to the one module's function
DELEGATES = {
    "writes": {"writes", "replicated_writes"},
    "rank_term": {"rank_term"},
    "key_suffix": {"rank_term", "sglang_key_suffix"},
    "restorable_blocks": {"restorable_stops"},
}
#: the places that open a store by name from a config, and the backends only the registry builds
OPENERS = ("integrations/config.py", "tools/stress/inputs.py", "tools/demo.py")
BACKEND_CALLS = {"UmbpStore", "MooncakeConfig", "FaultyStore"}


def product_files() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(tuple(f"{s}/" for s in SKIP)) or "/." in f"/{rel}":
            continue
        yield rel, ast.parse(path.read_text(), rel)


FILES = dict(product_files())


def defs(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def called(node: ast.AST) -> set[str]:
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def test_the_product_files_were_read() -> None:
    for rel in ("components/lookup.py", "components/ranks.py", "integrations/sglang/linker.py",
                "integrations/vllm/plan.py", "stores/registry.py", *OPENERS):
        assert rel in FILES


@pytest.mark.parametrize("name", sorted(OWNERS))
def test_a_rule_is_defined_in_one_module(name: str) -> None:
    where = sorted(rel for rel, tree in FILES.items() for d in defs(tree) if d.name == name)
    assert where == [OWNERS[name]], f"{name} is defined in {where}, only {OWNERS[name]} may define it"


@pytest.mark.parametrize("name", sorted(DELEGATES))
def test_a_front_s_own_name_for_a_rule_calls_the_one_rule(name: str) -> None:
    found = 0
    for rel, tree in FILES.items():
        if rel.startswith("components/ranks.py"):
            continue
        for d in defs(tree):
            if d.name == name:
                found += 1
                assert called(d) & DELEGATES[name], f"{rel}:{d.lineno} {name} writes its own rule"
    assert found, f"no front defines {name}: update DELEGATES"


def test_the_fronts_lookups_use_the_one_hit_rule() -> None:
    for rel, fn in (("integrations/sglang/linker.py", "lookup"), ("runtime/linker/lookup_room.py", None),
                    ("integrations/vllm/plan.py", "restorable_blocks")):
        tree = FILES[rel]
        scope: ast.AST = tree if fn is None else next(d for d in defs(tree) if d.name == fn)
        assert called(scope) & {"restorable_stops", "restorable_page_counts"}, rel


def test_stores_are_opened_by_name_only_through_the_registry() -> None:
    for rel in OPENERS:
        calls = called(FILES[rel])
        assert "open_store" in calls, f"{rel} does not open its store through stores.registry.open_store"
        assert not calls & (BACKEND_CALLS | {"EmbeddedStore"}), f"{rel} builds a backend itself"
    for rel, tree in FILES.items():
        if rel.startswith("stores/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("umbp"):
                names = {a.name for a in node.names}
                assert "UmbpStore" not in names, f"{rel} opens UMBP itself: use stores.registry.open_store"
