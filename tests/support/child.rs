//! The sidecar as a child process (the real binary), and what a test reads of it.

use super::*;

pub fn open_fds(sidecar: &ChildSidecar) -> usize {
    let pid = sidecar.child.id().expect("running");
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// Upstream connections (every pool, every state) and application connections open.
pub async fn connections(sidecar: &ChildSidecar) -> (f64, f64) {
    let scrape = scrape(sidecar.admin).await;
    (
        value(&scrape, "egress_upstream_connections", &[]),
        value(&scrape, "egress_downstream_connections", &[]),
    )
}

/// Waits (up to 10 s) until no connection is open either side and, when given, the fd count
/// is `expected`; returns (upstream connections, downstream connections, fds).
pub async fn settle(sidecar: &ChildSidecar, expected: Option<usize>) -> (f64, f64, usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (up, down) = connections(sidecar).await;
        let fds = open_fds(sidecar);
        let quiet = up == 0.0 && down == 0.0 && expected.is_none_or(|e| e == fds);
        if quiet || tokio::time::Instant::now() > deadline {
            return (up, down, fds);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// === the sidecar, as a child process ===

/// The `egress-sidecar` binary running with a config file; killed on drop.
pub struct ChildSidecar {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub child: tokio::process::Child,
    /// The config file it runs with.
    pub config_path: std::path::PathBuf,
    /// Every line it logged (JSON).
    pub logs: Arc<Mutex<Vec<String>>>,
    _dir: TempDir,
}

impl ChildSidecar {
    /// Starts the binary with `yaml` (listen/admin 127.0.0.1:0 prepended) and waits until it
    /// logs its addresses.
    pub async fn spawn(yaml: &str) -> Self {
        Self::spawn_with_env(yaml, &[]).await
    }

    /// Like [`ChildSidecar::spawn`], with extra environment variables.
    pub async fn spawn_with_env(yaml: &str, env: &[(&str, &str)]) -> Self {
        Self::spawn_command(yaml, env, None).await
    }

    /// Like [`ChildSidecar::spawn`], started inside the cgroup whose `cgroup.procs` file is
    /// `procs`: a shell joins it, then execs the sidecar, so that the sidecar reads that
    /// cgroup's limit at start.
    pub async fn spawn_in_cgroup(yaml: &str, procs: &std::path::Path) -> Self {
        Self::spawn_command(yaml, &[], Some(procs)).await
    }

    async fn spawn_command(yaml: &str, env: &[(&str, &str)], cgroup_procs: Option<&std::path::Path>) -> Self {
        use tokio::io::AsyncBufReadExt;
        let dir = TempDir::new();
        let path = dir.path.join("config.yaml");
        std::fs::write(&path, Self::config_text(yaml)).unwrap();
        let binary = env!("CARGO_BIN_EXE_egress-sidecar");
        let mut command = match cgroup_procs {
            None => tokio::process::Command::new(binary),
            Some(procs) => {
                let mut sh = tokio::process::Command::new("sh");
                sh.arg("-c")
                    .arg("echo $$ > \"$0\" && exec \"$@\"")
                    .arg(procs)
                    .arg(binary);
                sh
            }
        };
        // The sidecar reads HTTPS_PROXY and the like (`via: { url: env }`): it sees only those
        // the test gives it, never the test runner's own.
        for var in PROXY_ENV {
            command.env_remove(var);
        }
        let mut child = command
            .arg("run")
            .arg("--config")
            .arg(&path)
            .env("EGRESS_LOG_FORMAT", "json")
            .env("EGRESS_LOG", "info")
            .envs(env.iter().copied())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (addr, admin) = loop {
            let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
                .await
                .expect("sidecar started within 20s")
                .unwrap()
                .unwrap_or_else(|| {
                    let logged = logs.lock().unwrap().join("\n");
                    panic!("sidecar exited before listening; it logged:\n{logged}")
                });
            logs.lock().unwrap().push(line.clone());
            if line.contains("forward proxy listening") {
                break (json_field(&line, "listen"), json_field(&line, "admin"));
            }
        };
        // Keep draining stderr so the child never blocks on a full pipe.
        let kept = logs.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                kept.lock().unwrap().push(line);
            }
        });
        ChildSidecar {
            addr: addr.parse().unwrap(),
            admin: admin.parse().unwrap(),
            child,
            config_path: path,
            logs,
            _dir: dir,
        }
    }

    fn config_text(yaml: &str) -> String {
        format!("listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\n{yaml}")
    }

    /// Replaces the config file the way Kubernetes and most editors do: a new file renamed over
    /// the old one, so the sidecar never reads half of it.
    pub fn rewrite_config(&self, yaml: &str) {
        self.replace_config_file(&Self::config_text(yaml));
    }

    /// Like [`ChildSidecar::rewrite_config`], with the file's whole text (listeners included).
    pub fn replace_config_file(&self, text: &str) {
        let tmp = self.config_path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.config_path).unwrap();
    }

    /// Sends a signal (`-TERM`, `-HUP`, ...) with kill(1).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("running").to_string();
        let status = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Logged lines containing `text`.
    pub fn logged(&self, text: &str) -> Vec<String> {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(text))
            .cloned()
            .collect()
    }

    /// Waits for the process to exit (at most `within`) and asserts it exited 0.
    pub async fn assert_exits_ok_within(&mut self, within: Duration) {
        let status = tokio::time::timeout(within, self.child.wait())
            .await
            .expect("exited in time")
            .unwrap();
        assert!(status.success(), "exit status {status}");
    }

    /// A `/proc/PID/status` field in KiB (e.g. `VmRSS`, `VmHWM`).
    pub fn status_kib(&self, field: &str) -> u64 {
        let pid = self.child.id().expect("running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("{field} not in /proc/{pid}/status"))
    }
}

fn json_field(line: &str, name: &str) -> String {
    let key = format!("\"{name}\":\"");
    let start = line.find(&key).unwrap_or_else(|| panic!("{name} in {line}")) + key.len();
    let end = line[start..].find('"').unwrap() + start;
    line[start..end].to_owned()
}

/// A directory removed on drop.
pub struct TempDir {
    pub path: std::path::PathBuf,
}

impl TempDir {
    pub fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "egress-sidecar-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&path).unwrap();
        TempDir { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
