# benches/common.sh: helpers the bench scripts share; sourced from the repo root after
# `REPO=$(pwd)`. Defines log/die, installs missing tools, builds or finds the sidecar (BIN), makes
# the scratch dir (TMP) whose cleanup also stops every PID in PIDS, finds free loopback ports,
# writes the nginx/HAProxy/sidecar configs the benches share and starts them pinned to a core,
# runs wrk and reads CPU and memory from /proc.
#
# CPU placement (the machine is assumed to have 2+ cores): the proxy under test alone on
# PROXY_CPU, the load generator and the upstream on LOAD_CPU.

PROXY_CPU=${PROXY_CPU:-1}
LOAD_CPU=${LOAD_CPU:-0}

# glibc's tunables for BIN: by default the image's (the Dockerfile's ENV GLIBC_TUNABLES), which
# belong to the image's build as much as its profile does. SIDECAR_TUNABLES= (empty) runs BIN as
# a plain `cargo build` runs, as compare.sh runs SIDECAR_PLAIN_BIN.
SIDECAR_TUNABLES=${SIDECAR_TUNABLES-$(sed -n 's/^ENV GLIBC_TUNABLES=//p' "$REPO/Dockerfile")}

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Installs, with apt-get, the Debian package of every command that is missing; then checks all.
ensure_tools() { # command:package ...
    local need=() pair
    for pair in "$@"; do command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}"); done
    if ((${#need[@]})); then
        log "installing ${need[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
    for pair in "$@"; do command -v "${pair%%:*}" >/dev/null || die "${pair%%:*} is required"; done
    (($(nproc) >= 2)) || die "needs at least 2 CPUs (proxy on core $PROXY_CPU, load on core $LOAD_CPU)"
}

# Sets BIN: $SIDECAR_BIN, or the build the image ships (deploy/pgo/build.sh, profile-guided)
# in $CARGO_TARGET_DIR (default target/bench).
build_sidecar() {
    if [[ -n ${SIDECAR_BIN:-} ]]; then
        BIN=$SIDECAR_BIN
    else
        local out=${CARGO_TARGET_DIR:-$REPO/target/bench}
        log "building the sidecar (deploy/pgo/build.sh, release builds in $out)"
        BIN=$(PGO_TARGET_DIR=$out bash "$REPO/deploy/pgo/build.sh")
    fi
    [[ -x $BIN ]] || die "no sidecar binary at $BIN"
}

# Sets TMP to a fresh directory; on exit every PID in PIDS is stopped and TMP removed.
make_scratch() { # prefix
    TMP=$(mktemp -d "/tmp/$1.XXXXXX")
    PIDS=()
    trap cleanup EXIT
    trap 'exit 130' INT TERM
}

cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$TMP"
}

# Stops one process started by the script, reaps it and drops it from PIDS.
stop_pid() { # pid
    kill -TERM "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    drop_pid "$1"
}

# Drops a process already reaped (by `wait`) from PIDS, so the cleanup signals no reused pid.
drop_pid() { # pid
    local keep=() p
    for p in "${PIDS[@]}"; do [[ $p == "$1" ]] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}

# N distinct free loopback ports (bound together, so distinct; released just before use).
free_ports() {
    python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

wait_port() { # port [tries]
    local i
    for ((i = 0; i < ${2:-200}; i++)); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    die "nothing listens on 127.0.0.1:$1 (logs in $TMP)"
}

# Sanity: the URL answers "ok" before it is measured.
check() { # name url [curl options...]
    local name=$1 url=$2 body
    shift 2
    body=$(curl -sS --max-time 5 "$@" "$url") || die "$name: request failed"
    [[ $body == ok ]] || die "$name: unexpected body ${body@Q}"
}

secs_of() { # "10s" / "500ms" / "2m" / "10" -> seconds (may be fractional)
    awk -v d="$1" 'BEGIN {
        if (d ~ /ms$/) { sub(/ms$/, "", d); print d / 1000 }
        else if (d ~ /m$/) { sub(/m$/, "", d); print d * 60 }
        else { sub(/s$/, "", d); print d + 0 } }'
}

# === /proc ===

# Busy ticks of one CPU (all processes, IRQs and steal included), from /proc/stat.
core_busy() { # cpu
    awk -v c="cpu$1" '$1 == c { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat
}

# Steal ticks of one CPU: time the hypervisor gave this vCPU's slot to something else.
core_steal() { # cpu
    awk -v c="cpu$1" '$1 == c { print $9 }' /proc/stat
}

# A process and its direct children (e.g. nginx's workers).
proc_tree() { # pid
    echo "$1"
    pgrep -P "$1" || true
}

# "utime stime" of a process and its direct children, in clock ticks.
cpu_ticks() { # pid
    local user=0 sys=0 p f
    for p in $(proc_tree "$1"); do
        # Fields after the ")" of comm: state is field 3, utime 14, stime 15.
        f=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null) || continue
        set -- $f
        user=$((user + ${12})) sys=$((sys + ${13}))
    done
    echo "$user $sys"
}

