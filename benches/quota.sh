#!/usr/bin/env bash
# benches/quota.sh: what the fleet-wide quota check (`global_rate_limit`, issue 45) costs a
# request that is over no limit: the sidecar's instructions, and the latency the call adds with
# the rate-limit service on loopback.
#
# Question answered:
#   With `global_rate_limit` configured, every request waits for one ShouldRateLimit call to
#   envoyproxy/ratelimit (which counts in Redis) before it goes upstream. How many instructions
#   per request does that cost the sidecar, next to no quota, and how much does it add to the
#   request's latency at p50 and p99?
#
# Method:
#   The service: redis-server (no persistence) and envoyproxy/ratelimit's service_cmd, both on
#   loopback ports and on SERVICE_CPU, with the environment of the README's table (USE_STATSD=false,
#   REDIS_SOCKET_TYPE=tcp, RUNTIME_* naming a config directory in the scratch dir,
#   RUNTIME_WATCH_ROOT=false, every listener on 127.0.0.1, LIMIT_RESPONSE_HEADERS_ENABLED=true)
#   and its local cache off (LOCAL_CACHE_SIZE_IN_BYTES=0). Its config, domain `egress`: 1e9
#   requests a second for ("upstream", "bench") (the upstream callgrind.sh and common.sh's
#   sidecar_conf name) and, under it, for each ("app", *): limits never reached, so every call
#   is one Redis round trip (INCRBY and EXPIRE per descriptor) answered OK.
#   1. Instructions per request: benches/callgrind.sh on one binary, three times: no quota;
#      `descriptors: [[{ key: upstream }]]`; and two descriptors, adding
#      `[{ key: upstream }, { key: app }]` (in route mode the app is the upstream's name).
#      Under valgrind the sidecar runs tens of times slower, so the quota runs set `timeout: 5s`,
#      and `failure_mode: deny`: a check that fails answers 503, which callgrind.sh's h2load
#      check refuses, so a count comes only from runs whose every check was answered OK. The
#      service's INCRBYs (Redis' INFO commandstats) must equal the requests sent times the
#      descriptors. callgrind counts the sidecar only: the service's and Redis' work is done in
#      their own processes and is not in these numbers.
#   2. Added latency: the same binary, not under valgrind (TOKIO_WORKER_THREADS=1, EGRESS_LOG=warn,
#      route mode, pool 64, on PROXY_CPU) in front of nginx (`return 200 "ok\n"`, on LOAD_CPU),
#      three sidecars: `none`, `quota 1` (`[[{ key: upstream }]]`) and `quota 2` (both
#      descriptors above), the quota ones as users run them: the default `timeout: 50ms` and
#      `failure_mode: allow` (a check slower than 50 ms lets the request go, counted as a
#      timeout). Each is measured by a closed loop on one connection: wrk -t1 -c1 --latency on
#      LOAD_CPU, WARMUP then DURATION. Two floors beside them: `direct`, wrk straight to nginx,
#      and `service`, the service alone: h2load (h2c, one connection, one stream at a time, on
#      PROXY_CPU, where the sidecars call it from) posting quota 1's ShouldRateLimit request
#      (protobuf, built here) to its gRPC port, each call checked to count in Redis; what a call
#      takes without the sidecar.
#      One round measures direct, service, none, quota 1, quota 2 in turn; ROUNDS rounds, so
#      the machine's noise hits each alike. Reported: p50 and p99 of each run, their medians
#      over the rounds, the added latency (median of quota minus median of none), and from the
#      sidecar's metrics the mean call time (egress_global_rate_limit_seconds) and the calls
#      that timed out or failed (none is expected on an idle machine). The run stops if the checks are not one per
#      request (wrk's in-flight request at the end aside) or the service says over limit.
#      One connection in a closed loop is all wake-ups: where a wake-up of an idle core is
#      expensive (a VM), a hop between cores dominates these numbers (see benches/RESULTS.md).
#
# Usage (from the repo root):   benches/quota.sh [SIDECAR_BIN]
#   env: ROUNDS (3), DURATION (10s), WARMUP (2s), LOW / HIGH (callgrind.sh's, 2000 / 12000),
#        PARTS (callgrind,latency: which parts run), KEEP (a directory: each callgrind.sh run
#        keeps its callgrind.out files in KEEP/quota0, quota1, quota2, for callgrind_annotate
#        or benches/cg_per_request.py; DUMP_INSTR=1 is passed on), RATELIMIT_BIN (a built
#        service_cmd; else it is built with `go install` (Go 1.25.6 or newer, GOTOOLCHAIN=local) into
#        ${XDG_CACHE_HOME:-~/.cache}/egress-sidecar-bench/, kept there), SIDECAR_BIN (skip the
#        build, use this binary), CARGO_TARGET_DIR (target/bench), PROXY_CPU (1), LOAD_CPU (0),
#        SERVICE_CPU (LOAD_CPU: Redis and the service).
# Installs redis-server, nginx, wrk, valgrind, nghttp2-client (h2load) and curl with apt-get if
# missing. Prints its results to stdout (a Markdown table for benches/RESULTS.md); everything it
# writes lives in one mktemp directory, removed on exit with every process it started.
# Numbers are reported, not asserted.

