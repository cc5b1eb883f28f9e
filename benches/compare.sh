#!/usr/bin/env bash
# benches/compare.sh: egress-sidecar next to nginx and HAProxy (and the upstream directly), eight
# workloads, one table, from one run on one machine.
#
# Question answered:
#   Per request CPU and throughput, tail latency, what a leaky client costs, memory per idle
#   client connection, HTTP/1.1 and h2 upstreams over TLS, and memory for many hosts met on the
#   fly: where does the sidecar (the image's build and, given SIDECAR_PLAIN_BIN, the plain
#   build) stand against nginx and HAProxy configured as equivalent egress proxies? (issues 6,
#   25 and 47; their targets are printed as ratios and limits under the table)
#
# Targets (columns), each a fresh process per workload, alone on core PROXY_CPU (default 1):
#   direct  : no proxy, the client talks to the upstream (a reference; there the load generator
#             and the server share core LOAD_CPU).
#   sidecar : the image's build (deploy/pgo/build.sh, profile-guided; or SIDECAR_BIN),
#             in the image's environment (its GLIBC_TUNABLES: SIDECAR_TUNABLES),
#             TOKIO_WORKER_THREADS=1, EGRESS_LOG=warn, route-mode listener (origin-form, like the
#             peers' reverse proxies), pool max_connections = max_idle = POOL,
#             downstream.idle_timeout and max_connections as below.
#   sidecar-plain : only when SIDECAR_PLAIN_BIN is set: that binary (the plain
#             `cargo build --release`), configured and run as `sidecar` but with no tunables,
#             in every workload the sidecar runs in, in the same rounds.
#   nginx   : worker_processes 1 (master + worker counted), `upstream { server ... max_conns=POOL;
#             keepalive POOL; }`, proxy_http_version 1.1, `Connection ""`, keepalive_timeout as
#             the idle timeout, access_log off.
#   haproxy : nbthread 1, no master (-db), `http-reuse always` (idle server connections shared by
#             all client sessions: the pool), `server ... maxconn POOL pool-max-conn POOL`,
#             `timeout http-keep-alive` as the idle timeout, no logging.
#   Upstream for 1-3 and 5: nginx, 1 worker on LOAD_CPU (default 0), `return 200 "ok\n"`,
#   keepalive_timeout 300s, stub_status on a second port (its `accepts` counts upstream dials).
#
# Workloads (the load generators run on LOAD_CPU; WORKLOADS picks which run):
#   1. keep-alive throughput: wrk -t1 -c$CONNECTIONS, WARMUP then DURATION, ROUNDS rounds (targets
#      in turn, medians reported, and each round's value): requests/s, p99 and p99.9 (wrk's
#      histogram, printed by the wrk script's done() hook: --latency stops at p99), and the
#      proxy's CPU (utime+stime, /proc/PID/stat, process and children) per request, split into
#      kernel and user space; "busy" is the share of the run the proxy used its core, other
#      processes used that core (competition: that column's req/s is then not comparable), and
#      the load core was busy.
#   2. leaky client: tests/leaky/main.go (a new Go http.Transport per request, sequential, so its
#      concurrency is 1), LEAKY_REQUESTS requests, downstream idle timeout IDLE_TIMEOUT s for
#      every proxy. Upstream connections dialed (upstream `accepts` delta), the client's
#      ESTABLISHED sockets to the target (ss, by pid) when its requests end and IDLE_TIMEOUT+2 s
#      later, the proxy's upstream connections open when they end, and its peak RSS (VmHWM,
#      summed over master + workers).
#   3. idle memory: on a fresh process (idle timeout 300 s), benches/idle_memory.py idle-clients:
#      64 warm-up connections, RSS base, IDLE_CONNS keep-alive connections with one GET each,
#      held idle; RSS growth / connections held (ss). User-space RSS only (not kernel sockets).
#   4. HTTP/2 upstream: nghttpd h2c (MAX_STREAMS streams per connection), wrk -c$H2_CLIENTS
#      HTTP/1.1 through HAProxy (`proto h2`) and the sidecar (`protocol: http2`); direct = h2load
#      with the same streams in flight; nginx through `grpc_pass grpc://` (common.sh's
#      nginx_grpc_conf: it speaks h2c upstream but one stream per connection, keepalive POOL,
#      no cap: its upstream connections are counted as the others'). Then, on the
#      same processes, a second run for the tail under CONNECTIONS keep-alive clients (WARMUP,
#      then DURATION): requests/s, p99, p99.9, errors, CPU per request; direct = h2load with
#      CONNECTIONS streams in flight. The proxies run ROUNDS rounds (fresh processes, medians,
#      CPU per request of each round, kernel and user space at H2_CLIENTS); direct runs once. Issue 47's
#      h2c CPU target (item 1) compares with HAProxy's, its latency target (item 5) with nginx's.
#   5. memory return: RSS RETURN_WAIT s after workload 2's requests ended, against the same
#      process's RSS before the storm. It reads workload 2's storm: selecting either runs both.
#   6. HTTP/1.1 over TLS: the origin is nginx (1 worker on LOAD_CPU, `listen ... ssl`, `return
#      200 "ok\n"`, keepalive_timeout 300s, TLS session cache, stub_status in plain HTTP on a
#      second port) with a certificate for origin.bench and 127.0.0.1 (P-256) from a CA made
#      with openssl for the run in the scratch dir. Every proxy dials 127.0.0.1, sends SNI
#      origin.bench, verifies the certificate against that CA for that name, and pools POOL
#      connections: the sidecar `url: https://127.0.0.1:PORT`, `tls: { ca_file, server_name }`,
#      `protocol: http1`, pool max_connections = max_idle = POOL; nginx workload 1's pool with
#      `proxy_pass https://`, `proxy_ssl_verify on`, `proxy_ssl_trusted_certificate`,
#      `proxy_ssl_name`, `proxy_ssl_server_name on`, `proxy_ssl_session_reuse on`; HAProxy
#      `server ... ssl verify required ca-file CA sni str(origin.bench) verifyhost origin.bench
#      maxconn POOL pool-max-conn POOL`. Client idle timeout IDLE_TIMEOUT s. Run as workload 1
#      (wrk -c$CONNECTIONS, WARMUP then DURATION, ROUNDS rounds, fresh processes, medians): the
#      same figures, plus the TLS connections each run dialed (the origin's `accepts` delta
#      over start, warm-up and run; direct: wrk's own).
#   7. h2 over TLS: the origin is nghttpd with the same certificate (ALPN h2, MAX_STREAMS
#      streams per connection, 1 worker on LOAD_CPU); the sidecar `protocol: http2` with
#      workload 6's `tls` and workload 4's pool (max_pending 4096, pending_timeout 30s,
#      max_connections = max_idle = POOL, MAX_STREAMS streams); HAProxy `server ... ssl verify
#      required ca-file CA sni str(origin.bench) verifyhost origin.bench alpn h2 pool-max-conn
#      POOL` and workload 4's stream cap; nginx `grpc_pass grpcs://` verifying as in workload 6
#      (`grpc_ssl_verify`, `grpc_ssl_trusted_certificate`, `grpc_ssl_name`, `grpc_ssl_server_name`,
#      `grpc_ssl_session_reuse`), one stream per upstream connection, keepalive POOL.
#      wrk -c$CONNECTIONS as workload 6 (ROUNDS rounds, medians, client idle timeout
#      IDLE_TIMEOUT s for every proxy); direct = h2load with CONNECTIONS streams in flight.
#      Workload 6's figures, the upstream connections counted as workload 4's (largest ss
#      sample during the run) instead of dials.
#   8. many hosts: benches/many_hosts.py sends one request to each of MANY_HOSTS distinct hosts
#      (127.1.x.y: one upstream, listening on 0.0.0.0, on LOAD_CPU) in absolute form through a
#      forward proxy, 8 keep-alive clients taking turns, after 64 requests to one warm-up host;
#      RSS (process and children) at the start, every 500 hosts, every 10 s while the proxy's
#      upstream connections idle out (MANY_HOSTS_IDLE_WAIT s: the sidecar's pool idle_timeout is
#      30 s, then a host met on the fly is let go 10 s after its last request by a sweep every
#      5 s, and the heap is trimmed every 5 s) and, for the sidecars only, MANY_HOSTS_FORGET_WAIT s more (on-the-fly upstreams are
#      forgotten after 5 minutes unused). The sidecar: its forward listener and admin listener
#      only, every other setting its default (no memory budget); /debug/pools and /metrics
#      sizes after sending, after the idle-out and after forgetting, and its open upstream
#      connections after the idle-out (/metrics). nginx: `proxy_pass http://$http_host` (a
#      variable: no `upstream {}`, so no keep-alive pool, one upstream connection per request).
#      HAProxy: `http-request set-dst url_ip`, `set-dst-port url_port`, `set-uri %[pathq]`,
#      `server s 0.0.0.0:0`, `http-reuse always` (its idle connections, per destination, purged
#      by pool-purge-delay). Rows: RSS at the start, after the hosts, after the idle-out, growth
#      per host after the idle-out, after forgetting and its difference from the start; the
#      RSS curve of each target (hosts, seconds, MiB) is listed under the table.
#
# Usage (from the repo root):   benches/compare.sh
#   env: ROUNDS (3, of workloads 1, 4, 6 and 7), DURATION (10s), WARMUP (2s), CONNECTIONS (64),
#        POOL (64), LEAKY_REQUESTS (5000), IDLE_TIMEOUT (5, seconds), IDLE_CONNS (5000),
#        H2_CLIENTS (400), H2_DURATION (10s), MAX_STREAMS (100), RETURN_WAIT (30, seconds),
#        MANY_HOSTS (5000), MANY_HOSTS_IDLE_WAIT (60, seconds), MANY_HOSTS_FORGET_WAIT (330,
#        seconds; 0 skips that phase), WORKLOADS (1,2,3,4,5,6,7,8: the workloads to run; rows of
#        the others are absent), RESULTS (benches/RESULTS.md; empty: do not write it), PROXY_CPU
#        (1), LOAD_CPU (0), CARGO_TARGET_DIR (target/bench), SIDECAR_BIN (skip the build, use
#        this binary as the image's build), SIDECAR_TUNABLES (the image's build's GLIBC_TUNABLES:
#        the Dockerfile's by default), SIDECAR_PLAIN_BIN (the plain release build: adds the
#        sidecar-plain column and issue 47's plain-build targets; unset: no such column).
#   e.g.  SIDECAR_PLAIN_BIN=target/release/egress-sidecar WORKLOADS=6,7,8 benches/compare.sh
# Installs nginx, haproxy, wrk, nghttp2-client (h2load), nghttp2-server (nghttpd), golang-go and
# openssl with apt-get if missing. Prints the table to stdout and replaces the section between
# the compare.sh markers in RESULTS. Everything else it writes (configs, the CA and keys, logs)
# lives in one mktemp directory, removed on exit with every process it started. Numbers are
# reported, not asserted. Workloads 6-8 live in benches/compare_upstreams.sh.

