"""The hylinker command line: one subcommand per tool module.

Each tool module exposes ``HELP: str``, ``configure(parser)`` and ``run(args) -> int``; it
keeps heavy imports (transformers, matplotlib, mooncake) inside ``run`` so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> module under hylinker.tools
COMMANDS: dict[str, str] = {
    "stress": "stress_cli",
    "demo": "demo",
    "bench": "bench",
    "study": "studies",
    "mooncake": "mooncake_cli",
    "fleet": "fleet",
    "config-doc": "config_doc",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hylinker", description=__doc__.splitlines()[0])
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
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trace_log:
        from ..dataplane.tracing import enable_trace_logging

        enable_trace_logging()
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
