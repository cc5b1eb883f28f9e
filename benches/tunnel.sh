#!/usr/bin/env bash
# benches/tunnel.sh: CPU per request of plain HTTP inside CONNECT (`curl -p` style) next to
# absolute-form requests, through the same sidecar.
#
# Question answered:
#   Since issue 20 a CONNECT to a port outside policy.connect_ports is answered by the sidecar
#   and the HTTP/1.1 inside is served through the pool. Does a request inside such a tunnel cost
#   the sidecar more CPU than the same request sent in absolute-form (`GET http://host/`, what
#   HTTP_PROXY clients send)? Target: within 10%.
#
# What it does and measures:
#   upstream  : nginx, 1 worker, `return 200 "ok\n"`, keepalive_requests 1e6, on LOAD_CPU.
#   sidecar   : release build, forward-proxy listener only, default pool, TOKIO_WORKER_THREADS=1,
#               EGRESS_LOG=warn, alone on PROXY_CPU.
#   client    : benches/keepalive_client.py (on LOAD_CPU, so its own cost stays off the sidecar's
#               core), CONNECTIONS keep-alive connections, each in its own thread sending one
#               request at a time:
#                 tunnel   : `CONNECT 127.0.0.1:UP`, then `GET / HTTP/1.1` + `Host` on it;
#                 absolute : `GET http://127.0.0.1:UP/ HTTP/1.1` + `Host`.
#               Every connection is opened (and the CONNECT answered) and warmed with WARMUP
#               requests first; then the client reads the sidecar's utime+stime from
#               /proc/PID/stat (all threads) and the sum of its threads' run time from
#               /proc/PID/task/*/schedstat (nanoseconds, finer than the 10 ms ticks), sends
#               REQUESTS requests in total, and reads them again. Every response is checked
#               (200, body "ok\n").
#   Rounds    : ROUNDS rounds of both modes (their order alternating), medians reported, and
#               the ratio tunnel / absolute.
#
# Usage (from the repo root):   benches/tunnel.sh [SIDECAR_BIN]
#   env: REQUESTS (20000), CONNECTIONS (4), ROUNDS (3), WARMUP (200 per connection),
#        CARGO_TARGET_DIR (default target/bench), SIDECAR_BIN (skip the build, use this binary).
# Installs nginx with apt-get if missing. Numbers are reported, not asserted.

set -euo pipefail

REQUESTS=${REQUESTS:-20000}
CONNECTIONS=${CONNECTIONS:-4}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-200}

cd "$(dirname "$0")/.."
REPO=$(pwd)
# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

ensure_tools nginx:nginx taskset:util-linux python3:python3 curl:curl
[[ -n ${1:-} ]] && SIDECAR_BIN=$1
build_sidecar
make_scratch egress-tunnel

read -r UP_PORT STATUS_PORT FWD_PORT ADMIN_PORT < <(free_ports 4)

nginx_upstream_conf upstream "$UP_PORT" "$STATUS_PORT" >"$TMP/upstream.conf"
start_nginx upstream "$LOAD_CPU"
wait_port "$UP_PORT"

cat >"$TMP/sidecar.yaml" <<EOF
listen: 127.0.0.1:$FWD_PORT
admin: 127.0.0.1:$ADMIN_PORT
shutdown: { drain_timeout: 1s }
EOF
start_sidecar "$TMP/sidecar.yaml" "$PROXY_CPU"
wait_port "$FWD_PORT"
wait_port "$ADMIN_PORT"
check "absolute-form" "http://127.0.0.1:$UP_PORT/" -x "http://127.0.0.1:$FWD_PORT"
check "curl -p" "http://127.0.0.1:$UP_PORT/" -p -x "http://127.0.0.1:$FWD_PORT"


# One measured run; prints its RESULT line (without the prefix).
measure() { # mode
    local out
    local tunnel=()
    [[ $1 == tunnel ]] && tunnel=(--tunnel)
    out=$(taskset -c "$LOAD_CPU" python3 "$REPO/benches/keepalive_client.py" --port "$FWD_PORT" \
        --target "127.0.0.1:$UP_PORT" "${tunnel[@]}" --pid "sidecar=$SC_PID" --total "$REQUESTS" \
        --conns "$CONNECTIONS" --warmup "$WARMUP") || die "client ($1) failed"
    grep '^RESULT ' <<<"$out" | sed 's/^RESULT //'
}

declare -A STAT SCHED RPS
for mode in tunnel absolute; do STAT[$mode]="" SCHED[$mode]="" RPS[$mode]=""; done
log "sidecar $BIN on core $PROXY_CPU; nginx and the client on core $LOAD_CPU"
log "$ROUNDS rounds x $REQUESTS requests on $CONNECTIONS keep-alive connections per mode"
for ((r = 1; r <= ROUNDS; r++)); do
    if ((r % 2)); then order=(tunnel absolute); else order=(absolute tunnel); fi
    for mode in "${order[@]}"; do
        line=$(measure "$mode")
        printf 'round %d %-8s %s\n' "$r" "$mode" "$line"
        STAT[$mode]+="$(field stat_us_per_req "$line") "
        SCHED[$mode]+="$(field sched_us_per_req "$line") "
        RPS[$mode]+="$(field rps "$line") "
    done
done

echo
printf '%-9s | %-22s | %-24s | %s\n' mode "CPU us/req (stat)" "CPU us/req (schedstat)" "req/s"
for mode in tunnel absolute; do
    printf '%-9s | %-22s | %-24s | %s\n' "$mode" "$(med "${STAT[$mode]}")" "$(med "${SCHED[$mode]}")" \
        "$(med "${RPS[$mode]}")"
done
awk -v t="$(med "${STAT[tunnel]}")" -v a="$(med "${STAT[absolute]}")" \
    -v ts="$(med "${SCHED[tunnel]}")" -v as="$(med "${SCHED[absolute]}")" \
    'BEGIN { printf "ratio tunnel/absolute: %.3f (stat), %.3f (schedstat)\n", t / a, ts / as }'

metrics=$(curl -sS "http://127.0.0.1:$ADMIN_PORT/metrics")
tunnels=$(awk '/^egress_tunnels_opened_total\{kind="connect_http"\}/ { print $2 }' <<<"$metrics")
accepts=$(curl -sS "http://127.0.0.1:$STATUS_PORT/" | awk 'NR == 3 { print $1 }')
echo "tunnels served (connect_http): ${tunnels:-0}; upstream connections accepted by nginx: $accepts"
