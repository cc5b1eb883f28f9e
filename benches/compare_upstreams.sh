# benches/compare_upstreams.sh: workloads 6-8 of benches/compare.sh, sourced by it after
# benches/common.sh. Owns the upstreams over TLS (a throwaway CA and the origin's certificate,
# nginx and nghttpd serving it, each proxy verifying it and pooling POOL connections), the
# forward-proxy configs of the many-hosts workload, their runs, and the RSS curves; fills
# compare.sh's table with put and uses its helpers (calc, mib, median, busy_cell) and target
# lists (TARGETS, PROXIES, SIDECARS). What each workload measures, and every setting, is
# documented in compare.sh's header.
# shellcheck shell=bash

# The name in the origin's certificate: every proxy sends it as SNI and verifies it (no /etc/hosts
# entry: each proxy dials 127.0.0.1 and is told the name in its own config).
ORIGIN=origin.bench

# === TLS material ===

# A throwaway CA and the origin's certificate signed by it (P-256; subjectAltName DNS:ORIGIN and
# IP:127.0.0.1; CA:FALSE, serverAuth), in $TMP/tls. Sets CA (the file every proxy trusts).
make_tls_material() {
    local d=$TMP/tls
    CA=$d/ca.pem
    [[ ! -s $CA ]] || return 0
    mkdir -p "$d"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
        -subj "/CN=egress-sidecar bench CA" -addext basicConstraints=critical,CA:TRUE \
        -addext keyUsage=critical,keyCertSign,cRLSign -keyout "$d/ca.key" -out "$CA" 2>"$d/openssl.log"
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$ORIGIN" \
        -keyout "$d/origin.key" -out "$d/origin.csr" 2>>"$d/openssl.log"
    printf '%s\n' "subjectAltName=DNS:$ORIGIN,IP:127.0.0.1" basicConstraints=critical,CA:FALSE \
        keyUsage=critical,digitalSignature extendedKeyUsage=serverAuth >"$d/origin.ext"
    openssl x509 -req -in "$d/origin.csr" -CA "$CA" -CAkey "$d/ca.key" -CAcreateserial -days 2 \
        -extfile "$d/origin.ext" -out "$d/origin.pem" 2>>"$d/openssl.log" || die "openssl: $(cat "$d/openssl.log")"
}

# === configs ===

# The HTTP/1.1 origin over TLS: nginx answering `ok\n` on PORT with the origin's certificate
# (TLS session cache on, tickets on by default), `stub_status` in plain HTTP on STATUS_PORT
# (its `accepts` counts the TLS connections the proxies dial).
nginx_tls_upstream_conf() { # name port status-port
    nginx_common "$1"
    echo "http {"
    nginx_http_common "$1"
    cat <<EOF
    server {
        listen 127.0.0.1:$2 ssl backlog=4096;
        ssl_certificate $TMP/tls/origin.pem;
        ssl_certificate_key $TMP/tls/origin.key;
        ssl_session_cache shared:origin:1m;
        location / { default_type text/plain; return 200 "ok\n"; }
    }
    server { listen 127.0.0.1:$3; location / { stub_status; } }
}
EOF
}

# nginx as a keep-alive reverse proxy to the origin over TLS: nginx_proxy_conf's pool
# (`keepalive POOL`, `max_conns=POOL`, HTTP/1.1, `Connection ""`), the certificate verified
# against CA for the name ORIGIN (sent as SNI), TLS sessions reused.
nginx_tls_proxy_conf() { # name listen-port upstream-port pool client-keepalive-timeout worker_connections
    nginx_proxy_conf "$1" "$2" "$3" "$4" "$5" "$6" "$(nginx_verify_lines proxy)"
}

# nginx in front of the h2 origin over TLS: `grpc_pass grpcs://` (common.sh's nginx_grpc_conf: one
# stream per upstream connection, POOL kept idle), verifying as nginx_tls_proxy_conf does.
nginx_grpc_tls_conf() { # name listen-port upstream-port pool client-keepalive-timeout worker_connections
    nginx_grpc_conf "$1" "$2" "$3" "$4" "$5" "$6" "$(nginx_verify_lines grpc)"
}

