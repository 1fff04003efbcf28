"""``hylinker soak`` (issue 53): the growth rule flags what grows and passes what is flat; a short
soak of the Linker front and of the data plane's held-out loop runs flat, every restore right.

The soaks are marked slow (each about 20-25 s on two cores); the rule's tests are not.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import pytest

from hylinker.tools import cli
from hylinker.tools.soak_measure import TOLERANCES, Sample, Sampler, Tolerance, growth, report


def _samples(values: list[float], metric: str = "rss_mib") -> list[Sample]:
    return [Sample(float(i), i, {metric: v}) for i, v in enumerate(values)]


def test_growth_rule_flags_growth_beyond_the_tolerance_after_the_warm_up() -> None:
    warm = [100.0 + 10 * i for i in range(10)]  # the warm-up may grow
    flat = warm + [200.0 + (i % 3) for i in range(40)]
    leak = warm + [200.0 + i for i in range(40)]  # +1 MiB a sample: 32 MiB from first to last fifth
    (g,) = growth(_samples(flat), warmup_s=10)
    assert not g.grew and g.allowed == 16
    (g,) = growth(_samples(leak), warmup_s=10)
    assert g.grew and g.last - g.first == 32
    (g,) = growth(_samples(leak), warmup_s=10, tolerances={"rss_mib": Tolerance(40.0)})
    assert not g.grew
    text, grew = report(_samples(leak), 10, [], {"requests": 1})
    assert grew and "GREW" in text


def test_too_few_samples_after_the_warm_up_is_not_flat() -> None:
    # a sampler starved after the warm-up (one sample left) must not read as "nothing grew"
    text, grew = report(_samples([100.0] * 10), 9.5, [], {})
    assert grew and "cannot be judged" in text


def test_threads_and_descriptors_have_no_tolerance() -> None:
    assert TOLERANCES["threads"].allowed(10) == TOLERANCES["fds"].allowed(10) == 0
    (g,) = growth(_samples([5.0] * 10 + [6.0] * 10, "fds"), warmup_s=0)
    assert g.grew


def test_sampler_sees_this_process_grow(tmp_path: Path) -> None:
    sampler = Sampler(0.0)
    held: list[mmap.mmap] = []
    for i in range(30):
        held.append(mmap.mmap(-1, 2 << 20))  # 2 MiB a sample of new pages, touched: resident
        for page in range(0, 2 << 20, 4096):
            held[-1][page] = 1
        sampler.take(i, {})
    (rss,) = [g for g in growth(sampler.samples, warmup_s=0) if g.metric == "rss_mib"]
    assert rss.grew and rss.last - rss.first > 30


@pytest.mark.slow
def test_linker_soak_is_flat_and_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    status = cli.main(["soak", "--front", "linker", "--minutes", "0.35", "--interval-s", "1",
                       "--concurrency", "4", "--kv-pages", "256", "--store-kib", "256",
                       "--restart-every-s", "14", "--outage-s", "1", "--warmup-s", "8", "--json", str(out)])
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert status == 0, text
    s = result["summary"]
    assert s["requests"] > 50 and s["restarts"] >= 1 and s["wrong_prefixes"] == 0 and not s["errors"]
    assert s["store_hit"] > 0 and s["evictions"] > 0, json.dumps(s)
    assert s["failed_keys"] > 0 and s["unavailable_calls"] > 0  # the faults were on
    last = result["samples"][-1]
    assert 0 < last["diag_kib"] <= 4096  # the eviction memory holds keys, within its budget


@pytest.mark.slow
def test_dataplane_soak_keeps_nothing_per_iteration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    status = cli.main(["soak", "--front", "dataplane", "--iterations", "1500", "--interval-s", "1",
                       "--warmup-s", "3", "--json", str(out)])
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert status == 0, text
    assert result["summary"]["failed_transfers"] == 0 and result["summary"]["evictions"] > 1000
    tasks = [s["tasks"] for s in result["samples"]]
    assert max(tasks) - min(tasks) <= 2  # the plane's own, and at most the last transfer's ending


def test_iterations_apply_to_the_dataplane_front_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["soak", "--front", "linker", "--iterations", "10"]) == 2
    assert "--iterations applies to --front dataplane only" in capsys.readouterr().err
