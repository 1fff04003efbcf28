#!/usr/bin/env bash
# Install everything hylinker's jobs and tests need, on a fresh Debian machine as root.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch: the CPU build (a plain `pip install torch` would pull a multi-GB CUDA build)
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0 (CPU build)"
    "$PY" -m pip install -q "torch==2.13.0"
fi

# hylinker itself, editable from this checkout, with its extras
here=$(pwd -P)
if ! "$PY" - "$here" <<'PYEOF' 2>/dev/null
import os, sys
import hylinker, pytest, hypothesis, pytest_asyncio, transformers, matplotlib, prometheus_client  # noqa: F401
sys.exit(0 if os.path.realpath(os.path.dirname(hylinker.__file__)) == sys.argv[1] else 1)
PYEOF
then
    echo "setup: installing hylinker (editable) with extras dev, reference, plot"
    "$PY" -m pip install -q -e ".[dev,reference,plot]"
fi

# Mooncake Store client + master (needs Debian's libibverbs1)
bash .ci/mooncake-setup.sh

# the fleet suite builds network namespaces with iproute2's `ip` (as root)
if ! command -v ip >/dev/null 2>&1; then
    echo "setup: installing iproute2 (the fleet suite's network namespaces)"
    apt-get update -qq && apt-get install -y -qq iproute2
fi

# the dashboard tests query a real Prometheus (Debian's package) on loopback
if ! command -v prometheus >/dev/null 2>&1; then
    echo "setup: installing prometheus (the dashboard tests)"
    apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus
fi
