#!/usr/bin/env python3
"""Idle-connection memory of egress-sidecar next to nginx. Run it through idle_memory.sh
(`measure`); benches/compare.sh uses its `idle-clients` probe on proxies it starts itself.

Question answered:
    What does one idle downstream keep-alive connection cost the sidecar, and one pooled idle
    upstream connection? And the same for nginx as a keep-alive reverse proxy?

Method (user-space memory only: VmRSS from /proc/PID/status, nginx = master + workers):
    A Python asyncio upstream (`upstream` subcommand) answers `ok\\n`, after 1 s on /sleep.
    Each measurement gets a fresh proxy process, configured to keep everything that is opened
    (sidecar: downstream.idle_timeout 5m, max_idle_connections and leaky_idle_timeout lifted so that
    the leak detector does not close the probe's one-request connections, pool max_connections/max_idle 1000, pool idle_timeout
    5m; nginx: keepalive_timeout 300s, `upstream { keepalive 1000; keepalive_timeout 300s; }`).

    downstream: warm up with 64 connections (one request each, then closed) so that one-time
                allocations and the upstream pool exist; read RSS; open N (5000) connections
                to the proxy, one GET / on each (at most 4 in flight, so the upstream pool does
                not grow), keep all open and idle; wait 1 s; read RSS.
                cost = delta RSS / (downstream connections the proxy holds, counted with ss).
    upstream:   warm up with 64 concurrent /sleep requests; read RSS; send M (1000) concurrent
                /sleep requests on M new client connections (started 0.5 ms apart, all in
                flight together), so that the pool dials up to M upstream connections, which go
                idle when the responses are done; wait 1 s; read RSS. The M client connections are still open, so
                cost = (delta RSS - new downstream conns x downstream cost) / new upstream conns
                (both counted with ss). Then the clients close and RSS is read once more: that
                figure keeps whatever the allocator did not give back from the closed clients.

Not counted: kernel memory (socket structures, buffers), which RSS does not include.
"""

import argparse
import asyncio
import os
import resource
import signal
import socket
import subprocess
import sys
import time

OK_BODY = b"ok\n"
# Downstream test: requests in flight at once. Kept low so that the upstream pool the warm-up
# made is enough and does not grow while downstream connections are counted.
DOWNSTREAM_IN_FLIGHT = 4
# Upstream test: the slow requests start this far apart (1000 in 0.5 s, all in flight together
# since each takes 1 s), so each finds the previous dial done: the pool dials at most
# max_connecting (8) at a time, and a simultaneous burst of 1000 gets fewer connections.
SPACING = 0.0005
# What a tunnel carries: sent, echoed, then idle.
HELLO = b"hello"
SWITCHED = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\n" + OK_BODY


