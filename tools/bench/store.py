"""Store data-path benchmark: a store's raw batch API next to a plain memcpy of the same bytes.

Library functions only (``hylinker bench`` wires them in). Figures are printed by the caller;
nothing here asserts timing.

:func:`measure_raw_vs_memcpy` seals ``n_objects`` framed objects of ``object_bytes`` (header
included) in one staging tensor, then per repeat: puts them under fresh keys in batches of
``capabilities.max_batch`` (timed), gets them back into a second staging tensor (timed),
checks every byte. Stores that report a capacity of their own are left to evict earlier
repeats' objects (the steady state of a full cache: slots are reused, no fresh memory);
stores that report none have each repeat's keys removed where they can. The memcpy baseline
copies the same objects, one ``torch`` ``copy_`` per object, between the same two
preallocated tensors (torch intra-op threads set to 1 meanwhile); ``numpy_gbps`` adds ``numpy.copyto`` per object for reference (torch's
per-call overhead and intra-op threads weigh on small copies). Each figure is the best of
``repeats``.
"""

from __future__ import annotations

import functools
import gc
import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import torch

from ...stores.base import Outcome, Store
from ...stores.embedded import EmbeddedStore
from ...stores.framing import HEADER_BYTES, seal

_LAYOUT = b"bench-store-layout-fingerprint!!"

FAULTED_IN = ("memory faulted in before timing: every store (raw and runtime) first puts and removes "
              "as many objects as the timed run moves; pools, staging arenas and copy buffers are "
              "written before the clock starts")


async def fault_in(store: Store, object_bytes: int, n: int) -> None:
    """Fault in the store memory ``n`` objects take before anything is timed: put all ``n``
    (every slot written once, so every page of it is mapped), then remove them (the embedded
    store keeps emptied chunks, Mooncake its segment). Putting and removing a batch at a time
    would touch one slab chunk over and over and leave the timed run its first-touch faults
    (56-81 µs per 64 KiB object against 14-16 µs warm, measured)."""
    buf = torch.zeros(object_bytes, dtype=torch.uint8)
    keys = [f"warm-{i}" for i in range(n)]
    for lo in range(0, n, 256):
        await store.put(keys[lo:lo + 256], [buf] * len(keys[lo:lo + 256]))
    for lo in range(0, n, 256):
        await store.remove(keys[lo:lo + 256])


def measure_raw_vs_memcpy(
    store_factory: Callable[[], Any],
    object_bytes: int,
    n_objects: int,
    repeats: int = 3,
    fault_in_objects: int = 0,
) -> list[dict[str, Any]]:
    """Put and get GB/s of the store's raw batch API vs memcpy, with their ratio.

    ``store_factory()`` returns a store, or an awaitable of one (opened); the store is
    closed afterwards. Runs its own event loop: call it from synchronous code. Returns one
    row per direction: ``store, direction, object_bytes, n_objects, raw_gbps, memcpy_gbps,
    raw_vs_memcpy, numpy_gbps``. ``fault_in_objects``: objects :func:`fault_in` puts and
    removes first (0: the factory's store comes warm).
    """
    if object_bytes < HEADER_BYTES:
        raise ValueError(f"object_bytes must hold a {HEADER_BYTES}-byte header, got {object_bytes}")
    if n_objects < 1 or repeats < 1:
        raise ValueError(f"n_objects and repeats must be >= 1, got {n_objects}, {repeats}")
    result: list[dict[str, Any]] = anyio.run(
        _measure, store_factory, object_bytes, n_objects, repeats, fault_in_objects
    )
    return result


