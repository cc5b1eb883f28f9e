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
use tokio::task::JoinHandle;

use crate::access_log::AccessLog;
use crate::config::Config;
use crate::downstream::{self, Context};
use crate::endpoint::dns::Resolver;
use crate::metrics::Metrics;
use crate::pool::Registry;
use crate::proxy::Proxy;
use crate::reload::{self, Summary};
use crate::routing::{on_the_fly, Arrival, Router};
use crate::trace::{self, Tracer};
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
    let mut built = Built::new(config, local, listeners.proxy_addrs());

    tracing::info!(listen = %downstream::describe(&listeners.proxy), admin = %admin_addr, "forward proxy listening");
    let (mut tasks, unix_file) = built.accept(listeners.proxy, listeners.unix, listeners.routes);
    tasks.extend(built.services(reload));
    let (export_stop, exporting) = built.export();
    // The admin server last: once it answers, every task above is spawned, and `egress_runtime_tasks`
    // read then is the count at rest (a test's or an operator's leak baseline).
    let ready = Arc::new(AtomicBool::new(true));
    let (admin_stop_tx, admin_stop_rx) = watch::channel(false);
    let admin_task = tokio::spawn(admin::serve(
        listeners.admin,
        ready.clone(),
        built.metrics.clone(),
        (
            built.pools.clone(),
            built.paces.clone(),
            built.ctx.proxy.router().on_the_fly(),
        ),
        built.clients.clone(),
        built.budget.clone(),
        admin_stop_rx,
    ));

    shutdown.await;
    built.drain(&ready).await;
    for task in tasks {
        task.abort();
    }
    close_pools(&built.pools).await;
    // After the drain, so the spans of the requests it let finish go too.
    let _ = export_stop.send(true);
    if let Some(mut exporting) = exporting {
        // Bounded whatever the collector does: the exporter keeps its own deadline, this one
        // is the net under it.
        let grace = trace::export::FINAL_EXPORT_TIMEOUT + std::time::Duration::from_secs(1);
        if tokio::time::timeout(grace, &mut exporting).await.is_err() {
            exporting.abort();
        }
    }
    let _ = admin_stop_tx.send(true);
    let _ = admin_task.await;
    drop(unix_file);
    tracing::info!("stopped");
}

/// Lets quiet upstreams met on the fly go and forgets unused ones, every
/// [`on_the_fly::SWEEP_EVERY`], for the life of the accept loops.
async fn sweep_on_the_fly(ctx: Arc<Context>) {
    let mut every = tokio::time::interval(on_the_fly::SWEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let swept = ctx.proxy.router().sweep_on_the_fly(std::time::Instant::now());
        if swept != on_the_fly::Swept::default() {
            tracing::debug!(
                released = swept.released,
                forgotten = swept.forgotten,
                "upstreams met on the fly swept"
            );
        }
    }
}

/// What the request path and the services share, built once at start: the downstream context
/// (and, through it, the proxy and its router), the metrics, the pools, the per-source
/// accounting, the memory budget, and the drain signal.
struct Built {
    ctx: Arc<Context>,
    metrics: Arc<Metrics>,
    pools: Arc<Registry>,
    paces: Arc<crate::pace::Registry>,
    clients: Arc<clients::Clients>,
    budget: Option<Arc<budget::Budget>>,
    /// The configured upstreams, in config order (route listeners name theirs by index).
    upstreams: Vec<Arc<Upstream>>,
    wiring: Arc<Wiring>,
    drain_tx: watch::Sender<bool>,
    drain_rx: watch::Receiver<bool>,
    /// The span exporter, until `run` starts its task.
    exporter: Option<trace::export::Exporter>,
}