def raise_nofile():
    """Lift the soft RLIMIT_NOFILE to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# === upstream ===


async def serve_upstream(port, sleep_s):
    async def echo(reader, writer):
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()

    async def handle(reader, writer):
        try:
            # A CONNECT tunnel's payload: echoed from then on.
            start = await reader.readexactly(len(HELLO))
            if start == HELLO:
                writer.write(HELLO)
                return await echo(reader, writer)
            while True:
                head = start + await reader.readuntil(b"\r\n\r\n")
                start = b""
                if b"\r\nupgrade:" in head.lower():
                    writer.write(SWITCHED)
                    return await echo(reader, writer)
                target = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b"/"
                if target.startswith(b"/sleep"):
                    await asyncio.sleep(sleep_s)
                writer.write(RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=8192)
    async with server:
        await server.serve_forever()


# === clients ===


async def read_response(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers
                break
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    else:
        body = b""
    return status, body


async def open_clients(port, n, path, in_flight=None, spacing=0.0):
    """Opens n connections, one GET each; returns (open connections, failure messages).

    in_flight: at most this many connections between connect and response at a time.
    spacing:   else connection i starts i * spacing seconds in, and all may be in flight at once.
    """
    sem = asyncio.Semaphore(in_flight or n)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()

    async def one(i):
        if spacing:
            await asyncio.sleep(i * spacing)
        async with sem:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            status, body = await read_response(reader)
        if status != 200 or body != OK_BODY:
            writer.close()
            raise RuntimeError(f"status {status}, body {body[:60]!r}")
        return writer

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True), 120)
    writers = [r for r in results if not isinstance(r, BaseException)]
    failures = [repr(r) for r in results if isinstance(r, BaseException)]
    return writers, failures


async def close_all(writers):
    for w in writers:
        w.close()
    await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)


# === measuring ===


def pids_of(root):
    """root and its direct children (nginx's workers)."""
    pids = [root]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == root:
                pids.append(int(entry))
    return pids


def rss_bytes(root, field="VmRSS"):
    """`field` of /proc/PID/status (VmRSS; RssAnon: the part that is not file pages), in
    bytes, summed over `root` and its children."""
    total = 0
    for pid in pids_of(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def established(sport=None, dport=None):
    """Established TCP connections on 127.0.0.1 by local (sport) or remote (dport) port."""
    flt = f"( sport = :{sport} )" if sport else f"( dport = :{dport} )"
    out = subprocess.run(["ss", "-Htn", "state", "established", flt], capture_output=True, text=True, check=True)
    return sum(1 for line in out.stdout.splitlines() if line.strip())


# Seconds waited before each RSS reading (IDLE_SETTLE, default 1): past 10, the readings come
# after the sidecar's heap trim has asked its threads to free the buffers they keep.
SETTLE_S = float(os.environ.get("IDLE_SETTLE", "1"))


async def settle():
    await asyncio.sleep(SETTLE_S)


def free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_port(port, proc, what, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} does not listen on 127.0.0.1:{port}")


def die_with_parent():
    """In the child: SIGTERM when this driver exits, however it exits (PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


class Proc:
    """A child process, stopped by its own pid."""

    def __init__(self, argv, log, env=None):
        self.log = open(log, "ab")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL, env=env,
                                  preexec_fn=die_with_parent)

    @property
    def pid(self):
        return self.p.pid

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


# === the proxies ===


def start_sidecar(args, up_port):
    fwd, admin, route = free_ports(3)
    conf = os.path.join(args.tmp, "sidecar.yaml")
    with open(conf, "w") as f:
        f.write(
            f"""listen: 127.0.0.1:{fwd}
admin: 127.0.0.1:{admin}
shutdown: {{ drain_timeout: 1s }}
downstream: {{ idle_timeout: 5m, max_connections: {args.downstream + 1000}, max_idle_connections: {args.downstream + 1000}, leaky_idle_timeout: 5m }}
policy: {{ connect_ports: [{up_port}] }}
upstreams:
  - name: bench
    url: http://127.0.0.1:{up_port}
    listen: 127.0.0.1:{route}
    pool:
      max_connections: {args.upstream}
      max_idle: {args.upstream}
      idle_timeout: 5m
      max_pending: {args.upstream * 2}
      pending_timeout: 30s
"""
        )
    env = dict(os.environ, EGRESS_LOG="warn", GLIBC_TUNABLES=args.tunables)
    proc = Proc([args.sidecar, "run", "--config", conf], os.path.join(args.tmp, "sidecar.log"), env)
    wait_port(route, proc.p, "sidecar")
    proc.forward = fwd
    return proc, route


def start_nginx(args, up_port):
    (port,) = free_ports(1)
    t = args.tmp
    conf = os.path.join(t, "nginx.conf")
    with open(conf, "w") as f:
        f.write(
            f"""pid {t}/nginx.pid;
error_log {t}/nginx.error.log warn;
worker_processes 1;
worker_rlimit_nofile {args.downstream + 2 * args.upstream + 1000};
events {{ worker_connections {args.downstream + 2 * args.upstream + 500}; }}
http {{
    access_log off;
    client_body_temp_path {t}/nginx.body;
    proxy_temp_path {t}/nginx.proxy;
    fastcgi_temp_path {t}/nginx.fastcgi;
    uwsgi_temp_path {t}/nginx.uwsgi;
    scgi_temp_path {t}/nginx.scgi;
    keepalive_timeout 300s;
    upstream bench {{
        server 127.0.0.1:{up_port};
        keepalive {args.upstream};
        keepalive_timeout 300s;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""
        )
    argv = ["nginx", "-p", t, "-e", f"{t}/nginx.error.log", "-c", conf, "-g", "daemon off;"]
    proc = Proc(argv, os.path.join(t, "nginx.out"))
    wait_port(port, proc.p, "nginx")
    return proc, port


def kib(n):
    return f"{n / 1024:,.0f} KiB"


async def idle_clients(pid, port, n, up_port=None, warm=64, heap=None):
    """On a proxy (root pid) listening on port: warm up with `warm` connections (one request
    each, then closed; none: the first burst of a fresh process), read RSS, open n connections
    with one GET / each (at most 4 in flight) and keep them idle, wait 1 s, read RSS. Returns
    (the open connections, a result dict). `heap`: reads the live heap in bytes (heap_in_use),
    before and after, for the result's `live` per connection."""
    if warm:
        warmed, _ = await open_clients(port, warm, "/", in_flight=DOWNSTREAM_IN_FLIGHT)
        await close_all(warmed)
    await settle()
    # First: gdb's call maps in libc's pages for printing, not to be counted per connection.
    base_heap = heap() if heap else None
    base, base_up = rss_bytes(pid), up_port and established(dport=up_port)
    base_anon = rss_bytes(pid, "RssAnon")
    conns, failed = await open_clients(port, n, "/", in_flight=DOWNSTREAM_IN_FLIGHT)
    await settle()
    after, held, after_up = rss_bytes(pid), established(sport=port), up_port and established(dport=up_port)
    anon = (rss_bytes(pid, "RssAnon") - base_anon) / max(held, 1)
    after_heap = heap() if base_heap is not None else None
    live = (after_heap - base_heap) / max(held, 1) if after_heap is not None else None
    return conns, {"base": base, "after": after, "held": held, "per": (after - base) / max(held, 1),
                   "anon": anon, "live": live,
                   "failed": len(failed), "first_failure": failed[0] if failed else "",
                   "base_up": base_up, "after_up": after_up}


async def measure_downstream(name, start, args, up_port):
    """RSS per idle client connection of the proxy `start` starts. With HEAP_STATS=1 in the
    environment (and gdb installed), also the sidecar's live heap per connection."""
    proc, port = start(args, up_port)
    heap = None
    if name == "sidecar" and os.environ.get("HEAP_STATS") == "1":
        log = os.path.join(args.tmp, "sidecar.log")
        heap = lambda: heap_in_use(proc.pid, log)  # noqa: E731
    try:
        conns, r = await idle_clients(proc.pid, port, args.downstream, up_port, args.warm, heap)
        await close_all(conns)
        live = f", {r['live']:,.0f} B live heap" if r["live"] is not None else ""
        print(
            f"{name:8} downstream: RSS {kib(r['base'])} -> {kib(r['after'])} with {r['held']} idle client "
            f"connections ({r['failed']} failed; upstream connections {r['base_up']} -> {r['after_up']}): "
            f"{r['per']:,.0f} B per idle downstream connection, {r['anon']:,.0f} B of it anonymous{live}",
            flush=True,
        )
        if r["failed"]:
            print(f"         first failure: {r['first_failure']}", flush=True)
        return r
    finally:
        proc.stop()


async def probe_idle(args):
    """The `idle-clients` subcommand: idle_clients on a proxy someone else started; one line
    `RESULT base=<B> after=<B> held=<n> per=<B> failed=<n>` on stdout."""
    raise_nofile()
    conns, r = await idle_clients(args.pid, args.port, args.count)
    await close_all(conns)
    if r["failed"]:
        print(f"first failure: {r['first_failure']}", file=sys.stderr)
    print(f"RESULT base={r['base']} after={r['after']} held={r['held']} per={r['per']:.0f} "
          f"failed={r['failed']}", flush=True)


async def open_tunnels(proc, route, up_port, n, kind):
    """Opens n tunnels through the sidecar that each carry HELLO both ways, then sit idle:
    `connect` (CONNECT to the upstream's port, an opaque tunnel) or `websocket` (an Upgrade
    answered 101 through the route listener). Returns (open connections, failure messages)."""
    sem = asyncio.Semaphore(16)
    if kind == "connect":
        port, head = proc.forward, f"CONNECT 127.0.0.1:{up_port} HTTP/1.1\r\nHost: 127.0.0.1:{up_port}\r\n\r\n"
        expect = 200
    else:
        port, head = route, ("GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n"
                             "Upgrade: websocket\r\n\r\n")
        expect = 101

    async def one():
        async with sem:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head.encode())
            answer = await reader.readuntil(b"\r\n\r\n")
            status = int(answer.split()[1])
            if status != expect:
                writer.close()
                raise RuntimeError(f"{kind}: status {status}")
            writer.write(HELLO)
            echoed = await reader.readexactly(len(HELLO))
            if echoed != HELLO:
                writer.close()
                raise RuntimeError(f"{kind}: echoed {echoed!r}")
        return writer

    results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n)), return_exceptions=True), 120)
    return ([r for r in results if not isinstance(r, BaseException)],
            [repr(r) for r in results if isinstance(r, BaseException)])


