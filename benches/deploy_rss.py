#!/usr/bin/env python3
"""benches/deploy_rss.py: the sidecar's resident memory in the situations the deploy manifests
size their requests and limits for (deploy/, README "Deployment").

Question answered: how much memory does one sidecar hold at start, after a leaky client's
2000 one-request connections, with its pool grown by 200 concurrent slow requests, and with
5000 idle application connections held open? (VmRSS from /proc/PID/status, KiB; VmHWM is the
peak.)

Usage: python3 benches/deploy_rss.py BINARY [CONFIG]
  BINARY: e.g. target/bench/release/egress-sidecar (built with the Dockerfile's
          `cargo build --release --locked`); CONFIG: e.g. deploy/compose/egress-sidecar.yaml
          (its listen/admin are replaced by free loopback ports). Prints one JSON line.
Everything runs on 127.0.0.1 and stops when done.
"""

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


async def upstream(reader, writer):
    """HTTP/1.1 keep-alive: "ok" to everything, after 0.5 s for /sleep."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /sleep"):
                await asyncio.sleep(0.5)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def get(proxy, url, keep=None):
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy)
    writer.write(f"GET {url} HTTP/1.1\r\nHost: {url.split('/')[2]}\r\n\r\n".encode())
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(2)
    if keep is None:
        writer.close()
    else:
        keep.append(writer)


async def main(binary, config):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = await asyncio.start_server(upstream, "127.0.0.1", 0, backlog=4096)
    up = server.sockets[0].getsockname()[1]
    proxy, admin = free_port(), free_port()
    env = dict(os.environ, EGRESS_LISTEN=f"127.0.0.1:{proxy}", EGRESS_ADMIN=f"127.0.0.1:{admin}",
               EGRESS_LOG="error")
    env.pop("EGRESS_CONFIG", None)
    if config:
        env["EGRESS_CONFIG"] = config
    child = subprocess.Popen([binary, "run"], env=env)
    out = {}
    try:
        for _ in range(250):
            try:
                socket.create_connection(("127.0.0.1", proxy)).close()
                break
            except OSError:
                time.sleep(0.02)
        await asyncio.sleep(0.3)
        out["start"] = status_kib(child.pid, "VmRSS")
        url = f"http://127.0.0.1:{up}/x"
        for _ in range(2000):
            await get(proxy, url)
        out["after_2000_one_request_connections"] = status_kib(child.pid, "VmRSS")
        await asyncio.gather(*[get(proxy, f"http://127.0.0.1:{up}/sleep") for _ in range(200)])
        out["pool_grown_by_200_concurrent"] = status_kib(child.pid, "VmRSS")
        keep = []
        for _ in range(20):
            await asyncio.gather(*[get(proxy, url, keep) for _ in range(250)])
        out["with_5000_idle_app_connections"] = status_kib(child.pid, "VmRSS")
        out["peak"] = status_kib(child.pid, "VmHWM")
        for w in keep:
            w.close()
    finally:
        child.terminate()
        child.wait(timeout=15)
        server.close()
    print(json.dumps({"unit": "KiB", **out}))


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else None))
