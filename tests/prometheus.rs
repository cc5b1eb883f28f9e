//! A real Prometheus (Debian's `prometheus`, /usr/bin/prometheus) started by the test with its
//! own config, scraping a sidecar every second while the sidecar serves the leaky Go client
//! (tests/leaky) and ordinary traffic: the leak alert of
//! `deploy/prometheus/egress-sidecar-rules.yaml` (`EgressSidecarAppLeaking`) goes pending, and
//! every query of the Grafana dashboard (`deploy/grafana/egress-sidecar.json`, its variables
//! substituted) returns data from `/api/v1/query`. Which did, and which only through their
//! `or on() vector(0)`, is printed.
//!
//! Without prometheus (or Go, for the leaky client) the test is skipped, which fails it under
//! CI=true (.ci/run installs both).

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use support::dashboard;
use support::{ChildSidecar, FakeUpstream, RawClient, RefusingPort, TempDir};

const PROMETHEUS: &str = "/usr/bin/prometheus";
const RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/prometheus/egress-sidecar-rules.yaml"
);
const LEAK_ALERT: &str = "EgressSidecarAppLeaking";

/// A Prometheus process with its own config and storage; killed on drop.
struct Prometheus {
    addr: SocketAddr,
    _child: tokio::process::Child,
    _dir: TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `target`'s `/metrics` every second with the rules file
    /// loaded. Its listen address cannot be port 0: a port is taken by binding port 0 and
    /// releasing it, and another is tried should something take it meanwhile.
    async fn start(target: SocketAddr) -> Self {
        let dir = TempDir::new();
        let config = dir.path.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{ scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s }}\n\
                 rule_files: [\"{RULES}\"]\n\
                 scrape_configs:\n  - job_name: egress-sidecar\n    \
                 static_configs: [{{ targets: [\"{target}\"] }}]\n"
            ),
        )
        .unwrap();
        let log_path = dir.path.join("prometheus.log");
        for _ in 0..5 {
            let port = support::free_port();
            let addr: SocketAddr = ([127, 0, 0, 1], port).into();
            let log = std::fs::File::create(&log_path).unwrap();
            let mut child = tokio::process::Command::new(PROMETHEUS)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={}", dir.path.join("data").display()))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .expect("starting prometheus");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    let logged = std::fs::read_to_string(&log_path).unwrap_or_default();
                    assert!(
                        logged.contains("address already in use"),
                        "prometheus exited ({status}):\n{logged}"
                    );
                    break;
                }
                if get(addr, "/-/ready").await.is_some_and(|r| r.status == 200) {
                    return Prometheus {
                        addr,
                        _child: child,
                        _dir: dir,
                    };
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "prometheus not ready within 30 s:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        panic!("no free port for prometheus after 5 tries")
    }

    /// `path`'s JSON answer, its `status` checked.
    async fn api(&self, path: &str) -> serde_json::Value {
        let resp = get(self.addr, path).await.expect("prometheus answers");
        let json: serde_json::Value =
            serde_json::from_slice(&resp.body).unwrap_or_else(|e| panic!("{path}: {e}: {}", resp.text()));
        assert_eq!(json["status"], "success", "{path}: {json}");
        json
    }

    /// The result of an instant query.
    async fn query(&self, promql: &str) -> Vec<serde_json::Value> {
        let json = self.api(&format!("/api/v1/query?query={}", encode(promql))).await;
        json["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The state of the alert `name` (`pending`, `firing`), if it is active.
    async fn alert_state(&self, name: &str) -> Option<String> {
        let json = self.api("/api/v1/alerts").await;
        json["data"]["alerts"]
            .as_array()?
            .iter()
            .find(|a| a["labels"]["alertname"] == name)
            .and_then(|a| a["state"].as_str().map(str::to_owned))
    }
}

/// GETs `path`, or `None` when nothing listens.
async fn get(addr: SocketAddr, path: &str) -> Option<support::RawResponse> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let mut client = RawClient::from_stream(stream);
    client
        .send_raw(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
        .await;
    client.read_response(false).await
}

/// Percent-encodes a query parameter's value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leak_alert_goes_pending_and_every_dashboard_query_returns_data() {
    if !Path::new(PROMETHEUS).is_file() {
        support::skip("Debian's prometheus is not installed (/usr/bin/prometheus)");
        return;
    }
    let Some(leaky) = support::build_go("tests/leaky/main.go", "leaky").await else {
        support::skip("`go` is not on PATH (the leaky client)");
        return;
    };
    let upstream = FakeUpstream::start().await;
    let llm = dashboard::llm_origin().await;
    // A rate-limit service that refuses: the global quota's calls fail and are let through
    // (failure_mode allow), so its families get traffic of their own.
    let service = RefusingPort::new();
    let yaml = dashboard::upstreams_yaml(&[("api", upstream.addr)], service.addr, Some(llm.addr));
    let sidecar = ChildSidecar::spawn(&yaml).await;
    let prometheus = Prometheus::start(sidecar.admin).await;

    // The leak counter's 0 must be in Prometheus before the leak, for increase() to see it.
    let prom = &prometheus;
    let scraped = support::eventually_async(Duration::from_secs(20), || async move {
        prom.query("count_over_time(egress_leaks_detected_total[1m]) >= 2")
            .await
            .len()
            == 1
    })
    .await;
    assert!(scraped, "prometheus did not scrape the sidecar twice within 20 s");

    // Ordinary traffic, then the leaky client: 300 requests, 300 connections, from 127.0.0.1.
    let url = format!("http://{}/", upstream.addr);
    let urls = [url.clone()];
    dashboard::traffic(sidecar.addr, "127.0.0.2", &urls, &llm, 10).await;
    let out = support::client_command(&leaky)
        .args(["-n", "300", "-url", &url, "-wait", "0s"])
        .args(["-proxy", &format!("http://{}", sidecar.addr)])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let mut state = None;
    for _ in 0..60 {
        dashboard::traffic(sidecar.addr, "127.0.0.2", &urls, &llm, 1).await;
        state = prometheus.alert_state(LEAK_ALERT).await;
        if state.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    println!("{LEAK_ALERT}: {state:?}");
    assert!(
        matches!(state.as_deref(), Some("pending" | "firing")),
        "{LEAK_ALERT} did not go pending within 60 s; /metrics has egress_leaks_detected_total {:?}",
        prometheus.query("egress_leaks_detected_total").await
    );
    let pending = prometheus
        .query(&format!(
            "ALERTS{{alertname=\"{LEAK_ALERT}\",alertstate=\"pending\"}}"
        ))
        .await;
    assert_eq!(pending.len(), 1, "ALERTS: {pending:?}");

    // A few more scrapes with the traffic in them, then every dashboard query.
    for _ in 0..3 {
        dashboard::traffic(sidecar.addr, "127.0.0.2", &urls, &llm, 1).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let upstreams = prometheus
        .api("/api/v1/label/upstream/values?match[]=egress_upstream_connections_opened_total")
        .await;
    println!("$upstream values: {}", upstreams["data"]);
    assert!(upstreams["data"]
        .as_array()
        .is_some_and(|v| v.iter().any(|u| u == "api")));

    let mut empty = Vec::new();
    for query in dashboard::queries(&dashboard::load()) {
        let promql = dashboard::substitute(&query.expr);
        let result = prometheus.query(&promql).await;
        let mut through = "";
        if let Some(own) = promql.trim_end().strip_suffix("or on() vector(0)") {
            if !result.is_empty() && prometheus.query(own).await.is_empty() {
                through = " (only its or on() vector(0))";
            }
        }
        let verdict = if result.is_empty() { "NO DATA" } else { "data" };
        println!(
            "{verdict}{through}: {} ({}): {} series: {promql}",
            query.panel,
            query.ref_id,
            result.len()
        );
        if result.is_empty() {
            empty.push(format!("{} ({}): {promql}", query.panel, query.ref_id));
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard queries with no data:\n{}",
        empty.join("\n")
    );
}
