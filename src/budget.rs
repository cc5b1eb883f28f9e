//! The memory budget: the sidecar keeps its own footprint under a share of its container's
//! memory limit, as GOMEMLIMIT does for a Go service, by shedding what costs nothing to rebuild.
//!
//! The budget is `budget.memory_bytes` when set, else `budget.memory_fraction` of the cgroup
//! memory limit found at start (v2 `memory.max`, v1 `memory.limit_in_bytes`, the lowest on the
//! path from the process's cgroup up to the mount's root). No limit and no explicit budget: no
//! budget, and nothing here runs.
//!
//! Usage is measured. With a cgroup budget it is what the kernel charges the cgroup (sockets
//! and other kernel memory included, which RSS misses) less the page cache it can reclaim,
//! `usage - inactive_file`: the working set kubelet evicts by and close to what the OOM killer
//! acts on. With an explicit budget it is the process's RSS plus [`KERNEL_SOCKET_COST`] for
//! each open connection, the kernel memory a cgroup would have charged (an idle socket held
//! 1.5 KiB of kernel memory, measured in a cgroup v1 with 5000 leaked connections).
//!
//! One task measures every [`TICK`], and when new connections have used up their credit (at
//! most every `MIN_INTERVAL`). Above [`SHED_ABOVE`] of the budget it trims the heap, then
//! sheds, in this order, re-measuring between rounds, until usage is back to [`SHED_TO`]:
//! 1. idle keep-alive application connections, longest idle first (the parking lot's: idle
//!    for `PARK_AFTER` at least, so never one between a request and its response);
//! 2. idle upstream connections beyond each pool's `max_idle`, which the pool otherwise keeps
//!    for a one-second grace;
//! 3. accepting: each accept spends credit, the headroom under [`PAUSE_AT`] divided by what a
//!    new connection costs: at least [`ACCEPT_COST`], more when usage grew faster than that
//!    per connection accepted between measurements (requests in flight cost what their
//!    application sends and the upstream answers, which no constant knows). With no credit
//!    left, new connections wait in the kernel's backlog (as with `max_connections`) until a
//!    measurement finds room, which requests finishing and connections closing make.
//!
//! A request in flight is never shed. Nor does a budget starve: each tick lets at least one
//! connection in (more when none is open), as a tunnel or a connection that never sends a
//! request is never shed and could otherwise hold accepting paused for good.
//!
//! The cgroup working set is the sidecar's only while the cgroup holds the sidecar alone, as a
//! Kubernetes container does; if other processes share it at start (an init process, the
//! application), the limit still sizes the budget but usage is measured as under an explicit
//! budget. `budget.enabled: false` turns it all off.
//!
//! Not handled here: how a parked connection or pooled connection is closed (`downstream::park`,
//! `pool`), handing freed heap back to the kernel (`resident`).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::Notify;

use crate::clients::loopback::{FD_LINK_COST, MAX_FDS};
use crate::config::BudgetConfig;
use crate::metrics::Metrics;

/// How often usage is measured while nothing else asks for it.
pub const TICK: Duration = Duration::from_millis(100);
/// Shedding starts above this share of the budget...
pub const SHED_ABOVE: f64 = 0.90;
/// ...and stops once usage is back under this share.
pub const SHED_TO: f64 = 0.80;
/// New connections stop being accepted when usage (as measured, plus what each connection
/// accepted since costs) would pass this share.
pub const PAUSE_AT: f64 = 0.95;
/// What a freshly accepted connection is taken to cost at least: the kernel's socket and a
/// parked record, what a leaking client's connections cost (2-3 KiB). Connections that carry
/// requests cost more, and the estimate learns that from measured growth.
pub const ACCEPT_COST: u64 = 4 << 10;
/// The most one new connection is taken to cost: usage also grows without accepts (requests
/// already in flight), which must not stop accepting for long.
const MAX_ACCEPT_COST: u64 = 256 << 10;
/// What closing an idle application connection frees, for sizing a shedding round: its parked
/// record and the kernel's socket. Rounds re-measure, so a wrong guess costs a round, not the
/// budget.
const IDLE_DOWNSTREAM_FREES: u64 = 2 << 10;
/// Kernel memory an open connection holds (socket, file, epoll entry), counted into usage
/// under an explicit budget, where nothing measures it.
pub const KERNEL_SOCKET_COST: u64 = 1536;
/// Connections let in per measurement at most (a measurement every `MIN_INTERVAL` at most: up
/// to 6,400 accepts a second).
const MAX_CREDIT: u64 = 64;
/// Connections let in when usage cannot be read.
const UNMEASURED_CREDIT: i64 = 64;
/// Shedding rounds per measurement at most, each ending in a heap trim; the next measurement
/// goes on if usage is still high.
const MAX_ROUNDS: usize = 2;
/// Measurements an accept loop asks for are at least this far apart.
const MIN_INTERVAL: Duration = Duration::from_millis(10);
/// Pausing and resuming are logged at most this often (they are counted every time).
const LOG_EVERY: Duration = Duration::from_secs(10);
/// cgroup v1 reports "no limit" as a page-aligned i64::MAX; anything this large is no limit.
const UNLIMITED: u64 = 1 << 60;

