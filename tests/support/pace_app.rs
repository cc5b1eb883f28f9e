//! The Python application of the pacing tests (tests/pace/app.py, `requests`) run as child
//! processes that start sending together, and what they report: per request its status,
//! `x-egress-error`, `Retry-After`, limit headers and times.

use super::*;

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// Whether python3 with `requests` runs here; when not, the test is skipped (a failure under
/// CI, which installs it).
pub async fn python_requests_or_skip() -> bool {
    python_imports_or_skip("requests", "pip install requests").await
}

/// Whether python3 can import `modules` (`a, b`); when not, the test is skipped naming them
/// and `hint` (a failure under CI, whose .ci/run installs them).
pub async fn python_imports_or_skip(modules: &str, hint: &str) -> bool {
    let probe = client_command("python3")
        .args(["-c", &format!("import {modules}")])
        .output()
        .await;
    let ok = probe.as_ref().is_ok_and(|o| o.status.success());
    if !ok {
        let why = match probe {
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            Err(e) => e.to_string(),
        };
        skip(&format!("python3 cannot import {modules} ({why}); {hint}"));
    }
    ok
}

/// One request as an app saw it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct AppRequest {
    pub id: String,
    pub status: u16,
    pub error: Option<String>,
    pub retry_after: Option<String>,
    /// Seconds from the run's zero.
    pub start: f64,
    pub end: f64,
    /// The limit headers it was answered with (lower-case names).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

#[derive(Debug, serde::Deserialize)]
pub struct AppReport {
    pub requests: Vec<AppRequest>,
    /// How late the app started after the common start time, in seconds.
    pub late: f64,
}

/// What the apps of one run saw.
pub struct Run {
    pub apps: Vec<AppReport>,
}

impl Run {
    pub fn requests(&self) -> impl Iterator<Item = &AppRequest> {
        self.apps.iter().flat_map(|a| a.requests.iter())
    }

    pub fn count(&self, status: u16) -> usize {
        self.requests().filter(|r| r.status == status).count()
    }

    /// Requests by status, e.g. `{200: 180, 429: 20}` (0 for no response).
    pub fn statuses(&self) -> BTreeMap<u16, usize> {
        let mut by = BTreeMap::new();
        for r in self.requests() {
            *by.entry(r.status).or_insert(0) += 1;
        }
        by
    }

    /// From the first request's start to the last one's end, in seconds.
    pub fn run_time(&self) -> f64 {
        let first = self.requests().map(|r| r.start).fold(f64::INFINITY, f64::min);
        let last = self.requests().map(|r| r.end).fold(f64::NEG_INFINITY, f64::max);
        last - first
    }

    /// The latest start of an app after the common start time, in seconds.
    pub fn latest_app(&self) -> f64 {
        self.apps.iter().map(|a| a.late).fold(0.0, f64::max)
    }

    /// Up to 5 requests not answered 200, for failure messages.
    pub fn not_ok(&self) -> String {
        let bad: Vec<String> = self
            .requests()
            .filter(|r| r.status != 200)
            .take(5)
            .map(|r| {
                format!(
                    "{} {} error={:?} retry-after={:?} at {:.3}..{:.3} s",
                    r.id, r.status, r.error, r.retry_after, r.start, r.end
                )
            })
            .collect();
        if bad.is_empty() {
            "none".into()
        } else {
            bad.join("; ")
        }
    }
}

/// Where the apps send their requests.
pub struct Apps<'a> {
    pub url: String,
    /// The sidecar as their HTTP proxy; `None`: straight to the provider.
    pub proxy: Option<SocketAddr>,
    /// Header lines (`Name: value`) on every request.
    pub headers: &'a [&'a str],
    pub apps: usize,
    pub per_app: usize,
}

impl Apps<'_> {
    /// Runs the apps at once and collects what each printed (see [`Apps::start`]).
    pub async fn run(&self) -> Run {
        self.start(Duration::from_secs(2)).finish().await
    }

    /// Starts the apps; they send their first requests together `lead` from now (the
    /// interpreters' start-up is not part of the run). App `i` marks its requests
    /// `x-test-id: app{i}-{n}`.
    pub fn start(&self, lead: Duration) -> Started {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/pace/app.py");
        let now = SystemTime::now();
        let zero = now.duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
        let start_at = zero + lead.as_secs_f64();
        let mut running = Vec::new();
        for i in 0..self.apps {
            let mut cmd = client_command("python3");
            cmd.arg(script)
                .args(["--url", &self.url])
                .args(["--requests", &self.per_app.to_string()])
                .args(["--connections", "2"])
                .args(["--zero", &format!("{zero:.6}")])
                .args(["--start-at", &format!("{start_at:.6}")])
                .args(["--id", &format!("app{i}")]);
            for h in self.headers {
                cmd.args(["--header", h]);
            }
            if let Some(proxy) = self.proxy {
                cmd.args(["--proxy", &format!("http://{proxy}")]);
            }
            cmd.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            let child = cmd.spawn().expect("spawning python3");
            running.push(tokio::spawn(async move {
                tokio::time::timeout(Duration::from_secs(120), child.wait_with_output()).await
            }));
        }
        Started {
            running,
            start_at: tokio::time::Instant::now() + lead,
            per_app: self.per_app,
        }
    }
}

pub type AppOutput = Result<std::io::Result<std::process::Output>, tokio::time::error::Elapsed>;

/// Apps started by [`Apps::start`].
pub struct Started {
    pub running: Vec<tokio::task::JoinHandle<AppOutput>>,
    /// When they send their first requests.
    pub start_at: tokio::time::Instant,
    pub per_app: usize,
}

impl Started {
    /// Waits for every app to finish and collects what each printed.
    pub async fn finish(self) -> Run {
        let mut apps = Vec::new();
        for (i, task) in self.running.into_iter().enumerate() {
            let out = task
                .await
                .unwrap()
                .unwrap_or_else(|_| panic!("app{i} did not finish within 120 s"))
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "app{i} failed: {}\n{stderr}", out.status);
            let line = stdout.lines().last().unwrap_or("");
            let report: AppReport = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("app{i} printed no report ({e}): {stdout}\n{stderr}"));
            assert_eq!(report.requests.len(), self.per_app, "app{i}'s requests");
            apps.push(report);
        }
        Run { apps }
    }
}
