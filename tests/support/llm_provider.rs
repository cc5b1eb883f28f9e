//! A scripted LLM provider over TLS (the token-accounting tests, issue 44): one server (HTTP/1.1,
//! or HTTP/2 by ALPN as the real APIs speak it) with a certificate for api.openai.com,
//! api.anthropic.com and generativelanguage.googleapis.com that answers OpenAI chat completions
//! and Responses, Anthropic messages and Gemini `generateContent` as the real APIs do (JSON, or
//! server-sent events when the request asks for a stream; OpenAI's usage chunk only with
//! `stream_options.include_usage`), with the model and usage the test scripted for the
//! request's `x-test-id`, written as the test chose (event by event, byte by byte, split at an
//! offset, paced, held mid-body); hostile bodies on demand (any bytes, 50 MB, cut mid-stream,
//! gzipped); and a record of every exchange: the request's version, headers and body, the
//! SHA-256 of the bytes sent.
//!
//! The sidecar reaches it as the real hosts (`url: https://api.openai.com`, `addresses` pointing
//! here, the test CA as `tls.ca_file`), so `llm.usage: auto` sees known hosts.

use super::*;

use std::collections::HashMap;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The API hosts the certificate names; the upstreams of [`LlmProvider::upstreams_yaml`].
pub const HOSTS: [(&str, &str); 3] = [
    ("openai", "api.openai.com"),
    ("anthropic", "api.anthropic.com"),
    ("gemini", "generativelanguage.googleapis.com"),
];

/// Tokens an answer spent, in the sidecar's one meaning per count (the issue's `input`,
/// `output`, `cache_read`, `cache_write`, `reasoning`). The provider writes them in each API's
/// own fields (Anthropic's `input_tokens` is `input - cache_read - cache_write`, Gemini's
/// `candidatesTokenCount` is `output - reasoning`), so a sidecar that reads them back must undo
/// exactly that.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Spend {
    pub input: u64,
    pub output: u64,
    pub cache_read: u64,
    pub cache_write: u64,
    pub reasoning: u64,
}

impl Spend {
    pub fn add(&mut self, other: &Spend) {
        self.input += other.input;
        self.output += other.output;
        self.cache_read += other.cache_read;
        self.cache_write += other.cache_write;
        self.reasoning += other.reasoning;
    }

    /// `(type label, count)` in the metric's terms.
    pub fn by_type(&self) -> [(&'static str, u64); 5] {
        [
            ("input", self.input),
            ("output", self.output),
            ("cache_read", self.cache_read),
            ("cache_write", self.cache_write),
            ("reasoning", self.reasoning),
        ]
    }
}

/// The answer a request asks for, from its path and body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Chat { stream: bool, include_usage: bool },
    Responses { stream: bool },
    Messages { stream: bool },
    Gemini { stream: bool },
}

impl Shape {
    fn of(path: &str, body: &serde_json::Value) -> Option<Shape> {
        let stream = body["stream"] == true;
        let (path, query) = path.split_once('?').unwrap_or((path, ""));
        let shape = if path.ends_with("/chat/completions") {
            Shape::Chat {
                stream,
                include_usage: body["stream_options"]["include_usage"] == true,
            }
        } else if path.ends_with("/responses") {
            Shape::Responses { stream }
        } else if path.ends_with("/messages") {
            Shape::Messages { stream }
        } else if path.ends_with(":streamGenerateContent") && query.split('&').any(|p| p == "alt=sse") {
            Shape::Gemini { stream: true }
        } else if path.ends_with(":generateContent") {
            Shape::Gemini { stream: false }
        } else {
            return None;
        };
        Some(shape)
    }

    fn is_stream(self) -> bool {
        match self {
            Shape::Chat { stream, .. }
            | Shape::Responses { stream }
            | Shape::Messages { stream }
            | Shape::Gemini { stream } => stream,
        }
    }
}

