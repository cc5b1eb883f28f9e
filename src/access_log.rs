//! The access log: one line per request (JSON, or nginx's combined format with `key=value`
//! fields), to stdout or a file, written by a thread of its own through a bounded queue, so a
//! slow disk or a full pipe never holds a request: a line that finds the queue full is dropped
//! and counted (`egress_access_log_dropped_total`).
//!
//! What a line holds is fixed here ([`Record`]); credentials never reach it: no header value is
//! logged but the `traceparent` trace id and, in text lines, the `User-Agent`, the query
//! string only with `access_log.query: true`, and an authority without its userinfo (the
//! caller's to remove, with `crate::redact`).
//!
//! Whatever the bytes an application sends, a line stays one line whose fields are where a
//! parser looks for them: text fields are escaped as nginx escapes them (`"`, `\` and bytes
//! outside printable ASCII as `\xHH`), so a path or a `User-Agent` cannot close its quotes and
//! write fields of its own; JSON strings are escaped as JSON.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::time::SystemTime;

use prometheus_client::metrics::counter::Counter;

use crate::clients::Source;
use crate::config::{AccessLogConfig, AccessLogFormat};
use crate::rng::Xorshift;

/// Lines queued for the writer before new ones are dropped.
const QUEUE_LINES: usize = 4096;

/// One request, as its line shows it.
#[derive(Debug, Clone)]
pub struct Record {
    /// When the request head was read.
    pub time: SystemTime,
    /// The client.
    pub source: Option<Source>,
    /// Method.
    pub method: String,
    /// The upstream's scheme.
    pub scheme: &'static str,
    /// The host:port the request named.
    pub authority: String,
    /// Path, with the query when configured.
    pub path: String,
    /// What the application got.
    pub status: u16,
    /// The `x-egress-error` kind, for sidecar-made answers.
    pub error: Option<&'static str>,
    /// The upstream's label.
    pub upstream: Option<std::sync::Arc<str>>,
    /// The endpoint the request went to.
    pub endpoint: Option<SocketAddr>,
    /// Downstream protocol.
    pub protocol: &'static str,
    /// Upstream protocol.
    pub upstream_protocol: Option<&'static str>,
    /// Whether the upstream connection had served before.
    pub reused: bool,
    /// Times the request was sent again.
    pub retries: u32,
    /// Request body bytes from the application.
    pub bytes_in: u64,
    /// Response body bytes to the application.
    pub bytes_out: u64,
    /// Request head to response head, in milliseconds.
    pub ttfb_ms: f64,
    /// Request head to the body's end, in milliseconds.
    pub duration_ms: f64,
    /// From a valid `traceparent`.
    pub trace_id: Option<String>,
    /// `User-Agent` as sent (any bytes a field value may hold), for text lines.
    pub user_agent: Option<Box<[u8]>>,
    /// The model an LLM answer (or its request) named, as labelled (`llm`).
    pub model: Option<std::sync::Arc<str>>,
    /// Tokens an LLM answer reported: every prompt token, cached or not.
    pub input_tokens: Option<u64>,
    /// Tokens an LLM answer reported generating, reasoning included.
    pub output_tokens: Option<u64>,
    /// The part of `input_tokens` served from a prompt cache.
    pub cached_tokens: Option<u64>,
}

impl Record {
    /// A record of a request from `source` read at `time`, its outcome still blank.
    pub fn begin(
        time: SystemTime,
        source: Option<Source>,
        method: String,
        authority: String,
        path: String,
    ) -> Self {
        Record {
            time,
            source,
            method,
            scheme: "http",
            authority,
            path,
            status: 0,
            error: None,
            upstream: None,
            endpoint: None,
            protocol: "HTTP/1.1",
            upstream_protocol: None,
            reused: false,
            retries: 0,
            bytes_in: 0,
            bytes_out: 0,
            ttfb_ms: 0.0,
            duration_ms: 0.0,
            trace_id: None,
            user_agent: None,
            model: None,
            input_tokens: None,
            output_tokens: None,
            cached_tokens: None,
        }
    }
}

/// The access log's sending end.
#[derive(Debug)]
pub struct AccessLog {
    config: AccessLogConfig,
    tx: SyncSender<String>,
    dropped: Counter,
    rng: Xorshift,
}