def heap_in_use(pid, log):
    """Bytes glibc's malloc has handed out and not had back, all arenas: `malloc_stats()` called
    in the process through gdb, which prints to its stderr (the log). None without gdb, or if
    the call printed nothing. gdb's exit status is not read: on some VMs it exits 1 after a
    call that worked ("Couldn't write extended state status")."""
    marker = "Total (incl. mmap):"
    with open(log) as f:
        printed = f.read().count(marker)
    try:
        subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "call (void)malloc_stats()"],
                       capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    time.sleep(0.2)
    with open(log) as f:
        text = f.read()
    if text.count(marker) <= printed:
        return None
    for line in text[text.rfind(marker):].splitlines():
        if line.startswith("in use bytes"):
            return int(line.split("=")[1])
    return None


async def measure_tunnels(args, up_port, kind):
    """RSS per idle tunnel of `kind` (see open_tunnels), on a fresh sidecar warmed with
    `args.warm` tunnels (none: its first burst).
    With HEAP_STATS=1 in the environment (and gdb installed), also the live heap per tunnel."""
    proc, route = start_sidecar(args, up_port)
    heap_stats = os.environ.get("HEAP_STATS") == "1"
    log = os.path.join(args.tmp, "sidecar.log")
    try:
        if args.warm:
            warm, failed = await open_tunnels(proc, route, up_port, args.warm, kind)
            # Idle long enough to be parked (after 100 ms), then closed through the wake: the
            # code the measured tunnels run is mapped in before the base reading, not counted
            # per tunnel.
            await asyncio.sleep(0.5)
            await close_all(warm)
        await settle()
        # First: gdb's call maps in libc's pages for printing, not to be counted per tunnel.
        base_heap = heap_in_use(proc.pid, log) if heap_stats else None
        base, base_up = rss_bytes(proc.pid), established(dport=up_port)
        base_anon = rss_bytes(proc.pid, "RssAnon")
        tunnels, failed = await open_tunnels(proc, route, up_port, args.tunnels, kind)
        await asyncio.sleep(3.0)
        early = rss_bytes(proc.pid)
        # Read again after IDLE_SETTLE, as the client connections are, so that both figures
        # come after the sidecar's heap trims alike (every 5 s); the 3 s reading is printed
        # beside it (on 2,000 tunnels the two differed by 0-8 B per tunnel, issue 47).
        if SETTLE_S > 3.0:
            await asyncio.sleep(SETTLE_S - 3.0)
        after, held = rss_bytes(proc.pid), established(dport=up_port) - base_up
        per = (after - base) / max(held, 1)
        at_3s = f" (at 3 s: {(early - base) / max(held, 1):,.0f} B)" if SETTLE_S > 3.0 else ""
        # RSS also counts the binary's pages read for the first time, once, not per tunnel;
        # anonymous memory is the tunnels' own state and the heap's slack around it.
        anon = (rss_bytes(proc.pid, "RssAnon") - base_anon) / max(held, 1)
        # What the tunnels' state takes on the heap, without the slack a burst leaves.
        heap = heap_in_use(proc.pid, log) if base_heap is not None else None
        live = f", {(heap - base_heap) / max(held, 1):,.0f} B live heap" if heap is not None else ""
        print(f"sidecar  {kind + ' tunnels:':19} RSS {kib(base)} -> {kib(after)} with {held} idle tunnels that "
              f"each carried {len(HELLO)} bytes each way ({len(failed)} failed): {per:,.0f} B per idle tunnel{at_3s}, "
              f"{anon:,.0f} B of it anonymous{live}",
              flush=True)
        if failed:
            print(f"         first failure: {failed[0]}", flush=True)
        await close_all(tunnels)
        return {"base": base, "after": after, "held": held, "per": per, "anon": anon, "failed": len(failed)}
    finally:
        proc.stop()