/// How a body's bytes are written to the connection (each write a flush: a TLS record and an
/// HTTP/1.1 chunk of its own).
#[derive(Debug, Clone)]
pub enum Writes {
    /// Each event (a JSON answer is one) in a write of its own.
    Events,
    /// One byte per write.
    Bytewise,
    /// Two writes, the first `n` bytes then the rest.
    SplitAt(usize),
    /// `before` after the head, the first event; `after` later, the rest, event by event.
    Paced { before: Duration, after: Duration },
    /// The first event, then the rest once the receiver holds `true`.
    Held(tokio::sync::watch::Receiver<bool>),
}

/// What the provider answers a request with.
#[derive(Debug, Clone)]
pub enum Answer {
    /// The answer the request's shape asks for, naming `model` and spending `spend`.
    Llm {
        model: String,
        spend: Spend,
        writes: Writes,
    },
    /// `status` with a JSON error body (a 429 with `Retry-After: 1`).
    Status { status: u16, body: String },
    /// These events (any bytes: [`Writes`] takes each as an event) as a body of
    /// `content_type`.
    Raw {
        content_type: &'static str,
        events: Vec<Bytes>,
        writes: Writes,
    },
    /// A chat completion of `len` bytes or so (its content pads it), usage at the end, written
    /// in 64 KiB pieces.
    Large { model: String, spend: Spend, len: usize },
    /// The events of a chat stream up to (not including) its usage chunk, then the connection
    /// is cut.
    Cut { model: String },
    /// A JSON answer with `Content-Encoding: gzip`, these bytes (compressed by the test),
    /// whatever the request accepted.
    Gzipped { body: Bytes },
}

/// One request the provider answered.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub test_id: Option<String>,
    pub version: http::Version,
    pub method: String,
    /// Path and query.
    pub path: String,
    pub headers: HeaderMap,
    /// The request body as JSON (`Null` when it is not).
    pub request: serde_json::Value,
    pub status: u16,
    /// SHA-256 (hex) and length of the body sent, whole (for [`Answer::Cut`]: what was sent
    /// before the cut).
    pub sent_sha256: String,
    pub sent_len: usize,
}

struct Shared {
    scripts: Mutex<HashMap<String, Answer>>,
    exchanges: Mutex<Vec<Exchange>>,
    count: tokio::sync::watch::Sender<usize>,
    /// Bodies waiting in [`Writes::Held`] now.
    holding: AtomicUsize,
}

/// The provider; stops on drop.
pub struct LlmProvider {
    pub addr: SocketAddr,
    /// The test CA's certificate, for `tls.ca_file`.
    pub ca_file: std::path::PathBuf,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    _dir: TempDir,
}

// === impl LlmProvider ===

impl LlmProvider {
    /// A provider speaking HTTP/1.1 only: every write a chunk of its own.
    pub async fn start() -> Self {
        Self::start_with(&[b"http/1.1"]).await
    }

    /// A provider offering HTTP/2 and HTTP/1.1 by ALPN, as api.openai.com and the others do: a
    /// sidecar with `protocol: auto` speaks HTTP/2 to it.
    pub async fn start_h2() -> Self {
        Self::start_with(&[b"h2", b"http/1.1"]).await
    }

