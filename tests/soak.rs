//! The soak run (ignored by default; `SOAK_SECONDS`, default 600; `SOAK_TRAFFIC`, a part of
//! the mix such as `failing` or `keepalive,h2`, to tell which traffic a trend comes from):
//!
//! ```text
//! cargo test --release --test soak -- --ignored --nocapture
//! ```
//!
//! The sidecar binary serves, at once and for the whole run, keep-alive HTTP/1.1 clients, a
//! leaky client (a new connection per request, never closed by the client), HTTP/2 upstream
//! traffic, and failing traffic (upstream resets and truncations, a lying `Content-Length`, a
//! refused port, a denied host). Every second it records the sidecar's RSS, open fds, runtime
//! tasks and pool gauges (printed, and written to `SOAK_CSV`, default `target/soak.csv`).
//!
//! It passes when every response was the one expected for its request (zero unexplained
//! errors), RSS at the end is within 10% of RSS after the warm-up, and once traffic stops the
//! upstream and downstream gauges fall to 0 and the fd and task counts to their baselines.

mod support;

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use support::{fault_upstream, open_fds, ChildSidecar, FakeUpstream, RawClient, RawResponse};
use tokio::time::Instant;

/// Requests each traffic loop sends per second at most: enough to keep every path busy for ten
/// minutes without the test process's own bookkeeping dominating.
const LOOP_INTERVAL: Duration = Duration::from_millis(10);
const KEEPALIVE_CLIENTS: usize = 8;
const H2_CLIENTS: usize = 4;
const LEAKY_INTERVAL: Duration = Duration::from_millis(50);
/// How long the leaky client holds each connection before forgetting it (the sidecar's idle
/// timeout, 2 s, or the leak detector's shorter one, closes it first).
const LEAKY_HOLD: Duration = Duration::from_secs(5);

/// What the traffic loops saw: requests answered as expected, and everything else.
#[derive(Default)]
struct Tally {
    ok: u64,
    unexplained: Vec<String>,
}

impl Tally {
    fn check(&mut self, what: &str, outcome: Result<(), String>) {
        match outcome {
            Ok(()) => self.ok += 1,
            Err(why) if self.unexplained.len() < 20 => self.unexplained.push(format!("{what}: {why}")),
            Err(_) => {}
        }
    }
}

