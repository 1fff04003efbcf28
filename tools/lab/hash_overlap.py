"""The floor of a checksummed offload over Mooncake on this host, with no runtime around it.

``python -m hylinker.tools.lab.hash_overlap --json bench-results/hash_overlap.json``

One Mooncake client with a 1 GiB in-process segment (populated first, steady state) on a fresh
loopback master. ``--objects`` objects of ``--object-kib`` each, every object a 64-byte header
and two row pieces (the shape of a two-layer MLA page), all in registered memory. Per round,
side by side, in alternating order:

* **plain**: one ``batch_put_from_multi_buffers`` of every object, nothing hashed: what
  SGLang's ``MooncakeDirectLinker`` does for a node's pages (without its existence check);
* **overlapped**: one thread seals the objects sub-batch by sub-batch (XXH3 over the row
  pieces into the header, ``framing.seal_parts``) while a second thread puts each sub-batch as
  soon as it is sealed (sub-batches of 1/6, 1/3, 1/2 of the objects): the best overlap of
  hashing and copying any linker that checksums every byte gets here, with no event loop,
  queue or retry rule around it;
* **serial**: seal every object, then one put: no overlap at all.

The ratio plain / overlapped is the most a checksumming offload can reach against a plain one
on this machine; hylinker's plugin runs inside that bound. The client copies into its own
segment with a local memcpy unless ``MC_STORE_MEMCPY=0`` (then over loopback TCP); the JSON
records the variable. Figures are medians over
``--rounds`` rounds; compare ratios of one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import itertools
import queue
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..bench.host import describe, finish, host_record
from ..bench.mooncake import copy_path_setting
from ..bench.output import write_json

MIB = 1 << 20
FINGERPRINT = b"overlap-bench-layout"


def _sub_batches(n: int) -> list[tuple[int, int]]:
    """1/6, 1/3 and 1/2 of the objects: for 48 objects 8 / 16 / 24, the ramp the runtime's
    in-place offload of 48 x 1 MiB objects makes (``runtime/dataplane/in_place.py``), kept at that shape
    for every size so the first put waits for a small sub-batch's hash."""
    a, b = max(1, n // 6), max(2, n // 2)
    cuts = sorted({0, min(a, n), min(b, n), n})
    return [(lo, hi) for lo, hi in itertools.pairwise(cuts) if hi > lo]


def run(object_kib: int, objects: int, rounds: int, segment_mib: int = 1024) -> dict[str, Any]:
    import torch

    from ...stores import framing
    from ...stores.mooncake_client import MooncakeConfig, import_mooncake_store, setup_client
    from ...stores.mooncake_master import MooncakeMaster
    from ..bench.mooncake import anonymous_mappings, populate_new_segments

    size = object_kib * 1024
    half = (size - framing.HEADER_BYTES) // 2
    times: dict[str, list[float]] = {"plain": [], "overlapped": [], "serial": []}
    with MooncakeMaster() as master:
        before = anonymous_mappings()
        client = setup_client(import_mooncake_store(), MooncakeConfig(
            master_address=master.address, segment_bytes=segment_mib * MIB, detect_exists=False))
        try:
            populated = populate_new_segments(before)
            rows = torch.randint(0, 256, (objects * size,), dtype=torch.uint8)
            rows_np = rows.numpy()
            base = rows.data_ptr()
            if client.register_buffer(base, rows.numel()) != 0:
                raise RuntimeError("Mooncake refused to register the rows")
            # an object: header at its start, then two pieces (the rest of the object)
            ptrs = [[base + i * size, base + i * size + 64, base + i * size + 64 + half] for i in range(objects)]
            sizes = [[64, half, size - 64 - half]] * objects
            heads = [rows_np[i * size: i * size + 64] for i in range(objects)]
            pieces = [[rows_np[i * size + 64: i * size + 64 + half], rows_np[i * size + 64 + half: (i + 1) * size]]
                      for i in range(objects)]
            batches = _sub_batches(objects)

            def put(keys: list[str], lo: int, hi: int) -> None:
                codes = client.batch_put_from_multi_buffers(keys[lo:hi], ptrs[lo:hi], sizes[lo:hi])
                if any(int(c) != 0 for c in codes):
                    raise RuntimeError(f"put failed: {list(codes)}")

            def seal(keys: list[str], lo: int, hi: int) -> None:
                for i in range(lo, hi):
                    framing.seal_parts(heads[i], pieces[i], keys[i], FINGERPRINT)

            def plain(keys: list[str]) -> None:
                put(keys, 0, objects)

            def serial(keys: list[str]) -> None:
                seal(keys, 0, objects)
                put(keys, 0, objects)

            def overlapped(keys: list[str]) -> None:
                sealed: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
                failed: list[BaseException] = []

                def sealer() -> None:
                    try:
                        for lo, hi in batches:
                            seal(keys, lo, hi)
                            sealed.put((lo, hi))
                    except BaseException as exc:  # surfaced below, never a hang
                        failed.append(exc)
                        sealed.put((-1, -1))

                th = threading.Thread(target=sealer, name="sealer")
                th.start()
                try:
                    for _ in batches:
                        lo, hi = sealed.get()
                        if lo < 0:
                            break
                        put(keys, lo, hi)
                finally:
                    th.join()
                if failed:
                    raise failed[0]

            cases: dict[str, Callable[[list[str]], None]] = {
                "plain": plain, "overlapped": overlapped, "serial": serial}
            for r in range(rounds + 1):  # round 0 warms the client, not counted
                order = list(cases) if r % 2 else list(reversed(cases))
                for name in order:
                    keys = [f"overlap-{uuid.uuid4().hex[:12]}-{i}" for i in range(objects)]
                    t0 = time.perf_counter()
                    cases[name](keys)
                    dt = time.perf_counter() - t0
                    if r:
                        times[name].append(dt)
        finally:
            client.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = objects * size
    return {
        "object_kib": object_kib, "objects": objects, "rounds": rounds, "populated_bytes": populated,
        "sub_batches": batches,
        **{f"{k}_ms": round(v * 1e3, 2) for k, v in med.items()},
        **{f"{k}_gbps": round(nbytes / v / 1e9, 2) for k, v in med.items()},
        "overlapped_vs_plain": round(med["plain"] / med["overlapped"], 2),
        "serial_vs_plain": round(med["plain"] / med["serial"], 2),
        "runs_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in times.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hylinker.tools.lab.hash_overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--object-kib", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--objects", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.objects < 1 or args.rounds < 1 or any(k < 1 for k in args.object_kib):
        parser.error("--objects, --rounds and --object-kib must be positive")
    host = host_record()
    results = [run(kib, args.objects, args.rounds) for kib in args.object_kib]
    print(table(results))
    host = finish(host)
    print(describe(host))
    if args.json is not None:
        payload = {"results": results, "argv": list(sys.argv[1:] if argv is None else argv),
                   "MC_STORE_MEMCPY": copy_path_setting(), "host": host}
        write_json(args.json, payload)
    return 0


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| object | plain put | checksum overlapped with the put | checksum, then put | overlapped / plain |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['object_kib']} KiB x {r['objects']} | {r['plain_ms']} ms ({r['plain_gbps']} GB/s) | "
              f"{r['overlapped_ms']} ms ({r['overlapped_gbps']} GB/s) | {r['serial_ms']} ms | "
              f"{r['overlapped_vs_plain']} |" for r in results]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
