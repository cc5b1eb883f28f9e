//! A client run as a child process that prints one JSON line per phase (the Go leaky client,
//! the Node one): its stdout read line by line, its stderr shown in every failure, its stdin
//! kept open for as long as the test wants it alive.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

pub struct LineClient {
    /// Names the client in failures.
    name: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
}

impl LineClient {
    /// Spawns `cmd` (a `client_command`) with stdout and stderr piped, and stdin too when
    /// `keep_stdin` (the client then lives until [`LineClient::finish`] closes it).
    pub fn spawn(mut cmd: Command, name: &'static str, keep_stdin: bool) -> Self {
        if keep_stdin {
            cmd.stdin(Stdio::piped());
        }
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawning the {name}: {e}"));
        let stdout = child.stdout.take().unwrap();
        LineClient {
            name,
            stdin: child.stdin.take(),
            child,
            lines: BufReader::new(stdout).lines(),
        }
    }

    /// The next line, which should be `phase`'s, within `within`; panics with the client's
    /// stderr when it exits first.
    pub async fn next_line(&mut self, phase: &str, within: Duration) -> String {
        let name = self.name;
        let line = tokio::time::timeout(within, self.lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("no {phase:?} line from the {name} within {within:?}"))
            .unwrap_or_else(|e| panic!("reading the {name}'s stdout: {e}"));
        match line {
            Some(line) => line,
            None => {
                let stderr = self.stderr().await;
                panic!("the {name} exited before {phase:?}; stderr:\n{stderr}");
            }
        }
    }

    /// The client's stdin (spawned with `keep_stdin`).
    pub fn stdin(&mut self) -> &mut ChildStdin {
        self.stdin.as_mut().expect("stdin kept open")
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    pub async fn stderr(&mut self) -> String {
        let mut text = String::new();
        if let Some(mut err) = self.child.stderr.take() {
            let _ = err.read_to_string(&mut text).await;
        }
        text
    }

    /// Closes stdin and waits for a clean exit.
    pub async fn finish(mut self) {
        drop(self.stdin.take());
        let name = self.name;
        let status = tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("the {name} did not exit"))
            .unwrap();
        let stderr = self.stderr().await;
        assert!(status.success(), "the {name} failed: {status}\n{stderr}");
    }
}
