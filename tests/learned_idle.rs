//! The pool learning an upstream's unannounced idle timeout: an upstream that closes keep-alive
//! connections idle for 2 s (and sends no `Keep-Alive` header) races the pool's reuse until the
//! pool has seen it close idle connections three times; from then on the pool retires idle
//! connections before 2 s, and a 60 s run with gaps on both sides of 2 s has no retry, no lost
//! request and no upstream close of a pooled connection.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use support::{RawClient, Sidecar};

/// The upstream closes a connection idle this long.
const IDLE: Duration = Duration::from_secs(2);
/// How long the upstream's close takes to reach the sidecar: a request sent in this window
/// after the upstream decided to close is lost, as on a real network path. Wide enough that a
/// request sent 2.005 s after the last still lands in it on a loaded machine.
const FIN_DELAY: Duration = Duration::from_millis(100);
/// Response bodies are this much padding after the request path, so a cut body shows.
const PADDING: usize = 4096;

#[derive(Default)]
struct Counts {
    accepted: AtomicUsize,
    answered: AtomicUsize,
    /// Requests that arrived on a connection after the upstream decided to close it.
    lost: AtomicUsize,
}

/// A keep-alive HTTP/1.1 upstream that closes every connection idle for [`IDLE`] since its last
/// response (or its accept) without saying so in any header.
struct ClosingUpstream {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

impl ClosingUpstream {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                c.accepted.fetch_add(1, Ordering::SeqCst);
                conns.spawn(serve(stream, c.clone()));
            }
        });
        ClosingUpstream { addr, counts, task }
    }

    fn count(&self, which: fn(&Counts) -> &AtomicUsize) -> usize {
        which(&self.counts).load(Ordering::SeqCst)
    }
}

impl Drop for ClosingUpstream {
    fn drop(&mut self) {
        // Aborting the accept task drops its JoinSet, which aborts every connection task.
        self.task.abort();
    }
}

async fn serve(mut stream: TcpStream, counts: Arc<Counts>) {
    let mut buf = Vec::new();
    let mut idle_since = Instant::now();
    loop {
        let deadline = idle_since + IDLE;
        let path = match tokio::time::timeout_at(deadline, support::read_request_path(&mut stream, &mut buf))
            .await
        {
            Ok(Some(path)) => path,
            Ok(None) => return, // the sidecar closed it
            Err(_) => break,    // idle timeout: decided to close
        };
        // The timer may fire late on a busy machine; the decision is at the deadline all the same.
        if Instant::now() >= deadline {
            counts.lost.fetch_add(1, Ordering::SeqCst);
            break;
        }
        let body = format!("{path}\n{}", "x".repeat(PADDING));
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
        if stream
            .write_all(format!("{head}{body}").as_bytes())
            .await
            .is_err()
        {
            return;
        }
        counts.answered.fetch_add(1, Ordering::SeqCst);
        idle_since = Instant::now();
    }
    linger_then_close(stream, &mut buf, counts, idle_since + IDLE + FIN_DELAY).await;
}

/// The close is decided; until its FIN "arrives" at `fin_at`, whatever comes in is lost.
async fn linger_then_close(mut stream: TcpStream, buf: &mut Vec<u8>, counts: Arc<Counts>, fin_at: Instant) {
    while let Ok(Some(_)) =
        tokio::time::timeout_at(fin_at, support::read_request_path(&mut stream, buf)).await
    {
        counts.lost.fetch_add(1, Ordering::SeqCst);
    }
    // Bytes that arrived as the timer fired, before the socket was seen readable, are a lost
    // request too (closing on them sends a reset, which the sidecar retries).
    if !buf.is_empty() || matches!(stream.try_read(&mut [0u8; 4096]), Ok(n) if n > 0) {
        counts.lost.fetch_add(1, Ordering::SeqCst);
    }
}

/// The sidecar's counters this test watches.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Observed {
    retries: f64,
    upstream_closes: f64,
    learned_closes: f64,
    reused: f64,
    learned_seconds: f64,
}

async fn observe(admin: SocketAddr) -> Observed {
    let m = support::scrape(admin).await;
    let up = [("upstream", "closing")];
    let closed = |reason: &str| {
        support::value(
            &m,
            "egress_upstream_connections_closed_total",
            &[("upstream", "closing"), ("reason", reason)],
        )
    };
    Observed {
        retries: support::value(&m, "egress_upstream_retries_total", &up),
        upstream_closes: closed("upstream_close"),
        learned_closes: closed("learned_idle_timeout"),
        reused: support::value(&m, "egress_pool_reused_total", &up),
        learned_seconds: support::value(&m, "egress_upstream_learned_idle_timeout_seconds", &up),
    }
}

/// Sleeps `gap`, then GETs `/req/{n}` through the sidecar and checks the whole answer.
async fn request_after(client: &mut RawClient, upstream: SocketAddr, n: usize, gap: Duration) {
    // The scenario: the application idles for `gap` against the upstream's idle timeout.
    tokio::time::sleep(gap).await;
    let resp = client.get(&format!("http://{upstream}/req/{n}")).await;
    assert_eq!(resp.status, 200, "request {n} after {gap:?}: {}", resp.text());
    let expected = format!("/req/{n}\n{}", "x".repeat(PADDING));
    assert!(resp.text() == expected, "request {n}: body cut or wrong");
}

