"""``python -m hylinker.tools.lab.layer_ranges`` reads what it claims: each ranged get of a layer group lands that
group's bytes of every object, and a range read from the wrong place fails the run. Behaviour
only, never its timings (real Mooncake client on the session's loopback master)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from hylinker.tools.lab.layer_ranges import _groups, measure

OBJECT_BYTES = 64 << 10


@pytest.fixture
def client(mooncake_master: Any) -> Iterator[Any]:
    from hylinker.stores.mooncake_client import MooncakeConfig, import_mooncake_store, setup_client

    c = setup_client(import_mooncake_store(), MooncakeConfig(master_address=mooncake_master.address,
                                                             segment_bytes=32 << 20, local_buffer_bytes=16 << 20))
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("layers", [1, 2, 8])
def test_layer_groups_cover_the_layers_in_order(layers: int) -> None:
    for groups in range(1, layers + 1):
        spans = _groups(layers, groups)
        assert len(spans) == groups and spans[0][0] == 0 and spans[-1][1] == layers
        assert all(hi > lo for lo, hi in spans) and all(a[1] == b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize("layers", [1, 2, 8])
def test_each_ranged_get_lands_its_groups_bytes(client: Any, layers: int) -> None:
    counts = sorted({1, 2, layers} & set(range(1, layers + 1)))
    rows = measure(client, OBJECT_BYTES, 4, layers, counts, 2, f"ok{layers}")
    assert [r["groups"] for r in rows] == counts
    assert all(r["verified"] and r["first_group_ms"] <= r["all_groups_ms"] for r in rows)


class _ShiftedRanges:
    """The client, but every ranged read comes from ``shift`` bytes further into the object."""

    def __init__(self, client: Any, shift: int) -> None:
        self._client, self._shift = client, shift

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_get_into_multi_buffer_ranges(self, keys: Any, ptrs: Any, sizes: Any, offsets: Any) -> Any:
        moved = [[(o + self._shift) % OBJECT_BYTES for o in per] for per in offsets]
        return self._client.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, moved)


def test_a_range_read_from_the_wrong_place_fails_the_run(client: Any) -> None:
    with pytest.raises(RuntimeError, match="differ"):
        measure(_ShiftedRanges(client, OBJECT_BYTES // 2), OBJECT_BYTES, 2, 2, [2], 1, "shifted")
