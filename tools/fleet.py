"""``hylinker fleet``: real network faults on a fleet of namespaces, every restore verified.

One :class:`~hylinker.tools.harness.fleet.Fleet` (a master and ``--hosts`` engine hosts, each in a
network namespace on one bridge) serves traffic from every host while the tool applies, in
turn, each fault of ``--faults``:

* ``partition``: a host's bridge port goes down for ``--fault-s``, then up;
* ``host-death``: a host is cut off and its engine SIGKILLed (its segment and the objects in it
  vanish, mid-load and mid-offload for the others), then it comes back empty;
* ``master-restart``: the master is SIGKILLed and, ``--fault-s`` later, restarted empty on the
  same address;
* ``engine-kill9``: an engine is SIGKILLed while it drains its offloads, and restarted at
  once against the same store.

Each host fault hits the host whose segment the others were reading from (:func:`holder`), so
its objects are ones in use.

For each fault: wrong restores (must be 0), requests that recomputed, store calls and keys
that got no answer (cut at a timeout, refused by the open breaker, failing every attempt),
lookup and load p99 and max during the fault (bounded by the engines' store timeouts), and the
seconds after the fault ends until the fleet's store hit rate is back within 5 % of its
pre-fault value. At the end every engine is stopped gracefully and reports leaked rows, slots
and locked nodes (must be 0).
Needs root and ``ip`` (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from .arguments import (
    MOONCAKE_INSTALL,
    UsageError,
    int_at_least,
    nearest,
    non_negative_float,
    positive_float,
    require_package,
)
from .harness.fleet import Fleet, FleetConfig
from .harness.netns import NetnsUnavailableError
from .report import format_table, percentiles

HELP = "faults on a fleet of network namespaces (partition, host death, master restart, kill -9)"
FAULTS = ("partition", "host-death", "master-restart", "engine-kill9")
#: the hit rate is back when a window this long reaches 95 % of the pre-fault rate
WINDOW_S = 1.0


@attrs.define
class PhaseTimes:
    fault: str
    victim: str  # the host it hit (or "master")
    began: float  # the fault was applied
    ended: float  # the fault was lifted (healed, restarted)
    until: float  # the phase's traffic ended


def hit_rate(reqs: Sequence[dict[str, Any]], lo: float, hi: float) -> float | None:
    """Store-restored share of the prompt tokens of the requests that finished in [lo, hi)."""
    sel = [r for r in reqs if lo <= r["t"] < hi]
    prompt = sum(r["prompt"] for r in sel)
    return sum(r["restored"] for r in sel) / prompt if prompt else None


def recovery_s(reqs: Sequence[dict[str, Any]], pre: float, after: float, until: float,
               step_s: float = 0.1) -> float | None:
    """Seconds after ``after`` until the hit rate of a :data:`WINDOW_S` window first reaches
    95 % of ``pre`` (the window's end); None when it never does before ``until``."""
    s = after
    while s + WINDOW_S <= until:
        rate = hit_rate(reqs, s, s + WINDOW_S)
        if rate is not None and rate >= 0.95 * pre:
            return round(s + WINDOW_S - after, 2)
        s += step_s
    return None


def phase_figures(reqs: Sequence[dict[str, Any]], p: PhaseTimes, warm_s: float) -> dict[str, Any]:
    """One fault's row of the table, from the request events of every engine."""
    phase = [r for r in reqs if p.began - warm_s <= r["t"] < p.until]
    during = [r for r in reqs if r["t"] >= p.began and r["start"] <= p.ended]
    pre = hit_rate(reqs, p.began - warm_s, p.began) or 0.0

    def lat(name: str) -> dict[str, float]:
        values = [r[name] * 1e3 for r in during if r.get(name) is not None]
        if not values:
            return {"p99_ms": 0.0, "max_ms": 0.0}
        return {"p99_ms": round(percentiles(values, (99,))["p99"], 1), "max_ms": round(max(values), 1)}

    return {
        "fault": p.fault, "victim": p.victim, "fault_s": round(p.ended - p.began, 2),
        "requests": len(phase), "requests_during": len(during),
        "served_during": {h: sum(1 for r in during if r["host"] == h) for h in sorted({r["host"] for r in reqs})},
        "wrong_restores": sum(r["wrong"] for r in phase),
        "restores_verified": sum(1 for r in phase if r["restored"]),
        "recomputed": sum(1 for r in phase if r["recomputed"] and r["t"] >= p.began),
        "misses_after": sum(1 for r in phase if r["t"] >= p.began and not r["store_hit"]),
        "unanswered": sum(r.get("unanswered", 0) for r in during),
        "lookup": lat("lookup_s"), "load": lat("load_s"),
        "request_max_ms": round(max(((r["t"] - r["start"]) * 1e3 for r in during), default=0.0), 1),
        "pre_hit_rate": round(pre, 4),
        "recovery_s": recovery_s(reqs, pre, p.ended, p.until) if pre else None,
        "get_remote": sum(r.get("get_remote", 0) for r in phase),
        "get_local": sum(r.get("get_local", 0) for r in phase),
        "put_remote": sum(r.get("put_remote", 0) for r in phase),
        "put_local": sum(r.get("put_local", 0) for r in phase),
    }


def holder(fleet: Fleet, window_s: float) -> str:
    """The host whose segment the others read most from lately: the one that, of its own
    reads in the last ``window_s``, took the fewest across the network (so killing or cutting
    it loses objects the others are reading)."""
    now = time.monotonic()
    remote = {role: 0 for role in fleet.roles}
    local = {role: 0 for role in fleet.roles}
    for r in fleet.requests():
        if r["t"] >= now - window_s and r["host"] in remote:
            remote[r["host"]] += r.get("get_remote", 0)
            local[r["host"]] += r.get("get_local", 0)
    return min(fleet.roles, key=lambda h: (remote[h] - local[h], h))


def _held(fault_s: float, down: Callable[[], object], up: Callable[[], object]) -> tuple[float, float]:
    """``down``, ``fault_s`` seconds, then ``up``: (when it began, when it was lifted)."""
    began = time.monotonic()
    down()
    time.sleep(fault_s)
    up()
    return began, time.monotonic()


def apply_fault(fleet: Fleet, fault: str, fault_s: float, victim: str) -> tuple[float, float]:
    """Apply ``fault`` to ``victim`` (the master for a master restart) and lift it; (when it
    began, when it was lifted)."""
    if fault == "partition":
        return _held(fault_s, lambda: fleet.partition(victim), lambda: fleet.heal(victim))
    if fault == "host-death":
        def die() -> None:
            fleet.partition(victim)  # a dead host answers nothing, not even a reset
            fleet.kill_engine(victim)

        def revive() -> None:
            fleet.heal(victim)
            fleet.start_engine(victim)

        return _held(fault_s, die, revive)
    if fault == "master-restart":
        return _held(fault_s, fleet.kill_master, fleet.start_master)
    if fault == "engine-kill9":
        eng = fleet.engines[victim]
        eng.wait_event("offloading", 30.0, after=len(eng.events))
        # killed while it drains this request's offloads, restarted at once
        return _held(0.0, lambda: fleet.kill_engine(victim), lambda: fleet.start_engine(victim))
    raise ValueError(f"unknown fault {fault!r}; choose from {FAULTS}")


def run_faults(fleet: Fleet, faults: Sequence[str], *, warm_s: float, fault_s: float,
               after_s: float) -> dict[str, Any]:
    """Traffic from every host; each fault in turn; the table and the final leak checks."""
    for fault in faults:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose from {FAULTS}")
    fleet.start_engines()
    time.sleep(warm_s)  # every document stored once before the first window
    phases = []
    for fault in faults:
        time.sleep(warm_s)
        victim = "master" if fault == "master-restart" else holder(fleet, warm_s)
        began, ended = apply_fault(fleet, fault, fault_s, victim)
        time.sleep(after_s)
        phases.append(PhaseTimes(fault, victim, began, ended, time.monotonic()))
    ends = fleet.stop_engines()
    reqs = fleet.requests()
    rows = [phase_figures(reqs, p, warm_s) for p in phases]
    leaks = {role: ({k: e[k] for k in ("leaked_rows", "leaked_slots", "locked_nodes", "idle_error",
                                       "linker_close_s")} if e is not None else None)
             for role, e in ends.items()}
    return {"faults": rows, "leaks": leaks, "requests": len(reqs),
            "wrong_restores": sum(r["wrong"] for r in reqs),
            "config": attrs.asdict(fleet.config)}


def format_faults(result: dict[str, Any]) -> str:
    rows = [{"fault": r["fault"], "victim": r["victim"], "wrong": r["wrong_restores"], "verified": r["restores_verified"],
             "recomputed": r["recomputed"], "misses": r["misses_after"], "unanswered": r["unanswered"],
             "lookup p99/max ms": f"{r['lookup']['p99_ms']}/{r['lookup']['max_ms']}",
             "load p99/max ms": f"{r['load']['p99_ms']}/{r['load']['max_ms']}",
             "pre hit": r["pre_hit_rate"], "recovery s": r["recovery_s"],
             "get remote/local": f"{r['get_remote']}/{r['get_local']}"} for r in result["faults"]]
    return format_table(rows)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--faults", type=fault_list, default=",".join(FAULTS),
                        help=f"comma-separated, applied in order (default all: {','.join(FAULTS)})")
    parser.add_argument("--hosts", type=int_at_least(2), default=2, help="engine hosts (>= 2)")
    parser.add_argument("--warm-s", type=non_negative_float, default=4.0, help="traffic before each fault")
    parser.add_argument("--fault-s", type=positive_float, default=4.0, help="how long each fault lasts")
    parser.add_argument("--after-s", type=positive_float, default=8.0, help="traffic after each fault")
    parser.add_argument("--deadline-s", type=positive_float, default=2.0,
                        help="the engines' store transfer deadline (ResiliencePolicy.deadline_s)")
    parser.add_argument("--throughput", action="store_true",
                        help="instead: put/get GB/s to another host's segment across the veth and over "
                             "loopback (raw client, store adapter, runtime; tools/fleet_bench.py)")
    parser.add_argument("--workdir", default=None, help="keep the processes' logs here")
    parser.add_argument("--json", default=None, help="write the result here")