set -euo pipefail

DURATION=${DURATION:-10s}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-2s}
CONNECTIONS=${CONNECTIONS:-64}
POOL=${POOL:-64}
LEAKY_REQUESTS=${LEAKY_REQUESTS:-5000}
IDLE_TIMEOUT=${IDLE_TIMEOUT:-5}
IDLE_CONNS=${IDLE_CONNS:-5000}
IDLE_BOUND= # empty: the sidecar's default idle bounds (workload 3 lifts them)
H2_CLIENTS=${H2_CLIENTS:-400}
H2_DURATION=${H2_DURATION:-10s}
MAX_STREAMS=${MAX_STREAMS:-100}
RETURN_WAIT=${RETURN_WAIT:-30}
MANY_HOSTS=${MANY_HOSTS:-5000}
MANY_HOSTS_IDLE_WAIT=${MANY_HOSTS_IDLE_WAIT:-60}
MANY_HOSTS_FORGET_WAIT=${MANY_HOSTS_FORGET_WAIT:-330}
WORKLOADS=${WORKLOADS:-1,2,3,4,5,6,7,8}
[[ $WORKLOADS =~ ^[1-8](,[1-8])*$ ]] || { echo "WORKLOADS: a comma-separated list of 1-8, not ${WORKLOADS@Q}" >&2; exit 2; }

