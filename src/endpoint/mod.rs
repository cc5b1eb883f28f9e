//! An upstream's endpoints: the addresses its connections go to, each with its load and
//! health; where the next connection goes (`balance`); ejection of failing ones (`outlier`);
//! and, for a host name, the DNS answer kept fresh by its TTL, with endpoints that leave it
//! drained.
//!
//! # Balance
//! Only new connections are balanced: which idle connection a request reuses, the cap and the
//! wait queue stay the pool's, and `max_lifetime` keeps rebalancing over time. An endpoint's
//! load is its open connections, dials in flight included (a [`Claim`] counts from the pick to
//! the socket's close), so a burst of dials spreads at once.
//! - `least_connections` (the default): the fewest open connections; ties in turn, starting
//!   from the first address in order (IPv6 first in a DNS answer, as RFC 8305 wants).
//! - `p2c_ewma`: two endpoints drawn at random, the one with the lower cost kept, where cost is
//!   a peak-sensitive moving average of response-head latency (seeded by the TCP handshake)
//!   times (open connections + 1): linkerd2-proxy's choice.
//!
//! tower's `balance::p2c` and `load::PeakEwma` are not used: they balance *requests* over
//! endpoint `Service`s that are each polled for readiness, while here a request takes any idle
//! connection of the upstream and only a dial chooses an endpoint, under one per-upstream cap
//! and queue that tower's balancer has no place for. The cost function is the same as theirs.
//!
//! # DNS
//! A set for a host name resolves on the first dial, then a task refreshes the answer when it
//! expires, for as long as the set is used (a dial since the last refresh, or an open
//! connection); an unused set stops refreshing and resolves again on its next dial. A failed
//! refresh keeps the last good answer until `dns.max_ttl` has passed since it was got, retrying
//! every `dns.min_ttl`; a host that never resolved fails the dial with the resolver's error.

pub mod dns;
mod outlier;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::config::{Authority, Balance, OutlierConfig};
use crate::error::{ErrorKind, ProxyError};
use crate::metrics::UpstreamMetrics;
use crate::policy::Guard;
use crate::rng::Xorshift;
use outlier::Health;

/// How fast the latency average forgets (linkerd2-proxy's default decay).
const EWMA_DECAY: Duration = Duration::from_secs(10);
/// The latency assumed of an endpoint never measured.
const DEFAULT_RTT: Duration = Duration::from_millis(30);

/// What a set is built from.
#[derive(Debug)]
pub struct SetSpec {
    /// The upstream's label, in errors and logs.
    pub label: Arc<str>,
    /// Host and port: the name resolved (unless `addresses` is set) and the port of its answers.
    pub authority: Authority,
    /// Static endpoints; empty means resolve `authority`.
    pub addresses: Vec<SocketAddr>,
    /// The parent proxy `authority` is (shown without credentials), when the upstream is
    /// reached through one: the operator chose it, so its addresses are not policy-checked.
    pub parent: Option<Arc<str>>,
    /// Where new connections go.
    pub balance: Balance,
    /// When an endpoint is ejected.
    pub outlier: OutlierConfig,
    /// The sidecar's resolver.
    pub resolver: Arc<dns::Resolver>,
    /// The upstream's metrics (ejections, DNS refreshes and failures).
    pub metrics: UpstreamMetrics,
}

/// One address of an upstream.
#[derive(Debug)]
pub struct Endpoint {
    addr: SocketAddr,
    /// Connections open or dialing, counted by [`Claim`]s.
    open: AtomicUsize,
    /// Left the DNS answer: its connections close once idle.
    removed: AtomicBool,
    /// Connect failures and resets in a row.
    failures: AtomicU32,
    health: Mutex<Health>,
    latency: Mutex<Ewma>,
}

#[derive(Debug, Default)]
struct Ewma {
    nanos: f64,
    at: Option<Instant>,
}

impl Endpoint {
    fn new(addr: SocketAddr) -> Arc<Self> {
        Arc::new(Endpoint {
            addr,
            open: AtomicUsize::new(0),
            removed: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            health: Mutex::new(Health::default()),
            latency: Mutex::new(Ewma::default()),
        })
    }

