//! A scripted rate-limited provider (an LLM API as the pacing tests see it) on a real socket:
//! a fixed window of N requests per W per credential, the limit headers of one provider style
//! on every answer, 429 with `Retry-After` above the limit, one-shot scripted answers, and a
//! record of every request (arrival, credential, marker, status, what it was told).
//!
//! Windows are per credential (the value of `Authorization`, else `x-api-key`, else `api-key`):
//! the first starts at the credential's first request, the next ones follow back to back, so a
//! window's end is known exactly and every header tells the truth about it.

use super::upstream::full;
use super::*;

use std::collections::HashMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Which limit headers the provider sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, the reset a Go duration
    /// (`1.234s`, `87ms`) rounded up to the millisecond; `retry-after-ms` on 429. The tokens
    /// figures are large and never bind.
    OpenAi,
    /// `anthropic-ratelimit-requests-{limit,remaining,reset}`, the reset an RFC 3339 UTC time in
    /// whole seconds. The windows are aligned to whole seconds of the wall clock, so the reset
    /// it names is exact (see [`Window`]).
    Anthropic,
    /// `RateLimit-Policy: "default";q=N;w=W` and `RateLimit: "default";r=<remaining>;t=<seconds
    /// to the window's end, rounded up>` (draft-ietf-httpapi-ratelimit-headers).
    Ietf,
    /// Garbage and absurd values in every family while the real limit is not reached:
    /// `x-ratelimit-reset-requests: 99999999h`, negative remainings, words for numbers, a
    /// `RateLimit` that is not a structured field. No combination of them is a valid report of
    /// an exhausted quota, so a sidecar that ignores them must hold nothing.
    Malformed,
    /// No limit headers at all (a 429 above the limit still carries `Retry-After`).
    Silent,
}

/// A one-shot scripted answer, given to the first request [`When`] matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// 429 with `Retry-After: <seconds>` (and the style's headers saying remaining 0, reset
    /// then). Only that request is refused: the provider does not enforce the pause itself,
    /// so a request sent during it is answered 200 and only its arrival time shows it.
    TooMany { retry_after: u64 },
    /// 200 with the style's headers saying remaining 0 and a reset `reset` away, and the
    /// provider enforces it: the credential's window is full until then (aligned up to a whole
    /// second in the Anthropic style), and windows of W follow back to back from there.
    Exhaust { reset: Duration },
}

/// Which request a scripted [`Action`] answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum When {
    /// The next request to arrive.
    Next,
    /// The next request carrying this credential.
    Credential(String),
    /// The request arriving with this 0-based index (over all requests).
    Arrival(usize),
}

/// A request the provider received.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// 0-based, in order of arrival.
    pub index: usize,
    /// When its head arrived.
    pub at: Instant,
    /// `Authorization`, else `x-api-key`, else `api-key` ("" without any).
    pub credential: String,
    /// The `x-test-id` marker, when it had one.
    pub test_id: Option<String>,
    pub status: u16,
    /// Refused because its credential's window was full (never true of a scripted answer).
    pub over_limit: bool,
    /// A scripted answer was given to it.
    pub scripted: bool,
    /// The limit headers it was answered with, in order.
    pub sent: Vec<(String, String)>,
    /// Every header it carried.
    pub headers: HeaderMap,
}