#[tokio::test]
async fn the_pool_learns_an_unannounced_upstream_idle_timeout() {
    let upstream = ClosingUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: closing\n    url: http://{}\n    pool: {{ idle_timeout: 30s }}\n",
        upstream.addr
    ))
    .await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let mut n = 0;

    // Phase 1, nothing learned: a request 2.005 s after the last one reaches the upstream after
    // it decided to close, before its FIN reaches the pool (lost there, retried by the sidecar);
    // a 2.3 s gap lets the pool see the close while the connection idles (one observation).
    // A retried request's fresh connection idles from its answer, so each step starts alike.
    request_after(&mut client, upstream.addr, n, Duration::ZERO).await;
    let racing = Duration::from_millis(2005);
    let observed = Duration::from_millis(2300);
    let mut learned_after = None;
    // Three chances to race first: one that loses the race to a late timer lands after the FIN
    // and is an observation instead, so the order keeps at least one race possible on a loaded
    // machine.
    for (i, gap) in [racing, racing, racing, observed, observed, observed]
        .into_iter()
        .enumerate()
    {
        n += 1;
        request_after(&mut client, upstream.addr, n, gap).await;
        let pool = support::debug_pool(sidecar.admin, "closing").await;
        println!(
            "phase 1 step {i} gap {gap:?}: observations {} learned_idle_timeout_ms {}",
            pool["idle_close_observations"], pool["learned_idle_timeout_ms"]
        );
        if learned_after.is_none() && !pool["learned_idle_timeout_ms"].is_null() {
            learned_after = pool["idle_close_observations"].as_u64();
        }
    }
    let before = observe(sidecar.admin).await;
    let pool = support::debug_pool(sidecar.admin, "closing").await;
    println!(
        "phase 1: {before:?}; upstream accepted {} answered {} lost {}; pool {}",
        upstream.count(|c| &c.accepted),
        upstream.count(|c| &c.answered),
        upstream.count(|c| &c.lost),
        pool
    );
    let lost_before = upstream.count(|c| &c.lost);
    assert!(lost_before >= 1, "no reuse raced the upstream's close");
    assert_eq!(
        before.retries, lost_before as f64,
        "every lost request was retried"
    );
    assert!(
        before.upstream_closes >= 3.0,
        "idle connections the upstream closed"
    );
    assert_eq!(
        pool["idle_close_observations"].as_f64(),
        Some(before.upstream_closes),
        "every upstream close of an idle connection was observed"
    );
    assert_eq!(learned_after, Some(3), "learned from the third close, not before");
    let learned_ms = pool["learned_idle_timeout_ms"].as_u64().expect("a learned value");
    // The close reaches the pool FIN_DELAY after the upstream's 2 s, less the time from the
    // upstream's answer to the pool's check-in, plus scheduling slack either way.
    assert!(
        (1900..2400).contains(&learned_ms),
        "learned {learned_ms} ms for a 2 s upstream"
    );
    assert!(
        (before.learned_seconds - learned_ms as f64 / 1000.0).abs() < 0.001,
        "the gauge agrees with /debug/pools"
    );
    let retire_ms = pool["learned_retire_after_ms"]
        .as_u64()
        .expect("a retirement age");
    assert_eq!(retire_ms, learned_ms - 250, "a 250 ms margin");

    // Phase 2, learned: 60 s of requests with gaps below and above 2 s. Retirement is between
    // 1.75 s and 2 s, so gaps up to 1.5 s must reuse and gaps of 2 s and more must not; the
    // 1.9 s and 2.005 s gaps are the ones that would race without learning.
    let gaps = [500, 1500, 1900, 2005, 2500].map(Duration::from_millis);
    let started = Instant::now();
    let (mut short, mut long, mut requests) = (0, 0, 0);
    for gap in gaps.iter().cycle() {
        if started.elapsed() + *gap > Duration::from_secs(60) {
            break;
        }
        n += 1;
        requests += 1;
        request_after(&mut client, upstream.addr, n, *gap).await;
        if *gap <= Duration::from_millis(1500) {
            short += 1;
        } else if *gap >= IDLE {
            long += 1;
        }
    }
    let after = observe(sidecar.admin).await;
    println!(
        "phase 2 ({:?}, {requests} requests, {short} gaps <= 1.5 s, {long} >= 2 s): {after:?}; upstream accepted {} answered {} lost {}",
        started.elapsed(),
        upstream.count(|c| &c.accepted),
        upstream.count(|c| &c.answered),
        upstream.count(|c| &c.lost),
    );
    assert_eq!(after.retries, before.retries, "a request was retried");
    assert_eq!(
        upstream.count(|c| &c.lost),
        lost_before,
        "the upstream saw a request after deciding to close"
    );
    assert_eq!(
        after.upstream_closes, before.upstream_closes,
        "the upstream closed a connection the pool still held"
    );
    let (retired, reused) = (
        after.learned_closes - before.learned_closes,
        after.reused - before.reused,
    );
    assert!(
        retired >= f64::from(long),
        "a gap of 2 s or more found its connection idle"
    );
    assert!(
        reused >= f64::from(short),
        "short gaps still reuse the connection"
    );
    assert_eq!(
        retired + reused,
        f64::from(requests),
        "each request reused the connection or found it retired by the learned timeout"
    );
    assert_eq!(
        upstream.count(|c| &c.answered),
        n + 1,
        "each request answered once"
    );
    drop(client);
    sidecar.stop().await;
}