# The sidecar in front of the origin over TLS: route-mode listener, `tls: { ca_file, server_name }`,
# PROTOCOL (http1: pool max_connections = max_idle = POOL, as workload 1; http2: the same plus
# workload 4's max_pending 4096, pending_timeout 30s and MAX_STREAMS streams per connection).
sidecar_tls_conf() { # listen-port admin-port route-port upstream-port protocol idle-timeout max-connections
    cat <<EOF
listen: 127.0.0.1:$1
admin: 127.0.0.1:$2
shutdown: { drain_timeout: 1s }
downstream: { idle_timeout: $6, max_connections: $7 }
upstreams:
  - name: origin
    url: https://127.0.0.1:$4
    listen: 127.0.0.1:$3
    tls: { ca_file: $CA, server_name: $ORIGIN }
    protocol: $5
EOF
    if [[ $5 == http1 ]]; then
        echo "    pool: { max_connections: $POOL, max_idle: $POOL }"
    else
        echo "    pool: { max_connections: $POOL, max_idle: $POOL, max_pending: 4096, pending_timeout: 30s }"
        echo "    http2: { max_streams_per_connection: $MAX_STREAMS }"
    fi
}

# nginx as a forward proxy to whatever host an absolute-form request names: `proxy_pass` with a
# variable ($http_host, which nginx checks against the request line's authority), so there is
# no `upstream {}` block and no keep-alive pool: nginx's defaults (HTTP/1.0, `Connection: close`,
# one upstream connection per request). IP literals need no `resolver`.
nginx_forward_conf() { # name listen-port worker_connections
    nginx_common "$1" "$3"
    echo "http {"
    nginx_http_common "$1" 60s
    cat <<EOF
    server {
        listen 127.0.0.1:$2 backlog=4096;
        location / { proxy_pass http://\$http_host; }
    }
}
EOF
}

# HAProxy 2.6 as a forward proxy: `server s 0.0.0.0:0` and the destination taken from the
# absolute-form request line (`http-request set-dst url_ip`, `set-dst-port url_port`; HAProxy
# itself rejects a Host header that disagrees with it), the request sent in origin-form
# (`set-uri %[pathq]`). `http-reuse always`: idle server connections are kept and reused per
# destination (its connection hash includes the address set by set-dst), purged by HAProxy's
# pool-purge-delay (5 s).
haproxy_forward_conf() { # name listen-port maxconn
    cat <<EOF
global
    nbthread 1
    maxconn $3
    stats socket $TMP/$1.sock mode 600 level admin

defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 60s
    timeout http-keep-alive 60s
    http-reuse always

frontend fe
    bind 127.0.0.1:$2 backlog 4096
    maxconn $3
    default_backend be

backend be
    http-request set-dst url_ip
    http-request set-dst-port url_port
    http-request set-uri %[pathq]
    server s 0.0.0.0:0
EOF
}

# === workloads 6 and 7: HTTP/1.1 and h2 over TLS ===