impl Arrival {
    /// The first value of response header `name` sent with it.
    pub fn sent(&self, name: &str) -> Option<&str> {
        self.sent
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One credential's current window: `count` requests admitted in `[start, start + len)`.
/// The first window of the Anthropic style starts at the whole second of the wall clock at or
/// BEFORE the credential's first request (so it may be shorter than W): every reset it names
/// is then a whole second and exact, and a sidecar that waits for it waits no extra time.
/// (`envoyproxy/ratelimit` aligns its windows to the calendar the same way.)
#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    len: Duration,
    count: u32,
}

struct State {
    windows: HashMap<String, Window>,
    scripts: Vec<(When, Action)>,
    arrivals: Vec<Arrival>,
}

struct Shared {
    style: Style,
    limit: u32,
    window: Duration,
    /// The instant and the wall-clock time the provider started at: the wall clock of any
    /// instant follows from them (the Anthropic style names times on the wall clock).
    epoch: (Instant, SystemTime),
    state: Mutex<State>,
    /// How many requests have arrived; watched by [`Provider::wait_arrivals`].
    count: tokio::sync::watch::Sender<usize>,
}

/// The provider. Every path answers the same way.
pub struct Provider {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
}

// === impl Provider ===

impl Provider {
    /// A provider allowing `limit` requests per `window` per credential, answering in `style`.
    pub async fn start(style: Style, limit: u32, window: Duration) -> Self {
        assert!(limit > 0 && !window.is_zero());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            style,
            limit,
            window,
            epoch: (Instant::now(), SystemTime::now()),
            state: Mutex::new(State {
                windows: HashMap::new(),
                scripts: Vec::new(),
                arrivals: Vec::new(),
            }),
            count: tokio::sync::watch::channel(0).0,
        });
        let (stop, mut stopped) = oneshot::channel();
        let s = shared.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    r = listener.accept() => match r { Ok(p) => p, Err(_) => continue },
                    _ = &mut stopped => return,
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| serve(req, s.clone()));
                    // HTTP/1.1 keep-alive: hyper keeps the connection for the next request.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Provider {
            addr,
            shared,
            stop: Some(stop),
        }
    }

    /// `http://{addr}{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Answers the first request `when` matches with `action`, once.
    pub fn script(&self, when: When, action: Action) {
        self.shared.state.lock().unwrap().scripts.push((when, action));
    }

    /// Every request received so far, in order of arrival.
    pub fn arrivals(&self) -> Vec<Arrival> {
        self.shared.state.lock().unwrap().arrivals.clone()
    }

    /// The request with marker `test_id`, if it arrived.
    pub fn arrival(&self, test_id: &str) -> Option<Arrival> {
        self.arrivals()
            .into_iter()
            .find(|a| a.test_id.as_deref() == Some(test_id))
    }

    /// Requests refused because their credential's window was full.
    pub fn over_limit(&self) -> usize {
        self.arrivals().iter().filter(|a| a.over_limit).count()
    }

    /// Waits (up to `within`) until `n` requests in all have arrived, and returns them all
    /// either way.
    pub async fn wait_arrivals(&self, n: usize, within: Duration) -> Vec<Arrival> {
        let mut rx = self.shared.count.subscribe();
        let _ = tokio::time::timeout(within, rx.wait_for(|c| *c >= n)).await;
        self.arrivals()
    }

    /// The wall-clock time of `at`, in seconds since the Unix epoch.
    pub fn unix_seconds(&self, at: Instant) -> f64 {
        self.shared
            .wall(at)
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

// === impl Shared ===

impl Shared {
    fn wall(&self, at: Instant) -> SystemTime {
        let (i0, s0) = self.epoch;
        match at.checked_duration_since(i0) {
            Some(d) => s0 + d,
            None => s0 - (i0 - at),
        }
    }

    /// `at` moved back to the whole second of the wall clock at or before it.
    fn floor_second(&self, at: Instant) -> Instant {
        let since = self.wall(at).duration_since(UNIX_EPOCH).unwrap();
        at - Duration::from_nanos(u64::from(since.subsec_nanos()))
    }

    /// `at` moved on to the whole second of the wall clock at or after it.
    fn ceil_second(&self, at: Instant) -> Instant {
        let floor = self.floor_second(at);
        if floor == at {
            at
        } else {
            floor + Duration::from_secs(1)
        }
    }

    /// The credential's window at `now`, rolled forward past the ends that have passed.
    fn window_at<'a>(
        &self,
        windows: &'a mut HashMap<String, Window>,
        credential: &str,
        now: Instant,
    ) -> &'a mut Window {
        let first_start = match self.style {
            Style::Anthropic => self.floor_second(now),
            _ => now,
        };
        let w = windows.entry(credential.to_owned()).or_insert(Window {
            start: first_start,
            len: self.window,
            count: 0,
        });
        while now >= w.start + w.len {
            w.start += w.len;
            w.len = self.window;
            w.count = 0;
        }
        w
    }

    /// Decides the answer to a request arriving `now` with `credential` and records it.
    fn decide(&self, now: Instant, credential: String, headers: HeaderMap) -> (u16, Vec<(String, String)>) {
        let mut state = self.state.lock().unwrap();
        let index = state.arrivals.len();
        let scripted = state.scripts.iter().position(|(when, _)| match when {
            When::Next => true,
            When::Credential(c) => *c == credential,
            When::Arrival(i) => *i == index,
        });
        let scripted = scripted.map(|i| state.scripts.remove(i).1);
        let (status, over_limit, remaining, end) = match scripted {
            Some(Action::TooMany { retry_after }) => (429, false, 0, now + Duration::from_secs(retry_after)),
            Some(Action::Exhaust { reset }) => {
                let mut end = now + reset;
                if self.style == Style::Anthropic {
                    end = self.ceil_second(end);
                }
                let limit = self.limit;
                let w = self.window_at(&mut state.windows, &credential, now);
                *w = Window {
                    start: now,
                    len: end - now,
                    count: limit,
                };
                (200, false, 0, end)
            }
            None => {
                let limit = self.limit;
                let w = self.window_at(&mut state.windows, &credential, now);
                let end = w.start + w.len;
                if w.count < limit {
                    w.count += 1;
                    (200, false, limit - w.count, end)
                } else {
                    (429, true, 0, end)
                }
            }
        };
        let mut sent = self.limit_headers(remaining, now, end);
        if status == 429 {
            let left = end.saturating_duration_since(now);
            sent.push(("retry-after".into(), ceil_seconds(left).to_string()));
            if self.style == Style::OpenAi {
                sent.push(("retry-after-ms".into(), ceil_millis(left).to_string()));
            }
        }
        let test_id = headers
            .get("x-test-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        state.arrivals.push(Arrival {
            index,
            at: now,
            credential,
            test_id,
            status,
            over_limit,
            scripted: scripted.is_some(),
            sent: sent.clone(),
            headers,
        });
        drop(state);
        self.count.send_modify(|c| *c += 1);
        (status, sent)
    }

    /// The style's headers for a window with `remaining` requests left that ends at `end`.
    fn limit_headers(&self, remaining: u32, now: Instant, end: Instant) -> Vec<(String, String)> {
        let left = end.saturating_duration_since(now);
        let limit = self.limit;
        let h = |n: &str, v: String| (n.to_owned(), v);
        match self.style {
            Style::OpenAi => {
                let reset = go_duration_millis(ceil_millis(left));
                // Tokens: a large budget that each request dents a little, never binding.
                let tokens_left = 10_000_000 - 100 * u64::from(limit - remaining);
                vec![
                    h("x-ratelimit-limit-requests", limit.to_string()),
                    h("x-ratelimit-remaining-requests", remaining.to_string()),
                    h("x-ratelimit-reset-requests", reset.clone()),
                    h("x-ratelimit-limit-tokens", "10000000".into()),
                    h("x-ratelimit-remaining-tokens", tokens_left.to_string()),
                    h("x-ratelimit-reset-tokens", reset),
                ]
            }
            Style::Anthropic => {
                // `end` is a whole second here (see Window), so this names it exactly.
                let at = self.wall(end).duration_since(UNIX_EPOCH).unwrap();
                let secs = at.as_secs() + u64::from(at.subsec_nanos() > 0);
                vec![
                    h("anthropic-ratelimit-requests-limit", limit.to_string()),
                    h("anthropic-ratelimit-requests-remaining", remaining.to_string()),
                    h("anthropic-ratelimit-requests-reset", rfc3339(secs)),
                ]
            }
            Style::Ietf => vec![
                h(
                    "ratelimit-policy",
                    format!("\"default\";q={limit};w={}", self.window.as_secs().max(1)),
                ),
                h(
                    "ratelimit",
                    format!("\"default\";r={remaining};t={}", ceil_seconds(left)),
                ),
            ],
            Style::Malformed => vec![
                h("x-ratelimit-limit-requests", "twenty".into()),
                h("x-ratelimit-remaining-requests", "-5".into()),
                h("x-ratelimit-reset-requests", "99999999h".into()),
                h("x-ratelimit-limit-tokens", "-1".into()),
                h("x-ratelimit-remaining-tokens", "lots".into()),
                h("x-ratelimit-reset-tokens", "soon".into()),
                h("anthropic-ratelimit-requests-limit", "0x14".into()),
                h("anthropic-ratelimit-requests-remaining", "-1".into()),
                h("anthropic-ratelimit-requests-reset", "yesterday at noon".into()),
                h("ratelimit-policy", "((garbage".into()),
                h("ratelimit", "not a structured field{{".into()),
            ],
            Style::Silent => Vec::new(),
        }
    }
}

