"""Every number of every config is finite and in range, or start-up fails naming the key (issue 42).

Python's ``json`` reads ``NaN``, ``Infinity`` and ``-Infinity``, and ``NaN <= 0`` is false, so a
bare range check let them through: ``lookup_timeout_s: Infinity`` raised ``OverflowError`` in
vLLM's scheduler, ``NaN`` made every lookup a miss. The configs share one rule
(``stores/config_rules.py``); these tests go through the entry points users use: the JSON
``extra_config`` parse of both engines and the config classes themselves.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest

from hylinker.integrations.config import PluginConfigError
from hylinker.integrations.sglang.config import SGLangLinkerConfig
from hylinker.integrations.vllm.config import VllmConnectorConfig
from hylinker.runtime.dataplane.plane import DataPlaneConfig
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.stores.fault_plan import FaultPlan
from hylinker.stores.mooncake_client import MooncakeConfig
from hylinker.stores.resilient import ResiliencePolicy

#: (class, the arguments it needs besides the field under test)
CLASSES: list[tuple[type, dict[str, Any]]] = [
    (LinkerConfig, {}),
    (DataPlaneConfig, {}),
    (ResiliencePolicy, {}),
    (MooncakeConfig, {"master_address": "127.0.0.1:50051"}),
    (FaultPlan, {}),
]
ENGINES = [VllmConnectorConfig, SGLangLinkerConfig]
#: float fields where 0 means something (no wait, no backoff, no jitter, no fault)
ZERO_ALLOWED = {"drain_timeout_s", "retry_backoff_ms", "backoff_s", "backoff_max_s", "jitter",
                "close_grace_s", "fail", "unavailable", "timeout", "torn", "corrupt", "vanish",
                "corrupt_first_read", "latency_ms", "jitter_ms", "deadline_ms",
                "load_wait_s",  # LinkerConfig: 0, a load never waits for pages
                "kv_backpressure_wait_s"}  # LinkerConfig: 0, the KV rule skips at once
#: what JSON reads, written as JSON text
NON_FINITE = ["NaN", "Infinity", "-Infinity"]


def _float_fields(cls: type) -> list[str]:
    return [f.name for f in attrs.fields(cls) if str(f.type).startswith("float")]


def _cases(classes: list[type]) -> list[tuple[type, str]]:
    return [(cls, name) for cls in classes for name in _float_fields(cls)]


def test_every_config_has_float_keys_under_test() -> None:
    # the enumeration below is not vacuous: the keys the issue names are among them
    engine_keys = {name for _, name in _cases(ENGINES)}
    assert {"lookup_timeout_s", "drain_timeout_s", "store_timeout_s", "retry_backoff_ms"} <= engine_keys
    assert "call_timeout_s" in _float_fields(ResiliencePolicy)
    assert "probe_timeout_s" in _float_fields(MooncakeConfig)


@pytest.mark.parametrize("text", NON_FINITE)
@pytest.mark.parametrize(("cls", "key"), _cases(ENGINES), ids=lambda v: getattr(v, "__name__", v))
def test_extra_config_refuses_non_finite(cls: Any, key: str, text: str) -> None:
    extra = json.loads(f'{{"{key}": {text}}}')  # what the engine hands the plugin
    assert not math.isfinite(extra[key])
    with pytest.raises(PluginConfigError, match=rf"\['{key}'\] must be .*finite"):
        cls.from_extra_config(extra)


@pytest.mark.parametrize("text", ["0", "-1", "-0.5"])
@pytest.mark.parametrize(("cls", "key"), _cases(ENGINES), ids=lambda v: getattr(v, "__name__", v))
def test_extra_config_range(cls: Any, key: str, text: str) -> None:
    extra = json.loads(f'{{"{key}": {text}}}')
    if text == "0" and key in ZERO_ALLOWED:
        assert getattr(cls.from_extra_config(extra), key) == 0
        return
    with pytest.raises(PluginConfigError, match=rf"\['{key}'\] must be"):
        cls.from_extra_config(extra)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -1.0])
@pytest.mark.parametrize(("cls", "key"), _cases([c for c, _ in CLASSES]),
                         ids=lambda v: getattr(v, "__name__", v))
def test_config_classes_refuse_bad_floats(cls: type, key: str, value: float) -> None:
    needs = dict(CLASSES)[cls]
    if value == 0 and key in ZERO_ALLOWED:
        cls(**needs, **{key: value})
        return
    with pytest.raises(ValueError, match=rf"{key}\b.* must be .*finite"):
        cls(**needs, **{key: value})


def test_int_settings_refuse_non_finite_too() -> None:
    # an int setting given a float from Python goes through the same rule
    with pytest.raises(ValueError, match=r"LinkerConfig\.queue_depth must be > 0 and finite"):
        LinkerConfig(queue_depth=math.inf)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"DataPlaneConfig\.queue_depth must be > 0 and finite"):
        DataPlaneConfig(queue_depth=math.inf)  # type: ignore[arg-type]


def test_fault_plan_from_the_faults_key() -> None:
    with pytest.raises(PluginConfigError, match="latency_ms"):
        SGLangLinkerConfig.from_extra_config({"faults": "latency_ms=nan"})


@pytest.mark.parametrize(("build", "named"), [
    (lambda v: LinkerConfig(in_place_min_bytes=v), r"LinkerConfig\.in_place_min_bytes must be an int >= 0"),
    (lambda v: DataPlaneConfig(in_place_min_bytes=v), r"DataPlaneConfig\.in_place_min_bytes must be an int >= 0"),
    (lambda v: DataPlaneConfig(layer_groups=v), r"DataPlaneConfig\.layer_groups must be an int > 0"),
    (lambda v: LinkerConfig(host_staging_bytes=v), r"LinkerConfig\.host_staging_bytes must be an int > 0"),
    (lambda v: DataPlaneConfig(host_staging_bytes=v), r"DataPlaneConfig\.host_staging_bytes must be an int > 0"),
])
@pytest.mark.parametrize("value", [2.0, math.nan, True, "4"])
def test_int_only_settings_refuse_every_non_int(build: Any, named: str, value: object) -> None:
    # the integer form of the one number rule (stores/config_rules.number_check): a whole float is
    # still not a count of bytes or layer groups
    with pytest.raises(ValueError, match=named):
        build(value)
