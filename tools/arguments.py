"""What the subcommands share about their arguments: the one exception a user's mistake raises,
argparse ``type=`` checks for ranges, files and addresses, and the help formatter that shows
every default.

A mistake a user can make (a flag out of range, a missing or malformed file, an unreachable
master) ends the command with one line on stderr that names the flag or the file and line, and
exit status 2: argparse's own errors through :class:`OneLineParser`, later ones as a
:class:`UsageError` that :func:`hylinker.tools.cli.main` catches.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

#: the exit status of a command the user asked for wrongly (argparse's own)
USAGE_EXIT = 2
#: how to install what ``--store mooncake`` and the Mooncake tools need (docs/guide/install.md)
MOONCAKE_INSTALL = ("install one Mooncake build: pip install 'hylinker[mooncake]' (no CUDA), "
                    "'hylinker[mooncake-cuda12]' or 'hylinker[mooncake-cuda13]', and Debian's libibverbs1 "
                    "(docs/guide/install.md)")


class UsageError(ValueError):
    """The user asked for something the command cannot do; its message (one line) names the
    flag, or the file and line, at fault."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ...``), without the usage
    block above it; ``--help`` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the help already says it, the
    default is ``None`` (the help says what happens then) or the option is an off switch."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default" in text or default is None or default is argparse.SUPPRESS
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
                or not action.option_strings):
            return action.help
        return f"{text} (default: %(default)s)"


def one_line(message: str) -> str:
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


def nearest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to a misspelled ``name``, else ''."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def require_package(package: str, needed_by: str, install: str, *, find_only: bool = False) -> None:
    """A :class:`UsageError` naming ``needed_by`` (a flag or a subcommand) and the package when
    ``package`` does not import here: checked before a run starts, not after its work.
    ``find_only``: only look for it (an engine whose import takes seconds)."""
    try:
        if find_only:
            if importlib.util.find_spec(package) is None:
                raise ImportError(f"no module named {package!r}")
        else:
            importlib.import_module(package)
    except (ImportError, OSError, ValueError) as exc:  # OSError: a native library missing; ValueError: find_spec
        raise UsageError(f"{needed_by} needs the Python package {package!r}, which does not import here "
                         f"({type(exc).__name__}: {exc}); {install}") from None


def number_list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """Comma-separated values, each checked by ``kind`` (one of the checks above)."""

    def check(text: str) -> list[Any]:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        return values

    check.__name__ = "list"
    return check


def _number(kind: Callable[[str], Any], text: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer ``>= low``."""

    def check(text: str) -> int:
        value = int(_number(int, text))
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    check.__name__ = f"int >= {low}"
    return check


def float_in(low: float, high: float = math.inf, *, low_open: bool = False,
             high_open: bool = False) -> Callable[[str], float]:
    """A finite number in ``[low, high]`` (``low_open``/``high_open``: that end excluded)."""

    def check(text: str) -> float:
        value = float(_number(float, text))
        if value < low or (low_open and value == low) or value > high or (high_open and value == high):
            left = "(" if low_open else "["
            right = ")" if high_open or high == math.inf else "]"
            raise argparse.ArgumentTypeError(f"must lie in {left}{low:g}, {high:g}{right}, got {value:g}")
        return value

    check.__name__ = "number"
    return check


positive_int = int_at_least(1)
positive_float = float_in(0.0, low_open=True)
non_negative_float = float_in(0.0)
share = float_in(0.0, 1.0, high_open=True)
probability = float_in(0.0, 1.0)


def trace_file(text: str) -> Path:
    """An existing trace file (the run reads it whole; a malformed line is a :class:`UsageError`
    naming its line)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a trace file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path


def fault_plan(text: str) -> str:
    """A fault plan that parses (:meth:`hylinker.stores.faulty.FaultPlan.parse`), kept as text."""
    from ..stores.fault_plan import FaultPlan

    try:
        FaultPlan.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(one_line(str(exc))) from None
    return text


def master_address(text: str) -> str:
    """A Mooncake master's ``host:port`` that accepts connections now (etcd and HA forms are
    passed on unchecked)."""
    from ..stores.mooncake_client import split_address
    from ..stores.mooncake_master import port_accepts

    try:
        parts = split_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if parts is not None and not port_accepts(*parts, timeout_s=1.0):
        raise argparse.ArgumentTypeError(f"nothing accepts connections on {text} (is mooncake_master running?)")
    return text


__all__ = ["MOONCAKE_INSTALL", "USAGE_EXIT", "DefaultsFormatter", "OneLineParser", "UsageError", "fault_plan", "float_in",
           "int_at_least", "master_address", "nearest", "non_negative_float", "number_list", "one_line",
           "positive_float", "positive_int", "probability", "require_package", "share", "trace_file"]
