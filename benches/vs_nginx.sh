#!/usr/bin/env bash
# benches/vs_nginx.sh: throughput, latency and CPU cost of egress-sidecar next to nginx.
#
# Question answered:
#   How fast and how CPU-hungry is the sidecar next to nginx configured as an equivalent
#   keep-alive reverse proxy, on the same machine, in the same run?
#
# What it does and measures:
#   upstream  : nginx, 1 worker, `return 200 "ok\n"` (3-byte body), keepalive_requests 1e6.
#   nginx     : reverse proxy to the upstream: `upstream {}` with `keepalive 64`,
#               proxy_http_version 1.1, `proxy_set_header Connection ""`, worker_processes 1,
#               access_log off.
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
PROXY_CPU=1   # core for the proxy under test
LOAD_CPU=0    # core for wrk and the upstream

cd "$(dirname "$0")/.."
REPO=$(pwd)

# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

# --- tools ---------------------------------------------------------------------------------
need_apt=()
command -v nginx >/dev/null || need_apt+=(nginx)
command -v wrk >/dev/null || need_apt+=(wrk)
if ((${#need_apt[@]})); then
    log "installing ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
for tool in nginx wrk taskset python3 curl; do
    command -v "$tool" >/dev/null || die "$tool is required"
done
(( $(nproc) >= 2 )) || die "needs at least 2 CPUs (proxy on core $PROXY_CPU, load on core $LOAD_CPU)"

# --- build ---------------------------------------------------------------------------------
build_sidecar

# --- scratch dir and cleanup ---------------------------------------------------------------
make_scratch egress-bench

# The nginx prefix/temp/log settings shared by both nginx instances: nothing outside $TMP.
nginx_common() { # name
    cat <<EOF
pid $TMP/$1.pid;
error_log $TMP/$1.error.log warn;
worker_processes 1;
worker_rlimit_nofile 65536;
events { worker_connections 16384; }
EOF
}
nginx_http_common() { # name
    cat <<EOF
    access_log off;
    client_body_temp_path $TMP/$1.body;
    proxy_temp_path $TMP/$1.proxy;
    fastcgi_temp_path $TMP/$1.fastcgi;
    uwsgi_temp_path $TMP/$1.uwsgi;
    scgi_temp_path $TMP/$1.scgi;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
EOF
}

start_nginx() { # name cpu -> sets NGINX_PID
    nginx -t -q -p "$TMP" -e "$TMP/$1.error.log" -c "$TMP/$1.conf" || die "nginx config $1 rejected"
    taskset -c "$2" nginx -p "$TMP" -e "$TMP/$1.error.log" -c "$TMP/$1.conf" -g 'daemon off;' &
    NGINX_PID=$!
    PIDS+=("$NGINX_PID")
}



read -r UP_PORT NGX_PORT FWD_PORT ADMIN_PORT ROUTE_PORT < <(free_ports 5)

# --- upstream: nginx returning a fixed 3-byte body -----------------------------------------
{
    nginx_common upstream
    echo "http {"
    nginx_http_common upstream
    cat <<EOF
    server {
        listen 127.0.0.1:$UP_PORT backlog=4096;
        location / { default_type text/plain; return 200 "ok\n"; }
    }
}
EOF
} >"$TMP/upstream.conf"
start_nginx upstream "$LOAD_CPU"
UP_PID=$NGINX_PID

# --- nginx reverse proxy --------------------------------------------------------------------
{
    nginx_common proxy
    echo "http {"
    nginx_http_common proxy
    cat <<EOF
    upstream bench {
        server 127.0.0.1:$UP_PORT;
        keepalive 64;
        keepalive_requests 1000000;
        keepalive_timeout 300s;
    }
    server {
        listen 127.0.0.1:$NGX_PORT backlog=4096;
        location / {
            proxy_pass http://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
EOF
} >"$TMP/proxy.conf"
start_nginx proxy "$PROXY_CPU"
NGX_PID=$NGINX_PID

# --- sidecar --------------------------------------------------------------------------------
cat >"$TMP/sidecar.yaml" <<EOF
listen: 127.0.0.1:$FWD_PORT
admin: 127.0.0.1:$ADMIN_PORT
shutdown: { drain_timeout: 1s }
upstreams:
  - name: bench
    url: http://127.0.0.1:$UP_PORT
    listen: 127.0.0.1:$ROUTE_PORT
    pool: { max_connections: 64, max_idle: 64 }
EOF
TOKIO_WORKER_THREADS=1 EGRESS_LOG=warn taskset -c "$PROXY_CPU" \
    "$BIN" run --config "$TMP/sidecar.yaml" 2>"$TMP/sidecar.log" &
SC_PID=$!
PIDS+=("$SC_PID")

for port in "$UP_PORT" "$NGX_PORT" "$FWD_PORT" "$ROUTE_PORT"; do wait_port "$port"; done

# --- wrk script: optional absolute-form path, machine-readable summary ----------------------
cat >"$TMP/bench.lua" <<'EOF'
-- BENCH_PATH, when set, becomes the request target (an absolute URL gives absolute-form).
local path = os.getenv("BENCH_PATH")
if path and path ~= "" then wrk.path = path end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "RESULT requests=%d duration_us=%d p50_us=%d p99_us=%d sock_errors=%d non2xx=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, e.status))
end
EOF

# Sanity: each path answers "ok" before it is measured.
check() { # name url [proxy]
    local body
    body=$(curl -sS --max-time 5 ${3:+--proxy "$3"} "$2") || die "$1: request failed"
    [[ $body == ok ]] || die "$1: unexpected body ${body@Q}"
}
check direct "http://127.0.0.1:$UP_PORT/"
check nginx "http://127.0.0.1:$NGX_PORT/"
check sidecar-route "http://127.0.0.1:$ROUTE_PORT/"
check sidecar-forward "http://127.0.0.1:$UP_PORT/" "http://127.0.0.1:$FWD_PORT"

CLK_TCK=$(getconf CLK_TCK)
LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg)
ROWS=()

bench() { # label url cpu_pid(or -) [absolute-form target]
    local label=$1 url=$2 pid=$3 target=${4:-}
    log "$label: warm-up $WARMUP, then $DURATION with $CONNECTIONS connections"
    BENCH_PATH=$target taskset -c "$LOAD_CPU" wrk -t1 -c"$CONNECTIONS" -d"$WARMUP" \
        -s "$TMP/bench.lua" "$url" >/dev/null
    local t0=0 t1=0 b0 b1
    [[ $pid != - ]] && t0=$(cpu_ticks "$pid")
    b0=$(core_busy "$PROXY_CPU")
    local out
    out=$(BENCH_PATH=$target taskset -c "$LOAD_CPU" wrk -t1 -c"$CONNECTIONS" -d"$DURATION" \
        --latency -s "$TMP/bench.lua" "$url")
    b1=$(core_busy "$PROXY_CPU")
    [[ $pid != - ]] && t1=$(cpu_ticks "$pid")
    echo "$out" >"$TMP/wrk.$label.txt"
    local line
    line=$(grep '^RESULT ' <<<"$out") || die "$label: no wrk summary: $out"
    local requests duration_us p50_us p99_us sock_errors non2xx
    eval "$(sed 's/^RESULT //; s/ /\n/g' <<<"$line" | sed 's/^/local /')"
    ROWS+=("$(awk -v l="$label" -v n="$requests" -v d="$duration_us" -v p50="$p50_us" \
        -v p99="$p99_us" -v se="$sock_errors" -v s="$non2xx" -v pid="$pid" \
        -v dt=$((t1 - t0)) -v db=$((b1 - b0)) -v hz="$CLK_TCK" -v round="$ROUND" 'BEGIN {
            secs = d / 1e6; cpu = dt / hz
            if (pid == "-") { c1 = "-"; c2 = "-"; c3 = "-" }
            else { c1 = sprintf("%.2f", cpu); c2 = sprintf("%.0f%%", 100 * cpu / secs)
                   c3 = sprintf("%.1f", cpu * 1e6 / n) }
            other = db / hz - cpu; if (other < 0) other = 0
            printf "| %s | %s | %.0f | %.3f | %.3f | %d | %s | %s | %s | %.0f%% |", round, l,
                n / secs, p50 / 1000, p99 / 1000, se + s, c1, c2, c3, 100 * other / secs }')")
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
