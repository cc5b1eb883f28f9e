//! Tests of the connection's task and its streams against an `h2`-crate server on a real socket:
//! closing once released, bodies both ways, abandoned and failing request bodies, the stream
//! limit, keepalive.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::net::{TcpListener, TcpStream};

use super::{handshake, Ended, Error, Keepalive, Sender, Status};
use crate::wire::{HeadLines, RequestBody};

const PATIENCE: Duration = Duration::from_secs(5);

/// A client connection to an h2 server on a real socket; returns the server's connection.
async fn connect_with(
    builder: h2::server::Builder,
    keepalive: Option<Keepalive>,
) -> (
    Sender,
    h2::server::Connection<TcpStream, Bytes>,
    tokio::sync::oneshot::Receiver<Option<String>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (io, _) = listener.accept().await.unwrap();
        builder.handshake(io).await.unwrap()
    });
    let io = TcpStream::connect(addr).await.unwrap();
    let (ended_tx, ended) = tokio::sync::oneshot::channel();
    let sender = handshake(io, 101, keepalive, None, move |e| {
        let _ = ended_tx.send(e.map(|e| e.to_string()));
    });
    (sender, server.await.unwrap(), ended)
}

async fn connect() -> (Sender, h2::server::Connection<TcpStream, Bytes>) {
    let (sender, server, _) = connect_with(h2::server::Builder::new(), None).await;
    (sender, server)
}

fn post(body: RequestBody) -> Request<RequestBody> {
    let mut req = Request::new(body);
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = "http://upstream.test/upload".parse().unwrap();
    req
}

fn get(path: &str) -> Request<RequestBody> {
    let mut req = Request::new(RequestBody::Empty);
    *req.uri_mut() = format!("http://upstream.test{path}").parse().unwrap();
    req
}

/// A connection the pool forgot closes once its last handle goes.
#[tokio::test]
async fn the_connection_closes_once_every_sender_is_gone() {
    let (sender, mut server, ended) = connect_with(h2::server::Builder::new(), None).await;
    let more = sender.clone();
    drop(sender);
    drop(more);
    let accepted = tokio::time::timeout(PATIENCE, server.accept())
        .await
        .expect("the client closed the connection once its senders were gone");
    assert!(accepted.is_none(), "no stream was opened");
    assert_eq!(
        ended.await.unwrap(),
        None,
        "a released connection ends without an error"
    );
}

/// A GET and its response, data and all, and a second on the same connection.
#[tokio::test]
async fn requests_get_their_responses_on_one_connection() {
    let (mut sender, mut server) = connect().await;
    let client = tokio::spawn(async move {
        let mut bodies = Vec::new();
        for path in ["/a", "/b"] {
            let mut resp = sender.send(&mut get(path), HeadLines::NONE).await.unwrap();
            assert_eq!(resp.status(), 200);
            // The fields come as the lines an HTTP/1.1 client gets, the map left empty.
            assert!(resp.headers().is_empty(), "{:?}", resp.headers());
            let wire = resp.body_mut().take_wire_fields().expect("the lines");
            assert_eq!(wire.lines(), format!("x-path: {path}\r\n").as_bytes());
            bodies.push(resp.into_body().collect().await.unwrap().to_bytes());
        }
        bodies
    });
    for _ in 0..2 {
        let (request, mut respond) = server.accept().await.unwrap().unwrap();
        let path = request.uri().path().to_owned();
        let response = http::Response::builder()
            .header("x-path", &path)
            .body(())
            .unwrap();
        let mut stream = respond.send_response(response, false).unwrap();
        stream
            .send_data(Bytes::from(format!("body of {path}")), true)
            .unwrap();
    }
    let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
    let bodies = tokio::time::timeout(PATIENCE, client).await.unwrap().unwrap();
    assert_eq!(bodies, [Bytes::from("body of /a"), Bytes::from("body of /b")]);
    serve.abort();
}

