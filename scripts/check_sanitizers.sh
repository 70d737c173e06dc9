#!/usr/bin/env bash
# Proves the ASan+UBSan C test build really carries the sanitizers: every
# test executable in the build folder must import __asan_init and a UBSan
# handler, and the loader must resolve libasan/libubsan for it. A build
# that silently lost -fsanitize fails here instead of passing unchecked.
# usage: scripts/check_sanitizers.sh <ctests-asan build folder>
set -euo pipefail
build="${1:?usage: $0 <ctests-asan build folder>}"
n=0
for exe in "$build"/test_*; do
    [ -x "$exe" ] && [ -f "$exe" ] || continue
    syms=$(nm -D --undefined-only "$exe" 2>/dev/null || true)
    grep -q '__asan_init' <<<"$syms" || { echo "FAIL $exe: no __asan_init (AddressSanitizer not linked)"; exit 1; }
    grep -q '__ubsan_handle_' <<<"$syms" || { echo "FAIL $exe: no __ubsan_handle_* (UBSan not linked)"; exit 1; }
    libs=$(ldd "$exe")
    grep -q 'libasan' <<<"$libs" || { echo "FAIL $exe: ldd shows no libasan"; exit 1; }
    grep -q 'libubsan' <<<"$libs" || { echo "FAIL $exe: ldd shows no libubsan"; exit 1; }
    n=$((n + 1))
done
[ "$n" -gt 0 ] || { echo "FAIL: no test executables in $build"; exit 1; }
echo "sanitizers linked in all $n C test executables of $build"
