#!/usr/bin/env bash
# The real mori UMBP client's environment: `.venv-umbp/` inside the checkout (ignored by git).
#
# amd-mori 1.2.4 ships a cp310 wheel (manylinux_2_35) for ROCm machines. On a CPU-only Debian 12
# machine it runs given
#   * Python 3.10 (UMBP_PYTHON, else pyenv's 3.10, else python3.10 on PATH);
#   * gRPC 1.30 / protobuf 3.12 and their dependencies, which Debian 11 (bullseye) has and
#     Debian 12 lacks: fetched with `apt-get download` against a private sources list (the
#     system's apt lists and caches are untouched) from the mirror host the machine's apt already
#     uses, unpacked with `dpkg -x` into .venv-umbp/lib-umbp;
#   * libamdhip64.so.7 and libhsa-runtime64.so.1: stubs compiled here from .ci/umbp-stubs/
#     (every function answers "no device", so the client treats buffers as host memory).
# .venv-umbp/bin/umbp-python is the venv's Python with .venv-umbp/lib-umbp on LD_LIBRARY_PATH.
# The venv also holds torch 2.13.0 (PyPI's cp310 build), the test tools and hylinker (editable,
# no deps). Idempotent: a second run only checks. Fails loudly, saying what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(pwd -P)
VENV="$here/.venv-umbp"
LIBS="$VENV/lib-umbp"
WRAP="$VENV/bin/umbp-python"
STUBS="$here/.ci/umbp-stubs"
MORI_VERSION=1.2.4
TORCH_VERSION=2.13.0
DEBS="libprotobuf23 libgrpc10 libgrpc++1 libabsl20200923 libssl1.1 libpci3 libc-ares2"
export PIP_DISABLE_PIP_VERSION_CHECK=1

die() { echo "umbp-setup: FAILED: $*" >&2; exit 1; }

check() {
    [ -x "$WRAP" ] || return 1
    "$WRAP" - "$here" "$MORI_VERSION" <<'PYEOF'
import os, sys
import torch, pytest, hypothesis, pytest_asyncio, anyio, structlog, numpy  # noqa: F401
import mori
from mori.umbp import UMBPClient, UMBPConfig  # noqa: F401
import hylinker
assert mori.__version__ == sys.argv[2], mori.__version__
assert os.path.realpath(os.path.dirname(hylinker.__file__)) == sys.argv[1], hylinker.__file__
PYEOF
}

if check 2>/dev/null; then
    echo "umbp-setup: .venv-umbp ok (amd-mori $MORI_VERSION)"
    exit 0
fi

# ---- Python 3.10 ------------------------------------------------------------------------------
find_py310() {
    if [ -n "${UMBP_PYTHON:-}" ]; then echo "$UMBP_PYTHON"; return; fi
    if command -v pyenv >/dev/null 2>&1; then
        local root; root=$(pyenv root)
        local v
        for v in "$root"/versions/3.10*; do
            [ -x "$v/bin/python3.10" ] && { echo "$v/bin/python3.10"; return; }
        done
    fi
    command -v python3.10 || true
}
PY310=$(find_py310)
[ -n "$PY310" ] && "$PY310" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null \
    || die "amd-mori $MORI_VERSION's Linux wheel that runs on glibc 2.36 is cp310: need Python 3.10 \
(set UMBP_PYTHON, or install one with pyenv); found '${PY310:-nothing}'"
command -v gcc >/dev/null || die "gcc is needed to build the ROCm stub libraries"
for tool in apt-get dpkg readelf; do
    command -v "$tool" >/dev/null || die "$tool is needed (Debian's libraries for gRPC 1.30)"
done

# ---- the venv, the wheel, torch, test tools, hylinker --------------------------------------------
VPY="$VENV/bin/python"
[ -x "$VPY" ] || "$PY310" -m venv "$VENV"
pip_() { "$VPY" -m pip install --no-input -q "$@" || die "pip install $*"; }
echo "umbp-setup: amd-mori==$MORI_VERSION (cp310 wheel, --no-deps: its extras are GPU tools)"
pip_ --no-deps --only-binary=:all: "amd-mori==$MORI_VERSION"
if ! "$VPY" -c "import torch" 2>/dev/null; then
    # PyPI's cp310 torch is the CUDA build; only its Python parts run here (no GPU is used).
    echo "umbp-setup: torch==$TORCH_VERSION"
    pip_ "torch==$TORCH_VERSION"
fi
echo "umbp-setup: test tools, hylinker (editable, no deps)"
pip_ "torch==$TORCH_VERSION" "numpy>=1.26" "anyio>=4.0" "attrs>=23.1" "structlog>=24.1" \
    "xxhash>=3.0" "prometheus-client>=0.17" "pytest>=8" "pytest-asyncio>=0.23" \
    "pytest-timeout>=2.2" "hypothesis>=6.100"
pip_ --no-deps -e .

