"""The Mooncake client itself: importing it, its return codes and what each means to the store
protocol, its configuration and setup, and a storage-only client (:class:`MooncakeSegmentHost`).
The store adapter built on it is :mod:`hylinker.stores.mooncake`.

Return codes (measured against mooncake-transfer-engine-non-cuda 0.3.13):

=========  ==========================  =========================================
code       Mooncake name               outcome
=========  ==========================  =========================================
0 / n>=0   OK / bytes read             OK
-200       NO_AVAILABLE_HANDLE         FULL (no room; the master evicts async)
-600       INVALID_PARAMS              get: TOO_SMALL (buffer < object); else FAILED
-703       REPLICA_IS_NOT_READY        get: MISSING (a writer has not finished)
-704       OBJECT_NOT_FOUND            MISSING
-705       OBJECT_ALREADY_EXISTS       EXISTS
-706       OBJECT_HAS_LEASE            LEASED
-707       LEASE_EXPIRED               get: retried once, then FAILED
-900       RPC_FAIL                    UNREACHABLE
other < 0                              FAILED
=========  ==========================  =========================================
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import struct
from typing import Any

import attrs

from .base import Outcome, StoreUnavailableError, exit_closes
from .config_rules import number_rule, positive
from .mooncake_master import port_accepts

log = logging.getLogger(__name__)

MIB = 1 << 20

# Mooncake ErrorCode values (mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
RPC_FAIL = -900

SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
TRANSFER_TIMEOUT_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC", "MC_TRANSFER_TIMEOUT")


#: ``batch_put_from``'s error codes (0 is OK; a code not here is FAILED)
_PUT_ERRORS = {NO_AVAILABLE_HANDLE: Outcome.FULL, OBJECT_ALREADY_EXISTS: Outcome.EXISTS,
               OBJECT_HAS_LEASE: Outcome.LEASED, RPC_FAIL: Outcome.UNREACHABLE}
#: ``batch_get_into``'s error codes (>= 0: bytes read, OK; a code not here is FAILED)
_GET_ERRORS = {OBJECT_NOT_FOUND: Outcome.MISSING, REPLICA_IS_NOT_READY: Outcome.MISSING,
               INVALID_PARAMS: Outcome.TOO_SMALL, OBJECT_HAS_LEASE: Outcome.LEASED, RPC_FAIL: Outcome.UNREACHABLE}


def put_outcome(code: int) -> Outcome:
    """Map a ``batch_put_from`` return code to an :class:`Outcome`."""
    return Outcome.OK if code == 0 else _PUT_ERRORS.get(code, Outcome.FAILED)


def get_outcome(code: int) -> Outcome:
    """Map a ``batch_get_into`` return code (bytes read when >= 0) to an :class:`Outcome`."""
    return Outcome.OK if code >= 0 else _GET_ERRORS.get(code, Outcome.FAILED)


def import_mooncake_store() -> Any:
    """``mooncake.store`` or a clear :class:`StoreUnavailableError` saying how to install it."""
    try:
        import mooncake.store as mooncake_store
    except (ImportError, OSError) as exc:  # OSError: libibverbs.so.1 missing
        raise StoreUnavailableError(
            f"cannot import mooncake.store ({exc}); install the Mooncake build for your torch "
            "(`pip install 'hylinker[mooncake]'` without CUDA, `hylinker[mooncake-cuda12]` or "
            "`hylinker[mooncake-cuda13]`: docs/guide/install.md) and Debian's `libibverbs1`"
        ) from exc
    return mooncake_store


def split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a plain ``host:port`` master address; None for etcd/HA forms."""
    if "://" in address or ";" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"master address must be host:port, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@attrs.frozen
