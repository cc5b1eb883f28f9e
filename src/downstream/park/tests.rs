//! The parking lot's tests: parked connections and parked tunnels, through real sockets.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::downstream::testing::eventually;

/// A plain upstream answering every request with `ok` (no keep-alive limit).
async fn upstream() -> std::net::SocketAddr {
    crate::downstream::testing::ok_upstream().await.0
}

async fn get(client: &mut tokio::net::TcpStream, upstream: std::net::SocketAddr) -> String {
    let req = format!("GET http://{upstream}/ HTTP/1.1\r\nhost: {upstream}\r\n\r\n");
    client.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 1024];
    let mut got = String::new();
    while !got.ends_with("ok") {
        let n = client.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed after {got:?}");
        got.push_str(std::str::from_utf8(&buf[..n]).unwrap());
    }
    got
}

/// A parked connection costs its slot in the lot's buffer (its sequence number and this
/// record; the buffer doubles as it grows) and a deadline entry: keep them from creeping up
/// unnoticed. 120 bytes until issue 25 (a 64-bit deadline, the requests and leak flag in one
/// word, the gauge kept by the lot, an IPv4 peer in 8 bytes).
#[test]
fn a_parked_connection_record_stays_small() {
    let size = std::mem::size_of::<super::Parked>();
    assert!(size <= 80, "a parked connection grew to {size} bytes");
    let slot = std::mem::size_of::<(u64, Option<super::Parked>)>();
    assert!(slot <= 88, "a parked connection's slot grew to {slot} bytes");
    let deadline = std::mem::size_of::<(super::Deadline, u64)>();
    assert!(deadline <= 16, "a deadline entry grew to {deadline} bytes");
}

/// A parked tunnel costs its slot and a deadline entry, where its task took about 1.8 KB
/// with the two sockets' runtime registrations.
#[test]
fn a_parked_tunnel_record_stays_small() {
    let size = std::mem::size_of::<super::ParkedTunnel>();
    println!("a parked tunnel's record: {size} B");
    assert!(size <= 104, "a parked tunnel grew to {size} bytes");
    let slot = std::mem::size_of::<(u64, Option<super::ParkedTunnel>)>();
    assert!(slot <= 112, "a parked tunnel's slot grew to {slot} bytes");
}

#[test]
fn a_packed_peer_gives_back_the_address_it_took() {
    use super::PackedSource;
    use crate::clients::Source;
    for addr in ["127.0.0.1:40000", "[::1]:40001", "[fe80::1%2]:40002"] {
        let addr: std::net::SocketAddr = addr.parse().unwrap();
        let back = Source::from(PackedSource::from(Source::Tcp(addr)));
        assert!(matches!(back, Source::Tcp(a) if a == addr), "{addr}: {back:?}");
    }
}

#[test]
fn a_tally_keeps_requests_and_the_leak_flag_apart() {
    for (requests, leaky) in [(0, false), (0, true), (7, true), ((1 << 31) - 1, false)] {
        let tally = super::Tally::new(requests, leaky);
        assert_eq!((tally.requests(), tally.leaky()), (requests, leaky));
    }
    let saturated = super::Tally::new(u64::MAX, false);
    assert_eq!((saturated.requests(), saturated.leaky()), ((1 << 31) - 1, false));
}

#[tokio::test]
async fn an_idle_connection_is_parked_and_woken_by_its_next_request() {
    let up = upstream().await;
    let (sidecar, ctx) =
        crate::downstream::testing::serve_for_test("downstream: { idle_timeout: 30s }\n").await;
    let mut client = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    assert!(get(&mut client, up).await.starts_with("HTTP/1.1 200"));
    assert!(
        eventually(|| ctx.parking.len() == 1).await,
        "idle past PARK_AFTER, the connection leaves its task"
    );
    for _ in 0..3 {
        assert!(get(&mut client, up).await.starts_with("HTTP/1.1 200"));
        assert!(eventually(|| ctx.parking.len() == 1).await, "parked again");
    }
    assert_eq!(ctx.parking.resumed(), 3);
    assert_eq!(ctx.open_connections(), 1);

    // The client leaves while parked: the connection is closed and every count returns.
    drop(client);
    assert!(eventually(|| ctx.parking.is_empty() && ctx.open_connections() == 0).await);
    // 16 permits, one held by the accept loop waiting for the next connection.
    assert_eq!(
        ctx.limit.available_permits(),
        15,
        "the max_connections permit is back"
    );
    let answered = ctx.metrics.render();
    assert!(
        answered.contains(&format!(
            "egress_upstream_requests_total{{upstream=\"{up}\",code=\"200\"}} 4"
        )),
        "four requests answered 200: {answered}"
    );
}

