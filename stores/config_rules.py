"""The one rule for a setting's number: a real, finite value in its range, else an error naming it.

Every config class (the plugins' ``extra_config``, ``LinkerConfig``, ``DataPlaneConfig``,
``ResiliencePolicy``, ``MooncakeConfig``, the fault plan) checks its numbers with the attrs
validators made here, so the rule lives in one place: a ``bool`` is not a number, ``NaN`` and
``±Infinity`` are refused (Python's ``json`` reads both, and ``NaN <= 0`` is false, so a bare
range check lets it through), then the range. The error names the field the way its class is
written by users (``ResiliencePolicy.call_timeout_s``, ``linker_extra_config['lookup_timeout_s']``).

This lives in ``stores/`` because it is the lowest layer every config class may import.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

#: how a field is named in an error: ``(instance, attribute) -> "Owner.field"``
Naming = Callable[[object, "attrs.Attribute[Any]"], str]
Validator = Callable[[object, "attrs.Attribute[Any]", Any], None]


def owner_field(instance: object, attribute: attrs.Attribute[Any]) -> str:
    """``Owner.field``: the class's name and the field's."""
    return f"{type(instance).__name__}.{attribute.name}"


def number_rule(*, above: float | None = None, at_least: float | None = None,
                at_most: float | None = None, optional: bool = False, integer: bool = False,
                error: type[ValueError] = ValueError, naming: Naming = owner_field) -> Validator:
    """An attrs validator: the value is a finite ``int`` or ``float`` (not a ``bool``; only an
    ``int`` when ``integer``), greater than ``above``, at least ``at_least``, at most ``at_most``
    (each bound optional); ``None`` passes when ``optional``. Anything else raises ``error``
    naming the field (``naming``)."""
    check_value = number_check(above=above, at_least=at_least, at_most=at_most, integer=integer)

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        wrong = check_value(value)
        if wrong is not None:
            raise error(f"{naming(instance, attribute)} {wrong}")

    return check


def number_check(*, above: float | None = None, at_least: float | None = None,
                 at_most: float | None = None, integer: bool = False) -> Callable[[Any], str | None]:
    """The rule of :func:`number_rule` as a plain function, for a value checked outside attrs
    (a budget known only once the pools are): ``None`` when ``value`` keeps it, else the
    sentence's end (``"must be an int >= 1 and finite, got 2.5"``) to follow the field's name."""
    low = f"({above:g}" if above is not None else f"[{at_least:g}" if at_least is not None else None
    if low is not None and at_most is not None:
        wanted = f"in {low}, {at_most:g}] and finite"
    elif low is not None:
        wanted = f"{'>' if above is not None else '>='} {low[1:]} and finite"
    elif at_most is not None:
        wanted = f"<= {at_most:g} and finite"
    else:
        wanted = "a finite number"
    if integer:
        wanted = "an int" + ("" if wanted == "a finite number" else f" {wanted.removesuffix(' and finite')}")

    def check(value: Any) -> str | None:
        ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
              and (not integer or isinstance(value, int))
              and (above is None or value > above) and (at_least is None or value >= at_least)
              and (at_most is None or value <= at_most))
        return None if ok else f"must be {wanted}, got {value!r}"

    return check


def positive(*, optional: bool = False, error: type[ValueError] = ValueError,
             naming: Naming = owner_field) -> Validator:
    """A finite number > 0."""
    return number_rule(above=0, optional=optional, error=error, naming=naming)


def non_negative(*, optional: bool = False, error: type[ValueError] = ValueError,
                 naming: Naming = owner_field) -> Validator:
    """A finite number >= 0."""
    return number_rule(at_least=0, optional=optional, error=error, naming=naming)


def share(*, error: type[ValueError] = ValueError, naming: Naming = owner_field) -> Validator:
    """A share of something: a finite number in (0, 1]."""
    return number_rule(above=0, at_most=1, error=error, naming=naming)


__all__ = ["Naming", "Validator", "non_negative", "number_check", "number_rule", "owner_field", "positive", "share"]
