//! The memory budget under a leak storm: the seeds' leaky Go client (`tests/leaky/main.go`, a new
//! `http.Transport` per request) opens 20,000 connections through the sidecar and never closes
//! one. Idle timeouts are set to minutes and `max_idle_connections` out of reach, so only the
//! budget can stop those connections from piling up. Meanwhile well-behaved clients keep
//! requests in flight; none of them may fail.
//!
//! Two budgets: an explicit `budget.memory_bytes`, metered by a limit-less memory cgroup, and 80%
//! of a real cgroup's memory limit. The headline is what the kernel charged the sidecar, sockets
//! included, which RSS leaves out; sheds are counted from the client's side and checked against
//! the sidecar's metric. The cgroups need root and a memory controller: locally their absence
//! skips, under `CI=true` it fails.

mod support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{ChildSidecar, FakeUpstream, RawClient};

const STORM: usize = 20_000;

/// Long idle timeouts and room for every connection: nothing but the budget sheds.
const NO_OTHER_LIMITS: &str = "downstream: { idle_timeout: 300s, leaky_idle_timeout: 300s, \
    max_idle_connections: 100000, max_connections: 100000 }\n";

/// Well-behaved clients keeping slow requests in flight until `stop`.
struct InFlight {
    ok: Arc<AtomicUsize>,
    failed: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl InFlight {
    /// `clients` keep-alive connections, each sending GET /sleep/150 back to back.
    fn start(sidecar: std::net::SocketAddr, upstream: std::net::SocketAddr, clients: usize) -> Self {
        let ok = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let url = format!("http://{upstream}/sleep/150");
        let tasks = (0..clients)
            .map(|_| {
                let (ok, failed, stop, url) = (ok.clone(), failed.clone(), stop.clone(), url.clone());
                tokio::spawn(async move {
                    let mut client = RawClient::connect(sidecar).await;
                    while !stop.load(Ordering::Relaxed) {
                        let resp = client.get(&url).await;
                        if resp.status == 200 && resp.body == b"ok" {
                            ok.fetch_add(1, Ordering::Relaxed);
                        } else {
                            failed
                                .lock()
                                .unwrap()
                                .push(format!("{} {:?}", resp.status, resp.text()));
                            return;
                        }
                    }
                })
            })
            .collect();
        InFlight {
            ok,
            failed,
            stop,
            tasks,
        }
    }

    /// Stops the clients; returns how many requests succeeded, asserting none failed.
    async fn finish(self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await
                .expect("an in-flight client panicked (its request failed)");
        }
        let failed = self.failed.lock().unwrap().clone();
        assert!(failed.is_empty(), "in-flight requests failed: {failed:?}");
        self.ok.load(Ordering::Relaxed)
    }
}

/// What the leaky client reported.
struct Leaked {
    ok: u64,
    errors: u64,
    /// Its connections the sidecar closed: `STORM` opened, less those still open a second
    /// after the last request (its own sockets, less the ones it had before any request).
    closed_by_sidecar: i64,
}

/// Runs the leaky client for `STORM` requests through the sidecar.
async fn leak_storm(leaky: &Path, sidecar: &ChildSidecar, upstream: std::net::SocketAddr) -> Leaked {
    let out = tokio::process::Command::new(leaky)
        .args(["-n", &STORM.to_string(), "-wait", "1s"])
        .args(["-url", &format!("http://{upstream}/")])
        .args(["-proxy", &format!("http://{}", sidecar.addr)])
        .env_remove("HTTP_PROXY")
        .env_remove("http_proxy")
        .kill_on_drop(true)
        .output()
        .await
        .expect("running the leaky client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "leaky client failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let phase = |name: &str| -> serde_json::Value {
        stdout
            .lines()
            .find(|l| l.contains(&format!("\"{name}\"")))
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("no {name} line in {stdout}"))
    };
    let (baseline, done) = (phase("baseline"), phase("after_wait"));
    let sockets = |v: &serde_json::Value| v["sockets"].as_i64().expect("a socket count");
    Leaked {
        ok: done["ok"].as_u64().unwrap(),
        errors: done["errors"].as_u64().unwrap(),
        // The second of `-wait` lets the client's read loops notice the last closes. Idle
        // timeouts are at 300 s and connection limits out of reach: nothing else closes them.
        closed_by_sidecar: STORM as i64 - (sockets(&done) - sockets(&baseline)),
    }
}

