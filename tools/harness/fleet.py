"""A fleet on one machine: a Mooncake master and engine hosts, each in its own network namespace.

:class:`Fleet` builds a :class:`~.netns.Network` (a bridge, one veth per namespace), starts
``mooncake_master`` in the ``master`` namespace and one engine process
(:mod:`.fleet_engine`) per host namespace with ``ip netns exec``. Each engine contributes a
Mooncake segment and serves its own requests, so an object one host wrote is read by the other
across the veth (TCP transport), or from its own segment (memcpy) when the master placed it
there; every request event says how many of its objects took each path.

Faults are real: :meth:`Fleet.partition` takes a host's bridge port down, :meth:`kill_engine`
SIGKILLs an engine (its segment dies with it), :meth:`kill_master` / :meth:`start_master`
crash and restart the master on the same address. Every process is started and stopped by
its own PID; :meth:`close` stops them and deletes the namespaces, also on failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import attrs

from ...stores.mooncake_master import MooncakeMaster
from .netns import Host, Network

MASTER_PORT = 50051
METRICS_PORT = 50052


def netns_port_accepts(netns: str, host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection from inside namespace ``netns``."""
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", netns, "timeout", str(max(timeout_s, 0.05)), "bash", "-c",
             f"exec 3<>/dev/tcp/{host}/{port}"], capture_output=True, timeout=timeout_s + 5)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


@attrs.define
class FleetConfig:
    hosts: int = 2
    docs: int = 12
    doc_pages: int = 8
    segment_mib: int = 64
    #: the store wrapper's bounds in each engine: one client call, one whole transfer
    call_timeout_s: float = 1.0
    deadline_s: float = 2.0
    #: Mooncake's own bound on a TCP transfer without progress (MooncakeConfig.transfer_timeout_s)
    transfer_timeout_s: int = 1
    think_s: float = 0.02
    lease_ttl_ms: int = 2000
    #: seconds a host's Mooncake client may go silent before the master drops its segment
    client_ttl_s: int = 4
    probe_paths: bool = True