# Starts TARGET fresh for workload 6 (KIND h1: the nginx origin) or 7 (h2: nghttpd) on the
# origin's PORT; sets T_PID ("-" for direct), T_PORT and T_URL, and checks that it answers
# (direct: curl verifying the origin's certificate for ORIGIN).
start_tls_target() { # h1|h2 target upstream-port
    local kind=$1 t=$2 up=$3 fwd admin srv
    srv="127.0.0.1:$up ssl verify required ca-file $CA sni str($ORIGIN) verifyhost $ORIGIN"
    case $t in
    direct)
        T_PID=- T_PORT=$up T_URL=https://127.0.0.1:$up/
        check "$t" "https://$ORIGIN:$up/" --cacert "$CA" --resolve "$ORIGIN:$up:127.0.0.1"
        return ;;
    sidecar | sidecar-plain)
        read -r fwd admin T_PORT < <(free_ports 3)
        sidecar_tls_conf "$fwd" "$admin" "$T_PORT" "$up" "$([[ $kind == h1 ]] && echo http1 || echo http2)" \
            "${IDLE_TIMEOUT}s" "$MAXCONN" >"$TMP/$t-$kind-tls.yaml"
        start_sidecar "$TMP/$t-$kind-tls.yaml" "$PROXY_CPU" "$(sidecar_bin "$t")"
        T_PID=$SC_PID ;;
    nginx)
        read -r T_PORT < <(free_ports 1)
        if [[ $kind == h1 ]]; then
            nginx_tls_proxy_conf nginx-tls "$T_PORT" "$up" "$POOL" "${IDLE_TIMEOUT}s" $((MAXCONN + POOL + 64)) \
                >"$TMP/nginx-tls.conf"
        else
            nginx_grpc_tls_conf nginx-tls "$T_PORT" "$up" "$POOL" "${IDLE_TIMEOUT}s" $((MAXCONN + 2 * CONNECTIONS + 64)) \
                >"$TMP/nginx-tls.conf"
        fi
        start_nginx nginx-tls "$PROXY_CPU"
        T_PID=$NGINX_PID ;;
    haproxy)
        read -r T_PORT < <(free_ports 1)
        if [[ $kind == h1 ]]; then
            haproxy_conf haproxy-tls "$T_PORT" "$MAXCONN" "${IDLE_TIMEOUT}s" \
                "$srv maxconn $POOL pool-max-conn $POOL" >"$TMP/haproxy-tls.cfg"
        else
            haproxy_conf haproxy-tls "$T_PORT" "$MAXCONN" "${IDLE_TIMEOUT}s" \
                "$srv alpn h2 pool-max-conn $POOL" "$(hap_streams_keyword) $MAX_STREAMS" >"$TMP/haproxy-tls.cfg"
        fi
        start_haproxy haproxy-tls "$PROXY_CPU"
        T_PID=$HAP_PID ;;
    esac
    T_URL=http://127.0.0.1:$T_PORT/
    wait_port "$T_PORT"
    check "$t" "$T_URL"
}

# h2load straight to an h2 upstream with CLIENTS streams in flight: ceil(CLIENTS / MAX_STREAMS)
# connections, CLIENTS / connections streams each, after a WARMUP warm-up. Sets wrk_measure's
# W_REQUESTS, W_DURATION_US, W_P99_US, W_P999_US and W_ERRORS (done - 2xx).
h2_direct() { # url clients duration outfile
    local conns=$(( ($2 + MAX_STREAMS - 1) / MAX_STREAMS ))
    h2load_measure "$1" "$conns" $(( ($2 + conns - 1) / conns )) "$3" "$WARMUP" "$4"
    # shellcheck disable=SC2153 # H_* come from h2load_measure
    W_REQUESTS=$H_DONE W_P99_US=$H_P99_US W_P999_US=$H_P999_US W_ERRORS=$((H_DONE - H_OK))
    W_DURATION_US=$(calc "\"%d\", $(secs_of "$3") * 1e6")
}

# Connections the TLS origin (workload 6) has accepted so far (this query's own included).
tls_accepts() {
    curl -sS --max-time 5 "http://127.0.0.1:$TLS_STATUS_PORT/" | awk 'NR == 3 { print $1 }'
}

