#!/usr/bin/env bash
# Opt-in (not run by scripts/test.sh: valgrind is not on a fresh CI machine
# and its run takes minutes): the plain C/C++ tests under valgrind memcheck.
# Any invalid read/write, use of uninitialised memory or definite leak
# fails the run. Needs the plain build of scripts/test.sh first.
# usage: scripts/valgrind_ctests.sh [ctests-plain build folder]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-${CARGO_TARGET_DIR:-$PWD/target}/ctests-plain}"
command -v valgrind >/dev/null || { echo "valgrind not installed (apt-get install valgrind)"; exit 2; }
n=0
for exe in "$build"/test_*; do
    [ -x "$exe" ] && [ -f "$exe" ] || continue
    echo "== valgrind $(basename "$exe")"
    # Children the tests fork or spawn (the manager daemon) are followed too.
    valgrind --tool=memcheck --error-exitcode=99 --suppressions=scripts/valgrind.supp --leak-check=full --errors-for-leak-kinds=definite \
        --trace-children=yes --child-silent-after-fork=no --quiet "$exe"
    n=$((n + 1))
done
echo "valgrind memcheck clean on $n C test executables"