cd "$(dirname "$0")/.."
REPO=$(pwd)
RESULTS=${RESULTS-$REPO/benches/RESULTS.md}

# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"
# shellcheck source=benches/compare_upstreams.sh
source "$REPO/benches/compare_upstreams.sh"

# Whether workload N is in WORKLOADS.
wants() { [[ ,$WORKLOADS, == *,$1,* ]]; }

ensure_tools nginx:nginx haproxy:haproxy wrk:wrk h2load:nghttp2-client nghttpd:nghttp2-server \
    go:golang-go taskset:util-linux python3:python3 curl:curl ss:iproute2 openssl:openssl
((EUID == 0)) || log "not root: ss -p cannot see other processes' sockets, connection counts will read 0"

# Client connections any proxy must hold at once, and the file descriptors that takes.
MAXCONN=$(( (IDLE_CONNS > LEAKY_REQUESTS ? IDLE_CONNS : LEAKY_REQUESTS) + H2_CLIENTS + 1000 ))
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
(( $(ulimit -n) >= 2 * MAXCONN + 256 )) || die "open-file limit $(ulimit -n) too low for $MAXCONN connections"

build_sidecar
PLAIN_BIN=${SIDECAR_PLAIN_BIN:-}
[[ -z $PLAIN_BIN || -x $PLAIN_BIN ]] || die "no sidecar binary at SIDECAR_PLAIN_BIN=$PLAIN_BIN"
make_scratch egress-compare

if wants 2 || wants 5; then
    log "building the leaky Go client (tests/leaky/main.go)"
    CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS= GOWORK=off go build -o "$TMP/leaky" tests/leaky/main.go
fi

CLK_TCK=$(getconf CLK_TCK)
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
STARTED=$(date -u +%Y-%m-%dT%H:%MZ)
# sidecar: the image's build (BIN); sidecar-plain: SIDECAR_PLAIN_BIN's, when given.
SIDECARS=(sidecar)
[[ -z $PLAIN_BIN ]] || SIDECARS+=(sidecar-plain)
PROXIES=("${SIDECARS[@]}" nginx haproxy)
TARGETS=(direct "${PROXIES[@]}")
sidecar_bin() { if [[ $1 == sidecar-plain ]]; then echo "$PLAIN_BIN"; else echo "$BIN"; fi; }
write_wrk_script

CURVES=() # workload 8's RSS curves, one line per target

# Row labels, by workload (a row names its workload first: the table is sorted by it).
W1="1 keep-alive, $CONNECTIONS conns:"
W2="2 leaky client, $LEAKY_REQUESTS requests:"
W3="3 idle memory, $IDLE_CONNS idle clients:"
W4="4 h2 upstream, $H2_CLIENTS clients:"
W4L="4 h2 upstream, $CONNECTIONS clients (a second run):"
W5="5 memory return:"
W6="6 h1 over TLS upstream, $CONNECTIONS conns:"
W7="7 h2 over TLS upstream, $CONNECTIONS clients:"
W8="8 many hosts, $MANY_HOSTS hosts:"

# === the table: M[row|target] = cell, rows in ROWS order ===

declare -A M
ROWS=()
put() { # row target value
    [[ -n ${M["$1|_"]:-} ]] || { ROWS+=("$1"); M["$1|_"]=1; }
    M["$1|$2"]=$3
}
calc() { awk "BEGIN { printf $1 }"; } # printf-format-and-args
mib() { calc "\"%.1f\", $1 / 1024"; }  # KiB -> MiB
sleep_until() { # epoch seconds (fractional)
    sleep "$(awk -v t="$1" -v now="$(date +%s.%N)" 'BEGIN { d = t - now; printf "%f", (d > 0 ? d : 0) }')"
}

# === upstream (workloads 1-3, 5) ===

read -r UP_PORT STATUS_PORT < <(free_ports 2)
if wants 1 || wants 2 || wants 3 || wants 5; then
    nginx_upstream_conf upstream "$UP_PORT" "$STATUS_PORT" >"$TMP/upstream.conf"
    start_nginx upstream "$LOAD_CPU"
    wait_port "$UP_PORT"
    check upstream "http://127.0.0.1:$UP_PORT/"
fi

# Connections the upstream has accepted so far (this query's own included).
upstream_accepts() {
    curl -sS --max-time 5 "http://127.0.0.1:$STATUS_PORT/" | awk 'NR == 3 { print $1 }'
}

# === the targets ===

# Starts TARGET fresh with a client idle timeout of IDLE seconds; sets T_PID ("-" for direct)
# and T_PORT, and checks that it answers (one request, so a proxy's pool has one connection).
start_target() { # target idle-seconds
    local fwd admin
    case $1 in
    direct) T_PID=- T_PORT=$UP_PORT; return ;; # already checked, and no connection more to count
    sidecar | sidecar-plain)
        read -r fwd admin T_PORT < <(free_ports 3)
        sidecar_conf "$fwd" "$admin" "$T_PORT" "$UP_PORT" "$POOL" "${2}s" "$MAXCONN" "$IDLE_BOUND" >"$TMP/$1.yaml"
        start_sidecar "$TMP/$1.yaml" "$PROXY_CPU" "$(sidecar_bin "$1")"
        T_PID=$SC_PID ;;
    nginx)
        read -r T_PORT < <(free_ports 1)
        nginx_proxy_conf nginx "$T_PORT" "$UP_PORT" "$POOL" "${2}s" $((MAXCONN + POOL + 64)) >"$TMP/nginx.conf"
        start_nginx nginx "$PROXY_CPU"
        T_PID=$NGINX_PID ;;
    haproxy)
        read -r T_PORT < <(free_ports 1)
        haproxy_conf haproxy "$T_PORT" "$MAXCONN" "${2}s" \
            "127.0.0.1:$UP_PORT maxconn $POOL pool-max-conn $POOL" >"$TMP/haproxy.cfg"
        start_haproxy haproxy "$PROXY_CPU"
        T_PID=$HAP_PID ;;
    esac
    wait_port "$T_PORT"
    check "$1" "http://127.0.0.1:$T_PORT/"
}

