"""Keep-alive HTTP/1.1 client of benches/tunnel.sh and benches/parent.sh; prints one RESULT line.

Opens CONNS keep-alive connections to the proxy on 127.0.0.1:PORT (each first tunnelled with
CONNECT in `tunnel` mode), warms each with WARMUP requests, then sends TOTAL requests for
`GET http://TARGET/` (absolute-form; origin-form inside a tunnel), one at a time per
connection, each in its own thread, checking every answer (200, body "ok\\n", and Squid's Via
header present or absent as --via asks). Around the measured part it reads the CPU of each
--pid (utime+stime from /proc/PID/stat, and the run time summed from the threads' schedstat, of
the process and its direct children) and the first one's voluntary context switches.

RESULT fields: requests, wall_s, rps; per --pid NAME=PID: stat_us_per_req, sched_us_per_req and
sleeps_per_req, prefixed `NAME_` for every pid after the first.
"""
import argparse, os, socket, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True, help="the proxy's listener")
p.add_argument("--target", required=True, help="host:port the requests are for")
p.add_argument("--tunnel", action="store_true", help="CONNECT first, then origin-form inside")
p.add_argument("--via", choices=["yes", "no", "any"], default="any", help="Squid's Via header")
p.add_argument("--pid", action="append", default=[], help="NAME=PID whose CPU is measured")
p.add_argument("--total", type=int, required=True)
p.add_argument("--conns", type=int, required=True)
p.add_argument("--warmup", type=int, required=True)
args = p.parse_args()
pids = [tuple(x.split("=", 1)) for x in args.pid]
target = args.target
if args.tunnel:
    request = f"GET / HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
else:
    request = f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
TICK = os.sysconf("SC_CLK_TCK")


def tree(pid):
    """pid and its direct children (Squid's auth helpers)."""
    found = [pid]
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += f.read().split()
        except FileNotFoundError:
            pass
    return found


def switches(pid):
    """Voluntary context switches of pid's threads: how often it went idle (and was woken)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                n += sum(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
        except FileNotFoundError:
            pass
    return n


def cpu(pid):
    """(utime+stime seconds, summed schedstat run time seconds) of pid and its children, and
    pid's voluntary context switches."""
    ticks = run_ns = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    run_ns += int(f.read().split()[0])
        except FileNotFoundError:
            pass
    return ticks / TICK, run_ns / 1e9, switches(pid)


class Conn:
    def __init__(self):
        self.sock = socket.create_connection(("127.0.0.1", args.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        if args.tunnel:
            self.sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            head = self.head()
            assert head.startswith(b"HTTP/1.1 200"), head

    def head(self):
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                head, self.buf = self.buf[:end], self.buf[end + 4:]
                return head
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("closed")
            self.buf += chunk

    def get(self):
        self.sock.sendall(request)
        head = self.head()
        if not head.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(head.decode(errors="replace"))
        length, via = 0, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"via" and b"squid" in value.lower():
                via = True
        if args.via != "any" and via != (args.via == "yes"):
            raise RuntimeError(f"Squid's Via header {'missing' if args.via == 'yes' else 'present'}")
        while len(self.buf) < length:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("closed mid-body")
            self.buf += chunk
        body, self.buf = self.buf[:length], self.buf[length:]
        if body != b"ok\n":
            raise RuntimeError(f"body {body!r}")


connections = [Conn() for _ in range(args.conns)]
for c in connections:
    for _ in range(args.warmup):
        c.get()
start = threading.Barrier(args.conns + 1)
errors = []


def work(c, n):
    start.wait()
    try:
        for _ in range(n):
            c.get()
    except Exception as e:  # reported, and the run counts as failed
        errors.append(repr(e))


total, conns = args.total, args.conns
share = [total // conns + (1 if i < total % conns else 0) for i in range(conns)]
threads = [threading.Thread(target=work, args=(c, n)) for c, n in zip(connections, share)]
for t in threads:
    t.start()
before, wall0 = [cpu(pid) for _, pid in pids], time.monotonic()
start.wait()
for t in threads:
    t.join()
wall, after = time.monotonic() - wall0, [cpu(pid) for _, pid in pids]
if errors:
    sys.exit(f"{len(errors)} connections failed: {errors[:3]}")
out = f"RESULT requests={total} wall_s={wall:.2f} rps={total / wall:.0f}"
for i, ((name, _), a, b) in enumerate(zip(pids, before, after)):
    prefix = "" if i == 0 else f"{name}_"
    out += (f" {prefix}stat_us_per_req={(b[0] - a[0]) / total * 1e6:.2f}"
            f" {prefix}sched_us_per_req={(b[1] - a[1]) / total * 1e6:.2f}"
            f" {prefix}sleeps_per_req={(b[2] - a[2]) / total:.2f}")
print(out)
