//! A minimal raw HTTP/1.1 client, and raw byte helpers for tunnels and upgrades.

use super::*;

// === raw client ===

/// A response read off a raw socket.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts the contract's shape of a sidecar-made error: `status`, `x-egress-error: kind`,
    /// and one `text/plain` line `egress-sidecar: <kind>: <cause>`. Returns the body.
    pub fn assert_sidecar_error(&self, status: u16, kind: &str, what: &str) -> String {
        assert_eq!(self.status, status, "{what}: {}", self.text());
        assert_eq!(self.header("x-egress-error"), Some(kind), "{what}");
        assert_eq!(
            self.header("content-type"),
            Some("text/plain; charset=utf-8"),
            "{what}"
        );
        let body = self.text();
        assert!(
            body.starts_with(&format!("egress-sidecar: {kind}: ")) && body.ends_with('\n'),
            "{what}: {body:?}"
        );
        assert_eq!(body.lines().count(), 1, "{what}: one line: {body:?}");
        body
    }
}

/// A keep-alive HTTP/1.1 client connection over a raw socket.
pub struct RawClient {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl RawClient {
    /// A client over an already connected stream.
    pub fn from_stream(stream: TcpStream) -> Self {
        RawClient {
            stream,
            buf: Vec::new(),
        }
    }

    /// Bytes read past the last parsed message.
    pub fn take_buffered(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    pub async fn connect(addr: SocketAddr) -> Self {
        RawClient {
            stream: TcpStream::connect(addr).await.unwrap(),
            buf: Vec::new(),
        }
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// Sends a GET in absolute-form for `url`.
    pub async fn get(&mut self, url: &str) -> RawResponse {
        let host = url.split('/').nth(2).unwrap_or("");
        self.send_raw(format!("GET {url} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await;
        self.read_response(false).await.expect("response")
    }

    /// Sends a GET in absolute-form for `url` with `extra` header lines (each ending in CRLF)
    /// and reads the response, which must come within 20 s, before a close.
    pub async fn get_with(&mut self, url: &str, extra: &str) -> RawResponse {
        let host = url.split('/').nth(2).unwrap_or("");
        self.send_raw(format!("GET {url} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n").as_bytes())
            .await;
        tokio::time::timeout(Duration::from_secs(20), self.read_response(false))
            .await
            .unwrap_or_else(|_| panic!("GET {url} {extra:?}: no response in 20 s"))
            .unwrap_or_else(|| panic!("GET {url} {extra:?}: closed before a response"))
    }

    /// Sends `CONNECT target` with `extra_head` lines (each ending in CRLF), then `early` bytes
    /// in the same write, and reads the answer: a 200's head only (the stream is then at the
    /// first tunnelled byte; bytes read past the head stay buffered), anything else whole.
    pub async fn open_tunnel(&mut self, target: &str, extra_head: &str, early: &[u8]) -> Option<RawResponse> {
        let mut raw = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{extra_head}\r\n").into_bytes();
        raw.extend_from_slice(early);
        self.send_raw(&raw).await;
        let (status, headers) = self.try_read_head().await?;
        Some(self.read_body(status, headers, status == 200).await)
    }

    /// Reads one response (`head_only` for HEAD requests); None if the connection closed first.
    pub async fn read_response(&mut self, head_only: bool) -> Option<RawResponse> {
        let (status, headers) = self.try_read_head().await?;
        Some(self.read_body(status, headers, head_only).await)
    }

    async fn read_body(&mut self, status: u16, headers: HeaderMap, head_only: bool) -> RawResponse {
        let no_body = head_only || status == 204 || status == 304 || (100..200).contains(&status);
        let body = if no_body {
            Vec::new()
        } else if let Some(len) = headers.get("content-length") {
            let len: usize = len.to_str().unwrap().parse().unwrap();
            while self.buf.len() < len {
                assert!(self.fill().await, "closed mid-body");
            }
            self.buf.drain(..len).collect()
        } else if headers.get("transfer-encoding").is_some_and(|v| v == "chunked") {
            self.read_chunked().await
        } else {
            while self.fill().await {}
            std::mem::take(&mut self.buf)
        };
        RawResponse {
            status,
            headers,
            body,
        }
    }

    async fn read_chunked(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(p) = find(&self.buf, b"\r\n") {
                    break p;
                }
                assert!(self.fill().await, "closed in chunk header");
            };
            let size_text = String::from_utf8_lossy(&self.buf[..line_end]).to_string();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
            self.buf.drain(..line_end + 2);
            if size == 0 {
                // trailers until empty line
                loop {
                    let end = loop {
                        if let Some(p) = find(&self.buf, b"\r\n") {
                            break p;
                        }
                        assert!(self.fill().await);
                    };
                    self.buf.drain(..end + 2);
                    if end == 0 {
                        return body;
                    }
                }
            }
            while self.buf.len() < size + 2 {
                assert!(self.fill().await, "closed in chunk");
            }
            body.extend(self.buf.drain(..size));
            self.buf.drain(..2);
        }
    }

    /// Reads the next chunk of a chunked body as it arrives (for streaming tests).
    pub async fn read_chunk(&mut self) -> Option<Vec<u8>> {
        let line_end = loop {
            if let Some(p) = find(&self.buf, b"\r\n") {
                break p;
            }
            if !self.fill().await {
                return None;
            }
        };
        let size_text = String::from_utf8_lossy(&self.buf[..line_end]).to_string();
        let size = usize::from_str_radix(size_text.trim(), 16).unwrap();
        self.buf.drain(..line_end + 2);
        while self.buf.len() < size + 2 {
            if !self.fill().await {
                return None;
            }
        }
        let data: Vec<u8> = self.buf.drain(..size).collect();
        self.buf.drain(..2);
        Some(data)
    }

    /// A response whose body the connection's end cuts short: its status and the body bytes
    /// that arrived before the close, whatever the framing promised. None if the connection
    /// closed before a head.
    pub async fn read_until_closed(&mut self) -> Option<(u16, usize)> {
        let (status, _) = self.try_read_head().await?;
        while self.fill().await {}
        Some((status, std::mem::take(&mut self.buf).len()))
    }

    /// Reads the head of a response only (the body is left for `read_chunk`).
    pub async fn read_head(&mut self) -> (u16, HeaderMap) {
        self.try_read_head().await.expect("closed before head")
    }

    /// Reads a response head; None if the connection closed first.
    async fn try_read_head(&mut self) -> Option<(u16, HeaderMap)> {
        let head_end = loop {
            if let Some(pos) = find(&self.buf, b"\r\n\r\n") {
                break pos + 4;
            }
            if !self.fill().await {
                return None;
            }
        };
        let mut slots = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut slots);
        resp.parse(&self.buf[..head_end]).expect("valid response head");
        let status = resp.code.unwrap();
        let mut headers = HeaderMap::new();
        for h in resp.headers.iter() {
            headers.append(
                http::HeaderName::from_bytes(h.name.as_bytes()).unwrap(),
                http::HeaderValue::from_bytes(h.value).unwrap(),
            );
        }
        self.buf.drain(..head_end);
        Some((status, headers))
    }

    /// Whether the peer closed the connection (reads until EOF or `wait`).
    pub async fn is_closed_within(&mut self, wait: Duration) -> bool {
        let mut tmp = [0u8; 1024];
        match tokio::time::timeout(wait, self.stream.read(&mut tmp)).await {
            Ok(Ok(0)) | Ok(Err(_)) => true,
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&tmp[..n]);
                false
            }
            Err(_) => false,
        }
    }