/// Where the budget's size came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitSource {
    /// `budget.memory_bytes`.
    Config,
    /// A share of a cgroup's memory limit.
    Cgroup(Cgroup),
}

/// The cgroup whose limit sizes the budget and whose usage is measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup {
    /// 1 or 2.
    pub version: u8,
    /// The process's own cgroup directory, whose usage is read.
    pub dir: PathBuf,
    /// The lowest limit on the path up, in bytes.
    pub limit: u64,
    /// Other processes share the cgroup (an init process, the application itself): its usage
    /// is not the sidecar's, so the sidecar's own RSS and sockets are measured instead.
    pub shared: bool,
}

/// The budget: its size and how usage is measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// Bytes the footprint is kept under.
    pub bytes: u64,
    /// Where that came from.
    pub source: LimitSource,
}

impl Limit {
    /// The budget `config` asks for, looking for the cgroup under `root` (`/` outside tests);
    /// `pid` is this process, which the cgroup should hold alone.
    pub fn discover(config: &BudgetConfig, root: &Path, pid: u32) -> Option<Limit> {
        if !config.enabled {
            return None;
        }
        if let Some(bytes) = config.memory_bytes {
            return Some(Limit {
                bytes: bytes as u64,
                source: LimitSource::Config,
            });
        }
        let mut cgroup = find_cgroup(root)?;
        cgroup.shared = shares_cgroup(&cgroup.dir, pid);
        Some(Limit {
            bytes: (cgroup.limit as f64 * config.memory_fraction) as u64,
            source: LimitSource::Cgroup(cgroup),
        })
    }

    /// Measures usage the way this budget's source counts it; `sockets` are the connections
    /// open now, both sides.
    pub fn usage(&self, sockets: u64) -> io::Result<u64> {
        match &self.source {
            LimitSource::Cgroup(cgroup) if !cgroup.shared => cgroup.working_set(),
            _ => Ok(crate::resident::rss_bytes()? + sockets * KERNEL_SOCKET_COST),
        }
    }

    /// `cgroup_working_set`, or `rss_and_sockets`.
    fn measure_name(&self) -> &'static str {
        match &self.source {
            LimitSource::Cgroup(cgroup) if !cgroup.shared => "cgroup_working_set",
            _ => "rss_and_sockets",
        }
    }

    fn describe(&self) -> String {
        match &self.source {
            LimitSource::Config => "budget.memory_bytes".into(),
            LimitSource::Cgroup(c) => format!(
                "cgroup v{} limit {} at {}{}",
                c.version,
                c.limit,
                c.dir.display(),
                if c.shared {
                    " (shared with other processes)"
                } else {
                    ""
                }
            ),
        }
    }
}

