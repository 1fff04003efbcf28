"""A fleet in network namespaces under real faults: nothing restored wrong, nothing hung, nothing
leaked, the hit rate back after each fault. One shared run (``conftest.fleet_result``): a
master and two engine hosts, traffic from both, then a partition, a host death, a master
restart and a kill -9, each followed by recovery traffic."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from conftest import AFTER_S, CONFIG, row

from hylinker.components.pools import HybridPools
from hylinker.testing.content import SyntheticContent, preset_layout
from hylinker.tools.fleet import FAULTS
from hylinker.tools.harness.netns import Network, list_own

#: what "bounded by the configured timeouts" allows, with 1 s for a loaded 2-core host. A lookup
#: is one wrapper transfer (deadline_s; exists calls are abandoned at the call timeout). A get
#: cannot be abandoned (the client would still write the rows), so each attempt runs until
#: Mooncake fails it, at most its progress plus its status timeout (2 x transfer_timeout_s), and
#: a load reads its pools' objects and then its fallback states: two such attempts may overrun
#: the deadline. Measured worst: 5.2 s (host death); Mooncake's default alone is 30 s per attempt
LOOKUP_BOUND_MS = (CONFIG.deadline_s + 1.0) * 1e3
LOAD_BOUND_MS = (CONFIG.deadline_s + 2 * 2 * CONFIG.transfer_timeout_s + 1.0) * 1e3


def test_objects_cross_the_veth_between_hosts(fleet_result: dict[str, Any]) -> None:
    """Both paths are taken and told apart: reads of the other host's segment go over TCP
    through the bridge, reads of its own segment are a memcpy."""
    rows = fleet_result["faults"]
    assert sum(r["get_remote"] for r in rows) > 100
    assert sum(r["put_remote"] for r in rows) > 10
    assert sum(r["get_local"] for r in rows) > 100  # the control: the other path exists too


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_restores_nothing_wrong_and_never_hangs(fleet_result: dict[str, Any], fault: str) -> None:
    r = row(fleet_result, fault)
    assert r["restores_verified"] > 20, r  # restores happened around the fault: the check is not vacuous
    assert r["wrong_restores"] == 0, r
    assert r["requests_during"] > 0, r  # traffic went on while the fault lasted
    assert r["lookup"]["max_ms"] <= LOOKUP_BOUND_MS, r
    assert r["load"]["max_ms"] <= LOAD_BOUND_MS, r
    assert r["pre_hit_rate"] > 0.5, r
    assert r["recovery_s"] is not None and r["recovery_s"] <= AFTER_S, r


def test_lost_objects_are_misses_then_recomputed(fleet_result: dict[str, Any]) -> None:
    """A restarted master starts empty and a dead host takes its segment's objects: lookups
    miss (the requests recompute), and the fleet refills the store."""
    master = row(fleet_result, "master-restart")
    assert master["misses_after"] > 0, master
    death = row(fleet_result, "host-death")
    assert death["misses_after"] + death["recomputed"] > 0, death


def test_partitioned_host_misses_within_its_deadline(fleet_result: dict[str, Any]) -> None:
    """Requests missed while the store did not answer (calls cut at their timeout or refused by
    the breaker that earlier failures opened, keys failing every attempt): the partition was
    real and was seen as one. How long the calls took is bounded in the test above."""
    r = row(fleet_result, "partition")
    assert r["misses_after"] > 0, r
    assert r["unanswered"] > 0, r


def test_every_engine_ends_clean_and_closes(fleet_result: dict[str, Any]) -> None:
    leaks = fleet_result["leaks"]
    assert set(leaks) == {"h0", "h1"}
    for role, end in leaks.items():
        assert end is not None, f"{role} did not stop gracefully"
        assert (end["leaked_rows"], end["leaked_slots"], end["locked_nodes"], end["idle_error"]) == (0, 0, 0, ""), end
    closed = {e["engine"]: e for e in fleet_result["closed"]}
    for name in fleet_result["survivors"]:
        assert closed[name]["store_close_s"] < CONFIG.deadline_s + CONFIG.transfer_timeout_s + 5, closed[name]
    assert fleet_result["wrong_restores"] == 0
    assert fleet_result["namespaces_left"] == []


def test_content_check_catches_one_wrong_byte() -> None:
    """The positive control for every ``wrong_restores == 0``: one flipped byte is counted."""
    layout = preset_layout("kimi", 64, 64)
    pools = HybridPools(layout, kv_pages=8, mamba_slots=2)
    content = SyntheticContent(pools, seed=0)
    keys = [bytes([i]) * 16 for i in range(4)]
    rows = torch.arange(4 * layout.page_size)
    content.write_pages(keys, rows)
    content.write_state(keys[-1], 0)
    assert len(content.pages_match(keys, rows)) == 0 and content.state_matches(keys[-1], 0)
    pools.kv.tensor.view(torch.uint8)[0, 70, 3] ^= 1  # page 1, token 6
    assert len(content.pages_match(keys, rows)) == 1
    assert pools.mamba is not None
    pools.mamba.tensors()[0].view(torch.uint8).reshape(2, -1)[0, 5] ^= 1
    assert not content.state_matches(keys[-1], 0)


def test_unreachable_master_fails_fast_inside_a_namespace() -> None:
    """An address on the fleet's own subnet that nobody holds (SYNs go unanswered): opening the
    store fails within its probe timeout with a clear error, it does not block in setup."""
    with Network(["h"]) as net:
        host = net.hosts["h"]
        code = ("import anyio, time\n"
                "from hylinker.stores.base import StoreUnavailableError\n"
                "from hylinker.stores.mooncake import MooncakeStore\n"
                "from hylinker.stores.mooncake_client import MooncakeConfig\n"
                "t = time.monotonic()\n"
                "try:\n"
                f"    anyio.run(MooncakeStore.open, MooncakeConfig(master_address='10.77.0.99:50051', local_hostname='{host.address}'))\n"
                "except StoreUnavailableError as exc:\n"
                "    print('UNAVAILABLE', round(time.monotonic() - t, 2), exc)\n")
        began = time.monotonic()
        done = subprocess.run(host.command([sys.executable, "-c", code]), capture_output=True, text=True,
                              timeout=60)
        took = time.monotonic() - began
        names = {net.switch, host.netns}
    assert "UNAVAILABLE" in done.stdout, done.stdout + done.stderr
    assert "not accepting connections" in done.stdout
    assert float(done.stdout.split()[1]) < 3.0, done.stdout
    assert took < 30
    assert not names & set(list_own())


def test_throughput_bench_reads_another_hosts_segment_over_tcp() -> None:
    """The figures' tool: every object lives on the storage host (its endpoint, not the
    client's), every read equals what was written, across the veth and over loopback."""
    from hylinker.tools.fleet_bench import throughput

    rows = throughput(object_kib=256, count=8, repeats=1)
    veth, loop = rows
    assert veth["setup"] == "veth" and loop["setup"] == "loopback"
    assert veth["object_hosts"] == [veth["storage_address"]] and veth["storage_address"].startswith("10.77.0.")
    assert loop["object_hosts"] == ["127.0.0.1"]
    for r in rows:
        assert r["runtime_restores_verified"] == 4 and r["runtime_misses"] == 0, r
        assert min(r["raw_put_gbps"], r["raw_get_gbps"], r["store_put_gbps"], r["store_get_gbps"]) > 0
