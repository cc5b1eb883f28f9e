//! Downstream: accepting application connections and serving them: HTTP/1.1 on our own
//! server, and h2c (a connection that opens with the HTTP/2 preface) through hyper (`h2c`).
//!
//! The server is ours rather than hyper's for three reasons a sidecar cares about:
//! - memory: an idle keep-alive connection holds no buffer at all (hyper keeps ~16 KiB per idle
//!   connection and never shrinks it); see `conn` for how;
//! - timeouts: `idle_timeout` between requests and `header_read_timeout` for a head are two
//!   knobs, where hyper folds both into its header timer;
//! - errors: every response the sidecar makes, malformed requests included, carries
//!   `x-egress-error`, which hyper's built-in 400/431 cannot.
//!
//! Applications connect over TCP ([`serve`]) or, with `listen_unix`, over a Unix socket
//! ([`serve_unix`]); both run the same server, generic over the socket type (`stream`), with the
//! same limits, timeouts, parking and draining. A connection's `Source` (its address, or the
//! process behind a Unix-socket connection) is what the leak detector counts it under.
//!
//! `max_connections` is a semaphore taken *before* `accept`, so excess connections wait in the
//! kernel's backlog instead of costing memory here; so does the memory budget's credit
//! (`budget`), when there is a budget.
//!
//! A CONNECT request or a switched protocol (`101`) ends HTTP on the connection: the task hands
//! the socket to `proxy::connect` or `proxy::upgrade`, and a tunnel they answer to `tunnel`,
//! keeping the client's side of it ([`tunnel::Keeper`]: the lot it parks in when quiet, the
//! connection's accounting when it ends). A CONNECT answered here is read as HTTP (`inside`).
//!
//! Not handled here: what a request means (`proxy`), the HTTP/1.1 wire format (`wire`).

mod conn;
mod h2c;
mod inside;
pub mod park;
mod pump;
mod respond;
mod stream;
#[cfg(test)]
pub(crate) mod testing;
pub mod unix;
mod wait_timer;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tracing::Instrument;

use conn::{Ended, Session};
use stream::{Accept, Stream, UnixAccept};

use crate::budget::{self, Budget};
use crate::caught;
use crate::clients::{loopback::Scan, Clients, Leak, Source};
use crate::config::DownstreamConfig;
use crate::live::Live;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::routing::Arrival;
use crate::tunnel::{self, Dormant, Tunnel};

/// After an accept error (EMFILE, ENFILE, ...) wait this long before accepting again.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

/// How long a connection idles in its task before it is parked (`park`), and a tunnel stays
/// quiet in its task before it does: under load connections idle for microseconds between
/// requests and should not pay for parking.
const PARK_AFTER: Duration = Duration::from_millis(100);

/// What every downstream connection shares.
#[derive(Debug)]
pub struct Context {
    /// Downstream settings; a reload replaces them.
    pub config: Live<DownstreamConfig>,
    /// The request handler.
    pub proxy: Proxy,
    /// Flips to `true` when draining starts.
    pub drain: watch::Receiver<bool>,
    /// `downstream.max_connections` permits; all back means no connection is open.
    pub limit: Arc<Semaphore>,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// Per-source accounting and the leak detector.
    pub clients: Arc<Clients>,
    /// Long-idle keep-alive connections, parked outside their tasks.
    pub parking: park::Parking,
    /// The memory budget, if there is one: accepting waits for its credit.
    pub budget: Option<Arc<Budget>>,
    /// `drain`'s value when it was handed over: the value until the channel's version moves.
    drain_at_start: bool,
}

impl Context {
    /// What the downstream connections of one sidecar share; `drain` flips to `true` when
    /// draining starts.
    pub fn new(
        config: DownstreamConfig,
        proxy: Proxy,
        drain: watch::Receiver<bool>,
        metrics: Arc<Metrics>,
        clients: Arc<Clients>,
        budget: Option<Arc<Budget>>,
    ) -> Self {
        let drain_at_start = *drain.borrow();
        Context {
            limit: Arc::new(Semaphore::new(config.max_connections)),
            config: Live::new(config),
            proxy,
            drain_at_start,
            drain,
            parking: park::Parking::new(metrics.families().downstream_parked.clone()),
            metrics,
            clients,
            budget,
        }
    }

    /// Switches to the downstream settings of a reloaded config.
    pub fn reconfigure(&self, config: DownstreamConfig) {
        self.resize_limit(self.config.get().max_connections, config.max_connections);
        self.config.set(config);
    }

    /// Grows or shrinks the `downstream.max_connections` semaphore. Shrinking takes permits as
    /// connections close, so no open connection is cut.
    fn resize_limit(&self, old: usize, new: usize) {
        if new > old {
            self.limit.add_permits(new - old);
        } else if new < old {
            let limit = self.limit.clone();
            let excess = u32::try_from(old - new).unwrap_or(u32::MAX);
            tokio::spawn(async move {
                if let Ok(permits) = limit.acquire_many_owned(excess).await {
                    permits.forget();
                }
            });
        }
    }

