#!/usr/bin/env bash
# The four engine virtualenvs (.venv-sglang, .venv-sglang-server, .venv-vllm, .venv-umbp) built
# in the background while the main suite runs: their installs are mostly downloads and unpacking,
# the main suite is CPU, and built one after the other they took ~12 of CI's minutes.
#   .ci/engine-venvs.sh start   start the builds (one after another) in the background, return at once
#   .ci/engine-venvs.sh wait    wait for them; on a failure print that build's log tail and exit 1
# Logs: .venv-builds/<name>.log; each setup script stays idempotent, so a `just test-vllm` later
# only checks its venv. Without `start`, `wait` builds them in the foreground.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.venv-builds
names=(sglang sglang-server vllm umbp)

build_all() {
    for name in "${names[@]}"; do
        start=$(date +%s)
        if bash ".ci/$name-setup.sh" >"$dir/$name.log" 2>&1; then rc=0; else rc=$?; fi
        echo "$name $rc $(( $(date +%s) - start ))" >>"$dir/done"
        [ "$rc" = 0 ] || break
    done
    echo finished >>"$dir/done"
}

case "${1:-}" in
start)
    rm -rf "$dir"; mkdir -p "$dir"
    nohup bash "$0" _build </dev/null >/dev/null 2>&1 &
    echo "engine-venvs: building ${names[*]} in the background (logs in $dir/)"
    ;;
_build)
    build_all
    ;;
wait)
    if [ ! -e "$dir/done" ] && ! pgrep -f "engine-venvs.sh _build" >/dev/null; then
        mkdir -p "$dir"; build_all
    fi
    while ! grep -qx finished "$dir/done" 2>/dev/null; do
        pgrep -f "engine-venvs.sh _build" >/dev/null || { echo "engine-venvs: the background build died" >&2; exit 1; }
        sleep 5
    done
    while read -r name rc secs; do
        [ "$name" = finished ] && continue
        echo "engine-venvs: $name rc=$rc in ${secs}s"
        if [ "$rc" != 0 ]; then
            echo "engine-venvs: $name-setup failed; the end of $dir/$name.log:" >&2
            grep -v "WARNING: Location" "$dir/$name.log" | tail -n 25 >&2
            exit 1
        fi
    done <"$dir/done"
    ;;
*)
    echo "usage: $0 start|wait" >&2; exit 2
    ;;
esac