class MooncakeConfig:
    """How to reach the master and what this client contributes."""

    master_address: str  # "host:port" of mooncake_master
    local_hostname: str = "127.0.0.1"  # address other clients reach this one at
    metadata_server: str = "P2PHANDSHAKE"  # transfer-engine metadata; P2P needs no server
    protocol: str = "tcp"  # "tcp" or "rdma"
    rdma_devices: str = ""
    segment_bytes: int = 256 * MIB  # memory contributed to the cluster; 0 = pure client
    local_buffer_bytes: int = 16 * MIB  # client-side transfer buffer
    workers: int = 4  # concurrent blocking client calls
    bounce_bytes: int = 16 * MIB  # initial bounce buffer for unregistered buffers
    max_batch: int = 4096  # keys per client call
    #: buffers the client's transfer engine takes in flight, all calls together (one per
    #: object, one per part of a multi-buffer object). Over TCP, Mooncake's lane queues reject
    #: the excess and the call fails those objects after a 60 s wait (measured on loopback
    #: against a peer's segment: 2,050 buffers in one call stored, 2,150 lost 4 objects and
    #: 2,400 lost every object; four calls of 1,000 at once stored 2,292). A call carries at
    #: most ``transfer_queue // workers`` buffers, so the calls in flight stay within it
    transfer_queue: int = 2048
    setup_retries: int = 1  # client connect attempts in setup (~4.4 s each when refused)
    probe_timeout_s: float = attrs.field(default=1.0, validator=positive())  # TCP probe of the master after it failed once
    detect_exists: bool = True  # check existence before put to report EXISTS
    force_remove: bool = True  # remove even leased objects (see module docstring)
    #: seconds a TCP transfer to a peer's segment may make no progress before it fails
    #: (``MC_TCP_PROGRESS_TIMEOUT_SEC`` / ``MC_TCP_STATUS_TIMEOUT_SEC`` / ``MC_TRANSFER_TIMEOUT``,
    #: set for the process unless already set). None: Mooncake's 30 s. A get cannot be
    #: abandoned (the client would still write the caller's buffer), so this, not the store
    #: wrapper's call timeout, bounds a read from a partitioned peer (measured: a 12 s
    #: partition held loads 12.4 s with None, 130 ms with 1)
    transfer_timeout_s: int | None = attrs.field(default=None, validator=number_rule(at_least=1, optional=True))
    #: whether the client reads and writes GPU memory (device pools registered and moved in
    #: place); None: found out from the client's build (:func:`device_memory_support`)
    device_memory: bool | None = None
    #: row-described sub-batches (``put_rows`` / ``get_rows``, :mod:`hylinker.stores.mooncake_rows`,
    #: ``capabilities.rows``); False: the data plane moves in place by ``put_parts`` / ``get_parts``
    row_calls: bool = True
    #: ``StoreCapabilities.min_run_bytes``: objects whose pool runs are shorter on average move
    #: staged (one buffer each). None: 256 KiB for a pure client over TCP (``segment_bytes`` 0,
    #: every object crosses to a peer's segment, and Mooncake's TCP transport pays per buffer:
    #: design/stores.md), 0 otherwise (in-process segment, RDMA)
    in_place_min_run_bytes: int | None = attrs.field(default=None, validator=number_rule(at_least=0, optional=True))

    @property
    def min_run_bytes(self) -> int:
        """The resolved :attr:`in_place_min_run_bytes`."""
        if self.in_place_min_run_bytes is not None:
            return self.in_place_min_run_bytes
        return 256 * 1024 if self.segment_bytes == 0 and self.protocol == "tcp" else 0

    def __attrs_post_init__(self) -> None:
        split_address(self.master_address)
        if self.segment_bytes < 0 or self.local_buffer_bytes < 0:
            raise ValueError("segment_bytes and local_buffer_bytes must be >= 0")
        if self.workers < 1 or self.max_batch < 1 or self.setup_retries < 1:
            raise ValueError("workers, max_batch and setup_retries must be >= 1")
        if self.transfer_queue < self.workers:
            raise ValueError(f"transfer_queue ({self.transfer_queue}) must be at least workers ({self.workers})")
        if self.bounce_bytes < 4096:
            raise ValueError("bounce_bytes must be at least 4096")


