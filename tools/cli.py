"""The hylinker command line: one subcommand per tool module.

Each module in ``COMMANDS`` exposes ``HELP: str``, ``configure(parser)`` and ``run(args) -> int``;
it keeps heavy imports (transformers, matplotlib, mooncake) inside ``run`` so ``--help`` is fast.
Each module in ``PASSED_ON`` owns its argument parser (``main(argv) -> int``) and is imported only
when its subcommand runs: several need an engine (SGLang, vLLM) that only their own environment has.
A user's mistake ends a subcommand with one line on stderr and exit status 2, never a traceback:
argparse's errors and the :class:`~.arguments.UsageError` a run raises (:mod:`.arguments`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .arguments import USAGE_EXIT, DefaultsFormatter, OneLineParser, UsageError, one_line

# subcommand -> module under hylinker.tools
COMMANDS: dict[str, str] = {
    "stress": "stress_cli",
    "demo": "demo",
    "bench": "bench",
    "study": "studies",
    "mooncake": "mooncake_cli",
    "fleet": "fleet",
    "config-doc": "config_doc",
    "plan": "plan",
}
# subcommand -> (module under hylinker.tools, one-line help); the arguments after the subcommand go to
# the module's main(argv) as they are
PASSED_ON: dict[str, tuple[str, str]] = {
    "bench-sglang": ("bench_sglang", "hylinker's SGLang plugin vs SGLang's MooncakeDirectLinker inside SGLang's "
                                     "cache (.venv-sglang)"),
    "bench-dead-store": ("bench_dead_store", "the SGLang scheduler's time blocked in lookups while the store does "
                                             "not answer (.venv-sglang)"),
    "bench-vllm": ("bench_vllm", "vLLM CPU build: time to first token restore vs recompute, decode steps (.venv-vllm)"),
    "bench-vllm-peers": ("bench_vllm_peers", "vLLM CPU build: hylinker's connector against vLLM's own "
                                             "MooncakeStoreConnector in one run (.venv-vllm)"),
    "profile-vllm-restore": ("profile_vllm_restore", "vLLM CPU build: where one restore's time goes (.venv-vllm)"),
    "serve-demo": ("serve_demo", "vLLM's OpenAI server on a tiny hybrid model with and without hylinker (.venv-vllm)"),
    "bench-vllm-keys": ("bench_vllm_keys", "what keying a vLLM request by vLLM's extra keys costs the scheduler"),
    "bench-shapes": ("bench_shapes", "the vLLM connector's save and load at Qwen3-Next-80B's object shape"),
    "bench-agreement": ("bench_agreement", "the cost of agreeing a lookup across ranks, beside a single-rank lookup"),
    "bench-checksum": ("bench_checksum", "what the integrity checksum costs on the embedded store"),
    "bench-hash-overlap": ("bench_hash_overlap", "a checksummed Mooncake offload's floor, with no runtime around it"),
    "bench-keys": ("bench_keys", "the cost of hashing a prompt into chained page keys"),
    "bench-rows": ("bench_rows", "the row-described copy routine against plain per-object copies"),
    "bench-calls": ("bench_calls", "Python calls per object through the synchronous data plane, on the embedded store "
                                   "or Mooncake (--store mooncake [--no-rows])"),
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
            from ..dataplane.tracing import enable_trace_logging

            enable_trace_logging()
        return _passed_on(rest[0], rest[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trace_log:
        from ..dataplane.tracing import enable_trace_logging

        enable_trace_logging()
    try:
        return int(args._run(args) or 0)
    except UsageError as exc:  # the user's mistake, found after parsing: one line, no traceback
        print(f"hylinker {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return USAGE_EXIT


if __name__ == "__main__":
    sys.exit(main())