async fn budget_report(sidecar: &ChildSidecar) -> serde_json::Value {
    let resp = support::admin_get(sidecar.admin, "/debug/pools").await;
    let pools: serde_json::Value = serde_json::from_slice(&resp.body).expect("JSON");
    pools["budget"].clone()
}

/// What a storm run saw.
struct Storm {
    in_flight_ok: usize,
    /// Leaky connections the client saw closed.
    client_saw_shed: i64,
    /// What the sidecar counted as shed (`egress_memory_sheds_total{action="downstream_idle"}`).
    counted_shed: f64,
    /// The most sockets the sidecar's process held at once, sampled from `/proc/PID/fd`.
    sockets_peak: usize,
}

/// Sockets among the open file descriptors of `pid` (0 once it is gone).
fn open_sockets(pid: u32) -> usize {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().starts_with("socket:"))
        .count()
}

/// The storm with in-flight clients alongside; asserts every request of both succeeded.
async fn storm_with_requests_in_flight(
    leaky: &Path,
    sidecar: &ChildSidecar,
    upstream: &FakeUpstream,
) -> Storm {
    let in_flight = InFlight::start(sidecar.addr, upstream.addr, 4);
    let watching = Arc::new(AtomicBool::new(true));
    let pid = sidecar.child.id().expect("running");
    let peak = tokio::spawn({
        let watching = watching.clone();
        async move {
            let mut peak = 0;
            while watching.load(Ordering::Relaxed) {
                peak = peak.max(open_sockets(pid));
                // A sampling interval, not synchronisation: the peak may fall between samples,
                // and the cgroup's charged peak (where there is one) misses nothing.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            peak
        }
    });
    let leaked = leak_storm(leaky, sidecar, upstream.addr).await;
    watching.store(false, Ordering::Relaxed);
    let in_flight_ok = in_flight.finish().await;
    assert_eq!(
        (leaked.ok, leaked.errors),
        (STORM as u64, 0),
        "every leaky request got its 200"
    );
    assert!(
        in_flight_ok > 0,
        "the well-behaved clients made requests during the storm"
    );
    let scrape = support::scrape(sidecar.admin).await;
    Storm {
        in_flight_ok,
        client_saw_shed: leaked.closed_by_sidecar,
        counted_shed: support::value(
            &scrape,
            "egress_memory_sheds_total",
            &[("action", "downstream_idle")],
        ),
        sockets_peak: peak.await.unwrap(),
    }
}

/// The sheds the client saw against the sidecar's count, and enough of them to matter.
fn assert_sheds_seen_and_counted(storm: &Storm) {
    // 20,000 sockets alone are ~29 MiB of kernel memory, over either budget: most had to go.
    assert!(
        storm.client_saw_shed >= (STORM / 2) as i64,
        "the leaky client saw only {} of its {STORM} connections closed",
        storm.client_saw_shed
    );
    // They differ by closes the client had not yet read a second after its last request, and
    // by sheds between its last count and the scrape: a handful at most.
    assert!(
        (storm.client_saw_shed as f64 - storm.counted_shed).abs() <= SHED_COUNT_SLACK,
        "the client saw {} connections closed, the sidecar counted {} shed",
        storm.client_saw_shed,
        storm.counted_shed
    );
    assert!(
        storm.sockets_peak < STORM / 2,
        "the sidecar held {} sockets at once",
        storm.sockets_peak
    );
}

/// Holds the other tests of this file off until it is dropped. Each measures a peak of memory
/// that the sidecar keeps by measuring and shedding in time; two storms at once (40,000
/// connections and two Go clients on two cores) delay both sidecars' measurements and the
/// clients' closes alike, and so move each other's peaks: the cgroup storm, run beside the
/// others, held 18.4-21.3 MB against its 20.1 MB budget in three runs (2026-12-02), and
/// 18.4 MB alone beside two busy loops (three runs).
/// (A test that fails holding it releases it as it unwinds; the next one still runs.)
async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    ALONE.lock().await
}

