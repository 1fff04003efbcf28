#!/usr/bin/env bash
# mypy over the package, the tests and the docs' examples. The repository root *is* the package
# `hylinker`, whatever the checkout's folder is called, so mypy reads it through a link named
# `hylinker` in a scratch folder.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd -P)
PY=${PYTHON:-python3}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
ln -s "$root" "$scratch/hylinker"
cd "$scratch"
# -p walks the whole tree through the link: the package, tests/ and docs/
MYPYPATH="$scratch" "$PY" -m mypy --config-file "$root/pyproject.toml" \
    --cache-dir "$root/.mypy_cache" -p hylinker