set -euo pipefail

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
LOW=${LOW:-2000}
HIGH=${HIGH:-12000}
PARTS=${PARTS:-callgrind,latency}
SERVICE_CPU=${SERVICE_CPU:-${LOAD_CPU:-0}}
RATELIMIT_MODULE=github.com/envoyproxy/ratelimit/src/service_cmd
# The pseudo-version the tests build (tests/support/ratelimit.rs) and the manifest's image.
RATELIMIT_VERSION=v1.4.1-0.20260122083618-3fb702589d36
DOMAIN=egress
LIMIT=1000000000

cd "$(dirname "$0")/.."
REPO=$(pwd)
# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

ensure_tools redis-server:redis-server redis-cli:redis-tools nginx:nginx wrk:wrk \
    valgrind:valgrind h2load:nghttp2-client curl:curl taskset:util-linux python3:python3
[[ -n ${1:-} ]] && SIDECAR_BIN=$1
build_sidecar
make_scratch egress-quota

# Sets RL_BIN: $RATELIMIT_BIN, or service_cmd built from the pinned module (once, then kept).
ratelimit_bin() {
    if [[ -n ${RATELIMIT_BIN:-} ]]; then
        RL_BIN=$RATELIMIT_BIN
    else
        local dir=${XDG_CACHE_HOME:-$HOME/.cache}/egress-sidecar-bench/ratelimit-$RATELIMIT_VERSION
        RL_BIN=$dir/service_cmd
        if [[ ! -x $RL_BIN ]]; then
            command -v go >/dev/null ||
                die "no RATELIMIT_BIN and no go (1.25.6 or newer) to build $RATELIMIT_MODULE with"
            log "building $RATELIMIT_MODULE@$RATELIMIT_VERSION into $dir"
            mkdir -p "$dir"
            GOBIN=$dir CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS='' GOWORK=off \
                go install "$RATELIMIT_MODULE@$RATELIMIT_VERSION" >&2
        fi
    fi
    [[ -x $RL_BIN ]] || die "no rate-limit service at $RL_BIN"
}

start_redis() { # port -> sets REDIS_PID
    mkdir -p "$TMP/redis"
    taskset -c "$SERVICE_CPU" redis-server --bind 127.0.0.1 --port "$1" --save '' \
        --appendonly no --daemonize no --dir "$TMP/redis" --logfile "$TMP/redis.log" &
    REDIS_PID=$!
    PIDS+=("$REDIS_PID")
    local i
    for ((i = 0; i < 200; i++)); do
        [[ $(redis-cli -p "$1" ping 2>/dev/null) == PONG ]] && return 0
        sleep 0.05
    done
    die "redis-server did not answer on 127.0.0.1:$1 ($(tail -n3 "$TMP/redis.log" 2>/dev/null))"
}

