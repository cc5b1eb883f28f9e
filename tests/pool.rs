//! Pool behaviour over real sockets: the connection cap under concurrency, idle and lifetime
//! limits, the wait queue's 503s, and the stale-connection race.

mod support;

use std::time::Duration;

use support::{FakeUpstream, RawClient, Sidecar};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_share_eight_connections() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: capped\n    url: http://{}\n    pool: {{ max_connections: 8, max_idle: 8, pending_timeout: 30s }}\n",
        upstream.addr
    ))
    .await;
    let url = format!("http://{}/sleep/20", upstream.addr);
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let url = url.clone();
        let addr = sidecar.addr;
        tasks.push(tokio::spawn(async move {
            let mut client = RawClient::connect(addr).await;
            client.get(&url).await
        }));
    }
    for task in tasks {
        let resp = task.await.unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert_eq!(resp.text(), "ok");
    }
    println!(
        "upstream peak open connections: {}, accepted: {}",
        upstream.peak(),
        upstream.accepted()
    );
    assert!(upstream.peak() <= 8, "peak {}", upstream.peak());
    assert!(upstream.accepted() <= 8, "accepted {}", upstream.accepted());
    assert_eq!(upstream.requests(), 200);
    sidecar.stop().await;
}

fn one_upstream(upstream: &FakeUpstream, pool: &str) -> String {
    format!(
        "upstreams:\n  - name: up\n    url: http://{}\n    pool: {{ {pool} }}\n",
        upstream.addr
    )
}

#[tokio::test]
async fn idle_connections_close_after_idle_timeout() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(&upstream, "idle_timeout: 300ms")).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(
        client.get(&format!("http://{}/", upstream.addr)).await.status,
        200
    );
    assert_eq!(upstream.open(), 1);
    assert!(
        support::eventually(Duration::from_secs(3), || upstream.open() == 0).await,
        "pooled connection still open after idle_timeout"
    );
    // The next request dials a fresh connection.
    assert_eq!(
        client.get(&format!("http://{}/", upstream.addr)).await.status,
        200
    );
    assert_eq!(upstream.accepted(), 2);
}

#[tokio::test]
async fn max_requests_per_connection_retires_connections() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(&upstream, "max_requests_per_connection: 3")).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    for _ in 0..9 {
        assert_eq!(
            client.get(&format!("http://{}/", upstream.addr)).await.status,
            200
        );
    }
    assert_eq!(upstream.requests(), 9);
    assert_eq!(upstream.accepted(), 3);
}

#[tokio::test]
async fn max_lifetime_retires_connections_once_idle() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(&upstream, "max_lifetime: 300ms, idle_timeout: 30s")).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let url = format!("http://{}/", upstream.addr);
    assert_eq!(client.get(&url).await.status, 200);
    assert_eq!(client.get(&url).await.status, 200);
    assert_eq!(upstream.accepted(), 1, "young connection reused");
    assert!(
        support::eventually(Duration::from_secs(3), || upstream.open() == 0).await,
        "connection older than max_lifetime kept open"
    );
    assert_eq!(client.get(&url).await.status, 200);
    assert_eq!(upstream.accepted(), 2);
}

#[tokio::test]
async fn upstream_connection_close_is_honoured() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(&upstream, "max_connections: 1")).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    for _ in 0..3 {
        let resp = client.get(&format!("http://{}/close", upstream.addr)).await;
        assert_eq!(resp.status, 200);
        assert_eq!(
            resp.header("connection"),
            None,
            "hop-by-hop header passed through"
        );
    }
    assert_eq!(upstream.accepted(), 3);
}

#[tokio::test]
async fn keep_alive_timeout_hint_retires_connection_early() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(&upstream, "idle_timeout: 30s")).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let url = format!("http://{}/keepalive/1", upstream.addr);
    assert_eq!(client.get(&url).await.status, 200);
    assert_eq!(client.get(&url).await.status, 200);
    assert_eq!(upstream.accepted(), 1, "reused while well inside the hint");
    // `Keep-Alive: timeout=1` means the upstream may close at 1 s; we retire it before that.
    assert!(
        support::eventually(Duration::from_millis(990), || upstream.open() == 0).await,
        "connection kept past the upstream's keep-alive hint"
    );
}

