#!/usr/bin/env bash
# Opt-in: the pure-Rust unit tests under Miri (undefined behaviour, bad
# aliasing, out-of-bounds, leaks). Needs a nightly toolchain with the miri
# component (`rustup +nightly component add miri rust-src`); CI's stable
# toolchain has neither, so scripts/test.sh does not run it. Tests that
# map shared memory or spawn processes cannot run under Miri (no shm_open,
# mmap of files, fork): the list below is what it can run.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo +nightly miri --version >/dev/null 2>&1 || { echo "miri not installed for the nightly toolchain"; exit 2; }
cargo +nightly miri test --lib -- \
    manager::protocol cuda::handle shm::names shm::flags shm::registry \
    content_store::dtype manager::segments::tests::naming "$@"
