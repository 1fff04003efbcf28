"""The hylinker command line: one subcommand per tool module.

Each module in ``COMMANDS`` exposes ``HELP: str``, ``configure(parser)`` and ``run(args) -> int``;
it keeps heavy imports (transformers, matplotlib, mooncake) inside ``run`` so ``--help`` is fast.
Each module in ``PASSED_ON`` (the benchmarks of :data:`.bench.BENCHMARKS` among them) owns its
argument parser (``main(argv) -> int``) and is imported only when its subcommand runs: several need
an engine (SGLang, vLLM) that only their own environment has.
A user's mistake ends a subcommand with one line on stderr and exit status 2, never a traceback:
argparse's errors and the :class:`~.arguments.UsageError` a run raises (:mod:`.arguments`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .arguments import (
    USAGE_EXIT,
    DefaultsFormatter,
    OneLineParser,
    UsageError,
    one_line,
    require_package,
)
from .bench import BENCHMARKS

# subcommand -> module under hylinker.tools
COMMANDS: dict[str, str] = {
    "stress": "stress.cli",
    "demo": "demo",
    "bench": "bench.paths",
    "study": "studies",
    "mooncake": "mooncake_cli",
    "fleet": "fleet",
    "config-doc": "config_doc",
    "plan": "plan",
    "trace": "timeline",
    "soak": "soak",
}
# subcommand -> (module under hylinker.tools, one-line help); the arguments after the subcommand go to
# the module's main(argv) as they are: every benchmark of the registry (tools/bench/__init__.py)
# and the tools that are not benchmarks
PASSED_ON: dict[str, tuple[str, str]] = {
    **{name: (bench.path, bench.help) for name, bench in BENCHMARKS.items()},
    "serve-demo": ("serve_demo", "vLLM's OpenAI server on a tiny hybrid model with and without hylinker (.venv-vllm)"),
}

#: passed-on subcommand -> the engine package it runs in, checked before it starts
NEEDS: dict[str, str] = {
    **{name: bench.needs for name, bench in BENCHMARKS.items() if bench.needs},
    "profile-vllm-restore": "vllm",
    "serve-demo": "vllm",
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hylinker", description=__doc__.splitlines()[0])
    parser.add_argument("--trace-log", action="store_true",
                        help="emit trace-level JSON log lines on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(f"hylinker.tools.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"hylinker.tools.{module_name}":
                raise
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP, formatter_class=DefaultsFormatter)
        module.configure(p)
        p.set_defaults(_run=module.run)
    for name, (_, help_line) in PASSED_ON.items():
        sub.add_parser(name, help=help_line, description=f"{help_line}; `hylinker {name} --help` lists its options",
                       add_help=False)
    return parser


#: what ``--plot`` needs, for every subcommand that has it
PLOT_INSTALL = "pip install 'hylinker[plot]' (matplotlib)"


def _usage_error(command: str, message: str) -> int:
    print(f"hylinker {command}: error: {one_line(message)}", file=sys.stderr)
    return USAGE_EXIT


def _passed_on(name: str, argv: list[str]) -> int:
    """Run a passed-on subcommand; an engine or package this environment lacks (SGLang, vLLM,
    ...) is one line naming it, as is a :class:`UsageError` its ``main`` raises."""
    try:
        if name in NEEDS and not {"-h", "--help"} & set(argv):
            venv = PASSED_ON[name][1].rpartition("(")[2].rstrip(")")  # the help ends "(.venv-vllm)"
            require_package(NEEDS[name], "this subcommand", f"run it with the python of {venv} "
                                                            "(docs/guide/install.md)", find_only=True)
        module = importlib.import_module(f"hylinker.tools.{PASSED_ON[name][0]}")
        return int(module.main(argv) or 0)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "hylinker":
            raise
        return _usage_error(name, f"needs the Python package {exc.name!r}, which this environment lacks "
                                  "(docs/guide/install.md)")
    except UsageError as exc:
        return _usage_error(name, str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    trace_log = argv[:1] == ["--trace-log"]
    rest = argv[1:] if trace_log else argv
    if rest and rest[0] in PASSED_ON:  # before building the parser: no other tool is imported
        if trace_log:
            from ..runtime.dataplane.tracing import enable_trace_logging

            enable_trace_logging()
        return _passed_on(rest[0], rest[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trace_log:
        from ..runtime.dataplane.tracing import enable_trace_logging

        enable_trace_logging()
    try:
        if getattr(args, "plot", None) is not None:  # before the run, not after its work
            require_package("matplotlib", "--plot", PLOT_INSTALL)
        return int(args._run(args) or 0)
    except UsageError as exc:  # the user's mistake, found after parsing: one line, no traceback
        return _usage_error(args.command, str(exc))


if __name__ == "__main__":
    sys.exit(main())