#[tokio::test]
async fn pending_timeout_answers_503() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(
        &upstream,
        "max_connections: 1, pending_timeout: 200ms",
    ))
    .await;
    let slow = format!("http://{}/sleep/1500", upstream.addr);
    let addr = sidecar.addr;
    let first = tokio::spawn(async move { RawClient::connect(addr).await.get(&slow).await });
    assert!(support::eventually(Duration::from_secs(2), || upstream.requests() == 1).await);
    let mut client = RawClient::connect(sidecar.addr).await;
    let resp = client.get(&format!("http://{}/", upstream.addr)).await;
    assert_eq!(resp.status, 503);
    assert_eq!(resp.header("x-egress-error"), Some("pending_timeout"));
    assert!(resp.text().contains("upstream up"), "{}", resp.text());
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(
        upstream.requests(),
        1,
        "the timed-out request never reached the upstream"
    );
}

#[tokio::test]
async fn max_pending_answers_503_pool_overflow() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(
        &upstream,
        "max_connections: 1, max_pending: 1, pending_timeout: 10s",
    ))
    .await;
    let slow = format!("http://{}/sleep/800", upstream.addr);
    let addr = sidecar.addr;
    let url = slow.clone();
    let first = tokio::spawn(async move { RawClient::connect(addr).await.get(&url).await });
    assert!(support::eventually(Duration::from_secs(2), || upstream.requests() == 1).await);
    let url = slow.clone();
    let queued = tokio::spawn(async move { RawClient::connect(addr).await.get(&url).await });
    let admin = sidecar.admin;
    let waiting = support::eventually_async(Duration::from_secs(5), || async move {
        support::debug_pool(admin, "up").await["pending"] == 1
    })
    .await;
    assert!(waiting, "the second request waits in the queue");
    let resp = RawClient::connect(sidecar.addr).await.get(&slow).await;
    assert_eq!(resp.status, 503);
    assert_eq!(resp.header("x-egress-error"), Some("pool_overflow"));
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(queued.await.unwrap().status, 200);
    assert_eq!(upstream.accepted(), 1);
    assert_eq!(upstream.requests(), 2);
}

#[tokio::test]
async fn response_header_timeout_answers_504() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: up\n    url: http://{}\n    response_header_timeout: 200ms\n",
        upstream.addr
    ))
    .await;
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{}/sleep/3000", upstream.addr))
        .await;
    assert_eq!(resp.status, 504);
    assert_eq!(resp.header("x-egress-error"), Some("response_timeout"));
    // The connection that timed out is not reused.
    assert!(support::eventually(Duration::from_secs(5), || upstream.open() == 0).await);
}

#[tokio::test]
async fn refused_connections_answer_502_connect_failed() {
    let refusing = support::RefusingPort::new();
    let closed = refusing.addr;
    let sidecar = Sidecar::start("").await;
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{closed}/"))
        .await;
    assert_eq!(resp.status, 502);
    assert_eq!(resp.header("x-egress-error"), Some("connect_failed"));
    assert!(resp.text().contains(&closed.to_string()), "{}", resp.text());
}

// === the stale-connection race ===

/// A raw upstream that answers the first request on each connection and, on a connection's
/// second request, reads it fully and closes without answering: the race of an upstream
/// closing an idle keep-alive connection just as it is reused, made deterministic.
struct StaleUpstream {
    addr: std::net::SocketAddr,
    /// (connection number, method) of every request read.
    log: std::sync::Arc<std::sync::Mutex<Vec<(usize, String)>>>,
}

impl StaleUpstream {
    async fn start() -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log2 = log.clone();
        tokio::spawn(async move {
            for conn_no in 1.. {
                let (mut stream, _) = listener.accept().await.unwrap();
                let log = log2.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    for nth in 0..2 {
                        let Some(method) = read_request(&mut stream, &mut buf).await else {
                            return;
                        };
                        log.lock().unwrap().push((conn_no, method));
                        if nth == 0 {
                            stream
                                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                                .await
                                .unwrap();
                        }
                    }
                    // Dropped without answering the second request.
                });
            }
        });

        async fn read_request(stream: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
            loop {
                if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..end]).to_string();
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0);
                    while buf.len() < end + 4 + len {
                        let mut tmp = [0u8; 4096];
                        let n = stream.read(&mut tmp).await.ok()?;
                        if n == 0 {
                            return None;
                        }
                        buf.extend_from_slice(&tmp[..n]);
                    }
                    buf.drain(..end + 4 + len);
                    return head.split(' ').next().map(str::to_owned);
                }
                let mut tmp = [0u8; 4096];
                let n = stream.read(&mut tmp).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&tmp[..n]);
            }
        }
        StaleUpstream { addr, log }
    }

    fn methods(&self, method: &str) -> Vec<usize> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, m)| m == method)
            .map(|(c, _)| *c)
            .collect()
    }
}

