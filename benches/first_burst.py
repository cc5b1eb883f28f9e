#!/usr/bin/env python3
"""What a fresh sidecar's first burst of idle client connections maps, and which code faults it in.

Question answered:
    benches/idle_memory.sh with WARM=0 says how many bytes per idle connection a fresh process
    keeps after its first burst (issue 47, item 3); part of it is code read for the first time.
    Which mappings grew, how many pages of the executable's text were mapped, and which
    functions, when first run, faulted them in: listed in link/request-path.symbols (and in
    which group) or left in the cold text?

Method:
    benches/idle_memory.py's Python upstream and its sidecar config (idle timeout 5 min, bounds
    lifted; the default runtime: the multi-thread one when this machine has 2 cores or more).
    SETTLE s after start, RSS and Anonymous per mapping (smaps) and the text pages present
    (pagemap) are read; `perf record -e page-faults -c 1 -d` follows the process while COUNT
    connections each send one GET (at most 4 in flight, as idle_memory.py does) and stay open;
    SETTLE s later the same reads again. A fault whose address is its instruction pointer is an
    instruction fetch: the function it names ran for the first time on a page not yet mapped,
    and the kernel mapped that page's fault-around window or folio with it.

Usage (from the repo root; needs perf, nm and c++filt):
    benches/first_burst.py BINARY [--count 2000] [--settle 12] [--kind clients|connect|websocket]
                           [--tunables GLIBC_TUNABLES]
Prints the growth per mapping, the new text pages in runs (the first function of each run, and
how many of the run's functions are listed), and each instruction fault's function with its
group in the list ("-": not listed). Numbers are reported, not asserted.
"""

import argparse
import asyncio
import bisect
import collections
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import idle_memory  # noqa: E402

LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "link", "request-path.symbols")


def mapping_rss(pid):
    """KiB of Rss and Anonymous per mapping, keyed by (path or [anon], permissions)."""
    out, key = collections.Counter(), None
    for line in open(f"/proc/{pid}/smaps"):
        f = line.split()
        if f and "-" in f[0] and not f[0].endswith(":"):
            key = (f[5] if len(f) > 5 else "[anon]", f[1])
        elif f and f[0] in ("Rss:", "Anonymous:"):
            out[(key, f[0][:-1])] += int(f[1])
    return out