def embedded_raw_vs_memcpy(total_bytes: int = 128 << 20, repeats: int = 3) -> list[dict[str, Any]]:
    """:func:`measure_raw_vs_memcpy` for the embedded store at 64 KiB and 1 MiB objects."""
    rows: list[dict[str, Any]] = []
    for object_bytes in (64 << 10, 1 << 20):
        n = max(16, total_bytes // object_bytes)
        rows += measure_raw_vs_memcpy(
            functools.partial(EmbeddedStore, 2 * n * object_bytes), object_bytes, n, repeats,
            fault_in_objects=2 * n,
        )
    return rows


async def _measure(
    store_factory: Callable[[], Any], object_bytes: int, n_objects: int, repeats: int,
    fault_in_objects: int,
) -> list[dict[str, Any]]:
    made = store_factory()
    store: Store = await made if hasattr(made, "__await__") else made
    try:
        await fault_in(store, object_bytes, fault_in_objects)
        total = object_bytes * n_objects
        src = torch.empty(total, dtype=torch.uint8)
        dst = torch.empty(total, dtype=torch.uint8)
        store.register(src)
        store.register(dst)
        pattern = torch.arange(object_bytes, dtype=torch.int64).remainder_(251).to(torch.uint8)
        src_views = [src[i * object_bytes : (i + 1) * object_bytes] for i in range(n_objects)]
        dst_views = [dst[i * object_bytes : (i + 1) * object_bytes] for i in range(n_objects)]
        batch = max(1, store.capabilities.max_batch)
        best = dict.fromkeys(
            ("put", "get", "memcpy_put", "memcpy_get", "numpy_put", "numpy_get"), 0.0
        )
        cleanup = store.capabilities.remove and store.statistics().capacity_bytes == 0
        for _ in range(repeats):
            prefix = uuid.uuid4().hex
            keys = [f"bench-{prefix}-{i}" for i in range(n_objects)]
            for i, view in enumerate(src_views):
                view.copy_(pattern)
                view[HEADER_BYTES : HEADER_BYTES + 8] = i % 256
                seal(view, keys[i], _LAYOUT)
            dst.zero_()

            gc.collect()  # no collection of earlier rounds' garbage inside the timed region
            t0 = time.perf_counter()
            for start in range(0, n_objects, batch):
                outcomes = await store.put(keys[start : start + batch], src_views[start : start + batch])
                if any(o is not Outcome.OK for o in outcomes):
                    raise RuntimeError(f"benchmark put failed: {sorted({o.value for o in outcomes})}")
            best["put"] = max(best["put"], total / (time.perf_counter() - t0) / 1e9)

            gc.collect()
            t0 = time.perf_counter()
            for start in range(0, n_objects, batch):
                results = await store.get(keys[start : start + batch], dst_views[start : start + batch])
                if any(r.outcome is not Outcome.OK for r in results):
                    raise RuntimeError("benchmark get failed: "
                                       f"{sorted({r.outcome.value for r in results})}")
            best["get"] = max(best["get"], total / (time.perf_counter() - t0) / 1e9)
            if not torch.equal(src, dst):
                raise RuntimeError("benchmark get returned other bytes than were put")
            if cleanup:
                for start in range(0, n_objects, batch):
                    await store.remove(keys[start : start + batch])

            # memcpy of the same objects between the same preallocated tensors, one thread
            # (torch's intra-op threads only add contention to a per-object copy)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                for direction, (a, b) in (("memcpy_put", (dst_views, src_views)),
                                          ("memcpy_get", (src_views, dst_views))):
                    t0 = time.perf_counter()
                    for target, source in zip(a, b, strict=True):
                        target.copy_(source)
                    best[direction] = max(best[direction], total / (time.perf_counter() - t0) / 1e9)
            finally:
                torch.set_num_threads(threads)
            for direction, (a, b) in (("numpy_put", (dst_views, src_views)),
                                      ("numpy_get", (src_views, dst_views))):
                targets = [t.numpy() for t in a]
                sources = [t.numpy() for t in b]
                t0 = time.perf_counter()
                for target_np, source_np in zip(targets, sources, strict=True):
                    np.copyto(target_np, source_np)
                best[direction] = max(best[direction], total / (time.perf_counter() - t0) / 1e9)
        rows = []
        for direction in ("put", "get"):
            raw, memcpy = best[direction], best[f"memcpy_{direction}"]
            rows.append({
                "store": store.capabilities.name,
                "direction": direction,
                "object_bytes": object_bytes,
                "n_objects": n_objects,
                "raw_gbps": raw,
                "memcpy_gbps": memcpy,
                "raw_vs_memcpy": raw / memcpy if memcpy else None,
                "numpy_gbps": best[f"numpy_{direction}"],
            })
        return rows
    finally:
        await store.close()
