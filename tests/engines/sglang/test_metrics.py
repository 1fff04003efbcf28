"""The plugin's Prometheus metrics inside SGLang's real cache (``--enable-metrics`` on): the
counters move with a restore, a damaged object and a refused lookup. The families live in
prometheus_client's global registry of this process, as they do in SGLang's scheduler process."""

from __future__ import annotations

from typing import Any

from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
A = list(range(5000, 5032))
B = list(range(6000, 6008))


def sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value("sglang:hylinker_" + name, {"tp_rank": "0", **labels})
    return float(value or 0.0)


def build(made: list[SGLangCache], **spec: Any) -> SGLangCache:
    cache = SGLangCache(CacheSpec(**spec), {**PLUGIN, "linker_extra_config": {}})
    made.append(cache)
    return cache


def test_counters_move_with_a_restore(caches: list[SGLangCache]) -> None:
    cache = build(caches, enable_metrics=True, model="dense", kv="mha", page_size=4, num_layers=2)
    assert cache.linker.metrics is not None
    hits0, misses0 = sample("lookups_total", outcome="hit"), sample("lookups_total", outcome="miss")
    tokens0, loads0 = sample("hit_tokens_total", source="store"), sample("loads_total", outcome="ok")
    bytes_in0 = sample("bytes_total", pool="kv", direction="load")
    bytes_out0 = sample("bytes_total", pool="kv", direction="offload")
    offloads0 = sample("offloads_total", outcome="ok")
    lat0 = sample("load_seconds_count")
    cache.serve(A)  # a miss, then its pages offloaded
    cache.flush()
    restored = cache.serve(A + B)
    assert restored.loaded == len(A) and restored.restore_mismatches == []
    cache.linker._publish_metrics(force=True)
    assert sample("lookups_total", outcome="miss") - misses0 == 1
    assert sample("lookups_total", outcome="hit") - hits0 == 1
    assert sample("hit_tokens_total", source="store") - tokens0 == len(A)
    assert sample("loads_total", outcome="ok") - loads0 == 1
    assert sample("load_seconds_count") - lat0 == 1
    assert sample("offloads_total", outcome="ok") - offloads0 >= 1
    from hylinker.stores import framing

    page_bytes = framing.framed_size(cache.linker.pools[next(iter(cache.linker.pools))].payload_bytes)
    assert sample("bytes_total", pool="kv", direction="load") - bytes_in0 == len(A) // 4 * page_bytes
    assert sample("bytes_total", pool="kv", direction="offload") - bytes_out0 >= len(A) // 4 * page_bytes
    from hylinker import __version__

    assert sample("info", version=__version__, integrity="checksum", store="embedded") == 1
    held = cache.linker.store.statistics()  # then published: a write still landing only adds
    cache.linker._publish_metrics(force=True)
    assert sample("store_objects") >= held.objects > 0 and sample("store_bytes") >= held.used_bytes > 0


def test_metrics_off_without_enable_metrics(caches: list[SGLangCache]) -> None:
    cache = build(caches, model="dense", kv="mha", page_size=4, num_layers=2)
    assert cache.linker.metrics is None
    hits0 = sample("lookups_total", outcome="miss")
    cache.serve(A)
    assert sample("lookups_total", outcome="miss") == hits0  # nothing recorded


def test_a_damaged_object_moves_the_verification_and_second_read_counters(caches: list[SGLangCache]) -> None:
    """A stored object with a flipped payload byte: the load reads it twice, fails, SGLang
    aborts the request, and the counters say so (one verify failure, one second read that
    failed, none recovered)."""
    from hylinker.stores import framing
    from hylinker.tools.harness.sglang_cache import page_keys

    cache = build(caches, enable_metrics=True, model="dense", kv="mha", page_size=4, num_layers=2)
    fail0 = sample("verify_failures_total", pool="kv")
    failed0 = sample("rereads_total", pool="kv", outcome="failed")
    recovered0 = sample("rereads_total", pool="kv", outcome="recovered")
    cache.serve(A)
    cache.flush()
    key = cache.linker.object_keys("kv", [page_keys(A, 4)[2]])[0]
    pool = cache.linker.pools[next(iter(cache.linker.pools))]
    cache.corrupt_object(key, framing.framed_size(pool.payload_bytes))
    assert cache.serve(A + B).aborted
    cache.linker._publish_metrics(force=True)
    assert sample("verify_failures_total", pool="kv") - fail0 == 1
    assert sample("rereads_total", pool="kv", outcome="failed") - failed0 == 1
    assert sample("rereads_total", pool="kv", outcome="recovered") == recovered0