/// A request body still streaming when its exchange is abandoned (a deadline, the
/// application gone) must not go on being sent to a response nobody reads.
#[tokio::test]
async fn an_abandoned_exchange_resets_its_stream_and_stops_the_body() {
    let (mut sender, mut server) = connect().await;
    // The pool's handle: the connection stays while the exchange goes.
    let _pooled = sender.clone();
    let (body, tx) = RequestBody::channel(None);
    let mut req = post(body);
    let exchange = tokio::spawn(async move { sender.send(&mut req, HeadLines::NONE).await.map(|_| ()) });
    let (request, _respond) = server.accept().await.unwrap().unwrap();
    let mut received = request.into_body();
    tx.tx
        .send(Ok(Frame::data(Bytes::from_static(b"part"))))
        .await
        .unwrap();
    let first = tokio::select! {
        data = received.data() => data,
        _ = server.accept() => panic!("the connection ended"),
    };
    assert_eq!(first.unwrap().unwrap(), Bytes::from_static(b"part"));
    exchange.abort();
    let next = tokio::select! {
        data = received.data() => data,
        _ = server.accept() => panic!("the connection ended"),
        _ = tokio::time::sleep(PATIENCE) => panic!("the stream was neither reset nor ended"),
    };
    let reset = next.expect("reset, not ended").expect_err("reset, not more data");
    assert_eq!(reset.reason(), Some(h2::Reason::CANCEL), "{reset}");
    tokio::time::timeout(PATIENCE, tx.tx.closed())
        .await
        .expect("the body's pump ended and dropped the body");
}

/// A body failing before the response head (the application went away mid-upload) is the
/// application's fault: reported as such, not as a reset by the upstream.
#[tokio::test]
async fn a_request_body_failing_before_the_response_is_reported_as_the_body() {
    let (mut sender, mut server) = connect().await;
    let (body, tx) = RequestBody::channel(None);
    let mut req = post(body);
    let exchange = tokio::spawn(async move { sender.send(&mut req, HeadLines::NONE).await.map(|_| ()) });
    let (request, _respond) = server.accept().await.unwrap().unwrap();
    let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
    tx.tx
        .send(Err(crate::wire::codec::BodyError("client went away".into())))
        .await
        .unwrap();
    let failed = tokio::time::timeout(PATIENCE, exchange)
        .await
        .unwrap()
        .unwrap()
        .expect_err("no response");
    assert!(
        matches!(&failed, Error::RequestBody(why) if why.contains("client went away")),
        "{failed:?}"
    );
    let reset = request.into_body().data().await.unwrap().expect_err("reset");
    assert_eq!(reset.reason(), Some(h2::Reason::INTERNAL_ERROR), "{reset}");
    serve.abort();
}

/// A body sent in full, then trailers; the response's data and trailers come back.
#[tokio::test]
async fn a_body_and_trailers_go_out_and_the_response_comes_back_whole() {
    let (mut sender, mut server) = connect().await;
    let (body, tx) = RequestBody::channel(None);
    let mut req = post(body);
    req.headers_mut()
        .insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    let client = tokio::spawn(async move {
        let resp = sender.send(&mut req, HeadLines::NONE).await.unwrap();
        let collected = resp.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        (collected.to_bytes(), trailers)
    });
    let feed = tokio::spawn(async move {
        for part in [&b"hello "[..], b"world"] {
            tx.tx
                .send(Ok(Frame::data(Bytes::from_static(part))))
                .await
                .unwrap();
        }
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        tx.tx.send(Ok(Frame::trailers(trailers))).await.unwrap();
    });
    let (request, mut respond) = server.accept().await.unwrap().unwrap();
    let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
    assert_eq!(request.headers()["te"], "trailers");
    let mut body = request.into_body();
    let mut received = Vec::new();
    while let Some(data) = body.data().await {
        let data = data.unwrap();
        body.flow_control().release_capacity(data.len()).unwrap();
        received.extend_from_slice(&data);
    }
    assert_eq!(received, b"hello world");
    let trailers = body.trailers().await.unwrap().expect("trailers");
    assert_eq!(trailers["grpc-status"], "0");
    feed.await.unwrap();

    let mut stream = respond.send_response(http::Response::new(()), false).unwrap();
    stream.send_data(Bytes::from_static(b"answer"), false).unwrap();
    let mut out = http::HeaderMap::new();
    out.insert("grpc-status", http::HeaderValue::from_static("0"));
    stream.send_trailers(out).unwrap();
    let (data, trailers) = tokio::time::timeout(PATIENCE, client).await.unwrap().unwrap();
    assert_eq!(data, Bytes::from_static(b"answer"));
    assert_eq!(trailers.expect("response trailers")["grpc-status"], "0");
    serve.abort();
}

