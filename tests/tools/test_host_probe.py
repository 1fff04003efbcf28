"""Every data-path figure records its host (``tools/bench/host.py``): the probe's fields, and
the benchmarks' JSON carrying them."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from hylinker.tools.bench import paths as bench
from hylinker.tools.bench.host import describe, finish, host_record, memcpy_gbps
from hylinker.tools.lab import checksum as bench_checksum


def test_host_record_has_cores_a_measured_memcpy_and_the_load() -> None:
    rec = host_record()
    assert rec["cores"] == os.cpu_count() and 1 <= rec["usable_cores"] <= rec["cores"]
    assert rec["memcpy_gbps"] > 0 and len(rec["load_average"]) == 3
    end = finish(rec)
    assert end["load_average_end"] >= 0 and "load_average_end" not in rec
    assert "memcpy" in describe(end) and "->" in describe(end)
    assert memcpy_gbps(1 << 20, repeats=2) > 0


def test_bench_json_carries_the_host(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--only", "facade", "--quick", "--json", str(out)])
    assert bench.run(args) == 0
    host = json.loads(out.read_text())["host"]
    assert {"cores", "memcpy_gbps", "load_average", "load_average_end"} <= set(host)


def test_checksum_bench_json_carries_the_host(tmp_path: Path) -> None:
    out = tmp_path / "checksum.json"
    assert bench_checksum.main(["--object-bytes", str(64 << 10), "--total-mib", "1", "--rounds", "1",
                                "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["host"]["memcpy_gbps"] > 0 and data["checksum_cost"]


def test_integrity_levels_bench_compares_both_levels_with_the_raw_store(tmp_path: Path) -> None:
    """``--only levels``: both levels and the raw store side by side, per store, size and
    direction, with the host beside them."""
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    out = tmp_path / "levels.json"
    args = parser.parse_args(["--only", "levels", "--quick", "--rounds", "1", "--mooncake", "no", "--json", str(out)])
    assert bench.run(args) == 0
    data = json.loads(out.read_text())
    rows = data["integrity_levels"]
    assert {(r["store"], r["object_bytes"], r["segments"], r["direction"]) for r in rows} == {
        ("embedded", size, segments, d) for size, segments in ((64 << 10, 1), (1 << 20, 1), ((768 << 10) + 64, 24))
        for d in ("put", "get")}
    assert all(r["checksum_gbps"] > 0 and r["header_gbps"] > 0 and r["header_vs_raw"] > 0 for r in rows)
    assert "data_path" not in data and data["host"]["memcpy_gbps"] > 0


def test_object_steps_bench_times_every_step_at_both_sizes(tmp_path: Path) -> None:
    """``--only steps``: every step of the host data path, per object, at 64 KiB and 1 MiB, with
    the host beside them (the figures are timing: only their presence is checked here)."""
    from hylinker.tools.bench.steps import STEP_NOTES, object_steps

    parser = argparse.ArgumentParser()
    bench.configure(parser)
    out = tmp_path / "steps.json"
    assert bench.run(parser.parse_args(["--only", "steps", "--quick", "--json", str(out)])) == 0
    data = json.loads(out.read_text())
    assert [r["object_bytes"] for r in data["object_steps"]] == [64 << 10, 1 << 20]
    for row in data["object_steps"]:
        assert set(row["us_per_object"]) == set(STEP_NOTES)
        assert all(v > 0 for v in row["us_per_object"].values())
    assert data["host"]["memcpy_gbps"] > 0
    with pytest.raises(ValueError, match="header"):
        object_steps(64)
