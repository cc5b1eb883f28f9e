//! Best-effort attribution of a loopback TCP source: when the leak detector flags 127.0.0.1,
//! the warning and `/debug/clients` name the processes holding its connections, found through
//! `/proc/net/tcp` and `/proc/PID/fd`. It needs the clients' pid namespace and permission to
//! read their fd tables; where the test cannot have those it says SKIPPED and why.

mod support;

use std::time::Duration;

use support::{ChildSidecar, FakeUpstream};

/// Why this machine cannot show attribution for `pid`, if it cannot.
fn proc_unreadable(pid: u32) -> Option<String> {
    if let Err(e) = std::fs::read_to_string("/proc/net/tcp") {
        return Some(format!("/proc/net/tcp is not readable: {e}"));
    }
    if let Err(e) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        return Some(format!(
            "/proc/{pid}/fd is not readable (needs root or the same uid): {e}"
        ));
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flagged_loopback_source_is_attributed_to_the_leaking_process() {
    let Some(leaky) = support::build_go("tests/leaky/main.go", "leaky").await else {
        support::skip("`go` is not on PATH");
        return;
    };
    let leaky = std::fs::canonicalize(leaky).unwrap();
    let upstream = FakeUpstream::start().await;
    // Short idle timeout: the first close, which lets the detector flag the source, comes soon.
    let sidecar = ChildSidecar::spawn("downstream: { idle_timeout: 2s }\n").await;

    // Leaks all along: 120 new connections a round, a round a second, until killed; each
    // connection stays open in the client until the sidecar closes it.
    let mut child = tokio::process::Command::new(&leaky)
        .args(["-n", "120", "-wait", "1s", "-rounds", "0", "-url"])
        .arg(format!("http://{}/", upstream.addr))
        .arg("-proxy")
        .arg(format!("http://{}", sidecar.addr))
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    if let Some(why) = proc_unreadable(pid) {
        support::skip(&why);
        let _ = child.kill().await;
        return;
    }

    let warned = support::eventually(Duration::from_secs(20), || {
        !sidecar.logged("likely builds").is_empty()
    })
    .await;
    let report = support::admin_get(sidecar.admin, "/debug/clients").await;
    let _ = child.kill().await;
    assert!(warned, "no leak warning within 20s");

    let report: Vec<serde_json::Value> = serde_json::from_slice(&report.body).unwrap();
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    let source = report
        .iter()
        .find(|r| r["source"] == "127.0.0.1")
        .expect("127.0.0.1 listed");
    assert_eq!(source["leaking"], true);
    let processes = source["processes"]
        .as_array()
        .expect("processes for a flagged loopback source");
    let first = &processes[0];
    assert_eq!(first["pid"], pid, "{processes:?}");
    assert_eq!(first["exe"], leaky.to_str().unwrap());
    assert!(first["connections"].as_u64().unwrap() >= 1);

    let warning = &sidecar.logged("likely builds")[0];
    let warning: serde_json::Value = serde_json::from_str(warning).unwrap();
    let processes = warning["fields"]["processes"].as_str().unwrap_or_default();
    let named = format!("pid {pid} ({})", leaky.display());
    assert!(processes.starts_with(&named), "{warning}");
    let message = warning["fields"]["message"].as_str().unwrap();
    assert!(message.contains(&named), "{message}");
}
