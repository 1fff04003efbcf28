#!/usr/bin/env bash
# The four engine virtualenvs (.venv-sglang, .venv-sglang-server, .venv-vllm, .venv-umbp) built
# in the background while the main suite runs: their installs are mostly downloads and unpacking,
# the main suite is CPU, and built one after the other they took ~12 of CI's minutes.
#   .ci/engine-venvs.sh start   start the builds (one after another) in the background, return at once
#   .ci/engine-venvs.sh wait    wait for them; on a failure print that build's log tail and exit 1
#   .ci/engine-venvs.sh release NAME   after NAME's suite: remove .venv-NAME in one-at-a-time mode
# Logs: .venv-builds/<name>.log; each setup script stays idempotent, so a `just test-vllm` later
# only checks its venv. Without `start`, `wait` builds them in the foreground.
#
# Disk: the four venvs take ~17.4 GB (sglang 2.7, sglang-server 6.3, vllm 3.6, umbp 4.8; measured
# with `du -sh .venv-*`). A CI run once failed with ENOSPC building the second venv on a machine
# with ~8 GB free. So `start` reads the free space of the checkout's filesystem: below
# NEED_GB it builds nothing in the background and writes .venv-builds/one-at-a-time; each engine
# recipe then builds its venv just before its suite (its setup script) and `release` removes it
# after, so at most one or two venvs exist at a time (peak ~8.4 GB: vllm is kept for the wheel
# check, then umbp). It costs the overlap (~6 minutes of CI) and is printed as the choice made.
# HYLINKER_VENV_MODE=background|one-at-a-time forces a mode.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.venv-builds
names=(sglang sglang-server vllm umbp)
NEED_GB=24  # the four venvs (~17.4 GB) plus the wheel check's venv, pip's unpacking and a margin

free_gb() { df -Pk . | awk 'NR==2 {print int($4 / 1048576)}'; }

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
    free=$(free_gb)
    mode=${HYLINKER_VENV_MODE:-}
    why="HYLINKER_VENV_MODE"
    if [ -z "$mode" ]; then
        why="< ${NEED_GB} GB for all four"
        if [ "$free" -ge "$NEED_GB" ]; then mode=background; else mode=one-at-a-time; fi
    fi
    if [ "$mode" = one-at-a-time ]; then
        touch "$dir/one-at-a-time"
        echo "engine-venvs: ${free} GB free ($why): each venv is built before" \
             "its suite and removed after it"
        exit 0
    fi
    [ "$mode" = background ] || { echo "engine-venvs: HYLINKER_VENV_MODE must be background or one-at-a-time, not '$mode'" >&2; exit 2; }
    echo "engine-venvs: ${free} GB free"
    nohup bash "$0" _build </dev/null >/dev/null 2>&1 &
    echo "engine-venvs: building ${names[*]} in the background (logs in $dir/)"
    ;;
_build)
    build_all
    ;;
wait)
    [ -e "$dir/one-at-a-time" ] && exit 0
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
release)
    name=${2:?usage: $0 release NAME}
    case " ${names[*]} " in *" $name "*) ;; *) echo "engine-venvs: no venv named '$name'" >&2; exit 2 ;; esac
    if [ -e "$dir/one-at-a-time" ]; then
        rm -rf ".venv-$name"
        echo "engine-venvs: removed .venv-$name ($(free_gb) GB free)"
    fi
    ;;
*)
    echo "usage: $0 start|wait|release NAME" >&2; exit 2
    ;;
esac