# The service's config: limits on both descriptors the bench sends, never reached.
ratelimit_config() {
    cat <<EOF
domain: $DOMAIN
descriptors:
  - key: upstream
    value: bench
    rate_limit: { unit: second, requests_per_unit: $LIMIT }
    descriptors:
      - key: app
        rate_limit: { unit: second, requests_per_unit: $LIMIT }
EOF
}

start_ratelimit() { # redis-port grpc-port http-port debug-port -> sets RL_PID
    mkdir -p "$TMP/rl/ratelimit/config"
    ratelimit_config >"$TMP/rl/ratelimit/config/$DOMAIN.yaml"
    (cd "$TMP/rl" && exec env -i PATH="$PATH" \
        USE_STATSD=false REDIS_SOCKET_TYPE=tcp REDIS_URL="127.0.0.1:$1" \
        RUNTIME_ROOT="$TMP/rl" RUNTIME_SUBDIRECTORY=ratelimit RUNTIME_APPDIRECTORY=config \
        RUNTIME_WATCH_ROOT=false RUNTIME_IGNOREDOTFILES=true \
        GRPC_HOST=127.0.0.1 GRPC_PORT="$2" HOST=127.0.0.1 PORT="$3" \
        DEBUG_HOST=127.0.0.1 DEBUG_PORT="$4" \
        LOCAL_CACHE_SIZE_IN_BYTES=0 LIMIT_RESPONSE_HEADERS_ENABLED=true LOG_LEVEL=warn \
        taskset -c "$SERVICE_CPU" "$RL_BIN") >"$TMP/ratelimit.log" 2>&1 &
    RL_PID=$!
    PIDS+=("$RL_PID")
    local i
    for ((i = 0; i < 200; i++)); do
        kill -0 "$RL_PID" 2>/dev/null || die "the rate-limit service exited: $(tail -n5 "$TMP/ratelimit.log")"
        [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$3/healthcheck") == 200 ]] &&
            break
        sleep 0.05
    done
    wait_port "$2"
    # The limit is there, so every call of the bench costs the service its Redis round trip.
    local answer
    answer=$(curl -sS --max-time 5 -d "{\"domain\":\"$DOMAIN\",\"descriptors\":[{\"entries\":[{\"key\":\"upstream\",\"value\":\"bench\"},{\"key\":\"app\",\"value\":\"probe\"}]}]}" \
        "http://127.0.0.1:$3/json") || die "the service's /json did not answer"
    [[ $answer == *'"overallCode":"OK"'* && $answer == *"\"requestsPerUnit\":$LIMIT"* ]] ||
        die "the service does not limit (upstream, app): ${answer@Q}"
}

# Descriptor hits the service counted so far (one INCRBY each).
incrby_calls() {
    redis-cli -p "$REDIS_PORT" info commandstats |
        sed -n 's/^cmdstat_incrby:calls=\([0-9]*\),.*/\1/p' | awk '{ n += $1 } END { print n + 0 }'
}

# The global_rate_limit line of an upstream: DESCRIPTORS (1 or 2), then extra keys.
quota_line() { # descriptors [extra keys...]
    local d='[{ key: upstream }]'
    [[ $1 == 2 ]] && d+=', [{ key: upstream }, { key: app }]'
    local extra=${2:+, $2}
    echo "global_rate_limit: { service: http://127.0.0.1:$GRPC_PORT, domain: $DOMAIN, descriptors: [$d]$extra }"
}

# === the service ===

ratelimit_bin
read -r REDIS_PORT GRPC_PORT RL_HTTP_PORT RL_DEBUG_PORT < <(free_ports 4)
start_redis "$REDIS_PORT"
start_ratelimit "$REDIS_PORT" "$GRPC_PORT" "$RL_HTTP_PORT" "$RL_DEBUG_PORT"
log "rate-limit service on 127.0.0.1:$GRPC_PORT (Redis on $REDIS_PORT)"

COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$REPO" diff --quiet HEAD 2>/dev/null || COMMIT+=+dirty
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)

