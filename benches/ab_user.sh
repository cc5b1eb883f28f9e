#!/usr/bin/env bash
# benches/ab_user.sh: user-space and kernel CPU per keep-alive request of several sidecar
# builds and of nginx and HAProxy, in interleaved rounds, by sampling.
#
# Question answered:
#   Did a change cut the sidecar's user-space CPU per request, and where does it stand against
#   nginx's? compare.sh reads utime from /proc, which the kernel splits from stime by sampling
#   at its 250 Hz tick: a 10 s round holds about 300 user-space ticks, so each round's figure
#   moves by +-5% from sampling alone. Here `perf record` samples the proxy's processes at
#   4,999 Hz (cpu-clock), twenty times as often.
#
# Method: compare.sh's workload 1. An nginx upstream (`return 200 "ok\n"`) and wrk -t1 -c64 on
#   core 0, each proxy a fresh process alone on core 1 (the sidecar: TOKIO_WORKER_THREADS=1,
#   route mode, pool 64; nginx: one worker, keepalive 64; HAProxy: nbthread 1, http-reuse
#   always). Each round runs every target in turn: 2 s of warm-up, then DURATION seconds
#   measured, `perf record -F 4999 -p PIDS` over the same seconds. Samples in the kernel and
#   outside it, each 1/4999 s, divided by the requests wrk completed. Sampling costs the
#   proxies some CPU (in the kernel, and caches): compare figures within one run, not across.
#
# Usage (from the repo root):   benches/ab_user.sh NAME=SIDECAR_BIN... [nginx] [haproxy]
#   e.g. benches/ab_user.sh before=/tmp/old after=target/release/egress-sidecar nginx
#   env: ROUNDS (5), DURATION (6, seconds)
# Prints each round as it ends (stderr), then per target: user/kernel µs per request @ req/s
# for every round, and the median, least and most of user space.
# Installs nginx, haproxy, wrk and perf with apt-get if missing. Run as root (perf on others'
# processes).

set -euo pipefail

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-6}

cd "$(dirname "$0")/.."
REPO=$(pwd)
# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

(($# > 0)) || die "usage: benches/ab_user.sh NAME=SIDECAR_BIN... [nginx] [haproxy]"
ensure_tools nginx:nginx haproxy:haproxy wrk:wrk perf:linux-perf
make_scratch egress-ab-user
read -r UP ST < <(free_ports 2)
nginx_upstream_conf upstream "$UP" "$ST" >"$TMP/upstream.conf"
start_nginx upstream "$LOAD_CPU"
wait_port "$UP"
write_wrk_script

declare -A RES
for ((round = 1; round <= ROUNDS; round++)); do
    for spec in "$@"; do
        name=${spec%%=*}
        read -r P A R < <(free_ports 3)
        case $name in
        nginx)
            nginx_proxy_conf proxy "$P" "$UP" 64 5s >"$TMP/proxy.conf"
            start_nginx proxy "$PROXY_CPU"
            pid=$NGINX_PID port=$P
            ;;
        haproxy)
            haproxy_conf hap "$P" 6400 5s "127.0.0.1:$UP maxconn 64 pool-max-conn 64" >"$TMP/hap.cfg"
            start_haproxy hap "$PROXY_CPU"
            pid=$HAP_PID port=$P
            ;;
        *)
            BIN=${spec#*=}
            [[ -x $BIN ]] || die "$name: no executable at $BIN"
            sidecar_conf "$P" "$A" "$R" "$UP" 64 5s 10000 >"$TMP/sidecar.yaml"
            start_sidecar "$TMP/sidecar.yaml" "$PROXY_CPU"
            pid=$SC_PID port=$R
            ;;
        esac
        wait_port "$port"
        wrk_warm "http://127.0.0.1:$port/" 64 2s
        pids=$(proc_tree "$pid" | paste -sd, -)
        perf record -q -o "$TMP/perf.data" -F 4999 -p "$pids" -- sleep "$DURATION" >/dev/null 2>&1 &
        perf_pid=$!
        wrk_measure "http://127.0.0.1:$port/" 64 "${DURATION}s" "$pid" "$TMP/wrk.out"
        wait "$perf_pid" || true
        read -r user kernel < <(perf report -i "$TMP/perf.data" --no-children -n -q --sort dso 2>/dev/null |
            awk '{ if ($3 == "[kernel.kallsyms]") k += $2; else u += $2 } END { print u + 0, k + 0 }')
        value=$(awk -v u="$user" -v k="$kernel" -v n="$W_REQUESTS" -v us="$W_DURATION_US" \
            'BEGIN { printf "%.3f/%.2f@%.0f", u * 1e6 / 4999 / n, k * 1e6 / 4999 / n, n * 1e6 / us }')
        RES[$name]="${RES[$name]:-} $value"
        log "round $round/$ROUNDS $name: user/kernel µs per request @ req/s: $value"
        stop_pid "$pid"
    done
done

for spec in "$@"; do
    name=${spec%%=*}
    # shellcheck disable=SC2086 # the per-round list splits into words on purpose
    python3 - "$name" ${RES[$name]} <<'PY'
import statistics, sys
name, rounds = sys.argv[1], sys.argv[2:]
user = [float(r.split("/")[0]) for r in rounds]
print(f"{name}: {' '.join(rounds)}")
print(f"  user space µs/request: median {statistics.median(user):.3f}, least {min(user):.3f}, most {max(user):.3f}")
PY
done
