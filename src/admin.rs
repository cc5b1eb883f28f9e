//! The admin listener: `/` (the status page, HTML for a browser: see [`status`]), `/healthz`
//! (alive), `/readyz` (ready; 503 while draining), `/metrics` (Prometheus text),
//! `/debug/pools` (JSON: the sidecar's version and uptime, the pools of a page (`?offset=&limit=`,
//! 100 by default) with each of their connections and every pool summed, how many hosts met on
//! the fly are live and remembered, each upstream's pace keys, and the memory budget), `/debug/clients` (JSON, per
//! application source) and `/debug/usage` (JSON, what LLM answers spent by upstream, app and
//! model, since start and over the last minute). Read-only: nothing on it changes state, and
//! the status page only reads the three JSON endpoints.
//!
//! Served with hyper: it sees a probe every few seconds, so none of the downstream server's
//! memory concerns apply.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::budget::{Budget, BudgetReport};
use crate::clients::Clients;
use crate::metrics::Metrics;
use crate::metrics::PoolSource;
use crate::pace;
use crate::pool::{PoolReport, Registry};
use crate::routing::on_the_fly;

pub mod status;

/// Serves the admin endpoints until `stop` flips to true.
pub async fn serve(
    listener: TcpListener,
    ready: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    (pools, paces, on_the_fly): (Arc<Registry>, Arc<pace::Registry>, Arc<on_the_fly::Table>),
    clients: Arc<Clients>,
    budget: Option<Arc<Budget>>,
    mut stop: watch::Receiver<bool>,
) {
    // `run` starts serving this first: the sidecar's uptime.
    let started = Instant::now();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => return,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let state = Admin {
            ready: ready.clone(),
            metrics: metrics.clone(),
            pools: pools.clone(),
            paces: paces.clone(),
            on_the_fly: on_the_fly.clone(),
            clients: clients.clone(),
            budget: budget.clone(),
            started,
        };
        tokio::spawn(async move {
            let service = service_fn(move |req| respond(req, state.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// What the admin endpoints read.
#[derive(Debug, Clone)]
struct Admin {
    ready: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    pools: Arc<Registry>,
    paces: Arc<pace::Registry>,
    on_the_fly: Arc<on_the_fly::Table>,
    clients: Arc<Clients>,
    budget: Option<Arc<Budget>>,
    started: Instant,
}

impl Admin {
    /// What `/debug/pools` shows under `sidecar`.
    fn sidecar(&self) -> status::SidecarReport {
        status::SidecarReport {
            version: env!("CARGO_PKG_VERSION"),
            uptime_seconds: self.started.elapsed().as_secs(),
            resident_bytes: crate::resident::rss_bytes().ok(),
        }
    }

    /// `/debug/pools`: the pools of `page`, and every pool summed.
    fn pools(&self, page: Page) -> PoolsReport {
        let live = self.pools.live();
        let mut totals = PoolTotals {
            pools: live.len(),
            ..PoolTotals::default()
        };
        for pool in &live {
            let counts = pool.counts();
            totals.open += counts.open;
            totals.idle += counts.idle;
            totals.pending += counts.pending;
        }
        PoolsReport {
            sidecar: self.sidecar(),
            pools: live
                .iter()
                .skip(page.offset)
                .take(page.limit)
                .map(|p| p.report())
                .collect(),
            pools_offset: page.offset,
            totals,
            on_the_fly: self.on_the_fly.report(),
            pace: self.paces.report(),
            budget: self.budget.as_ref().map(|b| b.report(&self.metrics)),
        }
    }

    /// Fd links a loopback source's attribution may look up now (see `budget`).
    fn fd_links_allowed(&self) -> usize {
        crate::budget::fd_links_allowed(self.budget.as_deref())
    }

    /// `GET /`: the status page, with the numbers of the three JSON endpoints in it.
    async fn status_page(&self) -> Response<Full<Bytes>> {
        let pools = self.pools(Page::default());
        let clients = self.clients.report_attributed(self.fd_links_allowed()).await;
        let usage = self.metrics.usage();
        let page = status::page(&status::View {
            sidecar: &pools.sidecar,
            pools: &pools.pools,
            pace: &pools.pace,
            budget: pools.budget.as_ref(),
            clients: &clients,
            usage: &usage,
        });
        let mut resp = Response::new(Full::new(Bytes::from(page)));
        let headers = resp.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/html; charset=utf-8"),
        );
        headers.insert(
            http::header::CACHE_CONTROL,
            http::HeaderValue::from_static("no-store"),
        );
        headers.insert(
            http::header::CONTENT_SECURITY_POLICY,
            http::HeaderValue::from_static(STATUS_CSP),
        );
        headers.insert(
            http::header::X_CONTENT_TYPE_OPTIONS,
            http::HeaderValue::from_static("nosniff"),
        );
        resp
    }
}

/// `/debug/pools`: the sidecar, the pools of a page and every pool summed, the upstreams met
/// on the fly, each upstream's pace keys, the memory budget.
#[derive(Debug, serde::Serialize)]
struct PoolsReport {
    sidecar: status::SidecarReport,
    pools: Vec<PoolReport>,
    /// Where `pools` starts among every pool, in the order they were made (configured
    /// upstreams first).
    pools_offset: usize,
    totals: PoolTotals,
    on_the_fly: on_the_fly::OnTheFlyReport,
    pace: Vec<pace::PaceReport>,
    budget: Option<BudgetReport>,
}

/// Every live pool, summed: what a page of `/debug/pools` leaves out still counts here.
#[derive(Debug, Default, serde::Serialize)]
struct PoolTotals {
    pools: usize,
    open: usize,
    idle: usize,
    pending: usize,
}

/// Which pools `/debug/pools` lists: `?offset=N&limit=M`. A forward proxy may hold thousands
/// of pools, and listing them all made megabytes of JSON (2.2 MB for 2,000 hosts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Page {
    offset: usize,
    limit: usize,
}

impl Page {
    /// Pools listed when the query names no `limit`.
    const DEFAULT_LIMIT: usize = 100;

    /// The page a query asks for; `None` when a value is not a number (the answer is 400).
    fn parse(query: Option<&str>) -> Option<Page> {
        let mut page = Page::default();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            match name {
                "offset" => page.offset = value.parse().ok()?,
                "limit" => page.limit = value.parse().ok()?,
                _ => {}
            }
        }
        Some(page)
    }
}

impl Default for Page {
    fn default() -> Self {
        Page {
            offset: 0,
            limit: Self::DEFAULT_LIMIT,
        }
    }
}

/// The status page loads nothing from anywhere (its style and script are inline) and fetches
/// only this listener's JSON; it may not be framed. Values in it are escaped all the same
/// (`status::esc`): this is the second line, not the first.
const STATUS_CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                          connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

async fn respond(req: Request<Incoming>, admin: Admin) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.uri().path() == "/" {
        return Ok(admin.status_page().await);
    }
    if req.uri().path() == "/debug/clients" {
        return Ok(json(
            &admin.clients.report_attributed(admin.fd_links_allowed()).await,
        ));
    }
    if req.uri().path() == "/debug/pools" {
        return Ok(match Page::parse(req.uri().query()) {
            Some(page) => json(&admin.pools(page)),
            None => plain(
                StatusCode::BAD_REQUEST,
                "offset and limit are numbers: /debug/pools?offset=100&limit=100\n",
            ),
        });
    }
    let Admin { ready, metrics, .. } = admin;
    if req.uri().path() == "/debug/usage" {
        return Ok(json(&metrics.usage()));
    }
    if req.uri().path() == "/metrics" {
        let (body, content_type) = if wants_openmetrics(req.headers()) {
            (metrics.render(), OPENMETRICS)
        } else {
            (metrics.render_classic(), CLASSIC_TEXT)
        };
        let mut resp = Response::new(Full::new(Bytes::from(body)));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(content_type),
        );
        return Ok(resp);
    }
    let (status, body) = match req.uri().path() {
        "/healthz" => (StatusCode::OK, "ok\n"),
        "/readyz" if ready.load(Ordering::Relaxed) => (StatusCode::OK, "ready\n"),
        "/readyz" => (StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
        _ => (
            StatusCode::NOT_FOUND,
            "not found; try / (the status page), /healthz, /readyz, /metrics, /debug/pools, \
             /debug/clients or /debug/usage\n",
        ),
    };
    Ok(plain(status, body))
}

fn plain(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const CLASSIC_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether `Accept` asks for OpenMetrics at least as much as for plain text (Prometheus sends
/// `application/openmetrics-text;version=1.0.0,...,text/plain;version=0.0.4;q=0.5,*/*;q=0.1`).
/// No Accept, `*/*` or `text/plain` alone get the classic format, which every agent reads.
fn wants_openmetrics(headers: &http::HeaderMap) -> bool {
    let mut openmetrics = 0.0f32;
    let mut text = 0.0f32;
    for value in headers.get_all(http::header::ACCEPT) {
        for range in value.to_str().unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q=").or_else(|| p.strip_prefix("Q=")))
                .find_map(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" => openmetrics = openmetrics.max(q),
                "text/plain" | "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
    }
    openmetrics > 0.0 && openmetrics >= text
}

fn json(value: &impl serde::Serialize) -> Response<Full<Bytes>> {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

/// `egress-sidecar healthcheck`: GET /readyz on `addr`; true when it answers 200.
pub fn probe(addr: std::net::SocketAddr, timeout: std::time::Duration) -> Result<bool, String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(format!("GET /readyz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
        .map_err(|e| format!("writing to {addr}: {e}"))?;
    let mut head = [0u8; 16];
    let n = stream
        .read(&mut head)
        .map_err(|e| format!("reading from {addr}: {e}"))?;
    Ok(head[..n].starts_with(b"HTTP/1.1 200"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accept(value: Option<&'static str>) -> bool {
        let mut headers = http::HeaderMap::new();
        if let Some(value) = value {
            headers.insert(http::header::ACCEPT, http::HeaderValue::from_static(value));
        }
        wants_openmetrics(&headers)
    }

    #[test]
    fn the_format_follows_accept() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                          version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(accept(Some(prometheus)));
        assert!(accept(Some("application/openmetrics-text; version=1.0.0")));
        assert!(!accept(None), "no Accept: classic");
        assert!(!accept(Some("*/*")));
        assert!(!accept(Some("text/plain;version=0.0.4")));
        assert!(
            !accept(Some("text/plain, application/openmetrics-text;q=0.5")),
            "plain text preferred"
        );
        assert!(!accept(Some("application/openmetrics-text;q=0")));
    }
}