# Sum of one /proc/PID/status field (VmRSS, VmHWM: KiB) over a process and its direct children.
status_kib() { # pid field
    local p
    for p in $(proc_tree "$1"); do cat "/proc/$p/status" 2>/dev/null || true; done |
        awk -v f="$2:" '$1 == f { s += $2 } END { print s + 0 }'
}

# Local ports of the ESTABLISHED connections that process PID (or a child: nginx's workers)
# holds to 127.0.0.1:PORT.
established_by() { # pid port
    ss -Htnp state established "( dport = :$2 )" 2>/dev/null |
        awk -v pids="$(proc_tree "$1" | paste -sd' ' -)" '
            BEGIN { n = split(pids, p, " "); for (i = 1; i <= n; i++) tags["pid=" p[i] ","] = 1 }
            { for (t in tags) if (index($0, t)) { k = split($3, a, ":"); print a[k]; next } }'
}

# Samples established_by every SAMPLE_EVERY s until killed; one line per sample:
# "<seconds since start> <count> <port,port,...>".
sampler() { # pid port outfile
    local t0 ports
    t0=$(date +%s.%N)
    while :; do
        ports=$(established_by "$1" "$2" | paste -sd, -)
        printf '%s %d %s\n' "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')" \
            "$(awk -F, 'NF { print NF; exit } END { if (!NR) print 0 }' <<<"$ports")" "${ports:--}" >>"$3"
        sleep "${SAMPLE_EVERY:-0.5}"
    done
}

# Starts sampler on LOAD_CPU in the background; sets SAMPLER_PID.
start_sampler() { # pid port outfile
    : >"$3"
    taskset -c "$LOAD_CPU" bash -c "$(declare -f sampler established_by proc_tree); SAMPLE_EVERY=${SAMPLE_EVERY:-0.5} sampler $1 $2 $3" &
    SAMPLER_PID=$!
    PIDS+=("$SAMPLER_PID")
}

# From a sampler file: "<count nearest mid-run> | <max> | <distinct local ports>".
conn_cols() { # samples-file run-seconds
    awk -v mid="$(awk -v d="$2" 'BEGIN { print d / 2 }')" '
        { d = $1 - mid; if (d < 0) d = -d
          if (!seen || d < best) { best = d; midn = $2; seen = 1 }
          if ($2 > max) max = $2
          if ($3 != "-") { n = split($3, p, ","); for (i = 1; i <= n; i++) ports[p[i]] = 1 } }
        END { k = 0; for (x in ports) k++; printf "%d | %d | %d", midn, max, k }' "$1"
}

# === load: wrk ===

# $TMP/bench.lua: BENCH_PATH, when set, becomes the request target (an absolute URL gives
# absolute-form); prints one machine-readable RESULT line (p99.9 too: `wrk --latency` stops
# at p99).
write_wrk_script() {
    cat >"$TMP/bench.lua" <<'EOF'
local path = os.getenv("BENCH_PATH")
if path and path ~= "" then wrk.path = path end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "RESULT requests=%d duration_us=%d p50_us=%d p99_us=%d p999_us=%d sock_errors=%d non2xx=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency:percentile(99.9), e.connect + e.read + e.write + e.timeout, e.status))
end
EOF
}

wrk_warm() { # url connections duration [absolute-form target]
    BENCH_PATH=${4:-} taskset -c "$LOAD_CPU" wrk -t1 -c"$2" -d"$3" -s "$TMP/bench.lua" "$1" >/dev/null
}