stop_target() {
    [[ $T_PID == - ]] || stop_pid "$T_PID"
}

# === workload 1: keep-alive throughput ===

# Share of measured runs that the proxy used its core, that other processes used that core (a
# shared machine: then the column's req/s is not comparable), and that the load core was busy
# (near 100%: the load side, not the proxy, set the pace).
BUSY="busy: proxy / others on its core / load core"
busy_cell() { # proxy-ticks proxy-core-busy-ticks load-core-busy-ticks run-seconds
    awk -v cpu="$1" -v bp="$2" -v bl="$3" -v hz="$CLK_TCK" -v s="$4" 'BEGIN {
        other = bp - cpu; if (other < 0) other = 0
        printf "%.0f%% / %.0f%% / %.0f%%", 100 * cpu / hz / s, 100 * other / hz / s, 100 * bl / hz / s }'
}
median() { # printf-format numbers...
    local fmt=$1
    shift
    printf '%s\n' "$@" | sort -g | awk -v f="$fmt" '{ v[NR] = $1 }
        END { printf f, (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'
}

# TR[workload|figure|target]: one value per round, space-separated (errors: a sum), from the
# last wrk_measure; CPU figures for the proxies only.
declare -A TR
record_round() { # workload target
    local w=$1 t=$2 secs
    secs=$(calc "\"%f\", $W_DURATION_US / 1e6")
    TR[$w|rps|$t]+=" $(calc "\"%.0f\", $W_REQUESTS / $secs")"
    TR[$w|p99|$t]+=" $(calc "\"%.2f\", $W_P99_US / 1000")"
    TR[$w|p999|$t]+=" $(calc "\"%.2f\", $W_P999_US / 1000")"
    TR[$w|err|$t]=$(( ${TR[$w|err|$t]:-0} + W_ERRORS ))
    [[ $t != direct ]] || return 0
    TR[$w|cpu|$t]+=" $(calc "\"%.1f\", $W_CPU / $CLK_TCK * 1e6 / $W_REQUESTS")"
    TR[$w|sys|$t]+=" $(calc "\"%.1f\", $W_SYS / $CLK_TCK * 1e6 / $W_REQUESTS")"
    TR[$w|usr|$t]+=" $(calc "\"%.2f\", ($W_CPU - $W_SYS) / $CLK_TCK * 1e6 / $W_REQUESTS")"
    local a b c d
    read -r a b c d <<<"${TR[$w|ticks|$t]:-0 0 0 0}"
    TR[$w|ticks|$t]="$((a + W_CPU)) $((b + W_BUSY_PROXY)) $((c + W_BUSY_LOAD)) $(calc "\"%f\", $d + $secs")"
}

# "a · b · c" from a round list " a b c".
each() { sed 's/^ //; s/ / · /g' <<<"$1"; }

# ROUNDS rounds, the targets in turn within each (drift on a shared VM spreads over all of them);
# each run on a fresh process. The table shows medians over the rounds and every round's value.
if wants 1; then
    for ((round = 1; round <= ROUNDS; round++)); do
        for t in "${TARGETS[@]}"; do
            log "workload 1, round $round/$ROUNDS, $t: warm-up $WARMUP, then $DURATION with $CONNECTIONS connections"
            start_target "$t" "$IDLE_TIMEOUT"
            url="http://127.0.0.1:$T_PORT/"
            wrk_warm "$url" "$CONNECTIONS" "$WARMUP"
            wrk_measure "$url" "$CONNECTIONS" "$DURATION" "$T_PID" "$TMP/w1.$t.$round.txt"
            record_round 1 "$t"
            stop_target
        done
    done
    for t in "${TARGETS[@]}"; do
        # shellcheck disable=SC2086 # the per-round lists split into words on purpose
        {
            put "$W1 requests/s (median)" "$t" "$(median %.0f ${TR[1|rps|$t]})"
            ((ROUNDS == 1)) || put "$W1 requests/s, each round" "$t" "$(each "${TR[1|rps|$t]}")"
            put "$W1 p99 latency (ms, median)" "$t" "$(median %.2f ${TR[1|p99|$t]})"
            put "$W1 p99.9 latency (ms, median)" "$t" "$(median %.2f ${TR[1|p999|$t]})"
            put "$W1 errors (all rounds)" "$t" "${TR[1|err|$t]}"
            [[ $t != direct ]] || continue
            put "$W1 proxy CPU µs/request (median)" "$t" "$(median %.1f ${TR[1|cpu|$t]})"
            ((ROUNDS == 1)) || put "$W1 proxy CPU µs/request, each round" "$t" "$(each "${TR[1|cpu|$t]}")"
            # The kernel's part (stime): what trimming our own code cannot reach.
            put "$W1 of which in the kernel (µs/request, median)" "$t" "$(median %.1f ${TR[1|sys|$t]})"
            # User space, each round's own (not the difference of two rounded medians): the part
            # that is ours to trim. The kernel splits a process's CPU time by sampling at its tick,
            # so a 10 s round's figure is good to a few percent.
            put "$W1 in user space (µs/request, median)" "$t" "$(median %.2f ${TR[1|usr|$t]})"
            ((ROUNDS == 1)) || put "$W1 in user space µs/request, each round" "$t" "$(each "${TR[1|usr|$t]}")"
            put "$W1 $BUSY" "$t" "$(busy_cell ${TR[1|ticks|$t]})"
        }
    done
fi

# === workloads 2 and 5: the leaky client, then memory return ===

# A field of one JSON line the leaky client printed.
leaky_field() { # file phase field
    python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["phase"] == sys.argv[2]: print(r.get(sys.argv[3], ""))' "$@"
}

