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

from .arguments import (
    MOONCAKE_INSTALL,
    UsageError,
    int_at_least,
    master_address,
    positive_int,
    require_package,
)

if TYPE_CHECKING:
    from ..stores.mooncake_client import MooncakeSegmentHost

HELP = "run a local Mooncake master / storage segment (for the mooncake store backend)"

_MIB = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    from ..stores.mooncake_master import add_master_arguments

    sub = parser.add_subparsers(dest="mooncake_command", required=True)
    up = sub.add_parser("up", help="start a master in the foreground; print its address")
    add_master_arguments(up)
    up.add_argument("--segment-mib", type=int_at_least(0), default=0,
                    help="also contribute a storage segment of this many MiB (default none)")
    segment = sub.add_parser("segment", help="contribute a storage segment to a master")
    segment.add_argument("--master", required=True, type=master_address, help="master address host:port")
    segment.add_argument("--segment-mib", type=positive_int, required=True, help="segment size in MiB")
    segment.add_argument("--hostname", default="127.0.0.1",
                         help="address other clients reach this process at")
    segment.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp", help="transfer protocol")


def run(args: argparse.Namespace) -> int:
    require_package("mooncake.store", f"hylinker mooncake {args.mooncake_command}", MOONCAKE_INSTALL)
    if args.mooncake_command == "up":
        return _up(args)
    return _segment(args)


def _up(args: argparse.Namespace) -> int:
    from ..stores.mooncake_master import (
        MooncakeMasterError,
        master_from_arguments,
        wait_for_stop_signal,
    )

    try:
        master = master_from_arguments(args).start()
    except MooncakeMasterError as exc:  # no binary, or it did not start on that port
        raise UsageError(str(exc)) from None
    with master:
        host = None
        if args.segment_mib:
            host = _open_segment(master.address, args.segment_mib, args.host, "tcp")
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

    host = _open_segment(args.master, args.segment_mib, args.hostname, args.protocol)
    print(f"segment of {args.segment_mib} MiB mounted on {args.master}; Ctrl-C to stop",
          file=sys.stderr, flush=True)
    try:
        wait_for_stop_signal()
    finally:
        host.close()
    return 0


def _open_segment(master: str, mib: int, hostname: str, protocol: str) -> MooncakeSegmentHost:
    from ..stores.base import StoreUnavailableError
    from ..stores.mooncake_client import MooncakeConfig, MooncakeSegmentHost

    try:
        config = MooncakeConfig(master_address=master, segment_bytes=mib * _MIB,
                                local_hostname=hostname, protocol=protocol)
        return MooncakeSegmentHost(config)
    except (StoreUnavailableError, ValueError) as exc:
        raise UsageError(f"--master {master}: {exc}") from None


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
