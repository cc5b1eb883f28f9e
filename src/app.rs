//! The wiring: binds the listeners, builds what the request path shares (policy guard, metrics,
//! pool registry, router, downstream context), runs the accept loops, the admin listener, the
//! memory budget and reloading, and drains at shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::access_log::AccessLog;
use crate::config::Config;
use crate::downstream::{self, Context};
use crate::endpoint::dns::Resolver;
use crate::metrics::Metrics;
use crate::pool::Registry;
use crate::proxy::Proxy;
use crate::reload::{self, Summary};
use crate::routing::{Arrival, Router};
use crate::upstream::{Shared, Upstream};
use crate::{admin, budget, clients, policy};

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
async fn close_pools(pools: &Registry) {
    let pools = pools.live();
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
    let shared = Shared {
        guard: Arc::new(policy::Guard::new(local, config.policy.clone())),
        metrics: Arc::new(Metrics::new()),
        pools: Arc::new(Registry::default()),
        resolver: Arc::new(Resolver::new(&config.dns)),
    };
    let metrics = shared.metrics.clone();
    let pools = shared.pools.clone();
    let clients = Arc::new(clients::Clients::with_listeners(listeners.proxy_addrs()));
    let upstreams: Vec<Arc<Upstream>> = config
        .upstreams
        .iter()
        .map(|cfg| Arc::new(Upstream::configured(cfg, &shared)))
        .collect();
    let router = Router::new(config.clone(), &upstreams, shared);
    let (drain_tx, drain_rx) = watch::channel(false);
    let budget = budget::Limit::discover(&config.budget, std::path::Path::new("/"), std::process::id())
        .map(|l| Arc::new(budget::Budget::new(l, &metrics)));
    let ctx = Arc::new(Context::new(
        config.downstream,
        Proxy::new(router).with_access_log(AccessLog::start(
            &config.access_log,
            metrics.families().access_log_dropped.clone(),
        )),
        drain_rx.clone(),
        metrics.clone(),
        clients.clone(),
        budget.clone(),
    ));
    let wiring = Arc::new(Wiring {
        ctx: ctx.clone(),
        pools: pools.clone(),
    });

    let ready = Arc::new(AtomicBool::new(true));
    let (admin_stop_tx, admin_stop_rx) = watch::channel(false);
    let admin_task = tokio::spawn(admin::serve(
        listeners.admin,
        ready.clone(),
        metrics.clone(),
        pools.clone(),
        clients,
        budget.clone(),
        admin_stop_rx,
    ));
    tracing::info!(listen = %downstream::describe(&listeners.proxy), admin = %admin_addr, "forward proxy listening");
    let mut accept_tasks = vec![tokio::spawn(downstream::serve(
        listeners.proxy,
        Arrival::Forward,
        ctx.clone(),
    ))];
    // Kept to the end: the socket file goes once nothing accepts on it any more.
    let mut unix_file = None;
    if let Some(unix) = listeners.unix {
        tracing::info!(listen_unix = %unix.file.path().display(), "forward proxy listening on a unix socket");
        unix_file = Some(unix.file);
        accept_tasks.push(tokio::spawn(downstream::serve_unix(
            unix.listener,
            Arrival::Forward,
            ctx.clone(),
        )));
    }
    for (i, listener) in listeners.routes {
        let name: Arc<str> = upstreams[i].label().into();
        tracing::info!(upstream = %name, listen = %downstream::describe(&listener), "route listener");
        accept_tasks.push(tokio::spawn(downstream::serve(
            listener,
            Arrival::Route(name),
            ctx.clone(),
        )));
    }
    if let Some(budget) = budget {
        accept_tasks.push(tokio::spawn(budget::enforce(
            budget,
            wiring.clone(),
            metrics.clone(),
        )));
    }
    if let Some(watcher) = reload {
        accept_tasks.push(tokio::spawn(reload::watch(
            watcher,
            wiring.clone(),
            metrics.clone(),
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
    close_pools(&pools).await;
    let _ = admin_stop_tx.send(true);
    let _ = admin_task.await;
    drop(unix_file);
    tracing::info!("stopped");
}

/// The narrow handles the memory budget and reloading act through: the downstream connections
/// and the pools, as the wiring holds them.
struct Wiring {
    ctx: Arc<Context>,
    pools: Arc<Registry>,
}

impl budget::Connections for Wiring {
    fn downstream_open(&self) -> usize {
        self.ctx.open_connections()
    }

    fn upstream_open(&self) -> usize {
        self.pools.open_connections()
    }

    fn shed_downstream_idle(&self, n: usize) -> usize {
        self.ctx.shed_longest_idle(n)
    }

    fn shed_upstream_idle(&self) -> usize {
        self.pools.live().iter().map(|p| p.shed_idle_surplus()).sum()
    }
}

impl reload::Apply for Wiring {
    fn config(&self) -> Arc<Config> {
        self.ctx.proxy.router().config()
    }

    fn apply(&self, config: Config) -> Summary {
        let downstream = config.downstream;
        let summary = self.ctx.proxy.router().reload(Arc::new(config));
        self.ctx.reconfigure(downstream);
        summary
    }
}
