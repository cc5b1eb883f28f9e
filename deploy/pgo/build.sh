#!/usr/bin/env bash
# deploy/pgo/build.sh: the release build that ships, optimised with a profile of its own
# request path (profile-guided optimisation). The Dockerfile runs it, deploy/validate.sh runs it
# and tests the result, and benches/ measure it. Why, and what it changes: deploy/pgo/README.md.
#
#   1. `cargo build --release` with -Cprofile-generate: an instrumented sidecar that counts
#      every branch and call, into $PGO_TARGET_DIR/pgo/instrumented;
#   2. the trainer (`cargo build --example pgo-train`: deploy/pgo/train.rs), which drives that
#      sidecar through the request paths users run and checks every answer; the sidecar writes
#      its counts when it exits;
#   3. llvm-profdata (rustup's llvm-tools, the LLVM of this rustc) merges them;
#   4. `cargo build --release` with -Cprofile-use: $PGO_TARGET_DIR/release/egress-sidecar.
#
# Usage (from anywhere):   deploy/pgo/build.sh
#   env: PGO_TARGET_DIR (where the release builds go: default $CARGO_TARGET_DIR, else target/);
#        the trainer builds in cargo's usual target directory, where `cargo test` left its
#        dependencies. RUSTFLAGS, when set, are kept and added to.
# Prints the binary's path on stdout; everything else goes to stderr.

set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
OUT=${PGO_TARGET_DIR:-${CARGO_TARGET_DIR:-$REPO/target}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PGO=$OUT/pgo
RAW=$PGO/raw
FLAGS=${RUSTFLAGS:-}

log() { printf '==> pgo: %s\n' "$*" >&2; }
die() { printf 'error: pgo: %s\n' "$*" >&2; exit 1; }

# llvm-profdata must be the one of rustc's own LLVM: a profile's format follows it.
host=$(rustc -vV | sed -n 's/^host: //p')
profdata=$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata
if [[ ! -x $profdata ]]; then
    command -v rustup >/dev/null || die "no $profdata and no rustup to add llvm-tools with"
    log "adding rustup's llvm-tools (llvm-profdata)"
    rustup component add llvm-tools >&2
fi
[[ -x $profdata ]] || die "no llvm-profdata at $profdata"

# Moves of up to 256 bytes are written inline (16 stores) instead of calling memcpy. x86-64's
# default stops at 8 stores (128 bytes): requests and responses of 129-256 bytes move through
# the request path a dozen times per request, each a call into libc (see README.md). The
# option is LLVM's own: added only when this rustc's LLVM takes it.
mkdir -p "$PGO"
if echo 'fn main() {}' | rustc -Cllvm-args=--max-store-memcpy=16 --emit=metadata \
    --crate-type=bin --crate-name=probe -o "$PGO/probe.rmeta" - 2>/dev/null; then
    FLAGS="$FLAGS -Cllvm-args=--max-store-memcpy=16"
else
    log "this rustc's LLVM has no --max-store-memcpy: moves keep LLVM's default"
fi

log "1/4 instrumented build"
rm -rf "$RAW"
RUSTFLAGS="$FLAGS -Cprofile-generate=$RAW" CARGO_TARGET_DIR=$PGO/instrumented \
    cargo build --release --locked --bin egress-sidecar >&2
# Build scripts and proc macros were instrumented too and wrote counts as they ran: not ours.
rm -rf "$RAW"

log "2/4 training"
# One build: its progress and diagnostics go to stderr, its JSON names the binary.
trainer=$(cargo build --locked --example pgo-train --message-format=json-render-diagnostics |
    sed -n 's/.*"executable":"\([^"]*pgo-train\)".*/\1/p' | tail -n1)
[[ -x $trainer ]] || die "no trainer binary"
"$trainer" "$PGO/instrumented/release/egress-sidecar" >&2
compgen -G "$RAW/*.profraw" >/dev/null || die "the instrumented sidecar wrote no profile into $RAW"

log "3/4 merging $(find "$RAW" -name '*.profraw' | wc -l) profiles"
"$profdata" merge -o "$PGO/merged.profdata" "$RAW"

log "4/4 optimised build"
RUSTFLAGS="$FLAGS -Cprofile-use=$PGO/merged.profdata" CARGO_TARGET_DIR=$OUT \
    cargo build --release --locked --bin egress-sidecar >&2
echo "$OUT/release/egress-sidecar"
