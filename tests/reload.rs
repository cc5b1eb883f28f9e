//! Hot reload of the real binary, by config-file change and by SIGHUP: pool limits change under
//! load without a failed request and without redialing, a broken file is rejected while the old
//! config keeps serving, and upstreams that leave the config (or change identity) drain.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::{debug_pool, eventually, scrape, value, ChildSidecar, FakeUpstream, RawClient};

fn pool_config(upstream: SocketAddr, max_connections: usize) -> String {
    format!(
        "upstreams:\n  - name: up\n    url: http://{upstream}\n    pool: {{ max_connections: {max_connections}, pending_timeout: 30s }}\n"
    )
}

async fn reloads(sidecar: &ChildSidecar, result: &str) -> f64 {
    value(
        &scrape(sidecar.admin).await,
        "egress_config_reloads_total",
        &[("result", result)],
    )
}

/// The log lines containing `text`, once there are at least `n`: the sidecar logs a reload
/// before counting it, but its stderr is read by another thread.
async fn logged(sidecar: &ChildSidecar, text: &str, n: usize) -> Vec<String> {
    eventually(Duration::from_secs(2), || sidecar.logged(text).len() >= n).await;
    sidecar.logged(text)
}

/// Waits (up to 5 s) until the sidecar has counted `n` reloads with `result`.
async fn wait_for_reloads(sidecar: &ChildSidecar, result: &str, n: f64) {
    for _ in 0..100 {
        if reloads(sidecar, result).await >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no {result} reload #{n}; logs: {:?}", sidecar.logged("reload"));
}

/// Application load: `workers` keep-alive clients sending `/sleep/20` until stopped; counts
/// answers by status.
struct Load {
    ok: Arc<AtomicUsize>,
    failed: Arc<std::sync::Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(sidecar: SocketAddr, upstream: SocketAddr, workers: usize) -> Self {
        let ok = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..workers)
            .map(|_| {
                let (ok, failed, stop) = (ok.clone(), failed.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut client = RawClient::connect(sidecar).await;
                    while !stop.load(Ordering::Relaxed) {
                        let resp = client.get(&format!("http://{upstream}/sleep/20")).await;
                        if resp.status == 200 {
                            ok.fetch_add(1, Ordering::Relaxed);
                        } else {
                            failed
                                .lock()
                                .unwrap()
                                .push(format!("{} {}", resp.status, resp.text()));
                        }
                    }
                })
            })
            .collect();
        Load {
            ok,
            failed,
            stop,
            tasks,
        }
    }

    async fn finish(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("a load worker panicked");
        }
        let failed = self.failed.lock().unwrap().clone();
        (self.ok.load(Ordering::Relaxed), failed)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_limits_change_under_load_without_a_failed_request_or_a_redial() {
    let upstream = FakeUpstream::start().await;
    let sidecar = ChildSidecar::spawn(&pool_config(upstream.addr, 2)).await;
    let load = Load::start(sidecar.addr, upstream.addr, 12);
    assert!(eventually(Duration::from_secs(5), || upstream.requests() >= 50).await);
    assert_eq!(upstream.peak(), 2, "the first limit holds");

    // Raise the cap by editing the file: the queue drains onto new connections.
    sidecar.rewrite_config(&pool_config(upstream.addr, 6));
    wait_for_reloads(&sidecar, "success", 1.0).await;
    assert!(
        eventually(Duration::from_secs(5), || upstream.open() == 6).await,
        "open upstream connections: {}",
        upstream.open()
    );
    assert_eq!(debug_pool(sidecar.admin, "up").await["max_connections"], 6);

    // Lower it with SIGHUP: connections over the cap close as they free up; none is redialed.
    sidecar.rewrite_config(&pool_config(upstream.addr, 3));
    sidecar.signal("-HUP");
    wait_for_reloads(&sidecar, "success", 2.0).await;
    assert!(
        eventually(Duration::from_secs(5), || upstream.open() == 3).await,
        "open upstream connections: {}",
        upstream.open()
    );
    let before = upstream.requests();
    assert!(eventually(Duration::from_secs(5), || upstream.requests() >= before + 50).await);
    assert!(upstream.open() <= 3);

    let (ok, failed) = load.finish().await;
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(ok > 150, "{ok} requests");
    assert_eq!(
        upstream.accepted(),
        6,
        "connections were kept across both reloads, never redialed"
    );
    let m = scrape(sidecar.admin).await;
    assert_eq!(
        value(
            &m,
            "egress_upstream_connections_closed_total",
            &[("upstream", "up"), ("reason", "reload")]
        ),
        3.0
    );
    assert_eq!(value(&m, "egress_config_last_reload_successful", &[]), 1.0);
    println!("{ok} requests, 0 failed, across two reloads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_config_is_rejected_and_the_old_one_keeps_serving() {
    let upstream = FakeUpstream::start().await;
    let sidecar = ChildSidecar::spawn(&pool_config(upstream.addr, 2)).await;
    let load = Load::start(sidecar.addr, upstream.addr, 4);
    assert!(eventually(Duration::from_secs(5), || upstream.requests() >= 20).await);

    sidecar.rewrite_config(&format!(
        "upstreams:\n  - name: up\n    url: http://{}\n    pool: {{ max_connections: lots }}\n",
        upstream.addr
    ));
    wait_for_reloads(&sidecar, "failure", 1.0).await;
    let rejected = logged(&sidecar, "config reload rejected", 1).await;
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert!(
        rejected[0].contains("upstreams[0].pool.max_connections"),
        "names the key: {}",
        rejected[0]
    );
    assert!(rejected[0].contains("\"level\":\"ERROR\""), "{}", rejected[0]);
    assert_eq!(
        value(
            &scrape(sidecar.admin).await,
            "egress_config_last_reload_successful",
            &[]
        ),
        0.0
    );

    // Moving a listening socket is refused too, naming the key.
    sidecar.replace_config_file(&format!(
        "listen: 127.0.0.1:1\nadmin: 127.0.0.1:0\n{}",
        pool_config(upstream.addr, 2)
    ));
    wait_for_reloads(&sidecar, "failure", 2.0).await;
    let rejected = logged(&sidecar, "config reload rejected", 2).await;
    assert!(rejected[1].contains("listen: changed"), "{}", rejected[1]);

    // Still serving, with the old limit.
    let before = upstream.requests();
    assert!(eventually(Duration::from_secs(5), || upstream.requests() >= before + 20).await);
    assert_eq!(debug_pool(sidecar.admin, "up").await["max_connections"], 2);
    let (ok, failed) = load.finish().await;
    assert!(failed.is_empty(), "{failed:?}");
    assert!(ok > 0);
    assert_eq!(upstream.peak(), 2);

    // A fixed file is applied.
    sidecar.rewrite_config(&pool_config(upstream.addr, 5));
    wait_for_reloads(&sidecar, "success", 1.0).await;
    assert_eq!(debug_pool(sidecar.admin, "up").await["max_connections"], 5);
    assert_eq!(
        value(
            &scrape(sidecar.admin).await,
            "egress_config_last_reload_successful",
            &[]
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_and_changed_upstreams_drain_their_pools() {
    let a = FakeUpstream::start().await;
    let b = FakeUpstream::start().await;
    let two = format!(
        "upstreams:\n  - name: a\n    url: http://{}\n  - name: b\n    url: http://{}\n",
        a.addr, b.addr
    );
    let sidecar = ChildSidecar::spawn(&two).await;
    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(client.get(&format!("http://{}/", a.addr)).await.status, 200);
    assert_eq!(client.get(&format!("http://{}/", b.addr)).await.status, 200);
    // A slow request holds a's connection through the reload.
    let (addr, a_addr) = (sidecar.addr, a.addr);
    let slow = tokio::spawn(async move {
        RawClient::connect(addr)
            .await
            .get(&format!("http://{a_addr}/sleep/3000"))
            .await
    });
    assert!(eventually(Duration::from_secs(3), || a.requests() == 2).await);
    assert_eq!((a.open(), b.open()), (1, 1));

    // b leaves; a's connect_timeout changes, which is part of its pool's identity.
    sidecar.rewrite_config(&format!(
        "upstreams:\n  - name: a\n    url: http://{}\n    connect_timeout: 2s\n",
        a.addr
    ));
    wait_for_reloads(&sidecar, "success", 1.0).await;
    assert!(
        eventually(Duration::from_secs(3), || b.open() == 0).await,
        "b's idle connection closed"
    );
    assert_eq!(a.open(), 1, "a's busy connection lives until its exchange ends");
    assert_eq!(slow.await.unwrap().status, 200, "the in-flight request completed");
    assert!(
        eventually(Duration::from_secs(3), || a.open() == 0).await,
        "then it closed instead of going back to a drained pool"
    );
    assert_eq!(client.get(&format!("http://{}/", a.addr)).await.status, 200);
    assert_eq!(a.accepted(), 2, "the new pool dialed afresh");
    let m = scrape(sidecar.admin).await;
    for label in ["a", "b"] {
        assert_eq!(
            value(
                &m,
                "egress_upstream_connections_closed_total",
                &[("upstream", label), ("reason", "reload")]
            ),
            1.0,
            "{label}"
        );
    }
    let reloaded = logged(&sidecar, "config reloaded", 1).await;
    assert!(
        reloaded[0].contains("\"replaced\":1") && reloaded[0].contains("\"removed\":1"),
        "{reloaded:?}"
    );
}

#[tokio::test]
async fn sighup_reloads_the_file() {
    let upstream = FakeUpstream::start().await;
    let sidecar = ChildSidecar::spawn(&pool_config(upstream.addr, 2)).await;
    sidecar.signal("-HUP");
    wait_for_reloads(&sidecar, "success", 1.0).await;
    assert_eq!(logged(&sidecar, "\"trigger\":\"SIGHUP\"", 1).await.len(), 1);
    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(
        client.get(&format!("http://{}/", upstream.addr)).await.status,
        200
    );
}

/// `global_rate_limit` changes on reload, without a restart: added (a service that does not
/// answer, under `failure_mode: deny`, refuses every request), relaxed to `allow` (they go),
/// and removed (no call at all).
#[tokio::test]
async fn the_fleet_quota_section_changes_on_reload() {
    let upstream = FakeUpstream::start().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let quota = |mode: &str| {
        format!(
            "upstreams:\n  - name: up\n    url: http://{}\n    global_rate_limit:\n      service: http://127.0.0.1:{closed}\n      domain: egress\n      failure_mode: {mode}\n      descriptors: [[{{ key: upstream }}]]\n",
            upstream.addr
        )
    };
    let calls = |scrape: &prometheus_parse::Scrape| -> f64 {
        scrape
            .samples
            .iter()
            .filter(|s| {
                s.metric == "egress_global_rate_limit_calls_total" && s.labels.get("upstream") == Some("up")
            })
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                _ => 0.0,
            })
            .sum()
    };
    let sidecar = ChildSidecar::spawn(&pool_config(upstream.addr, 2)).await;
    let url = format!("http://{}/", upstream.addr);
    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(client.get(&url).await.status, 200);

    sidecar.rewrite_config(&quota("deny"));
    wait_for_reloads(&sidecar, "success", 1.0).await;
    let before = upstream.requests();
    let refused = client.get(&url).await;
    refused.assert_sidecar_error(503, "rate_limit_unavailable", "failure_mode is deny");
    assert_eq!(upstream.requests(), before, "nothing went upstream");

    sidecar.rewrite_config(&quota("allow"));
    wait_for_reloads(&sidecar, "success", 2.0).await;
    assert_eq!(client.get(&url).await.status, 200);
    let asked = calls(&scrape(sidecar.admin).await);
    assert_eq!(asked, 2.0, "one failed call each");

    sidecar.rewrite_config(&pool_config(upstream.addr, 2));
    wait_for_reloads(&sidecar, "success", 3.0).await;
    assert_eq!(client.get(&url).await.status, 200);
    assert_eq!(calls(&scrape(sidecar.admin).await), asked, "removed: no call");

    // `check` names the key of a bad value, as a reload does.
    sidecar.rewrite_config(&quota("sometimes"));
    wait_for_reloads(&sidecar, "failure", 1.0).await;
    let rejected = logged(&sidecar, "config reload rejected", 1).await;
    assert!(
        rejected[0].contains("upstreams[0].global_rate_limit.failure_mode"),
        "{}",
        rejected[0]
    );
}