/// The cgroup this process is in and its memory limit, if it has one. v2 first; on a hybrid
/// host (v2 mounted without the memory controller) v1's memory hierarchy decides.
pub fn find_cgroup(root: &Path) -> Option<Cgroup> {
    let membership = fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let v2 = membership.lines().find_map(|l| l.strip_prefix("0::"));
    if let Some(found) = v2.and_then(|path| limit_on_path(&root.join("sys/fs/cgroup"), path, "memory.max", 2))
    {
        return Some(found);
    }
    let v1 = v1_memory_path(&membership)?;
    limit_on_path(&root.join("sys/fs/cgroup/memory"), v1, "memory.limit_in_bytes", 1)
}

/// The path of the v1 memory hierarchy's cgroup in `/proc/self/cgroup` text.
pub fn v1_memory_path(membership: &str) -> Option<&str> {
    membership.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        controllers.split(',').any(|c| c == "memory").then_some(path)
    })
}

/// The lowest limit in `file` from the cgroup at `path` under `mount` up to the mount's root.
/// Inside a container with its own cgroup namespace the mount's root is the container's cgroup
/// and `path` is `/`; without one `path` names a directory the mount may not have, and then the
/// mount's root is the closest thing to it.
fn limit_on_path(mount: &Path, path: &str, file: &str, version: u8) -> Option<Cgroup> {
    let nested = mount.join(path.trim_start_matches('/'));
    let dir = if nested.is_dir() {
        nested
    } else {
        mount.to_path_buf()
    };
    let mut lowest: Option<u64> = None;
    let mut seen_file = false;
    for level in dir.ancestors().take_while(|d| d.starts_with(mount)) {
        let Ok(text) = fs::read_to_string(level.join(file)) else {
            continue;
        };
        seen_file = true;
        if let Some(limit) = parse_limit(&text) {
            lowest = Some(lowest.map_or(limit, |l| l.min(limit)));
        }
    }
    if !seen_file {
        return None;
    }
    Some(Cgroup {
        version,
        dir,
        limit: lowest?,
        shared: false,
    })
}

/// Whether a process other than `pid` is in the cgroup at `dir` (unreadable: assumed not).
fn shares_cgroup(dir: &Path, pid: u32) -> bool {
    fs::read_to_string(dir.join("cgroup.procs"))
        .map(|procs| {
            procs
                .lines()
                .any(|p| p.trim().parse::<u32>().is_ok_and(|p| p != pid))
        })
        .unwrap_or(false)
}

/// `max` (v2) and near-i64::MAX values (v1) are no limit.
fn parse_limit(text: &str) -> Option<u64> {
    let value: u64 = text.trim().parse().ok()?;
    (value < UNLIMITED).then_some(value)
}

impl Cgroup {
    /// Charged usage less reclaimable page cache.
    fn working_set(&self) -> io::Result<u64> {
        let (usage_file, inactive_key) = match self.version {
            2 => ("memory.current", "inactive_file"),
            _ => ("memory.usage_in_bytes", "total_inactive_file"),
        };
        let usage: u64 = fs::read_to_string(self.dir.join(usage_file))?
            .trim()
            .parse()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{usage_file}: {e}")))?;
        let stat = fs::read_to_string(self.dir.join("memory.stat"))?;
        Ok(usage.saturating_sub(stat_field(&stat, inactive_key).unwrap_or(0)))
    }
}

fn stat_field(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == key).then(|| value.trim().parse().ok()).flatten()
    })
}

/// The connections the budget measures and sheds, handed in by the wiring so that the budget
/// need not know the downstream server or the pools.
pub trait Connections: Send + Sync {
    /// Application connections open now.
    fn downstream_open(&self) -> usize;
    /// Upstream connections open now, over every pool.
    fn upstream_open(&self) -> usize;
    /// Closes up to `n` idle application connections, longest idle first; returns how many.
    fn shed_downstream_idle(&self, n: usize) -> usize;
    /// Closes each pool's idle connections beyond its `max_idle`; returns how many.
    fn shed_upstream_idle(&self) -> usize;
}

/// The budget in force: shared by the accept loops (credit) and the enforcing task.
#[derive(Debug)]
pub struct Budget {
    limit: Limit,
    /// Connections that may still be accepted before the next measurement.
    credit: AtomicI64,
    /// Accept loops out of credit ask for a measurement.
    measure_now: Notify,
    /// A measurement found room.
    refilled: Notify,
    usage: AtomicU64,
    paused: AtomicBool,
    /// Connections admitted since start.
    admitted: AtomicU64,
    /// The enforcing task's view of the last measurement.
    last: std::sync::Mutex<LastMeasurement>,
}

