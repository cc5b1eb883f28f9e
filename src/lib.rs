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
pub mod budget;
pub mod clients;
pub mod config;
pub mod connector;
pub mod downstream;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod inject;
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

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

pub use config::Config;

use metrics::Metrics;

use downstream::Context;
use proxy::Proxy;
use routing::{Entry, Router};
use upstream::Upstream;

/// The sockets the sidecar serves on, bound before [`run`] so that tests can bind port 0 and
/// learn the addresses.
#[derive(Debug)]
pub struct Listeners {
    /// The forward-proxy listener (`listen`).
    pub proxy: TcpListener,
    /// The forward-proxy Unix socket (`listen_unix`); its file goes when this is dropped.
    pub unix: Option<downstream::unix::UnixSocket>,
    /// The admin listener (`admin`).
    pub admin: TcpListener,
    /// Route-mode listeners: index into `config.upstreams`, and the socket.
    pub routes: Vec<(usize, TcpListener)>,
}

impl Listeners {
    /// Binds every listener the config names.
    pub async fn bind(config: &Config) -> io::Result<Self> {
        let bind = |addr: SocketAddr, what: String| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|e| io::Error::new(e.kind(), format!("binding {what} {addr}: {e}")))
        };
        let proxy = bind(config.listen, "listen".into()).await?;
        let unix = match &config.listen_unix {
            Some(path) => Some(downstream::unix::bind(path).await?),
            None => None,
        };
        let admin = bind(config.admin, "admin".into()).await?;
        let mut routes = Vec::new();
        for (i, up) in config.upstreams.iter().enumerate() {
            if let Some(addr) = up.listen {
                routes.push((i, bind(addr, format!("upstreams[{i}].listen")).await?));
            }
        }
        Ok(Listeners {
            proxy,
            unix,
            admin,
            routes,
        })
    }

    /// Addresses the applications' requests arrive on: forward proxy, then route listeners.
    pub fn proxy_addrs(&self) -> Vec<SocketAddr> {
        std::iter::once(&self.proxy)
            .chain(self.routes.iter().map(|(_, l)| l))
            .filter_map(|l| l.local_addr().ok())
            .collect()
    }

    /// Addresses actually bound: forward proxy, admin, then route listeners in order.
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        std::iter::once(&self.proxy)
            .chain(std::iter::once(&self.admin))
            .chain(self.routes.iter().map(|(_, l)| l))
            .filter_map(|l| l.local_addr().ok())
            .collect()
    }
}

/// How often draining checks whether application connections are gone.
const DRAIN_POLL: std::time::Duration = std::time::Duration::from_millis(25);

/// How long the pools get to close their connections at exit.
const POOL_CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Closes every pool's connections so upstreams see a clean goodbye (HTTP/2: GOAWAY) rather
/// than a reset when the process exits; a connection still busy gets [`POOL_CLOSE_GRACE`].
async fn close_pools(metrics: &Metrics) {
    let pools = metrics.live_pools();
    for pool in &pools {
        pool.retire("shutdown");
    }
    let all_closed = async {
        while pools.iter().any(|p| p.open_connections() > 0) {
            tokio::time::sleep(DRAIN_POLL).await;
        }
    };
    let _ = tokio::time::timeout(POOL_CLOSE_GRACE, all_closed).await;
}

/// Serves until `shutdown` completes, then drains for up to `shutdown.drain_timeout`.
pub async fn run(config: Config, listeners: Listeners, shutdown: impl Future<Output = ()>) {
    run_with_reload(config, listeners, shutdown, None).await
}

