"""The whole runtime's data path as the benchmarks time it: offload then load objects through a
:class:`~hylinker.runtime.linker.facade.Linker` (keys, tree, staging or in place, integrity, store).
``hylinker bench``'s data path and its per-step breakdown (:mod:`.steps`) both call it."""

from __future__ import annotations

import gc
import time

import attrs
import numpy as np

from ...components.layout import ModelLayout
from ...components.pools import HybridPools
from ...runtime.linker.config import LinkerConfig
from ...runtime.linker.facade import Linker
from ...stores.base import Store


async def runtime_transfer(store: Store, object_bytes: int, n_objects: int,
                           in_place: bool = True, in_place_min_bytes: int | None = None,
                           integrity: str = "checksum", segments: int = 1, run: str = "") -> dict[str, float]:
    """Offload then load ``n_objects`` KV page objects through the whole runtime (GB/s);
    ``in_place=False`` forces the staged path (stage, checksum, scatter) for comparison,
    ``in_place_min_bytes=0`` the in-place path at every size; None keeps the default;
    ``integrity``: ``LinkerConfig.integrity``; ``segments``: the object's payload in that many
    layers (one segment each, equal rows); ``run``: a tag that gives this call keys of its own
    (a store that outlives the call, e.g. a remote Mooncake segment, would otherwise answer a
    later round's puts ``EXISTS`` and time nothing)."""
    from ...stores.framing import HEADER_BYTES

    page = 64
    payload = object_bytes - HEADER_BYTES
    row = payload // page // segments
    layout = ModelLayout.create(page_size=page, full_layers=list(range(segments)), kv_row_shape=[row],
                                kv_dtype="uint8", model_name=f"bench-{object_bytes}-{segments}{run}")
    pools = HybridPools(layout, kv_pages=n_objects + 1)
    tokens = np.random.default_rng(object_bytes).integers(1, 50000, n_objects * page + 1)
    cfg = LinkerConfig(touch=False, latency_high_ms=1e6, latency_low_ms=1e5,
                       staging_bytes_per_pool=256 << 20, in_place=in_place, integrity=integrity)
    if in_place_min_bytes is not None:
        cfg = attrs.evolve(cfg, in_place_min_bytes=in_place_min_bytes)
    nbytes = n_objects * (HEADER_BYTES + payload)
    async with Linker(layout, pools, store, cfg) as lk:
        r = lk.request("w", tokens)
        await lk.lookup(r)
        rows = lk.extend(r, n_objects * page)
        pools.kv.tensor[:, rows] = 3
        # earlier rounds' linkers and stores are garbage with reference cycles (their arenas
        # among them): collect them now, not inside the timed region (the raw side does too)
        gc.collect()
        t0 = time.perf_counter()
        await lk.insert(r, n_objects * page)
        await lk.drain()
        t_put = time.perf_counter() - t0
        await lk.release(r)
        lk.flush_device()
        r = lk.request("r", tokens)
        gc.collect()
        t0 = time.perf_counter()
        await lk.lookup(r)
        load = await lk.load(r)
        assert load is not None
        restored = await lk.commit(load)
        t_get = time.perf_counter() - t0
        await lk.release(r)
    # a round the store failed in part (an offload or a load lost) times less than it claims:
    # the caller reports it as a loss and keeps it out of the figures
    return {"put": nbytes / t_put / 1e9, "get": nbytes / t_get / 1e9,
            "restored_fraction": restored / (n_objects * page)}
