#!/usr/bin/env bash
# Checks the library the way its users get it: installs cargo's artifacts
# to a temporary prefix with the top-level CMake project, then
#  - the SONAME (readelf -d) and the .so links;
#  - an out-of-tree CMake project with find_package against the shared and
#    the static target, and one asking for a version of another major;
#  - pkg-config (flags, version, Libs.private);
#  - the README's run command (ssctl demo), and every README example
#    marked "checked", built and run exactly as written (CMake, pkg-config,
#    the static link line, C++), and the programs of examples/ (C, C++, Go)
#    that the README and docs/ link to;
#  - the Go package's tests with cgo pointer checks and forced GC.
# Each consumer shares a buffer between two processes; no segment may be
# left in /dev/shm.
#   tests/packaging/run.sh <folder with libstorage_sharing.so/.a and the executables>
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
artifacts="$(cd "${1:?usage: run.sh <cargo release folder>}" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/ss-packaging.XXXXXX")"
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"
fail() { echo "packaging: FAIL: $*" >&2; exit 1; }
step() { echo "-- $*"; }

# Runs a program that prints the segment it made ("/torch_..."), and checks
# that the segment is gone once the program ended. (Consumers and Go tests
# check their own segments; a global look at /dev/shm would see other
# projects' test runs on a shared machine.)
run_and_check_segment() {
    local what="$1" out name
    shift
    out="$("$@")" || fail "$what"
    echo "$out"
    name="$(echo "$out" | grep -o '/torch_[0-9_]*' | head -n1)"
    [ -n "$name" ] || fail "$what printed no segment name"
    [ ! -e "/dev/shm$name" ] || fail "$what left /dev/shm$name behind"
}

version="$(sed -n 's/^version *= *"\([0-9.]*\)".*/\1/p' "$root/Cargo.toml" | head -n1)"
major="${version%%.*}"

step "install $version to a temporary prefix"
cmake -S "$root" -B "$work/build" -DSS_PREBUILT_DIR="$artifacts" >/dev/null
cmake --build "$work/build" >/dev/null
cmake --install "$work/build" --prefix "$prefix" >/dev/null

step "SONAME and links"
lib="$prefix/lib"
[ -f "$lib/libstorage_sharing.so.$version" ] && [ ! -L "$lib/libstorage_sharing.so.$version" ] \
    || fail "no real file libstorage_sharing.so.$version"
[ "$(readlink "$lib/libstorage_sharing.so.$major")" = "libstorage_sharing.so.$version" ] || fail ".so.$major link"
[ "$(readlink "$lib/libstorage_sharing.so")" = "libstorage_sharing.so.$major" ] || fail ".so link"
readelf -d "$lib/libstorage_sharing.so.$version" | grep -q "(SONAME) *Library soname: \[libstorage_sharing.so.$major\]" \
    || fail "SONAME is not libstorage_sharing.so.$major: $(readelf -d "$lib/libstorage_sharing.so.$version" | grep SONAME)"
readelf -d "$lib/libstorage_sharing.so.$version" | grep SONAME
# The crate's executables (src/bin/NAME.rs, src/bin/NAME/main.rs) are installed.
for f in "$root"/src/bin/*.rs "$root"/src/bin/*/main.rs; do
    [ -e "$f" ] || continue
    bin="$(basename "${f%/main.rs}" .rs)"
    [ -x "$prefix/bin/$bin" ] || fail "executable $bin not installed"
done
ls "$prefix/bin" 2>/dev/null | sed 's/^/   installed bin: /' || true

step "find_package consumer: shared, static and C++ targets"
cmake -S "$root/tests/packaging/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
    -DSS_WANT_VERSION="$major.0" >/dev/null
cmake --build "$work/consumer" -j2 >/dev/null
for exe in consumer_shared consumer_static consumer_cpp; do
    "$work/consumer/$exe" || fail "$exe"
done
readelf -d "$work/consumer/consumer_shared" | grep -q "NEEDED.*\[libstorage_sharing.so.$major\]" \
    || fail "consumer_shared does not record libstorage_sharing.so.$major"
if readelf -d "$work/consumer/consumer_static" | grep -q "NEEDED.*libstorage_sharing"; then
    fail "consumer_static depends on the shared library"
fi
if cmake -S "$root/tests/packaging/consumer" -B "$work/consumer-next" -DCMAKE_PREFIX_PATH="$prefix" \
    -DSS_WANT_VERSION="$((major + 1)).0" >"$work/next.log" 2>&1; then
    fail "find_package accepted version $((major + 1)).0 from a $version install"
fi
grep -q "not compatible\|unsuitable\|version" "$work/next.log" || fail "no version message: $(cat "$work/next.log")"

step "pkg-config consumer"
export PKG_CONFIG_PATH="$lib/pkgconfig"
[ "$(pkg-config --modversion storage_sharing)" = "$version" ] || fail "pkg-config version"
# shellcheck disable=SC2046 # word splitting of the flags is intended
cc -std=c11 -Wall -Wextra -Werror "$root/tests/packaging/consumer/consumer.c" $(pkg-config --cflags --libs storage_sharing) \
    -Wl,-rpath,"$lib" -o "$work/consumer_pc"
