#!/usr/bin/env bash
# benches/vs_haproxy_h2.sh: HTTP/1.1 clients through the sidecar to an HTTP/2 upstream, next to
# HAProxy doing the same (h1 frontend, h2 to the backend).
#
# Question answered:
#   400 concurrent HTTP/1.1 clients through the sidecar to an HTTP/2 (h2c) upstream vs the same
#   through HAProxy with h2 to the backend: requests per second and CPU per request side by
#   side, in one run, plus how many upstream TCP connections each proxy opened.
#
# What it does and measures:
#   upstream  : nghttpd (nghttp2-server), h2c with prior knowledge (--no-tls), 1 worker thread,
#               serving a 3-byte file ("ok\n") as `/`, SETTINGS_MAX_CONCURRENT_STREAMS
#               $MAX_STREAMS (default 100, nghttpd's own default). With 400 requests in flight
#               a proxy that respects the limit needs 4 connections.
#   haproxy   : `mode http`, frontend on a free port (HTTP/1.1 from wrk), backend
#               `server s1 127.0.0.1:UPPORT proto h2` (h2c to the backend), `http-reuse always`,
#               nbthread 1, `-db` (no master process). The per-connection stream cap is
#               `tune.h2.be.max-concurrent-streams $MAX_STREAMS` where the installed HAProxy
#               accepts it (checked with `haproxy -c`); older ones (Debian 12's 2.6 rejects it)
#               get `tune.h2.max-concurrent-streams $MAX_STREAMS`, which in 2.6 also caps the
#               server's advertised limit on backend connections. global maxconn is sized to
#               the open-file limit the script gets (it raises `ulimit -n` as far as allowed).
#               HAProxy's own `show stat` counters for the server (connect, reuse; cumulative,
#               warm-ups included) are printed as a cross-check of the ss samples.
#   sidecar   : release build, one upstream `protocol: http2` on the h2c url with a route-mode
#               listener (origin-form, the analogue of HAProxy's frontend), pool
#               { max_connections: 64, max_pending: 4096, pending_timeout: 30s },
#               http2.max_streams_per_connection $MAX_STREAMS. TOKIO_WORKER_THREADS=1,
#               EGRESS_LOG=warn.
#   CPU placement (the machine is assumed to have 2 cores; with exactly 2 this is the best
#   split available, and core 0 may well be the bottleneck, see "core 0 busy"):
#               core 1: the proxy under test, alone (HAProxy, or the sidecar);
#               core 0: wrk (1 thread), the upstream nghttpd, and the connection sampler.
#   Reference row: wrk speaks HTTP/1.1 only, so there is no "wrk direct" row; instead h2load
#               (nghttp2-client, h2c, -c ceil(CONNECTIONS/MAX_STREAMS) -m MAX_STREAMS, i.e. the
#               same 400 streams in flight over 4 connections) hits the upstream directly, also
#               from core 0. It shows what the upstream+load core can do without a proxy and
#               without 400 HTTP/1.1 sockets; it is not comparable to the proxy rows.
#   Per target: a $WARMUP warm-up (opens the pools), then `wrk -t1 -c$CONNECTIONS -d$DURATION
#               --latency`. Reported: requests/s, latency p50/p99 (ms), errors (wrk socket
#               errors + non-2xx), the CPU the proxy process used during the measured run
#               (utime+stime from /proc/PID/stat, all threads) in seconds and microseconds per
#               request, busy share of both cores (/proc/stat; core 1's "other load" is what
#               was busy there besides the proxy, steal shown apart), and the proxy's ESTABLISHED TCP
#               connections to the upstream port: once in the middle of the run (`ss -Htnp state
#               established "( dport = :UPPORT )"`, only sockets owned by the proxy's pid), the
#               largest count over all samples (one every $SAMPLE_EVERY s) and how many distinct
#               connections (local ports) those samples saw during the run.
#
# Usage (from the repo root):   benches/vs_haproxy_h2.sh
#   env: DURATION (default 10s), CONNECTIONS (default 400), WARMUP (default 2s),
#        ROUNDS (default 1; the targets run in turn this many times), MAX_STREAMS (default 100),
#        SAMPLE_EVERY (default 0.5, seconds between connection samples),
#        CARGO_TARGET_DIR (default target/bench), SIDECAR_BIN (skip the build, use this binary).
# Installs haproxy, nghttp2-server (nghttpd), nghttp2-client (h2load) and wrk with apt-get if
# they are missing. Everything it writes at run time (configs, docroot, logs) lives in one
# mktemp directory, removed on exit together with every process it started. Numbers are
# reported, not asserted.

set -euo pipefail

DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-400}
WARMUP=${WARMUP:-2s}
ROUNDS=${ROUNDS:-1}
MAX_STREAMS=${MAX_STREAMS:-100}
SAMPLE_EVERY=${SAMPLE_EVERY:-0.5}

cd "$(dirname "$0")/.."
REPO=$(pwd)

# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