class EngineProcess:
    """One engine in a host namespace; its ``@@`` events are collected by a reader thread."""

    def __init__(self, fleet: Fleet, role: str, generation: int) -> None:
        self.role = role
        self.host: Host = fleet.net.hosts[role]
        cfg = fleet.config
        self.name = f"{role}g{generation}"
        self.log_path = fleet.workdir / f"{self.name}.log"
        argv = [sys.executable, "-m", "hylinker.tools.harness.fleet_engine", "--name", self.name,
                "--master", fleet.master_address, "--address", self.host.address,
                "--seed", str(1000 * int(role[1:]) + generation), "--docs", str(cfg.docs),
                "--doc-pages", str(cfg.doc_pages), "--segment-mib", str(cfg.segment_mib),
                "--call-timeout-s", str(cfg.call_timeout_s), "--deadline-s", str(cfg.deadline_s),
                "--think-s", str(cfg.think_s), "--transfer-timeout-s", str(cfg.transfer_timeout_s), "--probe-paths", str(int(cfg.probe_paths))]
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._log: IO[bytes] = open(self.log_path, "wb")  # noqa: SIM115 (closed by release())
        env = dict(os.environ, OMP_NUM_THREADS="1", MC_STORE_CLIENT_SETUP_RETRIES="1")
        self.process = subprocess.Popen(self.host.command(argv), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace")
            if not line.startswith("@@"):
                continue
            event = json.loads(line[2:])
            event["host"] = self.role
            event["engine"] = self.name
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_event(self, kind: str, timeout_s: float, after: int = 0) -> dict[str, Any]:
        """The first ``kind`` event at index >= ``after``; raises if none in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for e in self.events[after:]:
                    if e["ev"] == kind:
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self._reader.is_alive()):
                    raise TimeoutError(f"{self.name}: no {kind!r} event in {timeout_s}s "
                                       f"(exit {self.process.poll()}); log {self.log_path}:\n{self.log_tail()}")
                self._cond.wait(min(left, 0.2))

    def requests(self) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self.events if e["ev"] == "req"]

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float) -> dict[str, Any] | None:
        """Ask the engine to finish (drain, leak checks, close); its ``end`` event, or None
        when it had to be killed."""
        if not self.alive:
            return None
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(b"stop\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        end = None
        try:
            end = self.wait_event("end", timeout_s)
            self.wait_event("closed", timeout_s)
            self.process.wait(timeout=timeout_s)
        except (TimeoutError, subprocess.TimeoutExpired):
            self.kill()
        return end

    def kill(self) -> None:
        """SIGKILL the engine (a crash: no drain, no close)."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self._reader.join(timeout=5)

    def release(self) -> None:
        self._log.close()


class Fleet:
    """``hosts`` engine hosts and a master, each in a namespace on one bridge."""

    def __init__(self, config: FleetConfig | None = None, workdir: str | os.PathLike[str] | None = None) -> None:
        self.config = config or FleetConfig()
        if self.config.hosts < 2:
            raise ValueError("a fleet needs at least two hosts")
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hylinker-fleet-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.roles = [f"h{i}" for i in range(self.config.hosts)]
        self.net = Network(["master", *self.roles])
        self.engines: dict[str, EngineProcess] = {}
        self.retired: list[EngineProcess] = []
        self._generation = 0
        self._master_restarts = 0
        self.master: MooncakeMaster | None = None
        try:
            self.start_master()
        except BaseException:
            self.close()
            raise

    @property
    def master_host(self) -> Host:
        return self.net.hosts["master"]

    @property
    def master_address(self) -> str:
        return f"{self.master_host.address}:{MASTER_PORT}"

    def start_master(self) -> None:
        ns = self.master_host.netns
        self._master_restarts += 1
        self.master = MooncakeMaster(
            host=self.master_host.address, rpc_port=MASTER_PORT, metrics_port=METRICS_PORT,
            lease_ttl_ms=self.config.lease_ttl_ms,
            extra_args=[f"--client_ttl={self.config.client_ttl_s}"],
            log_path=self.workdir / f"master{self._master_restarts}.log",
            launcher=["ip", "netns", "exec", ns],
            probe=lambda h, p, t: netns_port_accepts(ns, h, p, t))
        self.master.start(timeout_s=20)

    def kill_master(self) -> None:
        if self.master is not None:
            self.master.kill()
            self.master.stop()

    def start_engine(self, role: str, timeout_s: float = 60.0) -> EngineProcess:
        self._generation += 1
        engine = EngineProcess(self, role, self._generation)
        old = self.engines.get(role)
        if old is not None:
            self.retired.append(old)
        self.engines[role] = engine
        engine.wait_event("ready", timeout_s)
        return engine

    def start_engines(self, timeout_s: float = 60.0) -> None:
        for role in self.roles:
            self.start_engine(role, timeout_s)

    def kill_engine(self, role: str) -> None:
        self.engines[role].kill()

    def partition(self, role: str) -> None:
        self.net.set_link(role, up=False)

    def heal(self, role: str) -> None:
        self.net.set_link(role, up=True)

    def all_engines(self) -> list[EngineProcess]:
        return [*self.retired, *self.engines.values()]

    def requests(self) -> list[dict[str, Any]]:
        out = [e for eng in self.all_engines() for e in eng.requests()]
        return sorted(out, key=lambda e: e["t"])

    def stop_engines(self, timeout_s: float = 30.0) -> dict[str, dict[str, Any] | None]:
        """Stop every live engine gracefully (in parallel); their ``end`` events."""
        ends: dict[str, dict[str, Any] | None] = {}

        def stop(role: str, eng: EngineProcess) -> None:
            ends[role] = eng.stop(timeout_s)

        threads = [threading.Thread(target=stop, args=(r, e)) for r, e in self.engines.items() if e.alive]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return ends

    def close(self) -> None:
        """Kill what still runs (by PID), stop the master, delete the namespaces."""
        try:
            for eng in self.all_engines():
                eng.kill()
                eng.release()
            if self.master is not None:
                self.master.stop()
        finally:
            self.net.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["EngineProcess", "Fleet", "FleetConfig", "netns_port_accepts"]