/// What the previous measurement saw, to learn what a new connection costs.
#[derive(Debug, Clone, Copy)]
struct LastMeasurement {
    usage: u64,
    admitted: u64,
    cost: CostEstimate,
    trimmed: Option<std::time::Instant>,
    logged: Option<std::time::Instant>,
}

/// What new connections have cost: growth and admits between measurements, each summed with a
/// tenth decayed per measurement, so that a burst is remembered for a while and one noisy
/// measurement (RSS grows in whole pages and arenas) moves it little.
#[derive(Debug, Clone, Copy, Default)]
struct CostEstimate {
    grown: f64,
    admitted: f64,
}

impl CostEstimate {
    fn observe(&mut self, grew: u64, admitted: u64) {
        self.grown = self.grown * 0.9 + grew as f64;
        self.admitted = self.admitted * 0.9 + admitted as f64;
    }

    /// What one more connection is taken to cost: at least [`ACCEPT_COST`], at most
    /// [`MAX_ACCEPT_COST`].
    fn cost(&self) -> u64 {
        if self.admitted < 1.0 {
            return ACCEPT_COST;
        }
        ((self.grown / self.admitted) as u64).clamp(ACCEPT_COST, MAX_ACCEPT_COST)
    }
}

/// The budget as `/debug/pools` shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BudgetReport {
    /// Bytes the footprint is kept under.
    pub budget_bytes: u64,
    /// Where the budget came from.
    pub source: String,
    /// Usage at the last measurement.
    pub usage_bytes: u64,
    /// `cgroup_working_set`, or `rss_and_sockets` (RSS plus an estimate of the kernel's
    /// memory for each open connection).
    pub usage_measure: &'static str,
    /// Whether new application connections are waiting in the backlog now.
    pub accept_paused: bool,
    /// Idle application connections closed to stay under budget.
    pub shed_downstream_idle: u64,
    /// Idle upstream connections closed to stay under budget.
    pub shed_upstream_idle: u64,
    /// Times accepting paused.
    pub shed_accept_paused: u64,
}

impl Budget {
    /// A budget of `limit`, with no credit until the first measurement; `metrics` shows it.
    pub fn new(limit: Limit, metrics: &Metrics) -> Self {
        metrics
            .families()
            .memory_budget
            .set(i64::try_from(limit.bytes).unwrap_or(i64::MAX));
        Budget {
            limit,
            credit: AtomicI64::new(0),
            measure_now: Notify::new(),
            refilled: Notify::new(),
            usage: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            admitted: AtomicU64::new(0),
            last: std::sync::Mutex::new(LastMeasurement {
                usage: 0,
                admitted: 0,
                cost: CostEstimate::default(),
                trimmed: None,
                logged: None,
            }),
        }
    }

    /// The budget's size and source.
    pub fn limit(&self) -> &Limit {
        &self.limit
    }

    fn share(&self, fraction: f64) -> u64 {
        (self.limit.bytes as f64 * fraction) as u64
    }

    /// Waits until one more application connection fits: called before each accept.
    pub async fn admit(&self) {
        loop {
            // Made before the check so that a refill between the two is not missed.
            let refilled = self.refilled.notified();
            if self.credit.fetch_sub(1, Ordering::AcqRel) > 0 {
                self.admitted.fetch_add(1, Ordering::Relaxed);
                return;
            }
            self.credit.fetch_add(1, Ordering::AcqRel);
            self.measure_now.notify_one();
            refilled.await;
        }
    }

    /// For `/debug/pools`; the shed counts are the ones `metrics` exports.
    pub fn report(&self, metrics: &Metrics) -> BudgetReport {
        let families = metrics.families();
        BudgetReport {
            budget_bytes: self.limit.bytes,
            source: self.limit.describe(),
            usage_bytes: self.usage.load(Ordering::Relaxed),
            usage_measure: self.limit.measure_name(),
            accept_paused: self.paused.load(Ordering::Relaxed),
            shed_downstream_idle: families.memory_sheds("downstream_idle"),
            shed_upstream_idle: families.memory_sheds("upstream_idle"),
            shed_accept_paused: families.memory_sheds("accept_paused"),
        }
    }

