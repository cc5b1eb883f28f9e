//! The leak detector: the seeds' leaky Go client (a new `http.Transport` per request) is
//! flagged in `/debug/clients`; a well-behaved shared client and curl doing a few requests are
//! not. Sources are told apart by loopback address (127.0.0.1, .2, .3). The flag is counted in
//! `egress_leaks_detected_total`, at 0 until then.

mod support;

use std::net::SocketAddr;

use support::{FakeUpstream, RawClient, Sidecar};

async fn debug_clients(admin: SocketAddr) -> Vec<serde_json::Value> {
    let mut client = RawClient::connect(admin).await;
    client
        .send_raw(b"GET /debug/clients HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
        .await;
    let resp = client
        .read_response(false)
        .await
        .expect("a /debug/clients answer");
    assert_eq!(resp.status, 200);
    serde_json::from_slice(&resp.body).expect("JSON")
}

fn source<'a>(report: &'a [serde_json::Value], ip: &str) -> &'a serde_json::Value {
    report
        .iter()
        .find(|r| r["source"] == ip)
        .unwrap_or_else(|| panic!("no entry for {ip} in {report:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leaky_client_is_flagged_and_good_clients_are_not() {
    let Some(leaky) = support::build_go("tests/leaky/main.go", "leaky").await else {
        support::skip("`go` is not on PATH");
        return;
    };
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let url = format!("http://{}/", upstream.addr);
    let leaks = |m: &prometheus_parse::Scrape| {
        let present = m
            .samples
            .iter()
            .any(|s| s.metric == "egress_leaks_detected_total");
        present.then(|| support::value(m, "egress_leaks_detected_total", &[]))
    };
    assert_eq!(
        leaks(&support::scrape(sidecar.admin).await),
        Some(0.0),
        "egress_leaks_detected_total at 0 on a fresh sidecar"
    );

    // The leaky client, from 127.0.0.1: 300 requests, 300 connections, then it exits.
    let out = tokio::process::Command::new(&leaky)
        .args([
            "-n",
            "300",
            "-url",
            &url,
            "-wait",
            "0s",
            "-proxy",
            &format!("http://{}", sidecar.addr),
        ])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // A well-behaved client from 127.0.0.2: 150 requests on one connection.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut shared = RawClient::from_stream(socket.connect(sidecar.addr).await.unwrap());
    for _ in 0..150 {
        assert_eq!(shared.get(&url).await.status, 200);
    }
    drop(shared);

    // curl from 127.0.0.3 doing three requests.
    for _ in 0..3 {
        let status = std::process::Command::new("curl")
            .args(["-s", "-o", "/dev/null", "--interface", "127.0.0.3", "-x"])
            .arg(format!("http://{}", sidecar.addr))
            .arg(&url)
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .status()
            .unwrap();
        assert!(status.success());
    }

    // Let the sidecar see every connection close: requests are counted per source as each
    // connection closes, so all 453 are in once all have.
    assert!(support::eventually(std::time::Duration::from_secs(5), || upstream.requests() >= 453).await);
    let closed = |report: &[serde_json::Value]| {
        report
            .iter()
            .map(|r| r["requests"].as_u64().unwrap())
            .sum::<u64>()
    };
    let report = support::fetch_until(
        std::time::Duration::from_secs(5),
        || debug_clients(sidecar.admin),
        |report| closed(report) >= 453,
    )
    .await;
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    let leaky = source(&report, "127.0.0.1");
    assert_eq!(leaky["leaking"], true);
    assert_eq!(leaky["connections_opened"], 300);
    assert_eq!(leaky["requests_per_connection"], 1.0);
    let shared = source(&report, "127.0.0.2");
    assert_eq!(shared["leaking"], false);
    assert_eq!(shared["connections_opened"], 1);
    assert_eq!(shared["requests"], 150);
    let curl = source(&report, "127.0.0.3");
    assert_eq!(curl["leaking"], false);
    assert_eq!(curl["connections_opened"], 3);
    assert_eq!(
        upstream.accepted(),
        1,
        "all of it over one pooled upstream connection"
    );
    // One warning for the leaky source in its window, none for the others.
    assert_eq!(leaks(&support::scrape(sidecar.admin).await), Some(1.0));
}