# One measured wrk run on LOAD_CPU (1 thread). Sets W_REQUESTS W_DURATION_US W_P50_US W_P99_US
# W_P999_US W_ERRORS (socket errors + non-2xx), W_CPU (ticks of process PID and its children; 0
# for "-") and W_SYS (the part of them spent in the kernel),
# W_BUSY_PROXY / W_BUSY_LOAD (busy ticks of PROXY_CPU / LOAD_CPU), W_STEAL (PROXY_CPU's steal);
# wrk's output goes to OUTFILE.
wrk_measure() { # url connections duration pid(or -) outfile [absolute-form target]
    local url=$1 conns=$2 dur=$3 pid=$4 outfile=$5 target=${6:-}
    local t0="0 0" t1="0 0" bp0 bp1 bl0 bl1 st0 st1 out line
    [[ $pid != - ]] && t0=$(cpu_ticks "$pid")
    bp0=$(core_busy "$PROXY_CPU"); bl0=$(core_busy "$LOAD_CPU"); st0=$(core_steal "$PROXY_CPU")
    out=$(BENCH_PATH=$target taskset -c "$LOAD_CPU" wrk -t1 -c"$conns" -d"$dur" --latency \
        -s "$TMP/bench.lua" "$url")
    bp1=$(core_busy "$PROXY_CPU"); bl1=$(core_busy "$LOAD_CPU"); st1=$(core_steal "$PROXY_CPU")
    [[ $pid != - ]] && t1=$(cpu_ticks "$pid")
    echo "$out" >"$outfile"
    line=$(grep '^RESULT ' <<<"$out") || die "no wrk summary from $url: $out"
    local requests duration_us p50_us p99_us p999_us sock_errors non2xx
    eval "$(sed 's/^RESULT //; s/ /\n/g' <<<"$line" | sed 's/^/local /')"
    W_REQUESTS=$requests W_DURATION_US=$duration_us W_P50_US=$p50_us W_P99_US=$p99_us W_P999_US=$p999_us
    local u0 s0 u1 s1
    read -r u0 s0 <<<"$t0"
    read -r u1 s1 <<<"$t1"
    W_ERRORS=$((sock_errors + non2xx)) W_CPU=$((u1 + s1 - u0 - s0)) W_SYS=$((s1 - s0))
    W_BUSY_PROXY=$((bp1 - bp0)) W_BUSY_LOAD=$((bl1 - bl0)) W_STEAL=$((st1 - st0))
}

# === peers ===

# The nginx main-context settings every nginx instance shares: nothing outside $TMP.
nginx_common() { # name [worker_connections]
    cat <<EOF
pid $TMP/$1.pid;
error_log $TMP/$1.error.log warn;
worker_processes 1;
worker_rlimit_nofile 65536;
events { worker_connections ${2:-16384}; }
EOF
}

# The http-context settings every nginx instance shares (no access log, temp paths in $TMP).
nginx_http_common() { # name [client keepalive_timeout]
    cat <<EOF
    access_log off;
    client_body_temp_path $TMP/$1.body;
    proxy_temp_path $TMP/$1.proxy;
    fastcgi_temp_path $TMP/$1.fastcgi;
    uwsgi_temp_path $TMP/$1.uwsgi;
    scgi_temp_path $TMP/$1.scgi;
    keepalive_requests 1000000;
    keepalive_timeout ${2:-300s};
EOF
}

# The upstream of the HTTP/1.1 benches: nginx answering `ok\n` (3-byte body) on PORT; with
# STATUS_PORT, `stub_status` there too (its `accepts` counts the connections the upstream saw).
# UPSTREAM_BODY picks the answer: unset, `ok\n` as text/plain; `json`, an OpenAI chat completion
# with its usage (application/json, 600 bytes); `sse`, $TMP/stream.sse as text/event-stream (the
# caller writes it: an OpenAI stream with include_usage).
nginx_upstream_conf() { # name port [status-port]
    nginx_common "$1"
    echo "http {"
    nginx_http_common "$1"
    local location='location / { default_type text/plain; return 200 "ok\n"; }'
    case ${UPSTREAM_BODY:-} in
        json) location="location / { default_type application/json; return 200 '$(chat_completion_json)'; }" ;;
        sse) location="location / { types { } default_type text/event-stream; root $TMP; try_files /stream.sse =404; }" ;;
    esac
    cat <<EOF
    server {
        listen 127.0.0.1:$2 backlog=4096;
        $location
    }
