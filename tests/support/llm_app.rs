//! The token-accounting tests' Python application (tests/llm/app.py: the `openai` and
//! `anthropic` SDKs, httpx2 for Gemini) as a child process: where it connects, the calls it
//! makes, and what it printed it received.

use super::llm_provider::Spend;
use super::*;

/// Whether python3 with the pinned SDKs runs here; when not, the test is skipped (a failure
/// under CI, whose .ci/run installs tests/llm/requirements.txt).
pub async fn sdks_or_skip() -> bool {
    super::pace_app::python_imports_or_skip(
        "openai, anthropic, httpx2",
        "pip install -r tests/llm/requirements.txt",
    )
    .await
}

/// The file name of the executable behind `python3` (pyenv and distro shims exec it): what
/// the sidecar names a Unix-socket client by (e.g. `python3.11`).
pub async fn python_exe_name() -> String {
    let out = client_command("python3")
        .args([
            "-c",
            "import os, sys; print(os.path.basename(os.path.realpath(sys.executable)))",
        ])
        .output()
        .await
        .expect("python3 runs");
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// One call of the app's plan.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Call {
    /// Its `x-test-id`.
    pub id: String,
    /// `chat_json`, `chat_stream`, `chat_stream_no_usage`, `responses_json`,
    /// `responses_stream`, `messages_json`, `messages_stream`, `gemini_json`, `gemini_stream`.
    pub kind: &'static str,
    /// The model the request names.
    pub model: String,
}

/// What the app received for one call.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Received {
    pub id: String,
    pub status: u16,
    /// Of the raw body bytes, as the SDK read them.
    pub sha256: String,
    pub bytes: usize,
    /// The answer's model, as the SDK parsed it.
    pub model: String,
    /// The usage the SDK parsed, in the sidecar's terms (none: a stream without usage).
    pub spend: Option<Spend>,
}

/// Where the app reaches the APIs.
pub enum Via {
    /// The sidecar's route listeners for the openai, anthropic and gemini upstreams.
    Routes([SocketAddr; 3]),
    /// The sidecar's Unix socket; the requests name the API hosts in `Host`.
    Unix(std::path::PathBuf),
}

/// Runs the app's `plan` through `via`, sending `x-egress-app: app` when given; returns what it
/// printed for each call, in order.
pub async fn run_app(via: &Via, app: Option<&str>, plan: &[Call]) -> Vec<Received> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/llm/app.py");
    let mut cmd = client_command("python3");
    cmd.arg(script);
    match via {
        Via::Routes([openai, anthropic, gemini]) => {
            cmd.args(["--openai", &format!("http://{openai}/v1")])
                .args(["--anthropic", &format!("http://{anthropic}")])
                .args(["--gemini", &format!("http://{gemini}")]);
        }
        Via::Unix(path) => {
            cmd.args(["--openai", "http://api.openai.com/v1"])
                .args(["--anthropic", "http://api.anthropic.com"])
                .args(["--gemini", "http://generativelanguage.googleapis.com"])
                .arg("--uds")
                .arg(path);
        }
    }
    if let Some(app) = app {
        cmd.args(["--app", app]);
    }
    cmd.args(["--plan", &serde_json::to_string(plan).unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the app finished within 60 s")
        .expect("spawning python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "app {app:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let got: Vec<Received> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("app printed {l:?}: {e}")))
        .collect();
    assert_eq!(got.len(), plan.len(), "one line per call: {stdout}\n{stderr}");
    got
}
