"""What layer-wise release could gain on Mooncake: ranged gets per layer group against one whole get.

``python -m hylinker.tools.lab.layer_ranges --json bench-results/layer_ranges.json``

SGLang's own linker hands the forward layer ``i`` as soon as its bytes landed, so the first
layers' compute overlaps the later layers' loads. hylinker stores a page as one object holding
every layer, and every store call completes per object, so that overlap needs ranged gets: one
call per group of layers, each reading the group's byte range out of every object of the load
(Mooncake's ``batch_get_session_start`` then ``batch_get_into_multi_buffer_ranges``). This
measures whether that pays, before the frame format and the load path are built for it.

On a fresh loopback master, ``--objects`` objects of each ``--object-kib`` size are put (random
bytes, registered memory), then per round, side by side, in alternating order:

* **whole**: one ``batch_get_into`` of every object (what a load does today);
* **ranged**: a get session, then one ``batch_get_into_multi_buffer_ranges`` per group of
  layers (``--layers`` layers split into each of ``--groups`` groups; ``G = L`` is per layer),
  then the session's end. Recorded: the session's start, when the first group landed (when the
  forward could start), and when the last one did.

Every read's bytes are compared with what was put: a mismatch fails the run. Two setups: the
client's own segment in its process (``in-process``, the setup of ``hylinker bench-sglang``),
and a segment held by a storage-only process, so every byte crosses loopback TCP
(``peer over TCP``). Medians over ``--rounds``; compare ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..bench.host import describe, finish, host_record
from ..bench.mooncake import copy_path_setting, segment_process
from ..bench.output import write_json

MIB = 1 << 20


def _groups(layers: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` contiguous layer ranges covering ``layers`` layers, as even as they divide."""
    cuts = [round(g * layers / groups) for g in range(groups + 1)]
    return [(cuts[g], cuts[g + 1]) for g in range(groups)]