async def measure_upstream(name, start, args, up_port, per_downstream):
    proc, port = start(args, up_port)
    try:
        warm, failed = await open_clients(port, 64, "/sleep", spacing=SPACING)
        await close_all(warm)
        await settle()
        base, base_up, base_down = rss_bytes(proc.pid), established(dport=up_port), established(sport=port)
        t0 = time.monotonic()
        conns, failed = await open_clients(port, args.upstream, "/sleep", spacing=SPACING)
        elapsed = time.monotonic() - t0
        await settle()
        after, pooled, held = rss_bytes(proc.pid), established(dport=up_port), established(sport=port)
        await close_all(conns)
        await settle()
        closed = rss_bytes(proc.pid)
        new_up = max(pooled - base_up, 1)
        new_down = held - base_down
        per = (after - base - new_down * per_downstream) / new_up
        per_closed = (closed - base) / new_up
        print(
            f"{name:8} upstream:   RSS {kib(base)} -> {kib(after)} with {pooled} idle pooled upstream "
            f"connections (was {base_up}) and {held} idle client connections; {args.upstream} slow "
            f"requests took {elapsed:.1f}s, {len(failed)} failed: "
            f"({kib(after - base)} - {new_down} x {per_downstream:,.0f} B) / {new_up} = "
            f"{per:,.0f} B per pooled idle upstream connection; after the clients closed: RSS {kib(closed)}, "
            f"{per_closed:,.0f} B per pooled connection",
            flush=True,
        )
        if pooled < args.upstream:
            print(f"         note: {args.upstream} concurrent requests left only {pooled} pooled upstream "
                  f"connections (pool max_connections {args.upstream})", flush=True)
        if failed:
            print(f"         first failure: {failed[0]}", flush=True)
        return {"base": base, "after": after, "pooled": pooled, "new": new_up, "per": per,
                "closed": closed, "per_closed": per_closed, "failed": len(failed)}
    finally:
        proc.stop()


