"""The benchmarks: one module per subject, the host probe (:mod:`.host`) they all record and the
one way they write their JSON (:mod:`.output`).

:data:`BENCHMARKS` is the one registry: each ``hylinker bench-<subject>`` subcommand, the module
below this package that owns its argument parser (``main(argv) -> int``) and its one-line help.
The command line (:mod:`hylinker.tools.cli`) reads it to list them, and imports a module only
when its subcommand runs (several need an engine that only their own environment has), so
nothing here imports a benchmark. ``hylinker bench`` itself (:mod:`.paths`: control path,
event-loop lag, data path) is configured by the command line like the other in-process tools.
"""

from __future__ import annotations

from typing import NamedTuple


class Benchmark(NamedTuple):
    module: str  #: below hylinker.tools.bench
    help: str  #: one line for ``hylinker --help``
    needs: str = ""  #: the engine package it runs in (checked before it starts), if any

    @property
    def path(self) -> str:
        """The module below ``hylinker.tools``, as the command line imports it."""
        return f"bench.{self.module}"


#: subcommand -> its benchmark
BENCHMARKS: dict[str, Benchmark] = {
    "bench-sglang": Benchmark("sglang", "hylinker's SGLang plugin vs SGLang's "
                                        "MooncakeDirectLinker inside SGLang's cache "
                                        "(.venv-sglang)", "sglang"),
    "bench-sglang-pool": Benchmark("sglang_pool", "SGLang's real cache at a device pool small enough "
                                                  "to evict: store hit tokens, two-stage vs one-stage "
                                                  "offload vs an unbounded in-flight limit (.venv-sglang)",
                                   "sglang"),
    "bench-vllm": Benchmark("vllm", "vLLM CPU build: time to first token restore vs recompute, "
                                    "decode steps (.venv-vllm)", "vllm"),
    "bench-vllm-peers": Benchmark("vllm_peers", "vLLM CPU build: hylinker's connector against "
                                                "vLLM's own MooncakeStoreConnector in one run "
                                                "(.venv-vllm)", "vllm"),
    "bench-vllm-serving": Benchmark("vllm_serving", "vLLM CPU build: the OpenAI server replaying a "
                                                    "multi-turn trace with each connector, under load "
                                                    "(.venv-vllm)", "vllm"),
}

__all__ = ["BENCHMARKS", "Benchmark"]