    async fn start_with(alpn: &[&[u8]]) -> Self {
        let ca = TestCa::new();
        let dir = TempDir::new();
        let ca_file = ca.write_pem(&dir);
        let names: Vec<&str> = HOSTS.iter().map(|(_, h)| *h).collect();
        let acceptor = ca.server(&names, false, alpn);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            scripts: Mutex::new(HashMap::new()),
            exchanges: Mutex::new(Vec::new()),
            count: tokio::sync::watch::channel(0).0,
            holding: AtomicUsize::new(0),
        });
        let (stop, mut stopped) = oneshot::channel();
        let s = shared.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = tokio::select! {
                    r = listener.accept() => match r { Ok(p) => p, Err(_) => continue },
                    _ = &mut stopped => return,
                };
                let (s, acceptor) = (s.clone(), acceptor.clone());
                // As API servers do: an event written after a pause goes out at once, not after
                // the peer's delayed ACK of the head.
                let _ = tcp.set_nodelay(true);
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let svc = service_fn(move |req| serve(req, s.clone()));
                    // HTTP/1.1 or HTTP/2, whichever ALPN chose (the first bytes tell).
                    let _ =
                        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                            .serve_connection(TokioIo::new(tls), svc)
                            .await;
                });
            }
        });
        LlmProvider {
            addr,
            ca_file,
            shared,
            stop: Some(stop),
            _dir: dir,
        }
    }

    /// Answers every request carrying `x-test-id: id` with `answer`.
    pub fn script(&self, id: &str, answer: Answer) {
        self.shared.scripts.lock().unwrap().insert(id.to_owned(), answer);
    }

    /// Every exchange so far, in the order their answers began.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.shared.exchanges.lock().unwrap().clone()
    }

    /// The (last) exchange of the request marked `id`.
    pub fn exchange(&self, id: &str) -> Exchange {
        self.exchanges()
            .into_iter()
            .rev()
            .find(|e| e.test_id.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("no request {id} reached the provider"))
    }

    /// Waits (up to `within`) until `n` exchanges in all began; returns how many did.
    pub async fn wait_exchanges(&self, n: usize, within: Duration) -> usize {
        let mut rx = self.shared.count.subscribe();
        let _ = tokio::time::timeout(within, rx.wait_for(|c| *c >= n)).await;
        let now = *rx.borrow();
        now
    }

    /// Bodies held mid-way by [`Writes::Held`] now.
    pub fn holding(&self) -> usize {
        self.shared.holding.load(Ordering::SeqCst)
    }

    /// The `upstreams:` list for the three hosts (named `openai`, `anthropic`, `gemini`), each
    /// reached here over TLS, aliased to its host on port 80 (the Unix-socket clients name it in
    /// `Host`), with a route listener on port 0 when `routes`, `llm.usage` as given, no retries
    /// and a pool for `connections` at once.
    pub fn upstreams_yaml(&self, usage: &str, routes: bool, connections: usize) -> String {
        let mut yaml = String::from("upstreams:\n");
        for (name, host) in HOSTS {
            yaml.push_str(&format!(
                "  - name: {name}\n    url: https://{host}\n    aliases: [\"{host}:80\"]\n    \
                 addresses: [\"{addr}\"]\n    tls: {{ ca_file: \"{ca}\" }}\n    llm: {{ usage: {usage} }}\n    \
                 retry: {{ attempts: 0 }}\n    \
                 pool: {{ max_connections: {connections}, max_idle: {connections}, max_pending: {pending} }}\n",
                addr = self.addr,
                ca = self.ca_file.display(),
                pending = connections * 2,
            ));
            if routes {
                yaml.push_str("    listen: 127.0.0.1:0\n");
            }
        }
        yaml
    }
}

