"""``linker_extra_config`` of :class:`hylinker.integrations.sglang.HylinkerLinker`.

SGLang passes the JSON object given as ``linker_extra_config`` in
``--unified-cache-external-linker-config``. Every key is checked at startup: an unknown key, a
wrong type or an impossible value is a :class:`LinkerConfigError` naming the key, raised from
the linker's constructor (so the server does not start with a typo silently ignored).

This module imports neither SGLang nor a store client, so it can be checked anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..stores.faulty import FaultPlan
from .config import coerce_value, range_validators

STORES = ("embedded", "mooncake", "umbp")


class LinkerConfigError(ValueError):
    """A ``linker_extra_config`` key is unknown or has a bad value."""


_positive, _non_negative = range_validators(LinkerConfigError, "linker_extra_config")


@attrs.frozen
class SGLangLinkerConfig:
    """The plugin's settings; build with :meth:`from_extra_config`."""

    store: str = "embedded"  # "embedded" | "mooncake" | "umbp"
    master: str | None = None  # Mooncake master "HOST:PORT" (store="mooncake")
    segment_mb: int = attrs.field(default=256, validator=_non_negative)  # Mooncake: memory this client contributes
    capacity_mb: int = attrs.field(default=1024, validator=_positive)  # embedded store capacity
    salt: str = ""  # tenant salt: objects of different salts never match
    faults: str = ""  # a fault plan (the `stress --faults` syntax) wrapped around the store
    fault_seed: int = 0
    protocol: str = "tcp"  # Mooncake transfer protocol: "tcp" | "rdma"
    rdma_devices: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    staging_mb: int = attrs.field(default=64, validator=_positive)  # per direction
    load_retries: int = attrs.field(default=3, validator=_non_negative)  # transient store errors
    retry_backoff_ms: float = attrs.field(default=20.0, validator=_non_negative)
    store_timeout_s: float = attrs.field(default=5.0, validator=_positive)  # longest wait on one store call
    lookup_timeout_s: float = attrs.field(default=1.0, validator=_positive)  # longest lookup wait (scheduler thread)
    touch: bool = True  # refresh store recency of prefixes that hit

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> SGLangLinkerConfig:
        """Check every key of ``extra`` and build the config (see the module docstring)."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise LinkerConfigError(f"linker_extra_config must be a JSON object, got {type(extra).__name__}")
        fields = {f.name: f for f in attrs.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise LinkerConfigError(
                f"unknown linker_extra_config keys {unknown}; known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name, raw in extra.items():
            default = fields[name].default
            values[name] = coerce_value("linker_extra_config", name, raw, default, LinkerConfigError)
        try:
            config = cls(**values)
        except LinkerConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise LinkerConfigError(f"linker_extra_config: {exc}") from None
        config._check()
        return config

    def _check(self) -> None:
        if self.store not in STORES:
            raise LinkerConfigError(f"linker_extra_config['store'] must be one of {list(STORES)}, got {self.store!r}")
        if self.store == "mooncake":
            if not self.master:
                raise LinkerConfigError('store "mooncake" needs linker_extra_config["master"] = "HOST:PORT"')
            host, sep, port = self.master.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise LinkerConfigError(f'linker_extra_config["master"] must be "HOST:PORT", got {self.master!r}')
        elif self.master is not None:
            raise LinkerConfigError(f'linker_extra_config["master"] only applies to store "mooncake", not {self.store!r}')
        if self.protocol not in ("tcp", "rdma"):
            raise LinkerConfigError(f'linker_extra_config["protocol"] must be "tcp" or "rdma", got {self.protocol!r}')
        try:
            FaultPlan.parse(self.faults)
        except ValueError as exc:
            raise LinkerConfigError(f'linker_extra_config["faults"]: {exc}') from None

    @property
    def fault_plan(self) -> FaultPlan | None:
        plan = FaultPlan.parse(self.faults)
        return None if plan.is_empty else plan


__all__ = ["STORES", "LinkerConfigError", "SGLangLinkerConfig"]
