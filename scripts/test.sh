#!/usr/bin/env bash
# Runs every test of the project: the README's test command (and .ci/run's).
# Installs what a fresh machine lacks first: apt packages (cmake, C/C++
# compilers, pkg-config, Go) and PyTorch, from the Python package index, in
# a virtual environment of its own under target/ (reused while it imports).
# Prints the minutes each part took at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p "$target"
timings=()
part_start=$SECONDS
# Closes the timing of the part that just ended: `part_done NAME`.
part_done() {
    local took=$((SECONDS - part_start))
    timings+=("$(printf '%-26s %3d min %02d s' "$1" $((took / 60)) $((took % 60)))")
    part_start=$SECONDS
}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v cc >/dev/null || need_apt+=(gcc)
command -v c++ >/dev/null || need_apt+=(g++)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v go >/dev/null || need_apt+=(golang-go)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "== installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

# PyTorch for the interop tests: every test that talks to a PyTorch process
# uses $SS_TEST_PYTHON. Under CI such a test fails when torch is missing.
venv="$target/torch-venv"
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "== installing PyTorch into $venv (about 5 GB with its CUDA libraries; CPU use only)"
    rm -rf "$venv"
    python3 -m venv "$venv"
    # No pip cache: on a fresh machine it would only hold a second copy.
    PIP_NO_CACHE_DIR=1 "$venv/bin/pip" install --quiet --disable-pip-version-check torch numpy
fi
export SS_TEST_PYTHON="$venv/bin/python"
echo "== PyTorch $("$SS_TEST_PYTHON" -c 'import torch; print(torch.__version__)') at $SS_TEST_PYTHON"
part_done "install (apt, PyTorch)"

echo "== lint gate: rustfmt, clippy -D warnings, rustdoc -D warnings"
cargo fmt --check
cargo clippy --release --all-targets --quiet -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --quiet
# The Python package is a crate of its own (PyO3): the same gate.
cargo fmt --manifest-path python/Cargo.toml --check
CARGO_TARGET_DIR="$target/python" cargo clippy --manifest-path python/Cargo.toml --release --all-targets --quiet -- -D warnings
part_done "lint gate"

echo "== cargo build (release library for the C tests)"
cargo build --release --lib --bins
part_done "cargo build"

echo "== cargo test"
export SS_TORCH_TESTS_LOG="$target/torch-interop-tests.txt"
rm -f "$SS_TORCH_TESTS_LOG"
cargo test --release --no-fail-fast
torch_tests=$(sort -u "$SS_TORCH_TESTS_LOG" 2>/dev/null | wc -l)
echo "== PyTorch interop tests run against $SS_TEST_PYTHON: $torch_tests"
if [ -n "${CI:-}" ] && [ "$torch_tests" -eq 0 ]; then
    echo "no PyTorch interop test ran under CI" >&2
    exit 1
fi
part_done "cargo test"

echo "== Python package: the wheel (scripts/build_wheel.sh), pip-installed into a fresh venv without cargo, pytest"
bash scripts/build_wheel.sh | tee "$target/build_wheel.log"
bash python/run_wheel_tests.sh "$(tail -n 1 "$target/build_wheel.log")"
part_done "Python package (wheel)"

echo "== C tests (ctest, -Wall -Wextra -Wpedantic -Werror, and under ASan+UBSan)"
for variant in plain asan; do
    build="$target/ctests-$variant"
    cmake -S ctests -B "$build" -DSS_LIB_DIR="$target/release" \
        -DSS_SANITIZE=$([ $variant = asan ] && echo ON || echo OFF) >/dev/null
    cmake --build "$build" -j2 >/dev/null
    ctest --test-dir "$build" --output-on-failure -j2
done
# The sanitizer build really links ASan+UBSan.
bash scripts/check_sanitizers.sh "$target/ctests-asan"
part_done "C and C++ tests"

echo "== packaging: install to a temp prefix; SONAME; find_package (shared, static), pkg-config, README examples, examples/; go test"
bash tests/packaging/run.sh "$target/release"
part_done "packaging, Go"

echo "== libtorch: a C++ program on the wheel's libtorch shares tensors with Python PyTorch through torch.hpp"
bash tests/libtorch/run.sh "$target/release"
part_done "libtorch adapter"

# The oldest PyTorch the package supports (python/pyproject.toml's torch
# extra, TESTED_RANGE in python/storage_sharing/_torch_compat.py): the pytest
# suite and PyTorch's test_multiprocessing.py of that release, stock and with
# enable(), through scripts/torch_versions.sh in a venv of its own under
# target/ (kept between runs). The newest is $SS_TEST_PYTHON's, above.
oldest_torch=2.4.1
oldest_torch_part() {
    echo "== Python package on the oldest PyTorch supported, $oldest_torch"
    # The wheel the part above built and tested (build_wheel.sh prints its
    # path last).
    local wheel
    wheel="$(tail -n 1 "$target/build_wheel.log")"
    # Less the tests of our own logic that no release changes (the file
    # says which and why); they ran on the newest release above.
    bash scripts/torch_versions.sh --cache "$target/torch-versions" --wheel "$wheel" \
        --deselect-from scripts/oldest_torch_deselect.txt "$oldest_torch"
}

# Last, because it needs room: its venv takes 5.2 GB plus 3.2 GB of
# downloads while pip installs (measured: docs/testing.md#disk), so 12 GiB
# leaves a margin. Where the disk has less, the build products
# no later part needs go first (each is rebuilt by the next run), the newest
# PyTorch's venv last.
room_gib=12
free_gib() { df -P -B1G "$target" | awk 'NR == 2 { print $4 }'; }
echo "== disk: $(free_gib) GiB free under $target (installing the oldest PyTorch needs about $room_gib)"
oldest_venv="$target/torch-versions/torch-$oldest_torch"
[ -x "$oldest_venv/bin/python" ] && room_gib=0
for reusable in "$target/wheel-build" "$target/wheel-venv" "$target/python" \
    "$target/ctests-asan" "$target/ctests-plain" "$target/release" "$venv"; do
    [ "$(free_gib)" -ge "$room_gib" ] && break
    [ -e "$reusable" ] || continue
    echo "== disk: removing $reusable ($(du -sh "$reusable" | cut -f1)) to make room"
    rm -rf "$reusable"
done
oldest_torch_part
part_done "oldest PyTorch"

echo "== minutes per part"
printf '%s\n' "${timings[@]}"