if wants 2 || wants 5; then
    for t in "${TARGETS[@]}"; do
        log "workload 2, $t: $LEAKY_REQUESTS requests from the leaky client, idle timeout ${IDLE_TIMEOUT}s"
        # Counted from before the start: the connection the start's check dials is the proxy's too.
        accepts0=$(upstream_accepts)
        start_target "$t" "$IDLE_TIMEOUT"
        [[ $t == direct ]] || rss_before=$(status_kib "$T_PID" VmRSS)
        out="$TMP/leaky.$t.out"
        taskset -c "$LOAD_CPU" "$TMP/leaky" -n "$LEAKY_REQUESTS" -url "http://127.0.0.1:$T_PORT/" \
            -wait "$((IDLE_TIMEOUT + 3))s" >"$out" 2>"$TMP/leaky.$t.err" &
        leaky_pid=$!
        PIDS+=("$leaky_pid")
        until grep -qs '"after_requests"' "$out"; do
            kill -0 "$leaky_pid" 2>/dev/null || die "leaky client ($t) exited early: $(cat "$TMP/leaky.$t.err")"
            sleep 0.1
        done
        ended=$(date +%s.%N)
        open_end=$(established_by "$leaky_pid" "$T_PORT" | wc -l)
        [[ $t == direct ]] || up_end=$(established_by "$T_PID" "$UP_PORT" | wc -l)
        sleep_until "$(calc "\"%f\", $ended + $IDLE_TIMEOUT + 2")"
        open_after=$(established_by "$leaky_pid" "$T_PORT" | wc -l)
        accepts1=$(upstream_accepts)
        put "$W2 requests ok / failed" "$t" \
            "$(leaky_field "$out" after_requests ok) / $(leaky_field "$out" after_requests errors)"
        put "$W2 storm duration (s)" "$t" "$(calc "\"%.1f\", $(leaky_field "$out" after_requests elapsed_ms) / 1000")"
        # The second stub_status query is itself one accepted connection.
        put "$W2 upstream connections dialed" "$t" $((accepts1 - accepts0 - 1))
        put "$W2 client conns open at storm end" "$t" "$open_end"
        put "$W2 client conns open ${IDLE_TIMEOUT}+2 s later" "$t" "$open_after"
        [[ $t == direct ]] || put "$W2 upstream conns open at storm end" "$t" "$up_end"
        stop_pid "$leaky_pid"
        if [[ $t != direct ]]; then
            put "$W2 proxy peak RSS (VmHWM, MiB)" "$t" "$(mib "$(status_kib "$T_PID" VmHWM)")"
            sleep_until "$(calc "\"%f\", $ended + $RETURN_WAIT")"
            rss_after=$(status_kib "$T_PID" VmRSS)
            put "$W5 RSS before the storm (MiB)" "$t" "$(mib "$rss_before")"
            put "$W5 RSS ${RETURN_WAIT} s after the storm (MiB)" "$t" "$(mib "$rss_after")"
            put "$W5 after / before" "$t" "$(calc "\"%.2fx\", $rss_after / $rss_before")"
        fi
        stop_target
    done
fi

# === workload 3: idle memory ===

# Measured per connection, so the sidecar keeps them all like its peers do: its default
# max_idle_connections (1024) would close the rest, and its leak detector flags 5000 one-request
# connections from one address and gives them leaky_idle_timeout (1 s). Workload 2 runs with
# both defaults.
if wants 3; then
    IDLE_BOUND=$MAXCONN
    for t in "${PROXIES[@]}"; do
        log "workload 3, $t: $IDLE_CONNS idle keep-alive client connections on a fresh process"
        start_target "$t" 300
        line=$(taskset -c "$LOAD_CPU" python3 "$REPO/benches/idle_memory.py" idle-clients \
            --pid "$T_PID" --port "$T_PORT" --count "$IDLE_CONNS" | grep '^RESULT ') || die "idle-clients ($t) failed"
        eval "$(sed 's/^RESULT //; s/ /\n/g' <<<"$line" | sed 's/^/r_/')"
        # shellcheck disable=SC2154 # r_* come from the eval above
        put "$W3 RSS base (MiB)" "$t" "$(calc "\"%.1f\", $r_base / 1048576")"
        put "$W3 RSS growth per idle client conn (B)" "$t" "$r_per"
        put "$W3 idle client conns held / failed" "$t" "$r_held / $r_failed"
        stop_target
    done
    IDLE_BOUND=
fi

# === workload 4: HTTP/2 upstream ===

