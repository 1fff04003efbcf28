"""The vLLM connector's data path at a real object shape, beside a memcpy of the same bytes.

Qwen3-Next-80B-A3B in vLLM (layer-outer layout, 12 layers per KV cache group, block 1,056):
one object is 12 segments of one page each (2.16 MB at TP 1, 1.08 MB at TP 2). This builds
that cache (:class:`~hylinker.integrations.vllm.pages.RawPages` over a buffer laid out as vLLM
0.32 places it), saves ``--objects`` blocks through :class:`PageTransfers` into an embedded store
and loads them into other blocks, timing each direction end to end (staging copy, framing,
checksum, store), and copies the same bytes row by row with ``torch`` as the baseline. Prints
and optionally writes JSON; asserts only that the loaded bytes are the saved ones.

    python -m hylinker.tools.lab.shapes --objects 16 --tp 1 --json out.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from ...integrations import store_host
from ...integrations.config import PluginConfig
from ...integrations.vllm.pages import PageTransfers, RawPages
from ...integrations.vllm.plan import TransferPlan
from ..bench.host import describe, finish, host_record
from ..bench.output import write_json
from ..harness.shapes import QWEN3_NEXT_80B, poll_loads


def real_pages(tp: int, num_blocks: int, device: str = "cpu") -> RawPages:
    g = QWEN3_NEXT_80B
    page = g.vllm_block_size(tp) * g.kv_bytes_per_token(tp)
    layers = len(g.full_attention_layers)
    buf = torch.randint(-128, 127, (layers * num_blocks * page,), dtype=torch.int8, device=device)
    kv = {f"model.layers.{4 * i + 3}.self_attn.attn": buf[i * num_blocks * page:(i + 1) * num_blocks * page]
          .view(num_blocks, 1, 1, page) for i in range(layers)}
    return RawPages(kv, num_blocks)


def measure(tp: int, objects: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """``device`` "cuda": the cache in GPU memory, moved by the connector's device path (the
    row copy baseline is then a device-to-device copy; ``save_call_s``: what the step pays)."""
    nb = 2 * objects + 1
    pages = real_pages(tp, nb, device)
    obj_bytes = sum(pages.page_bytes)
    host = store_host.acquire(PluginConfig.from_extra_config(
        {"capacity_mb": 2 * objects * obj_bytes // (1 << 20) + 64}, where="bench_shapes"))
    pt = PageTransfers(host, pages, fingerprint=b"b" * 32, with_state=False,
                       staging_bytes=(objects + 1) * obj_bytes)
    save_s, load_s, copy_s, call_s = [], [], [], []
    try:
        for rep in range(repeats):
            names = tuple(f"r{rep}-{i}" for i in range(objects))
            t0 = time.perf_counter()
            pt.save([TransferPlan(f"s{rep}", names, tuple(range(objects)))])
            call_s.append(time.perf_counter() - t0)
            assert pt.drain(600.0) and pt.statistics().saves_skipped == 0
            save_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pt.load(TransferPlan(f"l{rep}", names, tuple(range(objects, 2 * objects))))
            ok, bad = poll_loads(pt, 600.0)
            load_s.append(time.perf_counter() - t0)
            assert ok == {f"l{rep}"}, bad
            for r in pages.raws:
                assert torch.equal(r[objects:2 * objects], r[:objects])
            t0 = time.perf_counter()
            for r in pages.raws:
                for i in range(objects):
                    r[2 * objects].copy_(r[i])
            if device != "cpu":
                torch.cuda.synchronize()
            copy_s.append(time.perf_counter() - t0)
    finally:
        pt.close(30.0)
        store_host.release(host)
    total = objects * obj_bytes
    return {"tp": tp, "objects": objects, "object_bytes": obj_bytes, "segments": len(pages.raws),
            "save_gbps": round(total / min(save_s) / 1e9, 3), "load_gbps": round(total / min(load_s) / 1e9, 3),
            "row_copy_gbps": round(total / min(copy_s) / 1e9, 3), "save_call_s": min(call_s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hylinker.tools.lab.shapes", description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=16, help="objects per save and per load")
    ap.add_argument("--tp", default="1,2", help="tensor parallel sizes (the object shape of one rank)")
    ap.add_argument("--repeats", type=int, default=3, help="the best of this many is reported")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    host = host_record()
    results = [measure(int(tp), args.objects, args.repeats) for tp in args.tp.split(",")]
    host = finish(host)
    for r in results:
        print(f"TP {r['tp']}: object {r['object_bytes'] / 1e6:.2f} MB in {r['segments']} segments; "
              f"save {r['save_gbps']} GB/s, load {r['load_gbps']} GB/s, row copy {r['row_copy_gbps']} GB/s")
    print(describe(host))
    if args.json:
        write_json(args.json, {"host": host, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
