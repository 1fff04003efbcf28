"""Python calls per object on the data path: a count, so the host's load does not move it.

:func:`python_calls` builds a :class:`~hylinker.runtime.dataplane.sync_plane.SyncDataPlane` over host
KV pools and the embedded store (``store="mooncake"``: a Mooncake store on a loopback master this
module starts, its segment room for every object moved; ``rows=False`` opens it with
``MooncakeConfig.row_calls`` off, so the data plane moves in place by ``put_parts`` /
``get_parts`` as before the row calls), then counts the Python function calls (profile ``"call"``
events: a function entered or a coroutine resumed) plus the calls into C (``"c_call"``: a
builtin or extension function, e.g. one ``numpy.copyto``) made in
*every* thread (the caller's, the hand-off thread, the event loop's, the store's and the
runtime's worker threads) while one offload, one default load and one verify-all load of ``n``
objects run, each on its own, and divides by ``n``: ``*_calls_per_object`` is both kinds together (the figure issue 34's
goal of at most 10 per object reads), ``*_py_calls_per_object`` and ``*_c_calls_per_object``
the two apart. The profiler is installed with
``threading.setprofile`` before the data plane starts its threads, so each of them carries it;
counting is switched on only around the measured call (the set-up is not counted).

Shapes (:data:`SHAPES`): a 64 KiB page object in 4 layers (K only), a 1 MiB one in 4 layers,
and a Qwen3-Next-like page: 12 full-attention layers, K and V, page 64, 512-byte rows
(768 KiB in 24 segments).

Run alone: ``python3 -m hylinker.tools.bench.calls --store mooncake [--no-rows] [--shape S] [-n N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from ...components.layout import PoolKind
from ...components.pool_view import PoolSet, kv_view
from ...runtime.dataplane.plane import Transfer
from ...runtime.dataplane.sync_plane import SyncDataPlane
from ...stores.base import Store
from ...stores.embedded import EmbeddedStore
from .output import write_json

#: name -> (layers, parts per layer (1: K, 2: K and V), bytes per row); page 64 rows
SHAPES: dict[str, tuple[int, int, int]] = {
    "64KiB-4layers": (4, 1, 256),
    "1MiB-4layers": (4, 1, 4096),
    "qwen3next-12layers-KV": (12, 2, 512),
}
PAGE = 64
STORES = ("embedded", "mooncake")


class CallCounter:
    """A profile function counting Python and C calls in every thread, while switched on."""

    def __init__(self) -> None:
        self.on = False
        self.calls = 0
        self.c_calls = 0
        self._lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on:
            return
        if event == "call":
            with self._lock:
                self.calls += 1
        elif event == "c_call":
            with self._lock:
                self.c_calls += 1

    def measure(self, fn: Callable[[], object]) -> tuple[int, int]:
        """(Python calls, C calls) made while ``fn()`` runs, in every profiled thread."""
        self.calls = self.c_calls = 0
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        return self.calls, self.c_calls


@contextlib.contextmanager
def _store_factory(store: str, capacity: int, rows: bool
                   ) -> Iterator[Callable[[], Store] | Callable[[], Awaitable[Store]]]:
    """A factory of the store to measure on, ``capacity`` bytes; a Mooncake master lives as
    long as the context."""
    if store == "embedded":
        yield lambda: EmbeddedStore(capacity)
        return
    if store != "mooncake":
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    from ...stores.mooncake import MooncakeConfig, MooncakeStore
    from ...stores.mooncake_master import MooncakeMaster

    with MooncakeMaster() as master:
        config = MooncakeConfig(master_address=master.address, segment_bytes=capacity, row_calls=rows)
        yield lambda: MooncakeStore.open(config)


def _counts(shape: str, n: int, store: str = "embedded", row_calls: bool = True
            ) -> tuple[int, dict[str, tuple[int, int]]]:
    """(object bytes, {phase: (Python calls, C calls)}) of moving ``n`` objects of ``shape``."""
    layers, parts, row = SHAPES[shape]
    rows = 2 * n * PAGE + PAGE
    ks = [torch.randint(0, 256, (rows, row), dtype=torch.uint8) for _ in range(layers)]
    vs = [torch.randint(0, 256, (rows, row), dtype=torch.uint8) for _ in range(layers)] if parts == 2 else None
    view = kv_view(ks, vs, layer_ids=list(range(layers)), page_size=PAGE)
    object_bytes = view.payload_bytes + 64
    counter = CallCounter()
    threading.setprofile(counter)
    sys.setprofile(counter)
    run = uuid.uuid4().hex[:8]  # a store shared across runs (Mooncake's master) sees new keys
    try:
        with (_store_factory(store, 4 * n * (object_bytes + 64) + (64 << 20), row_calls) as factory,
              SyncDataPlane(PoolSet([view]), factory) as dp):
            if store == "mooncake":
                assert dp.store.capabilities.rows is row_calls
            src = torch.arange(n * PAGE)
            dst = torch.arange(n * PAGE, 2 * n * PAGE)

            def offload(tag: str) -> None:
                out = dp.offload([Transfer(PoolKind.FULL, [f"{run}-{tag}-{i}" for i in range(n)], src)]).result()
                assert out.ok, out

            def load(tag: str, verify_all: bool) -> None:
                out = dp.load([Transfer(PoolKind.FULL, [f"{run}-{tag}-{i}" for i in range(n)], dst)],
                              verify_all=verify_all).result.result()
                assert out.ok, out

            offload("warm")  # arenas, worker threads and store chunks exist before counting
            load("warm", False)
            load("warm", True)
            counts = {
                "offload": counter.measure(lambda: offload("obj")),
                "load": counter.measure(lambda: load("obj", False)),
                "verify_all_load": counter.measure(lambda: load("obj", True)),
            }
            for k, v in zip(ks, vs or ks):  # positive control: the load restored the bytes
                assert torch.equal(k[:n * PAGE], k[n * PAGE:2 * n * PAGE]) and torch.equal(v[:n * PAGE],
                                                                                      v[n * PAGE:2 * n * PAGE])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return object_bytes, counts


def python_calls(shape: str, n: int = 256, store: str = "embedded", rows: bool = True) -> dict[str, Any]:
    """Calls per object for an offload, a default load and a verify-all load of ``n`` objects
    of ``shape`` (:data:`SHAPES`) through the synchronous data plane on ``store`` (:data:`STORES`;
    ``rows``: Mooncake with its row calls); also moved at ``2 n`` objects, which splits each
    count into what one more object costs (``*_marginal_calls_per_object``: the slope,
    per-sub-batch work included) and what a submission costs whatever its size (``*_fixed_calls``)."""
    layers, parts, _ = SHAPES[shape]
    object_bytes, counts = _counts(shape, n, store, rows)
    _, double = _counts(shape, 2 * n, store, rows)
    out: dict[str, Any] = {"shape": shape, "object_bytes": object_bytes, "segments": layers * parts,
                           "objects": n, "store": store if rows or store == "embedded" else f"{store} (parts)"}
    for name, (py, c) in counts.items():
        out[f"{name}_calls_per_object"] = round((py + c) / n, 1)  # the goal's figure: both kinds
        out[f"{name}_py_calls_per_object"] = round(py / n, 1)
        out[f"{name}_c_calls_per_object"] = round(c / n, 1)
        slope = (sum(double[name]) - py - c) / n
        out[f"{name}_marginal_calls_per_object"] = round(slope, 1)
        out[f"{name}_fixed_calls"] = round(py + c - slope * n)
    return out


def all_shapes(quick: bool = False, store: str = "embedded", rows: bool = True) -> list[dict[str, Any]]:
    return [python_calls(shape, 64 if quick else 256, store, rows) for shape in SHAPES]


def print_calls(rows: list[dict[str, Any]]) -> None:
    print("\n== Python calls per object (every thread; a count, not a time)")
    print("| store | shape | object bytes | segments | objects | offload | load | verify-all load | "
          "of which into C | marginal (one more object) | fixed per submission |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    phases = ("offload", "load", "verify_all_load")
    for r in rows:
        print(f"| {r.get('store', 'embedded')} | {r['shape']} | {r['object_bytes']} | {r['segments']} | {r['objects']} | "
              + " | ".join(str(r[f"{p}_calls_per_object"]) for p in phases) + " | "
              + "/".join(str(r[f"{p}_c_calls_per_object"]) for p in phases) + " | "
              + "/".join(str(r[f"{p}_marginal_calls_per_object"]) for p in phases) + " | "
              + "/".join(str(r[f"{p}_fixed_calls"]) for p in phases) + " |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Python calls per object through the synchronous data plane")
    parser.add_argument("--store", choices=STORES, default="embedded")
    parser.add_argument("--no-rows", action="store_true",
                        help="mooncake: row calls off (MooncakeConfig.row_calls=False), moved by put_parts/get_parts")
    parser.add_argument("--shape", choices=list(SHAPES), action="append", help="repeatable; default: every shape")
    parser.add_argument("-n", type=int, default=256, help="objects per transfer (also measured at 2 n)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = [python_calls(shape, args.n, args.store, not args.no_rows) for shape in args.shape or SHAPES]
    print_calls(rows)
    if args.json is not None:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
