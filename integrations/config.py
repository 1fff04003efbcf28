"""The ``extra_config`` every engine plugin takes, and the store it opens.

vLLM passes ``kv_connector_extra_config`` (a JSON object in ``--kv-transfer-config``); SGLang's
external linker passes ``linker_extra_config``. Both take the same keys, checked here at startup:
an unknown key, a wrong type or an impossible value is a :class:`PluginConfigError` naming the
key, raised from the plugin's constructor (the engine does not start with a typo ignored).

This module imports no engine and no store client, so it can be checked anywhere.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from ..stores.base import Store
from ..stores.config_rules import Validator, non_negative, positive
from ..stores.eviction_memory import DEFAULT_BUDGET_BYTES
from ..stores.faulty import FaultPlan
from ..stores.framing import Integrity
from ..stores.registry import StoreSpec, open_store

STORES = ("embedded", "mooncake")
MIB = 1 << 20


#: the environment variable that turns a plugin's trace lines on, whatever its config says
TRACE_ENV = "HYLINKER_TRACE"


class PluginConfigError(ValueError):
    """An ``extra_config`` key is unknown or has a bad value."""


def range_validators(error: type[ValueError], where: str = "") -> tuple[Validator, Validator]:
    """attrs validators ``(positive, non_negative)`` raising ``error`` that names
    ``where[key]``: the one number rule (``stores/config_rules.py``: finite, then in range);
    both plugins' extra-config parsers use them."""

    def naming(_: object, attribute: attrs.Attribute[Any]) -> str:
        return f"{where}[{attribute.name!r}]"

    return positive(error=error, naming=naming), non_negative(error=error, naming=naming)


_positive, _non_negative = range_validators(PluginConfigError)


