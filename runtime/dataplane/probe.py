"""The data plane's existence probe: which objects it can serve now, from draining frames or the store.

An object is present when every one of its layer groups is: in a pool actor's staging index (a
sealed frame of a two-stage offload the store has not acknowledged yet,
``runtime/dataplane/frame_index.py``) or, for the keys no frame holds, in the store, asked in one
call. A store error or a wrong-length answer is a miss for every key the store was asked about
(fail closed), counted as ``exists_errors``; what the frames hold is still present.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ...components.layout import PoolKind
from ...components.pool_view import PoolViewError
from ...stores.base import StoreError
from .tracing import trace
from .transfer_jobs import check_keys, group_key

if TYPE_CHECKING:
    from .plane import DataPlane


async def probe(plane: DataPlane, keys: Mapping[PoolKind, Sequence[str]]) -> dict[PoolKind, list[bool]]:
    """:meth:`DataPlane.exists`. See the module doc."""
    names: list[str] = []
    spans: dict[PoolKind, tuple[int, int]] = {}
    for pool, ks in keys.items():
        if pool not in plane.actors:
            raise PoolViewError(f"no {pool.value} pool in this data plane")
        check_keys(ks, pool)
        spans[pool] = (len(names), len(ks))
        g = len(plane.codecs[pool])
        names.extend(group_key(k, j, g) for k in ks for j in range(g))
    out = {pool: [False] * n for pool, (_, n) in spans.items()}
    if not names:
        return out
    present = [False] * len(names)
    for pool, (off, n) in spans.items():  # draining frames first: the freshest copy
        index = plane.actors[pool].frames
        if index is not None and len(index):
            for j in range(off, off + n * len(plane.codecs[pool])):
                present[j] = index.holds(names[j])
    ask = [j for j, p in enumerate(present) if not p]
    if ask:
        for j, answer in zip(ask, await _store_exists(plane, [names[j] for j in ask])):
            present[j] = answer
    for pool, (off, n) in spans.items():
        g = len(plane.codecs[pool])
        out[pool] = [all(present[off + i * g + j] for j in range(g)) for i in range(n)]
    return out


async def _store_exists(plane: DataPlane, names: list[str]) -> list[bool]:
    """The store's answer for ``names`` in one call; all False (counted) where it cannot say."""
    plane._c["exists_calls"] += 1
    start = time.perf_counter()
    try:
        present = await plane.store.exists(names)
    except StoreError as exc:
        plane._c["exists_errors"] += 1
        trace("data.exists.store_error", error=str(exc), keys=len(names))
        return [False] * len(names)
    plane.latency.observe(time.perf_counter() - start)
    if len(present) != len(names):
        plane._c["exists_errors"] += 1
        trace("data.exists.store_error", error=f"answered {len(present)} of {len(names)} keys")
        return [False] * len(names)
    return [bool(p) for p in present]


__all__ = ["probe"]