"$work/consumer_pc" || fail "pkg-config consumer"
private="$(pkg-config --static --libs storage_sharing | tr ' ' '\n' | grep '^-l' | grep -v '^-lstorage_sharing$' | sort | tr '\n' ' ')"
[ -n "$private" ] || fail "no Libs.private"

step "README's run command (ssctl demo; scripts/test.sh has built the executables)"
grep -q '^cargo build --release --bins && target/release/ssctl demo ' "$root/README.md" \
    || fail "README's run command is not 'cargo build --release --bins && target/release/ssctl demo'"
grep -q '^bash scripts/test.sh ' "$root/README.md" || fail "README's test command is not 'bash scripts/test.sh'"
timeout 300 "$artifacts/ssctl" demo >"$work/demo.log" 2>&1 || { cat "$work/demo.log"; fail "ssctl demo"; }
tail -n 3 "$work/demo.log"

step "README examples and examples/"
readme="$work/readme"
mkdir -p "$readme"
# Writes each fenced block that follows a "<!-- checked: FILE -->" line to FILE.
awk -v dir="$readme" '
    /^<!-- checked: .* -->$/ { file = dir "/" $3; next }
    file != "" && /^```/ { if (inblock) { inblock = 0; file = "" } else { inblock = 1; printf "" > file }; next }
    inblock { print >> file }
' "$root/README.md"
for f in app.c CMakeLists.txt pkg-config.sh static-link.sh cpp.sh; do
    [ -s "$readme/$f" ] || fail "README has no checked block $f"
done
# The README's C program is examples/c/app.c; its C++ line builds examples/cpp/app.cpp.
cmp -s "$readme/app.c" "$root/examples/c/app.c" || fail "README's app.c differs from examples/c/app.c"
cp "$root/examples/cpp/app.cpp" "$readme/app.cpp"
readme_libs="$(grep -o ' -l[a-z_0-9]*' "$readme/static-link.sh" | tr -d ' ' | sort | tr '\n' ' ')"
[ "$readme_libs" = "$private" ] || fail "README static line links '$readme_libs', Libs.private says '$private'"
run_and_check_segment "README static link line" bash -c 'cd "$1" && PREFIX="$2" bash -eu static-link.sh' _ "$readme" "$prefix"
if readelf -d "$readme/app" | grep -q "NEEDED.*libstorage_sharing"; then fail "README static app is not static"; fi
run_and_check_segment "README pkg-config example" bash -c 'cd "$1" && rm -f app && PREFIX="$2" bash -eu pkg-config.sh' _ "$readme" "$prefix"
run_and_check_segment "README C++ example (examples/cpp/app.cpp)" bash -c 'cd "$1" && PREFIX="$2" bash -eu cpp.sh' _ "$readme" "$prefix"
cmake -S "$readme" -B "$readme/build" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$readme/build" >/dev/null
run_and_check_segment "README CMake example" "$readme/build/app"

# The C programs of examples/c against the installed prefix, through
# pkg-config (CTest also runs them, plain and under the sanitizers).
for src in "$root"/examples/c/*.c; do
    exe="$readme/example_$(basename "$src" .c)"
    # shellcheck disable=SC2046 # word splitting of the flags is intended
    cc -std=c11 -Wall -Wextra -Wpedantic -Werror "$src" $(pkg-config --cflags --libs storage_sharing) \
        -Wl,-rpath,"$lib" -o "$exe" || fail "examples/c/$(basename "$src") does not build"
    "$exe" || fail "examples/c/$(basename "$src")"
done

if command -v go >/dev/null; then
    step "Go: examples/go and go test"
    export CGO_LDFLAGS="-Wl,-rpath,$lib"
    export GOFLAGS=-mod=mod GOTOOLCHAIN=local
    export GOCACHE="${GOCACHE:-$artifacts/go-build-cache}"
    # A copy, with the module's relative replace made absolute: go run writes
    # nothing into the checkout.
    cp -r "$root/examples/go" "$readme/go"
    sed -i "s#=> \.\./\.\./bindings/go#=> $root/bindings/go#" "$readme/go/go.mod"
    grep -q "=> $root/bindings/go" "$readme/go/go.mod" || fail "examples/go/go.mod has no replace of ../../bindings/go"
    run_and_check_segment "examples/go" bash -c 'cd "$1" && go run .' _ "$readme/go"
    # Pointer checks: the default level, then the full one (GOEXPERIMENT
    # from Go 1.21, GODEBUG before).
    (cd "$root/bindings/go" && GODEBUG=cgocheck=1 go test -count=1 .) || fail "go test (cgocheck=1)"
    go_minor="$(go env GOVERSION | sed -n 's/^go1\.\([0-9]*\).*/\1/p')"
    if [ "${go_minor:-0}" -ge 21 ]; then
        (cd "$root/bindings/go" && GOEXPERIMENT=cgocheck2 go test -count=1 .) || fail "go test (cgocheck2)"
    else
        (cd "$root/bindings/go" && GODEBUG=cgocheck=2 go test -count=1 .) || fail "go test (cgocheck=2)"
    fi
else
    fail "go is not installed (scripts/test.sh installs golang-go)"
fi

echo "packaging: all checks passed (install, SONAME, find_package shared/static, pkg-config, README examples, examples/, Go)"