impl AccessLog {
    /// Starts the writer for `config`; `None` when the log is off or its file cannot be
    /// opened (said once, at error level: `check` reports that before a start).
    pub fn start(config: &AccessLogConfig, dropped: Counter) -> Option<Self> {
        if !config.enabled || config.sample <= 0.0 {
            return None;
        }
        let mut out: Box<dyn std::io::Write + Send> = match &config.path {
            None => Box::new(std::io::stdout()),
            Some(path) => match std::fs::OpenOptions::new().create(true).append(true).open(path) {
                Ok(file) => Box::new(file),
                Err(e) => {
                    tracing::error!(path = %path.display(), "access log off: {e}");
                    return None;
                }
            },
        };
        let (tx, rx) = sync_channel::<String>(QUEUE_LINES);
        let spawned = std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || {
                let mut batch = Vec::with_capacity(64 * 1024);
                while let Ok(line) = rx.recv() {
                    batch.extend_from_slice(line.as_bytes());
                    // What else is queued goes in the same write.
                    while let Ok(line) = rx.try_recv() {
                        batch.extend_from_slice(line.as_bytes());
                        if batch.len() >= 64 * 1024 {
                            break;
                        }
                    }
                    if out.write_all(&batch).and_then(|()| out.flush()).is_err() {
                        // Nowhere to write; the queue drains into nothing.
                    }
                    batch.clear();
                }
            });
        if let Err(e) = spawned {
            tracing::error!("access log off: no writer thread: {e}");
            return None;
        }
        Some(AccessLog {
            config: config.clone(),
            tx,
            dropped,
            rng: Xorshift::seeded(std::process::id()),
        })
    }

    /// Whether this request is logged (`sample`).
    pub fn sampled(&self) -> bool {
        if self.config.sample >= 1.0 {
            return true;
        }
        self.rng.unit() < self.config.sample
    }

    /// Whether lines show the `User-Agent` (text lines do).
    pub fn wants_user_agent(&self) -> bool {
        self.config.format == AccessLogFormat::Text
    }

    /// Whether paths keep their query string.
    pub fn with_query(&self) -> bool {
        self.config.query
    }

    /// Queues `record`'s line; drops it (counted) when the writer is behind.
    pub fn write(&self, record: &Record) {
        let line = match self.config.format {
            AccessLogFormat::Json => json_line(record),
            AccessLogFormat::Text => text_line(record),
        };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(line) {
            self.dropped.inc();
        }
    }
}

