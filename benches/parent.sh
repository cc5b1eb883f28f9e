#!/usr/bin/env bash
# benches/parent.sh: CPU per request of a keep-alive plain-HTTP request sent through a parent
# proxy (`via`, a real Squid) next to the same request sent direct (issue 22).
#
# Question answered:
#   With `defaults.via` a plain http:// upstream is reached through a parent proxy: absolute-form
#   requests on pooled keep-alive connections to the parent, each with Proxy-Authorization
#   (README "Parent proxy"). What CPU per request does the sidecar spend on such a request,
#   next to the same request reached direct? (And, separately, what does Squid spend?)
#
# What it does and measures:
#   upstream  : nginx, 1 worker, `return 200 "ok\n"`, keepalive_requests 1e6, on LOAD_CPU.
#   parent    : Squid (/usr/sbin/squid, `squid -N`), basic auth through basic_ncsa_auth (one
#               user, an `openssl passwd -apr1` hash), `cache deny all`, access log to a file
#               (as a corporate parent logs), config/pid/logs in the scratch dir, on LOAD_CPU.
#   sidecars  : two of the same release build, both alone on PROXY_CPU (TOKIO_WORKER_THREADS=1,
#               EGRESS_LOG=warn), forward-proxy listener only, default pool; they differ only
#               in `defaults.via`:
#                 direct : none (the upstream is dialed directly);
#                 via    : `{ url: http://127.0.0.1:SQUID, credentials_file: FILE }`.
#               Only the sidecar of the mode being measured gets requests; the other idles.
#   client    : benches/keepalive_client.py, as in benches/tunnel.sh (absolute-form
#               `GET http://127.0.0.1:UP/`, what HTTP_PROXY clients send), on LOAD_CPU so its
#               own cost stays off the sidecar's core: CONNECTIONS connections, each in its own
#               thread sending one request at a time. Every connection is opened and warmed
#               with WARMUP requests first (so the pools, and Squid's connections to nginx, are
#               open); then the client reads utime+stime from /proc/PID/stat and the sum of the
#               threads' run time from /proc/PID/task/*/schedstat (nanoseconds, finer than the
#               10 ms ticks) of the sidecar, and of Squid plus its children (the auth helpers),
#               sends REQUESTS requests in total, and reads them again. Every response is
#               checked (200, body "ok\n"; in via mode also Squid's `Via` header, so a request
#               that bypassed the parent fails the run).
#               Also the sidecar's voluntary context switches per request ("sleeps/req",
#               /proc/PID/task/*/status): how often it went idle and had to be woken.
#   Rounds    : ROUNDS rounds of both modes (their order alternating), medians reported, and
#               the ratio via / direct of the sidecar's CPU per request.
#   Caveat    : Squid (on LOAD_CPU with the client) caps the via rate well below direct's, and
#               a sidecar woken for nearly every request spends more per request than one that
#               finds several waiting (compare sleeps/req). CONNECTIONS=1 makes both modes wake
#               the sidecar once per request: the like-for-like control.
#
# Usage (from the repo root):   benches/parent.sh [SIDECAR_BIN]
#   env: REQUESTS (20000), CONNECTIONS (4), ROUNDS (3), WARMUP (200 per connection),
#        PROXY_CPU (1, the sidecars), LOAD_CPU (0: nginx, Squid and the client),
#        SQUID (/usr/sbin/squid), SQUID_AUTH (/usr/lib/squid/basic_ncsa_auth),
#        CARGO_TARGET_DIR (default target/bench), SIDECAR_BIN (skip the build, use this binary;
#        it must know `via`: commit 22eaa51 or later).
# Installs nginx and squid with apt-get if missing. Numbers are reported, not asserted.

set -euo pipefail

REQUESTS=${REQUESTS:-20000}
CONNECTIONS=${CONNECTIONS:-4}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-200}
SQUID=${SQUID:-/usr/sbin/squid}
SQUID_AUTH=${SQUID_AUTH:-/usr/lib/squid/basic_ncsa_auth}

cd "$(dirname "$0")/.."
REPO=$(pwd)
# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

ensure_tools nginx:nginx taskset:util-linux python3:python3 curl:curl openssl:openssl \
    squid:squid
