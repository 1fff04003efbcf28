"""Benchmark: cost of hashing a prompt into chained page keys (the LOOKUP hot path).

``python -m hylinker.tools.bench.keys [--tokens N] [--pages 16,64,256] [--repeats R]``

For each page size it reports milliseconds per prompt (p50 and min over ``repeats`` runs) for

* ``p50_ms`` / ``min_ms``: :func:`page_keys` on an already validated token array;
* ``from_list_p50_ms`` / ``from_list_min_ms``: :func:`as_tokens` from a Python list (what an
  engine usually hands over) plus :func:`page_keys`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from ...components.keys import as_tokens, namespace_seed, page_keys
from ...components.layout import ModelLayout
from .output import write_json


def _times_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm up
    out: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure_key_hashing(
    prompt_tokens: int = 131072,
    page_sizes: Sequence[int] = (16, 64, 256),
    repeats: int = 5,
) -> dict[int, dict[str, float]]:
    """Milliseconds per prompt of ``prompt_tokens`` tokens to compute its page keys, per page size.

    Returns ``{page_size: {"pages", "p50_ms", "min_ms", "from_list_p50_ms", "from_list_min_ms"}}``.
    """
    if prompt_tokens <= 0 or repeats <= 0 or not page_sizes or any(p <= 0 for p in page_sizes):
        raise ValueError(
            f"bad arguments: prompt_tokens={prompt_tokens} page_sizes={page_sizes} repeats={repeats}")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 160_000, size=prompt_tokens, dtype=np.int64)
    as_list = ids.tolist()
    tokens = as_tokens(ids)
    result: dict[int, dict[str, float]] = {}
    for page in page_sizes:
        layout = ModelLayout.create(page_size=page, full_layers=[0], kv_row_shape=(576,))
        seed = namespace_seed(layout)
        n_keys = len(page_keys(tokens, page, seed))
        keys_only = _times_ms(lambda: page_keys(tokens, page, seed), repeats)  # noqa: B023
        from_list = _times_ms(lambda: page_keys(as_tokens(as_list), page, seed), repeats)  # noqa: B023
        result[page] = {
            "pages": float(n_keys),
            "p50_ms": statistics.median(keys_only),
            "min_ms": min(keys_only),
            "from_list_p50_ms": statistics.median(from_list),
            "from_list_min_ms": min(from_list),
        }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hylinker.tools.bench.keys", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--pages", default="16,64,256", help="comma-separated page sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    pages = tuple(int(p) for p in args.pages.split(","))
    res = measure_key_hashing(args.tokens, pages, args.repeats)
    print(f"page keys for a {args.tokens}-token prompt, ms per prompt ({args.repeats} runs)")
    print(f"{'page':>6} {'pages':>7} {'p50':>8} {'min':>8} {'list p50':>9} {'list min':>9}")
    for page, r in res.items():
        print(f"{page:>6} {int(r['pages']):>7} {r['p50_ms']:>8.2f} {r['min_ms']:>8.2f} "
              f"{r['from_list_p50_ms']:>9.2f} {r['from_list_min_ms']:>9.2f}")
    if args.json:
        write_json(args.json, {"tokens": args.tokens, "repeats": args.repeats, "ms_per_prompt": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