EOF
    [[ -n ${3:-} ]] && echo "    server { listen 127.0.0.1:$3; location / { stub_status; } }"
    echo "}"
}

# An OpenAI chat completion as the API answers it, usage included (one line, no single quote).
chat_completion_json() {
    printf '%s' '{"id":"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG","object":"chat.completion","created":1741570283,"model":"gpt-4o-2024-08-06","choices":[{"index":0,"message":{"role":"assistant","content":"The image shows a wooden boardwalk path running through a lush green field or meadow.","refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":1117,"completion_tokens":46,"total_tokens":1163,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"service_tier":"default","system_fingerprint":"fp_fc9f1d7035"}'
}

# An OpenAI chat completion stream with include_usage: N content chunks, the usage chunk, [DONE].
chat_completion_sse() { # chunks
    local i
    for ((i = 0; i < $1; i++)); do
        printf 'data: {"id":"chatcmpl-B9MHD","object":"chat.completion.chunk","created":1741570283,"model":"gpt-4o-2024-08-06","service_tier":"default","system_fingerprint":"fp_fc9f1d7035","choices":[{"index":0,"delta":{"content":" word%d"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n' "$i"
    done
    printf 'data: {"id":"chatcmpl-B9MHD","object":"chat.completion.chunk","created":1741570283,"model":"gpt-4o-2024-08-06","choices":[],"usage":{"prompt_tokens":1117,"completion_tokens":%d,"total_tokens":%d}}\n\n' "$1" "$((1117 + $1))"
    printf 'data: [DONE]\n\n'
}

# nginx with a pool of connections to 127.0.0.1:UPPORT (`keepalive POOL` kept idle) and one
# location whose lines LOCATION gives; SERVER-OPTS are added to the pool's `server` line.
nginx_pooled_conf() { # name listen-port upstream-port pool client-keepalive-timeout worker_connections server-opts location
    nginx_common "$1" "$6"
    echo "http {"
    nginx_http_common "$1" "$5"
    cat <<EOF
    upstream bench {
        server 127.0.0.1:$3$7;
        keepalive $4;
        keepalive_requests 1000000;
        keepalive_timeout 60s;
    }
    server {
        listen 127.0.0.1:$2 backlog=4096;
        location / {
$8
        }
    }
}
EOF
}

# nginx as a keep-alive reverse proxy to 127.0.0.1:UPPORT: an `upstream {}` pool of
# `keepalive POOL` connections (and `max_conns=POOL`), HTTP/1.1, `Connection ""`.
# With TLS-LINES (proxy_ssl_* directives), the upstream is spoken to over TLS (https://).
nginx_proxy_conf() { # name listen-port upstream-port pool client-keepalive-timeout [worker_connections] [tls-lines]
    local scheme=http
    [[ -z ${7:-} ]] || scheme=https
    nginx_pooled_conf "$1" "$2" "$3" "$4" "$5" "${6:-}" " max_conns=$4" "            proxy_pass $scheme://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
${7:-}"
}

# nginx in front of an HTTP/2 upstream: the only module that speaks HTTP/2 to an upstream is
# `grpc_pass`, which proxies any request (not only gRPC) but never multiplexes: one stream per
# upstream connection, as many connections as requests in flight (`max_conns` would refuse the
# rest with 502: nginx's queue for them is commercial), `keepalive POOL` of them kept idle.
# With TLS-LINES (grpc_ssl_* directives), the upstream is spoken to over TLS (grpcs://).
nginx_grpc_conf() { # name listen-port upstream-port pool client-keepalive-timeout [worker_connections] [tls-lines]
    local scheme=grpc
    [[ -z ${7:-} ]] || scheme=grpcs
    nginx_pooled_conf "$1" "$2" "$3" "$4" "$5" "${6:-}" "" "            grpc_pass $scheme://bench;
${7:-}"
}

