"""``hylinker bench --only steps``: where one object's microseconds go on the host data path.

Each step of a staged transfer is timed alone over a batch of objects (distinct memory per
object, so copies and hashes meet cold cache lines like a real batch), as the minimum over
``reps`` repetitions divided by the objects: the minimum filters out the preemptions of a shared
host, so the figures are the step's own cost on this machine. Beside them: the raw embedded
store API on the same objects, its checksumming calls (``put_sealed`` / ``get_checked``, what
the runtime uses over it), and the whole runtime (``runtime_transfer``: keys, tree, staging,
store) per object. The runtime's per-object budget against the raw store is what the rows
must fit in.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import torch
import xxhash

from ...stores import framing
from ...stores.base import check_buffers
from ...stores.embedded import EmbeddedStore
from .runtime import runtime_transfer
from .store import FAULTED_IN, fault_in


def _per_object(fn: Callable[[], Any], n: int, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


async def _per_object_async(fn: Callable[[int], Awaitable[Any]], n: int, reps: int) -> float:
    best = float("inf")
    for r in range(reps):
        t0 = time.perf_counter()
        await fn(r)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def object_steps(object_bytes: int, n: int = 256, reps: int = 15, runtime_bytes: int = 256 << 20) -> dict[str, Any]:
    """µs per object of each step for ``n`` framed objects of ``object_bytes`` (header included);
    the whole runtime moves ``runtime_bytes`` (at least ``n`` objects) as ``hylinker bench``'s
    data path does, so its fixed costs per call spread as they do there."""
    if object_bytes <= framing.HEADER_BYTES or n < 1 or reps < 1:
        raise ValueError("object_bytes must exceed the header; n and reps must be >= 1")
    stride = -(-object_bytes // 64) * 64
    arena = torch.zeros(n * stride, dtype=torch.uint8)
    arena_np = arena.numpy()
    rows = np.random.default_rng(object_bytes).integers(0, 256, n * stride, dtype=np.uint8)
    keys = [f"{i:032x}:kv:tp0" for i in range(n)]
    fingerprint = b"\x01" * 16
    payload = object_bytes - framing.HEADER_BYTES
    frames = [arena[i * stride: i * stride + object_bytes] for i in range(n)]
    frames_np = [arena_np[i * stride: i * stride + object_bytes] for i in range(n)]
    sources = [rows[i * stride: i * stride + object_bytes] for i in range(n)]

    def seal_headers() -> None:
        for f, k in zip(frames_np, keys):
            framing.seal_header(f, k, fingerprint, payload)

    def copies() -> None:
        for d, src in zip(frames_np, sources):
            np.copyto(d, src)

    def hashes() -> None:
        for src in sources:
            xxhash.xxh3_64_intdigest(src.data)

    def seal_frames() -> None:
        for f, k in zip(frames_np, keys):
            framing.seal_array(f, k, fingerprint)

    steps: dict[str, float] = {
        "torch_frame_views": _per_object(lambda: [arena[i * stride: i * stride + object_bytes] for i in range(n)], n, reps),
        "numpy_frame_views": _per_object(lambda: [arena_np[i * stride: i * stride + object_bytes] for i in range(n)], n, reps),
        "split_header_payload": _per_object(lambda: [[f[:framing.HEADER_BYTES], f[framing.HEADER_BYTES:]] for f in frames], n, reps),
        "check_buffers": _per_object(lambda: check_buffers(keys, frames), n, reps),
        "seal_header": _per_object(seal_headers, n, reps),
        "memcpy": _per_object(copies, n, reps),
        "xxh3": _per_object(hashes, n, reps),
        "seal_array": _per_object(seal_frames, n, reps),
    }

    async def store_steps() -> dict[str, float]:
        store = EmbeddedStore(4 * n * stride + (64 << 20))
        parts = [[f[:framing.HEADER_BYTES], f[framing.HEADER_BYTES:]] for f in frames]

        def named(tag: str, r: int) -> list[str]:
            return [f"{k}:{tag}{r}" for k in keys]

        async def timed(tag: str, put: Callable[[list[str]], Awaitable[Any]],
                        get: Callable[[list[str]], Awaitable[Any]]) -> tuple[float, float]:
            best_put = best_get = float("inf")
            for r in range(reps):
                ks = named(tag, r)
                t0 = time.perf_counter()
                await put(ks)
                best_put = min(best_put, time.perf_counter() - t0)
                t0 = time.perf_counter()
                await get(ks)
                best_get = min(best_get, time.perf_counter() - t0)
                await store.remove(ks)
            return best_put / n * 1e6, best_get / n * 1e6

        try:
            await fault_in(store, stride, n)
            seal_frames()
            raw_put, raw_get = await timed("raw", lambda ks: store.put(ks, frames), lambda ks: store.get(ks, frames))
            sealed_put, checked_get = await timed("sealed", lambda ks: store.put_sealed(ks, parts),
                                                  lambda ks: store.get_checked(ks, parts))
        finally:
            await store.close()
        return {"raw_put": raw_put, "raw_get": raw_get, "put_sealed": sealed_put, "get_checked": checked_get}

    steps.update(anyio.run(store_steps))

    whole_n = max(n, runtime_bytes // object_bytes)

    async def whole() -> dict[str, float]:
        store = EmbeddedStore(2 * whole_n * stride + (64 << 20))
        try:
            return await runtime_transfer(store, object_bytes, whole_n)
        finally:
            await store.close()

    best = {"put": 0.0, "get": 0.0}
    for _ in range(max(1, reps // 5)):
        got = anyio.run(whole)
        if got["restored_fraction"] < 1.0:  # the embedded store lost objects: a defect, not a figure
            raise RuntimeError(f"runtime round restored {got['restored_fraction']:.3f} of the objects")
        best = {d: max(best[d], got[d]) for d in best}
    steps["runtime_put"] = object_bytes / (best["put"] * 1e9) * 1e6
    steps["runtime_get"] = object_bytes / (best["get"] * 1e9) * 1e6
    return {"object_bytes": object_bytes, "objects": n, "runtime_objects": whole_n, "reps": reps,
            "us_per_object": {k: round(v, 2) for k, v in steps.items()}}


STEP_NOTES = {
    "torch_frame_views": "a torch slice per frame (the staged path's frame list)",
    "numpy_frame_views": "a NumPy slice per frame (what framing uses)",
    "split_header_payload": "header and payload views of a frame (a checksumming store's parts)",
    "check_buffers": "the store protocol's per-buffer checks",
    "seal_header": "key digest and header pack, no payload pass",
    "memcpy": "one copy of the object (numpy.copyto, cold source)",
    "xxh3": "XXH3-64 over the object",
    "seal_array": "header and XXH3 over the payload",
    "raw_put": "EmbeddedStore.put, one call for the batch",
    "raw_get": "EmbeddedStore.get, one call for the batch",
    "put_sealed": "EmbeddedStore.put_sealed (copies and checksums at once)",
    "get_checked": "EmbeddedStore.get_checked (copies and checksums at once)",
    "runtime_put": "the whole runtime, offload (Linker insert + drain), per object",
    "runtime_get": "the whole runtime, restore (lookup + load + commit), per object",
}


def print_steps(rows: list[dict[str, Any]]) -> None:
    sizes = [r["object_bytes"] for r in rows]
    print("\nwhere one object's time goes (µs per object, min over repetitions)")
    print(FAULTED_IN)
    print("| step | " + " | ".join(f"{s >> 10} KiB" for s in sizes) + " | what |")
    print("|---|" + "---|" * len(sizes) + "---|")
    for step, note in STEP_NOTES.items():
        print(f"| {step} | " + " | ".join(f"{r['us_per_object'][step]:.2f}" for r in rows) + f" | {note} |")
