"""``hylinker study``: its own flags only, ``--json`` and ``--plot`` written, each row printed once
in tables that fit 100 columns."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hylinker.tools import cli


def _study_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["study"]


def test_the_study_lists_only_its_own_flags() -> None:
    text = _study_parser().format_help()
    for own in ("--capacities-mb", "--policies", "--evictions", "--json", "--plot", "--trace", "--store-capacity-mb"):
        assert own in text
    for other in ("--chaos", "--soak-seconds", "--ranks", "--replicated", "--no-progress"):
        assert other not in text
    assert _study_parser().parse_args(["sweep", "--study-json", "x.json"]).json == Path("x.json")  # the old name


def test_a_study_writes_its_json_and_plot_and_prints_each_row_once(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "study.json", tmp_path / "study.png"
    assert cli.main(["study", "admission", "--requests", "30", "--synthetic-scale", "0.05", "--policies", "end,marconi",
                     "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["end", "marconi"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = printed.splitlines()
    assert max(map(len, lines)) <= 100, printed
    header = [i for i, line in enumerate(lines) if line.startswith("policy") and "of bound" in line]
    assert len(header) == 1, printed  # one table, not one per row and another at the end
    main_table = lines[header[0] + 2: lines.index("", header[0])]
    assert [line.split()[0] for line in main_table] == ["end", "marconi"]


def test_a_bad_capacity_list_is_one_line() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["study", "sweep", "--capacities-mb", "64,0"])
    assert exc.value.code == 2