# The lines that make nginx verify the origin over TLS (MODULE: proxy or grpc): the certificate
# checked against CA for the name ORIGIN (sent as SNI), TLS sessions reused.
nginx_verify_lines() { # module
    printf '            %s_ssl_%s\n' "$1" "verify on;" "$1" "verify_depth 2;" "$1" "trusted_certificate $CA;" \
        "$1" "name $ORIGIN;" "$1" "server_name on;" "$1" "session_reuse on;"
}

start_nginx() { # name cpu -> sets NGINX_PID
    nginx -t -q -p "$TMP" -e "$TMP/$1.error.log" -c "$TMP/$1.conf" || die "nginx config $1 rejected"
    taskset -c "$2" nginx -p "$TMP" -e "$TMP/$1.error.log" -c "$TMP/$1.conf" -g 'daemon off;' &
    NGINX_PID=$!
    PIDS+=("$NGINX_PID")
}

# The HAProxy keyword for the per-backend-connection h2 stream cap: 2.6 (Debian 12) has only
# tune.h2.max-concurrent-streams, which there also caps what backend connections use.
hap_streams_keyword() {
    printf 'global\n    tune.h2.be.max-concurrent-streams 100\n' >"$TMP/probe.cfg"
    if haproxy -c -q -f "$TMP/probe.cfg" >/dev/null 2>&1; then
        echo tune.h2.be.max-concurrent-streams
    else
        echo tune.h2.max-concurrent-streams
    fi
}

# HAProxy, one thread, `mode http`, `http-reuse always` (idle server connections are shared by
# all client sessions: the pool), one frontend to one server. Stats socket $TMP/NAME.sock.
haproxy_conf() { # name listen-port maxconn client-keepalive-timeout server-line [global-line...]
    local name=$1 port=$2 maxconn=$3 keepalive=$4 server=$5
    shift 5
    cat <<EOF
global
    nbthread 1
    maxconn $maxconn
    stats socket $TMP/$name.sock mode 600 level admin
$(printf '    %s\n' "$@")

defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 60s
    timeout http-keep-alive $keepalive
    http-reuse always

frontend fe
    bind 127.0.0.1:$port backlog 4096
    maxconn $maxconn
    default_backend be

backend be
    server s1 $server
EOF
}

start_haproxy() { # name cpu -> sets HAP_PID
    haproxy -c -q -f "$TMP/$1.cfg" || die "haproxy config $1 rejected"
    taskset -c "$2" haproxy -db -f "$TMP/$1.cfg" >"$TMP/$1.log" 2>&1 &
    HAP_PID=$!
    PIDS+=("$HAP_PID")
}

# `show stat` fields of HAProxy's server be/s1, from its stats socket $TMP/NAME.sock.
hap_server_stats() { # name field...
    python3 - "$TMP/$1.sock" "${@:2}" <<'PY'
import socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(b"show stat\n")
data = b""
while True:
    b = s.recv(65536)
    if not b: break
    data += b
lines = data.decode().splitlines()
cols = lines[0].lstrip("# ").split(",")
for l in lines[1:]:
    f = dict(zip(cols, l.split(",")))
    if f.get("pxname") == "be" and f.get("svname") == "s1":
        print(" ".join(f.get(k, "?") for k in sys.argv[2:]))
PY
}

# The HTTP/2 upstream: nghttpd, h2c with prior knowledge, 1 worker, SETTINGS_MAX_CONCURRENT_STREAMS
# STREAMS, serving a 3-byte file ("ok\n") as `/`, on LOAD_CPU; with KEY and CERT (PEM files), h2
# over TLS instead (ALPN h2). Sets NGHTTPD_PID.
start_nghttpd() { # port streams [key cert]
    local tls=(--no-tls) log=$TMP/nghttpd.log
    [[ -z ${3:-} ]] || tls=() log=$TMP/nghttpd-tls.log
    mkdir -p "$TMP/www"
    printf 'ok\n' >"$TMP/www/index.html"
    taskset -c "$LOAD_CPU" nghttpd "${tls[@]}" -a 127.0.0.1 -n 1 -m "$2" -d "$TMP/www" \
        "$1" ${3:+"$3" "$4"} >"$log" 2>&1 &
    NGHTTPD_PID=$!
    PIDS+=("$NGHTTPD_PID")
}