/// The trace id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`), if valid.
pub fn trace_id(traceparent: &str) -> Option<String> {
    let mut parts = traceparent.trim().split('-');
    let (version, trace, parent, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && hex(flags, 2);
    valid.then(|| trace.to_owned())
}

/// One JSON object, written field by field: no `serde_json::Value` tree and no `fmt`
/// machinery per request (numbers, addresses and the time are written digit by digit; `fmt`
/// cost most of a line before).
fn json_line(r: &Record) -> String {
    let mut line = String::with_capacity(512);
    line.push_str("{\"time\":\"");
    push_time(&mut line, r.time);
    line.push('"');
    match &r.source {
        Some(Source::Tcp(addr)) => {
            line.push_str(",\"source\":\"");
            push_addr(&mut line, *addr);
            line.push_str("\",\"source_pid\":null,\"source_exe\":null");
        }
        Some(Source::Unix(process)) => {
            line.push_str(",\"source\":\"unix\",\"source_pid\":");
            match process.pid {
                Some(pid) => push_u64(&mut line, u64::from(pid)),
                None => line.push_str("null"),
            }
            line.push_str(",\"source_exe\":");
            json_opt_str(&mut line, process.exe.as_deref());
        }
        None => line.push_str(",\"source\":null,\"source_pid\":null,\"source_exe\":null"),
    }
    for (key, value) in [
        (",\"method\":", r.method.as_str()),
        (",\"scheme\":", r.scheme),
        (",\"authority\":", &r.authority),
        (",\"path\":", &r.path),
    ] {
        line.push_str(key);
        json_str(&mut line, value);
    }
    line.push_str(",\"status\":");
    push_u64(&mut line, u64::from(r.status));
    line.push_str(",\"error\":");
    json_opt_str(&mut line, r.error);
    line.push_str(",\"upstream\":");
    json_opt_str(&mut line, r.upstream.as_deref());
    match r.endpoint {
        Some(endpoint) => {
            line.push_str(",\"endpoint\":\"");
            push_addr(&mut line, endpoint);
            line.push('"');
        }
        None => line.push_str(",\"endpoint\":null"),
    }
    line.push_str(",\"protocol\":");
    json_str(&mut line, r.protocol);
    line.push_str(",\"upstream_protocol\":");
    json_opt_str(&mut line, r.upstream_protocol);
    line.push_str(if r.reused {
        ",\"reused\":true"
    } else {
        ",\"reused\":false"
    });
    for (key, value) in [
        (",\"retries\":", u64::from(r.retries)),
        (",\"bytes_in\":", r.bytes_in),
        (",\"bytes_out\":", r.bytes_out),
    ] {
        line.push_str(key);
        push_u64(&mut line, value);
    }
    line.push_str(",\"ttfb_ms\":");
    push_ms(&mut line, r.ttfb_ms);
    line.push_str(",\"duration_ms\":");
    push_ms(&mut line, r.duration_ms);
    line.push_str(",\"trace_id\":");
    json_opt_str(&mut line, r.trace_id.as_deref());
    // What an LLM answer spent, only when known: other lines keep their fields.
    if let Some(model) = &r.model {
        line.push_str(",\"model\":");
        json_str(&mut line, model);
    }
    for (key, value) in usage_fields(r) {
        line.push_str(",\"");
        line.push_str(key);
        line.push_str("\":");
        push_u64(&mut line, value);
    }
    line.push_str("}\n");
    line
}

/// The token counts a line shows, those known.
fn usage_fields(r: &Record) -> impl Iterator<Item = (&'static str, u64)> {
    [
        ("input_tokens", r.input_tokens),
        ("output_tokens", r.output_tokens),
        ("cached_tokens", r.cached_tokens),
    ]
    .into_iter()
    .filter_map(|(key, value)| Some((key, value?)))
}

fn push_u64(line: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    line.push_str(std::str::from_utf8(&digits[i..]).unwrap_or("0"));
}

/// `n` zero-padded to `width` digits.
fn push_padded(line: &mut String, n: u64, width: usize) {
    let mut digits = [b'0'; 20];
    let mut n = n;
    for slot in digits[20 - width..].iter_mut().rev() {
        *slot = b'0' + (n % 10) as u8;
        n /= 10;
    }
    line.push_str(std::str::from_utf8(&digits[20 - width..]).unwrap_or(""));
}

/// Milliseconds with three decimals, trailing zeros dropped (`1.25`, `2`).
fn push_ms(line: &mut String, ms: f64) {
    let micros = (ms.max(0.0) * 1000.0).round() as u64;
    push_u64(line, micros / 1000);
    let mut frac = micros % 1000;
    if frac == 0 {
        return;
    }
    let mut width = 3;
    while frac.is_multiple_of(10) {
        frac /= 10;
        width -= 1;
    }
    line.push('.');
    push_padded(line, frac, width);
}

fn push_addr(line: &mut String, addr: SocketAddr) {
    match addr {
        SocketAddr::V4(v4) => {
            for (i, octet) in v4.ip().octets().iter().enumerate() {
                if i > 0 {
                    line.push('.');
                }
                push_u64(line, u64::from(*octet));
            }
            line.push(':');
            push_u64(line, u64::from(v4.port()));
        }
        SocketAddr::V6(_) => {
            let _ = write!(line, "{addr}");
        }
    }
}

/// RFC 3339, UTC, milliseconds: `2026-11-24T08:53:14.123Z`.
fn push_time(line: &mut String, time: SystemTime) {
    let since = time.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    let of_day = secs % 86_400;
    push_padded(line, year as u64, 4);
    line.push('-');
    push_padded(line, u64::from(month), 2);
    line.push('-');
    push_padded(line, u64::from(day), 2);
    line.push('T');
    push_padded(line, of_day / 3600, 2);
    line.push(':');
    push_padded(line, of_day / 60 % 60, 2);
    line.push(':');
    push_padded(line, of_day % 60, 2);
    line.push('.');
    push_padded(line, u64::from(since.subsec_millis()), 3);
    line.push('Z');
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn json_opt_str(line: &mut String, value: Option<&str>) {
    match value {
        Some(value) => json_str(line, value),
        None => line.push_str("null"),
    }
}

/// A JSON string: quotes, backslashes and control characters escaped.
fn json_str(line: &mut String, value: &str) {
    line.push('"');
    if !value.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
        line.push_str(value);
        line.push('"');
        return;
    }
    for c in value.chars() {
        match c {
            '"' => line.push_str("\\\""),
            '\\' => line.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(line, "\\u{:04x}", c as u32);
            }
            c => line.push(c),
        }
    }
    line.push('"');
}