/// The server's SETTINGS_MAX_CONCURRENT_STREAMS of 1: a second request waits for the first's
/// stream to end, then goes out on the same connection.
#[tokio::test]
async fn a_request_over_the_servers_stream_limit_waits_for_a_stream_to_end() {
    let mut builder = h2::server::Builder::new();
    builder.max_concurrent_streams(1);
    let (sender, mut server, _) = connect_with(builder, None).await;
    let mut first = sender.clone();
    let mut second = sender.clone();
    let a = tokio::spawn(async move {
        let resp = first.send(&mut get("/first"), HeadLines::NONE).await.unwrap();
        resp.into_body().collect().await.unwrap().to_bytes()
    });
    let (request, mut respond) = server.accept().await.unwrap().unwrap();
    assert_eq!(request.uri().path(), "/first");
    while sender.max_streams() != 1 {
        tokio::task::yield_now().await;
    }
    let b = tokio::spawn(async move {
        let resp = second.send(&mut get("/second"), HeadLines::NONE).await.unwrap();
        resp.into_body().collect().await.unwrap().to_bytes()
    });
    let next = tokio::time::timeout(Duration::from_millis(300), server.accept()).await;
    assert!(next.is_err(), "the second stream waited");
    let mut stream = respond.send_response(http::Response::new(()), false).unwrap();
    stream.send_data(Bytes::from_static(b"one"), true).unwrap();
    let (request, mut respond) = server.accept().await.unwrap().unwrap();
    assert_eq!(request.uri().path(), "/second");
    respond.send_response(http::Response::new(()), true).unwrap();
    let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
    assert_eq!(a.await.unwrap(), "one");
    assert_eq!(b.await.unwrap(), "");
    serve.abort();
}

/// While a response is awaited, PINGs go out; a server that stops answering them ends the
/// connection, and the stream fails saying so.
#[tokio::test]
async fn an_unanswered_keepalive_ping_ends_the_connection() {
    let keepalive = Keepalive {
        interval: Duration::from_millis(100),
        timeout: Duration::from_millis(200),
    };
    let (mut sender, mut server, ended) = connect_with(h2::server::Builder::new(), Some(keepalive)).await;
    let exchange =
        tokio::spawn(async move { sender.send(&mut get("/slow"), HeadLines::NONE).await.map(|_| ()) });
    // Accepting the stream, then polling the server no more: its PING answers stop.
    let (_request, _respond) = server.accept().await.unwrap().unwrap();
    let failed = tokio::time::timeout(PATIENCE, exchange)
        .await
        .expect("the keepalive ended the exchange")
        .unwrap()
        .expect_err("no response");
    assert!(
        matches!(failed, Error::Connection(Ended::Unanswered)),
        "{failed:?}"
    );
    let why = ended.await.unwrap().expect("an error ended the connection");
    assert!(why.contains("keep-alive timed out"), "{why}");
}

/// Polls `cond` every 10 ms for up to [`PATIENCE`].
async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !cond() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

/// Streams the connection still counts: (slots awaiting a reader, streams open on the wire).
fn streams_held(sender: &Sender) -> (usize, usize) {
    let state = sender.shared.lock();
    (state.slots.len(), state.conn.open_streams())
}

