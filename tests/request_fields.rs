//! A request's fields as an HTTP/1.1 upstream gets them. A plain head (its first field `Host`,
//! none that a step of the request path reads) goes up as it came, names in the client's case
//! and spacing kept, behind the upstream's `Host` (`wire::lines`); a head with a hop-by-hop
//! field or a credential, or going to an upstream with header rules, goes through the map,
//! which strips and rewrites as before. A raw origin records each head exactly. To an h2c
//! upstream the same lines are encoded with their names lowercased.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use support::{FakeUpstream, Sidecar};

/// An origin that answers every request `ok` and sends each request head (its blank line
/// left out) to the returned receiver.
async fn recording_origin() -> (SocketAddr, mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        let mut chunk = [0u8; 4096];
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end + 2]).into_owned();
                    buf.drain(..end + 4);
                    let _ = tx.send(head);
                    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                    if stream.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// A sidecar with one route listener to `origin`; `extra`: more keys of that upstream.
async fn route_to(origin: SocketAddr, extra: &str) -> Sidecar {
    Sidecar::start_with_route(|port| {
        format!(
            "upstreams:\n  - name: origin\n    url: http://{origin}\n    listen: 127.0.0.1:{port}\n{extra}"
        )
    })
    .await
}

/// Sends each head on one keep-alive connection and reads its `ok`.
async fn send_heads(to: SocketAddr, heads: &[&str]) {
    let mut client = TcpStream::connect(to).await.unwrap();
    for head in heads {
        client.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        while !got.ends_with(b"\r\n\r\nok") {
            let mut chunk = [0u8; 1024];
            let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut chunk))
                .await
                .unwrap_or_else(|_| panic!("the sidecar answers; so far {:?}", String::from_utf8_lossy(&got)))
                .unwrap();
            assert!(
                n > 0,
                "the sidecar closed after {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&chunk[..n]);
        }
        assert!(
            got.starts_with(b"HTTP/1.1 200 OK\r\n"),
            "{}",
            String::from_utf8_lossy(&got)
        );
    }
}

async fn next_head(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the origin got a request")
        .expect("the origin runs")
}

#[tokio::test]
async fn a_plain_head_goes_up_as_it_came_behind_the_upstreams_host() {
    let (origin, mut heads) = recording_origin().await;
    let sidecar = route_to(origin, "").await;
    let plain = "GET /a?b=1 HTTP/1.1\r\nHost: app.local\r\nUser-Agent: Raw/1\r\nX-Mixed-Case:  A  b\r\n\
                 accept-encoding: gzip\r\nX-Egress: not ours\r\n\r\n";
    // Twice on one connection: the second head's lines are its own.
    let second = "GET /second HTTP/1.1\r\nhost: app.local\r\nACCEPT: */*\r\n\r\n";
    send_heads(sidecar.routes[0], &[plain, second]).await;
    assert_eq!(
        next_head(&mut heads).await,
        format!(
            "GET /a?b=1 HTTP/1.1\r\nhost: {origin}\r\nUser-Agent: Raw/1\r\nX-Mixed-Case:  A  b\r\n\
             accept-encoding: gzip\r\nX-Egress: not ours\r\n"
        )
    );
    assert_eq!(
        next_head(&mut heads).await,
        format!("GET /second HTTP/1.1\r\nhost: {origin}\r\nACCEPT: */*\r\n")
    );
    // A head of nothing but `Host`.
    send_heads(sidecar.routes[0], &["GET / HTTP/1.1\r\nHost: app.local\r\n\r\n"]).await;
    assert_eq!(
        next_head(&mut heads).await,
        format!("GET / HTTP/1.1\r\nhost: {origin}\r\n")
    );
    sidecar.stop().await;
}

#[tokio::test]
async fn fields_a_step_reads_send_the_head_through_the_map() {
    let (origin, mut heads) = recording_origin().await;
    let sidecar = route_to(origin, "").await;
    let heads_sent = [
        // Hop-by-hop fields, and one `Connection` names, are removed.
        "GET /hop HTTP/1.1\r\nHost: app.local\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n\
         User-Agent: Raw/1\r\n\r\n",
        // The sidecar's own fields are read and removed; a credential stays.
        "GET /own HTTP/1.1\r\nHost: app.local\r\nx-egress-retry: off\r\nAuthorization: Bearer t\r\n\r\n",
        // `Host` not first: it is replaced where it stands.
        "GET /late HTTP/1.1\r\nUser-Agent: Raw/1\r\nHost: app.local\r\n\r\n",
    ];
    send_heads(sidecar.routes[0], &heads_sent).await;
    assert_eq!(
        next_head(&mut heads).await,
        format!("GET /hop HTTP/1.1\r\nhost: {origin}\r\nuser-agent: Raw/1\r\n")
    );
    assert_eq!(
        next_head(&mut heads).await,
        format!("GET /own HTTP/1.1\r\nhost: {origin}\r\nauthorization: Bearer t\r\n")
    );
    assert_eq!(
        next_head(&mut heads).await,
        format!("GET /late HTTP/1.1\r\nuser-agent: Raw/1\r\nhost: {origin}\r\n")
    );
    sidecar.stop().await;
}

