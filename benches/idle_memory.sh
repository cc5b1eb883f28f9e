#!/usr/bin/env bash
# benches/idle_memory.sh: memory cost of idle connections, egress-sidecar next to nginx.
#
# Question answered:
#   What does one idle downstream keep-alive connection cost the sidecar, and one pooled idle
#   upstream connection? (And the same for nginx as a keep-alive reverse proxy, for comparison.)
#
# What it measures (details in benches/idle_memory.py, which does the work):
#   - VmRSS of the proxy (nginx: master + worker) before and after opening N (default 5000)
#     client keep-alive connections that each made one request and then sit idle:
#     bytes per idle downstream connection.
#   - VmRSS before and after M (default 1000) concurrent 1-second requests that make the pool
#     open M upstream connections, which then sit idle in the pool: bytes per pooled idle
#     upstream connection (the still-open client connections' share is subtracted).
#   Each measurement uses a fresh proxy process; the upstream is a Python asyncio server.
#   User-space memory only: kernel socket memory is not in RSS.
#
# Usage (from the repo root):   benches/idle_memory.sh
#   env: DOWNSTREAM (default 5000), UPSTREAM (default 1000), TUNNELS (default 1000),
#        WARM (default 64: connections and tunnels opened and closed before each base reading;
#        0: the base is the fresh process, and the figure is what its first burst keeps),
#        IDLE_SETTLE (default 1: seconds waited before each reading, tunnels' at least 3; 12
#        reads after the heap trim, every 5 s, has had the threads free the buffers they keep),
#        CARGO_TARGET_DIR (default target/bench), SIDECAR_BIN (skip the build, use this binary),
#        SIDECAR_TUNABLES (the sidecar's GLIBC_TUNABLES, default the image's, from the
#        Dockerfile; empty for a plain build as `cargo build` runs it; nginx runs without),
#        HEAP_STATS=1 (also the live heap per idle client connection and tunnel: glibc's
#        malloc_stats through gdb).
# Installs nginx with apt-get if missing. Configs and logs go to one mktemp directory, removed
# on exit with every process started. Numbers are reported, not asserted.

set -euo pipefail

DOWNSTREAM=${DOWNSTREAM:-5000}
UPSTREAM=${UPSTREAM:-1000}
TUNNELS=${TUNNELS:-1000}
WARM=${WARM:-64}

cd "$(dirname "$0")/.."
REPO=$(pwd)

# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

if ! command -v nginx >/dev/null; then
    log "installing nginx"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
fi
for tool in nginx python3 ss; do
    command -v "$tool" >/dev/null || die "$tool is required"
done

build_sidecar

TMP=$(mktemp -d /tmp/egress-idle-mem.XXXXXX)
PY_PID=
cleanup() {
    # The Python driver stops the proxies and the upstream it started; this is the backstop
    # for an interrupted run.
    if [[ -n $PY_PID ]]; then
        kill -TERM "$PY_PID" 2>/dev/null || true
        wait "$PY_PID" 2>/dev/null || true
    fi
    for f in "$TMP"/*.pid; do
        [[ -f $f ]] && kill -TERM "$(cat "$f")" 2>/dev/null || true
    done
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# RLIMIT_NOFILE: the Python driver raises its soft limit to the hard one and the proxies inherit it.
log "measuring: $DOWNSTREAM idle downstream, $UPSTREAM pooled upstream connections (sidecar, then nginx), $TUNNELS idle CONNECT and WebSocket tunnels (sidecar)"
python3 "$REPO/benches/idle_memory.py" measure --sidecar "$BIN" --tunables "$SIDECAR_TUNABLES" \
    --tmp "$TMP" --downstream "$DOWNSTREAM" --upstream "$UPSTREAM" --tunnels "$TUNNELS" --warm "$WARM" &
PY_PID=$!
wait "$PY_PID"
PY_PID=
