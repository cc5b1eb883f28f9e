#!/usr/bin/env python3
"""One application of the pacing tests (tests/pace.rs): a real client (Python `requests`) that
sends its requests as fast as it can over a few keep-alive connections (one `requests.Session`
per thread), directly or through the sidecar as its HTTP proxy, and prints one JSON line:

  {"counts": {"200": n, "429": m, ...}, "late": s, "requests": [{"id", "status", "error",
   "retry_after", "start", "end", "headers"}, ...]}

`error` is the response's `x-egress-error`, `headers` the limit headers it carried (names in
lower case), `start` and `end` seconds from the shared zero (`--zero`, a Unix time the test
passes; else the time the app was told to start). Each request carries `x-test-id: <id>-<n>`.
A request that fails without a response has status 0 and the exception in `error`.
"""

import argparse
import json
import sys
import threading
import time

import requests

LIMIT_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-", "ratelimit", "retry-after")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="the URL every request calls")
    ap.add_argument("--requests", type=int, required=True, help="how many requests in all")
    ap.add_argument("--connections", type=int, default=2, help="keep-alive connections (threads)")
    ap.add_argument("--header", action="append", default=[], help="'Name: value', repeatable")
    ap.add_argument("--proxy", help="the sidecar as HTTP proxy (http://host:port); else direct")
    ap.add_argument("--zero", type=float, help="the shared zero, a Unix time")
    ap.add_argument("--start-at", type=float, help="a Unix time to start sending at")
    ap.add_argument("--id", default="app", help="prefix of the x-test-id markers")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    args = ap.parse_args()

    headers = {}
    for h in args.header:
        name, _, value = h.partition(":")
        headers[name.strip()] = value.strip()
    proxies = {"http": args.proxy} if args.proxy else {}

    sessions = []
    for _ in range(args.connections):
        s = requests.Session()
        # Only the proxy named here, never one from the environment.
        s.trust_env = False
        s.proxies = proxies
        sessions.append(s)

    if args.start_at is not None:
        time.sleep(max(0.0, args.start_at - time.time()))
    started = time.time()
    late = max(0.0, started - args.start_at) if args.start_at is not None else 0.0
    zero = args.zero if args.zero is not None else started

    lock = threading.Lock()
    next_n = [0]
    results = []

    def worker(session):
        while True:
            with lock:
                n = next_n[0]
                if n >= args.requests:
                    return
                next_n[0] += 1
            marker = "%s-%d" % (args.id, n)
            start = time.time()
            record = {"id": marker, "status": 0, "error": None, "retry_after": None}
            try:
                r = session.get(
                    args.url,
                    headers=dict(headers, **{"x-test-id": marker}),
                    timeout=args.timeout,
                )
                _ = r.content
                record["status"] = r.status_code
                record["error"] = r.headers.get("x-egress-error")
                record["retry_after"] = r.headers.get("retry-after")
                record["headers"] = {
                    k.lower(): v for k, v in r.headers.items() if k.lower().startswith(LIMIT_PREFIXES)
                }
            except requests.RequestException as e:
                record["error"] = "%s: %s" % (type(e).__name__, e)
            record["start"] = start - zero
            record["end"] = time.time() - zero
            with lock:
                results.append(record)

    threads = [threading.Thread(target=worker, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    counts = {}
    for r in results:
        key = str(r["status"]) if r["status"] else "error"
        counts[key] = counts.get(key, 0) + 1
    results.sort(key=lambda r: r["start"])
    json.dump({"counts": counts, "late": late, "requests": results}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
