"""The vLLM connector's worker removes only what a load proved bad (issue 42 item 2): a worker
whose reads fail (the store answers FAILED) leaves every object, and a worker over fresh pages
restores them afterwards. In process, over the connector's own ``PageTransfers``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from hylinker.integrations import store_host
from hylinker.integrations.config import PluginConfig
from hylinker.integrations.vllm.index import rank_key
from hylinker.integrations.vllm.pages import PageTransfers, RawPages
from hylinker.integrations.vllm.plan import TransferPlan
from hylinker.stores.base import GetResult, Outcome
from hylinker.stores.rows import RowResults


def _pages(seed: int) -> tuple[torch.Tensor, RawPages]:
    """8 blocks of one attention layer and one state layer sharing a raw buffer (vLLM's hybrid
    allocation)."""
    page = 2 * 4 * 8 * 2
    raw = torch.randint(-100, 100, (8 * page,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    caches = {"model.layers.3.attn": raw.view(torch.bfloat16).view(8, 2, 4, 8),
              "model.layers.0.linear": raw.view(8, 1, 1, page)}
    return raw, RawPages(caches, 8)


def _load(pt: PageTransfers, plan: TransferPlan) -> bool:
    done: set[str] = set()
    bad: set[str] = set()
    while not (done or bad):
        done, bad = pt.finished_loads()
    return plan.request_id in done


def test_a_worker_whose_reads_fail_leaves_every_object(monkeypatch: pytest.MonkeyPatch) -> None:
    host = store_host.acquire(PluginConfig.from_extra_config({"capacity_mb": 8}, where="extra"))
    inner: Any = getattr(host.store, "_inner", host.store)  # under the retry wrapper
    keys = [rank_key(k, 0) for k in ("k1", "k2", "s2")]
    made: list[PageTransfers] = []

    def transfers(pages: RawPages) -> PageTransfers:
        made.append(PageTransfers(host, pages, fingerprint=b"f" * 32, with_state=True, staging_bytes=4 * 128))
        return made[-1]

    try:
        raw_a, pages_a = _pages(1)
        a = transfers(pages_a)
        a.save([TransferPlan("a", ("k1", "k2"), (1, 2), ("s2",), (3,))])
        assert a.drain(10.0) and a.statistics().saves_ok == 1
        stored = raw_a.view(8, -1)[1:4].clone()

        async def failed(keys: Sequence[str], *_: Any) -> list[GetResult]:
            return [GetResult(Outcome.FAILED)] * len(keys)

        async def failed_rows(batch: Any, _: bool) -> RowResults:
            return RowResults.of(len(batch.keys), Outcome.FAILED)

        with monkeypatch.context() as m:
            for name in ("get", "get_parts", "get_checked"):
                m.setattr(inner, name, failed)
            m.setattr(inner, "get_rows", failed_rows)
            _, pages_b = _pages(2)
            b = transfers(pages_b)
            plan = TransferPlan("b", ("k1", "k2"), (5, 6), ("s2",), (7,))
            b.load(plan)
            assert not _load(b, plan)
            assert b.drain(10.0)
            stats = b.statistics()
            assert (stats.loads_failed, stats.objects_removed, stats.objects_kept) == (1, 0, 3)
        assert host.portal.call(host.store.exists, keys) == [True, True, True]
        raw_c, pages_c = _pages(3)
        c = transfers(pages_c)
        plan = TransferPlan("c", ("k1", "k2"), (5, 6), ("s2",), (7,))
        c.load(plan)
        assert _load(c, plan)
        assert torch.equal(raw_c.view(8, -1)[5:8], stored)
    finally:
        for pt in made:
            pt.close(5.0)
        store_host.release(host)