# === 1. instructions per request ===

CG_LABELS=() CG_IR=()
# One callgrind.sh run; its line and count go to CG_LABELS / CG_IR; with KEEP, its profiles
# to KEEP/quotaN.
callgrind_run() { # label descriptors(0, 1, 2)
    local extra=() before after line ir
    [[ $2 == 0 ]] || extra=(UPSTREAM_EXTRA="$(quota_line "$2" 'timeout: 5s, failure_mode: deny')")
    if [[ -n ${KEEP:-} ]]; then
        mkdir -p "$KEEP/quota$2"
        extra+=(KEEP="$KEEP/quota$2")
    fi
    before=$(incrby_calls)
    line=$(env "${extra[@]}" SIDECAR_BIN="$BIN" LOW="$LOW" HIGH="$HIGH" bash "$REPO/benches/callgrind.sh" |
        grep 'instructions per request') || die "callgrind.sh failed ($1)"
    after=$(incrby_calls)
    (((after - before) == (LOW + HIGH) * $2)) ||
        die "$1: the service counted $((after - before)) descriptor hits, not $(((LOW + HIGH) * $2))"
    ir=$(sed -n 's/.*: \([0-9]*\) instructions per request.*/\1/p' <<<"$line")
    [[ -n $ir ]] || die "no count in: $line"
    log "$line"
    CG_LABELS+=("$1") CG_IR+=("$ir")
}

if [[ ,$PARTS, == *,callgrind,* ]]; then
    callgrind_run "none" 0
    callgrind_run "\`[[{ key: upstream }]]\`" 1
    callgrind_run "\`[[{ key: upstream }], [{ key: upstream }, { key: app }]]\`" 2
fi

# === 2. added latency ===

# The quota metrics of upstream bench: "ok timeout error over_limit cached seconds_sum
# seconds_count".
quota_snapshot() { # admin-port
    curl -sS --max-time 5 "http://127.0.0.1:$1/metrics" |
        awk 'index($0, "upstream=\"bench\"") {
                 if (index($0, "egress_global_rate_limit_calls_total{") == 1)
                     for (r in want) if (index($0, "result=\"" r "\"")) v[r] = $NF
                 if (index($0, "egress_global_rate_limit_seconds_sum{") == 1) v["sum"] = $NF
                 if (index($0, "egress_global_rate_limit_seconds_count{") == 1) v["count"] = $NF }
             BEGIN { split("ok timeout error over_limit cached", w, " "); for (i in w) want[w[i]] = 1 }
             END { printf "%d %d %d %d %d %.9f %d\n", v["ok"], v["timeout"], v["error"],
                       v["over_limit"], v["cached"], v["sum"], v["count"] }'
}

# $TMP/grpc.bin: one gRPC message (uncompressed, length-prefixed), a RateLimitRequest for
# ("upstream", "bench") in DOMAIN, as protobuf: what the sidecar sends for `quota 1`.
write_grpc_request() {
    python3 - "$DOMAIN" "$TMP/grpc.bin" <<'PY'
import sys
def field(number, payload):  # a length-delimited field (all of these are under 128 bytes)
    return bytes([number << 3 | 2, len(payload)]) + payload
entry = field(1, b"upstream") + field(2, b"bench")          # RateLimitDescriptor.Entry
request = field(1, sys.argv[1].encode()) + field(2, field(1, entry))  # domain, descriptors
open(sys.argv[2], "wb").write(b"\0" + len(request).to_bytes(4, "big") + request)
PY
}

