#!/usr/bin/env bash
# benches/hot_symbols.sh: writes link/request-path.symbols, the functions the release binary
# runs once start-up is over, hottest first, for the linker to lay out together (see
# link/README.md).
#
# Method: the sidecar (the given release build, TOKIO_WORKER_THREADS=1, route mode, pool 64)
#   runs under valgrind --tool=callgrind in front of an nginx upstream. Two seconds after its
#   listener opens the counters are zeroed (start-up is over: its pages are released), then
#   it serves a check, 64 one-request connections, 300 connections left idle (parked, the
#   first 100 evicted past max_idle_connections, then some woken by a request, some closed,
#   the rest timed out; the leak detector warns about their source), 2,000 keep-alive
#   requests on 8, and idles 7 s more (its periodic tasks: heap trim, config watch). A
#   second sidecar, with the downstream bounds at their defaults, takes benches/compare.sh's
#   workload 2: the Go leaky client of tests/leaky, 5,000 requests each on a new connection,
#   held past the idle timeout (parked, evicted past 1,024, closed by the leak detector). The
#   storm runs paths the first workload misses: Notify's waiter path, and the blocking pool's
#   queue growing; unlisted, they lie in the cold text, and the storm mapped 440 KiB of it. A
#   third sidecar carries 200 CONNECT and 200 WebSocket tunnels to benches/idle_memory.py's
#   echoing upstream, idle and then closed, as benches/idle_memory.sh opens them. A fourth
#   meets 300 hosts through its forward listener (benches/many_hosts.py, as workload 8 of
#   benches/compare.sh) with /debug/pools and /metrics read, and lets them go once idle. A
#   fifth sends GETs and POSTs to an h2c upstream (nghttpd), an HTTP/1.1 one over TLS (nginx)
#   and an h2 one over TLS (nghttpd), as workloads 4, 6 and 7 of benches/compare.sh do.
#   Those five take tokio's current-thread runtime (one worker, as benches/compare.sh runs
#   the sidecar); a sixth run takes the first run's kinds of connection (one-request, idle,
#   keep-alive) and the third's tunnels on the multi-thread runtime (two workers, as
#   benches/idle_memory.sh and any pod allowed more than one core run it), and the fifth run
#   is repeated on it. Every function of the binary with
#   instructions counted from the zero on, in any run, is listed, mangled, by instructions,
#   in four groups: the HTTP/1.1 runs' (first to fourth), the sixth's new names, the fifth's,
#   then its repeat's (symbols without a type, which valgrind does not read, named by the
#   instructions' addresses; and the paths only a race between threads takes, which
#   valgrind's one thread at a time seldom meets, added to the sixth's by name:
#   link/README.md). What runs
#   after start-up, however rarely, is laid out together, and the HTTP/1.1 paths apart from
#   the code only HTTP/2 and TLS upstreams run.
#
# Usage (from the repo root):   benches/hot_symbols.sh [SIDECAR_BIN]
#   Run it on the build the image ships (deploy/pgo/build.sh, which it runs when given no
#   binary: profile-guided builds inline differently, so their functions are named apart from
#   a plain release build's) after a change of dependencies or of the compiler (symbol names
#   carry a hash of both), and after a change that adds or renames functions on these paths
#   (a new one lands in the cold text, and the first time it runs maps a folio of its own).
#   Names the build lacks are skipped, so a stale list costs only its benefit: the RSS base,
#   and the RSS after workloads 3 and 5 of `benches/compare.sh`, show it.
#   ADD=1 keeps the names listed and adds the given build's that are not, each after the
#   listed names of its group (a listed name this build runs in an earlier group moves up to
#   it): run it
#   on a plain release build (`cargo build --release`) after the profile-guided one, so that
#   both builds find their request path listed (the plain build inlines other functions, and
#   so runs functions of other names).
# Installs valgrind, nginx and nghttp2-client (h2load) with apt-get if missing.

