//! An HTTP/1.1 upstream's response fields, as an HTTP/1.1 client gets them: byte for byte
//! (names in the upstream's case, repeated fields in order) but for the hop-by-hop fields and
//! the framing, which are the sidecar's. A raw origin writes each head exactly.

mod support;

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::Sidecar;

/// An origin that answers every request on a connection with `response`, as written.
async fn raw_origin(response: &'static [u8]) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while support::read_request_path(&mut stream, &mut buf).await.is_some() {
                    if stream.write_all(response).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// What a client that asks the sidecar for `origin`'s `/` with `Connection: close` reads,
/// to the close.
async fn fetch(sidecar: SocketAddr, origin: SocketAddr, version: &str) -> String {
    let mut client = TcpStream::connect(sidecar).await.unwrap();
    let req = format!("GET http://{origin}/ {version}\r\nHost: {origin}\r\nConnection: close\r\n\r\n");
    client.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), client.read_to_end(&mut got))
        .await
        .expect("the sidecar answers and closes")
        .unwrap();
    String::from_utf8(got).unwrap()
}

#[tokio::test]
async fn plain_fields_reach_the_client_as_the_upstream_wrote_them() {
    let origin = raw_origin(
        b"HTTP/1.1 200 OK\r\nServer: Up/1\r\nConnection: keep-alive\r\nX-Mixed-Case: A  b\r\n\
          Set-Cookie: a=1\r\nKeep-Alive: timeout=5\r\nset-cookie:b=2\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    let sidecar = Sidecar::start("").await;
    assert_eq!(
        fetch(sidecar.addr, origin, "HTTP/1.1").await,
        "HTTP/1.1 200 OK\r\nServer: Up/1\r\nX-Mixed-Case: A  b\r\nSet-Cookie: a=1\r\nset-cookie:b=2\r\n\
         Content-Length: 2\r\nconnection: close\r\n\r\nok"
    );
}

/// The body's framing towards the client is the sidecar's: the upstream's chunked coding (and
/// a `Content-Length` beside it) do not go on as fields.
#[tokio::test]
async fn a_chunked_response_goes_on_with_the_sidecars_framing_only() {
    let origin = raw_origin(
        b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n\
          2\r\nok\r\n0\r\n\r\n",
    )
    .await;
    let sidecar = Sidecar::start("").await;
    assert_eq!(
        fetch(sidecar.addr, origin, "HTTP/1.1").await,
        "HTTP/1.1 200 OK\r\nX-A: 1\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    );
    // An HTTP/1.0 client gets the body to the close.
    assert_eq!(
        fetch(sidecar.addr, origin, "HTTP/1.0").await,
        "HTTP/1.1 200 OK\r\nX-A: 1\r\nconnection: close\r\n\r\nok"
    );
}

/// Fields that the hop-by-hop rewrite removes are removed whether or not the rest could have
/// gone on as lines.
#[tokio::test]
async fn hop_by_hop_fields_and_the_fields_connection_names_are_removed() {
    let origin = raw_origin(
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Private\r\nX-Private: 1\r\nUpgrade: h2c\r\n\
          Proxy-Authenticate: Basic\r\nTE: trailers\r\nX-Public: 2\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    let sidecar = Sidecar::start("").await;
    assert_eq!(
        fetch(sidecar.addr, origin, "HTTP/1.1").await,
        "HTTP/1.1 200 OK\r\nx-public: 2\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
    );
}

/// A head whose lines end in a bare LF (which httparse takes) is rewritten with CRLF, not
/// passed on as it came.
#[tokio::test]
async fn bare_lf_lines_go_on_as_crlf_lines() {
    let origin = raw_origin(b"HTTP/1.1 200 OK\nServer: up\nContent-Length: 2\n\nok").await;
    let sidecar = Sidecar::start("").await;
    assert_eq!(
        fetch(sidecar.addr, origin, "HTTP/1.1").await,
        "HTTP/1.1 200 OK\r\nserver: up\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
    );
}
