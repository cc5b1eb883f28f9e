//! Real clients that send plain `http://` requests through CONNECT tunnels (issue 20): the
//! sidecar answers a CONNECT to a port outside `policy.connect_ports`, reads the client's first
//! bytes, and serves the tunnel as a downstream connection whose requests go through its pool.
//!
//! Node: `fetch` with a new undici `EnvHttpProxyAgent` per request (tests/node/leaky_fetch.mjs),
//! never closed. undici tunnels even `http://` URLs through `HTTP_PROXY` with CONNECT, so each
//! agent is one CONNECT and one kept-alive connection that is never reused: directly, every
//! request is a new upstream connection; through the sidecar, the upstream sees the pool's few,
//! and `downstream.idle_timeout` closes the leaked tunnels.

mod support;

use std::time::Duration;

use support::{FakeUpstream, Sidecar};
use tokio::io::AsyncWriteExt;

// === Node: fetch through undici's EnvHttpProxyAgent ===

const NODE_REQUESTS: usize = 300;
const NODE_CONCURRENCY: usize = 10;
/// The upstream's pool cap in the sidecar.
const NODE_MAX_CONNECTIONS: usize = 4;
/// The sidecar's `downstream.idle_timeout` (and `leaky_idle_timeout`).
const NODE_IDLE_TIMEOUT_SECS: u64 = 2;
/// The name the sidecar maps to the fake upstream (`addresses`): it resolves nowhere, so Node
/// reaches the upstream through the sidecar or not at all.
const NODE_HOST: &str = "node-upstream.test";

/// The script's directory, where `npm ci --prefix tests/node` installs undici.
fn node_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/node")
}

/// Why the Node client cannot run here, if it cannot.
fn node_missing() -> Option<String> {
    let version = match std::process::Command::new("node").arg("--version").output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        _ => return Some("`node` is not on PATH".into()),
    };
    // undici 7 (tests/node/package.json) needs Node 20.18.1 or later.
    let parts: Vec<u32> = version
        .trim_start_matches('v')
        .split('.')
        .map(|p| p.parse().unwrap_or(0))
        .collect();
    if parts.len() < 3 || (parts[0], parts[1], parts[2]) < (20, 18, 1) {
        return Some(format!(
            "node {version} is older than 20.18.1, which undici 7 needs"
        ));
    }
    if !node_dir().join("node_modules/undici/package.json").exists() {
        return Some("undici is not installed (npm ci --prefix tests/node)".into());
    }
    None
}

/// The leaky Node client, its stdout read line by line and its stdin open (it lives, holding
/// its agents, until stdin closes).
struct NodeClient(support::LineClient);

impl NodeClient {
    /// Runs the script against `url`, through `proxy` (as `HTTP_PROXY`) when given. The agents
    /// keep idle connections for 10 minutes (undici's default is 4 s), so only the peer closes
    /// the leaked ones while the test runs.
    fn spawn(url: &str, proxy: Option<&str>) -> NodeClient {
        let mut cmd = support::client_command("node");
        cmd.current_dir(node_dir())
            .arg("leaky_fetch.mjs")
            .args(["--url", url])
            .args(["--requests", &NODE_REQUESTS.to_string()])
            .args(["--concurrency", &NODE_CONCURRENCY.to_string()])
            .args(["--keep-alive-ms", "600000"]);
        if let Some(proxy) = proxy {
            cmd.env("HTTP_PROXY", proxy);
        }
        NodeClient(support::LineClient::spawn(cmd, "Node client", true))
    }

    /// The next JSON line, which must be `phase`.
    async fn next(&mut self, phase: &str) -> serde_json::Value {
        let line = self.0.next_line(phase, Duration::from_secs(60)).await;
        let value: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert_eq!(value["phase"], phase, "unexpected line {line}");
        value
    }

    /// The sockets the Node process has open now.
    async fn sockets(&mut self) -> i64 {
        let stdin = self.0.stdin();
        stdin.write_all(b"sockets\n").await.unwrap();
        stdin.flush().await.unwrap();
        self.next("sockets").await["sockets"].as_i64().unwrap()
    }

