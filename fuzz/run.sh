#!/usr/bin/env bash
# fuzz/run.sh: every fuzz target for a bounded time, from the committed corpus.
#
# Usage (from anywhere):   bash fuzz/run.sh [SECONDS per target, default 60]
# Needs a nightly toolchain (cargo-fuzz's instrumentation uses unstable flags) and installs
# cargo-fuzz with `cargo install --locked` if missing. The corpus in tests/fuzz_corpus/<target>/
# is copied to a scratch directory first, so a run never rewrites the committed one; a crash
# leaves its input in fuzz/artifacts/<target>/ and fails the run: add that input to the corpus
# (it then runs in every `cargo test` through src/fuzzing.rs's test) and fix the code.
set -euo pipefail
SECONDS_PER_TARGET=${1:-60}
cd "$(dirname "$0")"
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "fuzz/run.sh: no nightly toolchain installed; cannot fuzz here" >&2
    exit 2
fi
command -v cargo-fuzz >/dev/null 2>&1 || cargo install --locked cargo-fuzz
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
targets=$(sed -n 's/^name = "\([a-z_]*\)"$/\1/p' Cargo.toml | grep -v '^egress-sidecar-fuzz$')
cargo +nightly fuzz build --release
for target in $targets; do
    mkdir -p "$scratch/$target"
    cp ../tests/fuzz_corpus/"$target"/* "$scratch/$target/"
    echo "==> fuzzing $target for ${SECONDS_PER_TARGET}s ($(find "$scratch/$target" -type f | wc -l) corpus inputs)"
    status=0
    cargo +nightly fuzz run --release "$target" "$scratch/$target" -- \
        -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1 \
        >"$scratch/$target.log" 2>&1 || status=$?
    grep -E '^stat::(number_of_executed_units|peak_rss_mb)' "$scratch/$target.log" || true
    if [[ $status -ne 0 ]]; then
        tail -40 "$scratch/$target.log" >&2
        echo "fuzz/run.sh: $target found a failing input (fuzz/artifacts/$target/)" >&2
        exit 1
    fi
done
