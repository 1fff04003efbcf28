"""The fault plan of :class:`~hylinker.stores.faulty.FaultyStore`: what to inject and how often,
and the counters of what was injected (see that module's doc for each fault)."""

from __future__ import annotations

import difflib
from typing import Any, ClassVar

import attrs

from .base import StoreStatistics
from .config_rules import non_negative, number_rule

_SCHEDULED = ("failed", "unavailable", "timeout")


def _plan_field(_: object, attribute: attrs.Attribute[Any]) -> str:
    return f"fault plan {attribute.name}"


_probability = number_rule(at_least=0, at_most=1, naming=_plan_field)  # a probability lies in [0, 1]
_non_negative = non_negative(optional=True, naming=_plan_field)


def _check_ranges(
    _: object, attribute: attrs.Attribute[Any], value: tuple[tuple[int, int], ...]
) -> None:
    for item in value:
        if (
            not isinstance(item, tuple)
            or len(item) != 2
            or not all(isinstance(x, int) for x in item)
            or not 1 <= item[0] <= item[1]
        ):
            raise ValueError(
                f"fault plan {attribute.name}: each range is (first, last) call numbers with "
                f"1 <= first <= last, got {item!r}"
            )


def _to_ranges(value: object) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"fault plan fail_calls must be a sequence of ranges, got {value!r}")
    return tuple(tuple(r) if isinstance(r, (tuple, list)) else r for r in value)


@attrs.frozen
class FaultPlan:
    """What to inject, and how often. Probabilities are per key unless said per call."""

    fail: float = attrs.field(default=0.0, converter=float, validator=_probability)
    unavailable: float = attrs.field(default=0.0, converter=float, validator=_probability)
    timeout: float = attrs.field(default=0.0, converter=float, validator=_probability)
    torn: float = attrs.field(default=0.0, converter=float, validator=_probability)
    corrupt: float = attrs.field(default=0.0, converter=float, validator=_probability)
    vanish: float = attrs.field(default=0.0, converter=float, validator=_probability)
    corrupt_first_read: float = attrs.field(default=0.0, converter=float, validator=_probability)
    latency_ms: float = attrs.field(default=0.0, converter=float, validator=_non_negative)
    jitter_ms: float = attrs.field(default=0.0, converter=float, validator=_non_negative)
    deadline_ms: float | None = attrs.field(
        default=None,
        converter=attrs.converters.optional(float),
        validator=_non_negative,
    )
    fail_calls: tuple[tuple[int, int], ...] = attrs.field(
        default=(), converter=_to_ranges, validator=_check_ranges
    )
    fail_every: int = attrs.field(default=0, converter=int, validator=_non_negative)
    scheduled: str = attrs.field(default="failed", validator=attrs.validators.in_(_SCHEDULED))

    RATE_FIELDS: ClassVar[tuple[str, ...]] = (
        "fail", "unavailable", "timeout", "torn", "corrupt", "vanish",
    )

    @classmethod
    def uniform(cls, rate: float, **overrides: object) -> FaultPlan:
        """One rate for every fault kind (fail, unavailable, timeout, torn, corrupt, vanish)."""
        fields: dict[str, object] = dict.fromkeys(cls.RATE_FIELDS, rate)
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """Parse ``"fail=0.05,latency_ms=2,fail_calls=3-5+9-9,uniform=0.01,..."``.

        ``uniform=R`` sets every rate first; the other fields override it. ``fail_calls``
        takes ``first-last`` ranges joined by ``+``. An empty string is the empty plan.
        """
        fields: dict[str, object] = {}
        uniform: float | None = None
        names = {f.name for f in attrs.fields(cls)}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, raw = item.partition("=")
            name, raw = name.strip(), raw.strip()
            if not sep or not raw:
                raise ValueError(f"fault plan item {item!r} is not name=value")
            if name == "uniform":
                uniform = _parse_float(name, raw)
            elif name not in names:
                close = difflib.get_close_matches(name, ["uniform", *names], n=1)
                raise ValueError(
                    f"unknown fault plan field {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                    f"known: uniform, {', '.join(sorted(names))}"
                )
            elif name == "fail_calls":
                fields[name] = _parse_ranges(raw)
            elif name == "scheduled":
                fields[name] = raw
            elif name == "fail_every":
                try:
                    fields[name] = int(raw)
                except ValueError:
                    raise ValueError(f"fault plan fail_every={raw!r} is not an integer") from None
            else:
                fields[name] = _parse_float(name, raw)
        if uniform is not None:
            return cls.uniform(uniform, **fields)
        return cls(**fields)  # type: ignore[arg-type]

    def describe(self) -> str:
        """The plan as a :meth:`parse` string (fields that differ from the default)."""
        parts: list[str] = []
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if value == field.default:
                continue
            if field.name == "fail_calls":
                parts.append("fail_calls=" + "+".join(f"{a}-{b}" for a, b in value))
            else:
                parts.append(f"{field.name}={value}")
        return ",".join(parts)

    @property
    def is_empty(self) -> bool:
        """True when the plan injects nothing."""
        return self == FaultPlan()


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"fault plan {name}={raw!r} is not a number") from None


def _parse_ranges(raw: str) -> tuple[tuple[int, int], ...]:
    ranges: list[tuple[int, int]] = []
    for part in raw.split("+"):
        first, sep, last = part.partition("-")
        try:
            ranges.append((int(first), int(last) if sep else int(first)))
        except ValueError:
            raise ValueError(
                f"fault plan fail_calls={raw!r}: use first-last ranges joined by '+', e.g. 3-5+9-9"
            ) from None
    return tuple(ranges)


@attrs.frozen
class FaultStatistics(StoreStatistics):
    """The inner store's counters plus every fault injected."""

    calls: int = 0
    failed_keys: int = 0
    unavailable_calls: int = 0
    scheduled_failures: int = 0
    timeouts: int = 0
    delayed_calls: int = 0
    torn_writes: int = 0
    corrupted_writes: int = 0
    corrupted_reads: int = 0
    corrupted_first_reads: int = 0
    vanished: int = 0


_FAULT_COUNTERS = tuple(
    f.name for f in attrs.fields(FaultStatistics) if f.name not in
    {g.name for g in attrs.fields(StoreStatistics)}
)
