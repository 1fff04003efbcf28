"""``hylinker soak`` (issue 53): the growth rule flags what grows and passes what is flat; a short
soak of the Linker front and of the data plane's held-out loop runs flat, every restore right.

The soaks are marked slow (each about 20-25 s on two cores); the rule's tests are not.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np
import pytest

from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import small_hybrid_layout, synthetic_prefill
from hylinker.tools import cli
from hylinker.tools.soak_fronts import PAGE, InFlight, in_flight
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


async def test_in_flight_accounts_for_every_lock_and_names_a_stray_one() -> None:
    # what the Linker front checks: pages and locks held beyond what requests and offloads in
    # flight account for. A lock nobody in flight holds (a leak) must show; an open request's
    # and an offload's must not.
    layout = small_hybrid_layout(page_size=PAGE, chunk_size=PAGE)
    pools = HybridPools(layout, kv_pages=64, mamba_slots=8)
    content = SyntheticContent(pools)
    store = EmbeddedStore(1 << 20)
    async with Linker(layout, pools, store, LinkerConfig(staging_bytes_per_pool=1 << 20)) as linker:
        tokens = np.arange(1, 4 * PAGE + 1, dtype=np.int32)
        req = linker.request("a", tokens)
        await linker.lookup(req)
        await synthetic_prefill(linker, content, req)
        assert linker.offloads.in_flight == 1 and linker.offloads.locked_nodes > 0  # not settled yet
        assert in_flight(linker).stray_locks == 0
        await linker.release(req)
        await linker.drain()
        assert in_flight(linker) == InFlight(0, 0)
        again = linker.request("b", np.concatenate([tokens, tokens]))
        found = await linker.lookup(again)  # stands on the cached path: locks it
        flight = in_flight(linker)
        assert found.device_tokens > 0 and not again.node.is_root
        assert flight.stray_locks == 0 and flight.pages == found.device_tokens // PAGE
        node = again.node
        linker.tree.lock(node)  # a leaked lock: no request or offload holds it
        assert in_flight(linker).stray_locks == 1
        linker.tree.unlock(node)
        await linker.release(again)
    await store.close()


@pytest.mark.slow
def test_linker_soak_is_flat_and_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    # --rate 0: as fast as the workers go, so offloads pile up in flight (what the checks must
    # tell from a leak) and the tiny store still serves hits within the short run
    status = cli.main(["soak", "--front", "linker", "--rate", "0", "--minutes", "0.35", "--interval-s", "1",
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
    assert s["idle_at_end"] == "yes"  # drained: nothing locked, open or leaked
    # checked by what the work in flight accounts for: nothing held beyond it, ever
    beyond = [(x["pages_beyond_in_flight"], x["locks_beyond_in_flight"]) for x in result["samples"]]
    assert set(beyond) == {(0, 0)}, beyond
    assert "tasks_beyond_in_flight" in text and "pool_held" in text.split("not checked")[1]


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


def _fragmented_heap(mib: int) -> tuple[object, list[int]]:
    """``mib`` MiB freed in the middle of glibc's heap (resident until trimmed), held up by one
    live block at its top."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    blocks = [libc.malloc(16 << 10) for _ in range(mib * 64)]  # chunks below mmap's threshold
    for b in blocks:
        libc.memset(b, 1, 16 << 10)  # resident
    for b in blocks[:-1]:
        libc.free(b)  # the last block keeps the heap's top: nothing is returned on its own
    return libc, blocks[-1:]


def test_malloc_trim_tells_the_allocators_free_memory_from_live_objects() -> None:
    """``malloc_trim_released_mib`` (the vLLM fronts' last figure) reports what the trim gave back."""
    from hylinker.tools.soak_measure import malloc_trim_released_mib

    malloc_trim_released_mib()  # start from a trimmed heap
    libc, live = _fragmented_heap(64)
    try:
        assert malloc_trim_released_mib() > 32
    finally:
        libc.free(live[0])  # type: ignore[attr-defined]
    assert malloc_trim_released_mib() < 32  # nothing left to give back


def test_a_trimming_sampler_counts_live_memory_only() -> None:
    """``--malloc-trim``: the sample's resident memory leaves out what the allocator held free."""
    from hylinker.tools.soak_measure import malloc_trim_released_mib, resident_mib

    malloc_trim_released_mib()
    libc, live = _fragmented_heap(64)
    try:
        untrimmed = resident_mib()
        plain = Sampler(1.0).take(0, {}).values["rss_mib"]
        trimmed = Sampler(1.0, trim=True).take(0, {}).values["rss_mib"]
    finally:
        libc.free(live[0])  # type: ignore[attr-defined]
    assert plain > untrimmed - 8  # a plain sample sees the free memory
    assert trimmed < untrimmed - 32


def test_plot_from_redraws_an_earlier_runs_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--plot-from``: a run in an engine's environment (no matplotlib) is drawn from its JSON."""
    pytest.importorskip("matplotlib")
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"front": "vllm", "warmup_s": 60.0, "grew": False, "summary": {},
                                 "samples": [{"t_s": 10.0 * i, "done": i, "rss_mib": 100.0 + i, "threads": 3.0}
                                             for i in range(12)]}))
    png = tmp_path / "run.png"
    assert cli.main(["soak", "--plot-from", str(saved), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
