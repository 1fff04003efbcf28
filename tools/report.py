"""Output helpers for the command-line tools: a progress bar, plain-text tables, percentiles
and the stress tool's summaries (the plots are :mod:`.plots`)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from ..stores.base import exit_closes

# ---------------------------------------------------------------------------------------------
# Progress


class ProgressBar:
    """A progress bar on stderr: tqdm when installed, else a plain line printer.

    Silent unless the stream is a TTY or ``force`` is set. Use as a context manager, or call
    :meth:`close`. The plain fallback rewrites one line on a TTY and prints at most one line
    per ``interval_s`` otherwise.
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str = "",
        unit: str = "it",
        force: bool = False,
        stream: TextIO | None = None,
        interval_s: float = 0.5,
        use_tqdm: bool = True,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"total must be >= 0 or None, got {total}")
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self._stream = stream if stream is not None else sys.stderr
        is_tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self.enabled = force or is_tty
        self._is_tty = is_tty
        self._interval_s = interval_s
        self._postfix = ""
        self._start = time.monotonic()
        self._last_print = -math.inf
        self._closed = False
        self._tqdm: Any = None
        if self.enabled and use_tqdm:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._tqdm = tqdm(total=total, desc=desc, unit=unit, file=self._stream,
                                  dynamic_ncols=is_tty, mininterval=interval_s)

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled or self._closed:
            return
        if self._tqdm is not None:
            self._tqdm.update(n)
            return
        now = time.monotonic()
        if now - self._last_print >= self._interval_s or (self.total is not None and self.n >= self.total):
            self._last_print = now
            self._print_line(final=False)

    def set_postfix(self, **values: Any) -> None:
        """Show ``key=value`` pairs after the count (e.g. the running hit rate)."""
        self._postfix = ", ".join(f"{k}={_format_cell(v)}" for k, v in values.items())
        if self._tqdm is not None and self.enabled and not self._closed:
            self._tqdm.set_postfix_str(self._postfix, refresh=False)

    def _line(self) -> str:
        elapsed = time.monotonic() - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        pct = f" {100.0 * self.n / self.total:5.1f}%" if self.total else ""
        head = f"{self.desc}: " if self.desc else ""
        tail = f" [{self._postfix}]" if self._postfix else ""
        return f"{head}{count} {self.unit}{pct} {elapsed:.1f}s {rate:.1f} {self.unit}/s{tail}"

    def _print_line(self, *, final: bool) -> None:
        if self._is_tty:
            self._stream.write("\r" + self._line() + ("\n" if final else ""))
        else:
            self._stream.write(self._line() + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            self._print_line(final=True)

    def __enter__(self) -> ProgressBar:
        return self

    __exit__ = exit_closes


def progress_bar(
    total: int | None = None,
    *,
    desc: str = "",
    unit: str = "it",
    force: bool = False,
    stream: TextIO | None = None,
) -> ProgressBar:
    """A :class:`ProgressBar` on stderr (or ``stream``), silent when not a TTY unless ``force``."""
    return ProgressBar(total, desc=desc, unit=unit, force=force, stream=stream)


# ---------------------------------------------------------------------------------------------
# Tables


def _format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4g}" if abs(v) < 1 else f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str | tuple[str, str]] | None = None,
    *,
    width: int | None = None,
    keep: int = 0,
) -> str:
    """An aligned plain-text table.

    ``columns`` lists the keys to show, each a key or ``(key, header)``; by default every key in
    first-seen order. Numbers are right-aligned (ints with thousands separators, floats with
    4 significant digits), everything else left-aligned; a missing value shows as ``-``.
    With ``width``, a table wider than that is cut into tables one under the other, each
    repeating the first ``keep`` columns (a single column wider than ``width`` stays whole).
    """
    if width is not None:
        return _wrapped_table(rows, columns, width, keep)
    if columns is None:
        keys: list[str] = []
        for row in rows:
            keys.extend(k for k in row if k not in keys)
        columns = keys
    specs: list[tuple[str, str]] = []
    for col in columns:
        if isinstance(col, str):
            specs.append((col, col))
        elif isinstance(col, tuple) and len(col) == 2 and all(isinstance(c, str) for c in col):
            specs.append((col[0], col[1]))
        else:
            raise TypeError(f"a column is a key or a (key, header) pair of str, got {col!r}")
    cells = [[_format_cell(row.get(key)) for key, _ in specs] for row in rows]
    numeric = [
        any(_is_number(row.get(key)) for row in rows)
        and all(_is_number(row.get(key)) or row.get(key) is None for row in rows)
        for key, _ in specs
    ]
    widths = [max([len(header)] + [len(r[i]) for r in cells]) for i, (_, header) in enumerate(specs)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line([h for _, h in specs]), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def _wrapped_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str | tuple[str, str]] | None,
                   width: int, keep: int) -> str:
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    fixed, rest = list(columns[:keep]), list(columns[keep:])
    blocks: list[str] = []
    block: list[str | tuple[str, str]] = []
    for col in rest:
        wider = format_table(rows, [*fixed, *block, col])
        if block and max(map(len, wider.splitlines())) > width:
            blocks.append(format_table(rows, [*fixed, *block]))
            block = []
        block.append(col)
    if block or not blocks:
        blocks.append(format_table(rows, [*fixed, *block]))
    return "\n\n".join(blocks)


