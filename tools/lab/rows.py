"""The row-described copy routine against plain per-object copies of the same bytes (µs per object).

``python -m hylinker.tools.lab.rows``: :func:`hylinker.stores.rows.gather` (rows of every
segment into a slot, then XXH3 of the payload, one Python loop per object) next to one
``numpy.copyto`` per object of the same bytes from a contiguous source, with and without XXH3;
at 64 KiB in 4 segments, 1 MiB in 4 and 768 KiB in 24. Best of the repetitions, printed with
the host's load: what the figures in docs/design/decisions.md's "no native code" decision come from.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import xxhash

from ...stores import framing
from ...stores import rows as R

UNIT = 64


def measure(segments: int, row_bytes: int, n: int, reps: int = 7) -> dict[str, float]:
    rng = np.random.default_rng(0)
    segs = [rng.integers(0, 256, n * UNIT * row_bytes, dtype=np.uint8) for _ in range(segments)]
    keys = [f"k{i}" for i in range(n)]
    payload = UNIT * row_bytes * segments
    batch = R.RowBatch(keys, R.digests_of(keys), segs, [row_bytes] * segments, UNIT,
                       np.arange(n, dtype=np.int64) * UNIT, framing.header_template(b"x" * 32, payload))
    slot = -(-(payload + 64) // 64) * 64
    arena = np.zeros((n, slot), dtype=np.uint8)
    slots = [arena[i] for i in range(n)]
    src = rng.integers(0, 256, (n, payload + 64), dtype=np.uint8)

    def memcpy(hashed: bool) -> None:
        for i in range(n):
            np.copyto(slots[i][:payload + 64], src[i])
            if hashed:
                xxhash.xxh3_64_intdigest(slots[i][64:payload + 64].data)

    ways: dict[str, Callable[[], object]] = {
        "gather_xxh3": lambda: R.gather(batch, slots, True), "gather": lambda: R.gather(batch, slots, False),
        "memcpy_xxh3": lambda: memcpy(True), "memcpy": lambda: memcpy(False)}
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(reps):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return {k: round(v, 2) for k, v in best.items()}


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m hylinker.tools.lab.rows", description=__doc__.splitlines()[0]).parse_args(argv)
    print("load average", os.getloadavg())
    for label, segments, row_bytes, n in (("64 KiB, 4 segments", 4, 256, 256), ("1 MiB, 4 segments", 4, 4096, 64),
                                          ("768 KiB, 24 segments", 24, 512, 64)):
        print(label, measure(segments, row_bytes, n))
    print("load average", os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
