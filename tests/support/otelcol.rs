//! The trace tests' OTLP receiver: a real OpenTelemetry Collector (tests/otelcol: the core
//! collector with the OTLP receiver and contrib's file exporter) built once per test binary,
//! started on loopback, and what it received read back from its export file. Not the sidecar's
//! tracing, and not the tests of it (tests/traces.rs).
//!
//! A span is handed out as the collector wrote it (OTLP JSON: `traceId`, `spanId`,
//! `parentSpanId`, `name`, `kind`, `startTimeUnixNano`, `attributes`, `status`, ...) with two
//! keys added: `resource`, its resource's attribute list, and `scope`, its instrumentation
//! scope (`{"name": .., "version": ..}`). [`attribute`] and [`resource_attribute`] read a value
//! out of those lists as plain JSON; [`span_duration`] is its end less its start.

use super::*;

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde_json::Value;

/// The collector's Go module, relative to the crate root.
const MODULE: &str = "tests/otelcol";

/// What the collector logs once every receiver listens: a port clash makes it exit before.
const READY_LINE: &str = "Everything is ready";

/// An OpenTelemetry Collector on 127.0.0.1 receiving OTLP over HTTP (JSON or protobuf) and
/// writing every export to a file; killed on drop, its directory removed.
pub struct Collector {
    port: u16,
    child: tokio::process::Child,
    dir: TempDir,
}

impl Collector {
    /// Builds the collector (once per test binary) and starts it: `None` when `go` is not on
    /// PATH, after [`skip`] (which fails the test under CI=true).
    pub async fn start() -> Option<Collector> {
        let Some(bin) = collector_bin().await else {
            skip("`go` is not on PATH; the OpenTelemetry Collector (tests/otelcol) cannot be built");
            return None;
        };
        // The collector cannot take port 0 for its endpoint: a port free a moment ago, and
        // another when someone took it meanwhile.
        for _ in 0..10 {
            let dir = TempDir::new();
            let port = free_port();
            match spawn(&bin, dir, port).await {
                Ok(collector) => return Some(collector),
                Err(log) if log.to_ascii_lowercase().contains("address already in use") => {}
                Err(log) => panic!("the OpenTelemetry Collector did not start:\n{log}"),
            }
        }
        panic!("the OpenTelemetry Collector found no free port in 10 tries");
    }

    /// Its OTLP/HTTP base URL (`http://127.0.0.1:PORT`), for the sidecar's `tracing.otlp`:
    /// spans are posted to `<endpoint>/v1/traces`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every span the collector has written so far, in the order received (see the module
    /// doc for their shape). Written means flushed: up to `flush_interval` (100 ms) after the
    /// receiver answered.
    pub async fn spans(&self) -> Vec<Value> {
        let text = tokio::fs::read_to_string(self.export_file())
            .await
            .unwrap_or_default();
        // A flush can end inside a line; that export is read whole on a later call.
        let complete = text.rfind('\n').map_or("", |end| &text[..end]);
        complete
            .lines()
            .filter(|line| !line.trim().is_empty())
            .flat_map(|line| {
                let export: Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("the collector wrote a line that is no JSON ({e}): {line}"));
                flatten(export)
            })
            .collect()
    }

    /// [`Collector::spans`] once at least `n` have arrived, or whatever has when `timeout`
    /// runs out (the caller asserts the count, so more than `n` show too).
    pub async fn wait_for_spans(&self, n: usize, timeout: Duration) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let spans = self.spans().await;
            if spans.len() >= n || tokio::time::Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What the collector logged so far, for a failing test's message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path.join("collector.log")).unwrap_or_default()
    }

    /// Kills the collector, waits for it to exit and removes its directory.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }

    fn export_file(&self) -> PathBuf {
        self.dir.path.join("spans.jsonl")
    }
}

/// The value of the span attribute `key`, as plain JSON (see [`otlp_value`]); `None` when the
/// span has no such attribute.
pub fn attribute(span: &Value, key: &str) -> Option<Value> {
    find_attribute(&span["attributes"], key)
}

