"""``hylinker plan``: size a store tier before buying it (issue 44, item 4).

From a trace (or the production-regime generator's parameters) and a model geometry, predict
for each store size and tensor-parallel degree: the prefix hit rate, the store bytes per cached
token, the trace time until the store fills, and the store traffic (bytes written, bytes read by
restores), with TOUCH and KV-once on and off.

The model replays the requests in arrival order, one at a time, through two LRU caches of page
identities: the device pool (``--kv-pages``, every prompt's pages, a hit refreshing them) and the
store (capacity in bytes; an object's bytes from the geometry). A request stands on the longest
prefix the device holds, then on the store's continuation of it; a hybrid model restores only
up to a grid boundary whose state the store holds (one state per request, at the last grid
boundary of its prompt). After it, the store gets what the path lacks. TOUCH on: the store
copies of the whole path are refreshed (device hits and the offload's path TOUCH, tail first);
off: only what the store served (a get refreshes). What it leaves out, and what the test's
tolerance covers: concurrency (requests overlap in a real run), offloads skipped or dropped,
the checkpoint policy's branch-point states (``marconi``) and slot rounding.
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import xxhash

from ..components.mamba import restorable_ceiling
from .arguments import (
    UsageError,
    int_at_least,
    number_list,
    positive_float,
    positive_int,
    trace_file,
)
from .workloads import Request as WorkloadRequest

HELP = "predict hit rate, bytes per cached token, fill time and store traffic per store size and TP degree"
GIB = 1 << 30
MIB = 1 << 20


@attrs.frozen
class Geometry:
    """What one page and one state cost in the store, per rank, at ``tp`` ranks."""

    name: str
    #: KV (and draft) bytes per token on one rank, before sharding; ``kv_replicated``: every
    #: rank holds the same copy (MLA), else it is split over ranks (GQA heads, at most kv_heads ways)
    kv_bytes_per_token: int
    kv_replicated: bool
    #: one boundary's recurrent state, whole model; split over ranks
    state_bytes: int
    kv_heads: int = 1 << 30
    page_size: int = 64
    grid: int = 64

    def page_bytes(self, tp: int, kv_once: bool) -> int:
        """Store bytes of one page of the whole TP group."""
        if self.kv_replicated:
            return self.kv_bytes_per_token * self.page_size * (1 if kv_once else tp)
        shards = min(tp, self.kv_heads)
        return self.kv_bytes_per_token * self.page_size * tp // shards  # replicas past kv_heads

    def group_state_bytes(self, tp: int) -> int:
        return self.state_bytes  # sharded: tp pieces of state_bytes / tp


def _qwen3_next() -> Geometry:
    from .harness.shapes import QWEN3_NEXT_80B as g

    full = len(g.full_attention_layers)
    linear = g.layers - full
    return Geometry("qwen3-next-80b", kv_bytes_per_token=full * g.kv_bytes_per_token(1), kv_replicated=False,
                    state_bytes=linear * g.state_bytes(1), kv_heads=g.num_kv_heads)


def _stress_kimi() -> Geometry:
    from ..components.layout import PoolKind
    from ..testing.content import preset_layout

    lay = preset_layout("kimi")
    per_token = (lay.payload_bytes(PoolKind.FULL) + lay.payload_bytes(PoolKind.DRAFT)) // lay.page_size
    return Geometry("stress-kimi", kv_bytes_per_token=per_token, kv_replicated=True,
                    state_bytes=lay.payload_bytes(PoolKind.MAMBA), page_size=lay.page_size, grid=lay.grid)


#: the geometries ``--model`` names. kimi-k3: docs/guide/operations.md's per-rank figures (fp8 MLA
#: 12.9 KB per token, replicated; a 52.7 MB state per rank at TP 8); kimi-linear-48b: MLA
#: (512 + 64) bf16 at 7 layers, replicated; 20 KDA layers of 32 heads x 128 x 128 fp32
GEOMETRIES = {
    "stress-kimi": _stress_kimi,
    "qwen3-next-80b": _qwen3_next,
    "kimi-k3": lambda: Geometry("kimi-k3", kv_bytes_per_token=12_900, kv_replicated=True, state_bytes=8 * 52_700_000),
    "kimi-linear-48b": lambda: Geometry("kimi-linear-48b", kv_bytes_per_token=7 * 576 * 2, kv_replicated=True,
                                        state_bytes=20 * 32 * 128 * 128 * 4),
}


@attrs.define
class Prediction:
    store_bytes: int
    tp: int
    touch: bool
    kv_once: bool
    hit_rate: float
    store_hit_tokens: int
    device_hit_tokens: int
    bytes_per_cached_token: float
    fill_s: float | None  # trace seconds until the store first evicted; None: never filled
    written_bytes: int
    restored_bytes: int


def _page_chains(requests: Sequence[WorkloadRequest], page_size: int) -> list[list[bytes]]:
    out = []
    for req in requests:
        data = np.ascontiguousarray(req.token_ids(), dtype="<i4").tobytes()
        step = page_size * 4
        prev = b"hylinker-plan"
        chain = []
        for i in range(len(data) // step):
            prev = xxhash.xxh3_64_digest(prev + data[i * step:(i + 1) * step])
            chain.append(prev)
        out.append(chain)
    return out


def predict(requests: Sequence[WorkloadRequest], geometry: Geometry, *, store_bytes: int, tp: int,
            touch: bool, kv_once: bool, device_pages: int, device_states: int,
            chains: list[list[bytes]] | None = None) -> Prediction:
    """One setting's replay through the device and store LRU model (module docstring)."""
    P, G = geometry.page_size, geometry.grid
    page_b = geometry.page_bytes(tp, kv_once)
    state_b = geometry.group_state_bytes(tp)
    chains = chains if chains is not None else _page_chains(requests, P)
    device: OrderedDict[bytes, None] = OrderedDict()
    device_state: OrderedDict[bytes, None] = OrderedDict()  # boundaries whose state the device holds
    store: OrderedDict[tuple[bytes, bool], int] = OrderedDict()  # (page key, is state) -> bytes
    used = 0
    fill_s: float | None = None
    dev_hit = store_hit = prompt = written = restored = 0
    for req, chain in zip(requests, chains):
        n = req.prompt_length
        prompt += n
        ceiling_pages = restorable_ceiling(n, G) // P
        d = 0
        while d < min(len(chain), ceiling_pages) and chain[d] in device:
            d += 1
        s = d
        while s < min(len(chain), ceiling_pages) and (chain[s], False) in store:
            s += 1
        hit_pages = 0  # a device hit stands on a boundary whose state the device holds
        for b in range(d - d % (G // P), 0, -(G // P)):
            if chain[b - 1] in device_state:
                hit_pages = b
                device_state.move_to_end(chain[b - 1])
                break
        d = hit_pages
        for b in range(s - s % (G // P), d, -(G // P)):
            if b > 0 and (chain[b - 1], True) in store:
                hit_pages = b
                break
        dev_hit += min(d, hit_pages) * P
        store_hit += max(0, hit_pages - d) * P
        if hit_pages > d:
            restored += (hit_pages - d) * page_b + state_b
        # recency: a get refreshes what the store served; TOUCH refreshes the whole stored path
        served = range(d, hit_pages) if not touch else range(len(chain))
        for i in reversed(served):
            if (chain[i], False) in store:
                store.move_to_end((chain[i], False))
        # the offload: what the path lacks, and the state at its last boundary
        new: list[tuple[bytes, bool]] = [(k, False) for k in chain if (k, False) not in store]
        if ceiling_pages:
            new.append((chain[ceiling_pages - 1], True))
        for key in new:
            if key in store:
                continue
            size = state_b if key[1] else page_b
            if size > store_bytes:
                continue
            while used + size > store_bytes:
                _, freed = store.popitem(last=False)
                used -= freed
                if fill_s is None:
                    fill_s = req.arrival_s
            store[key] = size
            used += size
            written += size
        if touch:  # the offload's path TOUCH: tail first, root last
            for i in reversed(range(len(chain))):
                if (chain[i], False) in store:
                    store.move_to_end((chain[i], False))
        for k in chain:
            device[k] = None
            device.move_to_end(k)
        while len(device) > device_pages:
            device.popitem(last=False)
        if ceiling_pages and device_states:
            device_state[chain[ceiling_pages - 1]] = None
            device_state.move_to_end(chain[ceiling_pages - 1])
            while len(device_state) > device_states:
                device_state.popitem(last=False)
    pages_held = sum(1 for _, is_state in store if not is_state)
    return Prediction(store_bytes=store_bytes, tp=tp, touch=touch, kv_once=kv_once,
                      hit_rate=(dev_hit + store_hit) / prompt if prompt else 0.0, store_hit_tokens=store_hit,
                      device_hit_tokens=dev_hit,
                      bytes_per_cached_token=used / (pages_held * P) if pages_held else 0.0, fill_s=fill_s,
                      written_bytes=written, restored_bytes=restored)


def plan(requests: Sequence[WorkloadRequest], geometry: Geometry, *, store_sizes: Sequence[int],
         tps: Sequence[int], device_pages: int, device_states: int) -> list[Prediction]:
    chains = _page_chains(requests, geometry.page_size)
    out = []
    for tp in tps:
        for kv_once in ((True, False) if geometry.kv_replicated and tp > 1 else (True,)):
            for touch in (True, False):
                for size in store_sizes:
                    out.append(predict(requests, geometry, store_bytes=size, tp=tp, touch=touch, kv_once=kv_once,
                                       device_pages=device_pages, device_states=device_states,
                                       chains=chains))
    return out


def format_table(rows: Sequence[Prediction]) -> str:
    head = (f"{'store GiB':>9} {'TP':>3} {'touch':>5} {'KV once':>7} {'hit rate':>8} {'B/cached tok':>12} "
            f"{'fills at s':>10} {'written GiB':>11} {'restored GiB':>12}")
    lines = [head]
    for r in rows:
        fill = f"{r.fill_s:.0f}" if r.fill_s is not None else "never"
        lines.append(f"{r.store_bytes / GIB:>9.2f} {r.tp:>3} {('on' if r.touch else 'off'):>5} "
                     f"{('on' if r.kv_once else 'off'):>7} {r.hit_rate:>8.3f} {r.bytes_per_cached_token:>12.0f} "
                     f"{fill:>10} {r.written_bytes / GIB:>11.2f} {r.restored_bytes / GIB:>12.2f}")
    return "\n".join(lines)


#: one colour per TP degree; a line style per TOUCH setting and a marker per KV-once setting, so
#: curves that cross or touch stay apart (a dashed line over a solid one, a small filled marker
#: inside a large hollow one); settings predicting the very same curve are one line, its legend
#: entry naming each of them
_TP_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def plot(path: str, rows: Sequence[Prediction], *, title: str = "") -> Any:
    """A PNG of the predicted hit rate against store size, one curve per (TP, TOUCH, KV once)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from .plots import _import_matplotlib, legend_below

    figure_cls, canvas_cls = _import_matplotlib()
    fig = figure_cls(figsize=(9, 6), layout="constrained")
    canvas_cls(fig)
    ax = fig.subplots()
    curves: dict[tuple[int, bool, bool], list[Prediction]] = {}
    for r in rows:
        curves.setdefault((r.tp, r.touch, r.kv_once), []).append(r)
    # settings that predict the same curve are drawn once, the legend naming all of them
    same: dict[tuple[tuple[int, float], ...], list[tuple[int, bool, bool]]] = {}
    for setting, pts in sorted(curves.items(), key=lambda kv: (not kv[0][1], not kv[0][2], kv[0][0])):
        pts.sort(key=lambda r: r.store_bytes)
        same.setdefault(tuple((r.store_bytes, r.hit_rate) for r in pts), []).append(setting)
    colors = {tp: _TP_COLORS[i % len(_TP_COLORS)] for i, tp in enumerate(sorted({r.tp for r in rows}))}
    for points, settings in same.items():
        tp, touch, once = settings[0]
        tps = " and ".join(str(s[0]) for s in settings)
        kinds = {(s[1], s[2]) for s in settings}
        label = (f"TP {tps}, TOUCH {'on' if touch else 'off'}, KV once {'on' if once else 'off'}" if len(kinds) == 1
                 else " = ".join(f"TP {s[0]} TOUCH {'on' if s[1] else 'off'} KV once {'on' if s[2] else 'off'}"
                                 for s in settings))
        ax.plot([b / GIB for b, _ in points], [h for _, h in points], color=colors[tp],
                linestyle="-" if touch else (0, (4, 3)), linewidth=2.4 if touch else 1.4,
                marker="o" if once else "s", markersize=9 if touch else 5,
                markerfacecolor="none" if touch else colors[tp], label=label)
    sizes = sorted({r.store_bytes / GIB for r in rows})
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    rates = [r.hit_rate for r in rows]
    low, high = min(rates), max(rates)
    pad = max((high - low) * 0.15, 0.002)
    ax.set_ylim(max(0.0, low - pad), min(1.0, high + pad))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.1%}"))
    ax.set_xlabel("store size, GiB (log scale)")
    ax.set_ylabel("predicted prefix hit rate")
    ax.set_title(title or "hylinker plan: predicted hit rate against store size", fontsize=10)
    ax.grid(True, alpha=0.3)
    legend_below(ax, columns=2, fontsize=8)
    fig.savefig(path, dpi=120)
    return fig


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=trace_file, default=None, help="Mooncake-format JSONL trace (.gz read as such)")
    parser.add_argument("--workload-param", action="append", default=[], metavar="FIELD=VALUE",
                        help="without --trace: the production-regime generator's ProductionShape field (repeatable)")
    parser.add_argument("--synthetic-scale", type=positive_float, default=0.25, help="generator token-size multiplier")
    parser.add_argument("--requests", type=positive_int, default=2000, help="take the first N requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(GEOMETRIES), default="stress-kimi")
    parser.add_argument("--store-gib", type=number_list(positive_float), default="0.25,0.5,1,2,4",
                        help="store sizes, GiB, comma-separated")
    parser.add_argument("--tp", type=number_list(positive_int), default="1,8",
                        help="tensor-parallel degrees, comma-separated")
    parser.add_argument("--kv-pages", type=positive_int, default=4096, help="device KV pool, pages")
    parser.add_argument("--mamba-slots", type=int_at_least(0), default=97, help="device state pool, slots")
    parser.add_argument("--concurrency", type=int_at_least(0), default=8,
                        help="requests running at once: their pages and 3 slots each are not cache")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG: hit rate against store size, one curve per setting")


def load_requests(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.trace is not None:
        from .workloads import read_mooncake_trace

        return read_mooncake_trace(args.trace, first_n=args.requests)
    from .production_workload import production_agentic, production_shape

    shape = production_shape(args.workload_param, scale=args.synthetic_scale)
    return production_agentic(args.requests, seed=args.seed, shape=shape)


def run(args: argparse.Namespace) -> int:
    sizes = [int(v * GIB) for v in args.store_gib]
    tps = list(args.tp)
    if args.trace is not None and args.workload_param:
        raise UsageError("--workload-param shapes the generator; it has no effect with --trace")
    requests = load_requests(args)
    if not requests:
        raise UsageError(f"--trace {args.trace}: the trace holds no request" if args.trace is not None
                         else "the workload is empty")
    geometry = GEOMETRIES[args.model]()
    mean_pages = sum(r.prompt_length for r in requests) // len(requests) // geometry.page_size
    rows = plan(requests, geometry, store_sizes=sizes, tps=tps,
                device_pages=max(1, args.kv_pages - args.concurrency * mean_pages),
                device_states=max(0, args.mamba_slots - 3 * args.concurrency))
    print(f"{geometry.name}: {len(requests)} requests, {sum(r.prompt_length for r in requests):,} prompt tokens, "
          f"trace {requests[-1].arrival_s:.0f} s")
    print(format_table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([attrs.asdict(r) for r in rows], indent=2))
        print(f"wrote {args.json}")
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        source = f"trace {args.trace.name}" if args.trace is not None else "production-regime generator"
        plot(str(args.plot), rows, title=f"hylinker plan: predicted hit rate per store size\n"
                                         f"{geometry.name}, {len(requests):,} requests of the {source}")
        print(f"wrote {args.plot}")
    return 0


__all__ = ["GEOMETRIES", "HELP", "Geometry", "Prediction", "configure", "plan", "predict", "run"]