[[ -x $SQUID ]] || die "no squid at $SQUID"
[[ -x $SQUID_AUTH ]] || die "no basic_ncsa_auth at $SQUID_AUTH"
[[ -n ${1:-} ]] && SIDECAR_BIN=$1
build_sidecar
make_scratch egress-parent
# Squid started as root drops to the `proxy` user, which must write its logs and pid file here
# and read the password file.
chmod 0777 "$TMP"

read -r UP_PORT STATUS_PORT SQUID_PORT DIRECT_PORT DIRECT_ADMIN VIA_PORT VIA_ADMIN \
    < <(free_ports 7)

nginx_upstream_conf upstream "$UP_PORT" "$STATUS_PORT" >"$TMP/upstream.conf"
start_nginx upstream "$LOAD_CPU"
wait_port "$UP_PORT"

# Like wait_port (20 s), but fails at once, with the end of its logs, if process PID exits.
wait_up() { # pid port log...
    local i pid=$1 port=$2
    shift 2
    for ((i = 0; i < 400; i++)); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || die "process $pid exited before listening on $port: $(tail -n 5 "$@" 2>&1)"
        sleep 0.05
    done
    die "nothing listens on 127.0.0.1:$port (logs in $TMP)"
}

# === Squid, the parent ===
SQUID_USER=bench
SQUID_PASSWORD="pw-$$-$RANDOM"
printf '%s:%s\n' "$SQUID_USER" "$(openssl passwd -apr1 "$SQUID_PASSWORD")" >"$TMP/squid.passwd"
chmod 0644 "$TMP/squid.passwd"
printf '%s:%s\n' "$SQUID_USER" "$SQUID_PASSWORD" >"$TMP/credentials"
SQUID_AS=""
[[ $(id -u) == 0 ]] && SQUID_AS="cache_effective_user proxy"
# Names from /etc/hosts only (no resolver is asked: the bench uses 127.0.0.1 anyway).
cat >"$TMP/squid.conf" <<EOF
http_port 127.0.0.1:$SQUID_PORT
$SQUID_AS
pid_filename $TMP/squid.pid
cache_log $TMP/squid.cache.log
coredump_dir $TMP
logformat bench %ts.%03tu %>a %>p %rm %ru %>Hs %un
access_log stdio:$TMP/squid.access.log bench
cache deny all
cache_mem 8 MB
visible_hostname egress-bench-parent
netdb_filename none
dns_nameservers 127.0.0.1
pinger_enable off
shutdown_lifetime 0 seconds
auth_param basic program $SQUID_AUTH $TMP/squid.passwd
auth_param basic children 2
auth_param basic realm egress-bench
acl authenticated proxy_auth REQUIRED
http_access allow localhost authenticated
http_access deny all
EOF
taskset -c "$LOAD_CPU" "$SQUID" -N -f "$TMP/squid.conf" </dev/null >"$TMP/squid.stderr" 2>&1 &
SQUID_PID=$!
PIDS+=("$SQUID_PID")
wait_up "$SQUID_PID" "$SQUID_PORT" "$TMP/squid.cache.log" "$TMP/squid.stderr"
check "squid" "http://127.0.0.1:$UP_PORT/" -x "http://127.0.0.1:$SQUID_PORT" \
    -U "$SQUID_USER:$SQUID_PASSWORD"

# === the two sidecars ===
sidecar_yaml() { # listen-port admin-port [via-line]
    cat <<EOF
listen: 127.0.0.1:$1
admin: 127.0.0.1:$2
shutdown: { drain_timeout: 1s }
EOF
    [[ -z ${3:-} ]] || printf 'defaults:\n  via: %s\n' "$3"
}
sidecar_yaml "$DIRECT_PORT" "$DIRECT_ADMIN" >"$TMP/direct.yaml"
sidecar_yaml "$VIA_PORT" "$VIA_ADMIN" \
    "{ url: http://127.0.0.1:$SQUID_PORT, credentials_file: $TMP/credentials }" >"$TMP/via.yaml"
declare -A SC PORT ADMIN
PORT[direct]=$DIRECT_PORT ADMIN[direct]=$DIRECT_ADMIN
PORT[via]=$VIA_PORT ADMIN[via]=$VIA_ADMIN
for mode in direct via; do
    start_sidecar "$TMP/$mode.yaml" "$PROXY_CPU"
    SC[$mode]=$SC_PID
    wait_up "$SC_PID" "${PORT[$mode]}" "$TMP/$mode.log"
    wait_up "$SC_PID" "${ADMIN[$mode]}" "$TMP/$mode.log"
    check "$mode" "http://127.0.0.1:$UP_PORT/" -x "http://127.0.0.1:${PORT[$mode]}"
