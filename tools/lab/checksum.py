"""What the integrity checksum costs on the data path, on the embedded store, side by side.

``python -m hylinker.tools.lab.checksum [--object-bytes N] [--total-mib M] [--rounds R] [--json PATH]``

Per round, in rotating order, the same ``total`` bytes of ``object_bytes`` objects move three
ways between host "pool rows" and the store, put then get (GB/s of object bytes):

* ``raw``: the store's plain ``put`` / ``get`` of objects already framed (the copy alone);
* ``fused``: what the runtime does over a checksumming store: ``seal_header``, ``put_sealed``
  (copy and checksum in one pass), ``get_checked`` + ``verify_parts`` against the landed checksum;
* ``two_pass``: the checksum in a pass of its own: ``seal_parts`` over the rows then
  ``put_parts``, ``get_parts`` then ``verify_parts`` hashing the landed rows.

Ratios to ``raw`` are taken per round (paired) and summarised by their median and best, so a
load change between rounds moves both sides. Nothing here asserts timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from ...stores import framing
from ...stores.embedded import EmbeddedStore
from ..bench.host import describe, finish, host_record
from ..bench.output import write_json
from ..bench.store import FAULTED_IN, fault_in

_LAYOUT = b"bench-checksum-layout-fingerprint"
WAYS = ("raw", "fused", "two_pass")


async def measure(object_bytes: int, total_bytes: int, rounds: int) -> dict[str, Any]:
    n = max(1, total_bytes // object_bytes)
    body = object_bytes - framing.HEADER_BYTES
    store = EmbeddedStore(4 * n * object_bytes)
    rows = torch.randint(0, 256, (n * body,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pieces = [rows[i * body:(i + 1) * body] for i in range(n)]
    frames = torch.zeros(n * object_bytes, dtype=torch.uint8)
    objects = [frames[i * object_bytes:(i + 1) * object_bytes] for i in range(n)]
    heads_buf = torch.zeros(n * framing.HEADER_BYTES, dtype=torch.uint8)
    hb = framing.HEADER_BYTES
    heads = [heads_buf[i * hb:(i + 1) * hb] for i in range(n)]
    for i, o in enumerate(objects):  # raw moves the same bytes, framed once up front
        o[framing.HEADER_BYTES:] = pieces[i]
        framing.seal(o, f"raw-{i}", _LAYOUT)
    samples: dict[str, list[float]] = {f"{w}_{d}": [] for w in WAYS for d in ("put", "get")}
    try:
        await fault_in(store, object_bytes, n)
        for r in range(rounds):
            for way in WAYS[r % 3:] + WAYS[:r % 3]:
                keys = [f"{way}-{r}-{i}" for i in range(n)]
                parts = [[h, p] for h, p in zip(heads, pieces)]
                t0 = time.perf_counter()
                if way == "raw":
                    ok = await store.put(keys, objects)
                elif way == "fused":
                    for key, h in zip(keys, heads):
                        framing.seal_header(h.numpy(), key, _LAYOUT, body)
                    ok = await store.put_sealed(keys, parts)
                else:
                    for key, h, p in zip(keys, heads, pieces):
                        framing.seal_parts(h.numpy(), [p.numpy()], key, _LAYOUT)
                    ok = await store.put_parts(keys, parts)
                samples[f"{way}_put"].append(n * object_bytes / (time.perf_counter() - t0) / 1e9)
                assert all(o.ok for o in ok), ok
                t0 = time.perf_counter()
                if way == "raw":
                    got = await store.get(keys, objects)
                else:
                    got = await (store.get_checked if way == "fused" else store.get_parts)(keys, parts)
                    for key, h, p, res in zip(keys, heads, pieces, got):
                        # raw keys differ, so only the runtime ways are verified per object
                        framing.verify_parts(h.numpy(), res.nbytes, [p.numpy()], key, _LAYOUT,
                                             landed_checksum=res.checksum if way == "fused" else None)
                samples[f"{way}_get"].append(n * object_bytes / (time.perf_counter() - t0) / 1e9)
                assert all(g.outcome.ok for g in got)
                await store.remove(keys)
    finally:
        await store.close()
    out: dict[str, Any] = {"object_bytes": object_bytes, "objects": n, "rounds": rounds}
    for d in ("put", "get"):
        raw = samples[f"raw_{d}"]
        for way in WAYS:
            v = samples[f"{way}_{d}"]
            ratios = [a / b for a, b in zip(v, raw)]
            out[f"{way}_{d}"] = {"best_gbps": round(max(v), 2), "median_gbps": round(statistics.median(v), 2),
                                 "vs_raw_median": round(statistics.median(ratios), 3),
                                 "vs_raw_best": round(max(ratios), 3)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hylinker.tools.lab.checksum", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--object-bytes", type=int, action="append", default=None,
                    help="object size with its 64-byte header (repeatable; default 64 KiB and 1 MiB)")
    ap.add_argument("--total-mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    host = host_record()
    rows = [anyio.run(measure, ob, args.total_mib << 20, args.rounds)
            for ob in (args.object_bytes or [64 << 10, 1 << 20])]
    host = finish(host)
    print(FAULTED_IN)
    for row in rows:
        for d in ("put", "get"):
            print(f"{row['object_bytes']:>9,} B {d}: " + "  ".join(
                f"{w} {row[f'{w}_{d}']['median_gbps']:.2f} GB/s (x{row[f'{w}_{d}']['vs_raw_median']:.2f})"
                for w in WAYS))
    print(describe(host))
    if args.json is not None:
        write_json(args.json, {"checksum_cost": rows, "host": host})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
