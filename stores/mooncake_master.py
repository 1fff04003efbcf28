"""Start and stop a ``mooncake_master`` process on loopback, for tests, CI and local runs.

The master is started without its HTTP metadata server: clients use ``P2PHANDSHAKE`` as
their metadata service, which needs no extra process and connects in tens of milliseconds.
Ports are picked free at start (RPC and the admin/metrics port; both bind to the chosen
host only). The process is stopped by its own PID, never by name.

Use as a context manager::

    with MooncakeMaster() as master:
        store = await MooncakeStore.open(MooncakeConfig(master_address=master.address))

or from a shell (prints the address, runs until Ctrl-C or SIGTERM)::

    python -m hylinker.stores.mooncake_master --port 50051
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .base import exit_closes

BINARY_NAME = "mooncake_master"
INSTALL_HINT = (
    "install the Mooncake build for your torch (`pip install 'hylinker[mooncake]'` without CUDA, "
    "`hylinker[mooncake-cuda12]` or `hylinker[mooncake-cuda13]`: docs/guide/install.md; Debian also needs "
    "`apt-get install libibverbs1`), or run .ci/mooncake-setup.sh as root"
)


class MooncakeMasterError(RuntimeError):
    """The master binary is missing, or the master did not start or stop as asked."""


def find_master_binary() -> str:
    """Path of ``mooncake_master``: ``$PATH``, then next to this Python, then in the wheel."""
    found = shutil.which(BINARY_NAME)
    if found:
        return found
    candidates = [Path(sys.executable).parent / BINARY_NAME]
    with contextlib.suppress(ImportError, OSError):
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                candidates.append(Path(location) / BINARY_NAME)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise MooncakeMasterError(f"`{BINARY_NAME}` binary not found on PATH; {INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_accepts(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port`` (a cheap liveness probe)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One ``mooncake_master`` child process on ``host`` (loopback by default).

    ``lease_ttl_ms`` is the master's object lease (``--default_kv_lease_ttl``): reads and
    existence checks pin an object against eviction and plain removal for this long.
    ``eviction_high_watermark`` / ``eviction_ratio`` tune when and how much the master
    evicts. ``extra_args`` are passed to the binary unchanged.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        rpc_port: int | None = None,
        *,
        metrics_port: int | None = None,
        lease_ttl_ms: int | None = None,
        eviction_high_watermark: float | None = None,
        eviction_ratio: float | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        log_path: str | os.PathLike[str] | None = None,
        launcher: Sequence[str] = (),
        probe: Callable[[str, int, float], bool] | None = None,
    ) -> None:
        """``launcher`` prefixes the command (e.g. ``ip netns exec NS``, which execs the binary
        under the same PID); ``probe(host, port, timeout_s)`` says whether the RPC port accepts
        (default: a TCP connect from this process; a master in another namespace needs one made
        there). Ports given as None are picked free here, so with a launcher pass them."""
        if lease_ttl_ms is not None and lease_ttl_ms <= 0:
            raise ValueError(f"lease_ttl_ms must be positive, got {lease_ttl_ms}")
        for name, ratio in (("eviction_high_watermark", eviction_high_watermark),
                            ("eviction_ratio", eviction_ratio)):
            if ratio is not None and not 0.0 < ratio <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {ratio}")
        self.host = host
        self._requested_rpc_port = rpc_port
        self._requested_metrics_port = metrics_port
        self.lease_ttl_ms = lease_ttl_ms
        self.eviction_high_watermark = eviction_high_watermark
        self.eviction_ratio = eviction_ratio
        self.extra_args = tuple(extra_args)
        self._binary = binary
        self._launcher = tuple(launcher)
        self._probe = probe or port_accepts
        self._log_path = Path(log_path) if log_path is not None else None
        self._own_log = log_path is None
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.rpc_port: int | None = None
        self.metrics_port: int | None = None
        self.startup_seconds: float | None = None

    # -- state -------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port`` of the master RPC service, what clients pass as master address."""
        if self.rpc_port is None:
            raise MooncakeMasterError("the master has not been started")
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the master's log (stdout and stderr)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        text = self._log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    # -- start / stop ------------------------------------------------------------------

    def start(self, timeout_s: float = 15.0) -> MooncakeMaster:
        """Start the master and wait until its RPC port accepts connections."""
        with self._lock:
            if self.running:
                raise MooncakeMasterError(f"master already running at {self.address}")
            binary = self._binary or find_master_binary()
            if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
                raise MooncakeMasterError(f"{binary} is not executable; {INSTALL_HINT}")
            attempts = 1 if self._requested_rpc_port is not None else 3
            last_error = ""
            for _ in range(attempts):  # a picked port can be taken before the master binds
                began = time.perf_counter()
                self._spawn(binary)
                ok, last_error = self._wait_ready(timeout_s)
                if ok:
                    self.startup_seconds = time.perf_counter() - began
                    return self
                self._terminate(timeout_s=2.0)
            raise MooncakeMasterError(f"mooncake_master did not start: {last_error}")

    def _spawn(self, binary: str) -> None:
        self.rpc_port = self._requested_rpc_port or free_port(self.host)
        self.metrics_port = self._requested_metrics_port or free_port(self.host)
        if self._own_log:
            fd, name = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        assert self._log_path is not None
        args = [
            *self._launcher,
            binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false",
            "--logtostderr",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        if self.eviction_high_watermark is not None:
            args.append(f"--eviction_high_watermark_ratio={self.eviction_high_watermark}")
        if self.eviction_ratio is not None:
            args.append(f"--eviction_ratio={self.eviction_ratio}")
        args.extend(self.extra_args)
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal goes to us, not the master
            )

    def _wait_ready(self, timeout_s: float) -> tuple[bool, str]:
        assert self._process is not None and self.rpc_port is not None
        deadline = time.monotonic() + timeout_s
        delay = 0.005
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                return False, f"exited with code {code}; log tail:\n{self.log_tail()}"
            if self._probe(self.host, self.rpc_port, 0.2):
                return True, ""
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return False, f"port {self.rpc_port} not accepting after {timeout_s}s"

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM the master (SIGKILL after ``timeout_s``); idempotent."""
        with self._lock:
            self._terminate(timeout_s)

    def kill(self) -> None:
        """SIGKILL the master at once, as a crash would (for outage tests)."""
        with self._lock:
            process = self._process
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()

    def _terminate(self, timeout_s: float) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait()
        self._process = None

    def close(self) -> None:
        """Stop the master and delete the log file this object created."""
        self.stop()
        if self._own_log and self._log_path is not None:
            with contextlib.suppress(OSError):
                self._log_path.unlink()

    def __enter__(self) -> MooncakeMaster:
        if not self.running:
            self.start()
        return self

    __exit__ = exit_closes

    def __repr__(self) -> str:
        state = f"running at {self.address}" if self.running else "stopped"
        return f"MooncakeMaster({state}, pid={self.pid})"


def wait_for_stop_signal() -> int:
    """Block until SIGINT or SIGTERM; return the signal number."""
    received: list[int] = []
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        done.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received[0]


def add_master_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=None, help="RPC port (default: a free one)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="admin/metrics HTTP port (default: a free one)")
    parser.add_argument("--lease-ttl-ms", type=int, default=None,
                        help="object lease after a read or existence check (master default 10000)")
    parser.add_argument("--log", default=None, help="write the master's log here")


def master_from_arguments(args: argparse.Namespace) -> MooncakeMaster:
    return MooncakeMaster(
        host=args.host,
        rpc_port=args.port,
        metrics_port=args.metrics_port,
        lease_ttl_ms=args.lease_ttl_ms,
        log_path=args.log,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hylinker.stores.mooncake_master",
        description="Run a mooncake_master in the foreground until Ctrl-C or SIGTERM.",
    )
    add_master_arguments(parser)
    args = parser.parse_args(argv)
    try:
        master = master_from_arguments(args).start()
    except MooncakeMasterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    with master:
        print(master.address, flush=True)
        wait_for_stop_signal()
    return 0


if __name__ == "__main__":
    sys.exit(main())