#[tokio::test]
async fn stale_connection_race_retries_get_but_not_post() {
    let upstream = StaleUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: stale\n    url: http://{}\n    pool: {{ max_connections: 4 }}\n",
        upstream.addr
    ))
    .await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let url = format!("http://{}/", upstream.addr);
    let host = upstream.addr;

    // GET on a fresh connection, then a GET that meets the closing connection: retried.
    assert_eq!(client.get(&url).await.status, 200);
    let resp = client.get(&url).await;
    assert_eq!(
        resp.status,
        200,
        "GET lost to a stale connection: {}",
        resp.text()
    );
    assert_eq!(
        upstream.methods("GET"),
        vec![1, 1, 2],
        "retried once, on another connection"
    );

    // Connection 2 is now idle and will close on its next request. A POST is not retried.
    client
        .send_raw(format!("POST {url} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 4\r\n\r\ndata").as_bytes())
        .await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("upstream_reset"));
    assert_eq!(upstream.methods("POST"), vec![2], "POST sent exactly once");

    // With an Idempotency-Key a POST is retried.
    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(client.get(&url).await.status, 200); // fresh connection 3, now idle
    client
        .send_raw(
            format!(
                "POST {url} HTTP/1.1\r\nHost: {host}\r\nIdempotency-Key: k1\r\nContent-Length: 0\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(upstream.methods("POST"), vec![2, 3, 4]);

    // /metrics agrees: two requests retried, one 502, four 200s, four connections.
    let m = support::scrape(sidecar.admin).await;
    let stale = [("upstream", "stale")];
    assert_eq!(support::value(&m, "egress_upstream_retries_total", &stale), 2.0);
    assert_eq!(
        support::value(
            &m,
            "egress_upstream_requests_total",
            &[("upstream", "stale"), ("code", "200")]
        ),
        4.0
    );
    assert_eq!(
        support::value(
            &m,
            "egress_upstream_requests_total",
            &[("upstream", "stale"), ("code", "502")]
        ),
        1.0
    );
    assert_eq!(
        support::value(&m, "egress_upstream_connections_opened_total", &stale),
        4.0
    );
}

/// An upstream that closes every keep-alive connection 100 ms after answering; counts the
/// POSTs it answered and the connections it closed.
async fn short_keepalive_upstream() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let posts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let closes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (posts2, closes2) = (posts.clone(), closes.clone());
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            let posts = posts2.clone();
            let closes = closes2.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let mut tmp = [0u8; 4096];
                    let wait = if buf.is_empty() {
                        Duration::from_millis(100)
                    } else {
                        Duration::from_secs(5)
                    };
                    let n = match tokio::time::timeout(wait, stream.read(&mut tmp)).await {
                        Ok(Ok(n)) if n > 0 => n,
                        _ => {
                            // Idle too long: close, and count it once the FIN is sent.
                            drop(stream);
                            closes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            return;
                        }
                    };
                    buf.extend_from_slice(&tmp[..n]);
                    if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        if buf.starts_with(b"POST") {
                            posts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        buf.drain(..end + 4);
                        stream
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                            .await
                            .unwrap();
                    }
                }
            });
        }
    });
    (addr, posts, closes)
}