/// `127.0.0.1 - - [24/Nov/2026:08:53:14 +0000] "GET /path HTTP/1.1" 200 2 "-" "curl/8.0"`
/// then `key=value` fields, as nginx's combined format with upstream timings appended.
fn text_line(r: &Record) -> String {
    let mut line = String::with_capacity(256);
    match &r.source {
        Some(Source::Tcp(addr)) => {
            let _ = write!(line, "{}", addr.ip());
        }
        Some(Source::Unix(process)) => match process.pid {
            Some(pid) => {
                let _ = write!(line, "unix:{pid}");
            }
            None => line.push_str("unix"),
        },
        None => line.push('-'),
    }
    let _ = write!(line, " - - [{}] \"", clf_time(r.time));
    push_escaped(&mut line, r.method.as_bytes());
    line.push(' ');
    push_escaped(&mut line, r.path.as_bytes());
    let _ = write!(line, " {}\" {} {} \"-\" \"", r.protocol, r.status, r.bytes_out);
    push_escaped(&mut line, r.user_agent.as_deref().unwrap_or(b"-"));
    line.push_str("\" upstream=");
    push_escaped(&mut line, r.upstream.as_deref().unwrap_or("-").as_bytes());
    let _ = write!(
        line,
        " endpoint={} ttfb_ms={:.3} duration_ms={:.3} error={} retries={}",
        r.endpoint.map_or_else(|| "-".to_owned(), |e| e.to_string()),
        r.ttfb_ms,
        r.duration_ms,
        r.error.unwrap_or("-"),
        r.retries,
    );
    if let Some(model) = &r.model {
        line.push_str(" model=");
        push_escaped(&mut line, model.as_bytes());
    }
    for (key, value) in usage_fields(r) {
        let _ = write!(line, " {key}={value}");
    }
    line.push('\n');
    line
}

