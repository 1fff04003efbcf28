#!/usr/bin/env bash
# CI: hylinker as a user gets it. Builds the wheel, installs it into a fresh virtualenv outside the
# checkout (torch pinned to the version this interpreter has, so pip takes it from its cache or
# the machine's wheel folder instead of a CUDA build), and from that install runs the README's
# library block, `hylinker stress --requests 50` and the import of the vLLM connector. The
# connector imports vLLM, which a plain virtualenv lacks: that import runs in the vLLM
# virtualenv's interpreter (VLLM_PYTHON, default .venv-vllm/bin/python from .ci/vllm-setup.sh)
# with only the installed wheel's `hylinker` folder on its path.
# About 2 minutes on the 2-core machine with a warm pip cache, most of it unpacking torch.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd -P)
PY=${PYTHON:-python3}
VLLM_PYTHON=${VLLM_PYTHON:-$root/.venv-vllm/bin/python}
export PIP_DISABLE_PIP_VERSION_CHECK=1
work=$(mktemp -d)
# removing the virtualenv (torch: ~1 GB of small files) took ~45 s on the loaded 2-core machine:
# it goes on in the background, the script's result does not wait for it
trap '(rm -rf "$work" &)' EXIT
start=$SECONDS

# setuptools stages the package in build/ of the checkout: a stale one would ship deleted
# modules, and one left behind would be type-checked a second time by `just lint`
rm -rf "$root/build"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$root"
rm -rf "$root/build"
wheel=$(ls "$work"/dist/hylinker-*.whl)
"$PY" -m venv "$work/venv"
torch_pin="torch==$("$PY" -c 'import torch; print(torch.__version__)')"
version=$(basename "$wheel" | cut -d- -f2)
# docs/guide/install.md's library line, torch pinned to this machine's build (no .pyc: one run)
"$work/venv/bin/python" -m pip install -q --no-compile --find-links "$work/dist" "hylinker==$version" "$torch_pin" \
    >"$work/pip.log" 2>&1 \
    || { cat "$work/pip.log"; exit 1; }
echo "wheel-check: installed $(basename "$wheel") into a fresh virtualenv ($((SECONDS - start)) s)"

cd "$work"  # nothing of the checkout on the path from here on
VPY="$work/venv/bin/python"
"$VPY" - "$root" "$VPY" <<'PYEOF'
import importlib.metadata as md
import re
import runpy
import sys
from pathlib import Path

import hylinker
import hylinker.integrations.sglang  # noqa: F401
import hylinker.integrations.vllm  # noqa: F401

root, venv_python = sys.argv[1], sys.argv[2]
where = Path(hylinker.__file__).resolve()
assert not where.is_relative_to(root), f"hylinker imported from the checkout: {where}"
assert where.is_relative_to(Path(venv_python).parent.parent), where
assert md.version("hylinker") == hylinker.__version__, (md.version("hylinker"), hylinker.__version__)
assert (where.parent / "py.typed").is_file()
licenses = {Path(f.name).name for f in md.files("hylinker") if "licenses" in str(f)}
assert licenses == {"LICENSE", "NOTICE"}, licenses
blocks = re.findall(r"^```python\n(.*?)^```", (Path(root) / "README.md").read_text(), re.S | re.M)
assert blocks, "the README has no python block"
for i, code in enumerate(blocks):
    Path(f"readme_{i}.py").write_text(code)
    runpy.run_path(f"readme_{i}.py", run_name="__main__")
print(f"wheel-check: hylinker {hylinker.__version__} from {where.parent}; README's {len(blocks)} python block(s) ran")
PYEOF
"$work/venv/bin/hylinker" stress --requests 50 --no-progress >"$work/stress.txt"  # exit 1 on a mismatch or leak
grep -Eq "^restore mismatches +0$" "$work/stress.txt" || { cat "$work/stress.txt"; exit 1; }
echo "wheel-check: hylinker stress --requests 50 ran from the wheel"
"$work/venv/bin/hylinker" --help >/dev/null
rc=0; "$work/venv/bin/hylinker" config-doc 2>"$work/config-doc.txt" || rc=$?
[ "$rc" = 2 ] && grep -q -- "--out" "$work/config-doc.txt" || { cat "$work/config-doc.txt"; exit 1; }
site_dir=$("$VPY" -c 'import hylinker, os; print(os.path.dirname(os.path.dirname(hylinker.__file__)))')
[ ! -e "$site_dir/hylinker/docs" ] || { echo "wheel-check: config-doc wrote into $site_dir/hylinker/docs" >&2; exit 1; }
echo "wheel-check: hylinker --help runs; config-doc asks for --out instead of writing into site-packages"

if [ ! -x "$VLLM_PYTHON" ]; then
    echo "wheel-check: no vLLM interpreter at $VLLM_PYTHON (run .ci/vllm-setup.sh or set VLLM_PYTHON)" >&2
    exit 1
fi
mkdir "$work/only-hylinker" && ln -s "$site_dir/hylinker" "$work/only-hylinker/hylinker"
PYTHONPATH="$work/only-hylinker" "$VLLM_PYTHON" - "$site_dir" <<'PYEOF'
import os
import sys

from hylinker.integrations.vllm import HylinkerConnector

import hylinker

assert os.path.realpath(hylinker.__file__).startswith(os.path.realpath(sys.argv[1])), hylinker.__file__
print(f"wheel-check: vLLM imports {HylinkerConnector.__module__}.HylinkerConnector from the wheel")
PYEOF
echo "wheel-check: ok ($((SECONDS - start)) s)"
