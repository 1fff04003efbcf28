"""The UMBP adapter's own rules, over the protocol double (the real client needs ROCm)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest
import torch

from hylinker.stores.base import GetResult, Outcome, StoreUnavailableError
from hylinker.stores.umbp import SIZE_RECORD_SUFFIX, UmbpStore, UnsupportedStoreOperation
from hylinker.testing.umbp_double import UMBPClientDouble


def keys_(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"umbp-{prefix}-{i}" for i in range(n)]


def obj(i: int, nbytes: int = 1024) -> torch.Tensor:
    return torch.full((nbytes,), i + 1, dtype=torch.uint8)


def test_without_mori_the_error_names_the_package() -> None:
    try:
        import mori.umbp  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("mori is installed here")
    with pytest.raises(StoreUnavailableError, match="amd-mori"):
        UmbpStore()


def test_client_and_config_are_exclusive() -> None:
    with pytest.raises(ValueError, match="either client= or config="):
        UmbpStore(client=UMBPClientDouble(), config=object())


async def test_capabilities_say_no_remove_no_touch() -> None:
    store = UmbpStore(client=UMBPClientDouble())
    caps = store.capabilities
    assert (caps.name, caps.touch, caps.remove, caps.zero_copy) == ("umbp", False, False, True)
    with pytest.raises(UnsupportedStoreOperation, match="no per-key delete"):
        await store.remove(keys_(1))
    with pytest.raises(NotImplementedError):
        await store.remove(keys_(1))
    await store.close()


async def test_puts_write_the_object_and_its_size_record_by_pointer() -> None:
    client = UMBPClientDouble()
    store = UmbpStore(client=client)
    (key,) = keys_(1)
    buf = obj(3, 1000)
    assert await store.put([key], [buf]) == [Outcome.OK]
    assert client.stored_bytes(key) == bytes(buf.numpy())
    record = client.stored_bytes(key + SIZE_RECORD_SUFFIX)
    assert record is not None and record[:8] == b"HYLKSIZE"
    assert int.from_bytes(record[8:], "little") == 1000
    assert client.calls["batch_put_from_ptr"] == 1
    await store.close()


async def test_exact_size_get_is_one_client_call() -> None:
    client = UMBPClientDouble()
    store = UmbpStore(client=client)
    (key,) = keys_(1)
    await store.put([key], [obj(1)])
    before = client.calls["batch_get_into_ptr"]
    out = torch.empty(1024, dtype=torch.uint8)
    assert await store.get([key], [out]) == [GetResult(Outcome.OK, 1024)]
    assert client.calls["batch_get_into_ptr"] == before + 1
    assert torch.equal(out, obj(1))
    await store.close()


async def test_an_object_gone_but_its_record_left_is_missing() -> None:
    client = UMBPClientDouble()
    store = UmbpStore(client=client)
    a, b = keys_(2)
    await store.put([a, b], [obj(1), obj(2)])
    assert client.drop(a)  # the client's own eviction
    results = await store.get([a, b], [torch.empty(2048, dtype=torch.uint8)] * 2)
    assert results == [GetResult(Outcome.MISSING), GetResult(Outcome.OK, 1024)]
    await store.close()


async def test_without_size_records_gets_need_exact_buffers() -> None:
    client = UMBPClientDouble()
    store = UmbpStore(client=client, size_records=False)
    a, b = keys_(2)
    await store.put([a], [obj(1)])
    assert client.stored_bytes(a + SIZE_RECORD_SUFFIX) is None
    results = await store.get(
        [a, a, b],
        [torch.empty(1024, dtype=torch.uint8), torch.empty(2048, dtype=torch.uint8),
         torch.empty(1024, dtype=torch.uint8)],
    )
    assert [r.outcome for r in results] == [Outcome.OK, Outcome.FAILED, Outcome.MISSING]
    await store.close()


async def test_a_refused_put_is_failed() -> None:
    store = UmbpStore(client=UMBPClientDouble(capacity_bytes=4096))
    (key,) = keys_(1)
    assert await store.put([key], [obj(1, 8192)]) == [Outcome.FAILED]
    assert store.statistics().put_failures == 1
    await store.close()


class ExplodingClient(UMBPClientDouble):
    def batch_get_into_ptr(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        raise RuntimeError("master unreachable")


async def test_client_exceptions_become_store_unavailable() -> None:
    store = UmbpStore(client=ExplodingClient())
    with pytest.raises(StoreUnavailableError, match="master unreachable"):
        await store.get(keys_(1), [torch.empty(8, dtype=torch.uint8)])
    await store.close()


async def test_register_and_close_deregister_regions() -> None:
    client = UMBPClientDouble()
    store = UmbpStore(client=client)
    region = torch.zeros(1 << 16, dtype=torch.uint8)
    store.register(region)
    assert client.registered_regions == {region.data_ptr(): 1 << 16}
    await store.close()
    assert client.registered_regions == {}


async def test_touch_is_a_no_op() -> None:
    client = UMBPClientDouble()
    store = UmbpStore(client=client)
    await store.touch(keys_(2))
    assert sum(client.calls.values()) == 0
    await store.close()


def test_the_double_follows_umbp_semantics() -> None:
    client = UMBPClientDouble()
    a = obj(1, 64)
    b = obj(2, 64)
    assert client.put_from_ptr("k", a.data_ptr(), 64)
    assert client.put_from_ptr("k", b.data_ptr(), 64)  # true, but the first writer won
    out = torch.zeros(64, dtype=torch.uint8)
    assert not client.get_into_ptr("k", out.data_ptr(), 32)  # size must match exactly
    assert client.get_into_ptr("k", out.data_ptr(), 64)
    assert torch.equal(out, a)
    assert client.batch_exists_consecutive(["k", "nope", "k"]) == 1
    with pytest.raises(ValueError, match="differ in length"):
        client.batch_get_into_ptr(["k"], [out.data_ptr()], [])
    assert not hasattr(client, "remove") and not hasattr(client, "close")
