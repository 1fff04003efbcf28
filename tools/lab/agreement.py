"""The cost of agreeing a lookup across ranks, against the single-rank lookup, in one run.

``python -m hylinker.tools.lab.agreement --ranks 2 --json PATH`` starts N rank processes
(gloo on loopback, a shared loopback Mooncake master). Each rank builds two linkers over the same
layout and store: one with a :class:`~hylinker.runtime.linker.agreement.GlooAgreement`, one without
(:class:`~hylinker.runtime.linker.agreement.SingleRank`). The agreed linker stores a set of prompts
(their offloads agreed); then both linkers look the prompts up again with empty device trees (the
full path: device match, store probe, and for the agreed one the round), interleaved, so both
see the same machine load. The JSON gives per rank: lookup µs p50/p99 of each linker, the
round's own µs, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...components.keys import page_keys
from ...components.pools import HybridPools
from ...runtime.linker.agreement import Agreement, GlooAgreement
from ...runtime.linker.config import LinkerConfig
from ...runtime.linker.facade import Linker
from ...testing.content import SyntheticContent, preset_layout
from ..bench.output import write_json
from ..report import percentiles

PAGE = 64


def _us(values: list[float]) -> dict[str, float]:
    return {k: round(v, 1) for k, v in percentiles([v * 1e6 for v in values], (50, 99)).items()}


async def bench_rank(rank: int, size: int, agreement: Agreement, address: str, prompts: int,
                     rounds: int) -> dict[str, Any]:
    from ...stores.mooncake import MooncakeConfig, MooncakeStore

    layout = preset_layout("kimi", PAGE, PAGE, tp_rank=rank, tp_size=size, replicated=("kv", "draft"))
    store = await MooncakeStore.open(MooncakeConfig(master_address=address, segment_bytes=128 << 20))
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 30000, size=8 * PAGE + 3, dtype=np.int64) for _ in range(prompts)]
    cfg = LinkerConfig(resilience=None, touch=False)
    times: dict[str, list[float]] = {"single": [], "agreed": []}
    try:
        pools_a = HybridPools(layout, kv_pages=512, mamba_slots=32)
        pools_s = HybridPools(layout, kv_pages=512, mamba_slots=32)
        content = SyntheticContent(pools_a, seed=0)
        async with Linker(layout, pools_a, store, cfg, salt="bench", agreement=agreement) as agreed, \
                Linker(layout, pools_s, store, cfg, salt="bench") as single:
            for i, t in enumerate(tokens):  # store every prompt (agreed offloads)
                async with agreed.session(f"w{i}", t) as req:
                    await agreed.lookup(req)
                    await agreed.load(req)
                    keys = page_keys(req.tokens, PAGE, req.seed)
                    rows = agreed.extend(req, len(t))
                    content.write_pages(keys[:8], rows[: 8 * PAGE])
                    agreed.working_slot(req)
                    for depth in agreed.checkpoint_depths(req):
                        slot = agreed.checkpoint_slot(req)
                        content.write_state(keys[depth // PAGE - 1], slot)
                        await agreed.insert(req, depth, checkpoint_slot=slot)
                await agreed.drain()
            lookups = agreement.round_seconds.get(("requests", "lookup"))
            before = lookups.count if lookups is not None else 0
            for r in range(rounds):
                for i, t in enumerate(tokens):
                    order = (("single", single), ("agreed", agreed)) if (r + i) % 2 else \
                        (("agreed", agreed), ("single", single))
                    for name, lk in order:
                        lk.flush_device()
                        async with lk.session(f"{name}{r}.{i}", t) as req:
                            t0 = time.perf_counter()
                            hit = await lk.lookup(req)
                            times[name].append(time.perf_counter() - t0)
                            if hit.store_tokens == 0:
                                raise RuntimeError(f"rank {rank}: {name} lookup missed the stored prompt")
            round_s = agreement.round_seconds[("requests", "lookup")].since(before)
            # the bare collective under the round, on this thread (blocks the loop: bench only)
            raw, bare = _raw_rounds(agreement, len(round_s))
    finally:
        await store.close()
    s, a = _us(times["single"]), _us(times["agreed"])
    return {"rank": rank, "lookups": len(times["agreed"]), "single_lookup_us": s, "agreed_lookup_us": a,
            "round_us": _us(round_s), "raw_all_gather_object_us": _us(raw) if raw else None,
            "raw_slot_round_us": _us(bare) if bare else None,
            "ratio_p50": round(a["p50"] / s["p50"], 2) if s["p50"] else None,
            "ratio_p99": round(a["p99"] / s["p99"], 2) if s["p99"] else None}


def _raw_rounds(agreement: Agreement, n: int) -> tuple[list[float], list[float]]:
    """A lookup-sized value gathered straight on this thread (blocks the loop: bench only), by
    ``all_gather_object`` and by the round's own one-slot collective, interleaved."""
    if not isinstance(agreement, GlooAgreement):
        return [], []
    import torch.distributed as dist

    value = (("lookup", "r"), (0, (4, 8), (12, 16)))
    objects: list[float] = []
    slots: list[float] = []
    for _ in range(n):
        got: list[Any] = [None] * agreement.size
        t0 = time.perf_counter()
        dist.all_gather_object(got, value, group=agreement._groups["requests"])
        objects.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        agreement._round("requests", value)
        slots.append(time.perf_counter() - t0)
    return objects, slots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hylinker.tools.lab.agreement", description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from ...stores.mooncake_master import MooncakeMaster
    from ..ranks import launch

    with MooncakeMaster() as master:
        results = launch(args.ranks, bench_rank, master.address, args.prompts, args.rounds)
    out = {"ranks": args.ranks, "per_rank": results}
    print(json.dumps(out, indent=2))
    if args.json is not None:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
