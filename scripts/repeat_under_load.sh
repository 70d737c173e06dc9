#!/usr/bin/env bash
# Runs the test suite N times, each in a fresh clone under a mode-0700
# folder of mktemp, with a busy loop on every core, to find tests that
# depend on the machine (checkout path, TMPDIR, timing) rather than on the
# code. Each run gets its own TMPDIR, also mode 0700.
#   scripts/repeat_under_load.sh [N=10] [command run in the clone, default: bash .ci/run]
# Prints one line per run and the failed runs' logs' tails; exits 1 if any failed.
set -uo pipefail
runs="${1:-10}"
cmd="${2:-bash .ci/run}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
# The clones share one target folder: the runs test the checkout, not the
# compiler, and the 2-core machine would spend most of the time building.
shared_target="${SS_REPEAT_TARGET:-$repo/target/repeat-under-load}"
mkdir -p "$shared_target"

busy=()
for _ in $(seq "$(nproc)"); do
    ( while :; do :; done ) &
    busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT

failed=0
for i in $(seq "$runs"); do
    top="$(mktemp -d)"  # mode 0700
    chmod 0700 "$top"
    git clone -q "$repo" "$top/checkout"
    commit="$(git -C "$top/checkout" rev-parse --short HEAD)"
    mkdir -m 0700 "$top/tmp"
    # CMake caches name their source folder: each clone configures anew.
    rm -rf "$shared_target"/ctests-*
    start=$SECONDS
    if (cd "$top/checkout" && TMPDIR="$top/tmp" CARGO_TARGET_DIR="$shared_target" CI=true bash -c "$cmd") > "$top/log" 2>&1; then
        echo "run $i at $commit: ok ($((SECONDS - start)) s)"
        rm -rf "$top"
    else
        failed=$((failed + 1))
        echo "run $i at $commit: FAILED ($((SECONDS - start)) s), log: $top/log"
        grep -E "^test .* FAILED|panicked at|^error|FAIL" "$top/log" | head -20
    fi
done
echo "$failed of $runs runs failed"
[ "$failed" -eq 0 ]
