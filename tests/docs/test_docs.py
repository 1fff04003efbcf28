"""The README and the topic pages are true to the code: their Python runs, the configuration page
is what the config classes say, their links resolve, nothing points outside the repository, and every
figure they quote is in the docs/figures/ section it links to."""

from __future__ import annotations

import argparse
import re
import runpy
from pathlib import Path

import pytest

from hylinker.tools import config_doc

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/ and its subfolders
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
    assert config_doc.run(args) == 0, "docs/guide/configuration.md is stale: run `python -m hylinker config-doc`"
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


# ---- figures from one source ------------------------------------------------------------------
# A page quotes a measured figure as the text of a link to the section of a docs/figures/ page that
# measured it: [0.997 of the bound](docs/figures/stress.md#main-job-...). Every number in such a
# link's text must be in that section's current text (its block quotes, which hold earlier runs
# kept for context, left out), and a page names a figures page only through such links, so a
# rerun that changes a section fails here until every quote of it is updated. docs/figures.md is
# the index: its summaries are checked against the sections they link to.

FIGURES = ROOT / "docs" / "figures.md"
FIGURE_PAGES = {page.stem: page for page in sorted((ROOT / "docs" / "figures").glob("*.md"))}
QUOTING_PAGES = [page for page in PAGES if page != FIGURES and page not in FIGURE_PAGES.values()
                 and page.name != "configuration.md"]  # generated
_NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?![\d])")
_ISSUE = re.compile(r"\bissue \d+")  # a reference, not a figure
#: a link to the figures index or to a figures page: label, path, page (None: the index), anchor
_FIGURES_LINK = re.compile(
    r"\[([^\]]*)\]\(((?:\.\./)*(?:docs/)?figures(?:/([\w-]+))?\.md)(?:#([^)\s]+))?\)")
_FIGURES_NAMED = re.compile(r"figures(?:/[\w-]+)?\.md")


def numbers(text: str) -> list[float]:
    """The numbers in ``text`` by value (``2,500`` is 2500, ``421`` is ``421.0``), issue numbers
    left out."""
    return [float(n.replace(",", "")) for n in _NUMBER.findall(_ISSUE.sub("", text))]


def figure_sections(text: str) -> dict[str, str]:
    """Each heading's anchor -> its current text: down to the next heading of its level or
    above, without block-quote lines."""
    lines = text.splitlines()
    heads = [(i, len(m.group(1)), _slug(m.group(2))) for i, line in enumerate(lines)
             if (m := re.match(r"^(#+) (.+)$", line))]
    out = {}
    for k, (start, level, anchor) in enumerate(heads):
        end = next((i for i, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        out[anchor] = "\n".join(line for line in lines[start:end] if not line.lstrip().startswith(">"))
    return out


def all_sections() -> dict[str, str]:
    """``page#anchor`` -> that section's current text, over every docs/figures/ page."""
    return {f"{name}#{anchor}": text for name, page in FIGURE_PAGES.items()
            for anchor, text in figure_sections(page.read_text()).items()}


def stale_quotes(page_text: str, sections: dict[str, str]) -> list[str]:
    """Each quote whose numbers are not all in the section it links to (``sections``: keyed
    ``page#anchor``), and each mention of a figures page that is not a link."""
    bad = []
    for label, _, name, anchor in _FIGURES_LINK.findall(page_text):
        if numbers(label) and not (name and anchor):
            bad.append(f"[{label}] quotes figures but links to no section")
        elif numbers(label):
            section = sections.get(f"{name}#{anchor}", "")
            missing = [n for n in numbers(label) if n not in set(numbers(section))]
            if missing:
                bad.append(f"[{label}]({name}.md#{anchor}): {missing} not in that section")
    bare = re.sub(r"`git [^`]*`", "", _FIGURES_LINK.sub("", page_text))  # history: `git show REV:docs/figures.md`
    bad += [f"names a figures page outside a link: ...{bare[max(0, m.start() - 60):m.end() + 10]!r}"
            for m in _FIGURES_NAMED.finditer(bare)]
    return bad


def test_every_quoted_figure_is_in_the_current_section_it_links_to() -> None:
    sections = all_sections()
    quotes, stale = 0, []
    for page in QUOTING_PAGES:
        text = page.read_text()
        quotes += sum(1 for label, _, name, anchor in _FIGURES_LINK.findall(text)
                      if name and anchor and numbers(label))
        stale += [f"{page.relative_to(ROOT)}: {bad}" for bad in stale_quotes(text, sections)]
    assert not stale, "\n".join(stale)
    assert quotes >= 10


def test_the_figures_index_quotes_its_sections() -> None:
    """figures.md's Index summarises each section: its numbers must be in that section too."""
    sections = all_sections()
    index = re.findall(r"^- \[[^\]]*\]\(figures/([\w-]+)\.md#([^)]+)\): (.*)$",
                       FIGURES.read_text().split("## Index", 1)[1].split("\n## ", 1)[0], re.M)
    assert len(index) >= 20
    stale = [(f"{name}#{anchor}", missing) for name, anchor, summary in index
             if (missing := [n for n in numbers(summary)
                             if n not in set(numbers(sections.get(f"{name}#{anchor}", "")))])]
    assert not stale, stale


def test_figure_pages_are_short_with_stable_headings() -> None:
    """Each figures page stays readable (at most 300 lines) and its headings name what was
    measured, never an issue or a date (history is in git), so links to them stay valid."""
    assert len(FIGURE_PAGES) >= 8
    for name, page in FIGURE_PAGES.items():
        text = page.read_text()
        assert len(text.splitlines()) <= 300, f"docs/figures/{name}.md has over 300 lines"
        dated = [h for h in re.findall(r"^#+ (.+)$", text, re.M)
                 if re.search(r"\bissue \d+|\d{4}-\d\d-\d\d", h)]
        assert not dated, f"docs/figures/{name}.md: headings with an issue or a date: {dated}"


def test_no_docs_page_is_over_400_lines() -> None:
    long = [str(p.relative_to(ROOT)) for p in PAGES if len(p.read_text().splitlines()) > 400]
    assert not long, long


def test_the_readme_quotes_each_measured_figure_through_its_link() -> None:
    """Each row of the README's Measured table: what, then the figures as the link's text."""
    measured = (ROOT / "README.md").read_text().split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in measured.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 5
    for row in rows:
        figures = " | ".join(row.strip(" |").split(" | ")[1:])
        assert _FIGURES_LINK.search(figures) and not numbers(_FIGURES_LINK.sub("", figures)), row


def test_the_figures_check_fails_on_a_stale_or_unlinked_quote() -> None:
    sections = {f"sglang#{a}": s for a, s in figure_sections(
        "## SGLang\nloads ahead (1.04-1.83)\n\n> before: 1.7-2.5x\n## next\n1.9").items()}
    assert stale_quotes("loads [1.04-1.83x](figures/sglang.md#sglang)", sections) == []
    assert stale_quotes("loads [1.7-2.5x](figures/sglang.md#sglang)", sections)  # only in a block quote: an earlier run
    assert stale_quotes("loads [1.04-1.9x](figures/sglang.md#sglang)", sections)
    assert stale_quotes("loads [1.04-1.83x](figures/vllm.md#sglang)", sections)  # another page's section
    assert stale_quotes("loads 1.04-1.83x (`docs/figures/sglang.md`, SGLang)", sections)
    assert stale_quotes("loads [1.04x](figures.md)", sections)  # the index: no section
    assert stale_quotes("loads [1.7x](../figures/sglang.md#next)", sections)  # a page in a docs/ subfolder
    assert stale_quotes("see [the figures](../figures.md)", sections) == []