/// How far the client's count of closed connections and the sidecar's count of sheds may differ.
const SHED_COUNT_SLACK: f64 = 16.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_budget_holds_through_a_leak_storm() {
    let _alone = one_at_a_time().await;
    let Some(leaky) = support::build_go("tests/leaky/main.go", "leaky").await else {
        support::skip("`go` is not on PATH; the leaky Go client cannot be built");
        return;
    };
    let upstream = FakeUpstream::start().await;
    let budget = rest_rss(&upstream).await + STORM_ROOM;
    // No limit: the cgroup only meters what the kernel charges the sidecar, sockets included,
    // which neither RSS nor the sidecar's own estimate is.
    let Some(meter) = TestCgroup::meter() else {
        return;
    };
    let sidecar = ChildSidecar::spawn_in_cgroup(
        &format!("{NO_OTHER_LIMITS}budget: {{ memory_bytes: {budget} }}\n"),
        &meter.dir.join("cgroup.procs"),
    )
    .await;
    let scrape = support::scrape(sidecar.admin).await;
    assert_eq!(
        support::value(&scrape, "egress_memory_budget_bytes", &[]),
        budget as f64
    );

    let storm = storm_with_requests_in_flight(&leaky, &sidecar, &upstream);
    let (storm, footprint) = with_peak_footprint(&meter, &sidecar, storm).await;
    let (charged_peak, _) = meter.peak_and_failures();
    let peak_rss = sidecar.status_kib("VmHWM") * 1024;
    let file_pages = sidecar.status_kib("RssFile") * 1024;
    let report = budget_report(&sidecar).await;
    println!(
        "explicit budget {budget}: footprint {footprint} (sampled; peak charged {charged_peak}, file \
         pages {file_pages} at the end), peak RSS {peak_rss}, the client saw {} \
         connections closed, {} counted shed, at most {} sockets open, {} in-flight requests ok; {report}",
        storm.client_saw_shed, storm.counted_shed, storm.sockets_peak, storm.in_flight_ok
    );
    assert!(
        footprint < budget + ESTIMATE_SLACK,
        "the footprint peaked at {footprint}, past the budget {budget} and what its estimate misses"
    );
    assert_sheds_seen_and_counted(&storm);
}

/// The sidecar's RSS at rest, after a few requests: in a debug build mostly its code pages
/// (about 10 of 13.5 MB on 2026-11-24), which grow with each feature linked in. The budgets here
/// are this plus room for what each test grows, so that a bigger binary does not eat the room
/// (at a fixed 12 MiB, the storm's budget paused accepting for good once the retries and the
/// access log were linked in).
async fn rest_rss(upstream: &FakeUpstream) -> u64 {
    let sidecar = ChildSidecar::spawn(NO_OTHER_LIMITS).await;
    let url = format!("http://{}/sleep/10", upstream.addr);
    let requests: Vec<_> = (0..16)
        .map(|_| {
            let (addr, url) = (sidecar.addr, url.clone());
            tokio::spawn(async move { RawClient::connect(addr).await.get(&url).await })
        })
        .collect();
    for request in requests {
        assert_eq!(request.await.unwrap().status, 200, "a warm-up request");
    }
    let rss = sidecar.status_kib("VmRSS") * 1024;
    println!("the sidecar at rest: RSS {rss}");
    rss
}

/// The storm's room over the sidecar at rest: a few hundred open connections and the requests
/// in flight. The kernel charges each open socket more than the budget's 1.5 KiB estimate, so
/// what the estimate misses grows with the sockets a larger room lets pile up: at 2 MiB (1,650-
/// 2,070 sockets) the footprint passed budget + `ESTIMATE_SLACK` in 2 of 7 runs (18.3 MB against
/// 17.6); 1.5 MiB is about the room the fixed 13 MiB budget left when it passed.
const STORM_ROOM: u64 = 3 << 19;

