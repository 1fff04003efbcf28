"""The README and the topic pages are true to the code: their Python runs, the configuration page
is what the config classes say, their links resolve, and nothing points outside the repository."""

from __future__ import annotations

import argparse
import re
import runpy
from pathlib import Path

import pytest

from hylinker.tools import config_doc

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for i, match in enumerate(_FENCE.finditer(page.read_text())):
            out.append((f"{page.relative_to(ROOT)}#{i}", match.group(1)))
    return out


def test_there_are_snippets_to_run() -> None:
    names = [name for name, _ in snippets()]
    assert any(n.startswith("README.md") for n in names) and any(n.startswith("docs/") for n in names)


@pytest.mark.parametrize(("name", "code"), snippets(), ids=[n for n, _ in snippets()])
def test_python_snippet_runs(name: str, code: str, tmp_path: Path) -> None:
    """Each ```python block runs as written (its own asserts say what it must show)."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    runpy.run_path(str(script), run_name="__main__")


def test_configuration_page_is_current(tmp_path: Path) -> None:
    args = argparse.Namespace(check=True, out=config_doc.DOC)
    assert config_doc.run(args) == 0, "docs/configuration.md is stale: run `python -m hylinker config-doc`"
    stale = tmp_path / "configuration.md"
    stale.write_text(config_doc.render().replace("| `store` |", "| `stor` |", 1))
    assert config_doc.run(argparse.Namespace(check=True, out=stale)) == 1


def test_every_setting_is_described() -> None:
    rows = [line for line in config_doc.render().splitlines() if line.startswith("| `")]
    assert len(rows) > 40
    undescribed = [row.split("|")[1].strip() for row in rows if not row.rstrip(" |").split("|")[-1].strip()]
    assert not undescribed, f"fields without a #: or trailing comment in their class: {undescribed}"


def test_links_resolve_and_stay_inside() -> None:
    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text and "/work/" not in text, f"{page.name} points outside the repository"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_anchors_name_a_heading_of_their_page() -> None:
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            linked = (page.parent / target) if target else page
            if linked.suffix != ".md":
                continue
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)}
            assert anchor in slugs, f"{page.name} links to {target or page.name}#{anchor}, which names no heading"


def test_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