ensure_tools haproxy:haproxy nghttpd:nghttp2-server h2load:nghttp2-client wrk:wrk \
    taskset:util-linux python3:python3 curl:curl ss:iproute2
curl -V | grep -qi 'http2' || die "curl without HTTP/2 support (needed for the sanity check)"
((EUID == 0)) || log "not root: ss -p cannot see the proxies' sockets, connection counts will read 0"

# 400 client sockets + 400 proxy-side sockets + upstream ones, in one shell's children.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
(( $(ulimit -n) >= 2 * CONNECTIONS + 256 )) || die "open-file limit $(ulimit -n) too low for $CONNECTIONS connections"

build_sidecar
make_scratch egress-bench

read -r UP_PORT HAP_PORT FWD_PORT ADMIN_PORT ROUTE_PORT < <(free_ports 5)

# --- upstream: nghttpd, h2c prior knowledge, a 3-byte file as `/` ---------------------------
start_nghttpd "$UP_PORT" "$MAX_STREAMS"

# --- haproxy ----------------------------------------------------------------------------------
hap_streams_kw=$(hap_streams_keyword)
# maxconn sizes HAProxy's FD needs (about 2 per connection); keep it under our open-file limit.
HAP_MAXCONN=$(( ($(ulimit -n) - 200) / 2 ))
haproxy_conf haproxy "$HAP_PORT" "$HAP_MAXCONN" 60s "127.0.0.1:$UP_PORT proto h2" \
    "$hap_streams_kw $MAX_STREAMS" >"$TMP/haproxy.cfg"
start_haproxy haproxy "$PROXY_CPU"

# --- sidecar ----------------------------------------------------------------------------------
sidecar_h2_conf "$FWD_PORT" "$ADMIN_PORT" "$ROUTE_PORT" "$UP_PORT" "$MAX_STREAMS" >"$TMP/sidecar.yaml"
start_sidecar "$TMP/sidecar.yaml" "$PROXY_CPU"

for port in "$UP_PORT" "$HAP_PORT" "$FWD_PORT" "$ROUTE_PORT"; do wait_port "$port"; done
write_wrk_script

check upstream "http://127.0.0.1:$UP_PORT/" --http2-prior-knowledge
check haproxy "http://127.0.0.1:$HAP_PORT/"
check sidecar "http://127.0.0.1:$ROUTE_PORT/"

CLK_TCK=$(getconf CLK_TCK)
LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg)
DUR_S=$(secs_of "$DURATION")
ROWS=()

row() { # label requests duration_us p50_us p99_us errors pid dticks dbusy0 dbusy1 dsteal1 conncols
    awk -v l="$1" -v n="$2" -v d="$3" -v p50="$4" -v p99="$5" -v err="$6" -v pid="$7" \
        -v dt="$8" -v b0="$9" -v b1="${10}" -v st="${11}" -v cc="${12}" \
        -v hz="$CLK_TCK" -v round="$ROUND" 'BEGIN {
        secs = d / 1e6; cpu = dt / hz
        if (pid == "-") { c1 = "-"; c2 = "-" }
        else { c1 = sprintf("%.2f", cpu); c2 = sprintf("%.1f", cpu * 1e6 / n) }
        other = b1 / hz - cpu; if (other < 0) other = 0
        printf "| %s | %s | %.0f | %.2f | %.2f | %d | %s | %s | %.0f%% | %.0f%% (%.0f%%) | %s |",
            round, l, n / secs, p50 / 1000, p99 / 1000, err, c1, c2, 100 * b0 / hz / secs,
            100 * other / secs, 100 * st / hz / secs, cc }'
}

bench() { # label slug url pid
    local label=$1 slug=$2 url=$3 pid=$4
    log "$label: warm-up $WARMUP, then $DURATION with $CONNECTIONS connections"
    wrk_warm "$url" "$CONNECTIONS" "$WARMUP"
    local samples="$TMP/conns.$slug.$ROUND"
    start_sampler "$pid" "$UP_PORT" "$samples"
    wrk_measure "$url" "$CONNECTIONS" "$DURATION" "$pid" "$TMP/wrk.$slug.$ROUND.txt"
    stop_pid "$SAMPLER_PID"
    ROWS+=("$(row "$label" "$W_REQUESTS" "$W_DURATION_US" "$W_P50_US" "$W_P99_US" "$W_ERRORS" \
        "$pid" "$W_CPU" "$W_BUSY_LOAD" "$W_BUSY_PROXY" "$W_STEAL" "$(conn_cols "$samples" "$DUR_S")")")
}

