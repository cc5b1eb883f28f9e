//! The access log's two limits (issue 41): it is set up at start, so a reload that changes it is
//! refused whole (README "Hot reload"); and its writer thread is fed through a bounded queue, so
//! a writer that blocks (a full pipe, a stuck disk) costs lines, each counted in
//! `egress_access_log_dropped_total`, never a request held.

mod support;

use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use support::{ChildSidecar, FakeUpstream, RawClient, TempDir};

/// Lines the writer thread's queue holds (`QUEUE_LINES` in src/access_log.rs).
const QUEUE_LINES: usize = 4096;

/// The writer takes lines off the queue into one write until the batch reaches this many
/// bytes (src/access_log.rs): a blocked write holds at most one such batch.
const BATCH_BYTES: usize = 64 * 1024;

/// README "Hot reload": `access_log` is set up at start, so a file that changes it is rejected
/// whole (the error names the key, counted as a failure) and the old config keeps serving: the
/// policy change in the same file is not applied either, and no access log line is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_turns_the_access_log_on_is_refused_whole() {
    let origin = FakeUpstream::start().await;
    let dir = TempDir::new();
    let log = dir.path.join("access.log");
    let upstreams = format!("upstreams:\n  - name: origin\n    url: http://{}\n", origin.addr);
    let sidecar = ChildSidecar::spawn(&upstreams).await;
    let access_log = format!("access_log: {{ enabled: true, path: {} }}\n", log.display());
    let deny = "policy: { deny_hosts: [\"127.0.0.1\"] }\n";
    sidecar.rewrite_config(&format!("{access_log}{deny}{upstreams}"));
    // SIGHUP: the file poller takes its baseline some time after start, and may miss an edit
    // made as soon as the sidecar listens.
    sidecar.signal("-HUP");
    let reloads = |m: &prometheus_parse::Scrape, result| {
        support::value(m, "egress_config_reloads_total", &[("result", result)])
    };
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(10), |m| {
        reloads(m, "failure") + reloads(m, "success") >= 1.0
    })
    .await;
    let last = support::value(&m, "egress_config_last_reload_successful", &[]);
    assert_eq!(
        (reloads(&m, "failure") >= 1.0, reloads(&m, "success"), last),
        (true, 0.0, 0.0),
        "(refused, times applied, last reload successful)"
    );
    let refused = sidecar.logged("reload rejected");
    assert!(
        refused.iter().any(|l| l.contains("access_log: changed")),
        "the error names access_log: {refused:?}"
    );

    let mut client = RawClient::connect(sidecar.addr).await;
    let resp = client.get(&format!("http://{}/after-reload", origin.addr)).await;
    assert_eq!(
        resp.status,
        200,
        "the refused file's deny_hosts was applied: {}",
        resp.text()
    );
    drop(client);
    assert!(
        downstream_gone(sidecar.admin).await,
        "the request's connection never ended"
    );
    // Validating the file creates the path, as `check` does (it is opened as the writer would
    // open it); nothing is written to it.
    let written = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(written, "", "a line written under a refused reload");
}