/// One request on `client`, answered within 10 s.
async fn request(client: &mut RawClient, url: &str) -> Result<RawResponse, String> {
    let host = url.split('/').nth(2).unwrap_or("");
    client
        .send_raw(format!("GET {url} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    tokio::time::timeout(Duration::from_secs(10), client.read_response(false))
        .await
        .map_err(|_| "no response within 10 s".to_owned())?
        .ok_or_else(|| "connection closed without a response".to_owned())
}

fn expect(
    resp: &RawResponse,
    status: u16,
    kind: Option<&str>,
    body_len: Option<usize>,
) -> Result<(), String> {
    let got_kind = resp.header("x-egress-error");
    if resp.status != status || got_kind != kind || body_len.is_some_and(|n| n != resp.body.len()) {
        return Err(format!(
            "{} {:?} ({} bytes), expected {status} {kind:?}",
            resp.status,
            got_kind,
            resp.body.len()
        ));
    }
    Ok(())
}

/// A keep-alive client: one connection, GETs until `until`.
async fn keepalive(sidecar: SocketAddr, url: String, body_len: usize, until: Instant) -> Tally {
    let mut tally = Tally::default();
    let mut client = RawClient::connect(sidecar).await;
    while Instant::now() < until {
        let outcome = request(&mut client, &url)
            .await
            .and_then(|r| expect(&r, 200, None, Some(body_len)));
        if outcome.is_err() {
            client = RawClient::connect(sidecar).await;
        }
        tally.check(&url, outcome);
        // Paces the traffic (the scenario's request rate), not synchronisation.
        tokio::time::sleep(LOOP_INTERVAL).await;
    }
    tally
}

/// The seeds' leaky client: a new connection per request, left open.
async fn leaky(sidecar: SocketAddr, url: String, until: Instant) -> Tally {
    let mut tally = Tally::default();
    let mut held: VecDeque<(Instant, RawClient)> = VecDeque::new();
    while Instant::now() < until {
        let mut client = RawClient::connect(sidecar).await;
        tally.check(
            "leaky",
            request(&mut client, &url)
                .await
                .and_then(|r| expect(&r, 200, None, None)),
        );
        held.push_back((Instant::now(), client));
        while held.front().is_some_and(|(at, _)| at.elapsed() > LEAKY_HOLD) {
            held.pop_front();
        }
        // Paces the traffic (the scenario's request rate), not synchronisation.
        tokio::time::sleep(LEAKY_INTERVAL).await;
    }
    tally
}

/// Requests that fail, each in the way the README documents.
async fn failing(sidecar: SocketAddr, faults: SocketAddr, dead: SocketAddr, until: Instant) -> Tally {
    let mut tally = Tally::default();
    while Instant::now() < until {
        let mut client = RawClient::connect(sidecar).await;
        let url = format!("http://{faults}/reset-before-head");
        let outcome = request(&mut client, &url).await;
        tally.check(
            &url,
            outcome.and_then(|r| expect(&r, 502, Some("upstream_reset"), None)),
        );

        for path in ["/reset-mid-body", "/truncated"] {
            let mut client = RawClient::connect(sidecar).await;
            let url = format!("http://{faults}{path}");
            client
                .send_raw(format!("GET {url} HTTP/1.1\r\nHost: {faults}\r\n\r\n").as_bytes())
                .await;
            tally.check(&url, truncated(&mut client).await);
        }

        let mut client = RawClient::connect(sidecar).await;
        let lie = request(&mut client, &format!("http://{faults}/lie-long")).await;
        tally.check("lie-long", lie.and_then(|r| expect(&r, 200, None, Some(5))));
        let after = request(&mut client, &format!("http://{faults}/ok")).await;
        tally.check(
            "after lie-long",
            after.and_then(|r| expect(&r, 200, None, Some(2))),
        );

        let mut client = RawClient::connect(sidecar).await;
        let refused = request(&mut client, &format!("http://{dead}/")).await;
        tally.check(
            "refused port",
            refused.and_then(|r| expect(&r, 502, Some("connect_failed"), None)),
        );
        let denied = request(&mut client, "http://denied.example/").await;
        tally.check(
            "denied host",
            denied.and_then(|r| expect(&r, 403, Some("denied"), None)),
        );
        // Paces the traffic (the scenario's request rate), not synchronisation.
        tokio::time::sleep(LOOP_INTERVAL * 10).await;
    }
    tally
}

/// A 200 whose body stops short of its `Content-Length`, then the connection closes.
async fn truncated(client: &mut RawClient) -> Result<(), String> {
    match tokio::time::timeout(Duration::from_secs(10), client.read_until_closed()).await {
        Ok(Some((200, received))) if received < support::FAULT_BODY_LEN => Ok(()),
        Ok(Some((status, received))) => Err(format!("{status} with {received} body bytes")),
        Ok(None) => Err("closed before a response head".into()),
        Err(_) => Err("the truncated response did not end within 10 s".into()),
    }
}

/// A gauge from a scrape, 0 when absent.
fn gauge(scrape: &prometheus_parse::Scrape, name: &str) -> f64 {
    support::value(scrape, name, &[])
}

/// One second's record.
#[derive(Debug, Clone, Copy)]
struct Sample {
    second: u64,
    rss_kib: u64,
    fds: usize,
    tasks: f64,
    upstream: f64,
    downstream: f64,
    pending: f64,
}

async fn sample(sidecar: &ChildSidecar, second: u64) -> Sample {
    let scrape = support::scrape(sidecar.admin).await;
    Sample {
        second,
        rss_kib: sidecar.status_kib("VmRSS"),
        fds: open_fds(sidecar),
        tasks: gauge(&scrape, "egress_runtime_tasks"),
        upstream: gauge(&scrape, "egress_upstream_connections"),
        downstream: gauge(&scrape, "egress_downstream_connections"),
        pending: gauge(&scrape, "egress_pool_pending_requests"),
    }
}

/// Waits (up to 15 s) for no connection either side and, when given, the baseline's fd and
/// task counts.
async fn quiet(sidecar: &ChildSidecar, baseline: Option<Sample>) -> Sample {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = sample(sidecar, 0).await;
        let quiet = now.upstream == 0.0
            && now.downstream == 0.0
            && baseline.is_none_or(|b| now.fds == b.fds && now.tasks <= b.tasks);
        if quiet || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a 10-minute soak; run with --ignored (see the module docs)"]
async fn soak() {
    let seconds: u64 = std::env::var("SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let csv_path = std::env::var("SOAK_CSV")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target/soak.csv").to_owned());
    let h1 = FakeUpstream::start().await;
    let h2 = FakeUpstream::start_h2(None, 100).await;
    let faults = fault_upstream().await;
    let refusing = support::RefusingPort::new();
    let dead = refusing.addr;
    let sidecar = Arc::new(
        ChildSidecar::spawn(&format!(
            "downstream: {{ idle_timeout: 2s }}\n\
             defaults: {{ connect_timeout: 1s, pool: {{ idle_timeout: 2s, max_connections: 16 }} }}\n\
             upstreams:\n  - {{ name: h2, url: 'http://{}', protocol: http2 }}\n\
             policy: {{ deny_hosts: [denied.example] }}\n",
            h2.addr
        ))
        .await,
    );

    // Baseline: what the process keeps for its lifetime once it has served and parked a
    // connection, with every connection closed again.
    let mut warm = RawClient::connect(sidecar.addr).await;
    request(&mut warm, &format!("http://{}/", h1.addr)).await.unwrap();
    support::wait_parked(sidecar.admin, 1, Some(1)).await;
    drop(warm);
    let baseline = quiet(&sidecar, None).await;
    println!("baseline: {baseline:?}");

    let started = Instant::now();
    let until = started + Duration::from_secs(seconds);
    let mut loops = Vec::new();
    // SOAK_TRAFFIC picks part of the mix (`keepalive,h2,leaky,failing`), to tell which traffic
    // a trend in the samples comes from.
    let mix = std::env::var("SOAK_TRAFFIC").unwrap_or_else(|_| "keepalive,h2,leaky,failing".into());
    let runs = |kind: &str| mix.split(',').any(|k| k == kind);
    for _ in 0..KEEPALIVE_CLIENTS * usize::from(runs("keepalive")) {
        loops.push(tokio::spawn(keepalive(
            sidecar.addr,
            format!("http://{}/bytes/1024", h1.addr),
            1024,
            until,
        )));
    }
    for _ in 0..H2_CLIENTS * usize::from(runs("h2")) {
        loops.push(tokio::spawn(keepalive(
            sidecar.addr,
            format!("http://{}/", h2.addr),
            2,
            until,
        )));
    }
    if runs("leaky") {
        loops.push(tokio::spawn(leaky(
            sidecar.addr,
            format!("http://{}/", h1.addr),
            until,
        )));
    }
    if runs("failing") {
        loops.push(tokio::spawn(failing(sidecar.addr, faults, dead, until)));
    }

    let warmup = Duration::from_secs((seconds / 5).clamp(1, 30));
    let mut samples = Vec::new();
    let mut after_warmup = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while Instant::now() < until {
        tick.tick().await;
        let now = sample(&sidecar, started.elapsed().as_secs()).await;
        // The fake upstreams remember every request; the soak needs none of it.
        h1.seen.lock().unwrap().clear();
        h2.seen.lock().unwrap().clear();
        println!("{now:?}");
        if after_warmup.is_none() && started.elapsed() >= warmup {
            after_warmup = Some(now);
        }
        samples.push(now);
    }
    let mut tally = Tally::default();
    for task in loops {
        let part = task.await.unwrap();
        tally.ok += part.ok;
        tally.unexplained.extend(part.unexplained);
    }
    let end = quiet(&sidecar, Some(baseline)).await;
    let after_warmup = after_warmup.expect("a sample after the warm-up");

    let mut csv =
        String::from("second,rss_kib,fds,tasks,upstream_connections,downstream_connections,pending\n");
    for s in &samples {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{}",
            s.second, s.rss_kib, s.fds, s.tasks, s.upstream, s.downstream, s.pending
        );
    }
    std::fs::write(&csv_path, csv).unwrap();
    let peak = samples.iter().map(|s| s.rss_kib).max().unwrap_or(0);
    println!(
        "soak: {seconds} s, {} requests answered as expected, {} unexplained; RSS after warm-up {} KiB, \
         peak {peak} KiB, at the end {} KiB ({:.3}x); fds {} -> {}; tasks {} -> {}; samples in {csv_path}",
        tally.ok,
        tally.unexplained.len(),
        after_warmup.rss_kib,
        end.rss_kib,
        end.rss_kib as f64 / after_warmup.rss_kib as f64,
        baseline.fds,
        end.fds,
        baseline.tasks,
        end.tasks,
    );
    assert!(
        tally.unexplained.is_empty(),
        "unexplained: {:#?}",
        tally.unexplained
    );
    // Each part of the mix alone answers at least 10 requests a second.
    assert!(
        tally.ok > seconds * 10,
        "only {} requests in {seconds} s",
        tally.ok
    );
    assert_eq!(
        (end.upstream, end.downstream),
        (0.0, 0.0),
        "connections left open"
    );
    assert_eq!(end.fds, baseline.fds, "fds");
    assert!(
        end.tasks <= baseline.tasks,
        "tasks: {} at the end, {} at the start",
        end.tasks,
        baseline.tasks
    );
    assert!(
        end.rss_kib as f64 <= after_warmup.rss_kib as f64 * 1.10,
        "RSS {} KiB at the end against {} KiB after the warm-up",
        end.rss_kib,
        after_warmup.rss_kib
    );
}
