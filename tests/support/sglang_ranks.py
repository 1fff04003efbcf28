"""SGLang ranks, each its own process, as SGLang runs them: for the several-rank tests.

``python -m hylinker.tests.support.sglang_ranks --rank R --world N --port P --master HOST:PORT --out F``
joins a gloo process group on loopback, builds SGLang's ``UnifiedRadixCache`` with that group as
its TP group and ``HylinkerLinker`` on a shared Mooncake master, and drives the same requests as
the other ranks. SGLang's own code intersects the ranks' lookups (``_sync_restorable_prefix``: a
MIN all-reduce of a 0/1 mask over the TP group) and reduces load and offload results the same
way. The script writes what this rank saw as JSON to ``--out``; :func:`run_rank_processes` starts
every rank and collects them.

TP scenario (``--dcp 1``, FULL MLA + MAMBA, page 1): states are stored at three depths
(``len(A)``, ``len(A+B)``, ``len(A+B+C)``); then each rank loses a *different* one of its own
(per-rank) state objects — rank 0 the deepest, rank 1 the middle one — so the ranks' restorable
sets differ ({24, 40} and {24, 48}) and only 24 is common. ``--damage missing``: only rank 1
loses its deepest state ({24, 40, 48} and {24, 40}: 40 is common); ``--damage corrupt``: rank 1's
deepest state is damaged, not missing.

DCP scenario (``--dcp N``, N = world: each TP rank is DCP rank ``tp_rank``, SGLang's placement at
tp = dcp): ``get_parallel()`` publishes this process's DCP size and rank, SGLang's allocator hands
out widened pages of ``2 * N`` locs, and each rank writes and restores only the rows it owns
(checked at ``KVIndexTranslator``'s rows). ``--group`` picks the pool group
(:data:`DCP_GROUPS`). Prompts ``A``, ``A+B``, ``A+B+C`` of 64 tokens each are offloaded (with
Mamba states at 64, 128, 192), the device is flushed, and ``A+B+C+D`` is restored. ``--damage
none``: every rank restores all 192 tokens; ``missing``: rank 1 alone loses its KV object of the page
holding token :data:`DCP_LOST_TOKEN` (136), so its own lookup stops there (hybrid: at the state
below it, 128) and SGLang's MIN makes every rank restore that depth; ``corrupt``: that object is
damaged instead: every rank claims it, rank 1's load fails verification, SGLang's MIN aborts the
request on every rank, and the retry restores the common depth.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from ...components.layout import PoolKind

A = list(range(1000, 1024))
B = list(range(2000, 2016))
C = list(range(3000, 3008))
D = [7, 8, 9]

#: the DCP scenario's pool groups: name -> ``CacheSpec`` fields (page size 2, widened to 2 x dcp)
DCP_GROUPS: dict[str, dict[str, Any]] = {
    "dense-mha": {"model": "dense", "kv": "mha"},
    "full-mamba-mla": {"model": "hybrid", "kv": "mla", "mamba_extra_buffer": True},
}
DCP_A = list(range(1000, 1064))  # 64 tokens: one Mamba checkpoint (SGLang's grid is 64 here)
DCP_B = list(range(2000, 2064))
DCP_C = list(range(3000, 3064))
DCP_D = list(range(4000, 4010))
DCP_PAGE_SIZE = 2
#: rank 1 loses (or has damaged) its KV object of the tree page holding this token
DCP_LOST_TOKEN = 136


def _served(s: Any) -> dict[str, Any]:
    return {"device_hit": s.device_hit, "store_hit": s.store_hit, "loaded": s.loaded, "aborted": s.aborted,
            "restore_mismatches": s.restore_mismatches}


def _finish(cache: Any, out: dict[str, Any]) -> None:
    """Every offload reported; SGLang's own tree check (every node unlocked when idle); then the
    tree evicted and what stays allocated recorded (must be nothing)."""
    cache.settle()
    cache.cache.sanity_check()
    cache.evict_all()
    out["leaks"] = cache.leaks()
    out["stats"] = attrs.asdict(cache.linker.statistics())


def _restore(cache: Any, out: dict[str, Any], tokens: list[int], again: list[int], damage: str) -> None:
    """Serve ``tokens`` after the flush (SGLang's match_prefix: lookup, then MIN over the group);
    after ``corrupt`` (every rank aborted it, the damaged object removed) a retry; then ``again``,
    a request sharing the restored prefix; then :func:`_finish`."""
    t0 = time.monotonic()
    out["served"] = {**_served(cache.serve(tokens)), "s": round(time.monotonic() - t0, 3)}
    if damage == "corrupt":
        out["retry"] = _served(cache.serve(tokens))
    out["again"] = {k: v for k, v in _served(cache.serve(again)).items() if k != "store_hit"}
    _finish(cache, out)


def _lose(cache: Any, key: str, pool: PoolKind, damage: str) -> int:
    """Remove (``missing``) or damage (``corrupt``) the object under ``key``; returns how many
    objects were removed."""
    linker = cache.linker
    if damage == "corrupt":
        from ...stores import framing

        cache.corrupt_object(key, framing.framed_size(linker.data.plane.pools[pool].payload_bytes))
        return 0
    return int(linker.data.call_store(linker.store.remove, [key]).result(timeout=10))


def run(rank: int, world: int, port: int, master: str, core: str, damage: str = "remove") -> dict[str, Any]:
    """The TP scenario (see the module docstring)."""
    import torch.distributed as dist

    from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache, page_keys

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
        deepest = linker.object_keys("mamba", [keys[len(A + B + C) - 1]])[0]
        if damage == "remove":  # independent faults: each rank its own state
            lose = {0: len(A + B + C), 1: len(A + B)}[rank]
            out["removed"] = _lose(cache, linker.object_keys("mamba", [keys[lose - 1]])[0], PoolKind.MAMBA, "missing")
        else:  # rank 1 alone loses (or has damaged) its deepest state; rank 0 keeps every object
            out["removed"] = _lose(cache, deepest, PoolKind.MAMBA, damage) if rank == 1 else 0
        dist.barrier()  # every fault is in place before any rank looks up

        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        transfers = [PoolTransfer(name=PoolName("kv"), keys=keys),
                     PoolTransfer(name=PoolName("mamba"), keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        out["own_lookup"] = linker.lookup("probe", transfers)  # this rank alone, before SGLang's MIN
        _restore(cache, out, A + B + C + D, A + B + [5, 6], damage)
        dist.barrier()
    finally:
        cache.close()
        dist.destroy_process_group()
    return out


def run_dcp(rank: int, world: int, port: int, master: str, core: str, group: str,
            damage: str = "none") -> dict[str, Any]:
    """The DCP scenario (see the module docstring): this process is TP rank and DCP rank ``rank``
    of ``world``."""
    import torch.distributed as dist

    from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache, page_keys

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict[str, Any] = {"rank": rank}
    spec = CacheSpec(page_size=DCP_PAGE_SIZE, dcp_size=world, dcp_rank=rank, num_layers=3, kv_pages=512,
                     tree_core=core, **DCP_GROUPS[group])
    cache = SGLangCache(
        spec, {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang",
               "linker_extra_config": {"store": "mooncake", "master": master, "segment_mb": 32}},
        tp_group=dist.group.WORLD)
    try:
        linker = cache.linker
        W = cache.tree_page
        out.update(tp_rank=linker.tp_rank, dcp=[linker.dcp_size, linker.dcp_rank], tree_page=W,
                   allocator_page=int(cache.allocator.page_size))
        prompt = DCP_A + DCP_B + DCP_C
        keys = page_keys(prompt + DCP_D, W)
        out["kv_keys"] = linker.object_keys("kv", keys[: len(prompt) // W])
        out["first"] = [_served(cache.serve(tokens)) for tokens in (DCP_A, DCP_A + DCP_B, prompt)]
        cache.settle()
        frame = linker.data.plane.pools[PoolKind.FULL].payload_bytes + 4096
        stored = cache.stored_bytes(out["kv_keys"][0], frame)
        out["first_object"] = None if stored is None else stored.hex()
        cache.flush()
        dist.barrier()
        out["removed"] = 0
        if damage != "none" and rank == 1:
            out["removed"] = _lose(cache, out["kv_keys"][DCP_LOST_TOKEN // W], PoolKind.FULL, damage)
        dist.barrier()  # every fault is in place before any rank looks up

        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        transfers = [PoolTransfer(name=PoolName("kv"), keys=keys)]
        if not cache.dense:
            transfers.append(PoolTransfer(name=PoolName("mamba"), keys=keys[-1:],
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES))
        out["own_lookup"] = [n * W for n in linker.lookup("probe", transfers)]  # tokens, before the MIN
        _restore(cache, out, prompt + DCP_D, DCP_A + DCP_B + [5, 6], damage)
        dist.barrier()
    finally:
        cache.close()
        dist.destroy_process_group()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rank_processes(out_dir: Path, master: str, world: int, *args: str,
                       timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Every rank of this module (``args`` added to each command line), each its own process on
    one fresh gloo port; returns what each wrote, in rank order. A rank that fails raises with
    the end of its log."""
    port = _free_port()
    procs = []
    for rank in range(world):
        cmd = [sys.executable, "-m", "hylinker.tests.support.sglang_ranks", "--rank", str(rank), "--world", str(world),
               "--port", str(port), "--master", master, "--out", str(out_dir / f"rank{rank}.json"), *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode != 0:
            raise RuntimeError(f"rank {rank} exited {p.returncode}:\n{log[-4000:]}")
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--core", default="python")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dcp", type=int, default=1,
                    help="1: the TP scenario; the world size: the DCP scenario (every rank a DCP rank)")
    ap.add_argument("--group", choices=sorted(DCP_GROUPS), default="full-mamba-mla", help="the DCP scenario's pools")
    ap.add_argument("--damage", choices=["remove", "missing", "corrupt", "none"], default=None,
                    help="TP (default remove): remove: each rank loses a different state; missing: rank 1 alone "
                         "loses its deepest state; corrupt: rank 1's deepest state is damaged. DCP (default none): "
                         "missing/corrupt: rank 1's KV object of the page holding DCP_LOST_TOKEN")
    args = ap.parse_args(argv)
    if args.dcp not in (1, args.world):
        ap.error(f"--dcp must be 1 or the world size {args.world}")
    from hylinker.tools.harness.sglang_cache import install_cpu_shims

    install_cpu_shims()
    if args.dcp > 1:
        if args.damage == "remove":
            ap.error("--damage remove is the TP scenario's")
        result = run_dcp(args.rank, args.world, args.port, args.master, args.core, args.group, args.damage or "none")
    else:
        if args.damage == "none":
            ap.error("--damage none is the DCP scenario's")
        result = run(args.rank, args.world, args.port, args.master, args.core, args.damage or "remove")
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