    /// The address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether it left the DNS answer (its connections are drained).
    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Relaxed)
    }

    fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    fn health(&self) -> MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection was made, or a response head came back: the failure run and the backoff
    /// end. One load when there was none (every request calls this).
    pub fn succeeded(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
            self.health().ejections = 0;
        }
    }

    /// Feeds the latency average (p2c_ewma): a sample above the average replaces it (peak
    /// sensitivity), one below pulls it down as far as the time since the last sample allows.
    pub fn observe_latency(&self, took: Duration) {
        let now = Instant::now();
        let mut ewma = self.latency.lock().unwrap_or_else(|p| p.into_inner());
        let sample = took.as_nanos() as f64;
        ewma.nanos = match ewma.at {
            Some(at) if sample < ewma.nanos => {
                let elapsed = now.saturating_duration_since(at).as_secs_f64();
                let weight = (-elapsed / EWMA_DECAY.as_secs_f64()).exp();
                ewma.nanos * weight + sample * (1.0 - weight)
            }
            _ => sample,
        };
        ewma.at = Some(now);
    }

    /// Seeds the latency average with a TCP handshake's time, until a response is measured.
    pub fn seed_latency(&self, rtt: Duration) {
        let mut ewma = self.latency.lock().unwrap_or_else(|p| p.into_inner());
        if ewma.at.is_none() {
            ewma.nanos = rtt.as_nanos() as f64;
            ewma.at = Some(Instant::now());
        }
    }

    /// p2c_ewma's cost: latency times load.
    fn cost(&self) -> f64 {
        let ewma = self.latency.lock().unwrap_or_else(|p| p.into_inner());
        let nanos = if ewma.at.is_some() {
            ewma.nanos
        } else {
            DEFAULT_RTT.as_nanos() as f64
        };
        nanos * (self.open() + 1) as f64
    }
}

/// An endpoint's place in its load count: from the pick of a dial until the connection's
/// socket closes (the pool keeps it with the connection's place under the cap).
#[derive(Debug)]
pub struct Claim {
    endpoint: Arc<Endpoint>,
}

impl Claim {
    fn new(endpoint: Arc<Endpoint>) -> Self {
        endpoint.open.fetch_add(1, Ordering::Relaxed);
        Claim { endpoint }
    }

    /// The endpoint claimed.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.endpoint.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The endpoints one dial tries, in order: the balance's pick first (claimed), then the others
/// by load, ejected ones last.
#[derive(Debug)]
pub struct Plan {
    /// The endpoints to try, in order.
    pub attempts: Vec<Arc<Endpoint>>,
    claim: Claim,
}

impl Plan {
    /// The claim for the endpoint that won the race: the pick's own, or moved to another.
    pub fn claim_for(self, winner: usize) -> Claim {
        match self.attempts.get(winner) {
            Some(ep) if !Arc::ptr_eq(ep, &self.claim.endpoint) => Claim::new(ep.clone()),
            _ => self.claim,
        }
    }
}

/// An upstream's endpoints.
pub struct Set {
    label: Arc<str>,
    authority: Authority,
    /// Whether `authority` is a name to resolve (not static addresses, not an IP).
    resolves: bool,
    /// Whether the fixed endpoint is the IP the request named, which the policy checks (static
    /// `addresses` are the operator's own choice and are not checked).
    checks_ip: bool,
    /// The parent proxy these endpoints are: resolved, never policy-checked.
    parent: Option<Arc<str>>,
    resolver: Arc<dns::Resolver>,
    metrics: UpstreamMetrics,
    /// `balance` is `p2c_ewma`: read per response, so not behind the lock.
    p2c: AtomicBool,
    inner: Mutex<Inner>,
    /// One resolution at a time: a burst of dials on a cold set asks once.
    resolving: tokio::sync::Mutex<()>,
    /// Told when endpoints leave the answer, so that pools close their idle connections.
    drain_hooks: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
}

impl std::fmt::Debug for Set {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Set")
            .field("label", &self.label)
            .field("authority", &self.authority)
            .finish_non_exhaustive()
    }
}

struct Inner {
    /// In answer (or configured) order.
    endpoints: Vec<Arc<Endpoint>>,
    /// Endpoints that left the answer and still have connections.
    draining: Vec<Arc<Endpoint>>,
    /// The round-robin cursor for ties.
    next: usize,
    balance: Balance,
    outlier: OutlierConfig,
    dns: DnsState,
    /// p2c_ewma's draws.
    rng: Xorshift,
}

#[derive(Debug, Default)]
struct DnsState {
    /// When the answer expires; `None` before the first one.
    valid_until: Option<Instant>,
    /// When the last good answer came.
    last_ok: Option<Instant>,
    refreshes: u64,
    failures: u64,
    last_error: Option<String>,
    /// A refresh task is alive.
    refreshing: bool,
    /// A dial planned since the last refresh.
    used: bool,
}