/// The burst's room over the sidecar at rest: the heap of a few hundred requests in flight.
const BURST_ROOM: u64 = 2 << 20;

/// `work`, and the peak of the sidecar's footprint by the kernel's account while it ran
/// ([`TestCgroup::footprint_now`], sampled every 50 ms).
async fn with_peak_footprint<T>(
    meter: &TestCgroup,
    sidecar: &ChildSidecar,
    work: impl std::future::Future<Output = T>,
) -> (T, u64) {
    with_peak(|| meter.footprint_now(sidecar), work).await
}

/// `work`, and the peak of `sample` while it ran (sampled every 50 ms).
async fn with_peak<T>(
    mut sample: impl FnMut() -> u64,
    work: impl std::future::Future<Output = T>,
) -> (T, u64) {
    let mut peak = 0;
    let sampling = async {
        loop {
            peak = peak.max(sample());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let done = tokio::select! {
        done = work => done,
        () = sampling => unreachable!("sampling never ends"),
    };
    (done, peak)
}

/// What an explicit budget's estimate (RSS and 1.5 KiB a socket) misses of what the kernel
/// charges, measured on kernel 6.18 with cgroup v1: 0.2 MiB of kernel memory at rest (page
/// tables, thread stacks, listeners), sockets costing 1.7-1.9 KiB rather than 1.5 (~0.4 MiB at
/// 1,300 open), and closed sockets the kernel still holds. The footprint peaked 0.5-1.3 MiB over
/// the budget in those runs; with shedding off it passes 30 MiB.
const ESTIMATE_SLACK: u64 = 2 << 20;

/// A memory cgroup this test may create: v2 (`cgroup.procs`, `memory.max`) or v1.
struct TestCgroup {
    dir: PathBuf,
    version: u8,
}

impl TestCgroup {
    /// A cgroup with no limit of its own, to meter the sidecar; `None` (said as a skip) where
    /// this machine cannot make one.
    fn meter() -> Option<Self> {
        TestCgroup::create(None)
            .inspect_err(|why| {
                support::skip(&format!(
                    "cannot make a memory cgroup to meter the sidecar ({why})"
                ))
            })
            .ok()
    }

    /// A child of this process's own memory cgroup with `limit` bytes (`None`: no limit of its
    /// own, a meter), or why there cannot be.
    fn create(limit: Option<u64>) -> Result<Self, String> {
        let membership =
            std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
        let v2_root = Path::new("/sys/fs/cgroup");
        let (parent, version) = if v2_root.join("cgroup.controllers").exists() {
            let path = membership
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .ok_or("no v2 membership")?;
            (v2_root.join(path.trim_start_matches('/')), 2)
        } else {
            let path = egress_sidecar::budget::v1_memory_path(&membership)
                .ok_or("no memory controller in /proc/self/cgroup")?;
            (
                Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')),
                1,
            )
        };
        // The tests of this file run at once in one process: each needs a cgroup of its own.
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let dir = parent.join(format!(
            "egress-budget-test-{}-{}",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let cgroup = TestCgroup { dir, version };
        let Some(limit) = limit else {
            return Ok(cgroup);
        };
        let limit_file = if version == 2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        std::fs::write(cgroup.dir.join(limit_file), limit.to_string())
            .map_err(|e| format!("setting {limit_file} (is the memory controller delegated?): {e}"))?;
        Ok(cgroup)
    }

    /// What this cgroup charges now less its page cache, plus `sidecar`'s resident file pages.
    /// The binary's pages are charged to whichever cgroup read them first (the linker's, or this
    /// one once the kernel reclaimed cold pages and the sidecar read them in again), so neither
    /// the charge nor RSS alone counts them once: a charged peak plus the file pages read at the
    /// end counted 1-2 MB twice in a CI run (2026-11-24) after a reclaim.
    fn footprint_now(&self, sidecar: &ChildSidecar) -> u64 {
        self.charged_less_cache() + sidecar.status_kib("RssFile") * 1024
    }

    /// What this cgroup charges now less its page cache: the memory its processes hold and the
    /// kernel cannot reclaim (anonymous pages, sockets and other kernel memory).
    fn charged_less_cache(&self) -> u64 {
        let read = |f: &str| std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
        let (usage, cache_key) = if self.version == 2 {
            ("memory.current", "file ")
        } else {
            ("memory.usage_in_bytes", "cache ")
        };
        let charged: u64 = read(usage).trim().parse().unwrap_or(0);
        let cache: u64 = read("memory.stat")
            .lines()
            .find_map(|l| l.strip_prefix(cache_key)?.trim().parse().ok())
            .unwrap_or(0);
        charged.saturating_sub(cache)
    }

    /// How often the kernel killed a process of this cgroup for memory (v1 `memory.oom_control`,
    /// v2 `memory.events`).
    fn oom_kills(&self) -> u64 {
        let file = if self.version == 2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The highest usage the kernel charged, and how often the limit was hit.
    fn peak_and_failures(&self) -> (u64, u64) {
        let read = |f: &str| -> u64 {
            std::fs::read_to_string(self.dir.join(f))
                .ok()
                .and_then(|t| t.trim().parse().ok())
                .unwrap_or(0)
        };
        if self.version == 2 {
            let events = std::fs::read_to_string(self.dir.join("memory.events")).unwrap_or_default();
            let count = |key: &str| -> u64 {
                events
                    .lines()
                    .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
                    .unwrap_or(0)
            };
            (read("memory.peak"), count("max ") + count("oom_kill "))
        } else {
            (read("memory.max_usage_in_bytes"), read("memory.failcnt"))
        }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // The sidecar was killed before this runs; its cgroup empties as it exits.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Reads `path` through, so that its pages sit in the page cache charged to this test process's
/// cgroup: a sidecar started in a test cgroup then maps its code without the kernel charging the
/// test cgroup for reading it (it charges whichever cgroup reads a page first).
fn read_into_page_cache(path: &str) {
    std::io::copy(
        &mut std::fs::File::open(path).expect("the sidecar's binary"),
        &mut std::io::sink(),
    )
    .expect("reading the sidecar's binary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cgroup_limit_sizes_the_budget_and_the_storm_stays_under_it() {
    let _alone = one_at_a_time().await;
    let Some(leaky) = support::build_go("tests/leaky/main.go", "leaky").await else {
        support::skip("`go` is not on PATH; the leaky Go client cannot be built");
        return;
    };
    const LIMIT: u64 = 24 << 20;
    let cgroup = match TestCgroup::create(Some(LIMIT)) {
        Ok(cgroup) => cgroup,
        Err(why) => {
            support::skip(&format!(
                "cannot make a memory cgroup here ({why}); the explicit-budget test still runs"
            ));
            return;
        }
    };
    let upstream = FakeUpstream::start().await;
    read_into_page_cache(env!("CARGO_BIN_EXE_egress-sidecar"));
    let sidecar = ChildSidecar::spawn_in_cgroup(NO_OTHER_LIMITS, &cgroup.dir.join("cgroup.procs")).await;
    let budget = (LIMIT as f64 * 0.8) as u64;
    let report = budget_report(&sidecar).await;
    assert_eq!(
        report["budget_bytes"].as_u64(),
        Some(budget),
        "80% of the limit: {report}"
    );
    assert_eq!(report["usage_measure"], "cgroup_working_set", "{report}");
    assert!(
        report["source"]
            .as_str()
            .unwrap()
            .contains(&cgroup.dir.display().to_string()),
        "{report}"
    );

    let storm = storm_with_requests_in_flight(&leaky, &sidecar, &upstream);
    let (storm, held) = with_peak(|| cgroup.charged_less_cache(), storm).await;
    let (peak, failures) = cgroup.peak_and_failures();
    let peak_rss = sidecar.status_kib("VmHWM") * 1024;
    let oom_kills = cgroup.oom_kills();
    let report = budget_report(&sidecar).await;
    println!(
        "cgroup v{} limit {LIMIT}, budget {budget}: peak charged {peak} (less page cache, sampled: \
         {held}), peak RSS {peak_rss}, limit hit {failures} times, {oom_kills} OOM kills, the client \
         saw {} connections closed, {} counted shed, at most {} sockets open, {} in-flight requests \
         ok; {report}",
        cgroup.version, storm.client_saw_shed, storm.counted_shed, storm.sockets_peak, storm.in_flight_ok
    );
    assert_eq!(oom_kills, 0, "nothing in the cgroup was killed");
    assert!(
        held < budget,
        "the cgroup held {held} the kernel cannot reclaim at the peak, past the budget {budget}"
    );
    // Page cache charged here is the binary's code read in again after the kernel dropped it,
    // which the charge counts and the budget rightly does not (it is reclaimable): warmed above
    // and usually none, but a machine that drops caches under the test charges it again.
    let binary_pages_charged = peak >= held + (1 << 20);
    if !binary_pages_charged {
        assert_eq!(failures, 0, "the cgroup never hit its limit");
        assert!(
            peak < budget,
            "the kernel charged {peak} at the peak, past the budget {budget}"
        );
    }
    assert_sheds_seen_and_counted(&storm);
    drop(sidecar);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_requests_past_the_budget_waits_in_the_backlog_and_none_fails() {
    let _alone = one_at_a_time().await;
    const BURST: usize = 800;
    let Some(meter) = TestCgroup::meter() else {
        return;
    };
    let upstream = FakeUpstream::start().await;
    let budget = rest_rss(&upstream).await + BURST_ROOM;
    let sidecar = ChildSidecar::spawn_in_cgroup(
        &format!(
            "{NO_OTHER_LIMITS}defaults: {{ pool: {{ max_connections: 1000, max_idle: 1000, pending_timeout: 30s }} }}\n\
             budget: {{ memory_bytes: {budget} }}\n"
        ),
        &meter.dir.join("cgroup.procs"),
    )
    .await;
    let url = format!("http://{}/sleep/1000", upstream.addr);
    let started = tokio::time::Instant::now();
    let requests: Vec<_> = (0..BURST)
        .map(|_| {
            let (addr, url) = (sidecar.addr, url.clone());
            tokio::spawn(async move { RawClient::connect(addr).await.get(&url).await })
        })
        .collect();
    let mut statuses = std::collections::BTreeMap::new();
    for request in requests {
        let resp = request.await.unwrap();
        *statuses.entry(resp.status).or_insert(0) += 1;
    }
    let took = started.elapsed();
    let peak_rss = sidecar.status_kib("VmHWM") * 1024;
    let (charged_peak, _) = meter.peak_and_failures();
    let file_pages = sidecar.status_kib("RssFile") * 1024;
    let report = budget_report(&sidecar).await;
    println!(
        "{BURST} requests of 1 s in {took:?}: {statuses:?}, peak RSS {peak_rss}, footprint {} (peak \
         charged {charged_peak}, file pages {file_pages}); {report}",
        charged_peak + file_pages
    );
    assert_eq!(
        statuses.get(&200),
        Some(&BURST),
        "every request answered 200: {statuses:?}"
    );
    assert!(
        report["shed_accept_paused"].as_u64().unwrap() >= 1,
        "accepting paused: {report}"
    );
    assert!(
        took > Duration::from_secs(2),
        "some waited for earlier ones to finish"
    );
    // The budget's promise for a burst: the heap it grows stays under the budget. Requests
    // admitted before a measurement keep growing after it, so accepting pauses at 95% and at
    // most 64 connections come in per measurement.
    assert!(
        peak_rss < budget,
        "peak RSS {peak_rss} passed the budget {budget}"
    );
}
