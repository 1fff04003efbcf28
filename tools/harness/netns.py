"""A private network of Linux network namespaces: one bridge, one veth per host, one /24.

The fleet harness (:mod:`.fleet`) runs the Mooncake master and each engine host in a namespace
of its own, so every transfer between hosts crosses a real veth and a bridge (TCP through the
kernel's stack, not loopback). Everything is created under names unique to this run
(``hlf<pid>x<n>`` plus a role letter) and deleted on :meth:`Network.close`, which also runs at
interpreter exit; namespaces left by a run whose process is gone are swept on the next start.
Addresses are ``10.77.0.0/24`` *inside* these namespaces only: nothing in the root namespace
is touched or reachable.

Needs root and ``ip`` (iproute2); :func:`require_netns` says which is missing.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Sequence

import attrs

PREFIX = "hlf"
SUBNET = "10.77.0"
_counter = itertools.count()


class NetnsUnavailableError(RuntimeError):
    """Namespaces cannot be built here (not root, or no ``ip``)."""


def require_netns() -> None:
    """Raise :class:`NetnsUnavailableError` saying what is missing for namespaces."""
    if shutil.which("ip") is None:
        raise NetnsUnavailableError("the fleet needs `ip` (iproute2) on PATH: apt-get install iproute2")
    if os.geteuid() != 0:
        raise NetnsUnavailableError(f"the fleet needs root to create network namespaces (euid {os.geteuid()})")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and done.returncode != 0:
        raise NetnsUnavailableError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def sweep_stale() -> list[str]:
    """Delete namespaces this module created for runs whose process no longer exists."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)x\d+[a-z]\w*", name)
        if m is None or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


@attrs.define
class Host:
    """One namespace on the bridge: its name, its address, its bridge-side port."""

    role: str
    netns: str
    address: str
    port: str  # the veth end inside the switch namespace

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Network:
    """A switch namespace with a bridge, and one namespace per role attached to it."""

    def __init__(self, roles: Sequence[str]) -> None:
        require_netns()
        if len(set(roles)) != len(roles) or not roles:
            raise ValueError(f"roles must be distinct and non-empty, got {list(roles)}")
        sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.switch = f"{self.tag}s"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._add_netns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, role in enumerate(roles):
                self._add_host(role, i)
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_host(self, role: str, i: int) -> None:
        netns = f"{self.tag}h{i}"
        port = f"p{i}"
        address = f"{SUBNET}.{10 + i}"
        self._add_netns(netns)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        self.hosts[role] = Host(role, netns, address, port)

    def set_link(self, role: str, up: bool) -> None:
        """Cut (``up=False``) or heal a host's link at the bridge: its packets go nowhere, and
        its own address and routes stay (a partition, not a reconfiguration)."""
        host = self.hosts[role]
        _ip("-n", self.switch, "link", "set", host.port, "up" if up else "down")

    def close(self) -> None:
        """Delete every namespace this network made (their veths and bridge go with them)."""
        if self._closed:
            return
        self._closed = True
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
        atexit.unregister(self.close)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def list_own() -> list[str]:
    """Namespaces of this module that exist now (for leak checks)."""
    names = (line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.split())
    return [n for n in names if re.fullmatch(rf"{PREFIX}\d+x\d+[a-z]\w*", n)]


__all__ = ["Host", "NetnsUnavailableError", "Network", "list_own", "require_netns", "sweep_stale"]
