//! HTTP/2 PING keepalive to upstreams (`http2: { keepalive_interval, keepalive_timeout }`): an
//! upstream connection whose PINGs go unanswered while a stream is open is dropped after
//! `keepalive_timeout`. The stream on it is sent again on a new connection when the
//! stale-connection retry allows (a bodyless GET), and answered `502 upstream_reset` otherwise (a
//! POST with a body); either way the next requests use a new connection and the pool gauges
//! return to 0. An idle connection is not PINGed (README: PINGs only while streams are open), so
//! an unanswered keepalive never costs a pooled idle connection.
//!
//! The upstream is the fake h2c server behind a frame relay that can swallow the sidecar's PINGs
//! on one connection, so no PING ACK ever comes back on it while the server itself stays healthy.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{FakeUpstream, RawClient, Sidecar};

/// Longer than keepalive_interval plus keepalive_timeout (500 ms) with room for a busy machine:
/// the upstream is still "thinking" when the sidecar gives up on the connection.
const SLOW_PATH: &str = "/sleep/2000";

/// What the relay saw, per connection numbered from 1 in accept order.
#[derive(Default)]
struct RelayState {
    accepted: AtomicUsize,
    /// Connection whose PINGs from the sidecar are dropped (0: none).
    swallow_on: AtomicUsize,
    /// PING frames (not ACKs) dropped.
    swallowed: AtomicUsize,
    /// Connections the sidecar closed (EOF on the sidecar side), in order.
    closed_by_sidecar: Mutex<Vec<usize>>,
}

/// Relays h2c connections to `server` frame by frame, dropping the sidecar's PINGs on the
/// connection chosen with [`PingRelay::swallow_pings_on`].
struct PingRelay {
    addr: SocketAddr,
    state: Arc<RelayState>,
}

impl PingRelay {
    async fn start(server: SocketAddr) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(RelayState::default());
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let n = shared.accepted.fetch_add(1, Ordering::SeqCst) + 1;
                let upstream = tokio::net::TcpStream::connect(server).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut ur, mut uw) = upstream.into_split();
                tokio::spawn(async move {
                    // Server to sidecar: untouched.
                    let _ = tokio::io::copy(&mut ur, &mut cw).await;
                    let _ = cw.shutdown().await;
                });
                let state = shared.clone();
                tokio::spawn(async move {
                    // Sidecar to server: the preface, then frames minus the swallowed PINGs.
                    let mut preface = [0u8; 24];
                    if cr.read_exact(&mut preface).await.is_ok() && uw.write_all(&preface).await.is_ok() {
                        while let Some(frame) = support::read_h2_frame(&mut cr).await {
                            let is_ping = frame[3] == 6 && frame[4] & 1 == 0;
                            if is_ping && state.swallow_on.load(Ordering::SeqCst) == n {
                                state.swallowed.fetch_add(1, Ordering::SeqCst);
                                continue;
                            }
                            if uw.write_all(&frame).await.is_err() {
                                break;
                            }
                        }
                    }
                    state.closed_by_sidecar.lock().unwrap().push(n);
                    // Passes the close on, so the server's side of the connection ends too.
                    let _ = uw.shutdown().await;
                });
            }
        });

        PingRelay { addr, state }
    }

    /// From now on, PINGs the sidecar sends on connection `n` (1-based) go nowhere.
    fn swallow_pings_on(&self, n: usize) {
        self.state.swallow_on.store(n, Ordering::SeqCst);
    }

    fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    fn swallowed(&self) -> usize {
        self.state.swallowed.load(Ordering::SeqCst)
    }

    fn closed_by_sidecar(&self) -> Vec<usize> {
        self.state.closed_by_sidecar.lock().unwrap().clone()
    }
}

/// An h2c upstream `h2.test` reached through `relay`, PINGed after 200 ms without a frame and
/// given 300 ms to answer.
fn config(relay: &PingRelay) -> String {
    format!(
        "upstreams:\n  - name: h2\n    url: http://h2.test\n    addresses: [{}]\n    protocol: http2\n    \
         http2: {{ keepalive_interval: 200ms, keepalive_timeout: 300ms }}\n    \
         pool: {{ idle_timeout: 300ms }}\n",
        relay.addr
    )
}

/// Waits (up to 5 s) until the sidecar holds no upstream connection and no pending request;
/// returns what it last saw: (`egress_upstream_connections`, `egress_pool_pending_requests`).
async fn pool_settles(sidecar: &Sidecar) -> (f64, f64) {
    let gauges = |m: &prometheus_parse::Scrape| {
        (
            support::value(m, "egress_upstream_connections", &[]),
            support::value(m, "egress_pool_pending_requests", &[]),
        )
    };
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(5), |m| gauges(m) == (0.0, 0.0)).await;
    gauges(&m)
}

