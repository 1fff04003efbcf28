"""``bench_sglang`` (SGLang's cache with each linker over a real Mooncake master) writes its
host beside its figures, and the integrity level it ran the plugin at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.parametrize("integrity", ["checksum", "header"])
def test_bench_sglang_json_carries_the_host_and_the_level(tmp_path: Path, integrity: str) -> None:
    from hylinker.tools import bench_sglang

    out = tmp_path / "sglang.json"
    assert bench_sglang.main(["--object-kib", "64", "--tokens", "4", "--repeats", "1", "--linkers", "hylinker",
                              "--integrity", integrity, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"cores", "memcpy_gbps", "load_average", "load_average_end"} <= set(data["host"])
    (row,) = data["results"]
    assert row["integrity"] == integrity and row["restore_mismatches"] == 0
