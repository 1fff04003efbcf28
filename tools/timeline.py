"""``hylinker trace FILE``: a trace-level JSON log as a timeline.

The input is what ``stress --trace-file``, the plugins' ``trace_file`` key or ``--trace-log``
write (``runtime/dataplane/tracing.py``): one JSON object a line, each with ``event``, ``t``
(wall clock, seconds) and, where it ends something, ``us`` (how long it took). The output is
Chrome trace-event JSON (``{"traceEvents": [...]}``, microseconds) that Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open:

* per process that wrote the file, a *requests* process with one track per request: a
  ``request`` slice from its lookup to its last event, and inside it the phases as slices in
  order: ``lookup``, ``load`` (allocated and submitted to committed), ``engine`` (restore or lookup to insert: the
  engine's prefill), ``offload`` (insert to its last object stored); every other event of the
  request (``release``, ``offload.skipped``, the plugins' events) an instant;
* a *pool actors* process with a track per pool actor and direction (``kv offload``, ...): each
  transfer job a slice (its request, objects, bytes); below it the store calls (``kv store
  put``, ...) as slices. Calls that overlap (two in flight) go on numbered lanes, so slices
  on a track always nest;
* events of neither kind (a touch batch's store error, close) as instants on a ``runtime`` track.

``--png`` draws a chosen window of requests (``--window FIRST:LAST``, in the order they
started) as a PNG: one row per request with its phases, the pool actors' jobs and store calls
below, on one time axis (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from .arguments import UsageError

HELP = "a trace file (stress --trace-file, trace_file) as a Chrome/Perfetto timeline and a PNG"

#: request phases, in the order they happen (each a slice on the request's track)
PHASES = ("lookup", "load", "engine", "offload")
#: pool-actor job events (a slice per job on the pool's track)
JOBS = ("load", "offload")
#: events that end a load on a request's track (the first one found closes the ``load`` slice)
LOAD_ENDS = ("commit", "commit.dropped", "commit.partial", "load.miss")


@attrs.frozen
class Slice:
    """One span of time on one track, in microseconds since the trace's first event."""

    name: str
    start: float
    end: float
    args: Mapping[str, Any] = attrs.field(factory=dict)


def read_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The trace's events (JSON objects with ``event`` and ``t``) in time order, and how many
    other lines it had (plain text mixed in): a missing or event-less file is a UsageError."""
    if not path.is_file():
        raise UsageError(f"no such trace file: {path}")
    events: list[dict[str, Any]] = []
    skipped = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                skipped += line.strip() != ""
                continue
            if isinstance(event, dict) and isinstance(event.get("event"), str) and isinstance(
                    event.get("t"), (int, float)):
                events.append(event)
            else:
                skipped += 1
    if not events:
        raise UsageError(f"{path}: no trace events (JSON lines with 'event' and 't'; write them with "
                         "`hylinker stress --trace-file` or the plugins' trace_file key)")
    events.sort(key=lambda e: e["t"])
    return events, skipped


def _start_end(e: Mapping[str, Any], t0: float) -> tuple[float, float]:
    end = (e["t"] - t0) * 1e6
    return end - float(e.get("us", 0) or 0), end


@attrs.define
class Timeline:
    """The trace as tracks: request tracks (by request id, in the order they started), pool
    tracks (by name), the runtime track; each a list of slices, or of instants (``start == end``)."""

    requests: dict[str, list[Slice]] = attrs.field(factory=dict)
    pools: dict[str, list[Slice]] = attrs.field(factory=lambda: defaultdict(list))
    runtime: list[Slice] = attrs.field(factory=list)
    pid: dict[str, int] = attrs.field(factory=dict)  # request id -> the process that wrote it
    pool_pid: dict[str, int] = attrs.field(factory=dict)

    def window(self, first: int, last: int) -> list[str]:
        return list(self.requests)[first:last]


def build(events: list[dict[str, Any]]) -> Timeline:
    """Group the events into tracks and phases (see the module doc)."""
    t0 = min(e["t"] - float(e.get("us", 0) or 0) / 1e6 for e in events)
    tl = Timeline()
    by_request: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        name, rid, pool = e["event"], e.get("request_id"), e.get("pool")
        start, end = _start_end(e, t0)
        args = {k: v for k, v in e.items() if k not in ("event", "t", "timestamp", "level", "phase", "pid")}
        if name == "store" and pool is not None:
            direction = "put" if str(e.get("call", "")).startswith("put") else "get"
            track = f"{pool} store {direction}"
            tl.pools[track].append(Slice(str(e.get("call", "store")), start, end, args))
            tl.pool_pid[track] = e.get("pid", 0)
        elif name in JOBS and pool is not None:
            track = f"{pool} {name}"
            tl.pools[track].append(Slice(f"{name} {rid or ''}".strip(), start, end, args))
            tl.pool_pid[track] = e.get("pid", 0)
            if rid is not None:
                by_request.setdefault(str(rid), []).append(e)
        elif rid is not None:
            by_request.setdefault(str(rid), []).append(e)
        else:
            tl.runtime.append(Slice(name, start, end, args))
    for rid, evs in sorted(by_request.items(), key=lambda kv: min(_start_end(e, t0)[0] for e in kv[1])):
        tl.requests[rid] = request_slices(evs, t0)
        tl.pid[rid] = evs[0].get("pid", 0)
    return tl


def request_slices(evs: list[dict[str, Any]], t0: float) -> list[Slice]:
    """One request's track: the ``request`` slice, its phases in order, its other events as instants."""
    out: list[Slice] = []
    first = min(_start_end(e, t0)[0] for e in evs)
    last = max(_start_end(e, t0)[1] for e in evs)
    out.append(Slice("request", first, last, {"request_id": evs[0].get("request_id")}))
    at = {e["event"]: _start_end(e, t0) for e in reversed(evs) if e.get("pool") is None}  # first of each
    cursor = first
    if "lookup" in at:
        out.append(Slice("lookup", *at["lookup"]))
        cursor = at["lookup"][1]
    load_end = next((at[n][1] for n in LOAD_ENDS if n in at), None)
    if "load.queued" in at and load_end is not None:
        out.append(Slice("load", at["load.queued"][0], load_end))  # from allocation and submission
        cursor = load_end
    if "insert" in at:
        if at["insert"][1] > cursor:
            out.append(Slice("engine", cursor, at["insert"][1]))
        stored = [_start_end(e, t0)[1] for e in evs if e["event"] == "offload" and e.get("pool") is not None]
        if stored:
            out.append(Slice("offload", at["insert"][1], max(stored)))
    for e in evs:
        if e.get("pool") is None and e["event"] not in ("lookup", "insert", "load.queued", *LOAD_ENDS[:1]):
            end = _start_end(e, t0)[1]
            out.append(Slice(e["event"], end, end, {k: v for k, v in e.items() if k not in ("t", "timestamp")}))
    return out