@attrs.frozen
class PluginConfig:
    """A plugin's settings; build with :meth:`from_extra_config`. An engine plugin that needs
    more keys subclasses it (``integrations/sglang/config.py``)."""

    #: the stores this plugin may name in ``store``
    stores: ClassVar[tuple[str, ...]] = STORES
    #: Mooncake: ask the master whether a key exists before a put (reports EXISTS); without it
    #: an existing key counts as stored and a put costs one master round trip less
    mooncake_detect_exists: ClassVar[bool] = True

    store: str = "embedded"  # "embedded" (in this process) | "mooncake"
    master: str | None = None  # Mooncake master "HOST:PORT" (store="mooncake")
    segment_mb: int = attrs.field(default=256, validator=_non_negative)  # Mooncake memory this engine contributes; 0 = none
    capacity_mb: int = attrs.field(default=1024, validator=_positive)  # embedded store capacity
    #: bytes the embedded store may spend remembering evicted keys, to count those asked for
    #: again (``evicted_probed_again``); 0 turns that diagnostic off (stores/eviction_memory.py)
    eviction_memory_bytes: int = attrs.field(default=DEFAULT_BUDGET_BYTES, validator=_non_negative)
    salt: str = ""  # tenant salt: objects of different salts never match
    #: the operator's name for the weights served (part of every key; components/identity.py):
    #: change it to retire every stored object of the model, e.g. after an update in place
    model_revision: str = ""
    faults: str = ""  # a fault plan (the `stress --faults` syntax) wrapped around the store
    fault_seed: int = 0  # seed of the fault plan's random draws
    protocol: str = "tcp"  # Mooncake transfer protocol: "tcp" | "rdma"
    rdma_devices: str = ""  # Mooncake RDMA devices (protocol="rdma"), comma-separated
    metadata_server: str = "P2PHANDSHAKE"  # Mooncake transfer-engine metadata server ("P2PHANDSHAKE": none needed)
    local_hostname: str = "127.0.0.1"  # the address this engine's Mooncake segment is reached at
    staging_mb: int = attrs.field(default=64, validator=_positive)  # host copies of pages waiting for the store
    lookup_timeout_s: float = attrs.field(default=1.0, validator=_positive)  # longest store probe at admission
    drain_timeout_s: float = attrs.field(default=10.0, validator=_non_negative)  # shutdown: longest wait for writes
    #: what a stored object's frame proves: "checksum" (header and payload checksum) or
    #: "header" (key, layout, length; no payload hash): ``DataPlaneConfig.integrity``
    integrity: str = "checksum"
    trace: bool = False  # JSON trace lines per phase on stderr (also: HYLINKER_TRACE=1)
    #: JSON trace lines appended to this file instead of stderr (turns tracing on; every process
    #: of the engine appends its own lines); `hylinker trace FILE` draws it as a timeline
    trace_file: str = ""

    @property
    def tracing(self) -> bool:
        """``trace``, ``trace_file`` or the ``HYLINKER_TRACE`` environment variable (``1``/``true``/``yes``)."""
        return self.trace or bool(self.trace_file) or os.environ.get(TRACE_ENV, "").strip().lower() in (
            "1", "true", "yes")

    def start_tracing(self, where: str = "extra_config") -> None:
        """Turn tracing on as configured (nothing when it is off); a ``trace_file`` that cannot
        be opened is a :class:`PluginConfigError` naming the key."""
        if not self.tracing:
            return
        from ..runtime.dataplane.tracing import enable_trace_logging

        try:
            enable_trace_logging(sys.stderr, path=self.trace_file or None)
        except OSError as exc:
            raise PluginConfigError(f"{where}['trace_file']: cannot open {self.trace_file!r} "
                                    f"({exc.strerror or exc})") from None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *,
                          where: str = "extra_config") -> PluginConfig:
        """Check every key of ``extra`` (``where`` names it in errors) and build the config."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise PluginConfigError(f"{where} must be a JSON object, got {type(extra).__name__}")
        fields = {f.name: f for f in attrs.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            hints = [f"{key!r} -> {close[0]!r}" for key in unknown
                     if (close := difflib.get_close_matches(key, list(fields), n=1))]
            did_you_mean = f"; did you mean {', '.join(hints)}?" if hints else ""
            raise PluginConfigError(f"unknown {where} keys {unknown}{did_you_mean}; known: {sorted(fields)}")
        values = {name: coerce_value(where, name, raw, fields[name].default, PluginConfigError) for name, raw in extra.items()}
        try:
            config = cls(**values)
        except PluginConfigError as exc:
            raise PluginConfigError(f"{where}{exc}") from None
        except (TypeError, ValueError) as exc:
            raise PluginConfigError(f"{where}: {exc}") from None
        config._check(where)
        return config

    def _check(self, where: str) -> None:
        if self.store not in self.stores:
            raise PluginConfigError(f"{where}['store'] must be one of {list(self.stores)}, got {self.store!r}")
        if self.store == "mooncake":
            if not self.master:
                raise PluginConfigError(f'store "mooncake" needs {where}["master"] = "HOST:PORT"')
            host, sep, port = self.master.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise PluginConfigError(f'{where}["master"] must be "HOST:PORT", got {self.master!r}')
        elif self.master is not None:
            raise PluginConfigError(f'{where}["master"] only applies to store "mooncake", not {self.store!r}')
        try:
            Integrity.parse(self.integrity, f"{where}['integrity']")
        except ValueError as exc:
            raise PluginConfigError(str(exc)) from None
        if self.protocol not in ("tcp", "rdma"):
            raise PluginConfigError(f'{where}["protocol"] must be "tcp" or "rdma", got {self.protocol!r}')
        try:
            FaultPlan.parse(self.faults)
        except ValueError as exc:
            raise PluginConfigError(f'{where}["faults"]: {exc}') from None

    @property
    def integrity_level(self) -> Integrity:
        """``integrity`` as the data plane's setting."""
        return Integrity(self.integrity)

    @property
    def fault_plan(self) -> FaultPlan | None:
        plan = FaultPlan.parse(self.faults)
        return None if plan.is_empty else plan

    async def open_store(self) -> Store:
        """The store these settings name (on the calling event loop), fault plan wrapped around."""
        return (await open_store(StoreSpec(
            self.store, self.capacity_mb * MIB, eviction_memory_bytes=self.eviction_memory_bytes,
            mooncake={"master_address": self.master, "local_hostname": self.local_hostname,
                      "metadata_server": self.metadata_server, "protocol": self.protocol,
                      "rdma_devices": self.rdma_devices, "segment_bytes": self.segment_mb * MIB,
                      "detect_exists": self.mooncake_detect_exists},
            faults=self.fault_plan, fault_seed=self.fault_seed))).store


def coerce_value(where: str, name: str, raw: Any, default: Any,
                 error: type[ValueError] = ValueError) -> Any:
    """JSON value -> the type of the field's default; ``error`` naming ``where[name]``
    otherwise (bools are not numbers). Both plugins' extra-config parsers use it."""
    bad = error(f"{where}[{name!r}] must be {_kind(default)}, got {raw!r}")
    if isinstance(default, bool):
        if not isinstance(raw, bool):
            raise bad
        return raw
    if isinstance(default, int):
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise bad
        return raw
    if isinstance(default, float):
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise bad
        return float(raw)
    if not isinstance(raw, str) and not (default is None and raw is None):
        raise bad
    return raw


def _kind(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a number"
    return "a string"


__all__ = ["STORES", "TRACE_ENV", "PluginConfig", "PluginConfigError", "coerce_value", "range_validators"]
