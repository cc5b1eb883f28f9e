#!/usr/bin/env bash
# benches/vs_nginx.sh: throughput, latency and CPU cost of egress-sidecar next to nginx.
#
# Question answered:
#   How fast and how CPU-hungry is the sidecar next to nginx configured as an equivalent
#   keep-alive reverse proxy, on the same machine, in the same run?
#
# What it does and measures:
#   upstream  : nginx, 1 worker, `return 200 "ok\n"` (3-byte body), keepalive_requests 1e6.
#   nginx     : reverse proxy to the upstream: `upstream {}` with `keepalive 64` and
#               `max_conns=64` (the sidecar's cap), proxy_http_version 1.1,
#               `proxy_set_header Connection ""`, worker_processes 1, access_log off.
#   sidecar   : release build, one configured upstream (pool max_connections/max_idle 64, like
#               nginx's `keepalive 64`), with a route-mode listener (origin-form, the analogue
#               of nginx's reverse proxy) and the forward-proxy listener (absolute-form,
#               `GET http://127.0.0.1:UPPORT/`, i.e. what HTTP_PROXY clients send).
#               TOKIO_WORKER_THREADS=1, EGRESS_LOG=warn (nginx has no access log either).
#   CPU placement (the machine is assumed to have 2+ cores):
#               core 1: the proxy under test (nginx master+worker, or the sidecar; each alone,
#                       so both proxies get exactly one core);
#               core 0: wrk (1 thread) and the upstream nginx.
#               The "direct" row (wrk -> upstream, no proxy) is a reference only: there the
#               load generator and the server share core 0.
#   Per target: a 2 s warm-up (fills the pools), then `wrk -t1 -c$CONNECTIONS -d$DURATION
#               --latency`. Reported: requests/s, latency p50/p99 (wrk's, in ms), errors (wrk
#               socket errors + non-2xx), and the CPU the proxy process(es) used during the
#               measured run (utime+stime from /proc/PID/stat, all threads, nginx = master +
#               workers), as a share of one core and as microseconds of CPU per request.
#
# Usage (from the repo root):   benches/vs_nginx.sh
#   env: DURATION (default 10s), CONNECTIONS (default 50), WARMUP (default 2s),
#        ROUNDS (default 1; the four targets are run in turn this many times),
#        CARGO_TARGET_DIR (default target/bench), SIDECAR_BIN (skip the build, use this binary).
# Installs nginx and wrk with apt-get if they are missing. Everything it writes at run time
# (configs, logs, pid files) lives in one mktemp directory, removed on exit together with every
# process it started. Numbers are reported, not asserted.

set -euo pipefail

DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-50}
WARMUP=${WARMUP:-2s}
ROUNDS=${ROUNDS:-1}

cd "$(dirname "$0")/.."
REPO=$(pwd)

# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

ensure_tools nginx:nginx wrk:wrk taskset:util-linux python3:python3 curl:curl
build_sidecar
make_scratch egress-bench

read -r UP_PORT NGX_PORT FWD_PORT ADMIN_PORT ROUTE_PORT < <(free_ports 5)

# --- upstream: nginx returning a fixed 3-byte body -----------------------------------------
nginx_upstream_conf upstream "$UP_PORT" >"$TMP/upstream.conf"
start_nginx upstream "$LOAD_CPU"
UP_PID=$NGINX_PID

# --- nginx reverse proxy --------------------------------------------------------------------
nginx_proxy_conf proxy "$NGX_PORT" "$UP_PORT" 64 300s >"$TMP/proxy.conf"
start_nginx proxy "$PROXY_CPU"
NGX_PID=$NGINX_PID

# --- sidecar --------------------------------------------------------------------------------
sidecar_conf "$FWD_PORT" "$ADMIN_PORT" "$ROUTE_PORT" "$UP_PORT" 64 >"$TMP/sidecar.yaml"
start_sidecar "$TMP/sidecar.yaml" "$PROXY_CPU"

for port in "$UP_PORT" "$NGX_PORT" "$FWD_PORT" "$ROUTE_PORT"; do wait_port "$port"; done
write_wrk_script