done
curl -sS -o /dev/null -D - -x "http://127.0.0.1:$VIA_PORT" "http://127.0.0.1:$UP_PORT/" |
    grep -qi '^via:.*squid' || die "via: the response did not come through Squid"


# One measured run; prints its RESULT line (without the prefix).
measure() { # mode
    local out
    local via=no
    [[ $1 == via ]] && via=yes
    out=$(taskset -c "$LOAD_CPU" python3 "$REPO/benches/keepalive_client.py" --port "${PORT[$1]}" \
        --target "127.0.0.1:$UP_PORT" --via "$via" --pid "sidecar=${SC[$1]}" --pid "squid=$SQUID_PID" \
        --total "$REQUESTS" --conns "$CONNECTIONS" --warmup "$WARMUP") || die "client ($1) failed"
    grep '^RESULT ' <<<"$out" | sed 's/^RESULT //'
}

declare -A STAT SCHED SQ_STAT SQ_SCHED RPS SLEEPS
for mode in direct via; do
    STAT[$mode]="" SCHED[$mode]="" SQ_STAT[$mode]="" SQ_SCHED[$mode]="" RPS[$mode]="" SLEEPS[$mode]=""
done
log "sidecars $BIN on core $PROXY_CPU; nginx, Squid and the client on core $LOAD_CPU"
log "$ROUNDS rounds x $REQUESTS requests on $CONNECTIONS keep-alive connections per mode"
for ((r = 1; r <= ROUNDS; r++)); do
    if ((r % 2)); then order=(via direct); else order=(direct via); fi
    for mode in "${order[@]}"; do
        line=$(measure "$mode")
        printf 'round %d %-6s %s\n' "$r" "$mode" "$line"
        STAT[$mode]+="$(field stat_us_per_req "$line") "
        SCHED[$mode]+="$(field sched_us_per_req "$line") "
        SQ_STAT[$mode]+="$(field squid_stat_us_per_req "$line") "
        SQ_SCHED[$mode]+="$(field squid_sched_us_per_req "$line") "
        RPS[$mode]+="$(field rps "$line") "
        SLEEPS[$mode]+="$(field sleeps_per_req "$line") "
    done
done

echo
printf '%-6s | %-26s | %-12s | %-8s | %s\n' mode "sidecar CPU us/req (stat)" "(schedstat)" "req/s" \
    "sidecar sleeps/req"
for mode in direct via; do
    printf '%-6s | %-26s | %-12s | %-8s | %s\n' "$mode" "$(med "${STAT[$mode]}")" \
        "$(med "${SCHED[$mode]}")" "$(med "${RPS[$mode]}")" "$(med "${SLEEPS[$mode]}")"
done
printf 'Squid CPU us/req in via mode: %s (stat), %s (schedstat); in direct mode (idle): %s\n' \
    "$(med "${SQ_STAT[via]}")" "$(med "${SQ_SCHED[via]}")" "$(med "${SQ_SCHED[direct]}")"
awk -v v="$(med "${STAT[via]}")" -v d="$(med "${STAT[direct]}")" \
    -v vs="$(med "${SCHED[via]}")" -v ds="$(med "${SCHED[direct]}")" \
    'BEGIN { printf "ratio via/direct (sidecar): %.3f (stat), %.3f (schedstat)\n", v / d, vs / ds }'

accepts=$(curl -sS "http://127.0.0.1:$STATUS_PORT/" | awk 'NR == 3 { print $1 }')
# Squid's log: "time client-ip client-port method url status user"; the sidecar's connections
# to Squid are the distinct client ports of its requests (curl's checks aside).
read -r logged via_conns < <(awk -v u="$SQUID_USER" '$7 == u { n++; p[$3] = 1 }
    END { k = 0; for (x in p) k++; print n + 0, k }' "$TMP/squid.access.log")
echo "Squid logged $logged authenticated requests on $via_conns client connections (the sidecar's" \
    "pool to the parent, plus curl's check); upstream connections accepted by nginx: $accepts"
