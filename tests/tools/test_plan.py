"""``hylinker plan`` against the stress run it predicts (issue 44, item 4).

Tolerance: 0.06 of hit rate, absolute. The model replays one request at a time through LRU
page and state caches; the stress run overlaps requests, evicts the device tree by nodes and
donates branch-point states (tools/plan.py's docstring lists what it leaves out)."""

from __future__ import annotations

import json
from pathlib import Path

from hylinker.tools.cli import main

TOLERANCE = 0.06
WORKLOAD = ["--workload-param", "sessions_per_hour=120", "--synthetic-scale", "0.05", "--requests", "300"]


def test_the_prediction_matches_a_stress_run_at_two_store_sizes(tmp_path: Path) -> None:
    plan_json = tmp_path / "plan.json"
    sizes_mb = (12, 512)
    rc = main(["plan", *WORKLOAD, "--store-gib", ",".join(str(m / 1024) for m in sizes_mb), "--tp", "1",
               "--kv-pages", "1024", "--mamba-slots", "48", "--concurrency", "4", "--json", str(plan_json)])
    assert rc == 0
    predicted = {(r["store_bytes"] >> 20, r["touch"]): r for r in json.loads(plan_json.read_text())}
    for mb in sizes_mb:
        out = tmp_path / f"stress{mb}.json"
        rc = main(["stress", "--no-progress", "--workload", "production", *WORKLOAD, "--store-capacity-mb", str(mb),
                   "--kv-pages", "1024", "--mamba-slots", "48", "--concurrency", "4", "--json", str(out)])
        s = json.loads(out.read_text())
        assert rc == 0 and s["restore_mismatches"] == 0
        p = predicted[(mb, True)]
        assert abs(p["hit_rate"] - s["hit_rate"]) <= TOLERANCE, (mb, p["hit_rate"], s["hit_rate"])
    assert predicted[(12, True)]["fill_s"] is not None and predicted[(512, True)]["fill_s"] is None


def test_the_plot_draws_coinciding_settings_once_and_shows_the_differences(tmp_path: Path) -> None:
    """Settings predicting the same curve are one line whose legend names them all; the rest
    differ in line style or marker; the y range is the data's, the x ticks the store sizes."""
    from hylinker.tools.plan import GIB, Prediction, plot

    def row(size_gib: float, tp: int, touch: bool, once: bool, rate: float) -> Prediction:
        return Prediction(store_bytes=int(size_gib * GIB), tp=tp, touch=touch, kv_once=once, hit_rate=rate,
                          store_hit_tokens=0, device_hit_tokens=0, bytes_per_cached_token=0.0, fill_s=None,
                          written_bytes=0, restored_bytes=0)

    rows = [row(s, tp, True, True, r) for tp in (1, 8) for s, r in ((0.5, 0.88), (1, 0.90))]  # coincide
    rows += [row(s, 8, False, True, r) for s, r in ((0.5, 0.87), (1, 0.89))]
    rows += [row(s, 8, True, False, r) for s, r in ((0.5, 0.86), (1, 0.885))]
    fig = plot(str(tmp_path / "plan.png"), rows, title="a title")
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["TP 1 and 8, TOUCH on, KV once on", "TP 8, TOUCH on, KV once off",
                      "TP 8, TOUCH off, KV once on"]
    styles = {(str(line.get_linestyle()), line.get_marker()) for line in ax.get_lines()}
    assert len(styles) == 3
    assert ax.get_title() == "a title"
    low, high = ax.get_ylim()
    assert 0.84 < low < 0.86 and 0.90 < high < 0.92
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.5", "1"]
    assert (tmp_path / "plan.png").stat().st_size > 0
