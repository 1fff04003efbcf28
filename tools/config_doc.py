"""``hylinker config-doc``: write ``docs/guide/configuration.md`` from the config classes themselves.

Every setting a user can give lives in an attrs class (the plugins' ``extra_config`` keys, the
``Linker``'s and the data plane's configs, the store's retry policy). The page lists each field
with its type, its default (read from the class) and its description: the ``#:`` comment above
the field, or the ``#`` comment at the end of its line, in the class's source. So the page
cannot drift from the code: ``--check`` fails when the file differs from what the classes say
(a test runs it).
"""

from __future__ import annotations

import argparse
import inspect
import io
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

import attrs

from .arguments import UsageError

HELP = "write docs/guide/configuration.md from the config classes (--check: fail if it is stale)"

#: the page in a checkout (the repository root is the package); an installed wheel has no docs/
DOC = Path(__file__).resolve().parent.parent / "docs" / "guide" / "configuration.md"

#: (heading, where a user gives it, dotted class path)
SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("vLLM connector", "`kv_connector_extra_config` in `--kv-transfer-config` (JSON)",
     "hylinker.integrations.vllm.config.VllmConnectorConfig"),
    ("SGLang plugin", "`linker_extra_config` in `--unified-cache-external-linker-config` (JSON)",
     "hylinker.integrations.sglang.config.SGLangLinkerConfig"),
    ("Linker", "`hl.Linker(layout, pools, store, config=hl.LinkerConfig(...))`",
     "hylinker.runtime.linker.config.LinkerConfig"),
    ("Data plane", "`hl.DataPlane(views, store, config=hl.DataPlaneConfig(...))` (also `SyncDataPlane`)",
     "hylinker.runtime.dataplane.plane.DataPlaneConfig"),
    ("Store retries and breaker", "`LinkerConfig(resilience=hl.ResiliencePolicy(...))`",
     "hylinker.stores.retry_policy.ResiliencePolicy"),
)

_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def _load(path: str) -> type:
    module, _, name = path.rpartition(".")
    __import__(module)
    cls = getattr(sys.modules[module], name)
    assert isinstance(cls, type) and attrs.has(cls), path
    return cls


def field_comments(cls: type) -> dict[str, str]:
    """Each field's description in ``cls``'s own source (not its bases'): the ``#:`` lines right
    above it, else the comment at the end of its line; a field without either gets ''."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.line.strip() != tok.string.strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    src_lines = source.splitlines()
    own = set(inspect.get_annotations(cls))
    out: dict[str, str] = {}
    for i, line in enumerate(src_lines, start=1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0].strip() if ":" in stripped else ""
        if name not in own or line[: len(line) - len(line.lstrip())] != " " * 4:
            continue
        above: list[str] = []
        j = i - 2
        while j >= 0 and src_lines[j].strip().startswith("#:"):
            above.insert(0, src_lines[j].strip()[2:].strip())
            j -= 1
        out[name] = " ".join(above) if above else trailing.get(i, "")
    return out


def _default(field: attrs.Attribute[Any]) -> str:
    d = field.default
    if isinstance(d, attrs.Factory):  # type: ignore[arg-type]
        factory = getattr(d, "factory", None)
        return f"`{getattr(factory, '__name__', repr(factory))}()`"
    if d is attrs.NOTHING:
        return "required"
    value = getattr(d, "value", d)  # enums (Integrity) show their wire value
    text = f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'
    if isinstance(value, int) and not isinstance(value, bool) and "bytes" in field.name:
        for size, unit in _UNITS:
            if value >= size and value % size == 0:
                return f"{text} ({value // size} {unit})"
    return text


def _type(field: attrs.Attribute[Any]) -> str:
    t = field.type
    return f"`{t if isinstance(t, str) else getattr(t, '__name__', t)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The whole page, from the classes in :data:`SECTIONS`."""
    out = ["# Configuration", "",
           "Every setting, its default and what it does, generated from the config classes by",
           "`python -m hylinker config-doc` (a test fails when this page is stale: edit the",
           "comments in the class, then run the command). A plugin stops at startup on an unknown",
           "key or a bad value, naming the key.", ""]
    for heading, where, path in SECTIONS:
        cls = _load(path)
        comments: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            if attrs.has(klass):
                comments.update({k: v for k, v in field_comments(klass).items() if v or k not in comments})
        module = path.rsplit(".", 2)
        out += [f"## {heading}", "",
                f"Given as {where}; class `{cls.__name__}` (`{'/'.join(module[0].split('.')[1:])}/{module[1]}.py`).", "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in attrs.fields(cls):
            out.append(f"| `{f.name}` | {_cell(_type(f))} | {_cell(_default(f))} | {_cell(comments.get(f.name, ''))} |")
        out.append("")
    return "\n".join(out)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    parser.add_argument("--out", type=Path, default=None,
                        help="the page to write or check (default: docs/guide/configuration.md of the checkout "
                             "hylinker runs from; an installed hylinker has none, so give a path)")


def _page(out: Path | None) -> Path:
    """``--out``, else the checkout's page; never a path inside an installed package."""
    if out is not None:
        if out.is_dir():
            raise UsageError(f"--out {out} is a directory; name the page's file")
        return out
    if not DOC.parent.is_dir():
        raise UsageError(f"--out: hylinker runs from an installed package ({DOC.parent.parent}), which has "
                         "no docs/ folder; give the page's path, e.g. --out configuration.md")
    return DOC


def run(args: argparse.Namespace) -> int:
    out = _page(args.out)
    text = render()
    if args.check:
        if not out.is_file():
            raise UsageError(f"--check: no such file {out} to compare (without --check the command writes it)")
        if out.read_text() != text:
            print(f"{out} is stale: run `python -m hylinker config-doc`", file=sys.stderr)
            return 1
        return 0
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: no such folder {out.parent}")
    out.write_text(text)
    print(f"wrote {out}")
    return 0


__all__ = ["DOC", "HELP", "SECTIONS", "configure", "field_comments", "render", "run"]
