//! Downstream: accepting application connections and serving HTTP/1.1 on them.
//!
//! The server is ours rather than hyper's for three reasons a sidecar cares about:
//! - memory: an idle keep-alive connection holds no buffer at all (hyper keeps ~16 KiB per idle
//!   connection and never shrinks it); see `conn` for how;
//! - timeouts: `idle_timeout` between requests and `header_read_timeout` for a head are two
//!   knobs, where hyper folds both into its header timer;
//! - errors: every response the sidecar makes, malformed requests included, carries
//!   `x-egress-error`, which hyper's built-in 400/431 cannot.
//!
//! `max_connections` is a semaphore taken *before* `accept`, so excess connections wait in the
//! kernel's backlog instead of costing memory here; so does the memory budget's credit
//! (`budget`), when there is a budget.
//!
//! A CONNECT request or a switched protocol (`101`) ends HTTP on the connection: the task hands
//! the socket to `proxy::connect` or `proxy::upgrade` and closes it when they are done.
//!
//! Not handled here: what a request means (`proxy`), HTTP/2 downstream (h2c).

mod body;
pub mod codec;
mod conn;
mod h2;
pub mod park;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

pub use body::{BodySender, RequestBody, StreamingBody};
use conn::{Connection, Ended};

use crate::budget::Budget;
use crate::clients::{Clients, Leak};
use crate::config::DownstreamConfig;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::reload::Live;
use crate::routing::Entry;

/// After an accept error (EMFILE, ENFILE, ...) wait this long before accepting again.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

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
    /// Counters.
    pub stats: DownstreamStats,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// Per-source accounting and the leak detector.
    pub clients: Arc<Clients>,
    /// Long-idle keep-alive connections, parked outside their tasks.
    pub parking: park::Parking,
    /// The memory budget, if there is one: accepting waits for its credit.
    pub budget: Option<Arc<Budget>>,
}

/// Downstream counters.
#[derive(Debug, Default)]
pub struct DownstreamStats {
    /// Connections accepted.
    pub opened: AtomicU64,
    /// Keep-alive connections closed by `idle_timeout`.
    pub idle_closed: AtomicU64,
    /// Requests served.
    pub requests: AtomicU64,
}

impl Context {
    /// Whether the sidecar is draining.
    pub fn draining(&self) -> bool {
        *self.drain.borrow()
    }

    /// Counts a keep-alive connection closed for idling (timeout or `max_idle_connections`).
    fn count_idle_close(&self, requests: u64) {
        self.stats.idle_closed.fetch_add(1, Ordering::Relaxed);
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
pub async fn serve(listener: TcpListener, entry: Entry, ctx: Arc<Context>) {
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
        let _ = stream.set_nodelay(true);
        ctx.stats.opened.fetch_add(1, Ordering::Relaxed);
        ctx.metrics.families().downstream_opened.inc();
        let leaky = ctx.clients.opened(peer.ip());
        let held = Held {
            open: OpenGuard::new(&ctx.metrics.families().downstream_open),
            permit,
        };
        spawn_connection(
            Connection::new(stream, peer, leaky),
            held,
            entry.clone(),
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
fn spawn_connection(conn: Connection, held: Held, entry: Entry, ctx: Arc<Context>) {
    let peer = conn.peer;
    let span = tracing::debug_span!("downstream", client = %peer);
    tokio::spawn(
        async move {
            match conn::serve(conn, &entry, &ctx).await {
                Ended::Closed(served) => finish(&ctx, peer, served, held),
                Ended::Idle(conn) => ctx.parking.park(conn, held, entry, &ctx),
            }
        }
        .instrument(span),
    );
}

/// The accounting when a connection closes, however it ended.
fn finish(ctx: &Context, peer: SocketAddr, served: Served, held: Held) {
    let Held { open, permit } = held;
    drop(open);
    if served.requests > 0 {
        let families = ctx.metrics.families();
        families
            .downstream_requests_per_connection
            .observe(served.requests as f64);
    }
    if let Some(leak) = ctx.clients.closed(peer.ip(), served.requests, served.idle_closed) {
        warn_leak(&leak, ctx);
    }
    drop(permit);
}

fn warn_leak(leak: &Leak, ctx: &Context) {
    let upstream_connections = ctx.proxy.router().upstream_connections();
    tracing::warn!(
        source = %leak.source,
        connections = leak.connections,
        requests_per_connection = leak.requests_per_connection,
        upstream_connections,
        "client {} opened {} connections in the last {}s with {:.2} requests each: it likely builds a new \
         HTTP client or transport per request (in Go, a new http.Transport with no IdleConnTimeout), \
         leaking a connection each time. The sidecar closes them after downstream.idle_timeout and \
         serves this traffic over {} pooled upstream connections; share one client to fix it",
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
