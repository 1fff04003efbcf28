"""Benchmark: what keying a vLLM request by vLLM's extra keys costs the scheduler.

``python -m hylinker.tools.lab.vllm_keys [--tokens 16384,131072] [--blocks 16,384] [--repeats 5] [--json PATH]``

Per prompt length and block size, milliseconds (best of ``repeats``) to compute every block key
of one request, once per request in the connector (keys are kept and extended as it grows):

* ``plain_chain_ms``: the token chain alone (:class:`~hylinker.integrations.vllm.plan.BlockKeys`
  without extra keys: what the connector did before it keyed on vLLM's extra keys);
* ``plain_request_ms``: a plain vLLM ``Request`` through
  :func:`~hylinker.integrations.vllm.request_keys.request_block_keys` (vLLM's extra-key function
  asked for every block, none found);
* ``salt_and_image_ms``: a request with a ``cache_salt`` and one image over 4,000 tokens.

Needs vLLM (the ``.venv-vllm`` environment). Writes JSON with the host record.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..bench.host import describe, finish, host_record
from ..bench.output import write_json


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def measure(tokens: list[int], blocks: list[int], repeats: int) -> dict[str, dict[str, float]]:
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    from ...integrations.vllm.plan import BlockKeys, geometry_seed
    from ...integrations.vllm.request_keys import request_block_keys

    seed = geometry_seed("model", "geometry", "")
    out: dict[str, dict[str, float]] = {}
    for n in tokens:
        ids = [int(t) for t in np.random.default_rng(0).integers(10, 30000, n)]

        def request(**kw: Any) -> Request:
            return Request("r", ids, SamplingParams(max_tokens=1), None, **kw)  # noqa: B023

        image = [MultiModalFeatureSpec(None, "image", "img", PlaceholderRange(offset=100, length=4000))]
        for bs in blocks:
            out[f"{n}_tokens_block_{bs}"] = {
                "blocks": n // bs,
                "plain_chain_ms": _best_ms(lambda: BlockKeys(seed, bs).extend(ids), repeats),  # noqa: B023
                "plain_request_ms": _best_ms(
                    lambda: request_block_keys(seed, bs, request()).extend(ids), repeats),  # noqa: B023
                "salt_and_image_ms": _best_ms(lambda: request_block_keys(
                    seed, bs, request(cache_salt="A", mm_features=image)).extend(ids), repeats),  # noqa: B023
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hylinker.tools.lab.vllm_keys", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="16384,131072")
    ap.add_argument("--blocks", default="16,384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="bench-results/vllm_keys.json")
    args = ap.parse_args(argv)
    host = host_record()
    result = measure([int(x) for x in args.tokens.split(",")], [int(x) for x in args.blocks.split(",")],
                     max(1, args.repeats))
    record = {"host": finish(host), "results": result}
    for name, row in result.items():
        print(f"{name}: {row}")
    print(describe(record["host"]))
    write_json(args.json, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
