#!/usr/bin/env bash
# benches/callgrind.sh: user-space instructions the sidecar spends per proxied request.
#
# Question answered:
#   Did a change make the request path cheaper? Wall-clock CPU per request on a shared VM moves
#   by 10-25% between runs (benches/RESULTS.md); callgrind's instruction count moves by well
#   under 1%, so it can compare two builds that differ by a few percent. It counts user space
#   only: syscalls and the kernel's TCP work (about 60% of the sidecar's CPU) are not in it.
#
# Method: the sidecar (release build, TOKIO_WORKER_THREADS=1, route mode, pool 64) runs under
#   valgrind --tool=callgrind in front of an nginx upstream (`return 200 "ok\n"`); h2load --h1
#   sends N keep-alive requests over 8 connections; the total instruction count (Ir) is read at
#   exit. Two runs, LOW and HIGH requests, and (Ir(HIGH) - Ir(LOW)) / (HIGH - LOW) cancels
#   start-up, connection set-up and shutdown.
#
# Usage (from the repo root):   benches/callgrind.sh [SIDECAR_BIN]
#   env: LOW (2000), HIGH (12000), KEEP (a directory: keep the callgrind.out files there, for
#        callgrind_annotate), UPSTREAM_EXTRA (YAML keys added to the upstream, one flow-style
#        line such as 'retry: { attempts: 3 }': the same run with a feature configured),
#        TOP_EXTRA (a top-level YAML line, such as 'access_log: { enabled: true, path: /tmp/a.log }'),
#        CLIENTS (8: h2load's connections; 64 is compare.sh's workload 1), UPSTREAM (h1: nginx;
#        h2c: nghttpd with 100 streams a connection and the sidecar's `protocol: http2`, the
#        path of compare.sh's workload 4, with CLIENTS=32 as in benches/RESULTS.md; h1tls and
#        h2tls: the origins of compare.sh's workloads 6 and 7, nginx and nghttpd over TLS with a
#        certificate from a CA made for the run, which the sidecar verifies for origin.bench
#        (`tls: { ca_file, server_name }`, pool 64; h2tls 100 streams a connection); the
#        count then holds the TLS records' encryption both ways),
#        DUMP_INSTR=1 (callgrind counts each instruction, for benches/cg_per_request.py),
#        CACHE_SIM=1 (callgrind's cache simulation, `--cache-sim=yes`: the kept outputs also
#        count instruction-cache misses, I1mr, per function, for `callgrind_annotate
#        --show=Ir,I1mr --sort=I1mr`; the summary line still reads instructions),
#        BRANCH_SIM=1 (callgrind's branch-prediction simulation, `--branch-sim=yes`: the kept
#        outputs also count conditional and indirect branches and their mispredictions, Bc,
#        Bcm, Bi, Bim, per function; a simple predictor's guesses, not a processor's),
#        TRACE_SAMPLE (a ratio such as 1.0: `tracing` on, every root request traced, the spans
#        posted as OTLP to the nginx upstream, which answers 200 as a collector would; the
#        export task's encoding and posts are in the count. Only with the plain h1 upstream:
#        with UPSTREAM_BODY=sse (a static file) or UPSTREAM=h2c every post fails, and the
#        count is the failure path's),
#        UPSTREAM_BODY (h1 only: `json`, an OpenAI chat completion with usage, answering POSTs
#        (h2load sends each a small JSON body); `sse`, an OpenAI stream of SSE_CHUNKS (400)
#        chunks with usage at the end, about 110 KB, a static file nginx serves to GETs:
#        instructions per request over its size give instructions per streamed MiB. Compare
#        `llm: { usage: off }` in UPSTREAM_EXTRA with the default `auto`; for `sse`, with
#        `llm: { usage: openai }`, as `auto` reads only POSTs on a host it does not know)
# Installs valgrind, nginx and nghttp2-client (h2load) with apt-get if missing.

set -euo pipefail

LOW=${LOW:-2000}
HIGH=${HIGH:-12000}

cd "$(dirname "$0")/.."
REPO=$(pwd)
# shellcheck source=benches/common.sh
source "$REPO/benches/common.sh"

ensure_tools valgrind:valgrind nginx:nginx h2load:nghttp2-client curl:curl
[[ -n ${1:-} ]] && SIDECAR_BIN=$1
build_sidecar
make_scratch egress-callgrind

