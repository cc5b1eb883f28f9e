#!/usr/bin/env bash
# benches/h2c_syscalls.sh: what the kernel does for each request of HTTP/1.1 clients through
# sidecar builds (and HAProxy) to an h2c upstream: syscalls by kind, wake-ups of other
# processes, context switches, and the CPU it all costs.
#
# Question answered:
#   Where does a proxy's kernel time per request through an h2c upstream come from? compare.sh's
#   workload 4 splits CPU into user and kernel time; this counts what the kernel was asked to
#   do: the client side's `recvfrom` and `sendto` per request, how many requests share one
#   write to the upstream and one `epoll_wait`, and how often the proxy wakes the load
#   generator or the upstream (`sched:sched_waking` fires in the waker's context; an IPI when
#   the woken task's core must be interrupted).
#
# Method: compare.sh's workload 4. nghttpd (h2c, 100 streams a connection) and wrk -t1
#   -c$CLIENTS on core 0; each proxy alone on core 1, started once (the sidecar: route mode,
#   `protocol: http2`, TOKIO_WORKER_THREADS=1; HAProxy: nbthread 1, `proto h2`). Each round
#   runs every target in turn (the order reversed every other round): 2 s of warm-up, then
#   DURATION of wrk with `perf stat -p PID` counting tracepoints over the same seconds.
#   Counts are divided by the requests wrk completed. CPU is utime+stime from /proc, as in
#   compare.sh; perf's counting adds to it a little, the same for every target.
#
# Usage (from the repo root):   benches/h2c_syscalls.sh NAME=SIDECAR_BIN... [haproxy]
#   e.g. benches/h2c_syscalls.sh before=/tmp/old after=target/release/egress-sidecar haproxy
#   env: CLIENTS (400), ROUNDS (2), DURATION (8s)
# Prints one line per target and round. Installs haproxy, nghttp2-server, wrk and perf with
# apt-get if missing. Run as root (perf on others' processes).

set -euo pipefail

CLIENTS=${CLIENTS:-400}
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-8s}

cd "$(dirname "$0")/.."
REPO=$(pwd)
# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

(($# > 0)) || die "usage: benches/h2c_syscalls.sh NAME=SIDECAR_BIN... [haproxy]"
ensure_tools haproxy:haproxy nghttpd:nghttp2-server wrk:wrk perf:linux-perf python3:python3
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
(($(ulimit -n) >= 2 * CLIENTS + 256)) || die "open-file limit $(ulimit -n) too low for $CLIENTS clients"
# No build is the image's here: start_sidecar runs every binary without glibc tunables, as a
# plain `cargo build` runs.
BIN=
make_scratch egress-h2c-syscalls
read -r UP < <(free_ports 1)
start_nghttpd "$UP" 100
wait_port "$UP"
write_wrk_script

# Every target runs from the start: NAME, its route-mode port and its pid.
NAMES=() PORTS=() PROCS=()
for spec in "$@"; do
    name=${spec%%=*}
    read -r P A R < <(free_ports 3)
    if [[ $name == haproxy ]]; then
        # maxconn within the open-file limit checked above (two descriptors a connection).
        haproxy_conf haproxy "$R" $((CLIENTS + 64)) 60s "127.0.0.1:$UP proto h2" \
            "$(hap_streams_keyword) 100" >"$TMP/haproxy.cfg"
        start_haproxy haproxy "$PROXY_CPU"
        pid=$HAP_PID
    else
        bin=${spec#*=}
        [[ -x $bin ]] || die "no sidecar binary at $bin"
        sidecar_h2_conf "$P" "$A" "$R" "$UP" 100 >"$TMP/$name.yaml"
        start_sidecar "$TMP/$name.yaml" "$PROXY_CPU" "$bin"
        pid=$SC_PID
    fi
    wait_port "$R"
    NAMES+=("$name") PORTS+=("$R") PROCS+=("$pid")
done

EVENTS=sched:sched_waking,ipi:ipi_send_cpu,context-switches,raw_syscalls:sys_enter
EVENTS+=,syscalls:sys_enter_recvfrom,syscalls:sys_enter_sendto,syscalls:sys_enter_writev
EVENTS+=,syscalls:sys_enter_epoll_wait

measure() { # index round
    local name=${NAMES[$1]} port=${PORTS[$1]} pid=${PROCS[$1]} perf_pid
    wrk_warm "http://127.0.0.1:$port/" "$CLIENTS" 2s
    perf stat -x, -e "$EVENTS" -p "$pid" -o "$TMP/perf.txt" &
    perf_pid=$!
    sleep 0.2
    wrk_measure "http://127.0.0.1:$port/" "$CLIENTS" "$DURATION" "$pid" "$TMP/wrk.txt"
    kill -INT "$perf_pid"
    wait "$perf_pid" || true
    python3 - "$name" "$2" "$W_REQUESTS" "$W_CPU" "$W_SYS" "$(getconf CLK_TCK)" "$W_P99_US" \
        "$W_ERRORS" "$TMP/perf.txt" <<'PY'
import sys
name, rnd, n, cpu, sys_ticks, hz, p99, errors, path = sys.argv[1:]
n, hz = int(n), int(hz)
counts = {}
for line in open(path):
    f = line.strip().split(",")
    if len(f) > 2 and f[0][:1].isdigit():
        counts[f[2].split(":")[-1].removeprefix("sys_enter_")] = float(f[0])
short = {"sys_enter": "syscalls", "sched_waking": "wakes", "ipi_send_cpu": "ipis",
         "context-switches": "switches"}
each = " ".join(f"{short.get(k, k)} {v / n:.3f}" for k, v in counts.items())
print(f"round {rnd} {name:>10}: {n} requests, {errors} errors, CPU {int(cpu) * 1e6 / hz / n:.2f} µs"
      f" (kernel {int(sys_ticks) * 1e6 / hz / n:.2f}), p99 {int(p99) / 1000:.2f} ms;"
      f" per request: {each}")
PY
}

for ((round = 1; round <= ROUNDS; round++)); do
    order=$(seq 0 $((${#NAMES[@]} - 1)))
    ((round % 2)) || order=$(tac <<<"$order")
    for i in $order; do measure "$i" "$round"; done
done