/// A writer blocked on a full pipe holds one batch in flight; the queue then fills, and every
/// later line is dropped and counted while requests are answered as ever: dropped = sent −
/// queue − in flight, and every line not dropped reaches the pipe once it drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_writer_drops_lines_past_its_queue_and_counts_each() {
    let dir = TempDir::new();
    let fifo = dir.path.join("access.fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success(), "mkfifo {}", fifo.display());
    // The test holds the read end and reads nothing: filled with newlines before the sidecar
    // starts, the pipe blocks the writer's first write.
    let mut reader = open_nonblocking(&fifo, false);
    fill(&mut open_nonblocking(&fifo, true));

    let origin = FakeUpstream::start().await;
    // A child process: were a request held by the log, the test's timeout still runs.
    let sidecar = ChildSidecar::spawn(&format!(
        "access_log: {{ enabled: true, format: json, path: {} }}\nupstreams:\n  - name: origin\n    url: http://{}\n",
        fifo.display(),
        origin.addr
    ))
    .await;
    let (clients, each) = (4, 1300);
    let sent = clients * each;
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (addr, url) = (sidecar.addr, format!("http://{}/x", origin.addr));
        tasks.push(tokio::spawn(async move {
            let mut client = RawClient::connect(addr).await;
            for _ in 0..each {
                let resp = tokio::time::timeout(Duration::from_secs(10), client.get(&url)).await;
                assert_eq!(resp.expect("a request held by the access log").status, 200);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    // Each line is queued when its response body ends: all are, once the connections are gone.
    assert!(
        downstream_gone(sidecar.admin).await,
        "the clients' connections never ended"
    );
    let m = support::scrape(sidecar.admin).await;
    let dropped = support::value(&m, "egress_access_log_dropped_total", &[]) as usize;

    let lines = drain(&mut reader, sent - dropped.min(sent)).await;
    let longest = lines.iter().map(String::len).max().unwrap_or(0);
    assert!(
        lines.len() > QUEUE_LINES && longest > 0,
        "{} lines reached the pipe for {sent} sent, {dropped} dropped",
        lines.len()
    );
    let in_flight = lines.len() - QUEUE_LINES;
    let shortest = lines.iter().map(|l| l.len() + 1).min().unwrap();
    println!(
        "sent {sent}, dropped {dropped}, in flight {in_flight} (lines of {shortest}..={} bytes)",
        longest + 1
    );
    assert!(
        in_flight <= BATCH_BYTES / shortest + 1,
        "{in_flight} lines past the queue's {QUEUE_LINES}: more than one blocked batch in flight, or a longer queue"
    );
    assert_eq!(
        dropped,
        sent - QUEUE_LINES - in_flight,
        "dropped = sent - queue - in flight"
    );
    let sidecar_lines = lines.iter().filter(|l| l.contains("\"/x\"")).count();
    assert_eq!(sidecar_lines, lines.len(), "every line read is a request's");
}

/// Opens the FIFO at `path` without blocking: for reading (any time), or for writing (once a
/// reader has it open).
fn open_nonblocking(path: &Path, write: bool) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(!write)
        .write(write)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .unwrap()
}

/// Writes newlines into `pipe` until it is full.
fn fill(pipe: &mut std::fs::File) {
    let newlines = [b'\n'; 4096];
    loop {
        match pipe.write(&newlines) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("filling the pipe: {e}"),
        }
    }
    // Writes of up to a page are all or nothing: the last bytes of room, one at a time.
    while pipe.write(b"\n").is_ok() {}
}

/// Reads the pipe until `want` non-empty lines came (or 30 s passed), then half a second more
/// in case more were to come; returns them.
async fn drain(reader: &mut std::fs::File, want: usize) -> Vec<String> {
    let started = Instant::now();
    let mut bytes = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let count = |bytes: &[u8]| bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()).count();
    let mut until = started + Duration::from_secs(30);
    let mut reached = false;
    while Instant::now() < until {
        match reader.read(&mut buf) {
            Ok(n) if n > 0 => bytes.extend_from_slice(&buf[..n]),
            Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(e) => panic!("reading the pipe: {e}"),
        }
        if !reached && count(&bytes) >= want {
            reached = true;
            until = Instant::now() + Duration::from_millis(500);
        }
    }
    String::from_utf8(bytes)
        .expect("UTF-8 lines")
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Whether the sidecar's downstream connections all ended within 5 s.
async fn downstream_gone(admin: std::net::SocketAddr) -> bool {
    let gone = |m: &prometheus_parse::Scrape| support::value(m, "egress_downstream_connections", &[]) == 0.0;
    gone(&support::scrape_until(admin, Duration::from_secs(5), gone).await)
}
