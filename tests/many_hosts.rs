//! A forward proxy meeting many hosts on the fly: `/debug/pools` lists a page of their pools
//! and sums them all; once a host's connections have idled out its upstream is let go (its
//! pool gone from the listing and the sums), and its next request makes it again.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use support::{admin_get, eventually_async, FakeUpstream, RawClient, Sidecar};
use tokio::net::TcpListener;

const HOSTS: usize = 150;

/// The `i`-th host: a loopback address of its own (all of 127/8 reaches the upstream).
fn host(i: usize, port: u16) -> String {
    format!("127.1.{}.{}:{port}", i / 250, i % 250 + 1)
}

async fn pools(admin: SocketAddr, query: &str) -> Value {
    let resp = admin_get(admin, &format!("/debug/pools{query}")).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    serde_json::from_slice(&resp.body).expect("JSON")
}

fn labels(report: &Value) -> Vec<String> {
    let pools = report["pools"].as_array().expect("a pools array");
    pools
        .iter()
        .map(|p| p["upstream"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_met_on_the_fly_are_paged_then_are_let_go_and_come_back() {
    let listener = TcpListener::bind("0.0.0.0:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let upstream = FakeUpstream::start_on(listener);
    let sidecar = Sidecar::start("defaults:\n  pool: { idle_timeout: 1s }\n").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    for i in 0..HOSTS {
        let resp = client.get(&format!("http://{}/", host(i, port))).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    assert_eq!(upstream.accepted(), HOSTS, "one connection per host");

    // A page of 100, every pool summed, then the rest.
    let first = pools(sidecar.admin, "").await;
    assert_eq!(labels(&first).len(), 100);
    assert_eq!(first["pools_offset"], 0);
    assert_eq!(first["totals"]["pools"], HOSTS);
    assert_eq!(first["totals"]["open"], HOSTS);
    assert_eq!(first["totals"]["idle"], HOSTS);
    assert_eq!(first["on_the_fly"]["live"], HOSTS);
    assert_eq!(first["on_the_fly"]["remembered"], 0);
    let rest = pools(sidecar.admin, "?offset=100&limit=100").await;
    assert_eq!(rest["pools_offset"], 100);
    let listed: BTreeSet<String> = labels(&first).into_iter().chain(labels(&rest)).collect();
    let all: BTreeSet<String> = (0..HOSTS).map(|i| host(i, port)).collect();
    assert_eq!(listed, all, "the two pages list every host once");
    assert_eq!(labels(&pools(sidecar.admin, "?limit=3&offset=10").await).len(), 3);
    let bad = admin_get(sidecar.admin, "/debug/pools?limit=ten").await;
    assert_eq!(bad.status, 400);
    assert!(
        bad.text().contains("offset and limit are numbers"),
        "{}",
        bad.text()
    );

    // Idle out (1 s), quiet (10 s), swept (every 5 s): every host remembered, no pool left.
    let remembered = eventually_async(Duration::from_secs(30), || async {
        let report = pools(sidecar.admin, "").await;
        report["on_the_fly"]["remembered"] == HOSTS
    })
    .await;
    assert!(remembered, "{:#}", pools(sidecar.admin, "").await["on_the_fly"]);
    let report = pools(sidecar.admin, "").await;
    assert_eq!(report["on_the_fly"]["live"], 0);
    assert_eq!(
        report["totals"]["pools"], 0,
        "the remembered hosts' pools are gone"
    );
    assert!(labels(&report).is_empty());
    assert_eq!(upstream.open(), 0);

    // The next request makes the upstream again, with a new connection (the client's first
    // one has idled out meanwhile).
    let mut client = RawClient::connect(sidecar.addr).await;
    let resp = client.get(&format!("http://{}/again", host(7, port))).await;
    assert_eq!(resp.status, 200);
    let report = pools(sidecar.admin, "").await;
    assert_eq!(report["on_the_fly"]["live"], 1);
    assert_eq!(report["on_the_fly"]["remembered"], HOSTS - 1);
    assert_eq!(labels(&report), vec![host(7, port)]);
    assert_eq!(report["pools"][0]["opened_total"], 1);
    assert_eq!(upstream.accepted(), HOSTS + 1);
}