/// The body ends with its last data frame, not at a poll after it: the pool frees the stream
/// (and the downstream writer, which stops once it has the bytes it was told of, frees its
/// lease) with the last byte.
#[tokio::test]
async fn a_body_ends_with_its_last_frame() {
    let (mut sender, mut server) = connect().await;
    let pooled = sender.clone();
    let client = tokio::spawn(async move {
        let resp = sender.send(&mut get("/whole"), HeadLines::NONE).await.unwrap();
        let mut body = resp.into_body();
        let frame = body.frame().await.unwrap().unwrap();
        let ended = http_body::Body::is_end_stream(&body);
        (frame.into_data().unwrap(), ended, body)
    });
    let (_request, mut respond) = server.accept().await.unwrap().unwrap();
    let mut stream = respond.send_response(http::Response::new(()), false).unwrap();
    stream.send_data(Bytes::from_static(b"all of it"), true).unwrap();
    let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
    let (data, ended, _body) = tokio::time::timeout(PATIENCE, client).await.unwrap().unwrap();
    assert_eq!(data, "all of it");
    assert!(ended, "the body ended with its last frame");
    assert_eq!(
        streams_held(&pooled),
        (0, 0),
        "(slots, open streams) with the body still held"
    );
    serve.abort();
}

/// A server may answer before it has read the whole request (a 413 mid-upload). Once that
/// answer is read and dropped, the request body stops and its stream is reset: left
/// half-open it would count against the server's stream limit for the connection's life.
#[tokio::test]
async fn a_response_ending_before_its_request_body_resets_the_stream() {
    let (mut sender, mut server) = connect().await;
    let pooled = sender.clone();
    let (body, tx) = RequestBody::channel(None);
    let mut req = post(body);
    let client = tokio::spawn(async move {
        let resp = sender.send(&mut req, HeadLines::NONE).await.unwrap();
        assert_eq!(resp.status(), 413);
        resp.into_body().collect().await.unwrap().to_bytes()
    });
    let (request, mut respond) = server.accept().await.unwrap().unwrap();
    let mut received = request.into_body();
    let mut early = http::Response::new(());
    *early.status_mut() = http::StatusCode::PAYLOAD_TOO_LARGE;
    let mut stream = respond.send_response(early, false).unwrap();
    stream.send_data(Bytes::from_static(b"too large"), true).unwrap();
    let next = tokio::select! {
        data = received.data() => data,
        _ = server.accept() => panic!("the connection ended"),
        _ = tokio::time::sleep(PATIENCE) => panic!("the request's stream was left open"),
    };
    let reset = next.expect("reset, not ended").expect_err("reset, not more data");
    assert_eq!(reset.reason(), Some(h2::Reason::CANCEL), "{reset}");
    assert_eq!(client.await.unwrap(), "too large");
    assert!(
        eventually(|| tx.tx.is_closed() && streams_held(&pooled) == (0, 0)).await,
        "(slots, open streams) {:?}, request body dropped {}",
        streams_held(&pooled),
        tx.tx.is_closed()
    );
}

/// A GOAWAY that lets the open stream finish: the connection takes no new stream from then
/// on (the pool drains it), and is gone once the server closes it.
#[tokio::test]
async fn a_graceful_goaway_finishes_the_open_stream_and_takes_no_new_one() {
    let (mut sender, mut server) = connect().await;
    let pooled = sender.clone();
    let client = tokio::spawn(async move {
        let resp = sender.send(&mut get("/last"), HeadLines::NONE).await.unwrap();
        resp.into_body().collect().await.unwrap().to_bytes()
    });
    let (_request, mut respond) = server.accept().await.unwrap().unwrap();
    server.graceful_shutdown();
    let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
    assert!(
        eventually(|| pooled.status() == Status::GoingAway).await,
        "status {:?} after GOAWAY",
        pooled.status()
    );
    let mut stream = respond.send_response(http::Response::new(()), false).unwrap();
    stream.send_data(Bytes::from_static(b"done"), true).unwrap();
    assert_eq!(
        tokio::time::timeout(PATIENCE, client).await.unwrap().unwrap(),
        "done"
    );
    let mut late = pooled.clone();
    let refused = late
        .send(&mut get("/late"), HeadLines::NONE)
        .await
        .expect_err("no new stream");
    assert!(matches!(refused, Error::Unsent(_)), "{refused:?}");
    assert!(
        eventually(|| pooled.status() == Status::Gone).await,
        "status {:?} once the server closed",
        pooled.status()
    );
    serve.abort();
}

