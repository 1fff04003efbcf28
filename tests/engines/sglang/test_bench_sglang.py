"""``hylinker bench-sglang`` (SGLang's cache with each linker over a real Mooncake master) writes its
host beside its figures, and the integrity level it ran the plugin at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.parametrize(("integrity", "stages"), [("checksum", 2), ("header", 1)])
def test_bench_sglang_json_carries_the_host_and_the_level(tmp_path: Path, integrity: str, stages: int) -> None:
    from hylinker.tools.bench import sglang as bench_sglang

    out = tmp_path / "sglang.json"
    assert bench_sglang.main(["--object-kib", "64", "--tokens", "4", "--repeats", "1", "--linkers", "hylinker",
                              "--integrity", integrity, "--stages", str(stages), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"cores", "memcpy_gbps", "load_average", "load_average_end"} <= set(data["host"])
    (row,) = data["results"]
    assert row["integrity"] == integrity and row["restore_mismatches"] == 0
    assert row["stages"] == stages
    # an offload is reported to SGLang (its rows unlocked) no later than the store has its bytes
    (held,), (stored,) = row["rows_held_ms_runs"], row["offload_ms_runs"]
    assert 0 < held <= stored


def test_the_segment_holds_every_timed_prompt() -> None:
    """Each repeat stores a new prompt and restores it afterwards: a segment too small for all
    of them evicts one before its restore (5 repeats of 256 x 1 MiB did, in a 1 GiB segment)."""
    from hylinker.tools.bench.sglang import _segment_mb

    assert _segment_mb(64, 48, 3) == 1024
    for kib, tokens, repeats in ((1024, 256, 5), (64, 4096, 8), (1024, 1024, 3)):
        assert _segment_mb(kib, tokens, repeats) << 20 >= (repeats + 2) * tokens * (kib << 10)