# ROUNDS rounds, the targets in turn within each, each run on a fresh process: a WARMUP wrk run,
# then DURATION measured with CONNECTIONS clients (workload 7's direct: h2load). Workload 6
# counts the TLS connections each run dialed (start, warm-up and run), workload 7 the largest
# number of upstream connections seen during the measured run.
tls_rounds() { # h1|h2 workload-number upstream-port
    local kind=$1 n=$2 up=$3 round t a0 row w
    if [[ $kind == h1 ]]; then w=$W6; else w=$W7; fi
    for ((round = 1; round <= ROUNDS; round++)); do
        for t in "${TARGETS[@]}"; do
            log "workload $n, round $round/$ROUNDS, $t: warm-up $WARMUP, then $DURATION with $CONNECTIONS clients"
            [[ $kind == h2 ]] || a0=$(tls_accepts)
            start_tls_target "$kind" "$t" "$up"
            if [[ $kind == h2 && $t == direct ]]; then
                h2_direct "$T_URL" "$CONNECTIONS" "$DURATION" "$TMP/w$n.$t.$round.txt"
            else
                wrk_warm "$T_URL" "$CONNECTIONS" "$WARMUP"
                [[ $kind == h1 || $t == direct ]] || start_sampler "$T_PID" "$up" "$TMP/w$n.conns.$t.$round"
                wrk_measure "$T_URL" "$CONNECTIONS" "$DURATION" "$T_PID" "$TMP/w$n.$t.$round.txt"
                [[ $kind == h1 || $t == direct ]] || stop_pid "$SAMPLER_PID"
            fi
            record_round "$n" "$t"
            stop_target
            if [[ $kind == h1 ]]; then
                # The second stub_status query is itself one accepted connection.
                TR[$n|dials|$t]+=" $(( $(tls_accepts) - a0 - 1 ))"
            elif [[ $t != direct ]]; then
                TR[$n|conns|$t]+=" $(awk '$2 > m { m = $2 } END { print m + 0 }' "$TMP/w$n.conns.$t.$round")"
            fi
        done
    done
    # shellcheck disable=SC2086 # the per-round lists split into words on purpose
    for t in "${TARGETS[@]}"; do
        put "$w requests/s (median)" "$t" "$(median %.0f ${TR[$n|rps|$t]})"
        ((ROUNDS == 1)) || put "$w requests/s, each round" "$t" "$(each "${TR[$n|rps|$t]}")"
        put "$w p99 latency (ms, median)" "$t" "$(median %.2f ${TR[$n|p99|$t]})"
        put "$w p99.9 latency (ms, median)" "$t" "$(median %.2f ${TR[$n|p999|$t]})"
        put "$w errors (all rounds)" "$t" "${TR[$n|err|$t]}"
        if [[ $t == direct ]]; then
            [[ $kind == h2 ]] ||
                put "$w upstream TLS connections dialed per run (median)" "$t" "$(median %.0f ${TR[$n|dials|$t]})"
            [[ $kind == h1 ]] || put "$w upstream connections (max seen, median)" "$t" \
                "$(( (CONNECTIONS + MAX_STREAMS - 1) / MAX_STREAMS )) (h2load -c)"
            continue
        fi
        put "$w proxy CPU µs/request (median)" "$t" "$(median %.1f ${TR[$n|cpu|$t]})"
        ((ROUNDS == 1)) || put "$w proxy CPU µs/request, each round" "$t" "$(each "${TR[$n|cpu|$t]}")"
        put "$w of which in the kernel (µs/request, median)" "$t" "$(median %.1f ${TR[$n|sys|$t]})"
        put "$w in user space (µs/request, median)" "$t" "$(median %.2f ${TR[$n|usr|$t]})"
        put "$w $BUSY" "$t" "$(busy_cell ${TR[$n|ticks|$t]})"
        if [[ $kind == h1 ]]; then
            put "$w upstream TLS connections dialed per run (median)" "$t" "$(median %.0f ${TR[$n|dials|$t]})"
        else
            put "$w upstream connections (max seen, median)" "$t" "$(median %.0f ${TR[$n|conns|$t]})"
        fi
    done
}

workload6() {
    make_tls_material
    local port
    read -r port TLS_STATUS_PORT < <(free_ports 2)
    nginx_tls_upstream_conf upstream-tls "$port" "$TLS_STATUS_PORT" >"$TMP/upstream-tls.conf"
    start_nginx upstream-tls "$LOAD_CPU"
    local pid=$NGINX_PID
    wait_port "$port"
    wait_port "$TLS_STATUS_PORT"
    tls_rounds h1 6 "$port"
    stop_pid "$pid"
}

