#!/usr/bin/env bash
# Install what the Mooncake store backend needs; safe to run twice. Run as root (CI).
#   - Debian's libibverbs1 (mooncake's engine.so links libibverbs.so.1 even without RDMA)
#   - the PyPI wheel mooncake-transfer-engine-non-cuda (client + mooncake_master binary)
# PYTHON selects the interpreter (default: python3).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PYTHON="${PYTHON:-python3}"

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' \
   && ! dpkg-query -W -f='${Status}' libibverbs1 2>/dev/null | grep -q 'install ok installed'; then
  echo "mooncake-setup: installing libibverbs1"
  apt-get update -q
  apt-get install -y -q --no-install-recommends libibverbs1
else
  echo "mooncake-setup: libibverbs1 present"
fi

if ! "$PYTHON" -c 'import mooncake.store' >/dev/null 2>&1; then
  echo "mooncake-setup: installing mooncake-transfer-engine-non-cuda"
  "$PYTHON" -m pip install --no-input -q "mooncake-transfer-engine-non-cuda>=0.3.13,<0.4"
else
  echo "mooncake-setup: mooncake.store importable"
fi

"$PYTHON" -c 'import mooncake.store' 
command -v mooncake_master >/dev/null 2>&1 \
  || [ -x "$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")/mooncake_master" ] \
  || { echo "mooncake-setup: mooncake_master binary not found" >&2; exit 1; }
echo "mooncake-setup: ok"