impl Set {
    /// A set for `spec`: its static addresses, its IP, or (resolved on first use) its host name.
    pub fn new(spec: SetSpec) -> Arc<Self> {
        let ip = spec.authority.host.parse().ok();
        let fixed: Vec<SocketAddr> = match ip {
            _ if !spec.addresses.is_empty() => spec.addresses.clone(),
            Some(ip) => vec![SocketAddr::new(ip, spec.authority.port)],
            None => Vec::new(),
        };
        let rng = Xorshift::seeded(&*spec.label);
        Arc::new(Set {
            resolves: fixed.is_empty(),
            checks_ip: spec.addresses.is_empty() && ip.is_some() && spec.parent.is_none(),
            parent: spec.parent,
            label: spec.label,
            authority: spec.authority,
            resolver: spec.resolver,
            metrics: spec.metrics,
            p2c: AtomicBool::new(spec.balance == Balance::P2cEwma),
            inner: Mutex::new(Inner {
                endpoints: fixed.into_iter().map(Endpoint::new).collect(),
                draining: Vec::new(),
                next: 0,
                balance: spec.balance,
                outlier: spec.outlier,
                dns: DnsState::default(),
                rng,
            }),
            resolving: tokio::sync::Mutex::new(()),
            drain_hooks: Mutex::new(Vec::new()),
        })
    }