#[tokio::test]
async fn a_closed_idle_connection_is_never_handed_out() {
    let (addr, posts, closes) = short_keepalive_upstream().await;
    let sidecar = Sidecar::start(&format!("upstreams:\n  - name: short\n    url: http://{addr}\n")).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    for i in 0..3 {
        client
            .send_raw(
                format!("POST http://{addr}/ HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n")
                    .as_bytes(),
            )
            .await;
        let resp = client.read_response(false).await.unwrap();
        // A POST is never retried, so a 200 here means the pool did not hand out the
        // connection the upstream had closed meanwhile.
        assert_eq!(resp.status, 200, "{}", resp.text());
        // The upstream closes the idle pooled connection before the next request.
        let closed = support::eventually(Duration::from_secs(5), || {
            closes.load(std::sync::atomic::Ordering::SeqCst) == i + 1
        })
        .await;
        assert!(closed, "the upstream closed connection {}", i + 1);
    }
    assert_eq!(posts.load(std::sync::atomic::Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_dial_that_hangs_answers_504_connect_timeout() {
    let blackhole = support::Blackhole::start().await;
    let addr = blackhole.addr;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: blackhole\n    url: http://{addr}\n    connect_timeout: 300ms\n"
    ))
    .await;
    let started = std::time::Instant::now();
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{addr}/"))
        .await;
    assert_eq!(resp.status, 504, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("connect_timeout"));
    assert!(resp.text().contains("connect_timeout (300ms)"), "{}", resp.text());
    assert!(started.elapsed() < Duration::from_secs(3));
    drop(blackhole);
}

#[tokio::test]
async fn an_upstream_closing_an_idle_connection_frees_its_place_at_once() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(&upstream, "max_connections: 2, idle_timeout: 60s")).await;
    let mut a = RawClient::connect(sidecar.addr).await;
    let mut b = RawClient::connect(sidecar.addr).await;
    let url = format!("http://{}/sleep/100", upstream.addr);
    let (ra, rb) = tokio::join!(a.get(&url), b.get(&url));
    assert_eq!((ra.status, rb.status), (200, 200));
    let idle = |m: &prometheus_parse::Scrape| {
        support::value(
            m,
            "egress_upstream_connections",
            &[("upstream", "up"), ("state", "idle")],
        )
    };
    assert_eq!(idle(&support::scrape(sidecar.admin).await), 2.0);

    // The upstream drops both idle connections; no request comes to notice it, yet the pool
    // closes them within moments (not at idle_timeout) and counts why.
    upstream.counters.kill.notify_waiters();
    let reason = [("upstream", "up"), ("reason", "upstream_close")];
    let upstream_closes =
        |m: &prometheus_parse::Scrape| support::value(m, "egress_upstream_connections_closed_total", &reason);
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(1), |m| {
        idle(m) == 0.0 && upstream_closes(m) == 2.0
    })
    .await;
    assert!(
        idle(&m) == 0.0 && upstream_closes(&m) == 2.0,
        "idle connections the upstream closed are still pooled"
    );
    let pool = support::debug_pool(sidecar.admin, "up").await;
    assert_eq!(pool["open"], 0, "{pool}");
    // And the next request dials afresh without an error.
    assert_eq!(a.get(&format!("http://{}/", upstream.addr)).await.status, 200);
    assert_eq!(upstream.accepted(), 3);
}

/// hyper's server answers a handler that ignored the request body, then closes the connection
/// unless the body's rest is already in its buffer. A body that came with its head goes up in
/// the head's write, so such an upstream keeps its connection for every POST (with the body
/// written after the head, 8 to 27 of the 500 closed it, in six runs of six).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_came_with_its_head_goes_up_with_it() {
    const POSTS: usize = 500;
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(&upstream, "max_connections: 1")).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    for _ in 0..POSTS {
        client
            .send_raw(
                format!(
                    "POST http://{}/ HTTP/1.1\r\nHost: {}\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\n\r\n{body}",
                    upstream.addr,
                    upstream.addr,
                    body.len()
                )
                .as_bytes(),
            )
            .await;
        let resp = client.read_response(false).await.unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    assert_eq!(upstream.requests(), POSTS);
    assert_eq!(
        upstream.accepted(),
        1,
        "the upstream closed a connection after a POST"
    );
    sidecar.stop().await;
}

/// A client that leaves as soon as it has read a whole answer leaves its upstream connection
/// pooled: the sidecar has read the answer's end before writing the last bytes the client
/// reads (a body framed by length, one of many frames, and a chunked one alike). With one
/// connection allowed, a connection closed instead of pooled shows as another dial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_right_after_its_answer_leaves_the_connection_pooled() {
    const ROUNDS: usize = 20;
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_upstream(&upstream, "max_connections: 1")).await;
    let paths = ["/", "/bytes/100000", "/sse/1"];
    for path in paths {
        for _ in 0..ROUNDS {
            let mut client = RawClient::connect(sidecar.addr).await;
            let resp = client.get(&format!("http://{}{path}", upstream.addr)).await;
            assert_eq!(resp.status, 200, "{path}: {}", resp.text());
            assert!(!resp.body.is_empty(), "{path}");
        }
    }
    assert_eq!(upstream.requests(), ROUNDS * paths.len());
    assert_eq!(
        upstream.accepted(),
        1,
        "a connection was closed instead of pooled"
    );
    sidecar.stop().await;
}
