"""Report helpers: tables, percentiles, progress output; and the plots (tools/plots.py)."""

from __future__ import annotations

import io
import math
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hylinker.tools.plots import plot_stress, plot_study
from hylinker.tools.report import ProgressBar, format_table, percentiles, progress_bar
from hylinker.tools.stress.run import HitSample


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_format_table_aligns_columns() -> None:
    rows = [
        {"phase": "load", "p50": 0.00123, "n": 12345, "ok": True},
        {"phase": "commit", "p50": 12.5, "n": 3},
    ]
    text = format_table(rows, ["phase", ("p50", "p50 (s)"), "n", "ok"])
    lines = text.splitlines()
    assert lines[0].split() == ["phase", "p50", "(s)", "n", "ok"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["load", "0.00123", "12,345", "true"]
    assert lines[3].split() == ["commit", "12.50", "3", "-"]  # missing value shown as '-'
    # numbers right-aligned: the numeric column ends at the same offset on every row
    n_col_end = lines[0].index(" n") + 2
    assert lines[2][:n_col_end].endswith("12,345")
    assert lines[3][:n_col_end].endswith("3")
    # strings left-aligned
    assert lines[2].startswith("load  ") and lines[3].startswith("commit")


def test_format_table_default_columns_and_errors() -> None:
    text = format_table([{"a": 1}, {"b": "x"}])
    assert text.splitlines()[0].split() == ["a", "b"]
    assert format_table([], ["a", "b"]).splitlines()[0].split() == ["a", "b"]
    with pytest.raises(TypeError, match="column"):
        format_table([{"a": 1}], [("a",)])  # type: ignore[list-item]


def test_percentiles() -> None:
    got = percentiles(range(1, 101), (50, 99, 100))
    assert got == {"p50": pytest.approx(50.5), "p99": pytest.approx(99.01), "p100": 100.0}
    assert percentiles(np.array([2.0, 4.0]), (50,)) == {"p50": 3.0}
    empty = percentiles([], (50, 99.9))
    assert set(empty) == {"p50", "p99.9"} and all(math.isnan(v) for v in empty.values())
    with pytest.raises(ValueError, match="percentiles"):
        percentiles([1.0], (101,))


def test_progress_silent_when_not_tty() -> None:
    out = io.StringIO()
    with progress_bar(5, desc="replay", stream=out) as bar:
        for _ in range(5):
            bar.update()
    assert bar.n == 5
    assert out.getvalue() == ""


@pytest.mark.parametrize("use_tqdm", [True, False])
def test_progress_forced_writes(use_tqdm: bool) -> None:
    out = io.StringIO()
    with ProgressBar(10, desc="replay", force=True, stream=out, use_tqdm=use_tqdm, interval_s=0.0) as bar:
        for _ in range(10):
            bar.update()
        bar.set_postfix(hit=0.37)
    text = out.getvalue()
    assert "replay" in text and "10/10" in text


def test_progress_plain_fallback_on_tty() -> None:
    out = _TTY()
    bar = ProgressBar(None, desc="x", stream=out, use_tqdm=False, interval_s=0.0)
    bar.update(3)
    bar.close()
    bar.close()  # idempotent
    assert out.getvalue().startswith("\rx: 3 it")
    assert out.getvalue().endswith("\n")


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND"
    return width, height


def _below_its_axes(fig: Any, ax: Any) -> bool:
    """The axes' legend lies wholly under the axes' data area."""
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend()
    return legend is not None and legend.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0


def test_the_stress_plot_draws_the_bound_as_it_evolves_and_the_hits_split(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.collections import PolyCollection

    path = tmp_path / "stress.png"
    samples = [HitSample(0.0, 0.1, 0.0, 0.2), HitSample(10.0, 0.2, 0.1, 0.4), HitSample(20.0, 0.2, 0.15, 0.37)]
    fig = plot_stress(str(path), samples,
                      {"lookup": [0.0002, 0.0004, 0.001], "load": [0.01, 0.02], "commit": []}, title="stress")
    width, height = _png_size(path.read_bytes())
    assert width > 500 and height > 200
    hits, latency = fig.axes
    areas = [c for c in hits.collections if isinstance(c, PolyCollection)]
    assert [str(a.get_label()).split(" (")[0] for a in areas] == ["device hits", "store hits"]
    (bound,) = [line for line in hits.get_lines() if line.get_label().startswith("infinite-cache bound")]
    assert list(bound.get_ydata()) == pytest.approx([20.0, 40.0, 37.0])  # as it evolves, not the end value
    assert _below_its_axes(fig, hits) and _below_its_axes(fig, latency)
    # empty inputs still give a valid figure
    empty = tmp_path / "empty.png"
    plot_stress(str(empty), [], {})
    _png_size(empty.read_bytes())


def _study_row(**variant: Any) -> dict[str, Any]:
    return {**variant, "hit_rate": 0.5, "bound_hit_rate": 0.6, "device_hit_tokens": 300, "store_hit_tokens": 200,
            "stored_bytes_per_hit_token": 10.0}


def test_the_study_plot_draws_each_touch_setting_and_each_policy(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [_study_row(capacity_mb=c, touch=t) for c in (64, 256) for t in (True, False)]
    fig = plot_study(str(tmp_path / "sweep.png"), "sweep", rows)
    hit, source = fig.axes
    assert {line.get_label() for line in hit.get_lines()} >= {"hit rate, TOUCH on", "hit rate, TOUCH off"}
    assert len(source.get_lines()) == 4  # store and device hits, TOUCH on and off
    assert _below_its_axes(fig, hit) and _below_its_axes(fig, source)
    fig = plot_study(str(tmp_path / "admission.png"), "admission", [_study_row(policy=p) for p in ("end", "grid")])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["end", "grid"]
    _png_size((tmp_path / "admission.png").read_bytes())


def test_plot_without_matplotlib_names_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"hylinker\[plot\]"):
        plot_stress(str(tmp_path / "x.png"), [], {})
    assert not (tmp_path / "x.png").exists()


def test_a_table_wider_than_its_width_is_cut_into_tables_that_repeat_the_key() -> None:
    rows = [{"name": f"row{i}", **{f"column_{c}": 1000 * c + i for c in range(12)}} for i in range(3)]
    text = format_table(rows, width=60, keep=1)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 60
    blocks = text.split("\n\n")
    assert len(blocks) > 1 and all(block.startswith("name") for block in blocks)
    shown = {h for block in blocks for h in block.splitlines()[0].split()}
    assert shown == {"name", *(f"column_{c}" for c in range(12))}
    assert format_table(rows, width=1000) == format_table(rows)
