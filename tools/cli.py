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

from .arguments import USAGE_EXIT, DefaultsFormatter, OneLineParser, UsageError, one_line
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
}
# subcommand -> (module under hylinker.tools, one-line help); the arguments after the subcommand go to
# the module's main(argv) as they are: every benchmark of the registry (tools/bench/__init__.py)
# and the tools that are not benchmarks
PASSED_ON: dict[str, tuple[str, str]] = {
    **{name: (bench.path, bench.help) for name, bench in BENCHMARKS.items()},
    "serve-demo": ("serve_demo", "vLLM's OpenAI server on a tiny hybrid model with and without hylinker (.venv-vllm)"),
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


def _passed_on(name: str, argv: list[str]) -> int:
    module = importlib.import_module(f"hylinker.tools.{PASSED_ON[name][0]}")
    return int(module.main(argv) or 0)


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
        return int(args._run(args) or 0)
    except UsageError as exc:  # the user's mistake, found after parsing: one line, no traceback
        print(f"hylinker {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return USAGE_EXIT


if __name__ == "__main__":
    sys.exit(main())