    fn measure(&self, conns: &dyn Connections) -> io::Result<u64> {
        let open = conns.downstream_open() + conns.upstream_open();
        self.limit.usage(open as u64)
    }

    /// Measures, sheds if over, and sets the accept credit; `on_tick` when the tick, not an
    /// accept loop out of credit, asked.
    fn adjust(&self, conns: &dyn Connections, metrics: &Metrics, on_tick: bool) -> Option<u64> {
        let admitted = self.admitted.load(Ordering::Relaxed);
        let Ok(mut usage) = self.measure(conns) else {
            // Unmeasurable now: let connections in rather than stall on a /proc hiccup, and
            // count them as old by the next measurement.
            self.learn_cost(None, admitted);
            self.grant(UNMEASURED_CREDIT);
            return None;
        };
        let (cost, young) = self.learn_cost(Some(usage), admitted);
        // Shedding follows what is measured; what young connections will still grow by only
        // holds back new ones.
        if usage > self.share(SHED_ABOVE) && self.trim_due() {
            // What finished requests freed counts only once it is handed back.
            crate::resident::trim_heap();
            usage = self.measure(conns).unwrap_or(usage);
        }
        if usage > self.share(SHED_ABOVE) {
            usage = self.shed(usage, conns, metrics);
        }
        self.remember(usage);
        let families = metrics.families();
        families
            .memory_usage
            .set(i64::try_from(usage).unwrap_or(i64::MAX));
        let growing = young.saturating_mul(cost);
        let room = self.share(PAUSE_AT).saturating_sub(usage.saturating_add(growing)) / cost;
        // Accepts since the measurement spent credit this grant must not give again.
        let spent = self.admitted.load(Ordering::Relaxed) - admitted;
        // A burst is let in a slice at a time, so that what it costs is measured before the
        // next slice: the cost estimate only learns from connections already admitted.
        let mut credit = room.min(MAX_CREDIT).saturating_sub(spent);
        // Progress whatever stays open: a tunnel, or a connection waiting for its first request,
        // is never shed, and waiting for it to close could be forever.
        if credit == 0 && (on_tick || conns.downstream_open() == 0) {
            credit = 1;
        }
        self.grant(i64::try_from(credit).unwrap_or(i64::MAX));
        self.note_pause(room == 0, usage, families);
        Some(usage)
    }

    /// Counts and logs accepting pausing (no room under [`PAUSE_AT`]) and resuming.
    fn note_pause(&self, paused: bool, usage: u64, families: &crate::metrics::Families) {
        if paused == self.paused.swap(paused, Ordering::Relaxed) {
            return;
        }
        if paused {
            families.memory_shed("accept_paused", 1);
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        if last.logged.is_some_and(|at| now.duration_since(at) < LOG_EVERY) {
            return;
        }
        last.logged = Some(now);
        drop(last);
        if paused {
            tracing::info!(
                usage,
                budget = self.limit.bytes,
                "memory budget: new connections wait in the backlog"
            );
        } else {
            tracing::info!(usage, budget = self.limit.bytes, "memory budget: accepting again");
        }
    }

    /// Whether a heap trim before shedding is due: at most one per [`TICK`], as `malloc_trim`
    /// holds every arena's lock while it walks the heap.
    fn trim_due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        if last.trimmed.is_some_and(|at| now.duration_since(at) < TICK) {
            return false;
        }
        last.trimmed = Some(now);
        true
    }