def needed_libraries(path: str) -> list[str]:
    """The shared libraries an ELF64 little-endian object names as needed (``DT_NEEDED``)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _needed(data, path)


def _needed(data: mmap.mmap, path: str) -> list[str]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a little-endian ELF64 object")
    shoff = int.from_bytes(data[0x28:0x30], "little")
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize) per section
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed: list[str] = []
    for sec in sections:
        if sec[1] != 6:  # SHT_DYNAMIC
            continue
        strings = sections[sec[6]][4]
        for off in range(sec[4], sec[4] + sec[5], 16):
            tag, value = struct.unpack_from("<qQ", data, off)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                start = strings + value
                needed.append(data[start:data.find(b"\0", start)].decode())
    return needed


@functools.cache
def _client_links(path: str) -> tuple[str, ...]:
    return tuple(n for n in needed_libraries(path) if n.startswith(("libcuda.", "libcuda-", "libcudart")))


def device_memory_support(config: MooncakeConfig) -> tuple[bool, str]:
    """Whether the Mooncake client can address GPU memory, and why we think so.

    The Python client has no call that says so: GPU support is a build option (``USE_CUDA``;
    the ``mooncake-transfer-engine`` wheels are built with it, ``-non-cuda`` ones without), and
    a client built with it links the CUDA runtime or driver (Mooncake's own release check reads
    the same ``DT_NEEDED`` entries). So: ``config.device_memory`` when set, else whether
    ``mooncake/store`` links ``libcuda`` / ``libcudart``. A build that links CUDA statically
    reads as unsupported (device pools then stay staged: slower, never wrong); set
    ``device_memory=True`` for it."""
    if config.device_memory is not None:
        return config.device_memory, f"MooncakeConfig.device_memory={config.device_memory}"
    try:
        mooncake_store = import_mooncake_store()
        path = str(mooncake_store.__file__)
        cuda = _client_links(path)
    except (StoreUnavailableError, OSError, ValueError, AttributeError, struct.error) as exc:
        return False, f"cannot tell how the Mooncake client was built ({exc})"
    if cuda:
        return True, f"{path} links {', '.join(cuda)} (built with GPU support)"
    return False, (f"{path} links no CUDA library: the client was built without GPU support "
                   "(e.g. the mooncake-transfer-engine-non-cuda wheel)")


def setup_client(mooncake_store: Any, config: MooncakeConfig) -> Any:
    client = mooncake_store.MooncakeDistributedStore()
    # Cap the client's connect retries: 20 by default, ~4.4 s each against a dead master.
    os.environ.setdefault(SETUP_RETRIES_ENV, str(config.setup_retries))
    if config.transfer_timeout_s is not None:
        for name in TRANSFER_TIMEOUT_ENV:
            os.environ.setdefault(name, str(config.transfer_timeout_s))
    rc = client.setup(
        config.local_hostname,
        config.metadata_server,
        config.segment_bytes,
        config.local_buffer_bytes,
        config.protocol,
        config.rdma_devices,
        config.master_address,
    )
    if rc != 0:
        # setup() failed: nothing is mounted; close() releases what was half built.
        try:
            client.close()
        except Exception:  # pragma: no cover - best effort
            log.debug("close after failed setup raised", exc_info=True)
        raise StoreUnavailableError(
            f"Mooncake client setup against master {config.master_address} failed (code {rc})"
        )
    return client


class MooncakeSegmentHost:
    """A storage-only client: contributes ``segment_bytes`` to the cluster, issues no requests.

    Run it in its own process (``hylinker mooncake segment``) to measure or deploy the
    "separate storage process" setup: the runtime's :class:`MooncakeStore` then uses
    ``segment_bytes=0`` and every byte crosses the transfer engine to this process.
    """

    def __init__(self, config: MooncakeConfig) -> None:
        if config.segment_bytes <= 0:
            raise ValueError("a segment host needs segment_bytes > 0")
        mooncake_store = import_mooncake_store()
        master = split_address(config.master_address)
        if master is not None and not port_accepts(master[0], master[1], config.probe_timeout_s):
            raise StoreUnavailableError(
                f"Mooncake master {config.master_address} is not accepting connections"
            )
        self.config = config
        self._client: Any = setup_client(
            mooncake_store, attrs.evolve(config, local_buffer_bytes=0)
        )

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> MooncakeSegmentHost:
        return self

    __exit__ = exit_closes
