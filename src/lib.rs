//! egress-sidecar: a localhost egress proxy that holds capped, tuned per-upstream connection
//! pools, so that a leaky client's connections end cheaply here instead of at the upstream.
//!
//! # Layers
//! Modules are layered, top to bottom. A module may use its own layer's modules and the layers
//! below it, never one above, and the modules of one layer must not depend on each other in a
//! cycle. `tests/architecture.rs` reads this table and the `crate::` paths in `src/` (test code
//! aside) and fails naming the file and line of a path that breaks the rule. A new module gets a
//! row here; a path that would point up means the code is in the wrong module.
//!
//! | layer | modules | owns |
//! |---|---|---|
//! | entry | `app`, `admin`, `inject` | wiring: listeners, run, drain, reload apply, the handles services act through; the admin listener; the injection webhook |
//! | downstream | `downstream/` | accept, the connection task, parking idle connections, the h2c server, the Unix socket |
//! | request path | `proxy/` | one request from routing to response: its observer (span, access-log line) and admission step, for HTTP/1.1 and h2c alike; header rewriting; checking, dialing and answering a CONNECT; sending an upgrade and answering its `101` |
//! | routing | `routing` | which upstream a request means, and where a CONNECT goes with what its dial needs; on-the-fly upstreams; switching routes on reload |
//! | upstream | `upstream/` | an upstream's identity, spec and pool key; one request on a pooled connection with its deadline and retry |
//! | pacing | `pace/`, `global_rate_limit/` | an upstream's advertised rate limits read from its responses, per pace key (the upstream, a keyed hash of the credential, `x-egress-pace-key`); holding requests in order and by priority until the quota allows them; the fleet's rate limit a rate-limit service keeps (Envoy's protocol): the check before a request, the over-limit cache, token reports |
//! | tunnel | `tunnel/` | a tunnel (a CONNECT or upgrade pair) after its `200` or `101`: splicing, going quiet, the dormant record a lot parks, waking, its end and access-log line; what it needs of its keeper (`tunnel::Keeper`) |
//! | pool | `pool/` | cap, waiters, dial scheduling, the HTTP/1.1 idle list, HTTP/2 streams, leases, learning, reports, the registry of live pools |
//! | connector | `connector/` | one connection: an endpoint to dial, the happy-eyeballs race, TLS, the HTTP/1.1 client side, the HTTP/2 client side (on our own `wire::h2client`: its connection's task and streams), the byte stream to an upstream (`connector::Io`, which says whether it may park); no pool types (its place under the cap is an opaque guard) |
//! | endpoints | `endpoint/` | an upstream's endpoints: balance, outlier ejection, the DNS answer refreshed by TTL and draining; the resolver |
//! | services | `budget`, `reload` | the memory budget and hot reload, acting through handles the wiring gives them |
//! | leaves | `access_log`, `policy`, `metrics/`, `clients/`, `wire/`, `config/`, `live`, `llm/`, `error`, `resident`, `spare`, `sock`, `shutdown`, `watched`, `rng`, `duration`, `caught`, `rare`, `redact`, `trace/` | the access log's lines and writer, egress rules, the metrics registry, per-source accounting, the HTTP/1.1 codec and bodies, HPACK, HTTP/2 frames, an HTTP/2 client connection without I/O, configuration, reloadable values, the usage an LLM API answer reports and the counts per app and model, errors, process memory, spare buffers, a TCP socket's reads and writes through its readiness, signals, files re-read when they change, random draws for spread, durations taken from outside, the net that catches a task's panic, the mark of a rare branch, userinfo kept out of every output, OpenTelemetry spans (sampling, W3C trace context, the export queue and exporter) |
//!
//! # The request path, top to bottom
//! ```text
//!  application ──HTTP/1.1──▶ downstream (accept on TCP or the Unix socket, wire::codec,
//!                                 │        idle/header timeouts, leak detector by source)
//!                                 │ Request<wire::RequestBody>
//!                                 ▼
//!                            proxy::observe (the request's span and access-log line; h2c streams too)
//!                                 │
//!                            proxy ─▶ routing (upstream, policy, loop) ─▶ proxy::headers (origin-form, hop-by-hop)
//!                                 │
//!                            proxy::admit (now, after a wait, or refused: pacing, then the fleet's global rate limit)
//!                                 │
//!                                 ▼
//!                            upstream (retry, response deadline) ─▶ pool (cap, FIFO queue, MRU idle)
//!                                 │                                    │ connector::dial (resolve, connect, handshake)
//!                                 ▼                                    ▼
//!  application ◀──stream── PooledBody ◀── connector::h1 (HTTP/1.1, run by the request's task) ──▶ upstream
//!                                        ◀── connector::http2 (streams on wire::h2client; connection task) ──▶ upstream
//! ```
//!
//! CONNECT tunnels (`proxy::connect`) and protocol upgrades such as WebSocket (`proxy::upgrade`)
//! leave this flow: each gets a connection of its own outside the pool, and once answered the
//! pair is a `tunnel::Tunnel`, spliced in a task of its own until both close or it idles out,
//! parked by the downstream lot (through `tunnel::Keeper`) while quiet.
//!
//! Beside the path: `app` wires everything at start; `budget` measures memory and sheds idle
//! connections through `budget::Connections`; `reload` re-reads the config and applies it
//! through `reload::Apply`; `admin` reads the metrics, the pool registry and the per-source
//! accounting.
//!
//! # Cancel safety
//! When an application disconnects, its connection task is dropped at whatever await it was
//! in. Everything it holds gives resources back on drop: a queued request leaves the wait
//! queue (`Waiting`, in `pool/lease.rs`), a checked-out connection whose exchange did not finish
//! is closed rather than pooled (`pool::Lease`), and a place under `max_connections` is
//! returned when the connection's socket closes (`pool::Slot`, held through `connector::Place`).

pub mod access_log;
pub mod admin;
pub mod app;
pub mod budget;
pub mod caught;
pub mod clients;
pub mod config;
pub mod connector;
pub mod downstream;
pub mod duration;
pub mod endpoint;
pub mod error;
// Test code: cargo-fuzz builds with `--cfg fuzzing`; `cargo test` replays the corpus.
#[cfg(any(fuzzing, test))]
#[doc(hidden)]
pub mod fuzzing;
pub mod global_rate_limit;
pub mod inject;
pub mod live;
pub mod llm;
pub mod metrics;
pub mod pace;
pub mod policy;
pub mod pool;
pub mod proxy;
pub mod rare;
pub mod redact;
pub mod reload;
pub mod resident;
pub mod rng;
pub mod routing;
pub mod shutdown;
pub mod sock;
pub mod spare;
pub mod trace;
pub mod tunnel;
pub mod upstream;
pub mod watched;
pub mod wire;

pub use app::{run, run_with_reload, Listeners};
pub use config::Config;