    /// What a new connection is taken to cost, learned from the growth since the last
    /// measurement to `usage` (none: unmeasured), and how many were admitted since, counting
    /// up to `admitted`.
    fn learn_cost(&self, usage: Option<u64>, admitted: u64) -> (u64, u64) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let young = admitted - last.admitted;
        if let Some(usage) = usage {
            let grew = usage.saturating_sub(last.usage);
            last.cost.observe(grew, young);
        }
        last.admitted = admitted;
        (last.cost.cost(), young)
    }

    /// The usage the next measurement's growth is counted from.
    fn remember(&self, usage: u64) {
        self.usage.store(usage, Ordering::Relaxed);
        self.last.lock().unwrap_or_else(|p| p.into_inner()).usage = usage;
    }

    fn grant(&self, credit: i64) {
        self.credit.store(credit, Ordering::Release);
        if credit > 0 {
            self.refilled.notify_waiters();
        }
    }

    /// Sheds in the module's order until usage is back to [`SHED_TO`]; returns usage after.
    fn shed(&self, mut usage: u64, conns: &dyn Connections, metrics: &Metrics) -> u64 {
        let target = self.share(SHED_TO);
        let families = metrics.families();
        for _ in 0..MAX_ROUNDS {
            let excess = usage.saturating_sub(target);
            if excess == 0 {
                break;
            }
            let want = usize::try_from(excess.div_ceil(IDLE_DOWNSTREAM_FREES)).unwrap_or(usize::MAX);
            let mut closed = conns.shed_downstream_idle(want);
            families.memory_shed("downstream_idle", closed as u64);
            if closed < want {
                let upstream = conns.shed_upstream_idle();
                families.memory_shed("upstream_idle", upstream as u64);
                closed += upstream;
            }
            if closed == 0 {
                break;
            }
            tracing::debug!(usage, closed, "memory budget: shed idle connections");
            crate::resident::trim_heap();
            usage = self.measure(conns).unwrap_or(usage);
        }
        usage
    }
}

/// Fd links the leak detector's scan of fd tables may look up now (`clients::loopback`: each
/// costs the sidecar [`FD_LINK_COST`] of kernel memory, which stays in the dentry cache): what
/// fits under [`SHED_ABOVE`] at the last measurement, so that the scan sheds no connection; with
/// no budget, the scan's own bound.
pub fn fd_links_allowed(budget: Option<&Budget>) -> usize {
    let Some(budget) = budget else {
        return MAX_FDS;
    };
    let room = budget
        .share(SHED_ABOVE)
        .saturating_sub(budget.usage.load(Ordering::Relaxed));
    usize::try_from(room / FD_LINK_COST).map_or(MAX_FDS, |links| links.min(MAX_FDS))
}

