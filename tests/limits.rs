//! Hard limits and what happens at them: the `upstream` metric label stops at 256 distinct
//! values (then `other`), `downstream.max_connections` leaves extra connections waiting in the
//! kernel's accept backlog until one closes, and an accept that fails for want of file
//! descriptors (EMFILE) closes the 64 longest-idle parked connections so new ones are served.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use support::{ChildSidecar, FakeUpstream, RawClient, Sidecar};

/// `metrics::MAX_UPSTREAM_LABELS`.
const MAX_UPSTREAM_LABELS: usize = 256;

/// Distinct `upstream` label values in one family.
fn upstream_labels(scrape: &prometheus_parse::Scrape, family: &str) -> BTreeSet<String> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == family)
        .filter_map(|s| s.labels.get("upstream").map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn past_256_upstreams_new_ones_are_labelled_other() {
    const UPSTREAMS: usize = MAX_UPSTREAM_LABELS + 44;
    // Bound, never listening: each is a distinct upstream authority whose dial is refused at once,
    // and none of the ports can be taken by anything else while the test runs.
    let refused: Vec<socket2::Socket> = (0..UPSTREAMS)
        .map(|_| {
            let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            s.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
                .unwrap();
            s
        })
        .collect();
    let sidecar = Sidecar::start("").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    for socket in &refused {
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        let resp = client.get(&format!("http://{addr}/")).await;
        resp.assert_sidecar_error(502, "connect_failed", &addr.to_string());
    }

    let scrape = support::scrape(sidecar.admin).await;
    let labels = upstream_labels(&scrape, "egress_upstream_requests_total");
    assert!(
        labels.contains("other"),
        "no `other` label among {}",
        labels.len()
    );
    assert_eq!(
        labels.len(),
        MAX_UPSTREAM_LABELS + 1,
        "256 upstreams by name, the rest as `other`"
    );
    // Labels go to upstreams in the order they are first met.
    let first = refused[0].local_addr().unwrap().as_socket().unwrap().to_string();
    let last = refused[UPSTREAMS - 1]
        .local_addr()
        .unwrap()
        .as_socket()
        .unwrap()
        .to_string();
    assert!(labels.contains(&first) && !labels.contains(&last));
    assert_eq!(
        support::value(
            &scrape,
            "egress_upstream_requests_total",
            &[("upstream", "other"), ("code", "502")]
        ),
        (UPSTREAMS - MAX_UPSTREAM_LABELS) as f64,
        "every request past the cap is counted, under `other`"
    );
    assert_eq!(
        upstream_labels(&scrape, "egress_upstream_connections_opened_total").len(),
        MAX_UPSTREAM_LABELS + 1,
        "every family shares the cap"
    );
}

#[tokio::test]
async fn past_max_connections_a_connection_waits_in_the_backlog_until_one_closes() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(
        "downstream: { max_connections: 2, idle_timeout: 300s, leaky_idle_timeout: 300s }\n\
         budget: { enabled: false }\n",
    )
    .await;
    let url = format!("http://{}/", upstream.addr);
    let mut first = RawClient::connect(sidecar.addr).await;
    assert_eq!(first.get(&url).await.status, 200);
    let mut second = RawClient::connect(sidecar.addr).await;
    assert_eq!(second.get(&url).await.status, 200);

    // The kernel completes the handshake (the backlog), so the connect itself succeeds.
    let mut third = RawClient::connect(sidecar.addr).await;
    third
        .send_raw(format!("GET {url} HTTP/1.1\r\nHost: {}\r\n\r\n", upstream.addr).as_bytes())
        .await;
    // Bounded wait for what must not happen: neither an answer nor a close while both permits
    // are held. 300 ms is many times what a served request takes here.
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(300), third.stream.peek(&mut byte)).await;
    assert!(
        early.is_err(),
        "the third connection was answered or closed beyond max_connections: {early:?}"
    );
    let scrape = support::scrape(sidecar.admin).await;
    assert_eq!(
        support::value(&scrape, "egress_downstream_connections_opened_total", &[]),
        2.0,
        "the third connection was not accepted"
    );
    assert_eq!(upstream.requests(), 2);

    drop(first);
    let resp = tokio::time::timeout(Duration::from_secs(5), third.read_response(false))
        .await
        .expect("served once a connection closed")
        .expect("a response, not a close");
    assert_eq!(resp.status, 200);
    assert_eq!(upstream.requests(), 3);
    // The second connection was never disturbed.
    assert_eq!(second.get(&url).await.status, 200);
}

