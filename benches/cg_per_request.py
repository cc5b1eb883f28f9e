#!/usr/bin/env python3
"""benches/cg_per_request.py: what one request runs, from two callgrind profiles.

Question answered:
    Beyond the instruction count (benches/callgrind.sh), what does a request's user-space path
    cost that a simulation does not price: how many distinct code lines it runs (its
    instruction-cache footprint), how many locked (atomic read-modify-write) instructions, and
    where a function such as malloc or memcpy is called from?

Method: two profiles made with `valgrind --tool=callgrind --dump-instr=yes`, one after LOW
    requests and one after HIGH; every figure is (HIGH - LOW) / (HIGH - LOW requests), which
    cancels start-up and shutdown. callgrind.sh makes them:

        KEEP=/tmp/cg DUMP_INSTR=1 benches/callgrind.sh BIN
        benches/cg_per_request.py /tmp/cg/callgrind.2000.out /tmp/cg/callgrind.12000.out 10000 footprint

    Any program's profiles work the same way (nginx, HAProxy): the addresses are those of the
    files, so objdump reads the same ones.

Reports:
    footprint          distinct instructions run at least every other request, and the
                       64-byte lines they lie in, by object and by function;
    locked             executions per request of `lock`-prefixed instructions (and xchg with
                       memory, which locks implicitly), by address and function;
    callers FUNCTION   calls per request of FUNCTION (exact name, as callgrind writes it) and
                       the instructions each call ran, by call-site address; `addr2line -i -e
                       BIN ADDRESS` names the source line.
"""

import collections
import re
import subprocess
import sys


def parse(path):
    """Self cost per (object, instruction address), the function of each address, and the
    calls of each callee per (object, call-site address)."""
    names = {"ob": {}, "fn": {}}
    cost = collections.Counter()
    fn_of = {}
    calls = collections.Counter()
    call_cost = collections.Counter()
    ob = fn = callee = None
    last = 0
    call_count = None
    with open(path) as f:
        for line in f:
            first = line[0]
            if first in "0123456789+-*":
                parts = line.split()
                pos = parts[0]
                if pos.startswith("0x"):
                    last = int(pos, 16)
                elif pos[0] in "+-":
                    last += int(pos)
                if call_count is not None:
                    # The line after `calls=` is the call's inclusive cost, at the call site.
                    calls[(ob, last, callee)] += call_count
                    call_cost[(ob, last, callee)] += int(parts[-1])
                    call_count = None
                elif len(parts) >= 3:
                    cost[(ob, last)] += int(parts[2])
                    fn_of[(ob, last)] = fn
                continue
            m = re.match(r"(c?)(ob|fn)=\((\d+)\)(?: (.*))?", line)
            if m:
                called, kind, idx, name = m.groups()
                if name:
                    names[kind][idx] = name.strip()
                if kind == "ob" and not called:
                    ob = names["ob"][idx]
                elif kind == "fn":
                    if called:
                        callee = names["fn"][idx]
                    else:
                        fn = names["fn"][idx]
            elif line.startswith("calls="):
                call_count = int(line.split("=")[1].split()[0])
    return cost, fn_of, calls, call_cost


def per_request(low, high, requests):
    """The HIGH profile's counts minus the LOW one's, per request."""
    return {k: (v - low.get(k, 0)) / requests for k, v in high.items()}


def footprint(cost, fn_of):
    hot = [k for k, v in cost.items() if v >= 0.5]
    lines = collections.defaultdict(set)
    by_fn = collections.defaultdict(set)
    for ob, addr in hot:
        lines[ob].add(addr >> 6)
        by_fn[fn_of[(ob, addr)]].add(addr >> 6)
    print(f"distinct instructions run per request: {len(hot)}")
    print(f"64-byte code lines: {sum(len(s) for s in lines.values())}")
    for ob, s in sorted(lines.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(s):6} {ob}")
    print("by function (lines):")
    for fn, s in sorted(by_fn.items(), key=lambda kv: -len(kv[1]))[:25]:
        print(f"  {len(s):6} {fn[:140]}")


def locked_addresses(obj):
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj], capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+(.*)", line)
        if not m:
            continue
        ins = m.group(2)
        # objdump prints some `lock` prefixes on a line of their own: the prefix's address is
        # the instruction's, which is what callgrind counts.
        if re.match(r"lock\b", ins) or (re.match(r"xchg\s", ins) and "(" in ins):
            found.add(int(m.group(1), 16))
    return found


def locked(cost, fn_of):
    rows = []
    for ob in {ob for ob, _ in cost if ob}:
        try:
            addrs = locked_addresses(ob)
        except OSError:
            continue
        rows += [(v, ob, a) for (o, a), v in cost.items() if o == ob and a in addrs and v > 0.01]
    print(f"locked instructions per request: {sum(v for v, _, _ in rows):.1f}")
    for v, ob, a in sorted(rows, reverse=True)[:60]:
        print(f"  {v:6.2f} {ob.split('/')[-1]} {a:#x} {(fn_of.get((ob, a)) or '?')[:120]}")


def callers(calls, call_cost, target):
    rows = sorted(
        ((v, ob, a, call_cost.get((ob, a, callee), 0)) for (ob, a, callee), v in calls.items() if callee == target and v >= 0.05),
        key=lambda r: (-r[0], -r[3]),
    )
    print(f"calls of {target} per request: {sum(r[0] for r in rows):.2f}, "
          f"{sum(r[3] for r in rows):.0f} instructions in them")
    print("  calls  instructions per call  call site")
    for v, ob, a, c in rows:
        print(f"  {v:5.2f}  {c / v:21.0f}  {ob.split('/')[-1]} {a:#x}")


def main(argv):
    if len(argv) < 5 or argv[4] not in ("footprint", "locked", "callers") or (argv[4] == "callers" and len(argv) < 6):
        sys.exit(__doc__)
    low_path, high_path, requests, report = argv[1], argv[2], float(argv[3]), argv[4]
    low_cost, _, low_calls, low_call_cost = parse(low_path)
    high_cost, fn_of, high_calls, high_call_cost = parse(high_path)
    cost = per_request(low_cost, high_cost, requests)
    if report == "footprint":
        footprint(cost, fn_of)
    elif report == "locked":
        locked(cost, fn_of)
    else:
        callers(
            per_request(low_calls, high_calls, requests),
            per_request(low_call_cost, high_call_cost, requests),
            argv[5],
        )


if __name__ == "__main__":
    main(sys.argv)