# Reference: h2load straight to the upstream, same streams in flight, from core 0.
bench_h2load() {
    local label="h2load direct to upstream (reference)"
    local conns=$(( (CONNECTIONS + MAX_STREAMS - 1) / MAX_STREAMS ))
    log "$label: -c$conns -m$MAX_STREAMS, warm-up $WARMUP, then $DURATION"
    local b00 b01 b10 b11 st0 st1
    b00=$(core_busy "$LOAD_CPU"); b10=$(core_busy "$PROXY_CPU")
    st0=$(core_steal "$PROXY_CPU")
    h2load_measure "http://127.0.0.1:$UP_PORT/" "$conns" "$MAX_STREAMS" "$DURATION" "$WARMUP" "$TMP/h2load.$ROUND.txt"
    b01=$(core_busy "$LOAD_CPU"); b11=$(core_busy "$PROXY_CPU")
    st1=$(core_steal "$PROXY_CPU")
    # The busy ticks cover warm-up + run (one h2load call); scale them to the run's length.
    local dur_us
    dur_us=$(awk -v s="$DUR_S" 'BEGIN { printf "%d", s * 1e6 }')
    scaled() { awk -v b="$1" -v d="$DUR_S" -v w="$(secs_of "$WARMUP")" 'BEGIN { printf "%d", b * d / (d + w) }'; }
    ROWS+=("$(row "$label" "$H_DONE" "$dur_us" "$H_P50_US" "$H_P99_US" $((H_DONE - H_OK)) - 0 \
        "$(scaled $((b01 - b00)))" "$(scaled $((b11 - b10)))" "$(scaled $((st1 - st0)))" \
        "$conns (h2load -c) | - | -")")
}

for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    bench_h2load
    bench "haproxy (h1 -> h2)" haproxy "http://127.0.0.1:$HAP_PORT/" "$HAP_PID"
    bench "sidecar route mode (h1 -> h2)" sidecar "http://127.0.0.1:$ROUTE_PORT/" "$SC_PID"
done

# HAProxy's own count of connection attempts to s1 (cumulative since start, warm-ups included).
hap_connect=$(hap_server_stats haproxy connect reuse || true)

# --- report ----------------------------------------------------------------------------------
sc_threads=$(awk '/^Threads:/ {print $2}' "/proc/$SC_PID/status")
hap_threads=$(awk '/^Threads:/ {print $2}' "/proc/$HAP_PID/status")
sc_warns=$(grep -c . "$TMP/sidecar.log" || true)
cat <<EOF

## egress-sidecar vs HAProxy, HTTP/1.1 clients -> h2c upstream, $(date -u +%Y-%m-%dT%H:%MZ)

- sidecar: $("$BIN" --version) ($BIN), route mode, protocol: http2, pool max_connections 64 / max_pending 4096 / pending_timeout 30s, http2.max_streams_per_connection $MAX_STREAMS, TOKIO_WORKER_THREADS=1, $sc_threads threads, pinned to core $PROXY_CPU; $sc_warns line(s) in its log (EGRESS_LOG=warn)
- haproxy: $(haproxy -v | head -1 | sed 's/ - https.*//'), nbthread 1 ($hap_threads threads), \`server ... proto h2\`, \`http-reuse always\`, \`$hap_streams_kw $MAX_STREAMS\`, pinned to core $PROXY_CPU; its own stats for s1 since start (warm-ups included): connect=${hap_connect% *} reuse=${hap_connect#* }
- upstream: $(nghttpd --version | head -1), h2c prior knowledge, 1 worker, SETTINGS_MAX_CONCURRENT_STREAMS $MAX_STREAMS, 3-byte static file, pinned to core $LOAD_CPU
- wrk: $(wrk -v 2>&1 | head -1 | awk '{print $1, $2}'), -t1 -c$CONNECTIONS -d$DURATION --latency (after a $WARMUP warm-up), pinned to core $LOAD_CPU (shared with the upstream: with 2 cores that is the best split available)
- reference: $(h2load --version | head -1), -t1 -c$(( (CONNECTIONS + MAX_STREAMS - 1) / MAX_STREAMS )) -m$MAX_STREAMS -D $DURATION, pinned to core $LOAD_CPU
- host: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), kernel $(uname -r); load average before the runs: $LOADAVG

| round | target | req/s | p50 ms | p99 ms | errors | proxy CPU s | CPU µs/req | core $LOAD_CPU busy | other load on core $PROXY_CPU (steal) | upstream conns mid-run | max | distinct seen |
|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
$(printf '%s\n' "${ROWS[@]}")

errors = wrk socket errors (connect/read/write/timeout) + non-2xx responses (h2load: done - 2xx).
CPU = utime+stime of the proxy process (all threads) during the measured run.
core $LOAD_CPU busy = share of the run that core $LOAD_CPU (wrk + upstream + sampler) was busy: near 100%
means the load side, not the proxy, set the req/s. other load on core $PROXY_CPU = busy time of that
core (/proc/stat, IRQs and steal included) not charged to the proxy process, as a share of the
run; in brackets the steal part (the hypervisor ran something else on this vCPU). Anything well
above a few % means something competed with the proxy (on a shared dev machine: a build or test
run): its req/s and latency are then not comparable (CPU µs/req still is, roughly).
upstream conns = ESTABLISHED TCP connections owned by the proxy's pid to the upstream port
(ss -Htnp, sampled every ${SAMPLE_EVERY}s during the measured run): the sample nearest mid-run, the
largest sample, and distinct local ports across all samples (connections opened and closed
between two samples are missed).
EOF