set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
# shellcheck source=benches/common.sh
source benches/common.sh

ensure_tools valgrind:valgrind callgrind_control:valgrind nginx:nginx h2load:nghttp2-client curl:curl go:golang-go \
    nghttpd:nghttp2-server openssl:openssl
SIDECAR_BIN=${1:-${SIDECAR_BIN:-}}
build_sidecar
make_scratch hot-symbols
trap cleanup EXIT

read -r UP_PORT < <(free_ports 1)
nginx_upstream_conf upstream "$UP_PORT" >"$TMP/upstream.conf"
start_nginx upstream "$LOAD_CPU"
wait_port "$UP_PORT"

# Starts the sidecar under callgrind with config $1, writing $2, with WORKERS worker threads
# (default 1: tokio's current-thread runtime; more: the multi-thread one); its counters are
# zeroed once start-up is over. Sets vg and port.
start_profiled() { # config-file callgrind-out
    TOKIO_WORKER_THREADS=${WORKERS:-1} EGRESS_LOG=warn valgrind --tool=callgrind --demangle=no --compress-strings=no \
        --dump-instr=yes --compress-pos=no --callgrind-out-file="$2" "$BIN" run --config "$1" 2>"$2.log" &
    vg=$!
    PIDS+=("$vg")
    wait_port "$port" 600
    sleep 2
    callgrind_control -z "$vg" >/dev/null
}

read -r fwd admin port < <(free_ports 3)
sidecar_conf "$fwd" "$admin" "$port" "$UP_PORT" 64 3s 6000 200 >"$TMP/sidecar.yaml"
start_profiled "$TMP/sidecar.yaml" "$TMP/callgrind.out"
check sidecar "http://127.0.0.1:$port/"
h2load --h1 -n 64 -c 64 "http://127.0.0.1:$port/" >/dev/null
# Idle connections: parked, evicted past max_idle_connections (200: the 100 parked first),
# woken by a request, closed while parked, timed out in the lot. With the 64 before, 365
# connections of 1.3 requests each, so the leak detector warns (and looks for the processes
# behind the source on a blocking thread) at the first close.
python3 - "$port" <<'PY'
import socket, sys, time
port = int(sys.argv[1])
def get(s):
    s.sendall(b"GET / HTTP/1.1\r\nHost: upstream\r\n\r\n")
    got = b""
    while not got.endswith(b"ok\n"):
        got += s.recv(4096)
conns = []
for _ in range(300):
    s = socket.create_connection(("127.0.0.1", port))
    get(s)
    conns.append(s)
time.sleep(1.5)
for s in conns[200:]:
    get(s)
for s in conns[100:180]:
    s.close()
time.sleep(1.5)
PY
# After the warning, or its source would not read as leaking.
h2load --h1 -n 2000 -c 8 "http://127.0.0.1:$port/" >/dev/null
sleep 7
stop_pid "$vg"

# compare.sh's workload 2, as it runs it: sidecar_conf without the downstream bounds lifted.
CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS= GOWORK=off go build -o "$TMP/leaky" tests/leaky/main.go
read -r fwd admin port < <(free_ports 3)
sidecar_conf "$fwd" "$admin" "$port" "$UP_PORT" 64 5s 6000 >"$TMP/storm.yaml"
start_profiled "$TMP/storm.yaml" "$TMP/callgrind.storm.out"
check sidecar "http://127.0.0.1:$port/"
"$TMP/leaky" -n 5000 -url "http://127.0.0.1:$port/" -wait 8s >/dev/null
stop_pid "$vg"