    /// Closes up to `n` parked connections, longest idle first (the memory budget's first
    /// step); returns how many.
    pub fn shed_longest_idle(&self, n: usize) -> usize {
        self.parking.shed_longest_idle(n, self)
    }

    /// Whether the sidecar is draining.
    ///
    /// Asked twice per request: reading the value takes the channel's read lock (two atomic
    /// read-modify-writes), where whether it changed since the receiver was made is a load.
    pub fn draining(&self) -> bool {
        match self.drain.has_changed() {
            Ok(false) => self.drain_at_start,
            Ok(true) | Err(_) => *self.drain.borrow(),
        }
    }

    /// Counts a keep-alive connection closed for idling (timeout or `max_idle_connections`).
    fn count_idle_close(&self, requests: u64) {
        self.metrics.families().downstream_idle_closed.inc();
        tracing::debug!(requests, "closing idle downstream connection");
    }

    /// Downstream connections open now.
    pub fn open_connections(&self) -> usize {
        // Not the limit's permits: each accept loop holds one while it waits for a connection.
        usize::try_from(self.metrics.families().downstream_open.get()).unwrap_or(0)
    }
}

/// Accepts on `listener`, serving each connection on its own task, until the task is aborted
/// (at the end of the drain: applications still finishing their work need egress meanwhile).
pub async fn serve(listener: TcpListener, arrival: Arrival, ctx: Arc<Context>) {
    accept_loop(listener, arrival, ctx).await
}

/// Like [`serve`], on the Unix socket: each connection is counted under the process that
/// opened it.
pub async fn serve_unix(listener: UnixListener, arrival: Arrival, ctx: Arc<Context>) {
    let listener = UnixAccept {
        listener,
        processes: Default::default(),
    };
    accept_loop(listener, arrival, ctx).await
}

async fn accept_loop<L: Accept>(listener: L, arrival: Arrival, ctx: Arc<Context>) {
    loop {
        let Ok(permit) = ctx.limit.clone().acquire_owned().await else {
            return;
        };
        if let Some(budget) = &ctx.budget {
            budget.admit().await;
        }
        let accepted = listener.accept().await;
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                if out_of_descriptors(&e) {
                    // As nginx does when it runs out of connections: the longest idle keep-alive
                    // connections make room, rather than every new one waiting for a timeout.
                    let closed = ctx.parking.shed_longest_idle(FD_SHED, &ctx);
                    tracing::warn!(
                        closed,
                        "out of file descriptors: closed the longest idle connections"
                    );
                }
                tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                continue;
            }
        };
        ctx.metrics.families().downstream_opened.inc();
        let leaky = ctx.clients.opened(&peer);
        let held = Held {
            open: OpenGuard::new(&ctx.metrics.families().downstream_open),
            permit,
        };
        spawn_connection(
            Session::new(stream, peer, leaky),
            held,
            arrival.clone(),
            ctx.clone(),
        );
    }
}

/// Idle connections closed when an accept fails for want of file descriptors.
const FD_SHED: usize = 64;