/// Keeps the footprint under `budget` for as long as the runtime runs.
pub async fn enforce(budget: Arc<Budget>, conns: Arc<dyn Connections>, metrics: Arc<Metrics>) {
    tracing::info!(budget = budget.limit.bytes, source = %budget.limit.describe(), measure = budget.limit.measure_name(), "memory budget");
    let at_rest = budget.adjust(&*conns, &metrics, true);
    if at_rest.is_some_and(|usage| usage > budget.share(SHED_ABOVE)) {
        tracing::warn!(
            usage = at_rest,
            budget = budget.limit.bytes,
            "the memory budget is below what the sidecar uses at rest: idle connections will be shed \
             and connections let in one at a time; raise budget.memory_bytes or the memory limit"
        );
    }
    loop {
        let tick = tokio::time::Instant::now() + TICK;
        tokio::time::sleep(MIN_INTERVAL).await;
        let on_tick = tokio::select! {
            () = tokio::time::sleep_until(tick) => true,
            () = budget.measure_now.notified() => false,
        };
        budget.adjust(&*conns, &metrics, on_tick);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory tree standing in for `/`, removed on drop.
    struct FakeRoot(PathBuf);

    impl FakeRoot {
        /// `files` are (path under the root, content).
        fn new(files: &[(&str, &str)]) -> Self {
            use std::sync::atomic::AtomicU32;
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let root = std::env::temp_dir().join(format!("egress-budget-{}-{n}", std::process::id()));
            for (path, content) in files {
                let path = root.join(path);
                fs::create_dir_all(path.parent().unwrap()).unwrap();
                fs::write(path, content).unwrap();
            }
            fs::create_dir_all(&root).unwrap();
            FakeRoot(root)
        }
    }

    impl Drop for FakeRoot {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// This process, as far as the fixtures' `cgroup.procs` files go.
    const PID: u32 = 42;

    fn from_cgroup(fraction: f64) -> BudgetConfig {
        BudgetConfig {
            enabled: true,
            memory_fraction: fraction,
            memory_bytes: None,
        }
    }

    #[test]
    fn v2_takes_the_lowest_limit_on_the_path_up() {
        let root = FakeRoot::new(&[
            ("proc/self/cgroup", "0::/kubepods/pod1/ctr\n"),
            ("sys/fs/cgroup/kubepods/memory.max", "max\n"),
            ("sys/fs/cgroup/kubepods/pod1/memory.max", "134217728\n"),
            ("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "268435456\n"),
            ("sys/fs/cgroup/kubepods/pod1/ctr/memory.current", "10000000\n"),
            ("sys/fs/cgroup/kubepods/pod1/ctr/cgroup.procs", "42\n"),
            (
                "sys/fs/cgroup/kubepods/pod1/ctr/memory.stat",
                "anon 1\ninactive_file 2000000\nactive_file 5\n",
            ),
        ]);
        let limit = Limit::discover(&from_cgroup(0.5), &root.0, PID).expect("a limit");
        assert_eq!(limit.bytes, 64 << 20, "half of the pod's 128 MiB");
        let LimitSource::Cgroup(cgroup) = &limit.source else {
            panic!("{limit:?}")
        };
        assert_eq!((cgroup.version, cgroup.limit), (2, 128 << 20));
        assert!(cgroup.dir.ends_with("kubepods/pod1/ctr"));
        assert_eq!(
            limit.usage(10).unwrap(),
            8_000_000,
            "usage less inactive page cache"
        );
    }

    #[test]
    fn v2_inside_a_cgroup_namespace_reads_the_mount_root() {
        let root = FakeRoot::new(&[
            ("proc/self/cgroup", "0::/\n"),
            ("sys/fs/cgroup/memory.max", "67108864\n"),
        ]);
        let limit = Limit::discover(&from_cgroup(0.8), &root.0, PID).expect("a limit");
        assert_eq!(limit.bytes, (64u64 << 20) * 8 / 10);
    }

    #[test]
    fn v1_memory_controller_on_a_hybrid_host() {
        let root = FakeRoot::new(&[
            (
                "proc/self/cgroup",
                "9:name=systemd:/\n4:cpu,memory:/docker/abc\n0::/\n",
            ),
            (
                "sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            (
                "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes",
                "33554432\n",
            ),
            (
                "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes",
                "5000000\n",
            ),
            (
                "sys/fs/cgroup/memory/docker/abc/memory.stat",
                "cache 9\ntotal_inactive_file 1000000\n",
            ),
        ]);
        let limit = Limit::discover(&from_cgroup(1.0), &root.0, PID).expect("a limit");
        assert_eq!(limit.bytes, 32 << 20);
        assert_eq!(limit.usage(10).unwrap(), 4_000_000);
    }

    #[test]
    fn no_limit_anywhere_is_no_budget_and_explicit_bytes_win() {
        let unlimited = FakeRoot::new(&[
            ("proc/self/cgroup", "4:memory:/x\n"),
            (
                "sys/fs/cgroup/memory/x/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
        ]);
        assert_eq!(Limit::discover(&from_cgroup(0.8), &unlimited.0, PID), None);
        let v2_max = FakeRoot::new(&[
            ("proc/self/cgroup", "0::/\n"),
            ("sys/fs/cgroup/memory.max", "max\n"),
        ]);
        assert_eq!(Limit::discover(&from_cgroup(0.8), &v2_max.0, PID), None);
        let nothing = FakeRoot::new(&[]);
        assert_eq!(Limit::discover(&from_cgroup(0.8), &nothing.0, PID), None);
        let explicit = BudgetConfig {
            enabled: true,
            memory_fraction: 0.8,
            memory_bytes: Some(48 << 20),
        };
        let off = BudgetConfig {
            enabled: false,
            ..explicit
        };
        assert_eq!(
            Limit::discover(&off, &nothing.0, PID),
            None,
            "enabled: false wins"
        );
        let limit = Limit::discover(&explicit, &nothing.0, PID).unwrap();
        assert_eq!((limit.bytes, &limit.source), (48 << 20, &LimitSource::Config));
        assert_rss_and_sockets(&limit);
    }

    /// `limit` measures this process's RSS plus 1000 sockets (other tests' threads allocate
    /// meanwhile: the two reads may differ by a few MiB).
    fn assert_rss_and_sockets(limit: &Limit) {
        let usage = limit.usage(1000).unwrap();
        let rss = crate::resident::rss_bytes().unwrap();
        assert!(rss > 1 << 20, "RSS of this test process");
        let ours = usage - 1000 * KERNEL_SOCKET_COST;
        assert!(
            ours.abs_diff(rss) < 8 << 20,
            "{usage} is not RSS {rss} and the sockets"
        );
    }

    #[test]
    fn a_cgroup_shared_with_other_processes_sizes_the_budget_but_rss_is_measured() {
        let root = FakeRoot::new(&[
            ("proc/self/cgroup", "4:memory:/app\n"),
            ("sys/fs/cgroup/memory/app/memory.limit_in_bytes", "268435456\n"),
            ("sys/fs/cgroup/memory/app/memory.usage_in_bytes", "200000000\n"),
            ("sys/fs/cgroup/memory/app/memory.stat", "total_inactive_file 0\n"),
            ("sys/fs/cgroup/memory/app/cgroup.procs", "1\n42\n"),
        ]);
        let limit = Limit::discover(&from_cgroup(0.8), &root.0, PID).expect("a limit");
        assert_eq!(limit.bytes, (256u64 << 20) * 8 / 10, "sized by the limit");
        assert_eq!(limit.measure_name(), "rss_and_sockets");
        assert!(limit.describe().contains("shared"), "{}", limit.describe());
        assert_rss_and_sockets(&limit);
    }

    #[test]
    fn a_new_connection_costs_what_recent_ones_did_and_the_estimate_decays() {
        let mut estimate = CostEstimate::default();
        assert_eq!(estimate.cost(), ACCEPT_COST, "nothing seen: the floor");
        estimate.observe(1 << 20, 1000);
        assert_eq!(estimate.cost(), ACCEPT_COST, "cheap ones: the floor");
        estimate.observe(64 << 20, 1000);
        assert_eq!(estimate.cost(), 35_817, "(0.9 x 1 MiB + 64 MiB) / 1900");
        estimate.observe(1 << 20, 1);
        assert_eq!(estimate.cost(), 36_409, "one noisy measurement moves it little");
        let mut spike = CostEstimate::default();
        spike.observe(64 << 20, 1);
        assert_eq!(spike.cost(), MAX_ACCEPT_COST, "capped");
        for _ in 0..40 {
            estimate.observe(0, 50);
        }
        assert_eq!(estimate.cost(), ACCEPT_COST, "back to the floor");
    }

    #[test]
    fn the_leak_scan_may_read_what_fits_under_the_shedding_line() {
        assert_eq!(fd_links_allowed(None), MAX_FDS, "no budget: the scan's own bound");
        let limit = Limit {
            bytes: 100 << 20,
            source: LimitSource::Config,
        };
        let budget = Budget::new(limit, &Metrics::new());
        budget.remember(80 << 20);
        assert_eq!(
            fd_links_allowed(Some(&budget)),
            10 << 10,
            "10 MiB under 90%, 1 KiB a link"
        );
        budget.remember(95 << 20);
        assert_eq!(fd_links_allowed(Some(&budget)), 0, "over the line: nothing");
    }

    #[tokio::test]
    async fn admit_waits_without_credit_until_a_refill() {
        let limit = Limit {
            bytes: 1 << 30,
            source: LimitSource::Config,
        };
        let budget = Arc::new(Budget::new(limit, &Metrics::new()));
        budget.grant(2);
        budget.admit().await;
        budget.admit().await;
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.admit().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "no credit left: the third accept waits");
        budget.grant(1);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("a refill lets it in")
            .unwrap();
    }
}