if wants 4; then
    read -r H2_PORT < <(free_ports 1)
    start_nghttpd "$H2_PORT" "$MAX_STREAMS"
    wait_port "$H2_PORT"
    check nghttpd "http://127.0.0.1:$H2_PORT/" --http2-prior-knowledge
    h2_conns=$(( (H2_CLIENTS + MAX_STREAMS - 1) / MAX_STREAMS ))
    log "workload 4, direct: h2load -c$h2_conns -m$MAX_STREAMS, warm-up $WARMUP, then $H2_DURATION"
    h2load_measure "http://127.0.0.1:$H2_PORT/" "$h2_conns" "$MAX_STREAMS" "$H2_DURATION" "$WARMUP" "$TMP/h2load.txt"
    put "$W4 requests/s" direct "$(calc "\"%.0f\", $H_DONE / $(secs_of "$H2_DURATION")")"
    put "$W4 proxy CPU µs/request" direct -
    put "$W4 errors" direct $((H_DONE - H_OK))
    put "$W4 upstream connections (max seen)" direct "$h2_conns"
    # Put once the proxies' rows are in (rows keep the order they first appear in).
    direct_p99=("$(calc "\"%.2f\", $H_P99_US / 1000")" "$(calc "\"%.2f\", $H_P999_US / 1000")")
    # The tail under CONNECTIONS keep-alive clients (issue 47, item 5): a second run on the same
    # processes, after the one above (whose figures it leaves as they were).
    log "workload 4, direct, $CONNECTIONS clients: h2load, warm-up $WARMUP, then $DURATION"
    h2_direct "http://127.0.0.1:$H2_PORT/" "$CONNECTIONS" "$DURATION" "$TMP/h2load-lat.txt"
    direct_lat=("$(calc "\"%.0f\", $W_REQUESTS / $W_DURATION_US * 1e6")" "$(calc "\"%.2f\", $W_P99_US / 1000")" \
        "$(calc "\"%.2f\", $W_P999_US / 1000")" "$W_ERRORS")
    hap_streams_kw=$(hap_streams_keyword)
    h2_targets=("${PROXIES[@]}")
    # ROUNDS rounds, the proxies in turn within each, a fresh process each time, as workload 1:
    # one run of a few seconds on a shared VM moved a proxy's CPU per request by 20%.
    for ((round = 1; round <= ROUNDS; round++)); do
        for t in "${h2_targets[@]}"; do
            log "workload 4, round $round/$ROUNDS, $t: warm-up $WARMUP, then $H2_DURATION with $H2_CLIENTS connections"
            if [[ $t == sidecar* ]]; then
                read -r fwd admin T_PORT < <(free_ports 3)
                sidecar_h2_conf "$fwd" "$admin" "$T_PORT" "$H2_PORT" "$MAX_STREAMS" >"$TMP/$t-h2.yaml"
                start_sidecar "$TMP/$t-h2.yaml" "$PROXY_CPU" "$(sidecar_bin "$t")"
                T_PID=$SC_PID
            elif [[ $t == nginx ]]; then
                read -r T_PORT < <(free_ports 1)
                nginx_grpc_conf nginx-h2 "$T_PORT" "$H2_PORT" "$POOL" 60s $((MAXCONN + 2 * H2_CLIENTS)) \
                    >"$TMP/nginx-h2.conf"
                start_nginx nginx-h2 "$PROXY_CPU"
                T_PID=$NGINX_PID
            else
                read -r T_PORT < <(free_ports 1)
                haproxy_conf haproxy-h2 "$T_PORT" "$MAXCONN" 60s "127.0.0.1:$H2_PORT proto h2" \
                    "$hap_streams_kw $MAX_STREAMS" >"$TMP/haproxy-h2.cfg"
                start_haproxy haproxy-h2 "$PROXY_CPU"
                T_PID=$HAP_PID
            fi
            wait_port "$T_PORT"
            check "$t" "http://127.0.0.1:$T_PORT/"
            url="http://127.0.0.1:$T_PORT/"
            wrk_warm "$url" "$H2_CLIENTS" "$WARMUP"
            start_sampler "$T_PID" "$H2_PORT" "$TMP/h2conns.$t.$round"
            wrk_measure "$url" "$H2_CLIENTS" "$H2_DURATION" "$T_PID" "$TMP/w4.$t.$round.txt"
            stop_pid "$SAMPLER_PID"
            record_round 4 "$t"
            TR[4|conns|$t]+=" $(awk '$2 > m { m = $2 } END { print m + 0 }' "$TMP/h2conns.$t.$round")"
            log "workload 4, round $round/$ROUNDS, $t, $CONNECTIONS clients: warm-up $WARMUP, then $DURATION"
            wrk_warm "$url" "$CONNECTIONS" "$WARMUP"
            wrk_measure "$url" "$CONNECTIONS" "$DURATION" "$T_PID" "$TMP/w4lat.$t.$round.txt"
            record_round 4L "$t"
            stop_target
        done
    done
    # Medians under the rows' old names (the targets below read them), each round's value beside.
    for t in "${h2_targets[@]}"; do
        # shellcheck disable=SC2086 # the per-round lists split into words on purpose
        {
            put "$W4 requests/s" "$t" "$(median %.0f ${TR[4|rps|$t]})"
            put "$W4 proxy CPU µs/request" "$t" "$(median %.1f ${TR[4|cpu|$t]})"
            ((ROUNDS == 1)) || put "$W4 proxy CPU µs/request, each round" "$t" "$(each "${TR[4|cpu|$t]}")"
            put "$W4 of which in the kernel (µs/request, median)" "$t" "$(median %.1f ${TR[4|sys|$t]})"
            put "$W4 in user space (µs/request, median)" "$t" "$(median %.2f ${TR[4|usr|$t]})"
            put "$W4 errors" "$t" "${TR[4|err|$t]}"
            put "$W4 $BUSY" "$t" "$(busy_cell ${TR[4|ticks|$t]})"
            put "$W4 upstream connections (max seen)" "$t" "$(median %.0f ${TR[4|conns|$t]})"
            put "$W4 p99 latency (ms)" "$t" "$(median %.2f ${TR[4|p99|$t]})"
            put "$W4 p99.9 latency (ms)" "$t" "$(median %.2f ${TR[4|p999|$t]})"
            put "$W4L requests/s" "$t" "$(median %.0f ${TR[4L|rps|$t]})"
            put "$W4L p99 latency (ms)" "$t" "$(median %.2f ${TR[4L|p99|$t]})"
            ((ROUNDS == 1)) || put "$W4L p99 latency (ms), each round" "$t" "$(each "${TR[4L|p99|$t]}")"
            put "$W4L p99.9 latency (ms)" "$t" "$(median %.2f ${TR[4L|p999|$t]})"
            put "$W4L errors" "$t" "${TR[4L|err|$t]}"
            put "$W4L proxy CPU µs/request" "$t" "$(median %.1f ${TR[4L|cpu|$t]})"
            ((ROUNDS == 1)) || put "$W4L proxy CPU µs/request, each round" "$t" "$(each "${TR[4L|cpu|$t]}")"
        }
    done
    put "$W4 p99 latency (ms)" direct "${direct_p99[0]}"
    put "$W4 p99.9 latency (ms)" direct "${direct_p99[1]}"
    put "$W4L requests/s" direct "${direct_lat[0]}"
    put "$W4L p99 latency (ms)" direct "${direct_lat[1]}"
    put "$W4L p99.9 latency (ms)" direct "${direct_lat[2]}"
    put "$W4L errors" direct "${direct_lat[3]}"
    stop_pid "$NGHTTPD_PID"
fi

# === workloads 6-8 (benches/compare_upstreams.sh) ===

! wants 6 || workload6
! wants 7 || workload7
! wants 8 || workload8

# === report ===

cell() { echo "${M["$1|$2"]:--}"; }
num() { sed 's/[^0-9.].*//' <<<"$(cell "$1" "$2")"; }

# One line per issue target: name, the numbers, met/missed.
verdict() { # text ok(1/0)
    if [[ $2 == 1 ]]; then echo "- met: $1"; else echo "- missed: $1"; fi
}
ratio_line() { # label row-of-sidecar row-of-peer peer op limit [sidecar column]
    local s p r ok who=${7:-sidecar}
    s=$(num "$2" "$who"); p=$(num "$3" "$4")
    if [[ -z $s || -z $p || $p == 0 ]]; then echo "- not measured: $1"; return; fi
    r=$(calc "\"%.2f\", $s / $p")
    ok=$(awk -v r="$r" -v l="$6" -v op="$5" 'BEGIN { print (op == "<=" ? r <= l : r >= l) ? 1 : 0 }')
    verdict "$1: $who $s vs $4 $p = ${r}x (target $5 $6x)" "$ok"
}