workload7() {
    make_tls_material
    local port
    read -r port < <(free_ports 1)
    start_nghttpd "$port" "$MAX_STREAMS" "$TMP/tls/origin.key" "$TMP/tls/origin.pem"
    local pid=$NGHTTPD_PID
    wait_port "$port"
    tls_rounds h2 7 "$port"
    stop_pid "$pid"
}

# === workload 8: many hosts ===

# Starts TARGET as a forward proxy (the sidecar: its forward listener with no config beyond the
# listeners, i.e. every default and no memory budget); sets T_PID, T_PORT and MH_ADMIN (the
# sidecar's admin listener, empty for the peers).
start_forward_target() { # target
    local fwd admin
    MH_ADMIN=
    case $1 in
    sidecar | sidecar-plain)
        read -r fwd admin < <(free_ports 2)
        printf 'listen: 127.0.0.1:%s\nadmin: 127.0.0.1:%s\nshutdown: { drain_timeout: 1s }\n' \
            "$fwd" "$admin" >"$TMP/$1-forward.yaml"
        start_sidecar "$TMP/$1-forward.yaml" "$PROXY_CPU" "$(sidecar_bin "$1")"
        T_PID=$SC_PID T_PORT=$fwd MH_ADMIN=127.0.0.1:$admin ;;
    nginx)
        read -r T_PORT < <(free_ports 1)
        nginx_forward_conf nginx-forward "$T_PORT" $((MAXCONN + 64)) >"$TMP/nginx-forward.conf"
        start_nginx nginx-forward "$PROXY_CPU"
        T_PID=$NGINX_PID ;;
    haproxy)
        read -r T_PORT < <(free_ports 1)
        haproxy_forward_conf haproxy-forward "$T_PORT" "$MAXCONN" >"$TMP/haproxy-forward.cfg"
        start_haproxy haproxy-forward "$PROXY_CPU"
        T_PID=$HAP_PID ;;
    esac
    wait_port "$T_PORT"
}

# From many_hosts.py's JSON (stdout): shell assignments of the figures the rows need (RSS in KiB,
# admin sizes in bytes, "" where not measured), and CURVE, the points as one compact line.
many_hosts_fields() { # json-file
    python3 - "$1" <<'PY'
import json, shlex, sys
r = json.load(open(sys.argv[1]))
pts = r["points"]
def last(label, i):
    got = [p for p in pts if p[0] == label]
    return got[-1][i] if got else ""
def sizes(key):
    a = r.get(key)
    return "" if a is None else f'{a.get("/debug/pools", "?")} {a.get("/metrics", "?")}'
curve, prev = [], None
for label, secs, hosts, kib, *_ in pts:
    curve.append(("" if label == prev else label + " ") + f"({hosts}, {secs:g}, {kib / 1024:.1f})")
    prev = label
out = {
    "m_start": last("start", 3), "m_sent": last("sent", 3), "m_sent_s": last("sent", 1),
    "m_idle": last("idle", 3), "m_forget": last("forget", 3),
    "m_anon": " · ".join(str(last(p, 4)) for p in ("start", "idle", "forget") if last(p, 4) != ""),
    "m_conns_idle": r.get("upstream_connections_after_idle", ""),
    "m_adm_sent": sizes("admin_after_sending"), "m_adm_idle": sizes("admin_after_idle"),
    "m_adm_forget": sizes("admin_after_forget"), "m_curve": " · ".join(curve),
}
for k, v in out.items():
    print(f"{k}={shlex.quote(str(v))}")
PY
}

# "a · b · c" from field COLUMN of each non-empty "pools metrics" pair.
sizes_cell() { # column pair...
    local col=$1
    shift
    printf '%s\n' "$@" | awk -v c="$col" 'NF { printf "%s%s", s, $c; s = " · " }'
}

