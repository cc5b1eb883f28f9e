//! What does a request cost through our HTTP/2 client (`connector::http2`, on our own
//! `wire::h2client`) and through hyper's (`hyper::client::conn::http2`, on the `h2` crate), the
//! client most Rust proxies use?
//!
//! One process: an `h2`-crate server on a loopback socket answering each GET with a 38-byte
//! body, and one client sending `REQUESTS` GETs one after another on one connection, reading
//! each response whole. The server, the runtime and the socket are the same for both clients, so
//! the difference between two runs is the clients' own.
//!
//! Run: `cargo bench --bench h2_client` sends 20,000 requests with each client and prints the
//! wall time per request (noise on a shared machine). For instructions, count each client alone
//! under callgrind with two request counts and take the difference:
//! `H2_CLIENT=ours REQUESTS=1000 valgrind --tool=callgrind <bench binary>`, then `REQUESTS=11000`,
//! (Ir(11,000) - Ir(1,000)) / 10,000; the same with `H2_CLIENT=hyper`.

use std::time::Instant;

use bytes::Bytes;
use egress_sidecar::connector::http2;
use egress_sidecar::wire::{HeadLines, RequestBody};
use http::Request;
use http_body_util::BodyExt;
use tokio::net::{TcpListener, TcpStream};

const BODY: &[u8] = b"{\"id\":42,\"items\":[1,2,3],\"next\":null}\n";

/// Which client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Client {
    /// `connector::http2`.
    Ours,
    /// hyper's, on the `h2` crate.
    Hyper,
}

/// Answers every stream with 200 and [`BODY`] until the client goes.
async fn serve(listener: TcpListener) {
    let (io, _) = listener.accept().await.expect("the client connects");
    let mut conn = h2::server::handshake(io).await.expect("the h2 handshake");
    while let Some(Ok((_req, mut respond))) = conn.accept().await {
        let response = http::Response::builder()
            .header("content-type", "application/json")
            .header("content-length", BODY.len())
            .body(())
            .expect("a response");
        let Ok(mut send) = respond.send_response(response, false) else {
            continue;
        };
        let _ = send.send_data(Bytes::from_static(BODY), true);
    }
}

fn request() -> Request<RequestBody> {
    let mut req = Request::new(RequestBody::Empty);
    *req.uri_mut() = "http://upstream.test/v1/items?page=2".parse().expect("a uri");
    req.headers_mut().insert(
        "user-agent",
        http::HeaderValue::from_static("python-httpx/0.27.0"),
    );
    req.headers_mut()
        .insert("accept", http::HeaderValue::from_static("application/json"));
    req
}

/// Sends `requests` GETs with `client`, one after another, each read whole.
async fn run(client: Client, requests: usize) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
    let addr = listener.local_addr().expect("its address");
    let server = tokio::spawn(serve(listener));
    let io = TcpStream::connect(addr).await.expect("connects");
    io.set_nodelay(true).expect("nodelay");
    let mut received = 0;
    match client {
        Client::Ours => {
            let mut sender = http2::handshake(io, 100, None, None, |_| {});
            for _ in 0..requests {
                let resp = sender
                    .send(&mut request(), HeadLines::NONE)
                    .await
                    .expect("a response");
                received += resp.into_body().collect().await.expect("a body").to_bytes().len();
            }
        }
        Client::Hyper => {
            let (mut sender, conn) = hyper::client::conn::http2::handshake(
                hyper_util::rt::TokioExecutor::new(),
                hyper_util::rt::TokioIo::new(io),
            )
            .await
            .expect("the handshake");
            tokio::spawn(conn);
            for _ in 0..requests {
                let (parts, _) = request().into_parts();
                let req = Request::from_parts(parts, http_body_util::Empty::<Bytes>::new());
                let resp = sender.send_request(req).await.expect("a response");
                received += resp.into_body().collect().await.expect("a body").to_bytes().len();
            }
        }
    }
    assert_eq!(received, requests * BODY.len(), "every body came whole");
    server.abort();
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let chosen = match std::env::var("H2_CLIENT").as_deref() {
        Ok("ours") => Some(Client::Ours),
        Ok("hyper") => Some(Client::Hyper),
        _ => None,
    };
    if let Some(client) = chosen {
        let requests = std::env::var("REQUESTS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(10_000);
        runtime.block_on(run(client, requests));
        println!("{client:?}: {requests} requests");
        return;
    }
    // `cargo bench` passes `--bench`; any run without H2_CLIENT times both.
    for client in [Client::Hyper, Client::Ours] {
        let requests = 20_000;
        let started = Instant::now();
        runtime.block_on(run(client, requests));
        let per = started.elapsed() / requests as u32;
        println!("{client:?}: {per:?} per request ({requests} requests, server included)");
    }
}
