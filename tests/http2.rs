//! HTTP/2 upstreams: many downstream HTTP/1.1 requests multiplexed over few upstream
//! connections, as many as the server's stream limit requires and no more.

mod support;

use std::time::Duration;

use support::{FakeUpstream, RawClient, Sidecar, TempDir, TestCa};

/// The burst tests count connections, which scheduling delays on a 2-core machine can skew when
/// several hundred-connection bursts run at once: they take turns.
static BURSTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Sends `n` concurrent requests for `path`, each on its own downstream connection; returns
/// the statuses.
async fn burst(sidecar: &Sidecar, upstream: std::net::SocketAddr, path: &str, n: usize) -> Vec<u16> {
    let _turn = BURSTS.lock().await;
    let url = format!("http://{upstream}{path}");
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (addr, url) = (sidecar.addr, url.clone());
        tasks.push(tokio::spawn(async move {
            let resp = RawClient::connect(addr).await.get(&url).await;
            assert_eq!(resp.status, 200, "{}", resp.text());
            resp.status
        }));
    }
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap());
    }
    statuses
}

fn h2c_upstream_config(upstream: &FakeUpstream, pool: &str) -> String {
    format!(
        "upstreams:\n  - name: h2\n    url: http://{}\n    protocol: http2\n    pool: {{ pending_timeout: 30s, {pool} }}\n",
        upstream.addr
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_hundred_requests_use_four_connections_of_a_hundred_streams() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&h2c_upstream_config(&upstream, "max_connections: 64")).await;
    let held = HeldStreams::open(&sidecar, &upstream, 400).await;
    println!(
        "400 concurrent requests, server limit 100 streams: {} upstream connections (peak open {})",
        upstream.accepted(),
        upstream.peak()
    );
    assert_eq!(upstream.accepted(), 4);
    held.release(&upstream).await;
    assert!(upstream.seen().iter().all(|s| s.version == http::Version::HTTP_2));
}

/// Requests whose upstream streams stay open until released (`/sse/2` sends its second event
/// on `sse_next`): all of them are open at once however slowly a loaded machine sends them,
/// which a fixed `/sleep` cannot promise.
struct HeldStreams {
    requests: Vec<tokio::task::JoinHandle<u16>>,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

impl HeldStreams {
    /// Sends `n` requests and returns once the server has all of them.
    async fn open(sidecar: &Sidecar, upstream: &FakeUpstream, n: usize) -> Self {
        let turn = BURSTS.lock().await;
        let url = format!("http://{}/sse/2", upstream.addr);
        let requests = (0..n)
            .map(|_| {
                let (addr, url) = (sidecar.addr, url.clone());
                tokio::spawn(async move { RawClient::connect(addr).await.get(&url).await.status })
            })
            .collect();
        assert!(
            support::eventually(Duration::from_secs(20), || upstream.requests() == n).await,
            "all {n} streams reached the server: {}",
            upstream.requests()
        );
        HeldStreams {
            requests,
            _turn: turn,
        }
    }