async fn serve(req: Request<Incoming>, shared: Arc<Shared>) -> Result<Response<BoxBody>, std::io::Error> {
    let now = Instant::now();
    let (parts, body) = req.into_parts();
    let _ = body.collect().await;
    let credential = ["authorization", "x-api-key", "api-key"]
        .iter()
        .find_map(|name| parts.headers.get(*name))
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    let (status, sent) = shared.decide(now, credential, parts.headers);
    let body = if status == 200 {
        "{\"ok\":true}"
    } else {
        "{\"error\":{\"type\":\"rate_limit_error\"}}"
    };
    let mut resp = Response::new(full(Bytes::from_static(body.as_bytes())));
    *resp.status_mut() = http::StatusCode::from_u16(status).unwrap();
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    for (name, value) in sent {
        resp.headers_mut().append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            http::HeaderValue::from_str(&value).unwrap(),
        );
    }
    Ok(resp)
}

// === header values ===

/// Whole seconds in `d`, rounded up.
pub fn ceil_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Whole milliseconds in `d`, rounded up.
pub fn ceil_millis(d: Duration) -> u64 {
    let ms = d.as_millis() as u64;
    ms + u64::from(!d.subsec_nanos().is_multiple_of(1_000_000))
}

/// `ms` milliseconds as Go's `time.Duration.String` writes them: `0s`, `87ms`, `1.234s`,
/// `6m0s`, `1h2m3.5s`.
pub fn go_duration_millis(ms: u64) -> String {
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m, s, frac) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if h > 0 || m > 0 {
        out.push_str(&format!("{m}m"));
    }
    out.push_str(&s.to_string());
    if frac > 0 {
        let digits = format!("{frac:03}");
        out.push('.');
        out.push_str(digits.trim_end_matches('0'));
    }
    out.push('s');
    out
}

/// `secs` since the Unix epoch as an RFC 3339 UTC time: `2026-11-27T23:10:05Z` (humantime's
/// writer: the sidecar reads these with a parser of its own).
pub fn rfc3339(secs: u64) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_secs(secs);
    humantime::format_rfc3339_seconds(at).to_string()
}
