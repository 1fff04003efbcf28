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


def test_the_device_pool_sweep_runs_each_workload_pool_and_seed(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "pools.json", tmp_path / "pools.png"
    assert cli.main(["study", "device-pool", "--requests", "20", "--synthetic-scale", "0.05",
                     "--kv-pages-list", "4096,512", "--seeds", "0", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [(r["workload"], r["kv_pages"], r["seed"]) for r in data["rows"]] == [
        ("agentic", 4096, 0), ("agentic", 512, 0), ("mooncake", 4096, 0), ("mooncake", 512, 0)]
    for row in data["rows"]:
        assert {"of_bound", "offloads_skipped_kv", "load_misses", "load_waits", "load_waits_recomputed"} <= set(row)
        # the two-stage offload's count (it was "n/a" before host staging existed)
        assert isinstance(row["host_staging_full"], int) and row["host_staging_full"] >= 0
        assert row["mismatches"] == 0 and row["leaks"] == 0
    assert [(p["workload"], p["kv_pages"], p["runs"]) for p in data["points"]] == [
        ("agentic", 4096, 1), ("agentic", 512, 1), ("mooncake", 4096, 1), ("mooncake", 512, 1)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert max(len(line) for line in printed.splitlines() if not line.startswith("wrote ")) <= 100, printed
    assert "per point" in printed and "stg full" in printed


def test_the_device_pool_points_average_the_seeds_of_each_series() -> None:
    from hylinker.tools.pool_sweep import points

    def row(kv: int, ratio: float, skipped: int, series: str = "") -> dict[str, object]:
        return {"series": series, "workload": "agentic", "kv_pages": kv, "of_bound": ratio,
                "offloads_skipped_kv": skipped, "load_misses": 0, "load_waits": 2, "load_waits_recomputed": 0,
                "host_staging_full": "n/a"}

    got = points([row(256, 0.6, 10), row(256, 0.8, 20), row(4096, 1.0, 0), row(256, 0.5, 30, series="before")])
    assert [(p["series"], p["kv_pages"]) for p in got] == [("", 4096), ("", 256), ("before", 256)]
    p = got[1]
    assert (p["runs"], p["of_bound"], p["of_bound_min"], p["of_bound_max"]) == (2, 0.7, 0.6, 0.8)
    assert (p["offloads_skipped_kv"], p["host_staging_full"]) == (15.0, "n/a")


def test_the_device_pool_points_average_the_fitting_share_where_the_runs_have_it() -> None:
    from hylinker.tools.pool_sweep import points, pool_row

    rows = [pool_row({"of_bound_fit": fit}, {"workload": "agentic", "kv_pages": 256, "of_bound": 0.5})
            for fit in (0.9, 1.0)]
    assert rows[0]["of_bound_fit"] == 0.9 and points(rows)[0]["of_bound_fit"] == 0.95
    old = pool_row({}, {"workload": "agentic", "kv_pages": 256, "of_bound": 0.5})  # a run from before it existed
    assert points([old])[0]["of_bound_fit"] == "n/a"


def test_a_bad_page_list_is_one_line() -> None:
    assert _study_parser().parse_args(["device-pool", "--kv-pages-list", "derived,512"]).kv_pages_list == [None, 512]
    with pytest.raises(SystemExit) as exc:
        cli.main(["study", "device-pool", "--kv-pages-list", "512,0"])
    assert exc.value.code == 2
