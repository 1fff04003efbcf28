"""How many requests one bad object takes down inside SGLang's real cache (issue 42 item 7).

SGLang's contract gives a batch's loads one counter index and ``finish_layer_wise_loading`` one
verdict for it; ``UnifiedCacheLinkerWrapper.finish_loads`` then aborts (503) every request of
the batch when it is False. So the first batch that reads a bad object loses all its requests:
forced by the contract (measured below). What the plugin decides is whether that happens again:
a lookup never offers an object this plugin proved bad (``HylinkerLinker._condemned``), so the
next batch restores below it, even where the bad object is still in the store (a store without
remove, a removal that failed, or a writer that wrote it bad again). See ``docs/design.md``."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache, page_keys

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang"}
PAGE = 4
PROMPTS = [list(range(1000 * (i + 1), 1000 * (i + 1) + 24)) for i in range(4)]  # 6 pages each
TAIL = [7, 8, 9]
_rids = itertools.count()


def _load_batch(cache: SGLangCache, prompts: Sequence[list[int]]) -> tuple[list[int], list[bool]]:
    """Admit ``prompts`` as one batch: each looks up and queues its load, the loads start
    together behind one counter index, the forward waits per layer, SGLang finishes the loads.
    Returns (tokens each loaded, whether SGLang aborted each)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs, loaded = [], []
    for tokens in prompts:
        req = Req(rid=f"batch-{next(_rids)}", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        req.init_next_round_input(cache.cache)
        n = 0
        if int(req.host_hit_length or 0) > 0:
            n, req.last_node = cache.cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
            req.prefix_len += n
        reqs.append(req)
        loaded.append(int(n))
    index = cache.cache.ready_to_load_host_cache()
    counter = cache.cache.linker.layer_done_counter
    if index is not None and index >= 0:
        counter.set_consumer(index)
    for layer in range(cache.spec.num_layers):
        cache.kvcache.get_key_buffer(layer)
    failed = {r.rid for r in cache.cache.finish_external_linker_loads(reqs)}
    counter.set_consumer(-1)
    return loaded, [r.rid in failed for r in reqs]


@pytest.fixture
def cache() -> Iterator[SGLangCache]:
    made = SGLangCache(CacheSpec(model="dense", kv="mha", page_size=PAGE, num_layers=2),
                       {**PLUGIN, "linker_extra_config": {}})
    yield made
    made.close()


def test_one_bad_object_aborts_its_batch_once(cache: SGLangCache) -> None:
    for p in PROMPTS:
        cache.serve(p)
    cache.flush()
    key = cache.linker.object_keys("kv", [page_keys(PROMPTS[0], page_size=PAGE)[3]])[0]
    cache.corrupt_object(key, 1 << 16)
    bad = cache.stored_bytes(key, 1 << 16)
    assert bad is not None
    # the first batch that reads it: SGLang aborts every request of the batch (the contract)
    loaded, aborted = _load_batch(cache, [p + TAIL for p in PROMPTS])
    assert loaded == [24] * 4 and aborted == [True] * 4
    stats = cache.linker.statistics()
    assert stats.verify_failures >= 1 and stats.bad_objects_removed == 1
    # the bad object is back (a store that cannot remove, or a writer that wrote it bad again)
    cache.replace_object(key, bad)
    cache.flush()
    loaded, aborted = _load_batch(cache, [p + TAIL[:2] for p in PROMPTS])
    assert aborted == [False] * 4, "the object proved bad took a second batch down"
    assert loaded == [12, 24, 24, 24]  # the first restores the pages below the bad one


# ---- a reader whose reads fail removes nothing (issue 42 item 2, the SGLang plugin) ----------


@pytest.mark.mooncake
def test_a_plugin_whose_reads_fail_leaves_every_object_for_the_next_engine(mooncake_master: Any) -> None:
    """Engines A, B, C share one Mooncake master; B's reads are answered FAILED (a failing
    link): B's loads fail (SGLang aborts them), and every object stays, so C restores them."""
    from hylinker.stores.base import GetResult, Outcome
    from hylinker.stores.rows import RowResults

    spec = CacheSpec(model="dense", kv="mha", page_size=PAGE, num_layers=2)
    extra = {"store": "mooncake", "master": mooncake_master.address, "segment_mb": 16}
    made: list[SGLangCache] = []
    try:
        a = SGLangCache(spec, {**PLUGIN, "linker_extra_config": extra})
        made.append(a)
        for p in PROMPTS:
            assert not a.serve(p).aborted
        b = SGLangCache(spec, {**PLUGIN, "linker_extra_config": extra})
        made.append(b)
        inner = b.linker.store._inner  # the Mooncake store under the plugin's retry wrapper

        async def failed(keys: Sequence[str], *_: Any) -> list[GetResult]:
            return [GetResult(Outcome.FAILED)] * len(keys)

        async def failed_rows(batch: Any, _: bool) -> RowResults:
            return RowResults.of(len(batch.keys), Outcome.FAILED)

        for name in ("get", "get_parts", "get_checked"):
            setattr(inner, name, failed)
        inner.get_rows = failed_rows
        assert all(b.serve(p + TAIL).aborted for p in PROMPTS)  # every load failed: SGLang aborts
        stats = b.linker.statistics()
        assert stats.loads_failed == len(PROMPTS) and stats.bad_objects_removed == 0
        assert stats.failed_objects_kept > 0
        c = SGLangCache(spec, {**PLUGIN, "linker_extra_config": extra})
        made.append(c)
        for p in PROMPTS:
            served = c.serve(p + TAIL)
            assert not served.aborted and served.loaded == len(p) and served.restore_mismatches == []
    finally:
        for cache in made:
            cache.close()
