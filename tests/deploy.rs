//! The sidecar as the docker compose demo runs it: the binary, started the way the compose file
//! starts it (`EGRESS_CONFIG` pointing at `deploy/compose/egress-sidecar.yaml`, addresses from
//! `EGRESS_LISTEN`/`EGRESS_ADMIN`, here 127.0.0.1:0), passes the compose healthcheck and
//! serves requests.
//!
//! `cargo test` runs this against the debug binary. `deploy/validate.sh` runs it again with
//! `EGRESS_SIDECAR_BIN` set to the release binary built as the Dockerfile builds it
//! (`deploy/pgo/build.sh`, profile-guided), so the image's build is what gets tested without
//! making every `cargo test` pay for two LTO builds and a training run.

mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use support::{FakeUpstream, RawClient};
use tokio::io::AsyncBufReadExt;

const COMPOSE_CONFIG: &str = "deploy/compose/egress-sidecar.yaml";

fn binary() -> PathBuf {
    match std::env::var_os("EGRESS_SIDECAR_BIN") {
        Some(bin) => PathBuf::from(bin),
        None => PathBuf::from(env!("CARGO_BIN_EXE_egress-sidecar")),
    }
}

fn config_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(COMPOSE_CONFIG)
}

/// The sidecar's environment in compose (`egress` service), addresses made ephemeral.
fn compose_env(cmd: &mut tokio::process::Command) -> &mut tokio::process::Command {
    cmd.env("EGRESS_CONFIG", config_path())
        .env("EGRESS_LISTEN", "127.0.0.1:0")
        .env("EGRESS_ADMIN", "127.0.0.1:0")
        .env("EGRESS_LOG_FORMAT", "json")
        .env_remove("EGRESS_TLS_HOSTS")
}

async fn admin_get(admin: SocketAddr, path: &str) -> String {
    let mut client = RawClient::connect(admin).await;
    client
        .send_raw(format!("GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n").as_bytes())
        .await;
    let resp = client.read_response(false).await.expect("admin response");
    assert_eq!(resp.status, 200, "{path}: {}", resp.text());
    resp.text()
}

#[tokio::test]
async fn compose_config_passes_check() {
    let out = std::process::Command::new(binary())
        .arg("check")
        .env("EGRESS_CONFIG", config_path())
        .env_remove("EGRESS_LISTEN")
        .env_remove("EGRESS_ADMIN")
        .output()
        .unwrap();
    let effective = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // What the compose file relies on: loopback by default, its demo upstream, its drain.
    assert!(effective.contains("listen: 127.0.0.1:15080"), "{effective}");
    assert!(effective.contains("name: demo"), "{effective}");
    assert!(effective.contains("drain_timeout: 8s"), "{effective}");
}

#[tokio::test]
async fn compose_config_serves_requests() {
    let upstream = FakeUpstream::start().await;
    let mut child = compose_env(&mut tokio::process::Command::new(binary()))
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let (proxy, admin) = loop {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("listening within 20s")
            .unwrap()
            .expect("the sidecar exited before listening");
        if line.contains("forward proxy listening") {
            let v: Value = serde_json::from_str(&line).unwrap();
            let addr = |k: &str| v["fields"][k].as_str().unwrap().parse::<SocketAddr>().unwrap();
            break (addr("listen"), addr("admin"));
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    // The compose healthcheck, as written there: `egress-sidecar healthcheck`, the admin address
    // from EGRESS_ADMIN.
    let health = tokio::process::Command::new(binary())
        .arg("healthcheck")
        .env("EGRESS_ADMIN", admin.to_string())
        .output()
        .await
        .unwrap();
    assert!(
        health.status.success(),
        "{}",
        String::from_utf8_lossy(&health.stderr)
    );

    // Like the demo's leaky app: a new connection per request, each left open.
    let url = format!("http://{}/hello", upstream.addr);
    let mut leaked = Vec::new();
    for _ in 0..5 {
        let mut client = RawClient::connect(proxy).await;
        let resp = client.get(&url).await;
        assert_eq!((resp.status, resp.text().as_str()), (200, "ok"));
        leaked.push(client);
    }
    // Five application connections ended at the sidecar; the upstream saw one.
    assert_eq!(upstream.requests(), 5);
    assert_eq!(upstream.accepted(), 1);
    let clients: Value = serde_json::from_str(&admin_get(admin, "/debug/clients").await).unwrap();
    let source = clients
        .as_array()
        .unwrap_or_else(|| panic!("not a list of sources: {clients}"))
        .iter()
        .find(|s| s["source"] == "127.0.0.1")
        .unwrap_or_else(|| panic!("127.0.0.1 not in {clients}"));
    assert!(source["connections_opened"].as_u64().unwrap() >= 5, "{source}");
    let metrics = admin_get(admin, "/metrics").await;
    assert!(
        metrics.contains("egress_downstream_connections_opened_total"),
        "{metrics}"
    );
    drop(leaked);

    // docker stop: SIGTERM, and with the apps gone the sidecar exits 0 well before the 10s
    // stop_grace_period.
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = tokio::time::timeout(Duration::from_secs(9), child.wait())
        .await
        .expect("exited within 9s of SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}
