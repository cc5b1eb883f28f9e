//! egress-sidecar: a localhost egress proxy that holds capped, tuned per-upstream connection
//! pools, so that a leaky client's connections end cheaply here instead of at the upstream.
//!
//! # Flow
//! ```text
//!  application ──HTTP/1.1──▶ downstream (accept on TCP or the Unix socket, our HTTP/1.1 codec,
//!                                 │        idle/header timeouts, leak detector by source)
//!                                 │ Request<RequestBody>
//!                                 ▼
//!                            proxy ─▶ routing (upstream, policy, loop) ─▶ headers (origin-form, hop-by-hop)
//!                                 │
//!                                 ▼
//!                            upstream (retry, response deadline) ─▶ pool (cap, FIFO queue, MRU idle)
//!                                 │                                    │ dial (resolve, connect, handshake)
//!                                 ▼                                    ▼
//!  application ◀──stream── PooledBody ◀── connector::h1 (HTTP/1.1, run by the request's task) ──▶ upstream
//!                                        ◀── hyper HTTP/2 client connection (its own task) ──▶ upstream
//! ```
//!
//! CONNECT tunnels (`proxy::connect`) and protocol upgrades such as WebSocket (`proxy::upgrade`)
//! leave this flow: each gets a connection of its own outside the pool, and the downstream task
//! splices raw bytes between the two sockets until both close or the tunnel idles out.
//!
//! # Cancel safety
//! When an application disconnects, its connection task is dropped at whatever await it was
//! in. Everything it holds gives resources back on drop: a queued request leaves the wait
//! queue (`pool::Waiting`), a checked-out connection whose exchange did not finish is closed
//! rather than pooled (`pool::Lease`), and a place under `max_connections` is returned when the
//! connection's socket closes (`pool::Slot`).
//!
//! # Layers
//! | layer | modules | owns |
//! |---|---|---|
//! | entry | `admin`, `inject`, `fuzzing` | x |
//! | downstream | `downstream/` | x |
//! | request path | `proxy/` | x |
//! | routing | `routing` | x |
//! | upstream | `upstream/` | x |
//! | pool | `pool/` | x |
//! | services | `budget`, `reload` | x |
//! | leaves | `metrics`, `policy`, `config`, `error`, `clients/`, `resident`, `spare`, `shutdown` | x |

pub mod admin;
pub mod app;
pub mod budget;
pub mod clients;
pub mod config;
pub mod connector;
pub mod downstream;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod inject;
pub mod live;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod proxy;
pub mod reload;
pub mod resident;
pub mod routing;
pub mod shutdown;
pub mod spare;
pub mod upstream;
pub mod wire;

pub use app::{run, run_with_reload, Listeners};
pub use config::Config;