/// Like [`run`], and reloads the config from `reload` on SIGHUP and when the file changes.
pub async fn run_with_reload(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
    reload: Option<reload::Watcher>,
) {
    let config = Arc::new(config);
    let local = listeners.local_addrs();
    let admin_addr = local[1];
    if let Some(warning) = policy::open_proxy_warning(&listeners.proxy_addrs(), &config.policy) {
        tracing::warn!("{warning}");
    }
    let guard = Arc::new(policy::Guard::new(local, config.policy.clone()));
    let metrics = Arc::new(Metrics::new());
    let clients = Arc::new(clients::Clients::with_listeners(listeners.proxy_addrs()));
    let upstreams: Vec<Arc<Upstream>> = config
        .upstreams
        .iter()
        .map(|cfg| Arc::new(Upstream::configured(cfg, &guard, &metrics)))
        .collect();
    let router = Router::new(config.clone(), &upstreams, guard, metrics.clone());
    let (drain_tx, drain_rx) = watch::channel(false);
    let max_connections = config.downstream.max_connections;
    let limit = Arc::new(Semaphore::new(max_connections));
    let budget = budget::Limit::discover(&config.budget, std::path::Path::new("/"), std::process::id())
        .map(|l| Arc::new(budget::Budget::new(l, &metrics)));
    let ctx = Arc::new(Context {
        config: reload::Live::new(config.downstream),
        proxy: Proxy::new(router),
        drain: drain_rx.clone(),
        limit,
        stats: Default::default(),
        metrics: metrics.clone(),
        clients: clients.clone(),
        parking: Default::default(),
        budget: budget.clone(),
    });

    let ready = Arc::new(AtomicBool::new(true));
    let (admin_stop_tx, admin_stop_rx) = watch::channel(false);
    let admin_task = tokio::spawn(admin::serve(
        listeners.admin,
        ready.clone(),
        metrics.clone(),
        clients,
        budget.clone(),
        admin_stop_rx,
    ));
    tracing::info!(listen = %downstream::describe(&listeners.proxy), admin = %admin_addr, "forward proxy listening");
    let mut accept_tasks = vec![tokio::spawn(downstream::serve(
        listeners.proxy,
        Entry::Forward,
        ctx.clone(),
    ))];
    // Kept to the end: the socket file goes once nothing accepts on it any more.
    let mut unix_file = None;
    if let Some(unix) = listeners.unix {
        tracing::info!(listen_unix = %unix.file.path().display(), "forward proxy listening on a unix socket");
        unix_file = Some(unix.file);
        accept_tasks.push(tokio::spawn(downstream::serve_unix(
            unix.listener,
            Entry::Forward,
            ctx.clone(),
        )));
    }
    for (i, listener) in listeners.routes {
        let name: Arc<str> = upstreams[i].label().into();
        tracing::info!(upstream = %name, listen = %downstream::describe(&listener), "route listener");
        accept_tasks.push(tokio::spawn(downstream::serve(
            listener,
            Entry::Route(name),
            ctx.clone(),
        )));
    }
    if let Some(budget) = budget {
        accept_tasks.push(tokio::spawn(budget::enforce(budget, ctx.clone())));
    }
    if let Some(watcher) = reload {
        accept_tasks.push(tokio::spawn(reload::watch(
            watcher,
            ctx.clone(),
            drain_rx.clone(),
        )));
    }

    shutdown.await;
    // Draining: readiness off, idle keep-alive connections closed, every response carries
    // `Connection: close`, but the listeners keep accepting: applications still finishing
    // their work need egress. Done when no application connection is left, or at the deadline.
    let drain_timeout = ctx.proxy.router().config().shutdown.drain_timeout;
    tracing::info!(open = ctx.open_connections(), timeout = %humantime::format_duration(drain_timeout), "draining");
    ready.store(false, Ordering::Relaxed);
    let _ = drain_tx.send(true);
    let all_closed = async {
        while ctx.open_connections() > 0 {
            tokio::time::sleep(DRAIN_POLL).await;
        }
    };
    if tokio::time::timeout(drain_timeout, all_closed).await.is_err() {
        tracing::warn!(
            open = ctx.open_connections(),
            "drain timeout passed with connections open"
        );
    }
    for task in accept_tasks {
        task.abort();
    }
    close_pools(&metrics).await;
    let _ = admin_stop_tx.send(true);
    let _ = admin_task.await;
    drop(unix_file);
    tracing::info!("stopped");
}