# Tunnels, as benches/idle_memory.sh opens them (item 3 of issue 47 counts idle tunnels too):
# CONNECT through the forward listener and WebSocket upgrades through the route listener, to
# idle_memory.py's echoing upstream; each carries a few bytes, sits idle, some carry more, and
# all close. Unlisted, their functions lie in the cold text: a fresh process's first 2,000
# CONNECT tunnels mapped 0.8-1.2 KB of code each.
read -r TUP_PORT < <(free_ports 1)
python3 benches/idle_memory.py upstream --port "$TUP_PORT" >"$TMP/tunnel-upstream.log" 2>&1 &
PIDS+=("$!")
wait_port "$TUP_PORT"
read -r fwd admin port < <(free_ports 3)
{
    sidecar_conf "$fwd" "$admin" "$port" "$TUP_PORT" 64 5m 6000 6000
    echo "policy: { connect_ports: [$TUP_PORT] }"
} >"$TMP/tunnels.yaml"
# Drives the sidecar listening on fwd and port: IDLE idle client connections (one GET each),
# then COUNT CONNECT and COUNT WebSocket tunnels that each carry a few bytes and sit idle SETTLE
# seconds; half carry more, then all close, and the idle clients in two halves, 2 s apart.
drive_tunnels() { # count idle settle
    python3 - "$fwd" "$port" "$TUP_PORT" "$@" <<'PY'
import asyncio, sys, types
sys.path.insert(0, "benches")
# The tunnels and idle clients idle_memory.sh measures, opened alike.
from idle_memory import HELLO, close_all, open_clients, open_tunnels
fwd, route, up, count, idle, settle = (int(a) for a in sys.argv[1:])
async def main():
    clients, failed = await open_clients(route, idle, "/", in_flight=4) if idle else ([], [])
    if failed:
        sys.exit(f"idle clients failed: {failed[:3]}")
    writers = []
    for kind in ("connect", "websocket"):
        opened, failed = await open_tunnels(types.SimpleNamespace(forward=fwd), route, up, count, kind)
        if failed:
            sys.exit(f"{kind} tunnels failed: {failed[:3]}")
        writers += opened
    await asyncio.sleep(settle)
    # More bytes on half of them, echoed back (left unread): carried both ways once idle.
    for w in writers[::2]:
        w.write(HELLO)
    await asyncio.gather(*(w.drain() for w in writers[::2]))
    await asyncio.sleep(1)
    for w in writers:
        w.close()
    await close_all(clients[: idle // 2])
    await asyncio.sleep(2)
    await close_all(clients[idle // 2:])
asyncio.run(main())
PY
}
start_profiled "$TMP/tunnels.yaml" "$TMP/callgrind.tunnels.out"
drive_tunnels 200 0 3
stop_pid "$vg"

# The same paths on tokio's multi-thread runtime, which the sidecar starts when it may use more
# than one core (TOKIO_WORKER_THREADS unset, no CPU limit or one of 2 or more, as
# benches/idle_memory.sh runs it): the scheduler's code and every task's harness (poll, wake,
# drop) are other functions there, named for the runtime's handle. The runs above all take the
# current-thread runtime; with only their names listed, a fresh 2-thread process's first burst
# of 2,000 idle client connections ran seven such functions from the cold text, and the plain
# build's burst mapped 732-992 KiB of text (180-320 with them listed; benches/first_burst.py).
# One-request connections, 300 idle ones (closed in two halves), keep-alive requests and both
# kinds of tunnel, to idle_memory.py's upstream. Not on two workers: eviction past
# max_idle_connections, idle timeouts, the leak warning, admin reads, many hosts.
# The tunnels run's config (and ports, free again).
WORKERS=2 start_profiled "$TMP/tunnels.yaml" "$TMP/callgrind.multi.out"
check sidecar "http://127.0.0.1:$port/"
h2load --h1 -n 64 -c 64 "http://127.0.0.1:$port/" >/dev/null
drive_tunnels 100 300 2
h2load --h1 -n 2000 -c 8 "http://127.0.0.1:$port/" >/dev/null
sleep 7
stop_pid "$vg"

# Many hosts, as benches/compare.sh's workload 8 meets them (item 4 of issue 47): one request
# to each of 300 hosts through the forward listener, /debug/pools and /metrics read after the
# burst and after the idle-out (45 s: the pool's idle timeout, then the sweep lets each host's
# upstream go). Unlisted, the code of dialing a new host, making its pool and series, the sweep
# and the admin's encoders lay in the cold text: 5,000 hosts left 1.2 MiB more of it mapped.
read -r MH_PORT < <(free_ports 1)
python3 benches/many_hosts.py upstream "$MH_PORT" >"$TMP/many-upstream.log" 2>&1 &
PIDS+=("$!")
wait_port "$MH_PORT"
read -r fwd admin port < <(free_ports 3)
sidecar_conf "$fwd" "$admin" "$port" "$UP_PORT" 64 5s 6000 >"$TMP/many.yaml"
start_profiled "$TMP/many.yaml" "$TMP/callgrind.many.out"
python3 benches/many_hosts.py --proxy "127.0.0.1:$fwd" --pid "$vg" --admin "127.0.0.1:$admin" \
    --port "$MH_PORT" --hosts 300 --step 100 --idle-wait 45 --sample 15 >/dev/null 2>"$TMP/many.err"
stop_pid "$vg"

# HTTP/2 and TLS upstreams, as benches/compare.sh's workloads 4, 6 and 7 reach them: h2c to
# nghttpd, HTTP/1.1 over TLS to nginx and h2 over TLS to nghttpd, the origin's certificate
# verified; GETs and POSTs with a body on each. Unlisted, the HTTP/2 client (wire::h2client,
# hpack, frames, the connection's task) and the TLS records' code lie in the cold text, and a
# fresh process's first requests to an LLM API over h2 map them page by page.
# shellcheck source=benches/compare_upstreams.sh
source benches/compare_upstreams.sh
POOL=64 MAX_STREAMS=100
make_tls_material
read -r H2C_PORT H1TLS_PORT H1TLS_STATUS H2TLS_PORT < <(free_ports 4)
start_nghttpd "$H2C_PORT" "$MAX_STREAMS"
start_nghttpd "$H2TLS_PORT" "$MAX_STREAMS" "$TMP/tls/origin.key" "$TMP/tls/origin.pem"
nginx_tls_upstream_conf upstream-tls "$H1TLS_PORT" "$H1TLS_STATUS" >"$TMP/upstream-tls.conf"
start_nginx upstream-tls "$LOAD_CPU"
for p in "$H2C_PORT" "$H1TLS_PORT" "$H2TLS_PORT"; do wait_port "$p"; done
read -r fwd admin port r_h1tls r_h2tls < <(free_ports 5)
cat >"$TMP/h2.yaml" <<EOF
listen: 127.0.0.1:$fwd
admin: 127.0.0.1:$admin
shutdown: { drain_timeout: 1s }
upstreams:
  - name: h2c
    url: http://127.0.0.1:$H2C_PORT
    listen: 127.0.0.1:$port
    protocol: http2
    pool: { max_connections: 64, max_pending: 4096, pending_timeout: 30s }
    http2: { max_streams_per_connection: $MAX_STREAMS }
  - name: h1tls
    url: https://127.0.0.1:$H1TLS_PORT
    listen: 127.0.0.1:$r_h1tls
    tls: { ca_file: $CA, server_name: $ORIGIN }
    pool: { max_connections: $POOL, max_idle: $POOL }
  - name: h2tls
    url: https://127.0.0.1:$H2TLS_PORT
    listen: 127.0.0.1:$r_h2tls
    tls: { ca_file: $CA, server_name: $ORIGIN }
    protocol: http2
    pool: { max_connections: $POOL, max_idle: $POOL, max_pending: 4096, pending_timeout: 30s }
    http2: { max_streams_per_connection: $MAX_STREAMS }
EOF
printf '{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}' >"$TMP/request.json"
# Twice: on the current-thread runtime (callgrind.h2.1.out), then on the multi-thread one
# (callgrind.h2.2.out).
for workers in 1 2; do
    WORKERS=$workers start_profiled "$TMP/h2.yaml" "$TMP/callgrind.h2.$workers.out"
    for p in "$port" "$r_h1tls" "$r_h2tls"; do
        wait_port "$p"
        h2load --h1 -n 1000 -c 32 "http://127.0.0.1:$p/" >"$TMP/h2load-$p.txt"
        h2load --h1 -n 200 -c 8 -d "$TMP/request.json" -H 'content-type: application/json' \
            "http://127.0.0.1:$p/" >>"$TMP/h2load-$p.txt"
        grep -c "succeeded, 0 failed" "$TMP/h2load-$p.txt" | grep -qx 2 || die "h2load to $p: $(cat "$TMP/h2load-$p.txt")"
    done
    stop_pid "$vg"
done

# Exclusive instructions per function of the executable (not libc's), from the callgrind
# output's fn= blocks; a cost line right after calls= belongs to the call, not the function.
# Four groups, each by instructions, a name in the first that has it: the HTTP/1.1 paths on the
# current-thread runtime, what the multi-thread runtime adds to them, then what only the HTTP/2
# and TLS upstreams ran on each runtime. One ranking over the HTTP/1.1 and HTTP/2 runs put the
# TLS library's entropy and record code among the HTTP/1.1 request path; apart, the HTTP/1.1
# paths stay as close together as before.
# The list holds a heading line per group ("# N title": the linker reads no function in it,
# and deploy/validate.sh skips it), so that ADD=1 puts the second build's new names of each
# group after the first build's names of that group, not after the whole list. A list without
# headings (made before the groups) would put every name in the first group: ADD=1 refuses it.
listed=/dev/null
if [ "${ADD:-0}" = 1 ]; then
    grep -q '^# 1 ' link/request-path.symbols ||
        die "ADD=1: link/request-path.symbols has no group headings; regenerate it without ADD first"
    cp link/request-path.symbols "$TMP/listed.symbols"
    listed="$TMP/listed.symbols"
fi
python3 - "$BIN" "$listed" \
    "+HTTP/1.1 paths, current-thread runtime" "$TMP/callgrind.out" "$TMP/callgrind.storm.out" \
    "$TMP/callgrind.tunnels.out" "$TMP/callgrind.many.out" \
    "+HTTP/1.1 paths, what the multi-thread runtime adds" "$TMP/callgrind.multi.out" \
    "+HTTP/2 and TLS upstreams, current-thread runtime" "$TMP/callgrind.h2.1.out" \
    "+HTTP/2 and TLS upstreams, what the multi-thread runtime adds" "$TMP/callgrind.h2.2.out" \
    >"$TMP/request-path.symbols" <<'PY'
import bisect, collections, os, re, subprocess, sys
executable = sys.argv.pop(1)
binary = os.path.basename(executable)
# The names listed before, by group; other comment lines are skipped.
before, group = collections.defaultdict(list), 1
for line in open(sys.argv.pop(1)):
    line = line.strip()
    heading = re.match(r"#\s*(\d+)\s", line)
    if heading:
        group = int(heading[1])
    elif line and not line.startswith("#"):
        before[group].append(line)
# Each name's group: the first group in which any build ran it. A name the first build ran only
# with HTTP/2 upstreams (its callers inlined elsewhere) that the second runs on the HTTP/1.1
# paths moves up to theirs.
group_of = {}
for group in sorted(before):
    for name in before[group]:
        group_of.setdefault(name, group)
# Symbols without a type, which valgrind does not read: the parts a profile-guided build's
# machine function splitter moves out of their functions (`<name>.cold`, the blocks the profile
# never or hardly ran), whose cost callgrind gives the function it jumped from, and the TLS
# library's assembly, which it names by address. Their code is named by the instructions'
# addresses in the binary (--dump-instr).
untyped = []
for line in subprocess.run(["readelf", "-sW", executable], capture_output=True, text=True, check=True).stdout.splitlines():
    f = line.split()
    # readelf writes sizes past 99,999 in hex.
    if len(f) == 8 and f[3] == "NOTYPE" and f[2] not in ("0", "Size"):
        untyped.append((int(f[1], 16), int(f[2], 0), f[7]))
untyped.sort()
def named(position, fn):
    address = int(position, 16)
    at = bisect.bisect_right(untyped, (address, float("inf"))) - 1
    if at >= 0 and address < untyped[at][0] + untyped[at][1]:
        return untyped[at][2]
    return fn
def costs(paths):
    cost, fn, obj, call = collections.Counter(), None, None, False
    for path in paths:
        for line in open(path):
            line = line.rstrip("\n")
            if line.startswith("ob="):
                obj = line[3:]
            elif line.startswith("fn="):
                fn, call = (obj, line[3:]), False
            elif line.startswith("calls="):
                call = True
            elif line and (line[0].isdigit() or line[0] in "+-*"):
                if call:
                    call = False
                elif fn and fn[0] and fn[0].endswith(binary):
                    fields = line.split()
                    cost[named(fields[0], fn[1])] += int(fields[-1])
    return cost
groups = []
for arg in sys.argv[1:]:
    if arg.startswith("+"):
        groups.append((arg[1:], []))
    else:
        groups[-1][1].append(arg)
added = collections.defaultdict(list)
for number, (title, paths) in enumerate(groups, 1):
    for name, n in sorted(costs(paths).items(), key=lambda kv: -kv[1]):
        # Functions without a symbol show as their address: nothing to order by.
        if n > 0 and not name.startswith("0x") and group_of.get(name, number + 1) > number:
            group_of[name] = number
            added[number].append(name)
# The paths only a race between threads takes: a lock another thread holds (the contended and
# slow paths of std's and parking_lot's locks), a JoinHandle dropped while its task runs, the
# multi-thread scheduler's own functions (a worker's queue overflowing, a parked worker woken).
# valgrind runs one thread at a time, so the multi-thread run above seldom takes them, and a
# real burst on two workers does: each first call mapped a fault-around window of the cold text
# (64 KiB; benches/first_burst.py). Named from the binary, listed with what that runtime adds.
RACED = re.compile(r"futex::(Mutex|RwLock)>::\w+_contended|parking_lot::raw_(rw)?(lock|mutex)::"
                   r"Raw\w+::\w+_slow|parking_lot_core::(word_lock::WordLock::\w+_slow|parking_lot::"
                   r"(park|unpark_\w+)\b)|^tokio::runtime::(task::raw::drop_join_handle_slow|"
                   r"scheduler::multi_thread::)")
def functions(*flags):
    out = subprocess.run(["nm", "--defined-only", *flags, executable], capture_output=True, text=True, check=True)
    return [line.split(" ", 2) for line in out.stdout.splitlines()]
for (_, kind, name), (_, _, plain) in zip(functions(), functions("-C")):
    if kind in "tT" and RACED.search(plain) and name not in group_of:
        group_of[name] = 2
        added[2].append(name)
for number, (title, paths) in enumerate(groups, 1):
    print(f"# {number} {title}")
    for name in before.pop(number, []) + added[number]:
        if group_of.pop(name, None) == number:
            print(name)
# Groups this script no longer makes: kept, last, under a heading of their own.
kept = [name for names in before.values() for name in names if group_of.pop(name, None) is not None]
if kept:
    print(f"# {len(groups) + 1} kept from an earlier list")
    print("\n".join(kept))
PY
mv "$TMP/request-path.symbols" link/request-path.symbols
log "link/request-path.symbols: $(grep -vc "^#" link/request-path.symbols) functions"