# The service alone over gRPC: h2load (h2c, one connection, one stream at a time) posting
# $TMP/grpc.bin to ShouldRateLimit, from PROXY_CPU, where the sidecars call it from (the same
# hop between cores). Sets wrk_measure's W_REQUESTS, W_DURATION_US, W_P50_US, W_P99_US and
# W_ERRORS (non-2xx and unfinished); the per-request times come from h2load's log.
grpc_measure() { # url duration warmup outfile
    local out finished ok
    out=$(taskset -c "$PROXY_CPU" h2load -t1 -c1 -m1 --warm-up-time="$3" -D "$2" \
        -d "$TMP/grpc.bin" -H 'content-type: application/grpc' -H 'te: trailers' \
        --log-file="$TMP/h2load.log" "$1")
    echo "$out" >"$4"
    finished=$(awk '/^requests:/ { print $6 }' <<<"$out")
    ok=$(awk '/^status codes:/ { print $3 }' <<<"$out")
    [[ -n $finished && -n $ok ]] || die "h2load: no summary: $out"
    W_REQUESTS=$finished W_ERRORS=$((finished - ok))
    W_DURATION_US=$(awk -v s="$(secs_of "$2")" 'BEGIN { printf "%d", s * 1e6 }')
    read -r W_P50_US W_P99_US < <(cut -f3 "$TMP/h2load.log" | sort -n |
        awk '{ v[NR] = $1 } END { i = int(NR * 0.5); if (i < 1) i = 1; j = int(NR * 0.99); if (j < 1) j = 1
             print v[i] + 0, v[j] + 0 }')
}