# ---------------------------------------------------------------------------------------------
# Statistics


def _percentile_key(q: float) -> str:
    return f"p{q:g}"


def percentiles(values: Iterable[float], qs: Sequence[float] = (50, 99)) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}`` (linear interpolation); NaN for every key when empty."""
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"percentiles must lie in [0, 100], got {q}")
    arr = np.fromiter(values, dtype=np.float64)
    if arr.size == 0:
        return {_percentile_key(q): math.nan for q in qs}
    got = np.percentile(arr, list(qs))
    return {_percentile_key(q): float(v) for q, v in zip(qs, got, strict=True)}


# ---------------------------------------------------------------------------------------------
# Stress summaries

_MIB = 1 << 20

#: every loss a stress summary counts, in the order tables show them (summary key, header)
LOSS_COLUMNS: tuple[tuple[str, str], ...] = (
    ("alloc_retries", "alloc retry"),
    ("alloc_failures", "alloc fail"),
    ("never_fit", "never fit"),
    ("rejected", "rejected"),
    ("load_misses", "load miss"),
    ("load_waits", "load wait"),  # loads that waited for pages (not a loss unless also a miss)
    ("dropped_loads", "load drop"),
    ("partial_pages_lost", "pages lost"),  # by partial loads
    ("offloads_skipped_mamba", "skip mamba"),  # offloads skipped: state backpressure
    ("offloads_skipped_kv", "skip kv"),  # KV backpressure
    ("offloads_skipped_breaker", "skip breaker"),  # the store's circuit breaker open
    ("offloads_dropped", "offl drop"),
    ("offload_failures", "offl fail"),
)


def _of_bound(s: Mapping[str, Any]) -> float | None:
    bound = s.get("bound_hit_rate") or 0.0
    return round(s["hit_rate"] / bound, 3) if bound else None


def stress_row(s: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """One row of a study table: the hit rate beside its bound, what was stored for it, and
    every loss column (:data:`LOSS_COLUMNS`)."""
    stored = sum(s["bytes_offloaded"].values())
    hit_tokens = s["device_hit_tokens"] + s["store_hit_tokens"]
    row: dict[str, Any] = {
        **extra,
        "hit_rate": s["hit_rate"],
        "bound_hit_rate": s["bound_hit_rate"],
        "of_bound": _of_bound(s),
        "device_hit_tokens": s["device_hit_tokens"],
        "store_hit_tokens": s["store_hit_tokens"],
        "stored_mb": round(stored / _MIB, 1),
        "stored_bytes_per_hit_token": round(stored / hit_tokens, 1) if hit_tokens else None,
        "states_stored": s.get("states_stored", 0),
        "checkpoints": s["checkpoints_donated"],
        "store_evictions": s["store"]["evictions"],
    }
    for key, _ in LOSS_COLUMNS:
        row[key] = s.get(key, 0)
    row["mismatches"] = s["restore_mismatches"]
    row["leaks"] = s["leaked_rows"] + s["leaked_slots"] + s["locked_nodes_at_end"]
    row["seconds"] = s["seconds"]
    return row


def resilience_rows(s: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Table rows for the store wrapper's retries and circuit breaker, KV backpressure and
    partial restores (the wrapper's rows only when it ran)."""
    rows: list[dict[str, Any]] = [
        {"metric": "offloads skipped (kv backpressure / breaker open)",
         "value": f"{s.get('offloads_skipped_kv', 0)} / {s.get('offloads_skipped_breaker', 0)}"},
        {"metric": "loads kept partly (pages lost)",
         "value": f"{s.get('partial_loads', 0)} ({s.get('partial_pages_lost', 0)})"},
        {"metric": "bad objects removed", "value": s.get("bad_objects_removed", 0)},
    ]
    r = s.get("resilience")
    if r:
        rows[:0] = [
            {"metric": "store retries (keys recovered / exhausted)",
             "value": f"{r['retries']} ({r['recovered_keys']} / {r['exhausted_keys']})"},
            {"metric": "store timeouts / unavailable calls", "value": f"{r['timeouts']} / {r['unavailable']}"},
            {"metric": "breaker trips / rejected calls / resumes",
             "value": f"{r['breaker_trips']} / {r['rejected_calls']} / {r['resumes']}"},
        ]
    return rows


