"""The UMBP adapter's own rules. Tests over ``umbp_test_client`` run against the protocol double
here and against the real mori client under ``just test-umbp``; tests that need the double's
hooks (call counts, stored bytes, evicting one key) use the double in both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hylinker.stores.base import GetResult, Outcome, StoreUnavailableError
from hylinker.stores.umbp import (
    HEADER_BYTES,
    PAGE_BYTES,
    UmbpStore,
    UnsupportedStoreOperation,
    object_pages,
)
from hylinker.testing.umbp_double import (
    DeploymentMode,
    UMBPClientDouble,
    real_client_wanted,
    umbp_test_client,
)
from hylinker.tools.cli import main

TIER = 16 * PAGE_BYTES


def keys_(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"umbp-{prefix}-{i}" for i in range(n)]


def obj(i: int, nbytes: int = 1024) -> torch.Tensor:
    return torch.full((nbytes,), i + 1, dtype=torch.uint8)


def store_over(capacity: int = TIER) -> UmbpStore:
    return UmbpStore(client=umbp_test_client(capacity), capacity_bytes=capacity)


def test_without_mori_the_error_names_the_package() -> None:
    try:
        import mori.umbp  # noqa: F401
    except (ImportError, OSError):
        pass
    else:
        pytest.skip("mori loads here (the subprocess tests below cover a mori that cannot load)")
    with pytest.raises(StoreUnavailableError, match="amd-mori"):
        UmbpStore()


@pytest.mark.skipif(not real_client_wanted(), reason="needs .venv-umbp (just test-umbp)")
def test_a_mori_that_cannot_load_is_a_clear_error() -> None:
    # the venv's Python without the Debian libraries and ROCm stubs on LD_LIBRARY_PATH
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    code = (
        "from hylinker.stores.base import StoreUnavailableError\n"
        "from hylinker.stores.umbp import UmbpStore\n"
        "try:\n    UmbpStore()\n"
        "except StoreUnavailableError as exc:\n    print('CLEAR:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CLEAR:" in out.stdout and "amd-mori" in out.stdout
    assert ".so" in out.stdout  # names the library that is missing


def test_the_default_config_is_small_and_not_prefaulted() -> None:
    if not real_client_wanted():
        pytest.skip("builds a real UMBPConfig (just test-umbp)")
    from hylinker.stores.umbp import DEFAULT_CAPACITY_BYTES, umbp_config

    config = umbp_config()
    assert (config.dram.capacity_bytes, config.dram.prefault, config.ssd.enabled) == (
        DEFAULT_CAPACITY_BYTES, False, False)
    assert DEFAULT_CAPACITY_BYTES <= 256 << 20


def test_a_tier_too_small_for_one_object_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="holds no object"):
        UmbpStore(client=UMBPClientDouble(capacity_bytes=PAGE_BYTES), capacity_bytes=PAGE_BYTES)


async def test_capabilities_say_no_remove_and_touch_by_reading() -> None:
    store = store_over()
    caps = store.capabilities
    assert (caps.name, caps.touch, caps.remove, caps.zero_copy) == ("umbp", True, False, True)
    with pytest.raises(UnsupportedStoreOperation, match="no per-key delete"):
        await store.remove(keys_(1))
    with pytest.raises(NotImplementedError):
        await store.remove(keys_(1))
    await store.close()


async def test_an_object_is_its_header_and_payload_in_one_put() -> None:
    client = UMBPClientDouble(capacity_bytes=TIER)
    store = UmbpStore(client=client, capacity_bytes=TIER)
    (key,) = keys_(1)
    buf = obj(3, 1000)
    assert await store.put([key], [buf]) == [Outcome.OK]
    stored = client.stored_bytes(key)
    assert stored is not None and len(stored) == HEADER_BYTES + 1000
    assert stored[:8] == b"HYLKSIZE" and int.from_bytes(stored[8:16], "little") == 1000
    assert stored[16:] == bytes(buf.numpy())
    assert client.calls["batch_put_ranges_from_ptr"] == 1
    assert client.calls["batch_put_from_ptr"] == 0  # no separate size record
    await store.close()


async def test_objects_take_pages_and_no_page_for_a_size_record() -> None:
    # 16 pages, 1,000-byte objects: with a size record each would take 2 pages (6 left after
    # eviction); header and payload share one page, so 12 are left, as with bare objects
    store = store_over()
    keys = keys_(40)
    for key in keys:
        assert await store.put([key], [obj(1, 1000)]) == [Outcome.OK]
    assert sum(await store.exists(keys)) == 12
    assert object_pages(PAGE_BYTES - HEADER_BYTES) == 1 and object_pages(PAGE_BYTES) == 2
    await store.close()


async def test_exact_size_get_is_one_client_call() -> None:
    client = UMBPClientDouble(capacity_bytes=TIER)
    store = UmbpStore(client=client, capacity_bytes=TIER)
    (key,) = keys_(1)
    await store.put([key], [obj(1)])
    before = client.calls["batch_get_ranges_into_ptr"]
    out = torch.empty(1024, dtype=torch.uint8)
    assert await store.get([key], [out]) == [GetResult(Outcome.OK, 1024)]
    assert client.calls["batch_get_ranges_into_ptr"] == before + 1
    assert torch.equal(out, obj(1))
    await store.close()


async def test_gets_of_other_sizes() -> None:
    store = store_over()
    a, b = keys_(2)
    await store.put([a], [obj(1, 1000)])
    bigger, smaller, empty = (torch.zeros(n, dtype=torch.uint8) for n in (3000, 999, 0))
    results = await store.get([a, a, a, b], [bigger, smaller, empty, torch.zeros(8, dtype=torch.uint8)])
    assert results == [GetResult(Outcome.OK, 1000), GetResult(Outcome.TOO_SMALL),
                       GetResult(Outcome.TOO_SMALL), GetResult(Outcome.MISSING)]
    assert torch.equal(bigger[:1000], obj(1, 1000)) and not bigger[1000:].any()
    await store.close()


async def test_an_evicted_object_is_missing() -> None:
    client = UMBPClientDouble(capacity_bytes=TIER)
    store = UmbpStore(client=client, capacity_bytes=TIER)
    a, b = keys_(2)
    await store.put([a, b], [obj(1), obj(2)])
    assert client.drop(a)  # the client's own eviction
    results = await store.get([a, b], [torch.empty(2048, dtype=torch.uint8)] * 2)
    assert results == [GetResult(Outcome.MISSING), GetResult(Outcome.OK, 1024)]
    await store.close()


async def test_the_same_key_twice_in_one_batch_keeps_the_first() -> None:
    store = store_over()
    (key,) = keys_(1)
    assert await store.put([key, key], [obj(1), obj(2)]) == [Outcome.OK, Outcome.EXISTS]
    out = torch.empty(1024, dtype=torch.uint8)
    assert await store.get([key], [out]) == [GetResult(Outcome.OK, 1024)]
    assert torch.equal(out, obj(1))
    await store.close()


async def test_a_size_zero_put_is_a_counted_refusal() -> None:
    store = store_over()
    a, b = keys_(2)
    outcomes = await store.put([a, b], [torch.empty(0, dtype=torch.uint8), obj(1)])
    assert outcomes == [Outcome.FAILED, Outcome.OK]
    assert store.statistics().put_failures == 1
    assert await store.exists([a, b]) == [False, True]
    await store.close()


async def test_an_object_the_tier_cannot_keep_is_full_without_a_client_call() -> None:
    # 16 pages evict down to 11: an object of 12 pages would be evicted as soon as stored
    client = UMBPClientDouble(capacity_bytes=TIER)
    store = UmbpStore(client=client, capacity_bytes=TIER)
    a, b = keys_(2)
    fits, too_big = obj(1, 11 * PAGE_BYTES - HEADER_BYTES), obj(2, 11 * PAGE_BYTES)
    assert await store.put([a, b], [fits, too_big]) == [Outcome.OK, Outcome.FULL]
    assert store.statistics().put_failures == 1
    assert client.calls["batch_put_ranges_from_ptr"] == 1
    assert await store.exists([a, b]) == [True, False]
    await store.close()


async def test_a_refused_put_is_failed() -> None:
    store = store_over()
    small = keys_(14)
    for key in small:  # 14 of 16 pages: under the high watermark, nothing is evicted
        assert await store.put([key], [obj(1, 1000)]) == [Outcome.OK]
    (key,) = keys_(1)
    assert await store.put([key], [obj(1, 4 * PAGE_BYTES)]) == [Outcome.FAILED]  # no free pages
    assert store.statistics().put_failures == 1
    await store.close()


async def test_the_adapter_never_clears() -> None:
    client = UMBPClientDouble(capacity_bytes=TIER)
    store = UmbpStore(client=client, capacity_bytes=TIER)
    keys = keys_(40)
    for key in keys:
        await store.put([key], [obj(1)])
    await store.get(keys, [torch.empty(1024, dtype=torch.uint8) for _ in keys])
    await store.close()
    assert client.calls["clear"] == 0


class ExplodingClient(UMBPClientDouble):
    def batch_get_ranges_into_ptr(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> list[bool]:
        raise RuntimeError("master unreachable")


async def test_client_exceptions_become_store_unavailable() -> None:
    store = UmbpStore(client=ExplodingClient(capacity_bytes=TIER), capacity_bytes=TIER)
    with pytest.raises(StoreUnavailableError, match="master unreachable"):
        await store.get(keys_(1), [torch.empty(8, dtype=torch.uint8)])
    await store.close()


async def test_register_and_close_deregister_regions() -> None:
    client = UMBPClientDouble(capacity_bytes=TIER)
    store = UmbpStore(client=client, capacity_bytes=TIER)
    region = torch.zeros(1 << 16, dtype=torch.uint8)
    store.register(region)
    assert client.registered_regions == {region.data_ptr(): 1 << 16}
    await store.close()
    assert client.registered_regions == {}


async def test_register_on_the_real_default_client() -> None:
    store = store_over()
    region = torch.zeros(1 << 16, dtype=torch.uint8)
    store.register(region)
    (key,) = keys_(1)
    part = region[:1024]
    part.fill_(5)
    assert await store.put([key], [part]) == [Outcome.OK]
    await store.close()


async def test_standalone_process_mode_refuses_torch_regions() -> None:
    client = UMBPClientDouble(capacity_bytes=TIER, mode=DeploymentMode.StandaloneProcess)
    store = UmbpStore(client=client, capacity_bytes=TIER)
    with pytest.raises(StoreUnavailableError, match="StandaloneProcess"):
        store.register(torch.zeros(1 << 16, dtype=torch.uint8))
    assert client.calls["register_memory"] == 0
    await store.close()


async def test_touch_reads_headers_and_keeps_objects_alive() -> None:
    # 16 pages: 8 hot objects, then 40 cold puts with a touch of the hot ones every 4 puts;
    # without the touches the cold puts evict them all
    async def hot_left(touch: bool) -> int:
        store = store_over()
        hot = keys_(8)
        for key in hot:
            await store.put([key], [obj(1, 1000)])
        for i, key in enumerate(keys_(40)):
            await store.put([key], [obj(2, 1000)])
            if touch and i % 4 == 0:
                await store.touch([*hot, *keys_(1)])  # a missing key is harmless
        left = sum(await store.exists(hot))
        await store.close()
        return left

    assert (await hot_left(False), await hot_left(True)) == (0, 8)


async def test_touch_is_one_small_read() -> None:
    client = UMBPClientDouble(capacity_bytes=TIER)
    store = UmbpStore(client=client, capacity_bytes=TIER)
    await store.touch(keys_(3))
    assert client.calls == {"batch_get_ranges_into_ptr": 1}
    await store.touch([])
    assert sum(client.calls.values()) == 1
    await store.close()


def _stress(tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "stress.json"
    rc = main(["stress", "--no-progress", "--json", str(out), "--store", "umbp", "--requests", "60",
               "--synthetic-scale", "0.1", "--kv-pages", "1024", "--mamba-slots", "24",
               "--store-capacity-mb", "64", "--no-soak"])
    summary: dict[str, Any] = json.loads(out.read_text())
    assert rc == 0, summary
    return summary


@pytest.mark.skipif(not real_client_wanted(), reason="the real client (just test-umbp)")
def test_short_stress_on_the_real_umbp_client(tmp_path: Path) -> None:
    s = _stress(tmp_path)
    assert (s["restore_mismatches"], s["leaked_rows"], s["leaked_slots"], s["locked_nodes_at_end"]) == (0, 0, 0, 0)
    assert s["store_hit_tokens"] > 0 and s["restores_verified"] > 0


def test_stress_on_umbp_without_mori_is_a_clear_error(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import mori.umbp  # noqa: F401
    except (ImportError, OSError):
        pass
    else:
        pytest.skip("mori loads here (test_short_stress_on_the_real_umbp_client runs instead)")
    # checked before the run: one line naming the package, exit 2, no traceback
    out = tmp_path / "stress.json"
    assert main(["stress", "--no-progress", "--json", str(out), "--store", "umbp", "--requests", "60"]) == 2
    assert "amd-mori" in capsys.readouterr().err
    assert not out.exists()