    /// Asks for the socket count every 20 ms until it is `want` or `within` passes; returns
    /// the last count either way.
    async fn sockets_until(&mut self, want: i64, within: Duration) -> i64 {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let n = self.sockets().await;
            if n == want || tokio::time::Instant::now() >= deadline {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn alive(&mut self) -> bool {
        self.0.alive()
    }

    /// Closes stdin and waits for a clean exit.
    async fn finish(self) {
        self.0.finish().await;
    }
}

/// Asserts every request of an `after_requests` summary got a 200.
fn assert_all_ok(summary: &serde_json::Value, what: &str) {
    assert_eq!(
        summary["errors"], 0,
        "{what}: errors, first: {}",
        summary["first_error"]
    );
    assert_eq!(
        summary["statuses"],
        serde_json::json!({ "200": NODE_REQUESTS }),
        "{what}: statuses of {NODE_REQUESTS} requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_fetch_through_env_proxy_agent() {
    if let Some(why) = node_missing() {
        support::skip(&why);
        return;
    }

    // --- through the sidecar ---
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "downstream: {{ idle_timeout: {NODE_IDLE_TIMEOUT_SECS}s, leaky_idle_timeout: \
         {NODE_IDLE_TIMEOUT_SECS}s }}\n\
         upstreams:\n  - name: node\n    url: http://{NODE_HOST}\n    addresses: [{}]\n    \
         pool: {{ max_connections: {NODE_MAX_CONNECTIONS}, max_idle: {NODE_MAX_CONNECTIONS} }}\n",
        upstream.addr
    ))
    .await;
    let mut client = NodeClient::spawn(
        &format!("http://{NODE_HOST}/hello"),
        Some(&format!("http://{}", sidecar.addr)),
    );
    let summary = client.next("after_requests").await;
    println!("via sidecar: {summary}");
    assert_all_ok(&summary, "via sidecar");
    assert_eq!(
        upstream.requests(),
        NODE_REQUESTS,
        "requests the upstream answered"
    );
    let via_accepted = upstream.accepted();
    assert!(
        via_accepted <= NODE_MAX_CONNECTIONS,
        "the upstream accepted {via_accepted} connections; the pool caps it at \
         {NODE_MAX_CONNECTIONS}"
    );
    // Node cannot resolve NODE_HOST: every request came through a tunnel, and each named it.
    assert!(
        upstream
            .seen()
            .iter()
            .all(|s| s.authority() == NODE_HOST && s.path() == "/hello"),
        "the upstream saw requests for another authority or path"
    );
    // One CONNECT per agent, each served as HTTP inside the tunnel (none spliced opaquely).
    let m = support::scrape(sidecar.admin).await;
    let tunnels = |kind: &str| support::value(&m, "egress_tunnels_opened_total", &[("kind", kind)]);
    assert_eq!(
        (tunnels("connect_http"), tunnels("connect")),
        (NODE_REQUESTS as f64, 0.0),
        "(connect_http, connect) tunnels opened"
    );
    let held = summary["sockets"].as_i64().unwrap() - summary["baseline_sockets"].as_i64().unwrap();

    // The agents are never closed and keep idle connections for 10 minutes: the sidecar's
    // idle_timeout is what closes them, while Node lives.
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(30), |m| {
        support::value(m, "egress_downstream_connections", &[]) == 0.0
    })
    .await;
    assert_eq!(
        support::value(&m, "egress_downstream_connections", &[]),
        0.0,
        "client connections still open 30s after the requests (idle_timeout {NODE_IDLE_TIMEOUT_SECS}s)"
    );
    assert!(client.alive(), "the Node client exited before the check");
    let baseline = summary["baseline_sockets"].as_i64().unwrap();
    let node_sockets = client.sockets_until(baseline, Duration::from_secs(5)).await;
    assert_eq!(
        node_sockets, baseline,
        "sockets the Node client holds after the sidecar's idle_timeout"
    );
    client.finish().await;
    sidecar.stop().await;
    drop(upstream);

    // --- directly, no sidecar: the leak lands on the upstream ---
    let direct = FakeUpstream::start().await;
    let mut client = NodeClient::spawn(&format!("http://{}/hello", direct.addr), None);
    let dsummary = client.next("after_requests").await;
    println!("direct:      {dsummary}");
    assert_all_ok(&dsummary, "direct");
    let (direct_accepted, direct_open) = (direct.accepted(), direct.open());
    client.finish().await;
    assert!(
        direct_accepted > NODE_MAX_CONNECTIONS,
        "directly the upstream accepted only {direct_accepted} connections; the leak should \
         cost one per request"
    );

    println!(
        "\n=== Node fetch, {NODE_REQUESTS} requests, {NODE_CONCURRENCY} at a time, a new \
         EnvHttpProxyAgent each ===\n\
         direct:      upstream accepted {direct_accepted} connections ({direct_open} open while \
         Node lived)\n\
         via sidecar: upstream accepted {via_accepted} (max_connections \
         {NODE_MAX_CONNECTIONS}); Node held {held} sockets after the requests, {} after \
         idle_timeout ({NODE_IDLE_TIMEOUT_SECS}s)\n",
        node_sockets - baseline
    );
}