    /// A set of one static address, with the default balance and outlier settings (pools
    /// dialed in memory, in tests and benches).
    #[cfg(any(test, feature = "test-support"))]
    pub fn single(label: Arc<str>, addr: SocketAddr, metrics: UpstreamMetrics) -> Arc<Self> {
        Set::new(SetSpec {
            authority: Authority {
                host: addr.ip().to_string(),
                port: addr.port(),
            },
            label,
            addresses: vec![addr],
            parent: None,
            balance: Balance::LeastConnections,
            outlier: OutlierConfig::default(),
            resolver: Arc::new(dns::Resolver::new(&Default::default())),
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn error(&self, kind: ErrorKind, cause: impl Into<String>) -> ProxyError {
        ProxyError::new(kind, cause).with_upstream(&*self.label)
    }

    /// Applies reloaded settings.
    pub fn reconfigure(&self, balance: Balance, outlier: OutlierConfig) {
        let mut inner = self.lock();
        inner.balance = balance;
        inner.outlier = outlier;
        self.p2c.store(balance == Balance::P2cEwma, Ordering::Relaxed);
    }

    /// Whether response latencies are wanted (`p2c_ewma`).
    pub fn wants_latency(&self) -> bool {
        self.p2c.load(Ordering::Relaxed)
    }

    /// Calls `hook` whenever endpoints leave the answer.
    pub fn on_drain(&self, hook: Box<dyn Fn() + Send + Sync>) {
        self.drain_hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// The endpoints for one dial, the first claimed. Resolves first when the set has no fresh
    /// answer and no refresh task keeps one; checks resolved addresses against the policy.
    pub async fn plan(self: &Arc<Self>, guard: &Guard) -> Result<Plan, ProxyError> {
        self.ensure_resolved(guard).await?;
        let mut inner = self.lock();
        let attempts = inner.order(Instant::now());
        let first = attempts
            .first()
            .cloned()
            .ok_or_else(|| self.no_endpoints(&inner))?;
        Ok(Plan {
            attempts,
            claim: Claim::new(first),
        })
    }

    /// The addresses a dial outside the pool (an upgrade) tries, in a plan's order, unclaimed.
    pub async fn addresses(self: &Arc<Self>, guard: &Guard) -> Result<Vec<SocketAddr>, ProxyError> {
        self.ensure_resolved(guard).await?;
        let mut inner = self.lock();
        let order = inner.order(Instant::now());
        if order.is_empty() {
            return Err(self.no_endpoints(&inner));
        }
        Ok(order.iter().map(|ep| ep.addr).collect())
    }

    fn no_endpoints(&self, inner: &Inner) -> ProxyError {
        let why = inner.dns.last_error.as_deref().unwrap_or("no addresses");
        self.error(
            ErrorKind::ConnectFailed,
            format!("resolving {}: {why}", self.authority.host),
        )
    }

    async fn ensure_resolved(self: &Arc<Self>, guard: &Guard) -> Result<(), ProxyError> {
        if !self.resolves {
            if self.checks_ip {
                return self.check_policy(guard);
            }
            return Ok(());
        }
        if !self.needs_resolving(Instant::now()) {
            return self.check_policy(guard);
        }
        // On a task of its own: a dial whose deadline passes first stops waiting, but the
        // lookup still ends, and is counted and recorded, and the next dial finds its answer.
        let set = self.clone();
        let resolving = tokio::spawn(async move {
            let _one = set.resolving.lock().await;
            if set.needs_resolving(Instant::now()) {
                set.refresh().await;
                let mut inner = set.lock();
                if !inner.dns.refreshing && !inner.endpoints.is_empty() {
                    inner.dns.refreshing = true;
                    tokio::spawn(refresh_while_used(Arc::downgrade(&set)));
                }
            }
        });
        if let Err(e) = resolving.await {
            return Err(self.error(ErrorKind::ConnectFailed, format!("resolving: {e}")));
        }
        self.check_policy(guard)
    }

    /// The host name this set resolves, if it resolves one.
    pub fn resolved_name(&self) -> Option<&str> {
        self.resolves.then_some(self.authority.host.as_str())
    }

    fn check_policy(&self, guard: &Guard) -> Result<(), ProxyError> {
        let inner = self.lock();
        if inner.endpoints.is_empty() {
            return Err(self.no_endpoints(&inner));
        }
        if self.parent.is_some() {
            return Ok(());
        }
        let addrs: Vec<SocketAddr> = inner.endpoints.iter().map(|e| e.addr).collect();
        drop(inner);
        guard.check_addresses(&self.label, &self.authority, &addrs)
    }

    /// Marks the set used, and says whether a dial must resolve first.
    fn needs_resolving(&self, now: Instant) -> bool {
        let mut inner = self.lock();
        inner.dns.used = true;
        let fresh = inner.dns.valid_until.is_some_and(|v| now < v);
        !(fresh || inner.dns.refreshing && !inner.endpoints.is_empty())
    }

    /// Asks the resolver once and applies the answer (or the failure).
    async fn refresh(&self) {
        let found = self.resolver.lookup(&self.authority.host).await;
        self.metrics.dns_refreshes.inc();
        let dns = self.resolver.config();
        let now = Instant::now();
        let removed = {
            let mut inner = self.lock();
            inner.dns.refreshes += 1;
            match found {
                Ok(answer) => {
                    inner.dns.valid_until = Some(answer.valid_until);
                    inner.dns.last_ok = Some(now);
                    inner.dns.last_error = None;
                    let addrs = answer
                        .ips
                        .into_iter()
                        .map(|ip| SocketAddr::new(ip, self.authority.port));
                    inner.replace(addrs.collect())
                }
                Err(why) => {
                    self.metrics.dns_failures.inc();
                    inner.dns.failures += 1;
                    inner.dns.valid_until = Some(now + dns.min_ttl);
                    let stale = inner.dns.last_ok.is_none_or(|ok| now >= ok + dns.max_ttl);
                    tracing::warn!(
                        upstream = %self.label,
                        host = %self.authority.host,
                        keeping = !stale && !inner.endpoints.is_empty(),
                        "resolving failed: {why}"
                    );
                    inner.dns.last_error = Some(why);
                    if stale {
                        inner.replace(Vec::new())
                    } else {
                        false
                    }
                }
            }
        };
        if removed {
            for hook in self.drain_hooks.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                hook();
            }
        }
    }

    /// A connect attempt to `endpoint` failed, or a connection to it was reset: one more in its
    /// run of failures, which may eject it.
    pub fn failed(&self, endpoint: &Endpoint) {
        let failures = endpoint
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        let inner = self.lock();
        if failures < inner.outlier.consecutive_failures {
            return;
        }
        let now = Instant::now();
        let ejected = inner
            .endpoints
            .iter()
            .filter(|e| e.health().is_ejected(now))
            .count();
        let mut health = endpoint.health();
        if health.is_ejected(now)
            || endpoint.is_removed()
            || !outlier::ejects(&inner.outlier, failures, ejected, inner.endpoints.len())
        {
            return;
        }
        let length = outlier::ejection_length(&inner.outlier, health.ejections);
        health.ejections += 1;
        health.ejected_until = Some(now + length);
        drop(health);
        drop(inner);
        self.metrics.ejections.inc();
        tracing::warn!(
            upstream = %self.label,
            endpoint = %endpoint.addr,
            failures,
            "endpoint ejected for {}",
            humantime::format_duration(length)
        );
    }

    /// Endpoints by state: active, ejected, draining.
    pub fn counts(&self) -> EndpointCounts {
        let now = Instant::now();
        let mut inner = self.lock();
        inner.draining.retain(|e| e.open() > 0);
        let ejected = inner
            .endpoints
            .iter()
            .filter(|e| e.health().is_ejected(now))
            .count();
        EndpointCounts {
            active: inner.endpoints.len() - ejected,
            ejected,
            draining: inner.draining.len(),
        }
    }

    /// What `/debug/pools` shows; `idle` counts a pool's idle connections to an address.
    pub fn report(&self, idle: impl Fn(SocketAddr) -> usize) -> SetReport {
        let now = Instant::now();
        let wall = SystemTime::now();
        let mut inner = self.lock();
        inner.draining.retain(|e| e.open() > 0);
        let endpoints = inner
            .endpoints
            .iter()
            .chain(&inner.draining)
            .map(|ep| {
                let health = *ep.health();
                let left = health
                    .ejected_until
                    .filter(|_| health.is_ejected(now))
                    .map(|until| until.saturating_duration_since(now));
                EndpointReport {
                    address: ep.addr.to_string(),
                    state: if ep.is_removed() {
                        "draining"
                    } else if left.is_some() {
                        "ejected"
                    } else {
                        "active"
                    },
                    open: ep.open(),
                    idle: idle(ep.addr),
                    consecutive_failures: ep.failures.load(Ordering::Relaxed),
                    ejections: health.ejections,
                    ejected_until: left.map(|d| humantime::format_rfc3339_millis(wall + d).to_string()),
                    ejected_for_ms: left.map(|d| d.as_millis() as u64),
                }
            })
            .collect();
        let dns = self.resolves.then(|| DnsReport {
            host: self.authority.host.to_string(),
            refreshes: inner.dns.refreshes,
            failures: inner.dns.failures,
            expires_in_ms: inner
                .dns
                .valid_until
                .map(|v| v.saturating_duration_since(now).as_millis() as u64),
            last_error: inner.dns.last_error.clone(),
        });
        SetReport {
            endpoints,
            dns,
            via: self.parent.as_deref().map(str::to_owned),
        }
    }
}

impl Inner {
    /// Replaces the endpoints with `addrs`, keeping the records of those that stay (or come
    /// back); those that leave are marked removed and kept while they have connections.
    /// Returns whether any left.
    fn replace(&mut self, addrs: Vec<SocketAddr>) -> bool {
        let mut old: Vec<Arc<Endpoint>> = std::mem::take(&mut self.endpoints);
        old.append(&mut self.draining);
        let mut next = Vec::with_capacity(addrs.len());
        for addr in addrs {
            if next.iter().any(|e: &Arc<Endpoint>| e.addr == addr) {
                continue;
            }
            let ep = match old.iter().position(|e| e.addr == addr) {
                Some(i) => old.swap_remove(i),
                None => Endpoint::new(addr),
            };
            ep.removed.store(false, Ordering::Relaxed);
            next.push(ep);
        }
        let mut left = false;
        for ep in old {
            left |= !ep.is_removed();
            ep.removed.store(true, Ordering::Relaxed);
            if ep.open() > 0 {
                self.draining.push(ep);
            }
        }
        self.endpoints = next;
        left
    }

    /// A dial's order: the balance's pick, then the others by load, ejected ones last.
    fn order(&mut self, now: Instant) -> Vec<Arc<Endpoint>> {
        let n = self.endpoints.len();
        if n == 0 {
            return Vec::new();
        }
        let usable: Vec<bool> = self
            .endpoints
            .iter()
            .map(|e| !e.health().is_ejected(now))
            .collect();
        // `failed` never ejects more than half, but a reload may lower the set meanwhile.
        let any_usable = usable.iter().any(|u| *u);
        let eligible = |i: usize| usable[i] || !any_usable;
        let pick = match self.balance {
            Balance::LeastConnections => self.least_connections(&eligible),
            Balance::P2cEwma => self.p2c(&eligible),
        };
        let mut rest: Vec<usize> = (0..n).filter(|&i| i != pick).collect();
        rest.sort_by_key(|&i| (!eligible(i), self.endpoints[i].open()));
        let mut order = Vec::with_capacity(n);
        order.push(self.endpoints[pick].clone());
        order.extend(rest.into_iter().map(|i| self.endpoints[i].clone()));
        interleave_families(order, |e| e.addr.is_ipv6())
    }

    fn least_connections(&mut self, eligible: &dyn Fn(usize) -> bool) -> usize {
        let n = self.endpoints.len();
        let start = self.next % n;
        let mut best: Option<(usize, usize)> = None;
        for k in 0..n {
            let i = (start + k) % n;
            if !eligible(i) {
                continue;
            }
            let open = self.endpoints[i].open();
            if best.is_none_or(|(_, least)| open < least) {
                best = Some((i, open));
            }
        }
        let pick = best.map_or(start, |(i, _)| i);
        self.next = pick + 1;
        pick
    }

    fn p2c(&mut self, eligible: &dyn Fn(usize) -> bool) -> usize {
        let candidates: Vec<usize> = (0..self.endpoints.len()).filter(|&i| eligible(i)).collect();
        match candidates.len() {
            0 => 0,
            1 => candidates[0],
            len => {
                let a = self.draw(len);
                let b = (a + 1 + self.draw(len - 1)) % len;
                let (a, b) = (candidates[a], candidates[b]);
                if self.endpoints[b].cost() < self.endpoints[a].cost() {
                    b
                } else {
                    a
                }
            }
        }
    }

    /// A uniform-enough draw in `0..n`.
    fn draw(&mut self, n: usize) -> usize {
        self.rng.below(n as u64) as usize
    }
}

/// Alternates address families after the first item, starting with the other family
/// (RFC 8305 §4), keeping the order within each family.
pub fn interleave_families<T>(order: Vec<T>, is_v6: impl Fn(&T) -> bool) -> Vec<T> {
    let mut iter = order.into_iter();
    let Some(first) = iter.next() else {
        return Vec::new();
    };
    let first_v6 = is_v6(&first);
    let (mut same, mut other): (std::collections::VecDeque<_>, std::collections::VecDeque<_>) =
        iter.partition(|e| is_v6(e) == first_v6);
    let mut out = vec![first];
    while !same.is_empty() || !other.is_empty() {
        out.extend(other.pop_front());
        out.extend(same.pop_front());
    }
    out
}

/// Refreshes a set's answer when it expires, while the set is used; ends when the set is
/// dropped or unused (its next dial resolves again).
async fn refresh_while_used(set: Weak<Set>) {
    loop {
        let wake = {
            let Some(set) = set.upgrade() else { return };
            let inner = set.lock();
            inner.dns.valid_until.unwrap_or_else(Instant::now)
        };
        tokio::time::sleep_until(wake).await;
        let Some(set) = set.upgrade() else { return };
        {
            let mut inner = set.lock();
            let busy = inner.dns.used
                || inner
                    .endpoints
                    .iter()
                    .chain(&inner.draining)
                    .any(|e| e.open() > 0);
            if !busy {
                inner.dns.refreshing = false;
                return;
            }
            inner.dns.used = false;
        }
        let _one = set.resolving.lock().await;
        set.refresh().await;
    }
}

/// Endpoints by state, for the gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointCounts {
    /// In the answer and not ejected.
    pub active: usize,
    /// Ejected for now.
    pub ejected: usize,
    /// Left the answer, connections still open.
    pub draining: usize,
}

/// A set as `/debug/pools` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SetReport {
    /// Each endpoint, in answer order, then the draining ones.
    pub endpoints: Vec<EndpointReport>,
    /// The DNS answer's state, for a set that resolves a name.
    pub dns: Option<DnsReport>,
    /// The parent proxy these endpoints are, if they are one.
    pub via: Option<String>,
}

/// One endpoint as `/debug/pools` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EndpointReport {
    /// IP and port.
    pub address: String,
    /// `active`, `ejected` or `draining`.
    pub state: &'static str,
    /// Connections open or dialing.
    pub open: usize,
    /// Connections idle in the pool.
    pub idle: usize,
    /// Connect failures and resets in a row.
    pub consecutive_failures: u32,
    /// Ejections since its last success.
    pub ejections: u32,
    /// While ejected: until when (RFC 3339, UTC).
    pub ejected_until: Option<String>,
    /// While ejected: for how much longer.
    pub ejected_for_ms: Option<u64>,
}

/// The DNS state of a set, as `/debug/pools` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DnsReport {
    /// The name resolved.
    pub host: String,
    /// Resolutions so far.
    pub refreshes: u64,
    /// Resolutions that failed.
    pub failures: u64,
    /// When the answer expires.
    pub expires_in_ms: Option<u64>,
    /// Why the last resolution failed, if it did.
    pub last_error: Option<String>,
}

#[cfg(test)]
mod tests;
