//! grpc-go through `HTTPS_PROXY` (issue 20): a leaky gRPC client (`tests/grpc`, a new
//! `grpc.NewClient` per health check, never closed) against a real grpc-go health server.
//!
//! grpc-go sends plaintext targets through `HTTPS_PROXY` too: a `CONNECT` to the target, then
//! h2c inside the tunnel. The target's port is not in `policy.connect_ports`, so the sidecar
//! answers the CONNECT itself, sees the HTTP/2 preface, and serves the tunnel as h2c: the
//! requests go to the configured upstream through its pool, their streams multiplexed on one
//! or two upstream connections. Directly, the server sees one connection per client.
//!
//! The target is `grpc.internal.test:PORT`, mapped by the sidecar's config to the server: the
//! name resolves nowhere else, and grpc-go (like Go's `ProxyFromEnvironment`) never proxies a
//! loopback address.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::grpc::GrpcServer;
use support::Sidecar;

const HOST: &str = "grpc.internal.test";
const CHECKS: usize = 200;

/// The client's summary line.
#[derive(Debug)]
struct Summary {
    proxy: String,
    run: u64,
    statuses: BTreeMap<String, u64>,
    errors: u64,
    first_error: String,
    elapsed_ms: u64,
    line: String,
}

/// `grpcleak client TARGET N` with `HTTPS_PROXY` set to `proxy` (or unset).
async fn run_client(bin: &Path, target: &str, proxy: Option<&str>) -> Summary {
    let mut cmd = support::client_command(bin);
    cmd.args(["client", target, &CHECKS.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(proxy) = proxy {
        cmd.env("HTTPS_PROXY", proxy);
    }
    // A check has 5 s and the client stops after 10 failures: 60 s bounds even a broken path.
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the gRPC client did not finish within 60s")
        .expect("running the gRPC client");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "gRPC client failed: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.trim().to_owned();
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?} is not JSON: {e}"));
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"));
    Summary {
        proxy: v["proxy"].as_str().unwrap_or_default().to_owned(),
        run: n("run"),
        statuses: v["statuses"]
            .as_object()
            .expect("statuses")
            .iter()
            .map(|(k, c)| (k.clone(), c.as_u64().unwrap()))
            .collect(),
        errors: n("errors"),
        first_error: v["first_error"].as_str().unwrap_or_default().to_owned(),
        elapsed_ms: n("elapsed_ms"),
        line,
    }
}

fn all_serving() -> BTreeMap<String, u64> {
    BTreeMap::from([("SERVING".to_owned(), CHECKS as u64)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_go_health_checks_through_https_proxy() {
    let Some(bin) = support::build_go("tests/grpc", "grpcleak").await else {
        support::skip("`go` is not on PATH; the gRPC client cannot be built");
        return;
    };
    let started = Instant::now();

    // --- through the sidecar ---
    let mut server = GrpcServer::start(&bin).await;
    let port = server.port();
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: grpc\n    url: http://{HOST}:{port}\n    addresses: [{}]\n",
        server.addr
    ))
    .await;
    let proxy = format!("http://{}", sidecar.addr);
    let via = run_client(&bin, &format!("{HOST}:{port}"), Some(&proxy)).await;
    let via_counts = server.counts().await;
    let metrics = support::scrape(sidecar.admin).await;
    let tunnels = |kind: &str| support::value(&metrics, "egress_tunnels_opened_total", &[("kind", kind)]);
    let (h2_tunnels, opaque_tunnels) = (tunnels("connect_h2"), tunnels("connect"));
    println!("via sidecar: {}\n             server {via_counts:?}", via.line);

    assert_eq!(via.proxy, proxy, "grpc-go's proxy for {HOST}:{port}");
    assert_eq!(
        (via.run, via.errors, &via.statuses),
        (CHECKS as u64, 0, &all_serving()),
        "(checks run, errors, statuses); first error: {}",
        via.first_error
    );
    assert_eq!(
        via_counts.rpcs, CHECKS as u64,
        "every health check reached the server once"
    );
    assert!(
        via_counts.accepted <= 2,
        "the server accepted {} TCP connections for {CHECKS} leaked gRPC clients through the \
         sidecar; their streams should share one or two pooled h2c connections",
        via_counts.accepted
    );
    assert_eq!(
        (h2_tunnels, opaque_tunnels),
        (CHECKS as f64, 0.0),
        "egress_tunnels_opened_total for kind connect_h2 and connect (opaque)"
    );
    sidecar.stop().await;
    drop(server);

    // --- directly, no sidecar ---
    let mut server = GrpcServer::start(&bin).await;
    let direct = run_client(&bin, &server.addr, None).await;
    let direct_counts = server.counts().await;
    println!(
        "direct:      {}\n             server {direct_counts:?}",
        direct.line
    );
    assert_eq!(direct.proxy, "", "no proxy without HTTPS_PROXY");
    assert_eq!(
        (direct.run, direct.errors, &direct.statuses),
        (CHECKS as u64, 0, &all_serving()),
        "(checks run, errors, statuses) directly; first error: {}",
        direct.first_error
    );
    assert_eq!(direct_counts.rpcs, CHECKS as u64);
    // The leak lands on the server: one connection per never-closed client.
    assert!(
        direct_counts.accepted > 2,
        "directly the server accepted only {} TCP connections for {CHECKS} leaked clients",
        direct_counts.accepted
    );

    println!(
        "\n=== {CHECKS} grpc-go health checks, a new never-closed grpc.NewClient each ===\n\
         direct:      server accepted {} TCP connections, client run {} ms\n\
         via sidecar: server accepted {} TCP connections ({} connect_h2 tunnels), client run {} ms\n\
         test wall time (after the build): {} ms\n",
        direct_counts.accepted,
        direct.elapsed_ms,
        via_counts.accepted,
        h2_tunnels,
        via.elapsed_ms,
        started.elapsed().as_millis(),
    );
}