impl Drop for LlmProvider {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

// === answering ===

async fn serve(req: Request<Incoming>, shared: Arc<Shared>) -> Result<Response<BoxBody>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let version = parts.version;
    let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let request: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
    let test_id = parts
        .headers
        .get("x-test-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let answer = test_id
        .as_ref()
        .and_then(|id| shared.scripts.lock().unwrap().get(id).cloned());
    let shape = Shape::of(&path, &request);
    let tag = test_id.clone().unwrap_or_default();
    let gzipped = matches!(answer, Some(Answer::Gzipped { .. }));
    let (status, content_type, body, sent) = match (answer, shape) {
        (None, _) => error(400, &format!("no answer scripted for x-test-id {tag:?}")),
        (Some(Answer::Llm { .. }), None) => error(404, &format!("no API at {path}")),
        (Some(Answer::Llm { model, spend, writes }), Some(shape)) => {
            let events = render(shape, &model, &spend, &tag);
            let content_type = if shape.is_stream() {
                "text/event-stream; charset=utf-8"
            } else {
                "application/json"
            };
            let sent = digest(events.iter().map(|e| &e[..]));
            (200, content_type, write(events, writes, shared.clone()), sent)
        }
        (Some(Answer::Status { status, body }), _) => {
            let sent = digest([body.as_bytes()]);
            (status, "application/json", full_body(Bytes::from(body)), sent)
        }
        (
            Some(Answer::Raw {
                content_type,
                events,
                writes,
            }),
            _,
        ) => {
            let sent = digest(events.iter().map(|e| &e[..]));
            (200, content_type, write(events, writes, shared.clone()), sent)
        }
        (Some(Answer::Gzipped { body }), _) => {
            let sent = digest([&body[..]]);
            (200, "application/json", full_body(body), sent)
        }
        (Some(Answer::Large { model, spend, len }), _) => {
            let (head, tail) = large_ends(&model, &spend);
            let pad = len.saturating_sub(head.len() + tail.len());
            let sent = digest(large_pieces(&head, pad, &tail));
            (200, "application/json", large_body(head, pad, tail), sent)
        }
        (Some(Answer::Cut { model }), _) => {
            let shape = Shape::Chat {
                stream: true,
                include_usage: true,
            };
            let mut events = render(shape, &model, &Spend::default(), &tag);
            events.truncate(events.len() - 2); // the usage chunk and [DONE]
            let sent = digest(events.iter().map(|e| &e[..]));
            let (tx, body) = channel_body();
            tokio::spawn(async move {
                for event in events {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    if tx.send(Ok(Frame::data(event))).await.is_err() {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                let _ = tx.send(Err(std::io::Error::other("cut"))).await;
            });
            (200, "text/event-stream; charset=utf-8", body, sent)
        }
    };
    shared.exchanges.lock().unwrap().push(Exchange {
        test_id,
        version,
        method: parts.method.to_string(),
        path,
        headers: parts.headers,
        request,
        status,
        sent_sha256: sent.0,
        sent_len: sent.1,
    });
    shared.count.send_modify(|c| *c += 1);
    let mut resp = Response::new(body);
    *resp.status_mut() = http::StatusCode::from_u16(status).unwrap();
    let headers = resp.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    headers.insert("x-request-id", http::HeaderValue::from_static("req_scripted"));
    if gzipped {
        headers.insert(
            http::header::CONTENT_ENCODING,
            http::HeaderValue::from_static("gzip"),
        );
    }
    if status == 429 {
        headers.insert("retry-after", http::HeaderValue::from_static("1"));
    }
    Ok(resp)
}

fn error(status: u16, why: &str) -> (u16, &'static str, BoxBody, (String, usize)) {
    let body =
        serde_json::json!({ "error": { "message": why, "type": "invalid_request_error" } }).to_string();
    let sent = digest([body.as_bytes()]);
    (status, "application/json", full_body(Bytes::from(body)), sent)
}

fn full_body(bytes: Bytes) -> BoxBody {
    http_body_util::Full::new(bytes)
        .map_err(|never| match never {})
        .boxed()
}

/// The body of `events` written as `writes` says.
fn write(events: Vec<Bytes>, writes: Writes, shared: Arc<Shared>) -> BoxBody {
    let (tx, body) = channel_body();
    tokio::spawn(async move {
        let all = || Bytes::from(events.concat());
        let send = |b: Bytes| {
            let tx = tx.clone();
            async move { tx.send(Ok(Frame::data(b))).await.is_ok() }
        };
        match writes {
            Writes::Events => {
                for e in events {
                    if !send(e).await {
                        return;
                    }
                    tokio::task::yield_now().await;
                }
            }
            Writes::Bytewise => {
                let all = all();
                for i in 0..all.len() {
                    if !send(all.slice(i..i + 1)).await {
                        return;
                    }
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
            }
            Writes::SplitAt(n) => {
                let all = all();
                let n = n.min(all.len());
                if n > 0 && !send(all.slice(..n)).await {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
                if n < all.len() {
                    send(all.slice(n..)).await;
                }
            }
            Writes::Paced { before, after } => {
                let mut events = events.into_iter();
                tokio::time::sleep(before).await;
                if let Some(first) = events.next() {
                    if !send(first).await {
                        return;
                    }
                }
                tokio::time::sleep(after).await;
                for e in events {
                    if !send(e).await {
                        return;
                    }
                }
            }
            Writes::Held(mut release) => {
                let mut events = events.into_iter();
                if let Some(first) = events.next() {
                    if !send(first).await {
                        return;
                    }
                }
                shared.holding.fetch_add(1, Ordering::SeqCst);
                let _ = release.wait_for(|r| *r).await;
                shared.holding.fetch_sub(1, Ordering::SeqCst);
                for e in events {
                    if !send(e).await {
                        return;
                    }
                }
            }
        }
    });
    body
}

type FrameResult = Result<Frame<Bytes>, std::io::Error>;

/// A body fed through a channel: each message one frame, written when it arrives; an `Err`
/// aborts the connection mid-body.
struct ChannelBody(mpsc::Receiver<FrameResult>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<FrameResult>> {
        self.0.poll_recv(cx)
    }
}

fn channel_body() -> (mpsc::Sender<FrameResult>, BoxBody) {
    let (tx, rx) = mpsc::channel(4);
    (tx, ChannelBody(rx).boxed())
}

// === the large answer ===

const LARGE_PIECE: usize = 64 << 10;

/// The chat completion around the padding of a large answer.
fn large_ends(model: &str, spend: &Spend) -> (Bytes, Bytes) {
    let head = format!(
        "{{\"id\":\"chatcmpl-large\",\"object\":\"chat.completion\",\"created\":1764288000,\"model\":\"{model}\",\
         \"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\""
    );
    let tail = format!(
        "\",\"refusal\":null}},\"logprobs\":null,\"finish_reason\":\"length\"}}],\"usage\":{}}}",
        openai_chat_usage(spend)
    );
    (Bytes::from(head), Bytes::from(tail))
}

fn large_pieces<'a>(head: &'a Bytes, pad: usize, tail: &'a Bytes) -> impl Iterator<Item = &'a [u8]> {
    static PAD: [u8; LARGE_PIECE] = [b'a'; LARGE_PIECE];
    let full = pad / LARGE_PIECE;
    let rest = pad % LARGE_PIECE;
    std::iter::once(&head[..])
        .chain(std::iter::repeat_n(&PAD[..], full))
        .chain(std::iter::once(&PAD[..rest]))
        .chain(std::iter::once(&tail[..]))
}

fn large_body(head: Bytes, pad: usize, tail: Bytes) -> BoxBody {
    let (tx, body) = channel_body();
    tokio::spawn(async move {
        let pieces: Vec<Bytes> = large_pieces(&head, pad, &tail)
            .map(Bytes::copy_from_slice)
            .collect();
        for p in pieces {
            if tx.send(Ok(Frame::data(p))).await.is_err() {
                return;
            }
        }
    });
    body
}

// === SHA-256 ===

/// SHA-256 (hex) and length of the concatenation of `parts` (rustls' hash: no crate more).
pub fn digest<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> (String, usize) {
    let mut hasher = Sha256::new();
    for p in parts {
        hasher.update(p);
    }
    hasher.finish()
}

/// An incremental SHA-256.
pub struct Sha256 {
    ctx: Box<dyn rustls::crypto::hash::Context>,
    len: usize,
}

impl Sha256 {
    pub fn new() -> Self {
        let rustls::SupportedCipherSuite::Tls13(suite) =
            rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256
        else {
            unreachable!("a TLS 1.3 suite")
        };
        Sha256 {
            ctx: suite.common.hash_provider.start(),
            len: 0,
        }
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.ctx.update(bytes);
        self.len += bytes.len();
    }

    /// The hash in lower-case hex, and the length hashed.
    pub fn finish(self) -> (String, usize) {
        let out = self.ctx.finish();
        let hex = out.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        (hex, self.len)
    }
}

// === the APIs' answers ===

const CREATED: u64 = 1_764_288_000;

fn openai_chat_usage(s: &Spend) -> String {
    assert_eq!(s.cache_write, 0, "OpenAI reports no cache writes");
    format!(
        "{{\"prompt_tokens\":{},\"completion_tokens\":{},\"total_tokens\":{},\"prompt_tokens_details\":\
         {{\"cached_tokens\":{},\"audio_tokens\":0}},\"completion_tokens_details\":{{\"reasoning_tokens\":{},\
         \"audio_tokens\":0,\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}}}",
        s.input,
        s.output,
        s.input + s.output,
        s.cache_read,
        s.reasoning
    )
}

fn openai_responses_usage(s: &Spend) -> String {
    assert_eq!(s.cache_write, 0, "OpenAI reports no cache writes");
    format!(
        "{{\"input_tokens\":{},\"input_tokens_details\":{{\"cached_tokens\":{}}},\"output_tokens\":{},\
         \"output_tokens_details\":{{\"reasoning_tokens\":{}}},\"total_tokens\":{}}}",
        s.input,
        s.cache_read,
        s.output,
        s.reasoning,
        s.input + s.output
    )
}

/// Anthropic's usage with `output_tokens` as given (a stream's running count).
fn anthropic_usage(s: &Spend, output: u64) -> String {
    assert_eq!(s.reasoning, 0, "Anthropic reports no reasoning count");
    let uncached = s.input - s.cache_read - s.cache_write;
    format!(
        "{{\"input_tokens\":{uncached},\"cache_creation_input_tokens\":{},\"cache_read_input_tokens\":{},\
         \"cache_creation\":{{\"ephemeral_5m_input_tokens\":{},\"ephemeral_1h_input_tokens\":0}},\
         \"output_tokens\":{output},\"service_tier\":\"standard\"}}",
        s.cache_write, s.cache_read, s.cache_write
    )
}

/// Gemini's usage; `candidates` given (a stream's running count), thoughts only when whole.
fn gemini_usage(s: &Spend, candidates: u64, whole: bool) -> String {
    assert_eq!(s.cache_write, 0, "Gemini reports no cache writes");
    let (thoughts, cached) = if whole {
        (
            format!(",\"thoughtsTokenCount\":{}", s.reasoning),
            format!(",\"cachedContentTokenCount\":{}", s.cache_read),
        )
    } else {
        (String::new(), String::new())
    };
    let total = s.input + candidates + if whole { s.reasoning } else { 0 };
    format!(
        "{{\"promptTokenCount\":{},\"candidatesTokenCount\":{candidates},\"totalTokenCount\":{total}{cached}\
         {thoughts},\"promptTokensDetails\":[{{\"modality\":\"TEXT\",\"tokenCount\":{}}}]}}",
        s.input, s.input
    )
}

/// An answer's events (a JSON answer: one document), as the API writes them.
pub fn render(shape: Shape, model: &str, s: &Spend, id: &str) -> Vec<Bytes> {
    let texts = ["Tokens", " are", " what", " you", " pay", " for."];
    let out: Vec<String> = match shape {
        Shape::Chat { stream: false, .. } => vec![format!(
            "{{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion\",\"created\":{CREATED},\"model\":\"{model}\",\
             \"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\",\"refusal\":null,\
             \"annotations\":[]}},\"logprobs\":null,\"finish_reason\":\"stop\"}}],\"usage\":{},\
             \"service_tier\":\"default\",\"system_fingerprint\":\"fp_scripted\"}}",
            texts.concat(),
            openai_chat_usage(s)
        )],
        Shape::Chat {
            stream: true,
            include_usage,
        } => {
            let usage_null = if include_usage { ",\"usage\":null" } else { "" };
            let chunk = |choices: String| {
                format!(
                    "data: {{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion.chunk\",\"created\":{CREATED},\
                     \"model\":\"{model}\",\"service_tier\":\"default\",\"system_fingerprint\":\"fp_scripted\",\
                     \"choices\":{choices}{usage_null}}}\n\n"
                )
            };
            let mut events = vec![chunk(
                "[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null},\
                 \"logprobs\":null,\"finish_reason\":null}]"
                    .into(),
            )];
            for t in texts {
                events.push(chunk(format!(
                    "[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}},\"logprobs\":null,\"finish_reason\":null}}]"
                )));
            }
            events.push(chunk(
                "[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}]".into(),
            ));
            if include_usage {
                events.push(format!(
                    "data: {{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion.chunk\",\"created\":{CREATED},\
                     \"model\":\"{model}\",\"service_tier\":\"default\",\"system_fingerprint\":\"fp_scripted\",\
                     \"choices\":[],\"usage\":{}}}\n\n",
                    openai_chat_usage(s)
                ));
            }
            events.push("data: [DONE]\n\n".into());
            events
        }
        Shape::Responses { stream } => {
            let response = |status: &str, output: &str, usage: &str| {
                format!(
                    "{{\"id\":\"resp_{id}\",\"object\":\"response\",\"created_at\":{CREATED},\"status\":\"{status}\",\
                     \"background\":false,\"error\":null,\"incomplete_details\":null,\"instructions\":null,\
                     \"max_output_tokens\":null,\"model\":\"{model}\",\"output\":[{output}],\
                     \"parallel_tool_calls\":true,\"previous_response_id\":null,\
                     \"reasoning\":{{\"effort\":\"medium\",\"summary\":null}},\"service_tier\":\"default\",\
                     \"store\":true,\"temperature\":1.0,\"text\":{{\"format\":{{\"type\":\"text\"}},\
                     \"verbosity\":\"medium\"}},\"tool_choice\":\"auto\",\"tools\":[],\"top_p\":1.0,\
                     \"truncation\":\"disabled\",\"usage\":{usage},\"user\":null,\"metadata\":{{}}}}"
                )
            };
            let message = format!(
                "{{\"id\":\"msg_{id}\",\"type\":\"message\",\"status\":\"completed\",\"content\":[{{\"type\":\
                 \"output_text\",\"annotations\":[],\"logprobs\":[],\"text\":\"{}\"}}],\"role\":\"assistant\"}}",
                texts.concat()
            );
            let done = response("completed", &message, &openai_responses_usage(s));
            if !stream {
                vec![done]
            } else {
                let event = |n: usize, kind: &str, rest: String| {
                    format!("event: {kind}\ndata: {{\"type\":\"{kind}\",\"sequence_number\":{n},{rest}}}\n\n")
                };
                let mut events = vec![
                    event(
                        0,
                        "response.created",
                        format!("\"response\":{}", response("in_progress", "", "null")),
                    ),
                    event(
                        1,
                        "response.in_progress",
                        format!("\"response\":{}", response("in_progress", "", "null")),
                    ),
                    event(
                        2,
                        "response.output_item.added",
                        format!(
                            "\"output_index\":0,\"item\":{{\"id\":\"msg_{id}\",\"type\":\"message\",\
                             \"status\":\"in_progress\",\"content\":[],\"role\":\"assistant\"}}"
                        ),
                    ),
                    event(
                        3,
                        "response.content_part.added",
                        format!(
                            "\"item_id\":\"msg_{id}\",\"output_index\":0,\"content_index\":0,\"part\":\
                             {{\"type\":\"output_text\",\"annotations\":[],\"logprobs\":[],\"text\":\"\"}}"
                        ),
                    ),
                ];
                let mut n = 4;
                for t in texts {
                    events.push(event(
                        n,
                        "response.output_text.delta",
                        format!(
                            "\"item_id\":\"msg_{id}\",\"output_index\":0,\"content_index\":0,\
                             \"delta\":\"{t}\",\"logprobs\":[]"
                        ),
                    ));
                    n += 1;
                }
                events.push(event(
                    n,
                    "response.output_text.done",
                    format!(
                        "\"item_id\":\"msg_{id}\",\"output_index\":0,\"content_index\":0,\"text\":\"{}\",\
                         \"logprobs\":[]",
                        texts.concat()
                    ),
                ));
                events.push(event(
                    n + 1,
                    "response.output_item.done",
                    format!("\"output_index\":0,\"item\":{message}"),
                ));
                events.push(event(n + 2, "response.completed", format!("\"response\":{done}")));
                events
            }
        }
        Shape::Messages { stream: false } => vec![format!(
            "{{\"id\":\"msg_{id}\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"{model}\",\
             \"content\":[{{\"type\":\"text\",\"text\":\"{}\"}}],\"stop_reason\":\"end_turn\",\
             \"stop_sequence\":null,\"usage\":{}}}",
            texts.concat(),
            anthropic_usage(s, s.output)
        )],
        Shape::Messages { stream: true } => {
            // The case: three message_delta events with running counts 5, 17 and the
            // total. They are cumulative: the last one is the answer's output.
            assert!(s.output > 17, "a streamed Anthropic answer's output is above 17");
            let event = |kind: &str, data: String| format!("event: {kind}\ndata: {data}\n\n");
            let delta = |t: &str| {
                event(
                    "content_block_delta",
                    format!(
                        "{{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\
                         \"text\":\"{t}\"}}}}"
                    ),
                )
            };
            let message_delta = |stop: &str, output: u64| {
                event(
                    "message_delta",
                    format!(
                        "{{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":{stop},\"stop_sequence\":null}},\
                         \"usage\":{{\"output_tokens\":{output}}}}}"
                    ),
                )
            };
            vec![
                event(
                    "message_start",
                    format!(
                        "{{\"type\":\"message_start\",\"message\":{{\"id\":\"msg_{id}\",\"type\":\"message\",\
                         \"role\":\"assistant\",\"model\":\"{model}\",\"content\":[],\"stop_reason\":null,\
                         \"stop_sequence\":null,\"usage\":{}}}}}",
                        anthropic_usage(s, 1)
                    ),
                ),
                event(
                    "content_block_start",
                    "{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}"
                        .into(),
                ),
                event("ping", "{\"type\": \"ping\"}".into()),
                delta(texts[0]),
                delta(texts[1]),
                message_delta("null", 5),
                delta(texts[2]),
                delta(texts[3]),
                message_delta("null", 17),
                delta(texts[4]),
                delta(texts[5]),
                event(
                    "content_block_stop",
                    "{\"type\":\"content_block_stop\",\"index\":0}".into(),
                ),
                message_delta("\"end_turn\"", s.output),
                event("message_stop", "{\"type\":\"message_stop\"}".into()),
            ]
        }
        Shape::Gemini { stream } => {
            let chunk = |text: &str, finish: bool, usage: String| {
                let finish = if finish { ",\"finishReason\":\"STOP\"" } else { "" };
                format!(
                    "{{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"{text}\"}}],\"role\":\"model\"}}\
                     {finish},\"index\":0}}],\"usageMetadata\":{usage},\"modelVersion\":\"{model}\",\
                     \"responseId\":\"{id}\"}}"
                )
            };
            let candidates = s.output - s.reasoning;
            if !stream {
                vec![chunk(&texts.concat(), true, gemini_usage(s, candidates, true))]
            } else {
                // Each chunk carries the usage so far; the last one is whole. Gemini ends its
                // events with CRLF CRLF.
                let n = texts.len() as u64;
                texts
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let last = i as u64 + 1 == n;
                        let so_far = if last { candidates } else { candidates * (i as u64 + 1) / (n + 1) };
                        format!("data: {}\r\n\r\n", chunk(t, last, gemini_usage(s, so_far, last)))
                    })
                    .collect()
            }
        }
    };
    out.into_iter().map(Bytes::from).collect()
}