check direct "http://127.0.0.1:$UP_PORT/"
check nginx "http://127.0.0.1:$NGX_PORT/"
check sidecar-route "http://127.0.0.1:$ROUTE_PORT/"
check sidecar-forward "http://127.0.0.1:$UP_PORT/" --proxy "http://127.0.0.1:$FWD_PORT"

CLK_TCK=$(getconf CLK_TCK)
LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg)
ROWS=()

bench() { # label url cpu_pid(or -) [absolute-form target]
    local label=$1 url=$2 pid=$3 target=${4:-}
    log "$label: warm-up $WARMUP, then $DURATION with $CONNECTIONS connections"
    wrk_warm "$url" "$CONNECTIONS" "$WARMUP" "$target"
    wrk_measure "$url" "$CONNECTIONS" "$DURATION" "$pid" "$TMP/wrk.$label.txt" "$target"
    ROWS+=("$(awk -v l="$label" -v n="$W_REQUESTS" -v d="$W_DURATION_US" -v p50="$W_P50_US" \
        -v p99="$W_P99_US" -v err="$W_ERRORS" -v pid="$pid" \
        -v dt="$W_CPU" -v db="$W_BUSY_PROXY" -v hz="$CLK_TCK" -v round="$ROUND" 'BEGIN {
            secs = d / 1e6; cpu = dt / hz
            if (pid == "-") { c1 = "-"; c2 = "-"; c3 = "-" }
            else { c1 = sprintf("%.2f", cpu); c2 = sprintf("%.0f%%", 100 * cpu / secs)
                   c3 = sprintf("%.1f", cpu * 1e6 / n) }
            other = db / hz - cpu; if (other < 0) other = 0
            printf "| %s | %s | %.0f | %.3f | %.3f | %d | %s | %s | %s | %.0f%% |", round, l,
                n / secs, p50 / 1000, p99 / 1000, err, c1, c2, c3, 100 * other / secs }')")
}

for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    bench "direct (reference)" "http://127.0.0.1:$UP_PORT/" -
    bench "nginx reverse proxy" "http://127.0.0.1:$NGX_PORT/" "$NGX_PID"
    bench "sidecar route mode" "http://127.0.0.1:$ROUTE_PORT/" "$SC_PID"
    bench "sidecar forward mode" "http://127.0.0.1:$FWD_PORT/" "$SC_PID" "http://127.0.0.1:$UP_PORT/"
done

# --- report ----------------------------------------------------------------------------------
sc_threads=$(awk '/^Threads:/ {print $2}' "/proc/$SC_PID/status")
ngx_procs=$((1 + $(pgrep -c -P "$NGX_PID" || true)))
cat <<EOF

## egress-sidecar vs nginx (keep-alive proxy), $(date -u +%Y-%m-%dT%H:%MZ)

- sidecar: $("$BIN" --version) ($BIN), TOKIO_WORKER_THREADS=1, $sc_threads threads, pinned to core $PROXY_CPU
- nginx: $(nginx -v 2>&1 | sed 's/^nginx version: //'), worker_processes 1 ($ngx_procs processes), proxy pinned to core $PROXY_CPU
- wrk: $(wrk -v 2>&1 | head -1 | awk '{print $1, $2}'), -t1 -c$CONNECTIONS -d$DURATION (after a $WARMUP warm-up), pinned to core $LOAD_CPU
- upstream: nginx \`return 200 "ok\\n"\`, 1 worker, pinned to core $LOAD_CPU (shared with wrk)
- host: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), kernel $(uname -r); load average before the runs: $LOADAVG (other load on the host skews the numbers)

| round | target | req/s | p50 ms | p99 ms | errors | proxy CPU s | proxy CPU (of 1 core) | CPU µs/req | other load on core $PROXY_CPU |
|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|
$(printf '%s\n' "${ROWS[@]}")

errors = wrk socket errors (connect/read/write/timeout) + non-2xx responses.
CPU = utime+stime of the proxy process(es) during the measured run (nginx: master + worker).
other load on core $PROXY_CPU = busy time of that core (/proc/stat, IRQs included) not used by the proxy
under test, as a share of the run: anything well above a few % means another process competed
with the proxy, and its req/s and latency are not comparable (CPU µs/req still is, roughly).
EOF
