//! Test support: the sidecar in-process, its admin endpoints, and waiting on observable state;
//! fake upstreams, the raw client, a DNS responder, the child-process sidecar, child-process
//! clients that print JSON lines, a scripted origin, the token-accounting tests' LLM provider,
//! Python apps and view of the sidecar (`llm_provider`, `llm_app`, `llm_sidecar`), the pacing
//! tests' Python app and rate-limited provider (`pace_app`, `provider`), the fleet-wide quota
//! tests' Redis and rate-limit service (`ratelimit`), the trace tests' OpenTelemetry Collector
//! (`otelcol`), the Grafana dashboard's queries and traffic (`dashboard`; all used by path), a
//! Squid parent proxy, nginx as an origin, a grpc-go health server (`grpc`) and machine checks in
//! submodules.
//! Everything binds 127.0.0.1:0.
#![allow(dead_code, unreachable_pub, missing_docs)]

mod child;
mod client;
pub mod dashboard;
mod dns;
pub mod grpc;
mod line_client;
pub mod llm_app;
pub mod llm_provider;
pub mod llm_sidecar;
mod machine;
mod nginx;
pub mod otelcol;
pub mod pace_app;
pub mod provider;
pub mod ratelimit;
mod scripted;
mod squid;
mod upstream;

// Each test binary uses some of these: a glob none of its items are used from is no defect.
#[allow(unused_imports)]
pub use {
    child::*, client::*, dns::*, line_client::*, machine::*, nginx::*, scripted::*, squid::*, upstream::*,
};

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify};

pub type BoxBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

// === the sidecar, in-process ===

pub struct Sidecar {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// Route-mode listeners in config order.
    pub routes: Vec<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Sidecar {
    /// Starts the sidecar with `yaml` (listen/admin default to 127.0.0.1:0).
    pub async fn start(yaml: &str) -> Self {
        let mut text = String::from("listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\n");
        text.push_str(yaml);
        let config = egress_sidecar::config::parse(&text, &Default::default()).expect("valid test config");
        let listeners = egress_sidecar::Listeners::bind(&config).await.unwrap();
        Self::run(config, listeners)
    }

    /// Like [`Sidecar::start`], with the one route-mode listener bound by the test first:
    /// `yaml` gets its port, for configs that must name it elsewhere too (`connect_ports`).
    /// The listener is handed over bound, so no other process can take the port meanwhile.
    pub async fn start_with_route(yaml: impl FnOnce(u16) -> String) -> Self {
        let route = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = route.local_addr().unwrap().port();
        let mut text = String::from("listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\n");
        text.push_str(&yaml(port));
        let config = egress_sidecar::config::parse(&text, &Default::default()).expect("valid test config");
        let index = config
            .upstreams
            .iter()
            .position(|u| u.listen.is_some_and(|a| a.port() == port))
            .expect("an upstream listening on the given port");
        let listeners = egress_sidecar::Listeners {
            proxy: TcpListener::bind(config.listen).await.unwrap(),
            unix: None,
            admin: TcpListener::bind(config.admin).await.unwrap(),
            routes: vec![(index, route)],
        };
        Self::run(config, listeners)
    }

    fn run(config: egress_sidecar::config::Config, listeners: egress_sidecar::Listeners) -> Self {
        let addr = listeners.proxy.local_addr().unwrap();
        let admin = listeners.admin.local_addr().unwrap();
        let routes = listeners
            .routes
            .iter()
            .map(|(_, l)| l.local_addr().unwrap())
            .collect();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(egress_sidecar::run(config, listeners, async move {
            let _ = stopped.await;
        }));
        Sidecar {
            addr,
            admin,
            routes,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Signals shutdown and waits for the drain to finish.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

// === files the sidecar writes ===

/// The lines of the file at `path` (none when it is missing), as bytes.
pub fn file_lines(path: &std::path::Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).unwrap_or_default();
    let mut lines: Vec<Vec<u8>> = bytes.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect();
    lines.pop(); // after the last newline
    lines
}

/// Waits until the file holds `n` lines (10 s at most), then until it stops growing (lines
/// are written off the request path: any extra one shows), and returns them all.
pub async fn wait_file_lines(path: &std::path::Path, n: usize) -> Vec<Vec<u8>> {
    eventually(Duration::from_secs(10), || file_lines(path).len() >= n).await;
    let mut last = usize::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = file_lines(path);
        if now.len() == last {
            return now;
        }
        last = now.len();
    }
}

// === admin listener ===

/// GETs `path` on the admin listener.
pub async fn admin_get(admin: SocketAddr, path: &str) -> RawResponse {
    let mut client = RawClient::connect(admin).await;
    client
        .send_raw(format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n").as_bytes())
        .await;
    client.read_response(false).await.expect("an admin response")
}

/// Scrapes `/metrics` and parses it with a Prometheus text parser.
pub async fn scrape(admin: SocketAddr) -> prometheus_parse::Scrape {
    let resp = admin_get(admin, "/metrics").await;
    assert_eq!(resp.status, 200);
    let lines = resp.text().lines().map(|l| Ok(l.to_owned())).collect::<Vec<_>>();
    prometheus_parse::Scrape::parse(lines.into_iter()).expect("valid Prometheus text")
}

/// The value of `name` summed over samples with these labels (0 when absent).
pub fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => panic!("{name} is not a number"),
        })
        .sum()
}