def text_pages(pid, binary):
    """Offsets from the executable's load address of its text pages present in memory."""
    maps = [line.split() for line in open(f"/proc/{pid}/maps")]
    mine = [m for m in maps if len(m) >= 6 and m[5] == binary]
    base = int(mine[0][0].split("-")[0], 16)
    present = set()
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for m in mine:
            if "x" not in m[1]:
                continue
            lo, hi = (int(x, 16) for x in m[0].split("-"))
            for page in range(lo, hi, 4096):
                pagemap.seek(page // 4096 * 8)
                if struct.unpack("Q", pagemap.read(8))[0] >> 63:
                    present.add(page - base)
    return present


def functions(binary):
    """The executable's functions, by address: (sorted addresses, mangled names)."""
    nm = subprocess.run(["nm", "-n", "--defined-only", binary], capture_output=True, text=True, check=True)
    addrs, names = [], []
    for line in nm.stdout.splitlines():
        f = line.split(" ", 2)
        if len(f) == 3 and f[1] in "tTwW":
            addrs.append(int(f[0], 16))
            names.append(f[2])
    return addrs, names


def listed_groups():
    """Each listed name's group number (the list's `# N title` headings)."""
    group, out = 1, {}
    for line in open(LIST):
        line = line.strip()
        heading = re.match(r"#\s*(\d+)\s", line)
        if heading:
            group = int(heading[1])
        elif line and not line.startswith("#"):
            out.setdefault(line, group)
    return out


def instruction_faults(data):
    """Mangled names of the functions whose instruction fetches faulted, in order."""
    script = subprocess.run(["perf", "script", "-i", data, "--no-demangle", "-F", "ip,sym,addr"],
                            capture_output=True, text=True, check=True)
    out = []
    for line in script.stdout.splitlines():
        f = line.split()
        # addr [sym] ip [sym]: an instruction fetch faults at its own address.
        if len(f) >= 3 and f[0] == f[2]:
            out.append(f[1])
    return out


def demangle(names):
    return subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()


async def burst(args, tmp):
    idle_memory.raise_nofile()
    binary = os.path.realpath(args.binary)
    (up_port,) = idle_memory.free_ports(1)
    upstream = idle_memory.Proc([sys.executable, idle_memory.__file__, "upstream", "--port", str(up_port)],
                                os.path.join(tmp, "upstream.log"))
    conf = argparse.Namespace(tmp=tmp, sidecar=binary, downstream=args.count, upstream=100,
                              tunables=args.tunables)
    proc = perf = None
    try:
        idle_memory.wait_port(up_port, upstream.p, "upstream")
        proc, port = idle_memory.start_sidecar(conf, up_port)
        await asyncio.sleep(args.settle)
        rss0, text0 = mapping_rss(proc.pid), text_pages(proc.pid, binary)
        data = os.path.join(tmp, "faults.data")
        perf = subprocess.Popen(["perf", "record", "-q", "-e", "page-faults", "-c", "1", "-d",
                                 "-p", str(proc.pid), "-o", data], stderr=subprocess.PIPE)
        time.sleep(1)
        if perf.poll() is not None:
            sys.exit(f"perf record failed: {perf.stderr.read().decode(errors='replace').strip()}")
        if args.kind == "clients":
            conns, failed = await idle_memory.open_clients(port, args.count, "/", in_flight=4)
        else:
            conns, failed = await idle_memory.open_tunnels(proc, port, up_port, args.count, args.kind)
        await asyncio.sleep(args.settle)
        rss1, text1 = mapping_rss(proc.pid), text_pages(proc.pid, binary)
        perf.send_signal(signal.SIGINT)
        perf.wait()
        await idle_memory.close_all(conns)
    finally:
        if perf and perf.poll() is None:
            perf.send_signal(signal.SIGINT)
            perf.wait()
        if proc:
            proc.stop()
        upstream.stop()
    print(f"{len(conns)} idle {'client connections' if args.kind == 'clients' else args.kind + ' tunnels'} held, "
          f"{len(failed)} failed")
    for key in sorted(set(rss0) | set(rss1)):
        if rss1[key] != rss0[key]:
            (path, perms), field = key
            print(f"  {path[-50:]:50} {perms} {field:9} {rss0[key]:7,} -> {rss1[key]:7,} KiB "
                  f"({rss1[key] - rss0[key]:+,})")
    new = sorted(text1 - text0)
    print(f"text pages present {len(text0)} -> {len(text1)}: {len(new) * 4:,} KiB mapped by the burst")
    addrs, names = functions(binary)
    groups = listed_groups()
    runs = []
    for page in new:
        if runs and page == runs[-1][1]:
            runs[-1][1] = page + 4096
        else:
            runs.append([page, page + 4096])
    for lo, hi in runs:
        first, end = max(bisect.bisect_right(addrs, lo) - 1, 0), bisect.bisect_left(addrs, hi)
        inside = names[first:end]
        print(f"  {lo:#9x}-{hi:#9x} {(hi - lo) // 1024:5} KiB, {sum(n in groups for n in inside)} of "
              f"{len(inside)} functions listed, from {demangle([names[first]])[0][:70]}")
    faults = instruction_faults(data)
    print(f"instruction faults: {len(faults)}")
    for name, plain in zip(faults, demangle(faults)):
        print(f"  {groups.get(name, '-')!s:>2}  {plain[:110]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--settle", type=float, default=12)
    parser.add_argument("--kind", choices=["clients", "connect", "websocket"], default="clients",
                        help="idle client connections, or tunnels as idle_memory.py opens them")
    parser.add_argument("--tunables", default="", help="the sidecar's GLIBC_TUNABLES (the Dockerfile's for the image)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="first-burst.") as tmp:
        asyncio.run(burst(args, tmp))


if __name__ == "__main__":
    main()