/// The sidecar and this test share the thread, so the thread's spare buffers are the ones
/// the exchanges used.
#[tokio::test]
async fn keep_alive_exchanges_reuse_the_threads_spare_buffers() {
    use crate::spare::{DOWNSTREAM, UPSTREAM};
    let up = upstream().await;
    let (sidecar, _ctx) =
        crate::downstream::testing::serve_for_test("downstream: { idle_timeout: 30s }\n").await;
    let mut client = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    for _ in 0..4 {
        assert!(get(&mut client, up).await.starts_with("HTTP/1.1 200"));
        assert!(
            eventually(|| DOWNSTREAM.kept() == 1 && UPSTREAM.kept() == 1).await,
            "one of each, taken and given back again: {} downstream, {} upstream",
            DOWNSTREAM.kept(),
            UPSTREAM.kept()
        );
    }
}

#[tokio::test]
async fn the_memory_budget_closes_the_longest_idle_first() {
    let up = upstream().await;
    let (sidecar, ctx) =
        crate::downstream::testing::serve_for_test("downstream: { idle_timeout: 30s }\n").await;
    let mut clients = Vec::new();
    for parked in 1..=3 {
        let mut client = tokio::net::TcpStream::connect(sidecar).await.unwrap();
        get(&mut client, up).await;
        assert!(eventually(|| ctx.parking.len() == parked).await);
        clients.push(client);
    }
    assert_eq!(ctx.parking.shed_longest_idle(2, &ctx), 2);
    let mut rest = Vec::new();
    for (i, client) in clients.iter_mut().enumerate() {
        let closed = tokio::time::timeout(Duration::from_millis(300), client.read_to_end(&mut rest)).await;
        assert_eq!(matches!(closed, Ok(Ok(0))), i < 2, "client {i}: {closed:?}");
    }
    assert_eq!(ctx.parking.len(), 1);
    assert!(eventually(|| ctx.open_connections() == 1).await);
    assert!(
        get(&mut clients[2], up).await.starts_with("HTTP/1.1 200"),
        "the newest still serves"
    );
}

#[tokio::test]
async fn a_client_closing_a_parked_connection_needs_no_task() {
    let up = upstream().await;
    let (sidecar, ctx) =
        crate::downstream::testing::serve_for_test("downstream: { idle_timeout: 30s }\n").await;
    let mut client = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    get(&mut client, up).await;
    assert!(eventually(|| ctx.parking.len() == 1).await);
    drop(client);
    assert!(eventually(|| ctx.open_connections() == 0).await);
    assert!(ctx.parking.is_empty());
    assert_eq!(
        ctx.parking.resumed(),
        0,
        "closed in the parking task, not in a new connection task"
    );
}

/// The idle timeout runs from the connection's last exchange, not from when its task got
/// round to parking it: on a busy runtime that can be late, and the leaky client's
/// connections then outlived `idle_timeout` by as much (issue 18).
#[tokio::test]
async fn a_connection_parked_late_still_closes_at_its_idle_timeout() {
    const IDLE: Duration = Duration::from_millis(2500);
    const BUSY: Duration = Duration::from_secs(2);
    let up = upstream().await;
    let (sidecar, ctx) =
        crate::downstream::testing::serve_for_test("downstream: { idle_timeout: 2500ms }\n").await;
    let mut client = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    get(&mut client, up).await;
    let answered = std::time::Instant::now();
    // This runtime's only thread is busy: the connection's task cannot park it until then.
    std::thread::sleep(BUSY);
    assert!(eventually(|| ctx.parking.len() == 1).await);
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest)).await;
    let idled = answered.elapsed();
    assert!(matches!(closed, Ok(Ok(0))), "closed by the sidecar: {closed:?}");
    // Closing at BUSY + IDLE would mean the deadline ran from the park: half of BUSY
    // either side tells the two apart on a loaded machine.
    assert!(
        idled < IDLE + BUSY / 2,
        "closed {idled:?} after the response; idle_timeout is {IDLE:?}"
    );
    assert!(
        idled >= IDLE,
        "closed {idled:?} after the response, before idle_timeout"
    );
}

