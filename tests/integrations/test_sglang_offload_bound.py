"""The SGLang plugin's bound on offloads in flight, by count and by bytes (issue 42, item 5).

Imports no SGLang: the bound and the bytes an offload names are the plugin's own rules
(``integrations/sglang/offloads.py``); ``tests/engines/sglang/test_bounded_store.py`` floods SGLang's
real cache against a gated store.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hylinker.components.layout import PoolKind
from hylinker.integrations.sglang.config import SGLangLinkerConfig
from hylinker.integrations.sglang.offloads import OffloadBound, named_bytes


def test_refuses_beyond_the_count() -> None:
    bound = OffloadBound(max_count=2, max_bytes=1 << 30)
    first, second = bound.accept(10), bound.accept(10)
    assert bound.refuses(10)
    first.set_result(True)
    assert bound.completed() == 1 and bound.refuses(10)  # done but not yet popped: still held
    assert bound.pop() is True
    assert not bound.refuses(10) and bound.bytes == 10
    second.set_result(False)
    assert bound.completed() == 1 and bound.pop() is False
    assert bound.figures() == {"offloads_in_flight": 0, "offload_bytes_in_flight": 0,
                               "offloads_in_flight_peak": 2, "offload_bytes_in_flight_peak": 20}


def test_refuses_beyond_the_bytes_but_one_alone_may_pass_them() -> None:
    bound = OffloadBound(max_count=100, max_bytes=100)
    assert not bound.refuses(500)  # nothing in flight: a node larger than the bound still goes
    bound.accept(500)
    assert bound.refuses(1)
    bound.results[0].set_result(True)
    bound.pop()
    bound.accept(60)
    assert not bound.refuses(40) and bound.refuses(41)


def test_results_report_in_order() -> None:
    bound = OffloadBound(max_count=8, max_bytes=1 << 30)
    a, b = bound.accept(1), bound.accept(1)
    b.set_result(True)
    assert bound.completed() == 0  # a later result waits for the earlier one (SGLang's FIFO)
    a.set_result(True)
    assert bound.completed() == 2
    bound.clear()
    assert bound.figures()["offloads_in_flight"] == 0 and bound.bytes == 0


def test_named_bytes_counts_every_pool_the_offload_names() -> None:
    payload = {PoolKind.FULL: 100, PoolKind.DRAFT: 7, PoolKind.MAMBA: 1000}
    transfers = [SimpleNamespace(name=SimpleNamespace(value="kv"), keys=["a", "b", "c"]),
                 SimpleNamespace(name="mamba", keys=["c"]),
                 SimpleNamespace(name="swa", keys=["c"])]  # a pool this linker does not hold
    assert named_bytes(transfers, payload) == 3 * (100 + 7) + 1000


@pytest.mark.parametrize("key", ["offload_max_inflight", "offload_max_inflight_mb"])
def test_bound_keys_are_checked(key: str) -> None:
    assert getattr(SGLangLinkerConfig.from_extra_config({key: 3}), key) == 3
    with pytest.raises(ValueError, match=key):
        SGLangLinkerConfig.from_extra_config({key: 0})