impl Built {
    /// The policy guard (with the sidecar's own `local` addresses), metrics, pools, resolver,
    /// configured upstreams, router, memory budget, access log and downstream context.
    fn new(config: Arc<Config>, local: Vec<SocketAddr>, proxy_addrs: Vec<SocketAddr>) -> Self {
        let shared = Shared {
            guard: Arc::new(policy::Guard::new(local, config.policy.clone())),
            metrics: Arc::new(Metrics::new()),
            pools: Arc::new(Registry::default()),
            resolver: Arc::new(Resolver::new(&config.dns)),
            paces: Arc::default(),
            rate_limit_services: Arc::default(),
        };
        let metrics = shared.metrics.clone();
        let pools = shared.pools.clone();
        let paces = shared.paces.clone();
        let clients = Arc::new(clients::Clients::with_listeners(proxy_addrs));
        let upstreams: Vec<Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|cfg| Arc::new(Upstream::configured(cfg, &shared)))
            .collect();
        let router = Router::new(config.clone(), &upstreams, shared);
        let (drain_tx, drain_rx) = watch::channel(false);
        let (tracer, exporter) = match Tracer::start(
            &config.tracing,
            metrics.families().trace_spans_dropped("queue_full"),
            metrics.families().trace_spans_dropped("export_failed"),
        ) {
            Some((tracer, exporter)) => (Some(tracer), Some(exporter)),
            None => (None, None),
        };
        let budget = budget::Limit::discover(&config.budget, std::path::Path::new("/"), std::process::id())
            .map(|l| Arc::new(budget::Budget::new(l, &metrics)));
        let ctx = Arc::new(Context::new(
            config.downstream,
            Proxy::new(router)
                .with_access_log(AccessLog::start(
                    &config.access_log,
                    metrics.families().access_log_dropped.clone(),
                ))
                .with_tracer(tracer),
            drain_rx.clone(),
            metrics.clone(),
            clients.clone(),
            budget.clone(),
        ));
        let wiring = Arc::new(Wiring {
            ctx: ctx.clone(),
            pools: pools.clone(),
        });
        Built {
            ctx,
            metrics,
            pools,
            paces,
            clients,
            budget,
            upstreams,
            wiring,
            drain_tx,
            drain_rx,
            exporter,
        }
    }

    /// The accept loops: the forward proxy, its Unix socket, the route listeners. Returns their
    /// tasks and the Unix socket's file, to be kept until nothing accepts on it any more.
    fn accept(
        &self,
        proxy: TcpListener,
        unix: Option<downstream::unix::UnixSocket>,
        routes: Vec<(usize, TcpListener)>,
    ) -> (Vec<JoinHandle<()>>, Option<downstream::unix::SocketFile>) {
        let mut tasks = vec![tokio::spawn(downstream::serve(
            proxy,
            Arrival::Forward,
            self.ctx.clone(),
        ))];
        let mut unix_file = None;
        if let Some(unix) = unix {
            tracing::info!(listen_unix = %unix.file.path().display(), "forward proxy listening on a unix socket");
            unix_file = Some(unix.file);
            tasks.push(tokio::spawn(downstream::serve_unix(
                unix.listener,
                Arrival::Forward,
                self.ctx.clone(),
            )));
        }
        for (i, listener) in routes {
            let name: Arc<str> = self.upstreams[i].label().into();
            tracing::info!(upstream = %name, listen = %downstream::describe(&listener), "route listener");
            tasks.push(tokio::spawn(downstream::serve(
                listener,
                Arrival::Route(name),
                self.ctx.clone(),
            )));
        }
        (tasks, unix_file)
    }

    /// The services beside the request path: waking parked connections, sweeping the upstreams
    /// met on the fly, the memory budget's enforcement and reloading.
    fn services(&self, reload: Option<reload::Watcher>) -> Vec<JoinHandle<()>> {
        // Ends itself when draining starts.
        self.ctx.parking.start(&self.ctx);
        let mut tasks = vec![tokio::spawn(sweep_on_the_fly(self.ctx.clone()))];
        if let Some(budget) = self.budget.clone() {
            tasks.push(tokio::spawn(budget::enforce(
                budget,
                self.wiring.clone(),
                self.metrics.clone(),
            )));
        }
        if let Some(watcher) = reload {
            tasks.push(tokio::spawn(reload::watch(
                watcher,
                self.wiring.clone(),
                self.metrics.clone(),
                self.drain_rx.clone(),
            )));
        }
        tasks
    }

    /// The span exporter's task, when tracing is on, and what stops it (it then exports what
    /// is still queued).
    fn export(&mut self) -> (watch::Sender<bool>, Option<JoinHandle<()>>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = self
            .exporter
            .take()
            .map(|exporter| tokio::spawn(exporter.run(stop_rx)));
        (stop_tx, task)
    }

    /// Draining: readiness off, idle keep-alive connections closed, every response carries
    /// `Connection: close`, but the listeners keep accepting: applications still finishing
    /// their work need egress. Done when no application connection is left, or at the deadline.
    async fn drain(&self, ready: &AtomicBool) {
        let ctx = &self.ctx;
        let drain_timeout = ctx.proxy.router().config().shutdown.drain_timeout;
        tracing::info!(open = ctx.open_connections(), timeout = %humantime::format_duration(drain_timeout), "draining");
        ready.store(false, Ordering::Relaxed);
        let _ = self.drain_tx.send(true);
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
    }
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