UPSTREAM=${UPSTREAM:-h1}
read -r UP_PORT STATUS_PORT < <(free_ports 2)
case $UPSTREAM in
    h1)
        if [[ ${UPSTREAM_BODY:-} == sse ]]; then
            chat_completion_sse "${SSE_CHUNKS:-400}" >"$TMP/stream.sse"
            # nginx's workers run unprivileged: they must reach the file.
            chmod 755 "$TMP" && chmod 644 "$TMP/stream.sse"
        fi
        nginx_upstream_conf upstream "$UP_PORT" "$STATUS_PORT" >"$TMP/upstream.conf"
        start_nginx upstream "${LOAD_CPU:-0}"
        ;;
    h2c)
        ensure_tools nghttpd:nghttp2-server
        start_nghttpd "$UP_PORT" 100
        ;;
    h1tls | h2tls)
        ensure_tools openssl:openssl nghttpd:nghttp2-server
        # shellcheck source=benches/compare_upstreams.sh
        source "$REPO/benches/compare_upstreams.sh"
        POOL=64 MAX_STREAMS=100
        make_tls_material
        if [[ $UPSTREAM == h1tls ]]; then
            nginx_tls_upstream_conf upstream "$UP_PORT" "$STATUS_PORT" >"$TMP/upstream.conf"
            start_nginx upstream "${LOAD_CPU:-0}"
        else
            start_nghttpd "$UP_PORT" "$MAX_STREAMS" "$TMP/tls/origin.key" "$TMP/tls/origin.pem"
        fi
        ;;
    *) die "UPSTREAM: h1, h2c, h1tls or h2tls, not $UPSTREAM" ;;
esac
wait_port "$UP_PORT"

# Prints the instructions the sidecar executed while serving $1 requests.
instructions_for() { # requests
    local fwd admin port vg
    read -r fwd admin port < <(free_ports 3)
    if [[ $UPSTREAM == h2c ]]; then
        sidecar_h2_conf "$fwd" "$admin" "$port" "$UP_PORT" 100 >"$TMP/sidecar.yaml"
    elif [[ $UPSTREAM == h[12]tls ]]; then
        sidecar_tls_conf "$fwd" "$admin" "$port" "$UP_PORT" "http${UPSTREAM:1:1}" 5s 10000 >"$TMP/sidecar.yaml"
    else
        sidecar_conf "$fwd" "$admin" "$port" "$UP_PORT" 64 5s 10000 >"$TMP/sidecar.yaml"
    fi
    [[ -z ${UPSTREAM_EXTRA:-} ]] || printf '    %s\n' "$UPSTREAM_EXTRA" >>"$TMP/sidecar.yaml"
    [[ -z ${TOP_EXTRA:-} ]] || printf '%s\n' "$TOP_EXTRA" >>"$TMP/sidecar.yaml"
    [[ -z ${TRACE_SAMPLE:-} ]] ||
        printf 'tracing: { otlp: "http://127.0.0.1:%s", sample: %s }\n' "$UP_PORT" "$TRACE_SAMPLE" >>"$TMP/sidecar.yaml"
    TOKIO_WORKER_THREADS=1 EGRESS_LOG=warn valgrind --tool=callgrind ${DUMP_INSTR:+--dump-instr=yes} ${CACHE_SIM:+--cache-sim=yes} ${BRANCH_SIM:+--branch-sim=yes} \
        --callgrind-out-file="$TMP/callgrind.$1.out" "$BIN" run --config "$TMP/sidecar.yaml" \
        2>"$TMP/valgrind.$1.log" &
    vg=$!
    PIDS+=("$vg")
    wait_port "$port" 600
    local post=()
    if [[ ${UPSTREAM_BODY:-} == json ]]; then
        printf '{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}' >"$TMP/request.json"
        post=(-d "$TMP/request.json" -H 'content-type: application/json')
    fi
    h2load --h1 -n "$1" -c "${CLIENTS:-8}" "${post[@]}" "http://127.0.0.1:$port/" >"$TMP/h2load.$1.txt" 2>&1
    grep -q "$1 succeeded, 0 failed" "$TMP/h2load.$1.txt" || die "h2load: $(grep '^requests:' "$TMP/h2load.$1.txt")"
    stop_pid "$vg"
    [[ -z ${KEEP:-} ]] || cp "$TMP/callgrind.$1.out" "$KEEP/"
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$TMP/valgrind.$1.log"
}

log "callgrind: $LOW requests"
low=$(instructions_for "$LOW")
log "callgrind: $HIGH requests"
high=$(instructions_for "$HIGH")
[[ -n $low && -n $high ]] || die "no instruction count (logs in $TMP)"
echo "sidecar $("$BIN" --version | awk '{print $2}') ($BIN, $UPSTREAM upstream${UPSTREAM_BODY:+ answering $UPSTREAM_BODY}, ${CLIENTS:-8} clients${UPSTREAM_EXTRA:+, $UPSTREAM_EXTRA}${TOP_EXTRA:+, $TOP_EXTRA}${TRACE_SAMPLE:+, tracing sample $TRACE_SAMPLE}): $(( (high - low) / (HIGH - LOW) )) instructions per request" \
    "(Ir $low at $LOW requests, $high at $HIGH)"
if [[ ${UPSTREAM_BODY:-} == sse ]]; then
    size=$(stat -c %s "$TMP/stream.sse")
    echo "  the stream is $size bytes: $(( (high - low) / (HIGH - LOW) * 1048576 / size )) instructions per streamed MiB"
fi