workload8() {
    local w=$W8 t port pid forget more out sfx=
    ((MANY_HOSTS_FORGET_WAIT == 0)) || sfx=" · forgotten"
    local m_start m_sent m_sent_s m_idle m_forget m_anon m_conns_idle m_adm_sent m_adm_idle m_adm_forget m_curve
    read -r port < <(free_ports 1)
    taskset -c "$LOAD_CPU" python3 "$REPO/benches/many_hosts.py" upstream "$port" >"$TMP/many-upstream.log" 2>&1 &
    local up_pid=$!
    PIDS+=("$up_pid")
    wait_port "$port"
    for t in "${PROXIES[@]}"; do
        forget=0
        [[ $t != sidecar* ]] || forget=$MANY_HOSTS_FORGET_WAIT
        more=
        ((forget == 0)) || more=" and ${forget}s more"
        log "workload 8, $t: one request to each of $MANY_HOSTS hosts, then ${MANY_HOSTS_IDLE_WAIT}s idle$more"
        start_forward_target "$t"
        # The warm-up host of many_hosts.py: no host more for the proxy to remember.
        check "$t" "http://127.0.0.2:$port/" -x "http://127.0.0.1:$T_PORT"
        out=$TMP/many.$t.json
        taskset -c "$LOAD_CPU" python3 "$REPO/benches/many_hosts.py" --proxy "127.0.0.1:$T_PORT" --pid "$T_PID" \
            ${MH_ADMIN:+--admin "$MH_ADMIN"} --port "$port" --hosts "$MANY_HOSTS" \
            --idle-wait "$MANY_HOSTS_IDLE_WAIT" --forget-wait "$forget" >"$out" 2>"$TMP/many.$t.err" &
        pid=$!
        PIDS+=("$pid")
        wait "$pid" || die "many_hosts.py ($t) failed: $(tail -3 "$TMP/many.$t.err")"
        drop_pid "$pid"
        eval "$(many_hosts_fields "$out")"
        put "$w RSS at the start (MiB)" "$t" "$(mib "$m_start")"
        put "$w RSS after the $MANY_HOSTS hosts (MiB)" "$t" "$(mib "$m_sent")"
        put "$w time to send them (s)" "$t" "$m_sent_s"
        put "$w RSS ${MANY_HOSTS_IDLE_WAIT} s later, connections idled out (MiB)" "$t" "$(mib "$m_idle")"
        put "$w growth per host after idle-out (B)" "$t" "$(calc "\"%.0f\", ($m_idle - $m_start) * 1024 / $MANY_HOSTS")"
        put "$w upstream conns open after idle-out (/metrics)" "$t" "${m_conns_idle:-n/a}"
        put "$w of the RSS, anonymous (KiB): start · idle$sfx" "$t" "$m_anon"
        if ((MANY_HOSTS_FORGET_WAIT)); then
            if [[ -n $m_forget ]]; then
                put "$w RSS ${MANY_HOSTS_FORGET_WAIT} s more, hosts forgotten (MiB)" "$t" "$(mib "$m_forget")"
                put "$w forgotten - start (MiB)" "$t" "$(calc "\"%.1f\", ($m_forget - $m_start) / 1024")"
            else
                put "$w RSS ${MANY_HOSTS_FORGET_WAIT} s more, hosts forgotten (MiB)" "$t" "n/a"
                put "$w forgotten - start (MiB)" "$t" "n/a"
            fi
        fi
        if [[ -n $MH_ADMIN ]]; then
            put "$w /debug/pools bytes: sent · idle$sfx" "$t" "$(sizes_cell 1 "$m_adm_sent" "$m_adm_idle" "$m_adm_forget")"
            put "$w /metrics bytes: sent · idle$sfx" "$t" "$(sizes_cell 2 "$m_adm_sent" "$m_adm_idle" "$m_adm_forget")"
        else
            put "$w /debug/pools bytes: sent · idle$sfx" "$t" "n/a"
            put "$w /metrics bytes: sent · idle$sfx" "$t" "n/a"
        fi
        CURVES+=("- $t: $m_curve")
        stop_target
    done
    stop_pid "$up_pid"
}