TARGETS=(direct service none "quota 1" "quota 2")
declare -A URL ADMIN PID P50 P99 RPS CALL_US NOT_OK
if [[ ,$PARTS, == *,latency,* ]]; then
    write_wrk_script
    write_grpc_request
    URL[service]=http://127.0.0.1:$GRPC_PORT/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit
    read -r UP_PORT < <(free_ports 1)
    nginx_upstream_conf upstream "$UP_PORT" >"$TMP/upstream.conf"
    start_nginx upstream "$LOAD_CPU"
    wait_port "$UP_PORT"
    URL[direct]=http://127.0.0.1:$UP_PORT/ PID[direct]=$NGINX_PID
    for t in none "quota 1" "quota 2"; do
        read -r fwd admin port < <(free_ports 3)
        f=$TMP/sidecar-${t// /}.yaml
        sidecar_conf "$fwd" "$admin" "$port" "$UP_PORT" 64 5s 10000 >"$f"
        [[ $t == none ]] || printf '    %s\n' "$(quota_line "${t#quota }")" >>"$f"
        start_sidecar "$f" "$PROXY_CPU"
        wait_port "$port"
        check "$t" "http://127.0.0.1:$port/"
        URL[$t]=http://127.0.0.1:$port/ ADMIN[$t]=$admin PID[$t]=$SC_PID
    done
    for ((r = 1; r <= ROUNDS; r++)); do
        for t in "${TARGETS[@]}"; do
            log "latency round $r/$ROUNDS: $t"
            if [[ $t == service ]]; then
                hits0=$(incrby_calls)
                grpc_measure "${URL[$t]}" "$DURATION" "$WARMUP" "$TMP/wrk.out"
                # Answered with HTTP 200 is not yet answered OK (that is in the trailers): each
                # call counted in Redis is.
                (($(incrby_calls) - hits0 >= W_REQUESTS)) || die "service: fewer hits in Redis than calls"
            else
                wrk_warm "${URL[$t]}" 1 "$WARMUP"
                [[ $t == quota* ]] && read -r ok0 to0 err0 over0 cached0 sum0 n0 < <(quota_snapshot "${ADMIN[$t]}")
                wrk_measure "${URL[$t]}" 1 "$DURATION" "${PID[$t]}" "$TMP/wrk.out"
            fi
            ((W_ERRORS == 0)) || die "$t: $W_ERRORS errors or non-2xx answers ($(cat "$TMP/wrk.out"))"
            if [[ $t == quota* ]]; then
                read -r ok1 to1 err1 over1 cached1 sum1 n1 < <(quota_snapshot "${ADMIN[$t]}")
                calls=$((ok1 + to1 + err1 + over1 + cached1 - ok0 - to0 - err0 - over0 - cached0))
                # A limit reached would make this another bench (cached answers, 429s).
                ((over1 == over0 && cached1 == cached0)) || die "$t: the service said over limit"
                ((calls >= W_REQUESTS && calls <= W_REQUESTS + 1)) ||
                    die "$t: $calls quota checks for $W_REQUESTS requests"
                NOT_OK[$t]+=" $((to1 - to0))/$((err1 - err0))"
                CALL_US[$t]+=" $(awk -v s0="$sum0" -v n0="$n0" -v s1="$sum1" -v n1="$n1" \
                    'BEGIN { printf "%.0f", (s1 - s0) / (n1 - n0) * 1e6 }')"
            fi
            P50[$t]+=" $W_P50_US" P99[$t]+=" $W_P99_US"
            RPS[$t]+=" $(awk -v n="$W_REQUESTS" -v us="$W_DURATION_US" 'BEGIN { printf "%.0f", n / us * 1e6 }')"
        done
    done
fi

# === report ===

each() { sed 's/^ //; s/ / · /g' <<<"$1"; }

echo "### quota.sh ($(date -u +%Y-%m-%dT%H:%MZ))"
echo
echo "- sidecar: $("$BIN" --version), commit $COMMIT ($BIN)"
echo "- service: envoyproxy/ratelimit $RATELIMIT_VERSION ($RL_BIN), $(redis-server --version | awk '{ print $3 }' | sed 's/^v=/redis-server /'), on core $SERVICE_CPU"
echo "- machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), kernel $(uname -r);" \
    "load average before $LOAD_BEFORE, after $(cut -d' ' -f1-3 /proc/loadavg)"
if ((${#CG_IR[@]})); then
    echo
    echo "Instructions per request (benches/callgrind.sh, $LOW and $HIGH requests, h1 upstream, 8 clients; the sidecar's only, not the service's or Redis'):"
    echo
    echo "| descriptors | instructions per request | added |"
    echo "|---|---:|---:|"
    for i in "${!CG_IR[@]}"; do
        added=-
        ((i == 0)) || added=$(awk -v a="${CG_IR[$i]}" -v b="${CG_IR[0]}" \
            'BEGIN { printf "+%d (%+.1f%%)", a - b, (a - b) / b * 100 }')
        echo "| ${CG_LABELS[$i]} | ${CG_IR[$i]} | $added |"
    done
fi
if [[ -n ${P50[none]:-} ]]; then
    echo
    echo "Latency, one connection in a closed loop (wrk -t1 -c1 --latency, $WARMUP then $DURATION, $ROUNDS rounds; µs):"
    echo
    echo "| target | p50 | p99 | p50, each round | p99, each round | requests/s, each round | call, sidecar's mean | calls timed out/failed |"
    echo "|---|---:|---:|---|---|---|---|---|"
    for t in "${TARGETS[@]}"; do
        echo "| $t | $(med "${P50[$t]}") | $(med "${P99[$t]}") | $(each "${P50[$t]}") | $(each "${P99[$t]}")" \
            "| $(each "${RPS[$t]}") | $(each "${CALL_US[$t]:- -}") | $(each "${NOT_OK[$t]:- -}") |"
    done
    echo
    for t in "quota 1" "quota 2"; do
        printf 'Added by the check (%s minus none, medians): p50 %+d µs, p99 %+d µs\n' "$t" \
            "$(($(med "${P50[$t]}") - $(med "${P50[none]}")))" "$(($(med "${P99[$t]}") - $(med "${P99[none]}")))"
    done
fi