# One h2load run (1 thread, on LOAD_CPU) after a warm-up. Sets H_DONE, H_OK (2xx), H_P50_US,
# H_P99_US, H_P999_US (request times from its log); h2load's output goes to OUTFILE.
h2load_measure() { # url connections streams duration warmup outfile
    local out
    out=$(taskset -c "$LOAD_CPU" h2load -t1 -c"$2" -m"$3" --warm-up-time="$5" -D "$4" \
        --log-file="$TMP/h2load.log" "$1")
    echo "$out" >"$6"
    # "requests: N total, N started, N done, N succeeded, ..."; "status codes: N 2xx, ..."
    H_DONE=$(awk '/^requests:/ { print $6 }' <<<"$out")
    H_OK=$(awk '/^status codes:/ { print $3 }' <<<"$out")
    [[ -n $H_DONE && -n $H_OK ]] || die "h2load: no summary: $out"
    read -r H_P50_US H_P99_US H_P999_US < <(cut -f3 "$TMP/h2load.log" | sort -n |
        awk '{ v[NR] = $1 } END { if (!NR) { print 0, 0, 0; exit }
             i = int(NR * 0.5); if (i < 1) i = 1; j = int(NR * 0.99); if (j < 1) j = 1
             k = int(NR * 0.999); if (k < 1) k = 1
             print v[i], v[j], v[k] }')
}

# The sidecar in front of the HTTP/1.1 upstream: route-mode listener, pool max_connections and
# max_idle POOL (nginx's `keepalive POOL`); downstream idle_timeout / max_connections if given,
# and max_idle_connections (default 1024) if given too.
# max-idle lifts the bounds on idle clients: max_idle_connections, and leaky_idle_timeout (which
# would otherwise close a one-request-per-connection bench client's connections after 1 s).
sidecar_conf() { # listen-port admin-port route-port upstream-port pool [idle-timeout max-connections [max-idle]]
    cat <<EOF
listen: 127.0.0.1:$1
admin: 127.0.0.1:$2
shutdown: { drain_timeout: 1s }
EOF
    [[ -z ${6:-} ]] || echo "downstream: { idle_timeout: $6, max_connections: $7${8:+, max_idle_connections: $8, leaky_idle_timeout: $6} }"
    cat <<EOF
upstreams:
  - name: bench
    url: http://127.0.0.1:$4
    listen: 127.0.0.1:$3
    pool: { max_connections: $5, max_idle: $5 }
EOF
}

# The sidecar in front of an h2c upstream: route-mode listener, `protocol: http2`, pool
# { max_connections: 64, max_pending: 4096, pending_timeout: 30s }, STREAMS per connection.
sidecar_h2_conf() { # listen-port admin-port route-port upstream-port streams
    cat <<EOF
listen: 127.0.0.1:$1
admin: 127.0.0.1:$2
shutdown: { drain_timeout: 1s }
upstreams:
  - name: h2up
    url: http://127.0.0.1:$4
    listen: 127.0.0.1:$3
    protocol: http2
    pool: { max_connections: 64, max_pending: 4096, pending_timeout: 30s }
    http2: { max_streams_per_connection: $5 }
EOF
}

# The sidecar with one worker thread and warn-level logs (nginx and HAProxy log nothing either);
# BINARY defaults to BIN, which runs with SIDECAR_TUNABLES (another binary without).
start_sidecar() { # config-file cpu [binary] -> sets SC_PID
    local bin=${3:-$BIN} tunables=
    [[ $bin == "$BIN" ]] && tunables=$SIDECAR_TUNABLES
    GLIBC_TUNABLES=$tunables TOKIO_WORKER_THREADS=1 EGRESS_LOG=warn taskset -c "$2" \
        "$bin" run --config "$1" 2>"${1%.yaml}.log" &
    SC_PID=$!
    PIDS+=("$SC_PID")
}

# The value of NAME=VALUE in a RESULT line of benches/keepalive_client.py.
field() { # name line
    sed -n "s/.*\b$1=\([0-9.-]*\).*/\1/p" <<<"$2"
}

# The median of the space-separated numbers in $1.
med() { # "numbers..."
    tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}