def eviction_return_rows(s: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Evicted objects asked for again (probe or TOUCH), per pool, and how soon (trace time)."""
    rows = []
    for pool, r in s.get("eviction_returns", {}).get("pools", {}).items():
        rows.append({"metric": f"evicted {pool} asked again (by touch) / share / median s / within 5 min",
                     "value": f"{r['asked_again']:,} ({r['by_touch']:,}) / {r['asked_again_share']:.1%} / "
                              f"{r['median_delay_s']} / {r['within_soon_share']:.1%}"})
    return rows


def format_stress_summary(s: Mapping[str, Any]) -> str:
    """The stress tool's printed table: the hit rate beside its bound, then every loss."""
    of_bound = _of_bound(s)
    rows: list[dict[str, Any]] = [
        {"metric": "requests (completed)", "value": f"{s['requests']:,} ({s['completed']:,})"},
        {"metric": "prompt tokens", "value": s["prompt_tokens"]},
        {"metric": "hit rate / bound (infinite cache) = of bound",
         "value": f"{s['hit_rate']:.1%} / {s['bound_hit_rate']:.1%} = "
                  + (f"{of_bound:.3f}" if of_bound is not None else "-")},
        {"metric": "device hit tokens / store hit tokens",
         "value": f"{s['device_hit_tokens']:,} / {s['store_hit_tokens']:,}"},
        {"metric": "device pools: KV pages / state slots", "value": f"{s['kv_pages']:,} / {s['mamba_slots']:,}"},
        {"metric": "restores verified (pages + states)", "value": s["restores_verified"]},
        {"metric": "restore mismatches", "value": s["restore_mismatches"]},
        {"metric": "leaked rows / slots / locked nodes",
         "value": f"{s['leaked_rows']} / {s['leaked_slots']} / {s['locked_nodes_at_end']}"},
        {"metric": "waits: causal (previous turn) / admission (pools) / max queue",
         "value": f"{s['causal_waits']} / {s['alloc_waits']} / {s['max_waiting']}"},
        {"metric": "alloc retries / failures (dropped) / never fit / rejected",
         "value": f"{s['alloc_retries']} / {s['alloc_failures']} / {s['never_fit']} / {s['rejected']}"},
        {"metric": "loads: allocation misses / dropped -> recomputed",
         "value": f"{s['load_misses']} / {s['dropped_loads']}"},
        {"metric": "loads that waited for pages (of them recomputed)",
         "value": f"{s.get('load_waits', 0)} ({s.get('load_waits_recomputed', 0)})"},
        {"metric": "states waiting for their offload, most at once / state slots",
         "value": f"{s.get('states_pending_offload_peak', 0)} / {s['mamba_slots']}"},
        {"metric": "offloads (skipped / dropped / failed)",
         "value": f"{s['offloads']} ({s['offloads_skipped_mamba']} / {s['offloads_dropped']} / {s['offload_failures']})"},
        *resilience_rows(s),
        {"metric": "checkpoints donated", "value": s["checkpoints_donated"]},
        {"metric": "store evictions", "value": s["store"]["evictions"]},
        *eviction_return_rows(s),
        {"metric": "MB offloaded kv / mamba / draft",
         "value": " / ".join(f"{v / _MIB:.1f}" for v in s["bytes_offloaded"].values())},
        {"metric": "MB loaded kv / mamba / draft",
         "value": " / ".join(f"{v / _MIB:.1f}" for v in s["bytes_loaded"].values())},
    ]
    for phase in ("lookup", "load", "commit", "ttft", "ttft_store"):
        p = s["latency_ms"].get(phase)
        if p is not None:
            rows.append({"metric": f"{phase} ms p50 / p99", "value": f"{p['p50']} / {p['p99']}"})
    if s.get("declined_lookups"):
        rows.append({"metric": "declined restores (hit tokens given up) / probes taken",
                     "value": f"{s['declined_lookups']} ({s['declined_hit_tokens']}) / {s.get('decline_probes', 0)}"})
    rows.append({"metric": "event-loop lag ms p99", "value": s["loop_lag_ms"]["p99"]})
    rows.append({"metric": "seconds", "value": s["seconds"]})
    return format_table(rows, ["metric", "value"])