    async fn fill(&mut self) -> bool {
        let mut tmp = [0u8; 16384];
        match self.stream.read(&mut tmp).await {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&tmp[..n]);
                true
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Sends `n` GETs for `url` at once, each on its own connection to `sidecar`.
pub fn spawn_gets(sidecar: SocketAddr, url: &str, n: usize) -> Vec<tokio::task::JoinHandle<RawResponse>> {
    (0..n)
        .map(|_| {
            let url = url.to_owned();
            tokio::spawn(async move { RawClient::connect(sidecar).await.get(&url).await })
        })
        .collect()
}

// === raw byte helpers for tunnels and upgrades ===

/// Reads exactly `n` bytes, taking `early` (bytes already read) first.
pub async fn read_n(stream: &mut TcpStream, early: &mut Vec<u8>, n: usize) -> Vec<u8> {
    let mut out: Vec<u8> = early.drain(..early.len().min(n)).collect();
    let mut rest = vec![0u8; n - out.len()];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut rest))
        .await
        .expect("bytes within 5s")
        .unwrap();
    out.extend_from_slice(&rest);
    out
}

/// Whether `stream` reaches end-of-file (or a reset) within `wait`, discarding data.
pub async fn closes_within(stream: &mut TcpStream, wait: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    let mut tmp = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut tmp)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

/// One HTTP/2 frame, its 9-byte header included, as a relay between two peers forwards it.
pub async fn read_h2_frame(r: &mut tokio::net::tcp::OwnedReadHalf) -> Option<Vec<u8>> {
    let mut frame = vec![0u8; 9];
    r.read_exact(&mut frame).await.ok()?;
    let len = (usize::from(frame[0]) << 16) | (usize::from(frame[1]) << 8) | usize::from(frame[2]);
    frame.resize(9 + len, 0);
    r.read_exact(&mut frame[9..]).await.ok()?;
    Some(frame)
}

/// An h2c (prior knowledge) GET for `uri` to `addr` on a connection of its own; the status and
/// body.
pub async fn h2c_get(addr: SocketAddr, uri: &str) -> (u16, String) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(uri)
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}