/// `bytes` as nginx writes a variable into a log line (`escape=default`): `"`, `\` and bytes
/// outside printable ASCII as `\xHH`, the rest as they are.
fn push_escaped(line: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let plain = |b: u8| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\';
    // The usual field, printable ASCII throughout, is copied whole.
    if bytes.iter().all(|&b| plain(b)) {
        if let Ok(text) = std::str::from_utf8(bytes) {
            line.push_str(text);
            return;
        }
    }
    for &b in bytes {
        if plain(b) {
            line.push(char::from(b));
        } else {
            line.push_str("\\x");
            line.push(char::from(HEX[usize::from(b >> 4)]));
            line.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }
}

/// `24/Nov/2026:08:53:14 +0000`, from the RFC 3339 form.
fn clf_time(time: SystemTime) -> String {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let text = humantime::format_rfc3339_seconds(time).to_string(); // 2026-11-24T08:53:14Z
    let month = text[5..7].parse::<usize>().unwrap_or(1).clamp(1, 12);
    format!(
        "{}/{}/{}:{} +0000",
        &text[8..10],
        MONTHS[month - 1],
        &text[0..4],
        &text[11..19]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        Record {
            time: SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_795_510_394_123),
            source: Some(Source::Tcp("127.0.0.1:40000".parse().unwrap())),
            method: "GET".into(),
            scheme: "http",
            authority: "api.example.com:80".into(),
            path: "/v1/x".into(),
            status: 200,
            error: None,
            upstream: Some("api".into()),
            endpoint: Some("10.0.0.1:80".parse().unwrap()),
            protocol: "HTTP/1.1",
            upstream_protocol: Some("HTTP/1.1"),
            reused: true,
            retries: 1,
            bytes_in: 0,
            bytes_out: 2,
            ttfb_ms: 1.25,
            duration_ms: 1.5,
            trace_id: None,
            user_agent: Some(b"curl/8.0"[..].into()),
            model: None,
            input_tokens: None,
            output_tokens: None,
            cached_tokens: None,
        }
    }

    #[test]
    fn times_and_numbers_written_by_hand_match_fmt() {
        for millis in [
            0u64,
            951_782_400_000,
            1_795_510_394_123,
            4_102_444_800_999,
            1_709_164_800_500,
        ] {
            let time = SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(millis);
            let mut line = String::new();
            push_time(&mut line, time);
            assert_eq!(line, humantime::format_rfc3339_millis(time).to_string());
        }
        for (ms, text) in [
            (1.25, "1.25"),
            (2.0, "2"),
            (0.0004, "0"),
            (12.3456, "12.346"),
            (0.05, "0.05"),
        ] {
            let mut line = String::new();
            push_ms(&mut line, ms);
            assert_eq!(line, text, "{ms}");
        }
        let mut line = String::new();
        push_addr(&mut line, "10.0.0.255:8080".parse().unwrap());
        assert_eq!(line, "10.0.0.255:8080");
    }

    #[test]
    fn json_strings_are_escaped() {
        let mut r = record();
        r.path = "/a\"b\\c\u{1}".into();
        let json: serde_json::Value = serde_json::from_str(&json_line(&r)).unwrap();
        assert_eq!(json["path"], "/a\"b\\c\u{1}");
    }

    #[test]
    fn json_and_text_lines() {
        let json: serde_json::Value = serde_json::from_str(&json_line(&record())).unwrap();
        assert_eq!(json["time"], "2026-11-24T08:53:14.123Z");
        assert_eq!(json["source"], "127.0.0.1:40000");
        assert_eq!(json["source_pid"], serde_json::Value::Null);
        assert_eq!(json["endpoint"], "10.0.0.1:80");
        assert_eq!(json["retries"], 1);
        assert_eq!(json.as_object().unwrap().len(), 21);
        assert_eq!(
            text_line(&record()),
            "127.0.0.1 - - [24/Nov/2026:08:53:14 +0000] \"GET /v1/x HTTP/1.1\" 200 2 \"-\" \"curl/8.0\" \
             upstream=api endpoint=10.0.0.1:80 ttfb_ms=1.250 duration_ms=1.500 error=- retries=1\n"
        );
    }

    #[test]
    fn an_llm_answers_line_shows_its_model_and_tokens() {
        let mut r = record();
        r.model = Some("gpt-4o-2024-08-06".into());
        (r.input_tokens, r.output_tokens, r.cached_tokens) = (Some(120), Some(42), Some(100));
        let json: serde_json::Value = serde_json::from_str(&json_line(&r)).unwrap();
        assert_eq!(json["model"], "gpt-4o-2024-08-06");
        assert_eq!(
            (
                &json["input_tokens"],
                &json["output_tokens"],
                &json["cached_tokens"]
            ),
            (&120.into(), &42.into(), &100.into())
        );
        assert_eq!(json.as_object().unwrap().len(), 25);
        assert!(
            text_line(&r).ends_with(
                " retries=1 model=gpt-4o-2024-08-06 input_tokens=120 output_tokens=42 cached_tokens=100\n"
            ),
            "{}",
            text_line(&r)
        );
        // A model without usage (an error answer): the model alone.
        (r.input_tokens, r.output_tokens, r.cached_tokens) = (None, None, None);
        let json: serde_json::Value = serde_json::from_str(&json_line(&r)).unwrap();
        assert!(json.get("input_tokens").is_none() && json["model"] == "gpt-4o-2024-08-06");
    }

    #[test]
    fn text_fields_are_escaped_as_nginx_escapes_them() {
        let mut r = record();
        r.path = "/q\"x\\y/caf\u{e9}%22".into();
        r.user_agent = Some(b"ua\" 200 \"forged\t\x80\xff\x7f"[..].into());
        let line = text_line(&r);
        assert!(
            line.contains(
                "\"GET /q\\x22x\\x5Cy/caf\\xC3\\xA9%22 HTTP/1.1\" 200 2 \"-\" \
                 \"ua\\x22 200 \\x22forged\\x09\\x80\\xFF\\x7F\" upstream=api "
            ),
            "{line}"
        );
        assert_eq!(line.matches('"').count(), 6, "{line}");
    }

    #[test]
    fn trace_ids_only_from_valid_traceparents() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        assert_eq!(
            trace_id(&format!("00-{id}-00f067aa0ba902b7-01")).as_deref(),
            Some(id)
        );
        assert_eq!(
            trace_id("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            None
        );
        assert_eq!(trace_id(&format!("00-{id}-00f067aa0ba902b7")), None);
        assert_eq!(trace_id("garbage"), None);
    }
}