/// Opens a keep-alive connection and sends two requests on it: the sidecar has accepted it, and
/// the leak detector (about one request per connection) leaves the source alone.
async fn idle_connection(sidecar: &ChildSidecar, url: &str) -> RawClient {
    let mut client = RawClient::connect(sidecar.addr).await;
    for _ in 0..2 {
        let resp = tokio::time::timeout(Duration::from_secs(10), client.get(url))
            .await
            .expect("served within 10s (an accept failing for want of descriptors waits forever)");
        assert_eq!(resp.status, 200);
    }
    client
}

#[tokio::test]
async fn out_of_descriptors_the_64_longest_idle_connections_make_room() {
    /// The sidecar's RLIMIT_NOFILE: room for about 140 application connections.
    const LIMIT: usize = 160;
    /// `downstream::FD_SHED`.
    const SHED: usize = 64;
    let have_prlimit = tokio::process::Command::new("prlimit")
        .arg("--version")
        .output()
        .await
        .is_ok_and(|o| o.status.success());
    if !have_prlimit {
        return support::skip("prlimit (util-linux) is not installed");
    }
    let upstream = FakeUpstream::start().await;
    let url = format!("http://{}/", upstream.addr);
    // Only the descriptor limit may close an idle connection here.
    let sidecar = ChildSidecar::spawn(
        "downstream: { idle_timeout: 300s, leaky_idle_timeout: 300s, max_idle_connections: 100000 }\n\
         budget: { enabled: false }\n",
    )
    .await;
    let pid = sidecar.child.id().unwrap();
    assert!(support::open_fds(&sidecar) < LIMIT / 2);
    // Lowered on the running process: no unsafe pre_exec needed, and it holds few descriptors.
    let status = tokio::process::Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={LIMIT}:{LIMIT}"))
        .status()
        .await
        .unwrap();
    assert!(status.success(), "prlimit --pid {pid}: {status}");

    // The longest idle: all parked before any other connection is opened, so they are the 64
    // the sidecar sheds first.
    let mut oldest = Vec::new();
    for _ in 0..SHED {
        oldest.push(idle_connection(&sidecar, &url).await);
    }
    support::wait_parked(sidecar.admin, SHED, Some(SHED)).await;
    // Then connections until one meets EMFILE at accept. Each is served (idle_connection says
    // so), the one that met EMFILE included, once the sidecar has made room.
    let mut newer = Vec::new();
    while sidecar.logged("out of file descriptors").is_empty() {
        newer.push(idle_connection(&sidecar, &url).await);
        assert!(newer.len() < LIMIT, "the descriptor limit was never reached");
    }
    println!("EMFILE after {} idle connections", oldest.len() + newer.len());

    for (i, conn) in oldest.iter_mut().enumerate() {
        assert!(
            conn.is_closed_within(Duration::from_secs(5)).await,
            "longest-idle connection {i} was closed"
        );
    }
    for (i, conn) in newer.iter_mut().enumerate() {
        let resp = tokio::time::timeout(Duration::from_secs(5), conn.get(&url))
            .await
            .unwrap_or_else(|_| panic!("newer connection {i} still served"));
        assert_eq!(resp.status, 200, "newer connection {i}");
    }
    let scrape = support::scrape(sidecar.admin).await;
    assert_eq!(
        support::value(&scrape, "egress_downstream_idle_closed_total", &[]),
        SHED as f64,
        "the shed connections are counted as idle closes"
    );
    let logged = sidecar.logged("out of file descriptors");
    assert_eq!(logged.len(), 1, "one shed: {logged:?}");
    assert!(logged[0].contains(&format!("\"closed\":{SHED}")), "{logged:?}");
}
