# benches/common.sh: helpers the bench scripts share; sourced from the repo root after
# `REPO=$(pwd)`. Defines log/die, builds or finds the sidecar (BIN), makes the scratch dir (TMP)
# whose cleanup also stops every PID in PIDS, and finds free loopback ports.

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Sets BIN: $SIDECAR_BIN, or a release build in $CARGO_TARGET_DIR (default target/bench).
build_sidecar() {
    if [[ -n ${SIDECAR_BIN:-} ]]; then
        BIN=$SIDECAR_BIN
    else
        export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target/bench}
        log "building the sidecar (release, CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
        cargo build --release --quiet --bin egress-sidecar
        BIN=$CARGO_TARGET_DIR/release/egress-sidecar
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

# Busy ticks of one CPU (all processes, IRQs and steal included), from /proc/stat.
core_busy() { # cpu
    awk -v c="cpu$1" '$1 == c { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat
}

# utime+stime of a process and its direct children (e.g. nginx workers), in clock ticks.
cpu_ticks() { # pid
    local total=0 p f
    for p in "$1" $(pgrep -P "$1" || true); do
        # Fields after the ")" of comm: state is field 3, utime 14, stime 15.
        f=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null) || continue
        set -- $f
        total=$((total + ${12} + ${13}))
    done
    echo "$total"
}
