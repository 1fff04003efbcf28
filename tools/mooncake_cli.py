"""``hylinker mooncake``: run a Mooncake master (and optionally a storage segment) locally.

``hylinker mooncake up`` starts ``mooncake_master`` on loopback in the foreground, prints its
address (what ``MooncakeConfig.master_address`` takes) and stops it on Ctrl-C or SIGTERM.
With ``--segment-mib N`` this process also contributes an N MiB storage segment, so clients
can run with ``segment_bytes=0`` (the "separate storage process" setup).

``hylinker mooncake segment --master HOST:PORT --segment-mib N`` contributes a segment to a
master that runs elsewhere.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..stores.mooncake_client import MooncakeSegmentHost

HELP = "run a local Mooncake master / storage segment (for the mooncake store backend)"

_MIB = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    from ..stores.mooncake_master import add_master_arguments

    sub = parser.add_subparsers(dest="mooncake_command", required=True)
    up = sub.add_parser("up", help="start a master in the foreground; print its address")
    add_master_arguments(up)
    up.add_argument("--segment-mib", type=int, default=0,
                    help="also contribute a storage segment of this many MiB (default none)")
    segment = sub.add_parser("segment", help="contribute a storage segment to a master")
    segment.add_argument("--master", required=True, help="master address host:port")
    segment.add_argument("--segment-mib", type=int, required=True, help="segment size in MiB")
    segment.add_argument("--hostname", default="127.0.0.1",
                         help="address other clients reach this process at")
    segment.add_argument("--protocol", default="tcp", help="transfer protocol: tcp or rdma")


def run(args: argparse.Namespace) -> int:
    if args.mooncake_command == "up":
        return _up(args)
    return _segment(args)


def _up(args: argparse.Namespace) -> int:
    from ..stores.mooncake_master import (
        MooncakeMasterError,
        master_from_arguments,
        wait_for_stop_signal,
    )

    if args.segment_mib < 0:
        print("error: --segment-mib must be >= 0", file=sys.stderr)
        return 2
    try:
        master = master_from_arguments(args).start()
    except MooncakeMasterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    with master:
        host = None
        if args.segment_mib:
            host = _open_segment(master.address, args.segment_mib, args.host, "tcp")
            if host is None:
                return 1
        print(master.address, flush=True)
        print(f"mooncake master pid {master.pid} ready in {master.startup_seconds:.3f}s"
              + (f", segment {args.segment_mib} MiB" if host else "")
              + "; Ctrl-C to stop", file=sys.stderr, flush=True)
        try:
            wait_for_stop_signal()
        finally:
            if host is not None:
                host.close()
    return 0


def _segment(args: argparse.Namespace) -> int:
    from ..stores.mooncake_master import wait_for_stop_signal

    if args.segment_mib <= 0:
        print("error: --segment-mib must be > 0", file=sys.stderr)
        return 2
    host = _open_segment(args.master, args.segment_mib, args.hostname, args.protocol)
    if host is None:
        return 1
    print(f"segment of {args.segment_mib} MiB mounted on {args.master}; Ctrl-C to stop",
          file=sys.stderr, flush=True)
    try:
        wait_for_stop_signal()
    finally:
        host.close()
    return 0


def _open_segment(master: str, mib: int, hostname: str, protocol: str) -> MooncakeSegmentHost | None:
    from ..stores.base import StoreUnavailableError
    from ..stores.mooncake_client import MooncakeConfig, MooncakeSegmentHost

    try:
        config = MooncakeConfig(master_address=master, segment_bytes=mib * _MIB,
                                local_hostname=hostname, protocol=protocol)
        return MooncakeSegmentHost(config)
    except (StoreUnavailableError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def start_segment_process(master: str, segment_mib: int) -> subprocess.Popen[str]:
    """``hylinker mooncake segment`` in a child process, returned once its segment is mounted (a
    storage-only client for engines that contribute none); raises if it exits first. Kill it when done."""
    seg = subprocess.Popen([sys.executable, "-m", "hylinker", "mooncake", "segment", "--master", master,
                            "--segment-mib", str(segment_mib)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert seg.stderr is not None
    for _ in range(200):
        line = seg.stderr.readline()
        if "mounted" in line or seg.poll() is not None:
            break
    if seg.poll() is not None:
        raise RuntimeError(f"the storage process exited: {seg.stderr.read()[-2000:]}")
    return seg
