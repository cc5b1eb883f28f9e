//! A scripted HTTP/1.1 origin: per path, a sequence of answers consumed one per request (the
//! last repeats), each with its status, headers, body, a delay before the head and optionally
//! a body streamed in chunks with gaps (for SSE and silence), or no response at all (a close).
//! Records every request and counts the connections it accepts.

use super::upstream::{full, tokio_stream};
use super::*;

use std::collections::HashMap;
use std::time::Instant;

/// One answer of a script. Built with [`Answer::status`] and the methods after it.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// The whole body, sent with `Content-Length` (unless `chunks` is given).
    pub body: Bytes,
    /// How long the head waits once the request (body included) has arrived.
    pub head_delay: Duration,
    /// A streamed body instead of `body`: each chunk is sent after its gap (counted from the
    /// head or the previous chunk). Chunked unless a `content-length` header is given.
    pub chunks: Option<Vec<(Duration, Bytes)>>,
    /// After the last chunk, the body never ends: the origin stays silent until the other
    /// side closes the connection.
    pub hang: bool,
    /// No response: the connection closes once the request has arrived.
    pub reset: bool,
}

impl Answer {
    /// `status` with an empty body.
    pub fn status(status: u16) -> Self {
        Answer {
            status,
            headers: Vec::new(),
            body: Bytes::new(),
            head_delay: Duration::ZERO,
            chunks: None,
            hang: false,
            reset: false,
        }
    }

    /// No response at all: the connection closes once the request has arrived.
    pub fn reset() -> Self {
        Answer {
            reset: true,
            ..Self::status(200)
        }
    }

    /// 200 with `body`.
    pub fn ok(body: &str) -> Self {
        Self::status(200).body(body)
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn body(mut self, body: &str) -> Self {
        self.body = Bytes::copy_from_slice(body.as_bytes());
        self
    }

    /// The head is sent `delay` after the request arrived.
    pub fn head_after(mut self, delay: Duration) -> Self {
        self.head_delay = delay;
        self
    }

    /// Streams `data` `gap` after the head or the previous chunk.
    pub fn chunk(mut self, gap: Duration, data: &str) -> Self {
        self.chunks
            .get_or_insert_with(Vec::new)
            .push((gap, Bytes::copy_from_slice(data.as_bytes())));
        self
    }

    /// The body never ends after the chunks sent so far (see [`Answer::hang`]).
    pub fn then_hang(mut self) -> Self {
        self.chunks.get_or_insert_with(Vec::new);
        self.hang = true;
        self
    }
}

/// A request the scripted origin received.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Which accepted connection carried it (0 for the first).
    pub conn: usize,
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    /// When its head arrived.
    pub at: Instant,
    pub body_len: usize,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

#[derive(Default)]
struct Scripts {
    /// Per path: the answers not yet given (the last one stays).
    answers: HashMap<String, Vec<Answer>>,
}

struct Shared {
    scripts: Mutex<Scripts>,
    recorded: Mutex<Vec<Recorded>>,
    /// How many requests have been recorded; watched by [`ScriptedOrigin::wait_requests`].
    count: tokio::sync::watch::Sender<usize>,
    accepted: AtomicUsize,
    open: AtomicUsize,
}

/// The scripted origin. Paths without a script answer 200 "ok".
pub struct ScriptedOrigin {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
}

impl ScriptedOrigin {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            scripts: Mutex::new(Scripts::default()),
            recorded: Mutex::new(Vec::new()),
            count: tokio::sync::watch::channel(0).0,
            accepted: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
        });
        let (stop, mut stopped) = oneshot::channel();
        let s = shared.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    r = listener.accept() => match r { Ok(p) => p, Err(_) => continue },
                    _ = &mut stopped => return,
                };
                let conn = s.accepted.fetch_add(1, Ordering::SeqCst);
                s.open.fetch_add(1, Ordering::SeqCst);
                let s = s.clone();
                tokio::spawn(async move {
                    let s2 = s.clone();
                    let svc = service_fn(move |req| answer(req, conn, s2.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                    s.open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        ScriptedOrigin {
            addr,
            shared,
            stop: Some(stop),
        }
    }

    /// Sets the answers for `path`: one per request in order, the last one repeating.
    pub fn script(&self, path: &str, answers: Vec<Answer>) {
        assert!(!answers.is_empty(), "a script needs an answer");
        self.shared
            .scripts
            .lock()
            .unwrap()
            .answers
            .insert(path.to_owned(), answers);
    }

    /// `http://{addr}{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Every request received so far, in order of completion.
    pub fn recorded(&self) -> Vec<Recorded> {
        self.shared.recorded.lock().unwrap().clone()
    }

    /// The requests received for `path`.
    pub fn requests(&self, path: &str) -> Vec<Recorded> {
        self.recorded().into_iter().filter(|r| r.path == path).collect()
    }

    /// Waits (up to `within`) until `n` requests in all have been received, and returns them
    /// all either way.
    pub async fn wait_requests(&self, n: usize, within: Duration) -> Vec<Recorded> {
        let mut rx = self.shared.count.subscribe();
        let _ = tokio::time::timeout(within, rx.wait_for(|c| *c >= n)).await;
        self.recorded()
    }

    /// Connections accepted in total.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }
}

impl Drop for ScriptedOrigin {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn answer(
    req: Request<Incoming>,
    conn: usize,
    shared: Arc<Shared>,
) -> Result<Response<BoxBody>, std::io::Error> {
    let at = Instant::now();
    let (parts, body) = req.into_parts();
    let body_len = body.collect().await.map_or(0, |b| b.to_bytes().len());
    let path = parts.uri.path().to_owned();
    let script = {
        let mut scripts = shared.scripts.lock().unwrap();
        match scripts.answers.get_mut(&path) {
            Some(list) if list.len() > 1 => Some(list.remove(0)),
            Some(list) => Some(list[0].clone()),
            None => None,
        }
    };
    shared.recorded.lock().unwrap().push(Recorded {
        conn,
        method: parts.method.to_string(),
        path,
        headers: parts.headers,
        at,
        body_len,
    });
    shared.count.send_modify(|c| *c += 1);
    let script = script.unwrap_or_else(|| Answer::ok("ok"));
    if script.reset {
        // hyper closes the connection on a service error, without a response.
        return Err(std::io::Error::other("scripted reset"));
    }
    if !script.head_delay.is_zero() {
        // The scripted origin's slowness is the scenario (not synchronisation).
        tokio::time::sleep(script.head_delay).await;
    }
    let mut resp = match script.chunks {
        None => Response::new(full(script.body)),
        Some(chunks) => {
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
            let hang = script.hang;
            tokio::spawn(async move {
                for (gap, data) in chunks {
                    // The gaps are the scenario: a stream that thinks, or goes silent.
                    tokio::time::sleep(gap).await;
                    if tx.send(Ok(Frame::data(data))).await.is_err() {
                        return;
                    }
                }
                if hang {
                    // Silent until the connection goes (the body is dropped with it).
                    tx.closed().await;
                }
            });
            Response::new(StreamBody::new(tokio_stream(rx)).boxed())
        }
    };
    *resp.status_mut() = http::StatusCode::from_u16(script.status).unwrap();
    for (name, value) in &script.headers {
        resp.headers_mut().append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            http::HeaderValue::from_str(value).unwrap(),
        );
    }
    Ok(resp)
}
