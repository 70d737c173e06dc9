#!/usr/bin/env bash
# Checks include/storage_sharing/torch.hpp inside real libtorch programs:
# installs the library to a temporary prefix (as tests/packaging/run.sh
# does), builds tests/libtorch and examples/libtorch against it with
# find_package(StorageSharing) and against the libtorch of the PyTorch at
# $SS_TEST_PYTHON, then runs the example and the interop tests, which
# exchange tensors with stock Python PyTorch processes both ways, and the
# weights pool tests (a C-API producer process, host backend).
#   tests/libtorch/run.sh [cargo release folder, default target/release] [--bench]
# --bench also builds and runs the benchmark (not part of the tests).
# Without PyTorch it skips, except under CI, where it fails.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
artifacts="$root/target/release"
bench=0
for arg in "$@"; do
    case "$arg" in
        --bench) bench=1 ;;
        *) artifacts="$arg" ;;
    esac
done
artifacts="$(cd "$artifacts" && pwd)"
fail() {
    echo "libtorch: FAIL: $*" >&2
    echo "libtorch: 0 passed, 1 failed"
    exit 1
}

python="${SS_TEST_PYTHON:-}"
if [ -z "$python" ] || ! "$python" -c 'import torch' 2>/dev/null; then
    [ -z "${CI:-}" ] || fail "PyTorch is missing (SS_TEST_PYTHON='$python' cannot import torch)"
    echo "libtorch: skipped: no PyTorch at SS_TEST_PYTHON='$python'"
    exit 0
fi
torch_dir="$("$python" -c 'import torch, os; print(os.path.dirname(torch.__file__))')"
abi="$("$python" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"
echo "-- PyTorch $("$python" -c 'import torch; print(torch.__version__)') at $torch_dir"

work="$(mktemp -d "${TMPDIR:-/tmp}/ss-libtorch.XXXXXX")"
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

echo "-- install storage-sharing to a temporary prefix"
cmake -S "$root" -B "$work/install" -DSS_PREBUILT_DIR="$artifacts" >/dev/null
cmake --build "$work/install" >/dev/null
cmake --install "$work/install" --prefix "$prefix" >/dev/null
[ -f "$prefix/include/storage_sharing/torch.hpp" ] || fail "torch.hpp was not installed"

# find_package(Torch) where the wheel's config works here; the CUDA wheels'
# config stops without a CUDA toolkit, and then plain flags are used.
mkdir -p "$work/probe"
printf 'cmake_minimum_required(VERSION 3.18)\nproject(probe CXX)\nfind_package(Torch REQUIRED)\n' >"$work/probe/CMakeLists.txt"
torch_flags=(-DSS_TORCH_DIR="$torch_dir" -DSS_TORCH_CXX11_ABI="$abi")
if cmake -S "$work/probe" -B "$work/probe/build" -DCMAKE_PREFIX_PATH="$torch_dir/share/cmake" >"$work/probe.log" 2>&1; then
    echo "-- libtorch through find_package(Torch)"
    torch_flags+=(-DSS_TORCH_FIND_PACKAGE=ON)
else
    echo "-- libtorch through plain flags: find_package(Torch) failed here ($(grep -o 'CUDA[^.]*' "$work/probe.log" | head -n1 || echo 'see its log'))"
fi

echo "-- build tests/libtorch and examples/libtorch (one compile each)"
cmake -S "$root/tests/libtorch" -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix;$torch_dir/share/cmake" \
    "${torch_flags[@]}" -DSS_EXAMPLE_DIR="$root/examples/libtorch" >"$work/configure.log" 2>&1 \
    || { cat "$work/configure.log"; fail "configure"; }
cmake --build "$work/build" -j2 >"$work/build.log" 2>&1 || { tail -n 60 "$work/build.log"; fail "build"; }

# docs/libtorch.md shows the example: the page's block is the file.
awk '/^<!-- checked: share_tensor.cpp -->$/ { take = 1; next }
     take && /^```/ { if (inblock) exit; inblock = 1; next }
     inblock { print }' "$root/docs/libtorch.md" >"$work/docs_example.cpp"
cmp -s "$work/docs_example.cpp" "$root/examples/libtorch/share_tensor.cpp" \
    || fail "docs/libtorch.md's example differs from examples/libtorch/share_tensor.cpp"

if [ -x "$work/build/libtorch_example" ]; then
    echo "-- examples/libtorch/share_tensor"
    out="$("$work/build/libtorch_example" "$python")" || { echo "$out"; fail "the example"; }
    echo "$out" | sed 's/^/   /'
    name="$(echo "$out" | grep -o '/torch_[0-9_]*' | head -n1)"
    [ -n "$name" ] || fail "the example printed no segment name"
    # The Python child exits without dropping its storage, and PyTorch
    # does not release storages at interpreter exit: its count stays in
    # the header, and the manager removes the name once every holder has
    # exited. Wait for that (30 s: a hang guard only).
    for _ in $(seq 300); do [ -e "/dev/shm$name" ] || break; sleep 0.1; done
    [ ! -e "/dev/shm$name" ] || fail "the example left /dev/shm$name behind"
fi

echo "-- interop tests"
"$work/build/libtorch_interop" "$python" "$root/tests/libtorch/peer.py"

echo "-- weights pool tests (Weights::open over a host-backend producer)"
"$work/build/libtorch_pool_weights"

if [ "$bench" = 1 ]; then
    cmake --build "$work/build" --target libtorch_bench >/dev/null
    "$work/build/libtorch_bench" "$torch_dir/bin/torch_shm_manager"
fi
