#!/usr/bin/env bash
# A separate virtualenv for the SGLang plugin's tests and bench: `.venv-sglang/` inside the checkout
# (ignored by git). SGLang 0.5.23 pins a CUDA torch; we keep the CPU build (torch==2.13.0) and
# install sglang and the packages it imports with `--no-deps` where they would pull torch.
# Idempotent: a second run only checks. Needs network access to the package registry on first run.
# PYTHON selects the interpreter that creates the venv (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(pwd -P)
PY=${PYTHON:-python3}
VENV="$here/.venv-sglang"
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

check() {
    "$VPY" - "$here" <<'PYEOF'
import os, sys
import torch, sglang, pytest, mooncake.store, prometheus_client  # noqa: F401
import hylinker
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, "the SGLang venv must keep the CPU torch"
assert sglang.__version__ == "0.5.23", sglang.__version__
assert os.path.realpath(os.path.dirname(hylinker.__file__)) == sys.argv[1], hylinker.__file__
PYEOF
}

if [ -x "$VPY" ] && check 2>/dev/null; then
    echo "sglang-setup: .venv-sglang ok"
    exit 0
fi

[ -x "$VPY" ] || "$PY" -m venv "$VENV"
pip_() { "$VPY" -m pip install --no-input -q "$@"; }

echo "sglang-setup: torch==2.13.0 (CPU build)"
pip_ "torch==2.13.0"

echo "sglang-setup: sglang==0.5.23 (--no-deps: it pins a CUDA torch)"
pip_ --no-deps "sglang==0.5.23"

# What `sglang.srt.mem_cache` and the server-args/scheduler modules import at import time.
# Installed with torch pinned on the same command line, so pip never swaps in another torch.
echo "sglang-setup: sglang's import-time dependencies"
pip_ "torch==2.13.0" \
    aiohttp anyio apache-tvm-ffi attrs dill fastapi gguf huggingface_hub ipython Jinja2 loguru \
    msgspec numpy openai orjson packaging partial-json-parser pillow psutil pybase64 pydantic \
    PyYAML pyzmq regex requests rich safetensors sentencepiece setproctitle starlette tokenizers \
    tqdm "transformers>=5.20,<6" triton typer uvicorn uvloop xxhash
# compressed-tensors requires torch; --no-deps keeps ours
pip_ --no-deps compressed-tensors

echo "sglang-setup: Mooncake client, test tools, hylinker (editable, no deps)"
pip_ "torch==2.13.0" "mooncake-transfer-engine-non-cuda>=0.3.13,<0.4" \
    "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.2" "hypothesis>=6.100" \
    "anyio>=4.0" "attrs>=23.1" "structlog>=24.1" "xxhash>=3.0" "prometheus-client>=0.17"
pip_ --no-deps -e .

check
echo "sglang-setup: ok"
