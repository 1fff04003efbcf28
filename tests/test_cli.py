"""Every user-facing tool is a ``hylinker`` subcommand, and a passed-on one gets its arguments as given."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hylinker.tools import cli

TOOLS = Path(cli.__file__).parent
#: modules with an entry point that are not user-facing: the CLI itself and a child process's entry
CHILD_ENTRIES = {"cli", "fleet_bench"}


def _entry_points() -> set[str]:
    out = set()
    for path in TOOLS.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if "main" in names or {"configure", "run"} <= names:
            out.add(path.stem)
    return out - CHILD_ENTRIES


def test_every_tool_with_an_entry_point_is_a_subcommand() -> None:
    reachable = set(cli.COMMANDS.values()) | {module for module, _ in cli.PASSED_ON.values()}
    assert _entry_points() - reachable == set()
    assert not set(cli.COMMANDS) & set(cli.PASSED_ON)


def test_the_parser_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listed = capsys.readouterr().out
    for name in (*cli.COMMANDS, *cli.PASSED_ON):
        assert name in listed


def test_a_passed_on_subcommand_gets_its_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "keys.json"
    assert cli.main(["bench-keys", "--tokens", "1024", "--pages", "16", "--repeats", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())  # the module parsed --json: its figures are there
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench-keys", "--no-such-option"])
    assert exc.value.code == 2
    assert "hylinker bench-keys" in capsys.readouterr().err
