// A leaky Node client, for tests/tunnel_clients.rs: N fetches, C at a time, each through a NEW
// undici `EnvHttpProxyAgent` that is never closed (the pattern of code that builds a dispatcher
// per call). `EnvHttpProxyAgent` takes its proxy from HTTP_PROXY / NO_PROXY; for an `http://`
// URL behind a proxy, undici opens a CONNECT tunnel (ProxyAgent's `proxyTunnel` defaults to
// true), so every agent costs one CONNECT and one connection, kept alive and never reused.
//
// Usage: node leaky_fetch.mjs --url URL [--requests N] [--concurrency C] [--keep-alive-ms MS]
//
// Prints one JSON line when the requests are done:
//   {"phase":"after_requests","requests":N,"ok":..,"statuses":{"200":..},"errors":..,
//    "first_error":"..","sockets":..,"baseline_sockets":..,"elapsed_ms":..}
// then stays alive, holding its agents, and answers each stdin line with
//   {"phase":"sockets","sockets":..}
// (the sockets this process has open now), until stdin closes; then it exits 0.
//
// `--keep-alive-ms` sets the agents' keepAliveTimeout (undici closes an idle connection after
// 4 s by default): set long, only the peer can close the leaked connections.

import { readdirSync, readlinkSync } from 'node:fs'
import { createInterface } from 'node:readline'
import { EnvHttpProxyAgent, fetch } from 'undici'

function parseArgs (argv) {
  const opts = { url: '', requests: 300, concurrency: 10, keepAliveMs: 0 }
  for (let i = 0; i < argv.length; i += 2) {
    const [key, value] = [argv[i], argv[i + 1]]
    if (value === undefined) throw new Error(`${key} needs a value`)
    switch (key) {
      case '--url': opts.url = value; break
      case '--requests': opts.requests = Number.parseInt(value, 10); break
      case '--concurrency': opts.concurrency = Number.parseInt(value, 10); break
      case '--keep-alive-ms': opts.keepAliveMs = Number.parseInt(value, 10); break
      default: throw new Error(`unknown argument ${key}`)
    }
  }
  if (!opts.url) throw new Error('--url is required')
  return opts
}

/** The sockets (TCP, Unix) this process has open: /proc/self/fd entries that are sockets. */
function openSockets () {
  let n = 0
  for (const fd of readdirSync('/proc/self/fd')) {
    try {
      if (readlinkSync(`/proc/self/fd/${fd}`).startsWith('socket:')) n++
    } catch {
      // The directory's own fd, closed by the time it is read.
    }
  }
  return n
}

const opts = parseArgs(process.argv.slice(2))
const agentOpts = opts.keepAliveMs > 0
  ? { keepAliveTimeout: opts.keepAliveMs, keepAliveMaxTimeout: opts.keepAliveMs }
  : {}

// Held so the leak does not depend on the garbage collector: never closed, never reused.
const agents = []
const statuses = {}
let ok = 0
let errors = 0
let firstError = ''

/** An error and its causes, one after another ("fetch failed: ... <- ..."). */
function describe (err) {
  const parts = []
  for (let e = err; e && parts.length < 5; e = e.cause) {
    parts.push(typeof e === 'object' ? [e.code, e.message].filter(Boolean).join(' ') : String(e))
  }
  return parts.join(' <- ')
}

async function one () {
  const dispatcher = new EnvHttpProxyAgent(agentOpts)
  agents.push(dispatcher)
  try {
    const res = await fetch(opts.url, { dispatcher })
    await res.text() // the body read whole, so the connection goes back to idle
    statuses[res.status] = (statuses[res.status] ?? 0) + 1
    if (res.status === 200) ok++
  } catch (err) {
    errors++
    if (!firstError) firstError = describe(err)
  }
}

const baseline = openSockets()
const started = Date.now()
let next = 0
async function worker () {
  while (next < opts.requests) {
    next++
    await one()
  }
}
await Promise.all(Array.from({ length: Math.min(opts.concurrency, opts.requests) }, worker))

console.log(JSON.stringify({
  phase: 'after_requests',
  requests: opts.requests,
  ok,
  statuses,
  errors,
  first_error: firstError,
  sockets: openSockets(),
  baseline_sockets: baseline,
  agents: agents.length,
  elapsed_ms: Date.now() - started
}))

// Alive until stdin closes, its leaked connections open (or closed by the peer meanwhile).
for await (const _ of createInterface({ input: process.stdin })) { // eslint-disable-line no-unused-vars
  console.log(JSON.stringify({ phase: 'sockets', sockets: openSockets() }))
}
