"""What mori's UMBP client does, pinned: the same tests run against the protocol double (here)
and against the real ``amd-mori`` 1.2.4 client (``just test-umbp`` sets ``HYLINKER_UMBP_REAL=1``
in ``.venv-umbp``), so the double cannot drift from the real thing. Each rule of
``testing/umbp_double.py`` names the test here that pins it.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from hylinker.testing.umbp_double import PAGE_BYTES, real_client_wanted, umbp_test_client

TIER_PAGES = 16
TIER = TIER_PAGES * PAGE_BYTES  # 1 MiB: eviction past 14.4 pages, down to 11.2


def keys_(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"cl-{prefix}-{i}" for i in range(n)]


def buf(nbytes: int, fill: int = 0) -> torch.Tensor:
    return torch.full((max(nbytes, 1),), fill, dtype=torch.uint8)


@pytest.fixture
def client() -> Any:
    return umbp_test_client(TIER)


def put_one_by_one(client: Any, keys: list[str], nbytes: int) -> None:
    src = buf(nbytes, 7)
    for key in keys:
        assert client.batch_put_from_ptr([key], [src.data_ptr()], [nbytes]) == [True]


def test_which_client_runs(client: Any) -> None:
    assert type(client).__name__ == ("UMBPClient" if real_client_wanted() else "UMBPClientDouble")


def test_capacity_is_counted_in_pages(client: Any) -> None:
    # 40 puts of 1,000 bytes into 16 pages: each takes a page; past 90 % (15 pages) the oldest go
    # down to 70 % (11 pages), so 12 are left, the newest ones
    keys = keys_(40)
    put_one_by_one(client, keys, 1000)
    present = client.batch_exists(keys)
    assert sum(present) == 12 and present == [False] * 28 + [True] * 12
    # an object one byte over a page takes two
    more = keys_(40)
    put_one_by_one(client, more, PAGE_BYTES + 1)
    assert sum(client.batch_exists(more)) == 6


def test_a_put_that_does_not_fit_is_refused(client: Any) -> None:
    small = keys_(14)
    put_one_by_one(client, small, 1000)  # 14 pages: under the high watermark, nothing evicted
    assert all(client.batch_exists(small))
    src = buf(4 * PAGE_BYTES)
    (big,) = keys_(1)
    assert client.batch_put_from_ptr([big], [src.data_ptr()], [4 * PAGE_BYTES]) == [False]
    assert all(client.batch_exists(small))  # no eviction made room
    huge = buf(2 * TIER)
    assert client.batch_put_from_ptr(keys_(1), [huge.data_ptr()], [2 * TIER]) == [False]


def test_an_object_above_the_low_watermark_is_evicted_at_once(client: Any) -> None:
    src = buf(15 * PAGE_BYTES)
    (key,) = keys_(1)
    assert client.batch_put_from_ptr([key], [src.data_ptr()], [15 * PAGE_BYTES]) == [True]
    assert client.batch_exists([key]) == [False]


def test_reads_refresh_recency_exists_does_not(client: Any) -> None:
    keys = keys_(30)
    src, out = buf(1000, 1), buf(1000)
    for key in keys:
        assert client.batch_put_from_ptr([key], [src.data_ptr()], [1000]) == [True]
        assert client.batch_get_into_ptr([keys[0]], [out.data_ptr()], [1000]) == [True]
        client.batch_exists([keys[1]])
    assert client.batch_exists(keys[:2]) == [True, False]


def test_a_ranged_read_of_a_header_refreshes_recency(client: Any) -> None:
    keys = keys_(30)
    src, head = buf(1000, 1), buf(16)
    for key in keys:
        assert client.batch_put_from_ptr([key], [src.data_ptr()], [1000]) == [True]
        assert client.batch_get_ranges_into_ptr([keys[0]], [[head.data_ptr()]], [[16]], [[0]]) == [True]
    assert client.batch_exists(keys[:2]) == [True, False]


def test_first_writer_wins(client: Any) -> None:
    (key,) = keys_(1)
    a, b, out = buf(64, 1), buf(64, 2), buf(64)
    assert client.batch_put_from_ptr([key], [a.data_ptr()], [64]) == [True]
    assert client.batch_put_from_ptr([key], [b.data_ptr()], [64]) == [True]  # silently ignored
    assert client.batch_get_into_ptr([key], [out.data_ptr()], [64]) == [True]
    assert torch.equal(out, a)


def test_the_same_key_twice_in_one_batch(client: Any) -> None:
    (key,) = keys_(1)
    a, b, out = buf(64, 1), buf(64, 2), buf(64)
    assert client.batch_put_from_ptr([key, key], [a.data_ptr(), b.data_ptr()], [64, 64]) == [True, False]
    assert client.batch_get_into_ptr([key], [out.data_ptr()], [64]) == [True]
    assert torch.equal(out, a)


def test_a_get_needs_the_exact_size(client: Any) -> None:
    key, missing = keys_(2)
    src, out = buf(100, 3), buf(200)
    assert client.batch_put_from_ptr([key], [src.data_ptr()], [100]) == [True]
    assert client.batch_get_into_ptr([key, key, missing], [out.data_ptr()] * 3, [50, 200, 100]) == [
        False, False, False]
    assert client.batch_get_into_ptr([key], [out.data_ptr()], [100]) == [True]
    assert torch.equal(out[:100], src)


def test_ranged_reads(client: Any) -> None:
    (key,) = keys_(1)
    head, body = buf(16, 9), torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    assert client.supports_ranged_io()
    assert client.batch_put_ranges_from_ptr(
        [key], [1016], [[head.data_ptr(), body.data_ptr()]], [[16, 1000]], [[0, 16]]) == [True]
    h, out = buf(16), buf(2000)
    assert client.batch_get_ranges_into_ptr(
        [key], [[h.data_ptr(), out.data_ptr()]], [[16, 1000]], [[0, 16]]) == [True]
    assert torch.equal(h, head) and torch.equal(out[:1000], body)
    out.zero_()
    assert client.batch_get_ranges_into_ptr([key], [[out.data_ptr()]], [[500]], [[16]]) == [True]
    assert torch.equal(out[:500], body[:500]) and not out[500:].any()  # a prefix, nothing past it
    assert client.batch_get_ranges_into_ptr([key], [[out.data_ptr()]], [[1500]], [[16]]) == [False]
    assert client.batch_get_ranges_into_ptr(keys_(1), [[h.data_ptr()]], [[16]], [[0]]) == [False]


def test_lists_of_different_lengths_answer_all_false(client: Any) -> None:
    a, b = keys_(2)
    src = buf(64)
    assert client.batch_put_from_ptr([a, b], [src.data_ptr()], [64, 64]) == [False, False]
    assert client.batch_exists([a, b]) == [False, False]
    assert client.batch_get_into_ptr([a, b], [src.data_ptr()] * 2, [64]) == [False, False]


def test_a_size_zero_put_is_refused(client: Any) -> None:
    (key,) = keys_(1)
    src = buf(8)
    assert client.batch_put_from_ptr([key], [src.data_ptr()], [0]) == [False]
    assert client.batch_exists([key]) == [False]


def test_the_default_client_is_the_embedded_pool_client(client: Any) -> None:
    assert client.is_distributed()
    assert str(client.get_deployment_mode()).rsplit(".", 1)[-1] == "Distributed"
    region = buf(PAGE_BYTES)
    assert client.register_memory(region.data_ptr(), PAGE_BYTES)
    client.deregister_memory(region.data_ptr())


def test_after_clear_puts_fail(client: Any) -> None:
    key, other = keys_(2)
    src = buf(64)
    assert client.batch_put_from_ptr([key], [src.data_ptr()], [64]) == [True]
    assert client.clear()
    assert client.batch_exists([key]) == [False]
    assert client.batch_put_from_ptr([other], [src.data_ptr()], [64]) == [False]


def test_the_client_has_no_remove_close_or_touch(client: Any) -> None:
    for name in ("remove", "batch_remove", "close", "touch", "batch_touch"):
        assert not hasattr(client, name), name
