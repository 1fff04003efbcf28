#!/usr/bin/env bash
# A virtualenv for SGLang's real server (`.venv-sglang-server/`, ignored by git): the SGLang
# plugin's server suite (tests/engines/sglang_server/) launches `python -m sglang.launch_server` from it.
# SGLang's server imports torchvision at import time, and the registry's torchvision wheels load
# only beside their own torch, so this venv holds torch==2.14.1 + torchvision==0.29.1 (CUDA
# builds; they run on the CPU, and on a GPU machine they are the ones SGLang 0.5.23 pins), then
# sglang==0.5.23 with --no-deps (it would pull sgl-kernel and CUDA-only packages) and the
# packages its server imports. Measured facts: ../shared/SGLANG.md, "Real server on CPU".
# Idempotent: a second run only checks. Needs the package registry on first run (~6 GB).
# PYTHON selects the interpreter that creates the venv (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(pwd -P)
PY=${PYTHON:-python3}
VENV="$here/.venv-sglang-server"
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

check() {
    "$VPY" - "$here" <<'PYEOF'
import os, sys
import torch, torchvision, sglang, pytest, mooncake.store, prometheus_client  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401  (the server's own imports resolve)
import hylinker
assert torch.__version__.startswith("2.14.1"), torch.__version__
assert sglang.__version__ == "0.5.23", sglang.__version__
assert os.path.realpath(os.path.dirname(hylinker.__file__)) == sys.argv[1], hylinker.__file__
PYEOF
}

if [ -x "$VPY" ] && check 2>/dev/null; then
    echo "sglang-server-setup: .venv-sglang-server ok"
    exit 0
fi

[ -x "$VPY" ] || "$PY" -m venv "$VENV"
pip_() { "$VPY" -m pip install --no-input -q "$@"; }
TORCH=("torch==2.14.1" "torchvision==0.29.1")

echo "sglang-server-setup: ${TORCH[*]}"
pip_ "${TORCH[@]}"

echo "sglang-server-setup: sglang==0.5.23 (--no-deps)"
pip_ --no-deps "sglang==0.5.23"

echo "sglang-server-setup: the server's import-time dependencies (torch pinned on the same line)"
pip_ "${TORCH[@]}" \
    "transformers==5.19.0" "tokenizers==0.23.2" fastapi uvicorn uvloop pyzmq orjson msgspec \
    pybase64 psutil setproctitle aiohttp pydantic python-multipart einops xxhash zstandard regex \
    safetensors "sentencepiece==0.2.1" interegular partial_json_parser prometheus-client \
    "openai==2.8.0" tiktoken pillow scipy watchfiles distro huggingface_hub IPython dill \
    "apache-tvm-ffi==0.1.11" gguf "xgrammar==0.2.7" jsonschema "soundfile==0.13.1" \
    anyio attrs numpy packaging PyYAML requests rich tqdm loguru Jinja2 starlette typer
# compressed-tensors requires torch; --no-deps keeps ours
pip_ --no-deps "compressed-tensors==0.18.0"

echo "sglang-server-setup: Mooncake client, test tools, hylinker (editable, no deps)"
pip_ "${TORCH[@]}" "mooncake-transfer-engine-non-cuda>=0.3.13,<0.4" \
    "pytest>=8" "pytest-timeout>=2.2" "structlog>=24.1"
pip_ --no-deps -e .

check
echo "sglang-server-setup: ok"
