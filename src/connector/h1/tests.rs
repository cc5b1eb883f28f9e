//! Tests of an HTTP/1.1 upstream connection: request heads, response framing, the exchange
//! kept on the connection.

use http::{HeaderValue, Version};

use super::*;

fn head(text: &str) -> Result<Option<Response<()>>, Error> {
    Ok(head::parse(&mut BytesMut::from(text))?.map(head::Head::mapped))
}

/// The exchange of `req` begun on a connection's transfer.
fn started(req: &mut Request<RequestBody>, lines: &HeadLines) -> Transfer {
    let mut transfer = Transfer::idle();
    transfer.begin(req, lines);
    transfer
}

fn framing(req_method: Method, text: &str) -> Result<ResponseState, Error> {
    let mut req = Request::new(RequestBody::Empty);
    *req.method_mut() = req_method;
    let transfer = started(&mut req, &HeadLines::default());
    let head = head::parse(&mut BytesMut::from(text))?.expect("complete");
    transfer.body_framing(head.resp.status(), head.framing)
}

#[test]
fn response_heads_parse_with_their_framing() {
    assert!(head("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n")
        .unwrap()
        .is_none());
    let resp = head("HTTP/1.0 404 Nope\r\nA: b\r\nA: c\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.version(), Version::HTTP_10);
    assert_eq!(resp.headers().get_all("a").iter().count(), 2);
    assert!(matches!(
        framing(Method::GET, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"),
        Ok(ResponseState::Framed(Decoder::Length { remaining: 5 }))
    ));
    assert!(matches!(
        framing(Method::HEAD, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"),
        Ok(ResponseState::Done)
    ));
    assert!(matches!(
        framing(
            Method::GET,
            "HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n"
        ),
        Ok(ResponseState::Done)
    ));
    assert!(matches!(
        framing(
            Method::GET,
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        ),
        Ok(ResponseState::Framed(Decoder::Chunked(_)))
    ));
    assert!(matches!(
        framing(Method::GET, "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"),
        Ok(ResponseState::UntilClose)
    ));
    assert!(matches!(
        framing(Method::GET, "HTTP/1.1 200 OK\r\n\r\n"),
        Ok(ResponseState::UntilClose)
    ));
    assert!(matches!(
        framing(
            Method::GET,
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n"
        ),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(
        framing(Method::GET, "HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n"),
        Ok(ResponseState::Framed(Decoder::Length { remaining: 5 }))
    ));
    assert!(matches!(
        framing(Method::GET, "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"),
        Err(Error::Invalid(_))
    ));
    assert!(head("HTTP/1.1 2000 OK\r\n\r\n").is_err());
    assert!(head("NOT HTTP\r\n\r\n").is_err());
}

#[test]
fn partial_writes_span_the_head_and_the_body() {
    let mut transfer = started(&mut Request::new(RequestBody::Empty), &HeadLines::default());
    let head_len = transfer.head.len();
    transfer.out.push_back(Bytes::from_static(b"abc"));
    transfer.out.push_back(Bytes::from_static(b"defg"));
    transfer.consume(head_len - 2);
    assert_eq!(&transfer.head[..], b"\r\n");
    transfer.consume(4);
    assert!(transfer.head.is_empty());
    assert_eq!(&transfer.out[0][..], b"c");
    transfer.consume(3);
    assert_eq!(&transfer.out[0][..], b"fg");
    assert!(transfer.has_unwritten());
    transfer.consume(2);
    assert!(!transfer.has_unwritten());
}

#[test]
fn interim_responses_are_skipped() {
    let mut transfer = started(&mut Request::new(RequestBody::Empty), &HeadLines::default());
    let mut buf = BytesMut::from("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early\r\nLink: x\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n");
    let (resp, wire) = transfer.parse_head(&mut buf).unwrap().unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(
        wire.unwrap().lines(),
        b"Content-Length: 0\r\n",
        "the interim's fields stay behind"
    );
    assert!(transfer.is_end_stream());
    assert!(buf.is_empty());
}

#[derive(Debug)]
struct NoPlace;

impl Place for NoPlace {
    fn failed(&self) {}
    fn connected(&self, _: crate::endpoint::Claim) {}
}

/// The upstream answers `first`, then, once the head is in, `rest`; whether the body,
/// read to its end, came with the head (the pool then takes the head's arrival as the time
/// the connection went idle).
async fn ended_with_head(first: &'static [u8], rest: &'static [u8]) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (client, mut server) = tokio::io::duplex(4096);
    let mut conn = Connection::new(Transport::Memory(client), Box::new(NoPlace));
    let (head_in, head_is_in) = tokio::sync::oneshot::channel::<()>();
    let upstream = tokio::spawn(async move {
        let mut head = [0u8; 256];
        let _ = server.read(&mut head).await.unwrap();
        server.write_all(first).await.unwrap();
        head_is_in.await.unwrap();
        server.write_all(rest).await.unwrap();
        server
    });
    conn.send(&mut Request::new(RequestBody::Empty), &HeadLines::default())
        .await
        .unwrap();
    head_in.send(()).unwrap();
    let mut body = Vec::new();
    while let Some(frame) = std::future::poll_fn(|cx| conn.poll_frame(cx)).await {
        body.extend_from_slice(frame.unwrap().data_ref().unwrap());
    }
    assert_eq!(body, b"hello");
    drop(upstream.await.unwrap());
    conn.transfer().ended_with_head()
}

/// The exchange's state stays on the connection: a second request on it starts afresh, and
/// between the two the connection holds no buffer (the head's, the body's queue, the read
/// buffer all went back).
#[tokio::test]
async fn a_connection_keeps_its_exchange_and_no_buffer_between_exchanges() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (client, mut server) = tokio::io::duplex(64 * 1024);
    let mut conn = Connection::new(Transport::Memory(client), Box::new(NoPlace));
    let upstream = tokio::spawn(async move {
        let mut seen = Vec::new();
        let mut chunk = [0u8; 4096];
        for answer in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\none"[..],
            b"HTTP/1.1 204 No Content\r\n\r\n",
        ] {
            // The POST's body (5 bytes) and then the GET's head, each read in full first.
            let want = if seen.is_empty() { b"hello".len() } else { 0 };
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") || seen.len() < want {
                let n = server.read(&mut chunk).await.unwrap();
                seen.extend_from_slice(&chunk[..n]);
                if want > 0 && seen.ends_with(b"hello") {
                    break;
                }
            }
            seen.clear();
            server.write_all(answer).await.unwrap();
        }
        server
    });
    let mut post = Request::new(RequestBody::Empty);
    *post.method_mut() = Method::POST;
    let (body, sender) = RequestBody::channel(Some(5));
    *post.body_mut() = body;
    sender
        .tx
        .send(Ok(Frame::data(Bytes::from_static(b"hello"))))
        .await
        .unwrap();
    drop(sender);
    let head = conn.send(&mut post, &HeadLines::default()).await.unwrap();
    assert_eq!(head.status(), 200);
    let mut body = Vec::new();
    while let Some(frame) = std::future::poll_fn(|cx| conn.poll_frame(cx)).await {
        body.extend_from_slice(frame.unwrap().data_ref().unwrap());
    }
    assert_eq!(body, b"one");
    assert!(conn.transfer().is_end_stream() && conn.is_reusable());
    let transfer = conn.transfer();
    assert_eq!(
        (transfer.head.capacity(), transfer.out.capacity()),
        (0, 0),
        "buffers kept idle"
    );
    assert_eq!(conn.link.buf.capacity(), 0, "the read buffer kept idle");

    let head = conn
        .send(&mut Request::new(RequestBody::Empty), &HeadLines::default())
        .await
        .unwrap();
    assert_eq!(head.status(), 204);
    assert!(conn.transfer().is_end_stream(), "a 204 ends with its head");
    assert!(conn.transfer().ended_with_head() && conn.is_reusable());
    drop(upstream.await.unwrap());
}

