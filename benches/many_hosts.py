#!/usr/bin/env python3
"""Memory of a forward proxy that meets many distinct hosts on the fly (issue 47, item 4).

Question answered:
    A forward proxy sent one request to each of N distinct hosts (webhook senders, crawlers,
    multi-tenant callers): how much memory does it keep per host while it remembers them, once
    every upstream connection has idled out, and how much once it has forgotten them?

Method (user-space memory: VmRSS of the proxy's pid and its children, from /proc):
    An asyncio upstream listens on 0.0.0.0:PORT and answers `ok\\n` to every request. The N hosts
    are N loopback addresses (127.0.1.1, 127.0.1.2, ... all of 127/8 reaches it on Linux), so
    each is a distinct authority to the proxy and no DNS is involved. The client sends
    `GET http://127.a.b.c:PORT/ HTTP/1.1` in absolute form through the proxy, on CLIENTS
    keep-alive connections taking turns, one request per host. Before the hosts, 64 requests to
    one warm-up host (127.0.0.2), so one-time allocations exist; then RSS is the start.
    RSS is read after every STEP hosts (the curve), then every SAMPLE seconds while the proxy's
    upstream connections idle out (`--idle-wait`) and, with `--forget-wait`, until the hosts are
    forgotten. `/debug/pools` and `/metrics` sizes are read from the admin listener when given.

Prints one JSON object: {"points": [[label, seconds, hosts, rss_kib, anon_kib], ...], ...}.
Run it through benches/compare.sh (the many-hosts workload) or by hand:
    benches/many_hosts.py --proxy 127.0.0.1:15080 --pid PID --admin 127.0.0.1:15081 --hosts 5000
"""

import argparse
import asyncio
import json
import os
import socket
import sys
import time
import urllib.request

from idle_memory import rss_bytes  # the idle-memory bench's reading of /proc, children summed

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nok\n"


def rss_kib(pid, field="VmRSS"):
    """`field` of /proc/PID/status (VmRSS; RssAnon: the part that is not file pages, such as
    code faulted in) of pid and its descendants (nginx: master + workers), in KiB."""
    return rss_bytes(pid, field) // 1024


def host(i):
    """The i-th distinct host: 127.1.0.1 upwards, skipping .0 and .255."""
    i += 1 * 254 * 254
    a, rest = divmod(i, 254 * 254)
    b, c = divmod(rest, 254)
    return f"127.{a}.{b}.{c + 1}"


# === upstream ===


async def serve(port):
    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head:
                    break
                writer.write(RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "0.0.0.0", port, backlog=4096)
    async with server:
        await server.serve_forever()


# === client ===


async def request(conn, target, port):
    reader, writer = conn
    writer.write(
        f"GET http://{target}:{port}/ HTTP/1.1\r\nHost: {target}:{port}\r\n\r\n".encode()
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"{target}: {head[:80]!r}")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)


async def send_all(proxy, port, targets, clients):
    phost, pport = proxy.rsplit(":", 1)
    conns = [await asyncio.open_connection(phost, int(pport)) for _ in range(clients)]
    queue = list(reversed(targets))

    async def worker(conn):
        while queue:
            await request(conn, queue.pop(), port)

    await asyncio.gather(*(worker(c) for c in conns))
    for _, w in conns:
        w.close()


def admin_sizes(admin):
    sizes = {}
    for path in ("/debug/pools", "/metrics"):
        try:
            with urllib.request.urlopen(f"http://{admin}{path}", timeout=30) as r:
                sizes[path] = len(r.read())
        except OSError as e:
            sizes[path] = f"error: {e}"
    return sizes


def upstream_connections(admin):
    """Open upstream connections, from /metrics (egress_upstream_connections)."""
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=30) as r:
        total = 0.0
        for line in r.read().decode().splitlines():
            if line.startswith("egress_upstream_connections{"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    up = sub.add_parser("upstream", help="serve the upstream on PORT (0.0.0.0) until killed")
    up.add_argument("port", type=int)
    ap.add_argument("--proxy", help="the proxy's forward listener host:port")
    ap.add_argument("--pid", type=int, help="the proxy's pid (children counted)")
    ap.add_argument("--admin", help="the sidecar's admin listener, for /debug/pools and /metrics")
    ap.add_argument("--port", type=int, default=0, help="the upstream's port (0: start one here)")
    ap.add_argument("--hosts", type=int, default=5000)
    ap.add_argument("--step", type=int, default=500)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--idle-wait", type=float, default=60,
                    help="seconds for connections to idle out (and the sidecar to let its hosts go)")
    ap.add_argument("--forget-wait", type=float, default=0, help="seconds more for hosts to be forgotten")
    ap.add_argument("--sample", type=float, default=10)
    args = ap.parse_args()
    if args.cmd == "upstream":
        asyncio.run(serve(args.port))
        return
    if not (args.proxy and args.pid):
        ap.error("--proxy and --pid are needed")

    upstream = None
    port = args.port
    if port == 0:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        import subprocess

        upstream = subprocess.Popen([sys.executable, __file__, "upstream", str(port)])
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
    try:
        points = []
        t0 = time.monotonic()

        def point(label, hosts):
            points.append([label, round(time.monotonic() - t0, 1), hosts, rss_kib(args.pid),
                           rss_kib(args.pid, "RssAnon")])
            print(json.dumps(points[-1]), file=sys.stderr)

        asyncio.run(send_all(args.proxy, port, ["127.0.0.2"] * 64, 1))
        time.sleep(1)
        point("start", 0)
        sent = 0
        while sent < args.hosts:
            batch = [host(i) for i in range(sent, min(sent + args.step, args.hosts))]
            asyncio.run(send_all(args.proxy, port, batch, args.clients))
            sent += len(batch)
            point("sent", sent)
        result = {"hosts": args.hosts, "port": port}
        if args.admin:
            result["admin_after_sending"] = admin_sizes(args.admin)
        end = time.monotonic() + args.idle_wait
        while time.monotonic() < end:
            time.sleep(min(args.sample, max(0.0, end - time.monotonic())))
            point("idle", sent)
        if args.admin:
            result["upstream_connections_after_idle"] = upstream_connections(args.admin)
            result["admin_after_idle"] = admin_sizes(args.admin)
        end = time.monotonic() + args.forget_wait
        while time.monotonic() < end:
            time.sleep(min(args.sample, max(0.0, end - time.monotonic())))
            point("forget", sent)
        if args.admin and args.forget_wait:
            result["admin_after_forget"] = admin_sizes(args.admin)
        result["points"] = points
        print(json.dumps(result))
    finally:
        if upstream:
            upstream.kill()
            upstream.wait()


if __name__ == "__main__":
    main()
