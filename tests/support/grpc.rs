//! A grpc-go health server (`tests/grpc`, `grpcleak server`) as a child process: its address,
//! and the counts it keeps (connections accepted and open, health RPCs served).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

/// What the server has counted: TCP connections accepted and still open, health RPCs served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub accepted: u64,
    pub open: u64,
    pub rpcs: u64,
}

/// `grpcleak server`: a grpc-go health server on 127.0.0.1:0 that answers "count" on stdin.
pub struct GrpcServer {
    pub addr: String,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    _child: Child,
}

impl GrpcServer {
    pub async fn start(bin: &Path) -> Self {
        let mut child = super::client_command(bin)
            .arg("server")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning the gRPC server");
        let stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = next_json(&mut lines, "the server's address").await;
        let addr = first["addr"].as_str().expect("an addr").to_owned();
        GrpcServer {
            addr,
            stdin,
            lines,
            _child: child,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.rsplit_once(':').unwrap().1.parse().unwrap()
    }

    pub async fn counts(&mut self) -> Counts {
        self.stdin.write_all(b"count\n").await.unwrap();
        self.stdin.flush().await.unwrap();
        let v = next_json(&mut self.lines, "the server's counts").await;
        let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"));
        Counts {
            accepted: n("accepted"),
            open: n("open"),
            rpcs: n("rpcs"),
        }
    }
}

async fn next_json(lines: &mut Lines<BufReader<ChildStdout>>, what: &str) -> Value {
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .unwrap_or_else(|_| panic!("no line with {what} within 10s"))
        .expect("reading the gRPC server's stdout")
        .unwrap_or_else(|| panic!("the gRPC server exited before printing {what}"));
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{what}: {line:?} is not JSON: {e}"))
}
