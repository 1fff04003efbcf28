"""One TP rank of SGLang's cache in its own process, for the two-rank agreement test.

``python -m hylinker.testing.sglang_ranks --rank R --world 2 --port P --master HOST:PORT --out F``
joins a gloo process group on loopback, builds SGLang's ``UnifiedRadixCache`` (FULL MLA + MAMBA)
with that group as its TP group and ``HylinkerLinker`` on a shared Mooncake master, and drives the
same requests as the other rank. SGLang's own code intersects the ranks' lookups
(``_sync_restorable_prefix``: a MIN all-reduce of a 0/1 mask over the TP group) and reduces load
and offload results the same way. The script writes what this rank saw as JSON to ``--out``.

Scenario: states are stored at three depths (``len(A)``, ``len(A+B)``, ``len(A+B+C)``); then each
rank loses a *different* one of its own (per-rank) state objects — rank 0 the deepest, rank 1 the
middle one — so the ranks' restorable sets differ ({24, 40} and {24, 48}) and only 24 is common.
``--damage missing``: only rank 1 loses its deepest state ({24, 40, 48} and {24, 40}: 40 is
common); ``--damage corrupt``: rank 1's deepest state is damaged, not missing.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..components.layout import PoolKind

A = list(range(1000, 1024))
B = list(range(2000, 2016))
C = list(range(3000, 3008))
D = [7, 8, 9]


def run(rank: int, world: int, port: int, master: str, core: str, damage: str = "remove") -> dict[str, Any]:
    import torch.distributed as dist

    from .sglang_cache import CacheSpec, SGLangCache, page_keys

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict[str, Any] = {"rank": rank}
    cache = SGLangCache(
        CacheSpec(tree_core=core),
        {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang",
         "linker_extra_config": {"store": "mooncake", "master": master, "segment_mb": 32}},
        tp_group=dist.group.WORLD)
    try:
        linker = cache.linker
        out["tp_rank"] = linker.tp_rank
        out["kv_key"] = linker.object_keys("kv", ["k"])[0]
        out["state_key"] = linker.object_keys("mamba", ["k"])[0]
        for tokens in (A, A + B, A + B + C):
            cache.serve(tokens)
        cache.flush()
        dist.barrier()
        keys = page_keys(A + B + C + D)
        if damage == "remove":
            lose = {0: len(A + B + C), 1: len(A + B)}[rank]  # independent faults: each its own state
            gone = linker.object_keys("mamba", [keys[lose - 1]])
            out["removed"] = linker.data.call_store(linker.store.remove, gone).result(timeout=10)
        elif damage == "missing":  # rank 1 alone loses its deepest state; rank 0 keeps every object
            gone = linker.object_keys("mamba", [keys[len(A + B + C) - 1]]) if rank == 1 else []
            out["removed"] = linker.data.call_store(linker.store.remove, gone).result(timeout=10) if gone else 0
        elif rank == 1:  # "corrupt": rank 1's deepest state is damaged, rank 0's is whole
            from ..stores import framing

            key = linker.object_keys("mamba", [keys[len(A + B + C) - 1]])[0]
            cache.corrupt_object(key, framing.framed_size(linker.data.plane.pools[PoolKind.MAMBA].payload_bytes))
        dist.barrier()  # both faults are in place before either rank looks up

        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        transfers = [PoolTransfer(name=PoolName("kv"), keys=keys),
                     PoolTransfer(name=PoolName("mamba"), keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        out["own_lookup"] = linker.lookup("probe", transfers)  # this rank alone, before SGLang's MIN
        t0 = time.monotonic()
        served = cache.serve(A + B + C + D)  # SGLang's match_prefix: lookup, then MIN over the group
        out["served"] = {"device_hit": served.device_hit, "store_hit": served.store_hit,
                         "loaded": served.loaded, "aborted": served.aborted,
                         "restore_mismatches": served.restore_mismatches, "s": round(time.monotonic() - t0, 3)}
        if damage == "corrupt":  # both ranks aborted it; the damaged object is gone: a retry
            retry = cache.serve(A + B + C + D)
            out["retry"] = {"device_hit": retry.device_hit, "store_hit": retry.store_hit, "loaded": retry.loaded,
                            "aborted": retry.aborted, "restore_mismatches": retry.restore_mismatches}
        # the restored state and KV pages are this rank's own bytes: one more request agrees too
        again = cache.serve(A + B + [5, 6])
        out["again"] = {"device_hit": again.device_hit, "loaded": again.loaded, "aborted": again.aborted,
                        "restore_mismatches": again.restore_mismatches}
        cache.settle()
        cache.evict_all()
        out["leaks"] = cache.leaks()
        out["stats"] = {k: v for k, v in linker.statistics().items() if not k.endswith("_us")}
        dist.barrier()
    finally:
        cache.close()
        dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--core", default="python")
    ap.add_argument("--out", required=True)
    ap.add_argument("--damage", choices=["remove", "missing", "corrupt"], default="remove",
                    help="remove: each rank loses a different state; missing: rank 1 alone loses its deepest "
                         "state; corrupt: rank 1's deepest state is damaged")
    args = ap.parse_args(argv)
    from .sglang_cache import install_cpu_shims

    install_cpu_shims()
    result = run(args.rank, args.world, args.port, args.master, args.core, args.damage)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