#[tokio::test]
async fn a_body_that_came_with_its_head_says_so() {
    let head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n";
    assert!(ended_with_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"").await);
    assert!(!ended_with_head(head, b"hello").await);
    assert!(!ended_with_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel", b"lo").await);
}

#[test]
fn request_heads_carry_their_body_framing() {
    let encoded = |mut req: Request<RequestBody>| {
        let transfer = started(&mut req, &HeadLines::default());
        assert!(req.body().is_empty(), "the body went with the transfer");
        assert!(transfer.out.is_empty(), "no body bytes before the body is polled");
        String::from_utf8(transfer.head.to_vec()).unwrap()
    };
    let mut get = Request::new(RequestBody::Empty);
    *get.uri_mut() = "/a?b=c".parse().unwrap();
    get.headers_mut().insert("host", HeaderValue::from_static("up"));
    assert_eq!(encoded(get), "GET /a?b=c HTTP/1.1\r\nhost: up\r\n\r\n");

    let (body, _tx) = RequestBody::channel(Some(7));
    let mut post = Request::new(body);
    *post.method_mut() = Method::POST;
    assert_eq!(encoded(post), "POST / HTTP/1.1\r\ncontent-length: 7\r\n\r\n");

    let (body, _tx) = RequestBody::channel(None);
    let mut post = Request::new(body);
    *post.method_mut() = Method::POST;
    assert_eq!(
        encoded(post),
        "POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"
    );
}