def lanes(slices: Iterable[Slice]) -> list[list[Slice]]:
    """``slices`` packed onto as few lanes as keep each lane's slices apart (greedy, by start)."""
    out: list[list[Slice]] = []
    for s in sorted(slices, key=lambda s: (s.start, s.end)):
        for lane in out:
            if lane[-1].end <= s.start:
                lane.append(s)
                break
        else:
            out.append([s])
    return out


def chrome_trace(tl: Timeline) -> dict[str, Any]:
    """The Chrome trace-event JSON object (``ph``: X slices, i instants, M names)."""
    ev: list[dict[str, Any]] = []
    pids: dict[tuple[int, str], int] = {}

    def process(os_pid: int, kind: str) -> int:
        if (os_pid, kind) not in pids:
            pid = pids[os_pid, kind] = len(pids) + 1
            ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{kind} (pid {os_pid})"}})
            ev.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        return pids[os_pid, kind]

    def thread(pid: int, tid: int, name: str) -> None:
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

    def emit(pid: int, tid: int, s: Slice, cat: str) -> None:
        args = {k: v for k, v in s.args.items() if isinstance(v, (str, int, float, bool))}
        ts, end = round(max(s.start, 0.0), 1), round(max(s.end, 0.0), 1)  # rounded once: nested ends stay nested
        if end > ts:
            ev.append({"ph": "X", "name": s.name, "cat": cat, "pid": pid, "tid": tid, "ts": ts,
                       "dur": round(end - ts, 1), "args": args})
        else:
            ev.append({"ph": "i", "s": "t", "name": s.name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "args": args})

    for tid, (rid, slices) in enumerate(tl.requests.items(), 1):
        pid = process(tl.pid[rid], "requests")
        thread(pid, tid, rid)
        for s in slices:
            emit(pid, tid, s, "request")
    tid = 0
    for track in sorted(tl.pools):
        pid = process(tl.pool_pid[track], "pool actors")
        for i, lane in enumerate(lanes(tl.pools[track])):
            tid += 1
            thread(pid, tid, track if i == 0 else f"{track} ({i + 1})")
            for s in lane:
                emit(pid, tid, s, "store" if " store " in track else "pool")
    if tl.runtime:
        pid = process(0, "runtime")
        thread(pid, 1, "runtime")
        for s in tl.runtime:
            emit(pid, 1, s, "runtime")
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def window_arg(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        lo, hi = int(first or 0), int(last) if sep else int(first) + 1
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST (request numbers), got {text!r}") from None
    if lo < 0 or hi <= lo:
        raise argparse.ArgumentTypeError(f"expected 0 <= FIRST < LAST, got {text!r}")
    return lo, hi


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="the trace: JSON lines (stress --trace-file, the plugins' trace_file)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the Chrome trace-event JSON to write (default: FILE with .chrome.json)")
    parser.add_argument("--png", type=Path, default=None, help="also draw the requests of --window as a PNG")
    parser.add_argument("--window", type=window_arg, default=(0, 20), metavar="FIRST:LAST",
                        help="requests FIRST..LAST-1, in the order they started, for --png (default: 0:20)")


def run(args: argparse.Namespace) -> int:
    if args.png is not None:
        from .plots import _import_matplotlib

        try:
            _import_matplotlib()
        except ImportError as exc:
            raise UsageError(f"--png: {exc}") from None
    events, skipped = read_events(args.file)
    tl = build(events)
    out = args.out if args.out is not None else args.file.with_suffix(".chrome.json")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(chrome_trace(tl)))
    except OSError as exc:
        raise UsageError(f"--out: cannot write {out} ({exc.strerror or exc})") from None
    print(f"{len(events):,} events, {len(tl.requests):,} requests, {len(tl.pools)} pool tracks"
          + (f"; {skipped:,} lines that are not trace events skipped" if skipped else ""))
    print(f"wrote {out} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.png is not None:
        from .timeline_plot import plot_window

        first, last = args.window
        rids = tl.window(first, last)
        if not rids:
            raise UsageError(f"--window {first}:{last}: the trace has {len(tl.requests)} requests")
        plot_window(str(args.png), tl, rids, title=f"{args.file.name}: requests {first}..{first + len(rids) - 1}",
                    phases=PHASES)
        print(f"wrote {args.png}")
    return 0


__all__ = ["HELP", "PHASES", "Slice", "Timeline", "build", "chrome_trace", "configure", "lanes", "read_events", "run"]