/// `/debug/pools`, parsed: the pool serving upstream `label` (not one a reload retired).
pub async fn debug_pool(admin: SocketAddr, label: &str) -> serde_json::Value {
    let resp = admin_get(admin, "/debug/pools").await;
    assert_eq!(resp.status, 200);
    let all: serde_json::Value = serde_json::from_slice(&resp.body).expect("JSON");
    all["pools"]
        .as_array()
        .expect("a pools array")
        .iter()
        .find(|p| p["upstream"] == label && p["retired"].is_null())
        .cloned()
        .unwrap_or_else(|| panic!("no pool {label} in {all}"))
}

/// Polls `cond` every 20ms until it holds or `within` passes.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    eventually_async(within, || std::future::ready(cond())).await
}

/// Polls `cond`, which may await something (an admin endpoint, say), every 20 ms until it
/// holds or `within` passes.
pub async fn eventually_async<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if cond().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Fetches a value every 20 ms until `cond` holds of it or `within` passes, and returns the
/// last value either way: the caller asserts on it, so a timeout fails with what it saw.
pub async fn fetch_until<T, Fut>(
    within: Duration,
    mut fetch: impl FnMut() -> Fut,
    mut cond: impl FnMut(&T) -> bool,
) -> T
where
    Fut: std::future::Future<Output = T>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let value = fetch().await;
        if cond(&value) || tokio::time::Instant::now() >= deadline {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`fetch_until`] for `/metrics`.
pub async fn scrape_until(
    admin: SocketAddr,
    within: Duration,
    cond: impl FnMut(&prometheus_parse::Scrape) -> bool,
) -> prometheus_parse::Scrape {
    fetch_until(within, || scrape(admin), cond).await
}

/// Waits (up to 5 s) until `parked` idle application connections are parked
/// (`egress_downstream_parked_connections`; a keep-alive connection is parked once it has idled
/// for 100 ms) and, when given, `open` are open (`egress_downstream_connections`). Panics
/// otherwise.
pub async fn wait_parked(admin: SocketAddr, parked: usize, open: Option<usize>) {
    let counts = |m: &prometheus_parse::Scrape| {
        let open_now = value(m, "egress_downstream_connections", &[]);
        (
            value(m, "egress_downstream_parked_connections", &[]),
            open.map_or(0.0, |_| open_now),
        )
    };
    let want = (parked as f64, open.unwrap_or(0) as f64);
    let m = scrape_until(admin, Duration::from_secs(5), |m| counts(m) == want).await;
    assert_eq!(counts(&m), want, "(parked, open) application connections");
}

/// Runs `egress-sidecar check` on `yaml` (no listen overrides from the environment): its exit
/// code, stdout and stderr.
pub fn check_config(yaml: &str) -> (i32, String, String) {
    let dir = TempDir::new();
    let path = dir.path.join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_egress-sidecar"))
        .args(["check", "--config"])
        .arg(&path)
        .env_remove("EGRESS_LISTEN")
        .env_remove("EGRESS_ADMIN")
        .env_remove("EGRESS_TLS_HOSTS")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