/// A head with a field the proxy must rewrite (`Proxy-Authenticate`, hop-by-hop in HTTP/1.1)
/// comes as a map, which the proxy's rewrite reads, not as lines written as they are.
#[tokio::test]
async fn a_head_with_a_hop_by_hop_field_comes_as_a_map() {
    let (mut sender, mut server) = connect().await;
    let client = tokio::spawn(async move {
        let mut resp = sender.send(&mut get("/auth"), HeadLines::NONE).await.unwrap();
        let wire = resp.body_mut().take_wire_fields();
        (resp.headers().clone(), wire)
    });
    let (_request, mut respond) = server.accept().await.unwrap().unwrap();
    let response = http::Response::builder()
        .status(407)
        .header("proxy-authenticate", "Basic realm=\"upstream\"")
        .header("x-kept", "1")
        .body(())
        .unwrap();
    respond.send_response(response, true).unwrap();
    let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
    let (headers, wire) = tokio::time::timeout(PATIENCE, client).await.unwrap().unwrap();
    assert!(wire.is_none(), "{wire:?}");
    assert_eq!(headers["proxy-authenticate"], "Basic realm=\"upstream\"");
    assert_eq!(headers["x-kept"], "1");
    serve.abort();
}

/// A server that sent its whole response may reset the stream with NO_ERROR to stop the
/// upload (RFC 9113 §8.1: the client must not discard the response for it).
#[tokio::test]
async fn a_reset_with_no_error_after_the_whole_response_keeps_the_response() {
    let (mut sender, mut server) = connect().await;
    let pooled = sender.clone();
    let (body, tx) = RequestBody::channel(None);
    let mut req = post(body);
    let (head_tx, head_rx) = tokio::sync::oneshot::channel();
    let (read_tx, read_rx) = tokio::sync::oneshot::channel::<()>();
    let client = tokio::spawn(async move {
        let resp = sender.send(&mut req, HeadLines::NONE).await.unwrap();
        let _ = head_tx.send(());
        read_rx.await.unwrap();
        resp.into_body().collect().await.map(|c| c.to_bytes())
    });
    let (_request, mut respond) = server.accept().await.unwrap().unwrap();
    let mut stream = respond.send_response(http::Response::new(()), false).unwrap();
    stream.send_data(Bytes::from_static(b"answered"), true).unwrap();
    let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
    tokio::time::timeout(PATIENCE, head_rx).await.unwrap().unwrap();
    // The whole response is in (its END_STREAM came with the data); now the reset.
    assert!(
        eventually(|| pooled.shared.lock().slots.values().all(|slot| slot.done)).await,
        "the response's end came"
    );
    stream.send_reset(h2::Reason::NO_ERROR);
    assert!(
        eventually(|| tx.tx.is_closed()).await,
        "the reset stopped the request body"
    );
    read_tx.send(()).unwrap();
    let read = tokio::time::timeout(PATIENCE, client).await.unwrap().unwrap();
    assert_eq!(read.expect("the whole response, not the reset"), "answered");
    serve.abort();
}

/// A stream's queued DATA comes out in the order it came, however reads and arrivals
/// interleave, and what is held unread is counted in full.
#[test]
fn queued_data_keeps_its_order() {
    let mut chunks = super::Chunks::default();
    assert!(chunks.is_empty() && chunks.pop().is_none());
    chunks.push(Bytes::from_static(b"a"));
    chunks.push(Bytes::from_static(b"bb"));
    chunks.push(Bytes::from_static(b"ccc"));
    assert_eq!(chunks.held(), 6);
    assert_eq!(chunks.pop().as_deref(), Some(&b"a"[..]));
    chunks.push(Bytes::from_static(b"dddd"));
    assert_eq!(chunks.held(), 9);
    let rest: Vec<Bytes> = std::iter::from_fn(|| chunks.pop()).collect();
    assert_eq!(rest, [&b"bb"[..], b"ccc", b"dddd"]);
    assert!(chunks.is_empty() && chunks.held() == 0);
    chunks.push(Bytes::from_static(b"e"));
    assert_eq!(chunks.pop().as_deref(), Some(&b"e"[..]));
    assert!(chunks.is_empty());
}