#[tokio::test]
async fn a_parked_connection_closes_at_its_idle_timeout() {
    let up = upstream().await;
    let (sidecar, ctx) =
        crate::downstream::testing::serve_for_test("downstream: { idle_timeout: 400ms }\n").await;
    let mut client = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    get(&mut client, up).await;
    assert!(eventually(|| ctx.parking.len() == 1).await);
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(2), client.read_to_end(&mut rest)).await;
    assert!(matches!(closed, Ok(Ok(0))), "closed by the sidecar: {closed:?}");
    assert!(eventually(|| ctx.open_connections() == 0).await);
    assert_eq!(ctx.metrics.families().downstream_idle_closed.get(), 1);
    assert!(ctx.parking.is_empty());
}

// === tunnels ===

/// A forward-proxy listener whose CONNECTs may reach `target`, with `yaml` besides; and the
/// sender that starts draining it.
async fn serve_tunnels(
    target: std::net::SocketAddr,
    yaml: &str,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<super::Context>,
    tokio::sync::watch::Sender<bool>,
) {
    let yaml = format!("policy: {{ connect_ports: [{}] }}\n{yaml}", target.port());
    crate::downstream::testing::serve_with_drain(&yaml).await
}

/// A CONNECT through `sidecar` to `target`, answered: (client, the target's side).
async fn open_tunnel(
    sidecar: std::net::SocketAddr,
    target: &tokio::net::TcpListener,
) -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let to = target.local_addr().unwrap();
    let mut client = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    let connect = format!("CONNECT {to} HTTP/1.1\r\nHost: {to}\r\n\r\n");
    client.write_all(connect.as_bytes()).await.unwrap();
    let (server, _) = target.accept().await.unwrap();
    let established = b"HTTP/1.1 200 Connection Established\r\n\r\n";
    let mut head = vec![0u8; established.len()];
    client.read_exact(&mut head).await.unwrap();
    assert_eq!(head, established);
    (client, server)
}

/// Writes `bytes` on `from` and reads them whole on `to`.
async fn carries(from: &mut tokio::net::TcpStream, to: &mut tokio::net::TcpStream, bytes: &[u8]) {
    from.write_all(bytes).await.unwrap();
    let mut got = vec![0u8; bytes.len()];
    tokio::time::timeout(Duration::from_secs(5), to.read_exact(&mut got))
        .await
        .expect("the bytes arrive")
        .unwrap();
    assert_eq!(got, bytes);
}

/// Waits past PARK_AFTER for `n` parked tunnels.
async fn parked_tunnels(ctx: &super::Context, n: usize) -> bool {
    tokio::time::sleep(super::super::PARK_AFTER).await;
    eventually(|| ctx.parking.tunnels() == n).await
}

#[tokio::test]
async fn a_quiet_tunnel_is_parked_and_woken_from_either_side() {
    let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (sidecar, ctx, _drain) = serve_tunnels(
        target.local_addr().unwrap(),
        "downstream: { idle_timeout: 30s }\n",
    )
    .await;
    let (mut client, mut server) = open_tunnel(sidecar, &target).await;
    let families = ctx.metrics.families();
    carries(&mut client, &mut server, b"hello").await;
    assert!(parked_tunnels(&ctx, 1).await, "quiet past PARK_AFTER: parked");
    assert_eq!(families.tunnel_counts("connect"), (1, 1), "still counted open");
    assert_eq!(
        ctx.parking.len(),
        0,
        "not counted as a parked keep-alive connection"
    );

    carries(&mut server, &mut client, b"from the upstream").await;
    assert!(parked_tunnels(&ctx, 1).await, "parked again");
    carries(&mut client, &mut server, b"from the client").await;
    // Many bytes at once, through a woken tunnel, arrive whole.
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let (mut server_rd, _server_wr) = server.split();
    let (_, ()) = tokio::join!(client.write_all(&big), async {
        let mut got = vec![0u8; big.len()];
        server_rd.read_exact(&mut got).await.unwrap();
        assert!(got == big, "a megabyte arrives whole and in order");
    });
    assert!(parked_tunnels(&ctx, 1).await);

    // The client leaves while parked: the close reaches the upstream and every count returns.
    drop(client);
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), server.read_to_end(&mut rest))
        .await
        .expect("the upstream sees the client's close")
        .unwrap();
    assert!(rest.is_empty());
    drop(server);
    assert!(
        eventually(|| families.tunnel_counts("connect") == (1, 0)
            && ctx.open_connections() == 0
            && ctx.parking.tunnels() == 0)
        .await
    );
    assert_eq!(
        ctx.limit.available_permits(),
        15,
        "the max_connections permit is back"
    );
}