def measure(client: Any, object_bytes: int, objects: int, layers: int, group_counts: Sequence[int],
            rounds: int, tag: str) -> list[dict[str, Any]]:
    """Whole gets against ranged gets for each group count, on one connected client."""
    import numpy as np

    if object_bytes % layers:
        raise ValueError(f"{object_bytes} bytes do not split into {layers} equal layers")
    per_layer = object_bytes // layers
    src = np.random.default_rng(object_bytes + layers).integers(0, 256, objects * object_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    for buf in (src, dst):
        if client.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            raise RuntimeError("Mooncake refused to register a buffer")
    keys = [f"layer-ranges/{tag}/{object_bytes}/{layers}/{i}" for i in range(objects)]
    codes = client.batch_put_from(keys, [src.ctypes.data + i * object_bytes for i in range(objects)],
                                  [object_bytes] * objects)
    if any(int(c) != 0 for c in codes):
        raise RuntimeError(f"put failed: {list(codes)}")

    def check(what: str) -> None:
        if not np.array_equal(dst, src):
            raise RuntimeError(f"{what}: the bytes read differ from the bytes put")
        dst[:] = 0

    def whole() -> dict[str, float]:
        t = time.perf_counter()
        got = client.batch_get_into(keys, [dst.ctypes.data + i * object_bytes for i in range(objects)],
                                    [object_bytes] * objects)
        s = time.perf_counter() - t
        if [int(c) for c in got] != [object_bytes] * objects:
            raise RuntimeError(f"whole get failed: {list(got)}")
        check("whole get")
        return {"all_s": s}

    def ranged(spans: list[tuple[int, int]]) -> dict[str, float]:
        t = time.perf_counter()
        if any(int(c) != 0 for c in client.batch_get_session_start(keys)):
            raise RuntimeError("get session refused")
        out = {"session_s": time.perf_counter() - t}
        try:
            for n, (lo, hi) in enumerate(spans):
                off, size = lo * per_layer, (hi - lo) * per_layer
                got = client.batch_get_into_multi_buffer_ranges(
                    keys, [[dst.ctypes.data + i * object_bytes + off] for i in range(objects)],
                    [[size]] * objects, [[off]] * objects)
                if [int(c) for c in got] != [size] * objects:
                    raise RuntimeError(f"ranged get of layers {lo}-{hi - 1} failed: {list(got)}")
                if n == 0:
                    out["first_s"] = time.perf_counter() - t
        finally:
            client.batch_get_session_end(keys)
        out["all_s"] = time.perf_counter() - t
        check(f"ranged get in {len(spans)} groups")
        return out

    runs: dict[str, Callable[[], dict[str, float]]] = {"whole": whole}
    for g in group_counts:
        runs[f"groups_{g}"] = functools.partial(ranged, _groups(layers, g))
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(runs[name]())
    with contextlib.suppress(Exception):
        client.batch_remove(keys) if hasattr(client, "batch_remove") else None
    for buf in (src, dst):
        with contextlib.suppress(Exception):
            client.unregister_buffer(buf.ctypes.data)

    def ms(name: str, field: str) -> float:
        return round(statistics.median(s[field] for s in samples[name]) * 1e3, 3)

    rows = []
    for g in group_counts:
        name = f"groups_{g}"
        rows.append({"object_kib": object_bytes // 1024, "objects": objects, "layers": layers, "groups": g,
                     "whole_ms": ms("whole", "all_s"), "session_ms": ms(name, "session_s"),
                     "first_group_ms": ms(name, "first_s"), "all_groups_ms": ms(name, "all_s"),
                     "rounds": rounds, "verified": True})
    return rows


def run(object_kib: Sequence[int], objects: int, layers: Sequence[int], groups: Sequence[int] | None,
        rounds: int, setups: Sequence[str], segment_mib: int = 1024) -> list[dict[str, Any]]:
    from ...stores.mooncake_client import MooncakeConfig, import_mooncake_store, setup_client
    from ...stores.mooncake_master import MooncakeMaster

    mooncake_store = import_mooncake_store()
    results: list[dict[str, Any]] = []
    for setup in setups:
        with contextlib.ExitStack() as stack:
            master = stack.enter_context(MooncakeMaster().start())
            if setup == "peer-tcp":
                segment_process(stack, master.address, segment_mib * MIB)
            client = setup_client(mooncake_store, MooncakeConfig(
                master_address=master.address, segment_bytes=0 if setup == "peer-tcp" else segment_mib * MIB,
                local_buffer_bytes=64 * MIB))
            stack.callback(client.close)
            for kib in object_kib:
                for n_layers in layers:
                    counts = sorted({g for g in (groups or (2, n_layers)) if 1 <= g <= n_layers})
                    for row in measure(client, kib * 1024, objects, n_layers, counts, rounds, setup):
                        results.append({"setup": setup, **row})
    return results


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| setup | object | layers | groups | whole get ms | ranged: session ms | first group ms | all groups ms |"
             " first group / whole | all / whole |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['setup']} | {r['object_kib']} KiB x {r['objects']} | {r['layers']} | {r['groups']} | "
                     f"{r['whole_ms']} | {r['session_ms']} | {r['first_group_ms']} | {r['all_groups_ms']} | "
                     f"{r['first_group_ms'] / r['whole_ms']:.2f} | {r['all_groups_ms'] / r['whole_ms']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hylinker.tools.lab.layer_ranges", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--object-kib", type=int, nargs="+", default=[64, 1024], help="object sizes (KiB)")
    parser.add_argument("--objects", type=int, default=48, help="objects per load")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8], help="layers per object")
    parser.add_argument("--groups", type=int, nargs="+", default=None,
                        help="layer groups per ranged load (default: 2 and one per layer)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--setups", nargs="+", choices=["in-process", "peer-tcp"],
                        default=["in-process", "peer-tcp"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.objects < 1 or args.rounds < 1 or min(args.object_kib) < 1 or min(args.layers) < 1:
        parser.error("--objects, --rounds, --object-kib and --layers must be positive")
    host = host_record()
    results = run(args.object_kib, args.objects, args.layers, args.groups, args.rounds, args.setups)
    print(table(results))
    host = finish(host)
    print(describe(host))
    if args.json is not None:
        write_json(args.json, {"results": results, "argv": list(sys.argv[1:] if argv is None else argv),
                               "MC_STORE_MEMCPY": copy_path_setting(), "host": host})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
