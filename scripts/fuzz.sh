#!/usr/bin/env bash
# Opt-in coverage-guided fuzzing (libFuzzer through cargo-fuzz; needs the
# nightly toolchain and `cargo install cargo-fuzz`, so CI does not run it:
# CI runs the property-based tests/reliability/parsers_fuzzed.rs, tests/store/tcpstore_fed_hostile_bytes.rs
# and tests/content_store/pytorch_format_fed_hostile_bytes.rs over the same corpus).
# Each target starts from the committed corpus tests/corpus/<dir>; new
# inputs go to a scratch folder. A crash leaves its input under
# fuzz/artifacts/<target>/: add it to tests/corpus/<dir>/ as a regression case.
# usage: scripts/fuzz.sh [seconds per target, default 60] [target...]   (default: every target)
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
shift || true
only=" $* "
for pair in manager_protocol:manager_protocol cuda_handle:cuda_handle shm_name:shm_names \
    tcpstore_request:tcpstore_request tensor_record:tensor_record torch_file:torch_format torch_unpickle:torch_format \
    arena_handle:arena_handle symm_request:symm_request; do
    target="${pair%%:*}" corpus="tests/corpus/${pair##*:}"
    if [ "$only" != "  " ] && [[ "$only" != *" $target "* ]]; then continue; fi
    scratch="$(mktemp -d)"
    echo "== fuzz $target for ${secs}s (seed corpus $corpus)"
    cargo +nightly fuzz run -O "$target" "$scratch" "$corpus" -- -max_total_time="$secs" 2>&1 | grep -E "DONE|Done|SUMMARY|panicked|crash-" || true
    rm -rf "$scratch"
done