async fn retries(sidecar: &Sidecar) -> f64 {
    let m = support::scrape(sidecar.admin).await;
    support::value(&m, "egress_upstream_retries_total", &[("upstream", "h2")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_in_flight_on_a_connection_that_stops_answering_pings_is_retried_on_a_new_one() {
    let server = FakeUpstream::start_h2(None, 100).await;
    let relay = PingRelay::start(server.addr).await;
    let sidecar = Sidecar::start(&config(&relay)).await;
    let mut client = RawClient::connect(sidecar.addr).await;

    let resp = client.get("http://h2.test/").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(relay.accepted(), 1);

    // The pooled connection goes silent: PINGs out, no ACK back.
    relay.swallow_pings_on(1);
    let resp = client.get(&format!("http://h2.test{SLOW_PATH}")).await;
    assert_eq!(resp.status, 200, "the GET was not retried: {}", resp.text());
    assert!(
        relay.swallowed() >= 1,
        "the sidecar sent no PING while the stream was open"
    );
    // Ordering, not speed: the dead connection closed before the retry's answer came back (and
    // so not by idle_timeout afterwards).
    assert_eq!(
        relay.closed_by_sidecar(),
        [1],
        "connections the sidecar had closed when the GET was answered"
    );
    assert_eq!(relay.accepted(), 2, "the retry went to a new connection");
    // The server saw the GET twice: once on the dead connection, once on the new one.
    assert_eq!(server.requests(), 3);
    // One stale-connection retry; plus, at times, one for a request handed back unsent when the
    // retry was checked out onto the dead connection before the pool had forgotten it.
    let retried = retries(&sidecar).await;
    assert!(
        retried == 1.0 || retried == 2.0,
        "egress_upstream_retries_total: {retried}"
    );

    // The next request goes to the live connection, or a new one; never to the dead one.
    let resp = client.get("http://h2.test/").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_at_rest(&sidecar, &server).await;
}

/// No upstream connection left in the pool or open at the server, nothing pending.
async fn assert_at_rest(sidecar: &Sidecar, server: &FakeUpstream) {
    assert_eq!(
        pool_settles(sidecar).await,
        (0.0, 0.0),
        "(connections, pending) at rest"
    );
    assert!(
        support::eventually(Duration::from_secs(5), || server.open() == 0).await,
        "upstream connections left open ({} open)",
        server.open()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_in_flight_on_a_connection_that_stops_answering_pings_fails_as_upstream_reset() {
    let server = FakeUpstream::start_h2(None, 100).await;
    let relay = PingRelay::start(server.addr).await;
    let sidecar = Sidecar::start(&config(&relay)).await;
    relay.swallow_pings_on(1);
    let mut client = RawClient::connect(sidecar.addr).await;

    // A body the sidecar has streamed away cannot be replayed, and POST is not idempotent.
    client
        .send_raw(
            format!(
                "POST http://h2.test{SLOW_PATH} HTTP/1.1\r\nHost: h2.test\r\nContent-Length: 4\r\n\r\ndata"
            )
            .as_bytes(),
        )
        .await;
    let resp = client.read_response(false).await.expect("a response");
    let body = resp.assert_sidecar_error(502, "upstream_reset", "POST on a dead connection");
    assert!(
        body.ends_with(
            "upstream h2: connection closed before a response: keep-alive timed out: no PING acknowledgement within keepalive_timeout\n"
        ),
        "{body}"
    );
    assert!(relay.swallowed() >= 1, "no PING was sent");
    // The stream fails as the connection is dropped; its socket closes right behind.
    assert!(
        support::eventually(Duration::from_secs(5), || relay.closed_by_sidecar() == [1]).await,
        "the sidecar kept the connection whose PINGs went unanswered (closed: {:?})",
        relay.closed_by_sidecar()
    );
    assert_eq!(relay.accepted(), 1, "the POST was not retried");
    assert_eq!(retries(&sidecar).await, 0.0, "egress_upstream_retries_total");

    // New requests go to a new connection.
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get("http://h2.test/")
        .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(relay.accepted(), 2);
    assert_at_rest(&sidecar, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_not_pinged_and_stays_pooled() {
    let server = FakeUpstream::start_h2(None, 100).await;
    let relay = PingRelay::start(server.addr).await;
    // idle_timeout far beyond the wait below, so only keepalive could close the connection.
    let sidecar = Sidecar::start(&config(&relay).replace("idle_timeout: 300ms", "idle_timeout: 30s")).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let resp = client.get("http://h2.test/").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    relay.swallow_pings_on(1);
    // A bounded wait for what must not happen: twice keepalive_interval plus keepalive_timeout
    // idle, in which a PING sent while idle would have been swallowed and the connection dropped.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(relay.swallowed(), 0, "PINGs sent on an idle connection");
    assert_eq!(
        relay.closed_by_sidecar(),
        Vec::<usize>::new(),
        "connections closed"
    );
    let resp = client.get("http://h2.test/").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(relay.accepted(), 1, "the idle connection was reused");
}