    /// Lets every stream finish; each must answer 200.
    async fn release(self, upstream: &FakeUpstream) {
        // Each stream's handler waits for a notification it may not have started waiting for.
        let released = support::eventually(Duration::from_secs(10), || {
            upstream.sse_next.notify_waiters();
            self.requests.iter().all(|r| r.is_finished())
        })
        .await;
        assert!(released, "every held stream finished once released");
        for status in self.requests {
            assert_eq!(status.await.unwrap(), 200);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_allowed_means_the_rest_queue() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&h2c_upstream_config(&upstream, "max_connections: 1, max_idle: 1")).await;
    let statuses = burst(&sidecar, upstream.addr, "/sleep/200", 400).await;
    assert_eq!(statuses.len(), 400);
    assert_eq!(
        upstream.accepted(),
        1,
        "StrictMaxConcurrentStreams: one connection"
    );
    assert_eq!(upstream.requests(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_follows_a_server_that_allows_fewer_streams() {
    let upstream = FakeUpstream::start_h2(None, 10).await;
    let sidecar = Sidecar::start(&h2c_upstream_config(&upstream, "max_connections: 64")).await;
    let held = HeldStreams::open(&sidecar, &upstream, 100).await;
    println!(
        "100 concurrent streams, server limit 10 streams: {} connections",
        upstream.accepted()
    );
    assert_eq!(upstream.accepted(), 10, "ten connections of ten streams each");
    held.release(&upstream).await;
}

#[tokio::test]
async fn an_h2_tls_upstream_carries_sequential_requests_on_one_connection_and_closes_when_idle() {
    let ca = TestCa::new();
    let dir = TempDir::new();
    let ca_file = ca.write_pem(&dir);
    let upstream = FakeUpstream::start_h2(Some(ca.server(&["upstream.test"], false, &[b"h2"])), 100).await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: h2tls\n    url: https://upstream.test:{port}\n    aliases: [upstream.test:80]\n    \
         addresses: [{addr}]\n    tls: {{ ca_file: {ca} }}\n    pool: {{ idle_timeout: 300ms }}\n",
        port = upstream.addr.port(),
        addr = upstream.addr,
        ca = ca_file.display()
    ))
    .await;
    let mut client = RawClient::connect(sidecar.addr).await;
    for _ in 0..5 {
        let resp = client.get("http://upstream.test/bytes/100000").await;
        assert_eq!(resp.status, 200);
        assert_eq!(resp.body.len(), 100_000);
    }
    assert_eq!(upstream.accepted(), 1);
    assert!(
        support::eventually(Duration::from_secs(3), || upstream.open() == 0).await,
        "idle HTTP/2 connection kept past idle_timeout"
    );
}

#[tokio::test]
async fn streamed_h2_responses_reach_the_client_event_by_event() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&h2c_upstream_config(&upstream, "")).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = upstream.addr;
    client
        .send_raw(format!("GET http://{host}/sse/3 HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    let (status, _) = client.read_head().await;
    assert_eq!(status, 200);
    for i in 0..3 {
        let chunk = tokio::time::timeout(Duration::from_secs(5), client.read_chunk())
            .await
            .expect("event held back")
            .unwrap();
        assert_eq!(String::from_utf8(chunk).unwrap(), format!("data: event {i}\n\n"));
        upstream.sse_next.notify_one();
    }
}

/// Starts `n` requests on their own downstream connections; returns their join handles.
fn spawn_requests(
    sidecar: std::net::SocketAddr,
    upstream: std::net::SocketAddr,
    raw: impl Fn(usize) -> String,
    n: usize,
) -> Vec<tokio::task::JoinHandle<support::RawResponse>> {
    (0..n)
        .map(|i| {
            let request = raw(i).replace("UPSTREAM", &upstream.to_string());
            tokio::spawn(async move {
                let mut client = RawClient::connect(sidecar).await;
                client.send_raw(request.as_bytes()).await;
                client.read_response(false).await.expect("a response")
            })
        })
        .collect()
}

fn get(path: &str) -> impl Fn(usize) -> String + '_ {
    move |_| format!("GET http://UPSTREAM{path} HTTP/1.1\r\nHost: UPSTREAM\r\n\r\n")
}

/// Pool gauges and runtime tasks: (upstream connections in every state, pending requests,
/// `runtime_tasks`). In-process, `runtime_tasks` counts this test's runtime, the test's own
/// tasks and the fake upstream's included, so it is compared to a baseline taken at rest.
fn pool_and_tasks(m: &prometheus_parse::Scrape) -> (f64, f64, f64) {
    (
        support::value(m, "egress_upstream_connections", &[]),
        support::value(m, "egress_pool_pending_requests", &[]),
        support::value(m, "egress_runtime_tasks", &[]),
    )
}

/// Waits (up to 5 s) until no upstream connection is open or request pending and the runtime
/// is back to `baseline_tasks`; returns what it last saw.
async fn settle_to(sidecar: &Sidecar, baseline_tasks: f64) -> (f64, f64, f64) {
    let settled = (0.0, 0.0, baseline_tasks);
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(5), |m| {
        pool_and_tasks(m) == settled
    })
    .await;
    pool_and_tasks(&m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goaway_under_load_loses_no_request() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&h2c_upstream_config(&upstream, "idle_timeout: 300ms")).await;
    let (_, _, baseline_tasks) = pool_and_tasks(&support::scrape(sidecar.admin).await);
    let first = spawn_requests(sidecar.addr, upstream.addr, get("/sleep/400"), 150);
    assert!(support::eventually(Duration::from_secs(5), || upstream.requests() >= 50).await);
    upstream.counters.goaway.notify_waiters();
    let second = spawn_requests(sidecar.addr, upstream.addr, get("/sleep/100"), 150);
    for task in first.into_iter().chain(second) {
        let resp = task.await.unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    assert!(
        upstream.accepted() >= 3,
        "requests after GOAWAY went to new connections"
    );
    assert!(
        support::eventually(Duration::from_secs(5), || upstream.open() == 0).await,
        "connections left open after the load ({} open)",
        upstream.open()
    );
    assert_eq!(
        settle_to(&sidecar, baseline_tasks).await,
        (0.0, 0.0, baseline_tasks),
        "(upstream connections, pending requests, runtime tasks) after GOAWAY"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_dies_mid_stream_costs_only_requests_that_cannot_be_replayed() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&h2c_upstream_config(&upstream, "idle_timeout: 300ms")).await;
    let (_, _, baseline_tasks) = pool_and_tasks(&support::scrape(sidecar.admin).await);
    let gets = spawn_requests(sidecar.addr, upstream.addr, get("/sleep/600"), 40);
    let posts = spawn_requests(
        sidecar.addr,
        upstream.addr,
        |_| {
            "POST http://UPSTREAM/sleep/600 HTTP/1.1\r\nHost: UPSTREAM\r\nContent-Length: 4\r\n\r\ndata"
                .into()
        },
        10,
    );
    assert!(support::eventually(Duration::from_secs(5), || upstream.requests() >= 50).await);
    upstream.counters.kill.notify_waiters();
    for task in gets {
        let resp = task.await.unwrap();
        assert_eq!(resp.status, 200, "a GET was lost: {}", resp.text());
    }
    for task in posts {
        let resp = task.await.unwrap();
        assert_eq!(resp.status, 502, "{}", resp.text());
        assert_eq!(resp.header("x-egress-error"), Some("upstream_reset"));
        assert!(resp.text().contains("upstream h2"), "{}", resp.text());
    }
    assert!(
        support::eventually(Duration::from_secs(5), || upstream.open() == 0).await,
        "connections left open ({} open)",
        upstream.open()
    );
    assert_eq!(
        settle_to(&sidecar, baseline_tasks).await,
        (0.0, 0.0, baseline_tasks),
        "(upstream connections, pending requests, runtime tasks) after the upstream died"
    );
}

// === a server that lowers its stream limit mid-run ===

/// Relays one h2c connection at a time to `server`; on `lower`, injects a SETTINGS frame with
/// `MAX_CONCURRENT_STREAMS = 10` into the first connection's server-to-client bytes (at a frame
/// boundary) and swallows the client's ACK of it, which the real server never asked for.
struct LoweringRelay {
    addr: std::net::SocketAddr,
    lower: std::sync::Arc<tokio::sync::Notify>,
    /// The client acknowledged the injected SETTINGS (and so applied it).
    acked: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl LoweringRelay {
    async fn start(server: std::net::SocketAddr) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let lower = std::sync::Arc::new(tokio::sync::Notify::new());
        let lower_first = lower.clone();
        let acked = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let acked_first = acked.clone();
        tokio::spawn(async move {
            let mut first = true;
            while let Ok((client, _)) = listener.accept().await {
                let upstream = tokio::net::TcpStream::connect(server).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut ur, mut uw) = upstream.into_split();
                let injecting = std::mem::take(&mut first);
                let swallow_ack = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                let (swallow, lower) = (swallow_ack.clone(), lower_first.clone());
                let acked = acked_first.clone();
                tokio::spawn(async move {
                    // Server to client, frame by frame, with the injection.
                    let mut injected = !injecting;
                    loop {
                        let frame = tokio::select! {
                            frame = support::read_h2_frame(&mut ur) => frame,
                            _ = lower.notified(), if !injected => {
                                injected = true;
                                swallow.store(true, std::sync::atomic::Ordering::SeqCst);
                                let settings = [0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 10];
                                if cw.write_all(&settings).await.is_err() { return; }
                                continue;
                            }
                        };
                        let Some(frame) = frame else { return };
                        if cw.write_all(&frame).await.is_err() {
                            return;
                        }
                    }
                });
                tokio::spawn(async move {
                    // Client to server: the preface, then frames minus our SETTINGS' ACK.
                    let mut preface = [0u8; 24];
                    if cr.read_exact(&mut preface).await.is_err() || uw.write_all(&preface).await.is_err() {
                        return;
                    }
                    while let Some(frame) = support::read_h2_frame(&mut cr).await {
                        let is_settings_ack = frame[3] == 4 && frame[4] & 1 == 1;
                        if is_settings_ack && swallow_ack.swap(false, std::sync::atomic::Ordering::SeqCst) {
                            acked.store(true, std::sync::atomic::Ordering::SeqCst);
                            continue;
                        }
                        if uw.write_all(&frame).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });

        LoweringRelay { addr, lower, acked }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_follows_a_server_that_lowers_its_limit_mid_run() {
    let server = FakeUpstream::start_h2(None, 100).await;
    let relay = LoweringRelay::start(server.addr).await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: h2\n    url: http://h2.test\n    addresses: [{}]\n    protocol: http2\n    \
         pool: {{ pending_timeout: 30s }}\n",
        relay.addr
    ))
    .await;
    let burst_via = |n: usize| {
        let addr = sidecar.addr;
        (0..n)
            .map(move |_| {
                tokio::spawn(async move {
                    let resp = RawClient::connect(addr)
                        .await
                        .get("http://h2.test/sleep/800")
                        .await;
                    assert_eq!(resp.status, 200, "{}", resp.text());
                })
            })
            .collect::<Vec<_>>()
    };
    let _turn = BURSTS.lock().await;
    // 50 concurrent requests fit the first connection's 100 streams.
    for task in burst_via(50) {
        task.await.unwrap();
    }
    assert_eq!(server.accepted(), 1);
    // The server now allows 10 streams on that connection: the next 50 need a second one.
    relay.lower.notify_one();
    // Wait until the sidecar has acknowledged the injected SETTINGS: its HTTP/2 client has
    // applied the new limit (the pool reads it at the connection's next request).
    let acked = support::eventually(Duration::from_secs(5), || {
        relay.acked.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;
    assert!(
        acked,
        "the sidecar acknowledged the lowered SETTINGS_MAX_CONCURRENT_STREAMS"
    );
    assert_eq!(server.open(), 1, "the first connection survived the new SETTINGS");
    let started = std::time::Instant::now();
    for task in burst_via(50) {
        task.await.unwrap();
    }
    println!("phase 2 took {:?}", started.elapsed());
    println!(
        "after the server lowered its limit to 10: {} connections",
        server.accepted()
    );
    assert_eq!(
        server.accepted(),
        2,
        "the pool kept filling a connection past its new limit"
    );
}

#[tokio::test]
async fn max_lifetime_retires_an_h2_connection_gracefully() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&h2c_upstream_config(
        &upstream,
        "max_lifetime: 400ms, idle_timeout: 30s",
    ))
    .await;
    let url = format!("http://{}/sleep/600", upstream.addr);
    // A stream still running when the lifetime passes finishes on the old connection...
    let addr = sidecar.addr;
    let long = {
        let url = url.clone();
        tokio::spawn(async move { RawClient::connect(addr).await.get(&url).await })
    };
    assert!(support::eventually(Duration::from_secs(3), || upstream.requests() == 1).await);
    // The scenario: max_lifetime (400 ms from the dial, which came before that request)
    // passes while the stream runs. Not synchronisation: the clock has to move.
    tokio::time::sleep(Duration::from_millis(450)).await;
    // ...while new requests go to a new connection.
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{}/", upstream.addr))
        .await;
    assert_eq!(resp.status, 200);
    assert_eq!(long.await.unwrap().status, 200);
    assert_eq!(upstream.accepted(), 2);
    assert!(
        support::eventually(Duration::from_secs(3), || upstream.open() == 1).await,
        "the retired connection stayed open after its last stream"
    );
}

#[tokio::test]
async fn max_requests_per_connection_retires_h2_connections_too() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&h2c_upstream_config(&upstream, "max_requests_per_connection: 3")).await;
    let url = format!("http://{}/", upstream.addr);
    let mut client = RawClient::connect(sidecar.addr).await;
    for i in 0..9 {
        assert_eq!(client.get(&url).await.status, 200, "request {i}");
    }
    assert_eq!(upstream.requests(), 9);
    assert_eq!(upstream.accepted(), 3, "9 streams, 3 per connection");
    // Each connection closes when its third stream ends, not when it idles out.
    assert!(
        support::eventually(Duration::from_secs(3), || upstream.open() == 0).await,
        "{} connections left open after their last stream",
        upstream.open()
    );
    let m = support::scrape(sidecar.admin).await;
    let closed = support::value(
        &m,
        "egress_upstream_connections_closed_total",
        &[("upstream", "h2"), ("reason", "max_requests")],
    );
    assert_eq!(closed, 3.0);
}