fn out_of_descriptors(error: &std::io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// What a connection holds from accept to close, in its task or parked.
#[derive(Debug)]
struct Held {
    open: OpenGuard,
    permit: OwnedSemaphorePermit,
}

/// How a connection ended, for per-source accounting.
#[derive(Debug, Clone, Copy)]
struct Served {
    /// HTTP/1.1 requests it carried (0 for h2c).
    requests: u64,
    /// Closed for idling: `downstream.idle_timeout`, or `max_idle_connections`.
    idle_closed: bool,
}

/// Serves `conn` on a task of its own: from accept, and again when a parked connection wakes.
fn spawn_connection<S: Stream>(conn: Session<S>, held: Held, arrival: Arrival, ctx: Arc<Context>) {
    // A copy for TCP, as before; for a Unix socket one reference count more per connection.
    let peer = conn.peer.clone();
    let span = tracing::debug_span!("downstream", client = %peer);
    // Under the net of `crate::caught`: a panic closes the connection, logged and counted.
    let panics = ctx.metrics.families().panics.clone();
    let serving = async move {
        let mut arrival = arrival;
        match conn::serve(conn, &mut arrival, &ctx).await {
            Ended::Closed(served) => finish(&ctx, &peer, served, held),
            Ended::Idle(conn) => ctx.parking.park(conn, held, arrival, &ctx),
            Ended::Tunnel(stream, tunnel, served) => {
                let ends = TunnelEnds { served, held, peer };
                splice_apart(stream, *tunnel, Instant::now(), true, ends, ctx)
            }
        }
    };
    tokio::spawn(caught::Caught::new(serving, panics).instrument(span));
}

/// Splices a tunnel (a CONNECT, or a switch of protocols) in a task of its own (`tunnel`),
/// so that the connection's task ends and an idle tunnel holds only the splice's state, not
/// the connection's task and the futures it held. Once nothing has moved for [`PARK_AFTER`]
/// the task ends too and the tunnel waits parked; it comes back here, `since` its last move,
/// when either socket turns readable.
fn splice_apart<S: Stream>(
    stream: S,
    tunnel: Tunnel,
    since: Instant,
    parks: bool,
    ends: TunnelEnds,
    ctx: Arc<Context>,
) {
    let panics = ctx.metrics.families().panics.clone();
    tunnel::spawn(stream, tunnel, since, parks, TunnelKeeper { ends, ctx }, panics);
}

/// What a tunnel's downstream connection leaves to be accounted when the tunnel closes.
struct TunnelEnds {
    served: Served,
    held: Held,
    peer: Source,
}

/// The client's side of a tunnel, kept by its downstream connection: parked in the lot, and
/// accounted as the connection's end.
struct TunnelKeeper {
    ends: TunnelEnds,
    ctx: Arc<Context>,
}

impl<S: Stream> tunnel::Keeper<S> for TunnelKeeper {
    fn idle_timeout(&self) -> Duration {
        self.ctx.config.get().idle_timeout
    }

    fn park_after(&self) -> Option<Duration> {
        let ctx = &self.ctx;
        (ctx.parking.available() && !ctx.draining()).then_some(PARK_AFTER)
    }

    fn park(self, client: S, tunnel: Dormant, deadline: Instant) {
        let TunnelKeeper { ends, ctx } = self;
        ctx.parking.park_tunnel(client, tunnel, ends, deadline, &ctx);
    }

    fn closed(self) {
        let TunnelKeeper { ends, ctx } = self;
        finish(&ctx, &ends.peer, ends.served, ends.held);
    }
}

/// The accounting when a connection closes, however it ended.
fn finish(ctx: &Context, peer: &Source, served: Served, held: Held) {
    let Held { open, permit, .. } = held;
    drop(open);
    if served.requests > 0 {
        let families = ctx.metrics.families();
        families
            .downstream_requests_per_connection
            .observe(served.requests as f64);
    }
    if let Some(leak) = ctx.clients.closed(peer, served.requests, served.idle_closed) {
        ctx.metrics.families().leaks_detected.inc();
        warn_leak(leak, ctx);
    }
    drop(permit);
}

/// Logs a leak; for a loopback source, once the processes behind it are looked for (off the
/// runtime's threads: it reads `/proc`).
fn warn_leak(leak: Leak, ctx: &Context) {
    let upstream_connections = ctx.proxy.router().upstream_connections();
    let loopback = leak.source.loopback_ip();
    let runtime = tokio::runtime::Handle::try_current();
    let (Some(ip), Ok(runtime)) = (loopback, runtime) else {
        return log_leak(&leak, upstream_connections, None);
    };
    let clients = ctx.clients.clone();
    let max_links = budget::fd_links_allowed(ctx.budget.as_deref());
    runtime.spawn(async move {
        let scan = tokio::task::spawn_blocking(move || clients.attribute(ip, max_links))
            .await
            .ok();
        log_leak(&leak, upstream_connections, scan.as_deref());
    });
}

fn log_leak(leak: &Leak, upstream_connections: usize, scan: Option<&Scan>) {
    let process = leak.source.process();
    let processes = scan.map(Scan::describe);
    let on_this_host = processes.as_deref().map_or_else(String::new, |p| {
        format!(" (processes holding its connections: {p})")
    });
    tracing::warn!(
        source = %leak.source,
        pid = process.and_then(|p| p.pid),
        exe = process.and_then(|p| p.exe.as_deref()),
        processes,
        connections = leak.connections,
        requests_per_connection = leak.requests_per_connection,
        upstream_connections,
        "client {}{on_this_host} opened {} connections in the last {}s with {:.2} requests each: it likely \
         builds a new HTTP client or transport per request (in Go, a new http.Transport with no \
         IdleConnTimeout), leaking a connection each time. The sidecar closes them after \
         downstream.idle_timeout and serves this traffic over {} pooled upstream connections; share \
         one client to fix it",
        leak.source,
        leak.connections,
        crate::clients::LEAK_WINDOW.as_secs(),
        leak.requests_per_connection,
        upstream_connections,
    );
}

/// Counts one open connection in a gauge for as long as it lives.
#[derive(Debug)]
struct OpenGuard(prometheus_client::metrics::gauge::Gauge);

impl OpenGuard {
    fn new(gauge: &prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        OpenGuard(gauge.clone())
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The address a listener is bound to, for logs.
pub fn describe(listener: &TcpListener) -> String {
    listener
        .local_addr()
        .map_or_else(|_| "?".into(), |a: SocketAddr| a.to_string())
}