# ---- Debian 11 libraries, through a private apt configuration ---------------------------------
mkdir -p "$LIBS"
if [ ! -e "$LIBS/.debs-done" ]; then
    apt_dir="$VENV/apt"
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
    # the mirror host the machine's own apt configuration uses (deb822 or one-line format)
    mirror=$(grep -hoE '(URIs:[[:space:]]*|^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?)https?://[^[:space:]]+/debian/?([[:space:]]|$)' \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -oE 'https?://[^[:space:]]+' | head -n1 || true)
    mirror=${UMBP_DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    [ -r "$keyring" ] || die "$keyring is missing (package debian-archive-keyring)"
    # Debian 11 left the main mirrors' LTS window in 2026: try the machine's mirror, then
    # deb.debian.org, then archive.debian.org, three attempts each (a mirror mid-sync answers
    # "Hash Sum mismatch" for a minute); the failing log's tail is printed, not only named.
    fetched=""
    for base in "${mirror%/}" http://deb.debian.org/debian http://archive.debian.org/debian; do
        for attempt in 1 2 3; do
            echo "deb [signed-by=$keyring] $base bullseye main" > "$apt_dir/sources.list"
            apt_=(apt-get -q -o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-"
                  -o "Dir::State::lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
                  -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root"
                  -o "Acquire::Retries=3" -o "Acquire::http::Timeout=30")
            echo "umbp-setup: Debian 11 libraries from $base, attempt $attempt (private apt lists in $apt_dir)"
            rm -f "$apt_dir"/debs/*.deb
            if ! "${apt_[@]}" update >"$apt_dir/update.log" 2>&1; then
                echo "umbp-setup: apt-get update against $base bullseye failed:" >&2
                tail -n 5 "$apt_dir/update.log" | sed 's/^/    /' >&2
                sleep $((attempt * 5)); continue
            fi
            # shellcheck disable=SC2086
            if (cd "$apt_dir/debs" && "${apt_[@]}" download $DEBS >"$apt_dir/download.log" 2>&1); then
                fetched=$base; break 2
            fi
            echo "umbp-setup: apt-get download $DEBS from $base failed:" >&2
            tail -n 8 "$apt_dir/download.log" | sed 's/^/    /' >&2
            sleep $((attempt * 5))
        done
    done
    [ -n "$fetched" ] || die "no mirror gave the Debian 11 libraries $DEBS (logs in $apt_dir)"
    for deb in "$apt_dir"/debs/*.deb; do
        dpkg -x "$deb" "$apt_dir/root"
    done
    cp -a "$apt_dir"/root/usr/lib/x86_64-linux-gnu/*.so.* "$LIBS"/
    if [ -d "$apt_dir/root/lib/x86_64-linux-gnu" ]; then
        cp -a "$apt_dir"/root/lib/x86_64-linux-gnu/*.so.* "$LIBS"/
    fi
    touch "$LIBS/.debs-done"
fi

# ---- the ROCm stub libraries ----------------------------------------------------------------------
build_stub() {  # soname syms-file error-code
    local soname=$1 syms=$2 err=$3
    local map="$VENV/stub-build/${soname}.map"
    mkdir -p "$VENV/stub-build"
    # the version script, from the same list: one node per version, in the order first seen
    awk -F'[(), ]+' '/^STUB\(/ { if (!($3 in seen)) { order[n++] = $3; seen[$3] = 1 }
                               syms[$3] = syms[$3] "    " $2 ";\n" }
        END { for (i = 0; i < n; i++) printf "%s {\n  global:\n%s%s};\n", order[i], syms[order[i]], (i == 0 ? "  local: *;\n" : "") }' \
        "$STUBS/$syms" > "$map"
    gcc -shared -fPIC -O1 -o "$LIBS/$soname" -Wl,-soname,"$soname" -Wl,--version-script="$map" \
        -DSYMBOLS="\"$STUBS/$syms\"" -DSTUB_ERROR="$err" "$STUBS/stub.c" \
        || die "building the stub $soname failed"
}
echo "umbp-setup: ROCm stub libraries (gcc, from .ci/umbp-stubs)"
build_stub libamdhip64.so.7 libamdhip64.syms 100        # hipErrorNoDevice
build_stub libhsa-runtime64.so.1 libhsa-runtime64.syms 0x1000  # HSA_STATUS_ERROR

# every HIP/HSA symbol the wheel imports must be in a stub, at its version
site=$("$VPY" -c 'import mori, os; print(os.path.dirname(mori.__file__))')
missing=$(for so in "$site"/*.so; do readelf --dyn-syms -W "$so" | awk '$7 == "UND" { print $8 }'; done \
    | grep -E '@(hip_|ROCR_)' | sed 's/ (.*//' | sort -u | while IFS=@ read -r name ver; do
        grep -qE "^STUB\\($name, $ver\\)" "$STUBS"/*.syms || echo "$name@$ver"
    done)
[ -z "$missing" ] || die "the stubs lack symbols the wheel imports: $missing"

cat > "$WRAP" <<EOF
#!/bin/sh
# .venv-umbp's Python with the Debian 11 libraries and the ROCm stubs on LD_LIBRARY_PATH
LD_LIBRARY_PATH="$LIBS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$VPY" "\$@"
EOF
chmod +x "$WRAP"

if ! check; then
    die "the environment was built but mori.umbp does not import (run $WRAP -c 'import mori.umbp')"
fi
echo "umbp-setup: ok (amd-mori $MORI_VERSION, $("$VPY" --version))"