async def run(args):
    nofile = raise_nofile()
    need = args.downstream + 2 * args.upstream + 200
    if nofile < need:
        sys.exit(f"RLIMIT_NOFILE is {nofile}, need about {need}")
    (up_port,) = free_ports(1)
    upstream = Proc([sys.executable, os.path.abspath(__file__), "upstream", "--port", str(up_port)],
                    os.path.join(args.tmp, "upstream.log"))
    try:
        wait_port(up_port, upstream.p, "upstream")
        results = {}
        for name, start in (("sidecar", start_sidecar), ("nginx", start_nginx)):
            d = await measure_downstream(name, start, args, up_port)
            u = await measure_upstream(name, start, args, up_port, d["per"])
            results[name] = (d, u)
        tunnels = {kind: await measure_tunnels(args, up_port, kind) for kind in ("connect", "websocket")}
        report(args, results, tunnels)
    finally:
        upstream.stop()


def report(args, results, tunnels):
    print()
    print(f"## Idle connection memory (user-space RSS), N={args.downstream} downstream, "
          f"M={args.upstream} pooled upstream")
    print()
    print(f"- sidecar: {subprocess.run([args.sidecar, '--version'], capture_output=True, text=True).stdout.strip()}"
          f", default runtime ({os.cpu_count()} worker threads), not pinned, "
          f"GLIBC_TUNABLES={args.tunables or '(none)'}")
    ngx = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
    print(f"- nginx: {ngx.replace('nginx version: ', '')}, worker_processes 1, RSS = master + worker")
    print(f"- upstream: Python asyncio server, `ok\\n`, /sleep answers after 1 s")
    print()
    print("| proxy | RSS at start of downstream test | per idle downstream conn | per idle pooled upstream conn "
          "| same, after clients closed | failed requests |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (d, u) in results.items():
        print(f"| {name} | {kib(d['base'])} | {d['per']:,.0f} B ({d['held']} conns) | {u['per']:,.0f} B "
              f"({u['new']} new conns) | {u['per_closed']:,.0f} B | {d['failed'] + u['failed']} |")
    print()
    print("per idle downstream conn = (RSS with N idle clients - RSS before) / clients held (ss count)")
    print("per idle pooled upstream conn = (RSS after M slow requests - RSS before - new client conns x "
          "per-downstream cost) / new pooled upstream conns (ss count); clients still open")
    print()
    print(f"| sidecar, {args.tunnels} idle tunnels | RSS before | per idle tunnel | anonymous | failed |")
    print("|---|---:|---:|---:|---:|")
    for kind, t in tunnels.items():
        print(f"| {kind} | {kib(t['base'])} | {t['per']:,.0f} B ({t['held']} tunnels) | {t['anon']:,.0f} B "
              f"| {t['failed']} |")
    print()
    print(f"per idle tunnel = (RSS {max(3.0, SETTLE_S):g} s after opening the tunnels - RSS before) / upstream "
          "connections held (ss count); each tunnel carried 5 bytes each way first; anonymous = the same for RssAnon "
          "(RSS less the binary's pages read for the first time)")
    print("Kernel memory for the sockets is not in RSS and not counted.")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upstream", help="serve the test upstream")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--sleep", type=float, default=1.0)
    m = sub.add_parser("measure", help="run the measurement")
    m.add_argument("--sidecar", required=True, help="release egress-sidecar binary")
    m.add_argument("--tunables", default="", help="the sidecar's GLIBC_TUNABLES (the image's, or empty)")
    m.add_argument("--tmp", required=True, help="scratch directory for configs and logs")
    m.add_argument("--downstream", type=int, default=5000)
    m.add_argument("--upstream", type=int, default=1000)
    m.add_argument("--tunnels", type=int, default=1000)
    m.add_argument("--warm", type=int, default=64,
                   help="connections and tunnels opened and closed before the base reading (0: none)")
    ic = sub.add_parser("idle-clients", help="RSS base and growth per idle client on a running proxy")
    ic.add_argument("--pid", type=int, required=True, help="the proxy's root pid (children counted)")
    ic.add_argument("--port", type=int, required=True, help="the proxy's listening port")
    ic.add_argument("--count", type=int, default=5000)
    args = parser.parse_args()
    if args.cmd == "upstream":
        raise_nofile()
        asyncio.run(serve_upstream(args.port, args.sleep))
    elif args.cmd == "idle-clients":
        asyncio.run(probe_idle(args))
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