# A target on one figure: met when VALUE <= LIMIT; "not measured" when the value is absent.
limit_line() { # label value limit text
    if [[ -z $2 ]]; then echo "- not measured: $1"; return; fi
    verdict "$1: $4" "$(awk -v v="$2" -v l="$3" 'BEGIN { print (v <= l) ? 1 : 0 }')"
}

targets_report() {
    ratio_line "CPU per proxied request (workload 1, medians)" "$W1 proxy CPU µs/request (median)" \
        "$W1 proxy CPU µs/request (median)" nginx "<=" 0.8
    ratio_line "keep-alive requests/s (workload 1, medians)" "$W1 requests/s (median)" "$W1 requests/s (median)" \
        nginx ">=" 1.1
    ratio_line "memory per idle client connection (workload 3)" "$W3 RSS growth per idle client conn (B)" \
        "$W3 RSS growth per idle client conn (B)" nginx "<=" 1.0
    local base back dialed
    base=$(num "$W3 RSS base (MiB)" sidecar)
    limit_line "RSS base (workload 3)" "$base" 5 "${base} MiB (target <= 5 MiB)"
    back=$(num "$W5 after / before" sidecar)
    limit_line "RSS ${RETURN_WAIT} s after the leaky storm (workload 5)" "$back" 1.5 \
        "${back}x the RSS before it (target <= 1.5x)"
    dialed=$(num "$W2 upstream connections dialed" sidecar)
    limit_line "upstream connections in workload 2" "$dialed" 1 \
        "$dialed for a client of concurrency 1 (target <= 1)"
}

# Issue 25's targets that this run measures: CPU per keep-alive request against the better
# of nginx and HAProxy, user space against nginx, req/s against nginx, and HTTP/1.1 clients
# through an h2c upstream against HAProxy.
issue25_report() {
    local cpu="$W1 proxy CPU µs/request (median)" better
    better=$(awk -v n="$(num "$cpu" nginx)" -v h="$(num "$cpu" haproxy)" \
        'BEGIN { print (h != "" && (n == "" || h < n)) ? "haproxy" : "nginx" }')
    ratio_line "keep-alive CPU per request, against the better peer (workload 1, medians)" "$cpu" "$cpu" \
        "$better" "<=" 0.95
    ratio_line "keep-alive user-space CPU per request (workload 1, medians)" \
        "$W1 in user space (µs/request, median)" "$W1 in user space (µs/request, median)" nginx "<=" 0.8
    ratio_line "keep-alive requests/s (workload 1, medians)" "$W1 requests/s (median)" "$W1 requests/s (median)" \
        nginx ">=" 1.0
    ratio_line "CPU per request through an h2c upstream (workload 4)" "$W4 proxy CPU µs/request" \
        "$W4 proxy CPU µs/request" haproxy "<=" 1.0
}

# Issue 47's targets that this run measures, for each sidecar column: sidecar = the image's
# build (profile-guided), sidecar-plain = the plain release build (SIDECAR_PLAIN_BIN).
issue47_report() {
    local who lim cpu better grow back row
    for who in "${SIDECARS[@]}"; do
        if [[ $who == sidecar ]]; then lim=0.85; else lim=0.95; fi
        ratio_line "item 1, CPU per request through an h2c upstream, $(build_of "$who") (workload 4)" \
            "$W4 proxy CPU µs/request" "$W4 proxy CPU µs/request" haproxy "<=" "$lim" "$who"
        ratio_line "item 1, CPU per request through an h2 upstream over TLS, $(build_of "$who") (workload 7, medians)" \
            "$W7 proxy CPU µs/request (median)" "$W7 proxy CPU µs/request (median)" haproxy "<=" "$lim" "$who"
    done
    if [[ -n $PLAIN_BIN ]]; then
        cpu="$W1 proxy CPU µs/request (median)"
        better=$(awk -v n="$(num "$cpu" nginx)" -v h="$(num "$cpu" haproxy)" \
            'BEGIN { print (h != "" && (n == "" || h < n)) ? "haproxy" : "nginx" }')
        ratio_line "item 2, keep-alive CPU per request, plain build, against the better peer (workload 1, medians)" \
            "$cpu" "$cpu" "$better" "<=" 0.95 sidecar-plain
        ratio_line "item 2, keep-alive user-space CPU per request, plain build (workload 1, medians)" \
            "$W1 in user space (µs/request, median)" "$W1 in user space (µs/request, median)" nginx "<=" 0.8 sidecar-plain
    fi
    for who in "${SIDECARS[@]}"; do
        grow=$(num "$W8 growth per host after idle-out (B)" "$who")
        limit_line "item 4, RSS growth per host once connections idled out, $(build_of "$who") (workload 8)" "$grow" 2048 \
            "$grow B (target <= 2048 B)"
        ((MANY_HOSTS_FORGET_WAIT)) || continue
        back=$(cell "$W8 forgotten - start (MiB)" "$who")
        [[ $back =~ ^-?[0-9.]+$ ]] || back=
        limit_line "item 4, RSS once the hosts are forgotten, $(build_of "$who") (workload 8)" \
            "$back" 2 "${back} MiB from the start (target within 2 MiB)"
    done
    for who in "${SIDECARS[@]}"; do
        for row in "p99 latency" "p99.9 latency"; do
            ratio_line "item 5, HTTP/1.1 upstream $row, $CONNECTIONS keep-alive clients, $(build_of "$who") (workload 1, medians)" \
                "$W1 $row (ms, median)" "$W1 $row (ms, median)" nginx "<=" 1.0 "$who"
        done
        for row in "p99 latency" "p99.9 latency"; do
            ratio_line "item 5, h2c upstream $row, $CONNECTIONS keep-alive clients, $(build_of "$who") (workload 4, second run)" \
                "$W4L $row (ms)" "$W4L $row (ms)" nginx "<=" 1.0 "$who"
        done
        # Not the item's target (it names nginx): HAProxy multiplexes, as the sidecar does.
        for row in "p99 latency" "p99.9 latency"; do
            ratio_line "beside item 5, h2c upstream $row against HAProxy, $(build_of "$who") (workload 4, second run)" \
                "$W4L $row (ms)" "$W4L $row (ms)" haproxy "<=" 1.0 "$who"
        done
    done
}
build_of() { if [[ $1 == sidecar ]]; then echo "image's build"; else echo "plain build"; fi; }