#[tokio::test]
async fn an_upstreams_header_rules_see_the_fields_of_a_plain_head() {
    let (origin, mut heads) = recording_origin().await;
    let rules = "    request_headers: { set: { X-Tenant: t-7, User-Agent: sidecar }, remove: [X-Drop] }\n";
    let sidecar = route_to(origin, rules).await;
    let plain = "GET /r HTTP/1.1\r\nHost: app.local\r\nUser-Agent: Raw/1\r\nX-Drop: 1\r\nAccept: */*\r\n\r\n";
    send_heads(sidecar.routes[0], &[plain]).await;
    let head = next_head(&mut heads).await;
    assert!(
        head.starts_with(&format!("GET /r HTTP/1.1\r\nhost: {origin}\r\n")),
        "{head}"
    );
    let mut fields: Vec<&str> = head.lines().skip(2).collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        ["accept: */*", "user-agent: sidecar", "x-tenant: t-7"],
        "{head}"
    );
    sidecar.stop().await;
}

#[tokio::test]
async fn an_upstream_that_takes_no_trace_context_gets_no_baggage_from_a_plain_head() {
    let (origin, mut heads) = recording_origin().await;
    let sidecar = route_to(origin, "    tracing: { propagate: false }\n").await;
    let head = "GET /b HTTP/1.1\r\nHost: app.local\r\nBaggage: user=alice\r\nUser-Agent: Raw/1\r\n\r\n";
    send_heads(sidecar.routes[0], &[head]).await;
    assert_eq!(
        next_head(&mut heads).await,
        format!("GET /b HTTP/1.1\r\nhost: {origin}\r\nuser-agent: Raw/1\r\n")
    );
    sidecar.stop().await;
}

#[tokio::test]
async fn through_the_forward_proxy_an_absolute_target_keeps_its_lines_and_a_relative_one_is_routed_by_host() {
    let (origin, mut heads) = recording_origin().await;
    // Configured, so that a relative target naming it in `Host` is served.
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: origin\n    url: http://{origin}\n"
    ))
    .await;
    // Its `Host` names another authority: the upstream's goes up.
    let absolute =
        format!("GET http://{origin}/abs HTTP/1.1\r\nHost: other.example\r\nUser-Agent: Raw/1\r\n\r\n");
    let relative = format!("GET /rel HTTP/1.1\r\nHost: {origin}\r\nUser-Agent: Raw/1\r\n\r\n");
    send_heads(sidecar.addr, &[&absolute, &relative]).await;
    assert_eq!(
        next_head(&mut heads).await,
        format!("GET /abs HTTP/1.1\r\nhost: {origin}\r\nUser-Agent: Raw/1\r\n")
    );
    assert_eq!(
        next_head(&mut heads).await,
        format!("GET /rel HTTP/1.1\r\nhost: {origin}\r\nuser-agent: Raw/1\r\n")
    );
    sidecar.stop().await;
}

#[tokio::test]
async fn to_an_h2c_upstream_a_plain_heads_fields_go_up_lowercased() {
    // hyper's HTTP/2 server refuses a request with an uppercase field name (RFC 9113 §8.2.1).
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = route_to(upstream.addr, "    protocol: http2\n").await;
    let long = format!("X-{}", "Long".repeat(20));
    let plain = format!(
        "GET /h2?q=1 HTTP/1.1\r\nHost: app.local\r\nUser-Agent:  Raw/1 \r\n{long}: v\r\nACCEPT: */*\r\n\r\n"
    );
    let second = "GET /again HTTP/1.1\r\nHost: app.local\r\nX-Mixed-Case: 2\r\n\r\n";
    send_heads(sidecar.routes[0], &[&plain, second]).await;
    let seen = upstream.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].uri, format!("http://{}/h2?q=1", upstream.addr));
    let fields = |i: usize| -> Vec<(String, String)> {
        seen[i]
            .headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
            .collect()
    };
    let long = long.to_ascii_lowercase();
    let expected = [("user-agent", "Raw/1"), (long.as_str(), "v"), ("accept", "*/*")];
    assert_eq!(fields(0), expected.map(|(n, v)| (n.to_owned(), v.to_owned())));
    assert_eq!(seen[1].uri, format!("http://{}/again", upstream.addr));
    assert_eq!(fields(1), [("x-mixed-case".to_owned(), "2".to_owned())]);
    sidecar.stop().await;
}
