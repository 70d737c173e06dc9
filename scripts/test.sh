#!/usr/bin/env bash
# Runs every test of the project: the README's test command (and .ci/run's).
# Installs what a fresh machine lacks (cmake) first.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v cc >/dev/null || need_apt+=(gcc)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "== installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

# --- packaging and bindings (issue 5): tools ------------------------------
# C++ for the RAII tests, pkg-config and Go for the consumer and Go tests.
pkg_apt=()
command -v c++ >/dev/null || pkg_apt+=(g++)
command -v pkg-config >/dev/null || pkg_apt+=(pkg-config)
command -v go >/dev/null || pkg_apt+=(golang-go)
if [ ${#pkg_apt[@]} -gt 0 ]; then
    echo "== installing ${pkg_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkg_apt[@]}"
fi
# --- end packaging tools -----------------------------------------------------

target="${CARGO_TARGET_DIR:-$PWD/target}"

echo "== cargo build (release library for the C tests)"
cargo build --release --lib --bins

echo "== cargo test"
cargo test --release

echo "== C tests (ctest, -Wall -Wextra -Wpedantic -Werror, and under ASan+UBSan)"
for variant in plain asan; do
    build="$target/ctests-$variant"
    cmake -S ctests -B "$build" -DSS_LIB_DIR="$target/release" \
        -DSS_SANITIZE=$([ $variant = asan ] && echo ON || echo OFF) >/dev/null
    cmake --build "$build" -j2 >/dev/null
    ctest --test-dir "$build" --output-on-failure -j2
done
# --- reliability (issue 12): the sanitizer build really links ASan+UBSan ----
bash scripts/check_sanitizers.sh "$target/ctests-asan"
# --- end reliability -------------------------------------------------------------

# --- packaging and bindings (issue 5) ----------------------------------------
echo "== packaging: install to a temp prefix; SONAME; find_package (shared, static), pkg-config, README examples; go test"
bash tests/packaging/run.sh "$target/release"
# --- end packaging -------------------------------------------------------------
