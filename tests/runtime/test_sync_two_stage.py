"""The synchronous facade's two-stage offload (what the SGLang plugin uses): ``offload(copied=)``
resolves at the copy into host staging, before the store answers; a full budget fails both
futures with ``HostStagingFullError``; ``drop_staged`` ends what waits for its put as failed and
counts it; and a derived budget can be capped, never below one object of every pool."""

from __future__ import annotations

import concurrent.futures

import pytest
from test_host_staging import (  # the same pools (tests/runtime is on the path: rootdir-relative imports)
    Pools,
    kv,
)

from hylinker.components.layout import PoolKind
from hylinker.runtime.dataplane.host_staging import HostStagingFullError, staging_for
from hylinker.runtime.dataplane.plane import DataPlaneConfig, Transfer
from hylinker.runtime.dataplane.sync_plane import SyncDataPlane
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.fakes import GatedStore


def sync_plane(pools: Pools, budget: int | None = None) -> tuple[SyncDataPlane, GatedStore]:
    gated: list[GatedStore] = []

    def make() -> GatedStore:
        gated.append(GatedStore(EmbeddedStore(8 << 20), hold_puts=True))
        return gated[0]

    config = DataPlaneConfig(two_stage_offload=True, host_staging_bytes=budget, staging_bytes_per_pool=1 << 16)
    return SyncDataPlane(pools.views(), make, config, namespace=b"sync-two-stage"), gated[0]


def open_gate(sp: SyncDataPlane, gated: GatedStore) -> None:
    async def run() -> None:
        gated.open()

    sp.call_store(run).result(timeout=10)


def test_copied_resolves_before_the_store_answers() -> None:
    pools = Pools(2, 4)
    sp, gated = sync_plane(pools)
    with sp:
        copied: concurrent.futures.Future[bool] = concurrent.futures.Future()
        done = sp.offload([kv(["a", "b"], pools, [0, 1]), Transfer(PoolKind.MAMBA, ["s"], [1])], copied=copied)
        assert copied.result(timeout=10) is True
        assert not done.done()  # the put waits at the gate
        staging = sp.plane.host_staging
        assert staging is not None and staging.used > 0
        open_gate(sp, gated)
        assert done.result(timeout=10).ok
        assert staging.used == 0


def test_a_full_budget_fails_both_futures() -> None:
    pools = Pools(2, 4)
    probe, probe_gate = sync_plane(pools)
    with probe:
        one = probe.plane.actors[PoolKind.FULL].drain.frame_bytes(1)
        floor = one + probe.plane.actors[PoolKind.MAMBA].drain.frame_bytes(1)
        open_gate(probe, probe_gate)
    sp, gated = sync_plane(pools, budget=floor)
    with sp:
        first: concurrent.futures.Future[bool] = concurrent.futures.Future()
        held = sp.offload([kv(["a"], pools, [0])], copied=first)
        assert first.result(timeout=10) is True
        copied: concurrent.futures.Future[bool] = concurrent.futures.Future()
        done = sp.offload([kv(["b", "c"], pools, [1, 2])], copied=copied)
        with pytest.raises(HostStagingFullError):
            copied.result(timeout=10)
        with pytest.raises(HostStagingFullError):
            done.result(timeout=10)
        assert sp.plane.host_staging is not None and sp.plane.host_staging.refused == 1
        open_gate(sp, gated)
        assert held.result(timeout=10).ok


def test_drop_staged_ends_the_waiting_puts_failed_and_counts_them() -> None:
    pools = Pools(2, 4)
    sp, gated = sync_plane(pools)
    with sp:
        dones, copies = [], []
        for i in range(3):
            copied: concurrent.futures.Future[bool] = concurrent.futures.Future()
            dones.append(sp.offload([kv([f"k{i}"], pools, [i])], copied=copied))
            copies.append(copied)
        assert all(c.result(timeout=10) for c in copies)
        sp.drop_staged()
        open_gate(sp, gated)  # the put already at the gate runs to its answer
        outcomes = [d.result(timeout=10) for d in dones]
        staging = sp.plane.host_staging
        assert staging is not None and staging.used == 0
        assert sum(not o.ok for o in outcomes) >= 1 and staging.dropped_objects == sum(not o.ok for o in outcomes)


def test_a_derived_budget_is_capped_never_below_one_object_of_every_pool() -> None:
    staging = staging_for("f", None, [(100, 1000), (10, 500)])
    assert staging.floor == 1500 and staging.capacity > 100_000
    staging.cap(50_000)
    assert staging.capacity == 50_000
    staging.cap(10)
    assert staging.capacity == 1500
