"""Every user-facing tool is a ``hylinker`` subcommand, a passed-on one gets its arguments as given,
a user's mistake is one line on stderr and a failure, and every stress option says its default."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hylinker.tools import cli

TOOLS = Path(cli.__file__).parent
#: modules with an entry point that are not user-facing: the CLI itself and child processes' entries
CHILD_ENTRIES = {"cli", "fleet_bench", "harness.vllm_runner", "harness.fleet_engine"}
#: benchmark modules `hylinker bench --only keys|calls` runs, also runnable alone with python -m
#: (calls: --store mooncake); the investigations of tools/lab/ are runnable from a checkout only
RUN_ALONE = {"bench.keys", "bench.calls"}


def _entry_points() -> set[str]:
    out = set()
    for path in TOOLS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if "main" in names or {"configure", "run"} <= names:
            out.add(".".join(path.relative_to(TOOLS).with_suffix("").parts))
    return {m for m in out - CHILD_ENTRIES - RUN_ALONE if not m.startswith("lab.")}


def test_every_tool_with_an_entry_point_is_a_subcommand() -> None:
    reachable = set(cli.COMMANDS.values()) | {module for module, _ in cli.PASSED_ON.values()}
    assert _entry_points() - reachable == set()
    assert not set(cli.COMMANDS) & set(cli.PASSED_ON)


def test_the_lab_stays_out_of_the_wheel_and_the_help() -> None:
    lab = sorted((TOOLS / "lab").glob("*.py"))
    assert lab, "tools/lab/ holds the investigations"
    assert not (TOOLS / "lab" / "__init__.py").exists()  # no package: pyproject's packages leave it out
    reachable = set(cli.COMMANDS.values()) | {module for module, _ in cli.PASSED_ON.values()}
    assert not {m for m in reachable if m.startswith("lab.")}
    for path in lab:  # each runs alone from a checkout
        assert 'if __name__ == "__main__":' in path.read_text(), path.name


def test_the_parser_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listed = capsys.readouterr().out
    for name in (*cli.COMMANDS, *cli.PASSED_ON):
        assert name in listed


def test_a_passed_on_subcommand_gets_its_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # every passed-on subcommand left needs an engine's virtualenv: the key-hashing benchmark (a
    # real module with its own parser, run by `hylinker bench --only keys`) stands in for one
    monkeypatch.setitem(cli.PASSED_ON, "bench-keys", ("bench.keys", "key hashing"))
    out = tmp_path / "keys.json"
    assert cli.main(["bench-keys", "--tokens", "1024", "--pages", "16", "--repeats", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())  # the module parsed --json: its figures are there
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench-keys", "--no-such-option"])
    assert exc.value.code == 2
    assert "python -m hylinker.tools.bench.keys" in capsys.readouterr().err


def _broken_trace(tmp_path: Path) -> str:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n{"timestamp": 1,\n')
    return str(path)


#: (arguments after `hylinker stress --no-progress`, what the one line must name)
USER_MISTAKES: dict[str, tuple[list[str], str]] = {
    "kv-pages 0": (["--kv-pages", "0", "--requests", "50"], "--kv-pages"),
    "kv-pages 1, nothing fits": (["--kv-pages", "1", "--requests", "50"], "--kv-pages"),
    "broken trace line": (["--trace", "BROKEN"], "broken.jsonl:2"),
    "requests -5": (["--requests", "-5"], "--requests"),
    "requests 0": (["--requests", "0"], "--requests"),
    "store capacity 0": (["--store-capacity-mb", "0", "--requests", "5"], "--store-capacity-mb"),
    "concurrency 0": (["--concurrency", "0", "--requests", "5"], "--concurrency"),
    "master not listening": (["--store", "mooncake", "--mooncake-master", "127.0.0.1:1", "--requests", "5"],
                             "--mooncake-master"),
    "master nonsense": (["--store", "mooncake", "--mooncake-master", "nonsense", "--requests", "5"],
                        "--mooncake-master"),
    "trace is a directory": (["--trace", "DIR"], "--trace"),
    "trace missing": (["--trace", "DIR/none.jsonl"], "--trace"),
    "unknown fault field": (["--faults", "melt=0.5", "--requests", "2"], "--faults"),
    "fault rate past 1": (["--fault-rate", "1.5", "--requests", "2"], "--fault-rate"),
}


@pytest.mark.parametrize("case", list(USER_MISTAKES))
def test_a_users_mistake_is_one_line_on_stderr_and_a_failure(case: str, tmp_path: Path) -> None:
    """Through ``python -m hylinker``, as a user runs it: no traceback, one line naming the flag
    (or the file and line), a non-zero exit."""
    args, names = USER_MISTAKES[case]
    args = [_broken_trace(tmp_path) if a == "BROKEN" else a.replace("DIR", str(tmp_path)) for a in args]
    proc = subprocess.run([sys.executable, "-m", "hylinker", "stress", "--no-progress", *args],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0, proc.stdout
    assert len(lines) == 1, proc.stderr
    assert names in lines[0] and lines[0].startswith("hylinker stress: error: ")


def test_every_stress_option_has_help_with_its_default() -> None:
    parser = cli.build_parser()
    stress = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["stress"]
    text = stress.format_help()
    for action in stress._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings} has no help"
        if action.default not in (None, False):
            assert f"(default: {action.default})" in " ".join(text.split()), action.option_strings


#: (argv, what the one line must name, modules that do not import for the case): every
#: subcommand's ordinary mistakes, a missing optional package among them, each found before the
#: run does its work
SUBCOMMAND_MISTAKES: dict[str, tuple[list[str], str, tuple[str, ...]]] = {
    "plan trace missing": (["plan", "--trace", "DIR/none.jsonl"], "--trace", ()),
    "soak plot-from not a soak's json": (["soak", "--plot-from", "BROKEN", "--plot", "DIR/x.png"], "--plot-from", ()),
    "soak plot-from without plot": (["soak", "--plot-from", "DIR/none.json"], "--plot", ()),
    "plan broken trace line": (["plan", "--trace", "BROKEN"], "broken.jsonl:2", ()),
    "plan misspelled workload field": (["plan", "--workload-param", "hors=1"], "did you mean 'hours'", ()),
    "plan workload param without =": (["plan", "--workload-param", "hours"], "--workload-param", ()),
    "plan store size 0": (["plan", "--store-gib", "0,1"], "--store-gib", ()),
    "plan tp not a number": (["plan", "--tp", "one"], "--tp", ()),
    "plan requests 0": (["plan", "--requests", "0"], "--requests", ()),
    "plan --plot without matplotlib": (["plan", "--requests", "5", "--plot", "DIR/p.png"], "matplotlib",
                                       ("matplotlib",)),
    "stress --plot without matplotlib": (["stress", "--requests", "5", "--plot", "DIR/p.png"], "--plot",
                                         ("matplotlib",)),
    "stress --store umbp without mori": (["stress", "--store", "umbp", "--requests", "5", "--no-progress"],
                                         "--store umbp", ("mori", "mori.umbp")),
    "study --plot without matplotlib": (["study", "sweep", "--plot", "DIR/p.png"], "--plot", ("matplotlib",)),
    "study misspelled policy": (["study", "admission", "--policies", "marconni"], "did you mean 'marconi'", ()),
    "bench rounds 0": (["bench", "--rounds", "0"], "--rounds", ()),
    "bench --mooncake yes without Mooncake": (["bench", "--mooncake", "yes"], "--mooncake yes",
                                              ("mooncake", "mooncake.store")),
    "demo without transformers": (["demo"], "transformers", ("transformers",)),
    "demo turns 0": (["demo", "--turns", "0"], "--turns", ()),
    "demo --store mooncake without Mooncake": (["demo", "--store", "mooncake"], "mooncake",
                                               ("mooncake", "mooncake.store")),
    "fleet without Mooncake": (["fleet"], "mooncake", ("mooncake", "mooncake.store")),
    "fleet misspelled fault": (["fleet", "--faults", "partiton"], "did you mean 'partition'", ()),
    "fleet one host": (["fleet", "--hosts", "1"], "--hosts", ()),
    "mooncake up without Mooncake": (["mooncake", "up"], "mooncake", ("mooncake", "mooncake.store")),
    "mooncake segment size 0": (["mooncake", "segment", "--segment-mib", "0", "--master", "127.0.0.1:1"],
                                "--segment-mib", ()),
    "mooncake segment master not listening": (["mooncake", "segment", "--master", "127.0.0.1:1",
                                               "--segment-mib", "8"], "--master", ()),
    "config-doc --check of a missing file": (["config-doc", "--check", "--out", "DIR/none.md"], "--check", ()),
    "config-doc --out a directory": (["config-doc", "--out", "DIR"], "--out", ()),
    "bench-sglang without SGLang": (["bench-sglang"], "sglang", ("sglang",)),
    "bench-vllm without vLLM": (["bench-vllm"], "vllm", ("vllm",)),
    "serve-demo without vLLM": (["serve-demo"], "vllm", ("vllm",)),
}


@pytest.mark.parametrize("case", list(SUBCOMMAND_MISTAKES))
def test_each_subcommands_mistakes_are_one_line_and_exit_2(case: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """In process (a traceback would fail the test as an exception): exit 2 and one line on
    stderr, ``hylinker CMD: error: ...``, naming the flag, file or package."""
    args, names, missing = SUBCOMMAND_MISTAKES[case]
    for module in missing:  # `import module` raises ModuleNotFoundError, as where it is not installed
        monkeypatch.setitem(sys.modules, module, None)
    args = [_broken_trace(tmp_path) if a == "BROKEN" else a.replace("DIR", str(tmp_path)) for a in args]
    rc: int | str | None
    try:
        rc = cli.main(args)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hylinker {args[0]}") and ": error: " in lines[0] and names in lines[0], lines[0]
    assert not list(tmp_path.glob("*.png")), "the run went on before failing"


def test_config_doc_never_writes_into_an_installed_package(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from hylinker.tools import config_doc

    installed = tmp_path / "site-packages" / "hylinker"
    installed.mkdir(parents=True)
    monkeypatch.setattr(config_doc, "DOC", installed / "docs" / "configuration.md")
    assert cli.main(["config-doc"]) == 2
    assert "--out" in capsys.readouterr().err
    assert not (installed / "docs").exists()
    page = tmp_path / "configuration.md"
    assert cli.main(["config-doc", "--out", str(page)]) == 0
    assert cli.main(["config-doc", "--check", "--out", str(page)]) == 0
    page.write_text(page.read_text().replace("| `store` |", "| `stor` |", 1))
    assert cli.main(["config-doc", "--check", "--out", str(page)]) == 1  # stale, not missing


def test_bench_auto_mode_skips_mooncake_where_it_does_not_import(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from hylinker.tools.bench.paths import data_path

    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    # no shape: the setups are built (Mooncake's attempted and skipped), nothing is timed
    assert data_path(True, "auto", rounds=1, shapes=()) == []
    assert "skipping Mooncake" in capsys.readouterr().out