report() {
    local row t builds="sidecar = the image's build, sidecar-plain = the plain release build"
    [[ -n $PLAIN_BIN ]] ||
        builds="sidecar = the image's build; no SIDECAR_PLAIN_BIN, so no plain build: item 2 and its other lines are left out"
    cat <<EOF
## Comparison: egress-sidecar vs nginx vs HAProxy ($STARTED)

Command: \`benches/compare.sh\` (ROUNDS=$ROUNDS DURATION=$DURATION WARMUP=$WARMUP CONNECTIONS=$CONNECTIONS POOL=$POOL
LEAKY_REQUESTS=$LEAKY_REQUESTS IDLE_TIMEOUT=$IDLE_TIMEOUT IDLE_CONNS=$IDLE_CONNS H2_CLIENTS=$H2_CLIENTS
H2_DURATION=$H2_DURATION MAX_STREAMS=$MAX_STREAMS RETURN_WAIT=$RETURN_WAIT MANY_HOSTS=$MANY_HOSTS
MANY_HOSTS_IDLE_WAIT=$MANY_HOSTS_IDLE_WAIT MANY_HOSTS_FORGET_WAIT=$MANY_HOSTS_FORGET_WAIT WORKLOADS=$WORKLOADS$([[ -z $PLAIN_BIN ]] || echo " SIDECAR_PLAIN_BIN=…"))

- machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), kernel $(uname -r);
  load average before the run $LOAD_BEFORE, after $(cut -d' ' -f1-3 /proc/loadavg)
- sidecar: $("$BIN" --version), commit $(git -C "$REPO" rev-parse --short HEAD)$(git -C "$REPO" diff --quiet HEAD -- src Cargo.toml Cargo.lock || echo " plus uncommitted changes"), $(rustc --version)$([[ -z ${SIDECAR_BIN:-} ]] || echo "; binary $BIN"), GLIBC_TUNABLES=${SIDECAR_TUNABLES:-(none)}
$([[ -z $PLAIN_BIN ]] || echo "- sidecar-plain (the plain release build): $("$PLAIN_BIN" --version), binary $PLAIN_BIN")
- nginx: $(nginx -v 2>&1 | sed 's/^nginx version: //'); haproxy: $(haproxy -v | head -1 | sed 's/ - https.*//'); $(wrk -v 2>&1 | head -1 | awk '{print "wrk", $2}'); $(h2load --version | head -1); $(nghttpd --version | head -1); $(go version | awk '{print $3}') (leaky client)
- placement: each proxy alone on core $PROXY_CPU; load generators and upstreams on core $LOAD_CPU

| metric |$(printf ' %s |' "${TARGETS[@]}")
|---|$(printf -- '---:|%.0s' "${TARGETS[@]}")
EOF
    # By workload (the leaky storm fills workload 5's rows too), in order of first appearance.
    sort -s -k1,1n < <(printf '%s\n' "${ROWS[@]}") | while IFS= read -r row; do
        printf '| %s |' "$row"
        for t in "${TARGETS[@]}"; do printf ' %s |' "$(cell "$row" "$t")"; done
        printf '\n'
    done
    cat <<EOF

Issue 6 targets, sidecar against nginx in this run:
$(targets_report)

Issue 25 targets measured here (its memory targets are issue 6's above, and
\`benches/idle_memory.sh\`'s tunnels):
$(issue25_report)

Issue 47 targets measured here ($builds):
$(issue47_report)

CPU = utime+stime of the proxy (nginx: master + worker) during the measured run, per request.
RSS = VmRSS summed over the proxy's processes; peak = VmHWM, same sum. busy = share of the run
that the proxy used its core / that other processes used it (above a few %: a shared machine, and
that column's req/s is not comparable; CPU per request still roughly is) / that the load core
(wrk and the upstream) was busy. Upstream dials are counted at the upstream (stub_status).
p99.9: wrk's own histogram (its \`done()\` hook; \`--latency\` prints up to p99), h2load's
request times for direct h2. nginx reaches an h2 upstream (workloads 4 and 7) only through
\`grpc_pass\`, one stream per upstream connection; item 1 compares with HAProxy, which multiplexes
as the sidecar does, item 5 with nginx as the issue words it (HAProxy's figures beside). TLS (workloads 6
and 7): a throwaway CA made for the run; every proxy verifies the origin's certificate for the
name $ORIGIN (sent as SNI) and pools up to $POOL connections. Many hosts (workload 8): nginx
proxies to a variable destination without any keep-alive pool (one upstream connection per
request); the sidecars' hosts-forgotten phase is theirs alone.
$(many_hosts_curves)
EOF
}

# Workload 8's RSS curves: (hosts sent, seconds since the start, RSS MiB) per sample.
many_hosts_curves() {
    ((${#CURVES[@]})) || return 0
    printf '\nWorkload 8 RSS curves, (hosts, s, MiB) at each sample:\n'
    printf '%s\n' "${CURVES[@]}"
}

REPORT=$(report)
printf '\n%s\n' "$REPORT"

if [[ -n $RESULTS ]]; then
    printf '%s\n' "$REPORT" >"$TMP/report.md"
    python3 - "$RESULTS" "$TMP/report.md" <<'PY'
import os, sys
path, report = sys.argv[1], open(sys.argv[2]).read().rstrip("\n")
begin, end = "<!-- compare.sh: begin -->", "<!-- compare.sh: end -->"
block = f"{begin}\n{report}\n{end}"
text = open(path).read() if os.path.exists(path) else "# Benchmark results\n\n"
if begin in text and end in text:
    text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
else:
    text = text.rstrip("\n") + "\n\n" + block + "\n"
open(path, "w").write(text)
PY
    log "table written to $RESULTS"
fi