def fault_list(text: str) -> list[str]:
    """``--faults``: names of :data:`FAULTS`, comma-separated; a misspelled one gets the nearest."""
    faults = [f.strip() for f in text.split(",") if f.strip()]
    for fault in faults:
        if fault not in FAULTS:
            raise argparse.ArgumentTypeError(f"unknown fault {fault!r}{nearest(fault, FAULTS)}; "
                                             f"choose from {', '.join(FAULTS)}")
    return faults


def _check_host() -> None:
    """What every fleet run needs, checked before it starts any process."""
    require_package("mooncake.store", "hylinker fleet", MOONCAKE_INSTALL)
    from ..stores.mooncake_master import MooncakeMasterError, find_master_binary

    try:
        find_master_binary()
    except MooncakeMasterError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    _check_host()
    if args.throughput:
        return _throughput(args)
    faults = args.faults
    cfg = FleetConfig(hosts=args.hosts, deadline_s=args.deadline_s,
                      call_timeout_s=min(1.0, args.deadline_s / 2))
    from .bench.host import describe, finish, host_record

    host = host_record()
    try:
        with Fleet(cfg, workdir=args.workdir) as fleet:
            result = run_faults(fleet, faults, warm_s=args.warm_s, fault_s=args.fault_s,
                                after_s=args.after_s)
    except NetnsUnavailableError as exc:  # not root, or no `ip`
        raise UsageError(str(exc)) from None
    result["host"] = finish(host)
    print(format_faults(result))
    print(describe(result["host"]))
    print("leaks:", json.dumps(result["leaks"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    bad = result["wrong_restores"] or any(
        e is None or e["leaked_rows"] or e["leaked_slots"] or e["locked_nodes"] or e["idle_error"]
        for e in result["leaks"].values())
    return 1 if bad else 0


def _throughput(args: argparse.Namespace) -> int:
    from .bench.host import describe, finish, host_record
    from .fleet_bench import throughput

    host = host_record()
    try:
        rows = throughput()
    except NetnsUnavailableError as exc:  # not root, or no `ip`
        raise UsageError(str(exc)) from None
    host = finish(host)
    keys = ("setup", "raw_put_gbps", "raw_get_gbps", "store_put_gbps", "store_get_gbps",
            "runtime_put_gbps", "runtime_get_gbps", "one_object_get_ms_p50", "exists_call_ms_p50")
    print(format_table([{k: r[k] for k in keys} for r in rows]))
    print(describe(host))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"throughput": rows, "host": host}, f, indent=1)
    return 0
