"""The stress tool end to end: real runtime, real stores, synthetic forward, every restore checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hylinker.components.pools import HybridPools
from hylinker.testing.content import SyntheticContent, preset_layout
from hylinker.tools.cli import main
from hylinker.tools.report import LOSS_COLUMNS, stress_row
from hylinker.tools.traces import mooncake_trace

TRACE = mooncake_trace()

SUMMARY_KEYS = {
    "requests", "prompt_tokens", "device_hit_tokens", "store_hit_tokens", "hit_rate",
    "bound_hit_rate", "restores_verified", "restore_mismatches", "leaked_rows", "leaked_slots",
    "locked_nodes_at_end", "offloads_skipped_mamba", "offloads_dropped", "bytes_offloaded",
    "bytes_loaded", "latency_ms", "loop_lag_ms",
}


def _run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "stress.json"
    rc = main(["stress", "--no-progress", "--json", str(out), *extra])
    summary = json.loads(out.read_text())
    assert rc == 0, summary
    return summary


def _assert_clean(s: dict[str, Any]) -> None:
    assert s["restore_mismatches"] == 0
    assert s["leaked_rows"] == 0
    assert s["leaked_slots"] == 0
    assert s["locked_nodes_at_end"] == 0
    assert s["idle_check_failed"] == 0


def test_short_stress_with_faults_is_exact_and_leak_free(tmp_path: Path) -> None:
    s = _run(tmp_path, "--requests", "120", "--synthetic-scale", "0.1", "--kv-pages", "1024",
             "--mamba-slots", "24", "--fault-rate", "0.05", "--seed", "3")
    assert set(s) >= SUMMARY_KEYS
    _assert_clean(s)
    # the run really used the store and really met faults
    assert s["store_hit_tokens"] > 0
    assert s["restores_verified"] > 0
    assert s["dropped_loads"] + s["offload_failures"] > 0
    assert 0 < s["hit_rate"] <= s["bound_hit_rate"] + 1e-9
    assert set(s["bytes_offloaded"]) == {"kv", "mamba", "draft"}
    assert s["bytes_offloaded"]["mamba"] > 0 and s["bytes_loaded"]["kv"] > 0


def test_every_loss_is_in_the_json_the_table_and_the_study_rows(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    s = _run(tmp_path, "--requests", "40", "--synthetic-scale", "0.05", "--fault-rate", "0.1")
    out = capsys.readouterr().out
    assert set(s) >= {key for key, _ in LOSS_COLUMNS} | {"of_bound", "alloc_waits", "causal_waits"}
    assert "hit rate / bound (infinite cache) = of bound" in out
    assert f"{s['hit_rate']:.1%} / {s['bound_hit_rate']:.1%}" in out
    for phrase in ("alloc retries / failures (dropped) / never fit / rejected",
                   "loads: allocation misses / dropped -> recomputed",
                   "offloads (skipped / dropped / failed)"):
        assert phrase in out
    row = stress_row(s, policy="marconi")
    assert set(row) >= {key for key, _ in LOSS_COLUMNS} | {"of_bound", "states_stored", "stored_bytes_per_hit_token"}
    assert row["dropped_loads"] == s["dropped_loads"] and row["of_bound"] == s["of_bound"]


def test_fault_plan_from_the_command_line(tmp_path: Path) -> None:
    s = _run(tmp_path, "--requests", "60", "--synthetic-scale", "0.1", "--kv-pages", "256",
             "--mamba-slots", "24", "--faults", "corrupt=0.3,vanish=0.1")
    _assert_clean(s)
    assert s["dropped_loads"] > 0  # corrupt and vanished objects were caught, then recomputed


def test_a_bad_fault_plan_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["stress", "--no-progress", "--requests", "2", "--faults", "melt=0.5"])
    assert exc.value.code == 2
    assert "argument --faults: unknown fault plan field 'melt'" in capsys.readouterr().err


def test_plain_attention_preset(tmp_path: Path) -> None:
    s = _run(tmp_path, "--preset", "attention", "--requests", "80", "--synthetic-scale", "0.1",
             "--kv-pages", "48")
    _assert_clean(s)
    assert s["bytes_offloaded"]["mamba"] == 0 and s["store_hit_tokens"] > 0


def test_trace_replay_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "stress.png"
    s = _run(tmp_path, "--trace", str(TRACE), "--requests", "40", "--kv-pages", "4096",
             "--plot", str(png))
    _assert_clean(s)
    assert s["requests"] == 40
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("preset", ["kimi", "attention"])  # an fp8 KV pool with states; bf16 pages only
def test_content_detects_a_swapped_page_a_one_byte_flip_and_another_seed(preset: str) -> None:
    import torch

    layout = preset_layout(preset)
    pools = HybridPools(layout, kv_pages=8, mamba_slots=2)
    content = SyntheticContent(pools)
    P = layout.page_size
    keys = [bytes([i]) * 16 for i in range(1, 4)]
    rows = torch.arange(3 * P)
    content.write_pages(keys, rows)
    assert content.pages_match(keys, rows) == []
    swapped = torch.cat([rows[P:2 * P], rows[:P], rows[2 * P:]])
    assert content.pages_match(keys, swapped) == [0, 1]
    pools.kv.tensor.view(torch.uint8)[0, 2 * P + 5].view(-1)[0] ^= 1  # one bit of page 2
    assert content.pages_match(keys, rows) == [2]
    assert SyntheticContent(pools, seed=1).pages_match(keys[:2], rows[:2 * P]) == [0, 1]
    with pytest.raises(ValueError, match="rows"):
        content.pages_match(keys, rows[:P])
    if layout.is_hybrid:
        content.write_state(keys[0], 0)
        assert content.state_matches(keys[0], 0)
        assert not content.state_matches(keys[1], 0)
        assert not SyntheticContent(pools, seed=1).state_matches(keys[0], 0)


@pytest.mark.mooncake
def test_short_stress_on_mooncake(tmp_path: Path, mooncake_master: object) -> None:
    address = mooncake_master.address  # type: ignore[attr-defined]
    s = _run(tmp_path, "--store", "mooncake", "--mooncake-master", address, "--requests", "60",
             "--synthetic-scale", "0.1", "--kv-pages", "1024", "--mamba-slots", "24",
             "--store-capacity-mb", "256")
    _assert_clean(s)
    assert s["store_hit_tokens"] > 0


def test_a_slow_store_with_declines_on_gives_up_hits_and_reports_time_to_first_token(tmp_path: Path) -> None:
    """A store 20 ms per call against a modelled prefill no load can beat (10^9 tokens/s, so the
    outcome does not hang on this machine's timing): with the check on, every store hit after the
    first load (which measures the bandwidth) is declined, counted and recomputed, and the run
    stays exact; off, none is. One request at a time: the store hits do not hang on timing."""
    common = ("--requests", "200", "--synthetic-scale", "0.1", "--kv-pages", "160", "--concurrency", "1", "--no-soak",
              "--faults", "latency_ms=20", "--prefill-tokens-per-s", "1e9")
    off = _run(tmp_path, *common)
    on = _run(tmp_path, *common, "--decline-slow-restores")
    for s in (off, on):
        _assert_clean(s)
        assert s["latency_ms"]["ttft"]["p50"] > 0
    assert off["declined_lookups"] == 0 and off["store_hit_tokens"] > 0
    assert on["declined_lookups"] > 0 and on["declined_hit_tokens"] > 0
    assert on["store_hit_tokens"] < off["store_hit_tokens"] / 10  # declined hits recompute


def test_the_hits_over_time_end_at_the_summary_and_the_bound_evolves() -> None:
    """One sample per finished request: device and store hits and the bound, each over the
    finished requests' prompt tokens; the last sample is the summary's (what stress.png draws)."""
    import anyio

    from hylinker.stores.embedded import EmbeddedStore
    from hylinker.tools.stress.run import MIB, StressConfig, StressResult, StressRun
    from hylinker.tools.workloads import synthetic_agentic

    requests = synthetic_agentic(60, seed=1, scale=0.05)
    async def replay() -> StressResult:
        store = EmbeddedStore(256 * MIB)
        try:
            return await StressRun(StressConfig(kv_pages=256, mamba_slots=24), store, requests).run(False)
        finally:
            await store.close()

    result = anyio.run(replay)
    s, samples = result.summary, result.hits_over_time
    assert len(samples) == len(requests)
    assert [x.seconds for x in samples] == sorted(x.seconds for x in samples)
    last = samples[-1]
    assert last.bound == pytest.approx(s["bound_hit_rate"], abs=1e-4)
    assert last.device + last.store == pytest.approx(s["hit_rate"], abs=1e-4)
    assert last.store * s["prompt_tokens"] == pytest.approx(s["store_hit_tokens"])
    assert len({round(x.bound, 6) for x in samples}) > 5  # drawn as it evolves, not the end value