/// The value of the attribute `key` of the span's resource (`service.name`, say), as
/// [`attribute`] reads a span's.
pub fn resource_attribute(span: &Value, key: &str) -> Option<Value> {
    find_attribute(&span["resource"], key)
}

/// How long the span lasted: its `endTimeUnixNano` less its `startTimeUnixNano` (OTLP JSON
/// writes both as decimal strings).
pub fn span_duration(span: &Value) -> Duration {
    let nanos = |key: &str| -> u64 {
        let text = span[key]
            .as_str()
            .unwrap_or_else(|| panic!("span without {key}: {span}"));
        text.parse()
            .unwrap_or_else(|_| panic!("{key} {text:?} is no integer"))
    };
    let (start, end) = (nanos("startTimeUnixNano"), nanos("endTimeUnixNano"));
    assert!(end >= start, "a span that ends before it starts: {span}");
    Duration::from_nanos(end - start)
}

/// An OTLP JSON `AnyValue` as plain JSON: `{"stringValue": "a"}` is `"a"`, `{"intValue": "42"}`
/// (OTLP writes 64-bit integers as strings) is `42`, `{"doubleValue": 0.5}` is `0.5`,
/// `{"boolValue": true}` is `true`; arrays and key-value lists element by element; bytes stay
/// their base64 string. An empty value is `null`.
pub fn otlp_value(value: &Value) -> Value {
    let Some((kind, inner)) = value.as_object().and_then(|o| o.iter().next()) else {
        return Value::Null;
    };
    match kind.as_str() {
        "intValue" => match inner {
            Value::String(s) => Value::from(
                s.parse::<i64>()
                    .unwrap_or_else(|_| panic!("intValue {s:?} is no integer")),
            ),
            other => other.clone(),
        },
        // JSON cannot hold NaN or infinities: OTLP writes them as strings, kept so.
        "stringValue" | "boolValue" | "doubleValue" | "bytesValue" => inner.clone(),
        "arrayValue" => Value::Array(
            inner["values"]
                .as_array()
                .map(|values| values.iter().map(otlp_value).collect())
                .unwrap_or_default(),
        ),
        "kvlistValue" => Value::Object(
            inner["values"]
                .as_array()
                .map(|kvs| {
                    kvs.iter()
                        .map(|kv| {
                            (
                                kv["key"].as_str().unwrap_or_default().to_owned(),
                                otlp_value(&kv["value"]),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
        ),
        other => panic!("unknown OTLP value kind {other}: {value}"),
    }
}

/// An OTLP endpoint where nothing listens: a loopback port bound but not listening, held for
/// the rest of the test binary's run so no other test's server can take it (a connect gets
/// refused at once), for the "collector down" test.
pub fn stopped_endpoint() -> String {
    static HELD: Mutex<Vec<RefusingPort>> = Mutex::new(Vec::new());
    let port = RefusingPort::new();
    let endpoint = format!("http://{}", port.addr);
    HELD.lock().unwrap().push(port);
    endpoint
}

// === one export file line ===

/// The spans of one export (`{"resourceSpans": [...]}`), each with its `resource` attribute
/// list and its `scope` added.
fn flatten(export: Value) -> Vec<Value> {
    let mut spans = Vec::new();
    for resource_spans in as_array(&export["resourceSpans"]) {
        let resource = resource_spans["resource"]["attributes"].clone();
        for scope_spans in as_array(&resource_spans["scopeSpans"]) {
            let scope = scope_spans.get("scope").cloned().unwrap_or(Value::Null);
            for span in as_array(&scope_spans["spans"]) {
                let mut span = span.clone();
                let object = span.as_object_mut().expect("a span is a JSON object");
                object.insert("resource".into(), resource.clone());
                object.insert("scope".into(), scope.clone());
                spans.push(span);
            }
        }
    }
    spans
}

/// A JSON array's items; none when absent (OTLP JSON omits empty lists).
fn as_array(value: &Value) -> &[Value] {
    value.as_array().map_or(&[], Vec::as_slice)
}

fn find_attribute(list: &Value, key: &str) -> Option<Value> {
    as_array(list)
        .iter()
        .find(|kv| kv["key"] == key)
        .map(|kv| otlp_value(&kv["value"]))
}

// === building and starting ===

/// The collector's binary, built once per test binary into the cargo target tmpdir and kept
/// there, named by a hash of the module's files (an edit builds anew); `None` without `go`.
async fn collector_bin() -> Option<PathBuf> {
    static BUILT: tokio::sync::OnceCell<Option<PathBuf>> = tokio::sync::OnceCell::const_new();
    BUILT.get_or_init(build).await.clone()
}

async fn build() -> Option<PathBuf> {
    if !have_go().await {
        return None;
    }
    let module = Path::new(env!("CARGO_MANIFEST_DIR")).join(MODULE);
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for file in ["go.mod", "go.sum", "main.go"] {
        std::fs::read(module.join(file))
            .unwrap_or_else(|e| panic!("{MODULE}/{file}: {e}"))
            .hash(&mut hasher);
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("go-bin")
        .join(format!("otelcol-{:016x}", hasher.finish()));
    let bin = dir.join("otelcol");
    if bin.is_file() {
        return Some(bin);
    }
    // Built beside, then renamed in: another test binary reading the path never finds half a
    // file.
    std::fs::create_dir_all(&dir).unwrap();
    let staging = dir.join(format!("otelcol.{}", std::process::id()));
    let mut cmd = go_command(&module);
    cmd.args(["build", "-o"]).arg(&staging).arg(".");
    // Cold (nothing in the Go build cache) the compile takes about two minutes on two cores;
    // .ci/run warms the cache with the same flags, so there it only links.
    run_go(&mut cmd, &format!("go build {MODULE}"), Duration::from_secs(600)).await;
    std::fs::rename(&staging, &bin).unwrap();
    Some(bin)
}

/// The collector's config: the OTLP receiver over HTTP on 127.0.0.1:`port`, the file exporter
/// writing one JSON line per export, no processors.
fn config(port: u16, export_file: &Path) -> String {
    format!(
        "\
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{port}
exporters:
  file:
    path: {export}
    format: json
    flush_interval: 100ms
service:
  telemetry:
    # Its own metrics would listen on a fixed port (8888), which parallel tests share.
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [file]
",
        export = serde_json::to_string(&export_file.to_string_lossy()).unwrap(),
    )
}

/// Starts the collector in `dir` on `port` and waits (20 s at most) until it says it is ready
/// and its OTLP endpoint takes an empty export; its log when it exits first or never does.
async fn spawn(bin: &Path, dir: TempDir, port: u16) -> Result<Collector, String> {
    let config_path = dir.path.join("config.yaml");
    std::fs::write(&config_path, config(port, &dir.path.join("spans.jsonl"))).unwrap();
    let log_path = dir.path.join("collector.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let child = tokio::process::Command::new(bin)
        .arg("--config")
        .arg(format!("file:{}", config_path.display()))
        .current_dir(&dir.path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("starting the OpenTelemetry Collector");
    let mut collector = Collector { port, child, dir };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = collector.child.try_wait().unwrap() {
            return Err(format!("(exited: {status})\n{}", collector.log()));
        }
        // Ready is logged after the receiver bound its port, so the answer is ours.
        if collector.log().contains(READY_LINE) && post_empty_export(port).await == Some(200) {
            return Ok(collector);
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("(not ready in 20 s)\n{}", collector.log()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// POSTs `{}` (an export of no spans) to `/v1/traces`: the status, `None` when nothing answers.
async fn post_empty_export(port: u16) -> Option<u16> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let request = "POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                   Content-Length: 2\r\nConnection: close\r\n\r\n{}";
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut raw))
        .await
        .ok()?
        .ok()?;
    String::from_utf8_lossy(&raw).split(' ').nth(1)?.parse().ok()
}