#[tokio::test]
async fn a_parked_tunnel_closes_at_its_idle_timeout() {
    let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (sidecar, ctx, _drain) = serve_tunnels(
        target.local_addr().unwrap(),
        "downstream: { idle_timeout: 1500ms }\n",
    )
    .await;
    let (mut client, mut server) = open_tunnel(sidecar, &target).await;
    carries(&mut client, &mut server, b"x").await;
    let moved = std::time::Instant::now();
    assert!(parked_tunnels(&ctx, 1).await);
    let (mut at_client, mut at_server) = (Vec::new(), Vec::new());
    let (a, b) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut at_client)),
        tokio::time::timeout(Duration::from_secs(5), server.read_to_end(&mut at_server)),
    );
    assert!(
        matches!((a, b), (Ok(Ok(0)), Ok(Ok(0)))),
        "both sides closed by the sidecar"
    );
    let closed = moved.elapsed();
    assert!(
        closed >= Duration::from_millis(1500),
        "closed {closed:?} after the last byte, before idle_timeout"
    );
    // And at it, not later: a second of slack for a loaded machine, where a parked deadline
    // pushed 2 s late closes it 3.5 s after its last byte.
    assert!(
        closed < Duration::from_millis(2500),
        "closed {closed:?} after the last byte, idle_timeout 1.5 s: the parked deadline is late"
    );
    let families = ctx.metrics.families();
    assert!(eventually(|| families.tunnel_counts("connect") == (1, 0) && ctx.open_connections() == 0).await);
    assert_eq!(ctx.parking.tunnels(), 0);
}

/// Draining closes parked keep-alive connections, but a tunnel carries what its application
/// is still doing: it goes back to a task and goes on.
#[tokio::test]
async fn draining_puts_parked_tunnels_back_in_tasks() {
    let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (sidecar, ctx, drain) = serve_tunnels(
        target.local_addr().unwrap(),
        "downstream: { idle_timeout: 30s }\n",
    )
    .await;
    let (mut client, mut server) = open_tunnel(sidecar, &target).await;
    carries(&mut client, &mut server, b"x").await;
    assert!(parked_tunnels(&ctx, 1).await);
    drain.send(true).unwrap();
    assert!(
        eventually(|| ctx.parking.tunnels() == 0).await,
        "taken out of the lot"
    );
    carries(&mut server, &mut client, b"still here").await;
    tokio::time::sleep(super::super::PARK_AFTER * 2).await;
    assert_eq!(ctx.parking.tunnels(), 0, "not parked again while draining");
    carries(&mut client, &mut server, b"and here").await;
    assert_eq!(ctx.metrics.families().tunnel_counts("connect"), (1, 1));
}

/// A switched connection (a WebSocket) is a tunnel like a CONNECT: parked when quiet, woken
/// by either side, and closed through when the upstream leaves.
#[tokio::test]
async fn a_quiet_websocket_is_parked_and_woken_from_either_side() {
    let origin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = origin.local_addr().unwrap();
    let (sidecar, ctx, _drain) = serve_tunnels(up, "downstream: { idle_timeout: 30s }\n").await;
    let mut client = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    let upgrade = format!(
        "GET http://{up}/chat HTTP/1.1\r\nHost: {up}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    );
    client.write_all(upgrade.as_bytes()).await.unwrap();
    let (mut server, _) = origin.accept().await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        head.push(server.read_u8().await.unwrap());
    }
    let switched = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n";
    server.write_all(switched).await.unwrap();
    let mut answer = Vec::new();
    while !answer.ends_with(b"\r\n\r\n") {
        answer.push(client.read_u8().await.unwrap());
    }
    assert!(
        answer.starts_with(b"HTTP/1.1 101 "),
        "{}",
        String::from_utf8_lossy(&answer)
    );

    let families = ctx.metrics.families();
    carries(&mut client, &mut server, b"frame one").await;
    assert!(parked_tunnels(&ctx, 1).await, "quiet past PARK_AFTER: parked");
    assert_eq!(families.tunnel_counts("upgrade"), (1, 1));
    carries(&mut server, &mut client, b"pushed by the server").await;
    assert!(parked_tunnels(&ctx, 1).await, "parked again");
    carries(&mut client, &mut server, b"frame two").await;
    assert!(parked_tunnels(&ctx, 1).await);

    drop(server);
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest))
        .await
        .expect("the client sees the upstream's close")
        .unwrap();
    assert!(rest.is_empty());
    drop(client);
    assert!(eventually(|| families.tunnel_counts("upgrade") == (1, 0) && ctx.open_connections() == 0).await);
    assert_eq!(ctx.parking.tunnels(), 0);
}
