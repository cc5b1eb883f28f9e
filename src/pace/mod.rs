//! Pacing to an upstream's advertised rate limits: what its responses say is left of each
//! pace key's quota, and holding requests (in order, by priority) until the quota allows them,
//! instead of letting them collect 429s and stampede at the reset.
//!
//! A [`Pacer`] belongs to one upstream and outlives reloads that keep its name. Its state is
//! per **pace key**: the upstream, a keyed hash of the credential the request carries
//! (`Authorization`, `x-api-key`, `api-key`, or a value `request_headers` injects) and the
//! value of `x-egress-pace-key`. The hash is SipHash under a key drawn at start
//! ([`RandomState`]): the credential is never kept, logged or shown, only the hash's first
//! eight hex digits on `/debug/pools`.
//!
//! Until an upstream's responses carry a limit field, its pacer holds no key and a request
//! costs a load and a branch: pacing is on for every upstream, hosts met on the fly included,
//! and acts only on what that upstream says. Nothing here is a library's: tower's rate limiter
//! and governor pace to a rate fixed in advance, not to a remaining count and a reset that
//! each response moves, and neither queues by priority.
//!
//! What a response says is read by [`report`]; the per-key state and its queue are `key`;
//! waiting is [`Waiting`]. Not here: where requests are admitted (`proxy::admit`) and where
//! responses are read (`upstream`).

pub mod report;

mod key;
mod wait;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName};
use prometheus_client::metrics::gauge::Gauge;
use serde::Serialize;
use tokio::time::Instant;

use crate::config::PaceConfig;
use crate::metrics::{Metrics, PaceMetrics};
use crate::wire::WireFields;

use key::{Key, Verdict};
pub use report::Report;
pub use wait::{Refusal, Waiting};

/// Which requests go first when a key's requests wait: `x-egress-priority`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// Served before the others.
    High = 0,
    /// The default.
    #[default]
    Normal = 1,
    /// Served after the others.
    Low = 2,
}

impl Priority {
    /// `high`, `normal` or `low`, in any case.
    pub fn parse(text: &str) -> Option<Self> {
        [
            ("high", Priority::High),
            ("normal", Priority::Normal),
            ("low", Priority::Low),
        ]
        .into_iter()
        .find(|(name, _)| text.eq_ignore_ascii_case(name))
        .map(|(_, priority)| priority)
    }
}

/// What a request asked of its pacing: `x-egress-pace-key` (hashed) and `x-egress-priority`,
/// and whether it came with a credential field.
#[derive(Debug, Clone, Copy, Default)]
pub struct Asked {
    /// A hash of `x-egress-pace-key`, when sent: it splits the credential's key (by model, say).
    pub tag: Option<u64>,
    /// Its class in the queue.
    pub priority: Priority,
    /// The application sent one of [`CREDENTIALS`] (the walk over its names saw it): a request
    /// with none, to an upstream whose `request_headers` set none, is looked up no further.
    pub credential: bool,
}

impl Asked {
    /// The tag of an `x-egress-pace-key` value. Not keyed: the value names a model or a tenant,
    /// not a secret, and the key it joins is hashed under the pacer's key again.
    pub fn tag(value: &[u8]) -> u64 {
        let mut hasher = std::hash::DefaultHasher::new();
        value.hash(&mut hasher);
        hasher.finish()
    }
}

/// The names a request's credential is read from, in this order, before those its upstream's
/// `request_headers` set.
pub const CREDENTIALS: [HeaderName; 3] = [
    http::header::AUTHORIZATION,
    HeaderName::from_static("x-api-key"),
    HeaderName::from_static("api-key"),
];

/// Where an upstream's requests carry their credential: [`CREDENTIALS`], then the names its
/// `request_headers` set.
#[derive(Debug, Clone)]
pub struct Credentials {
    names: Box<[HeaderName]>,
    /// `request_headers` sets some name: a request may carry a credential the application
    /// did not send, so its fields are always looked up.
    injected: bool,
}

impl Credentials {
    /// The names to read for an upstream whose `request_headers` set `set`.
    pub fn new<'a>(set: impl IntoIterator<Item = &'a HeaderName>) -> Self {
        let mut names = CREDENTIALS.to_vec();
        let mut injected = false;
        for name in set {
            injected = true;
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        Credentials {
            names: names.into_boxed_slice(),
            injected,
        }
    }
}

impl Default for Credentials {
    fn default() -> Self {
        Credentials::new([])
    }
}

/// A pace key's hash. 0 is the key of requests with neither a credential nor a tag.
pub type KeyId = u64;

/// One upstream's pacing state.
#[derive(Debug)]
pub struct Pacer {
    label: Arc<str>,
    /// Keys the upstream's responses told something of. Empty until a response carries a
    /// limit field: admission then looks no further.
    keys: Mutex<Keys>,
    /// Some answer of the upstream carried a limit field: until then a request is admitted
    /// with a plain load instead of the lock.
    known: std::sync::atomic::AtomicBool,
    hash_key: std::collections::hash_map::RandomState,
    /// The settings in force, for `/debug/pools` (requests are given their upstream's).
    config: Mutex<PaceConfig>,
    metrics: PaceMetrics,
}

/// A pacer's keys, and when to sweep out those nothing holds.
#[derive(Debug)]
struct Keys {
    map: HashMap<KeyId, Arc<Key>>,
    /// The count at which a new key first sweeps: twice what the last sweep kept, so a map
    /// of live keys grows at a sweep per doubling and one of spent keys stays bounded.
    sweep_at: usize,
}

impl Default for Keys {
    fn default() -> Self {
        Keys {
            map: HashMap::new(),
            sweep_at: MIN_SWEEP,
        }
    }
}

/// The fewest keys a sweep is worth.
const MIN_SWEEP: usize = 64;

/// What pacing decided for a request.
#[derive(Debug)]
pub enum Pass {
    /// It may go now.
    Go,
    /// It waits its turn. Boxed: every request's admission returns a `Pass` (with pacing off,
    /// `Go`), and at the waiter's size it came back through a `memcpy` call.
    Wait(Box<Waiting>),
    /// It would wait past its `max_wait` or deadline.
    Refuse(Refusal),
}

/// A request's place in its key's accounting, from admission to its response head: it counts
/// as in flight while it is out, and the response's fields are credited to its key.
///
/// Sixteen bytes: every request's future carries one to its response head.
#[derive(Debug, Default)]
pub struct Ticket(Held);

#[derive(Debug, Default)]
enum Held {
    /// Pacing is off.
    #[default]
    Off,
    /// The upstream's pacer knew no key when the request was admitted: only its key's hash,
    /// for an answer that turns out to carry limit fields.
    Untracked(KeyId),
    /// The key's state, whether the request went (it counts as in flight until the ticket
    /// drops), and the tokens it was charged when it went.
    Tracked { key: Arc<Key>, out: bool, charged: u32 },
}

impl Ticket {
    /// The request goes upstream now: it counts as in flight until the ticket drops. By
    /// value: a ticket borrowed in a future stays in its state across every later await.
    /// Inlined: most requests go to hosts that are not paced, whose ticket is untracked.
    #[must_use]
    #[inline(always)]
    pub fn going(mut self) -> Self {
        if let Held::Tracked { out: false, .. } = &self.0 {
            self.0.go();
        }
        self
    }
}

impl Held {
    #[inline(never)]
    fn go(&mut self) {
        if let Held::Tracked {
            key,
            out: out @ false,
            charged,
        } = self
        {
            key.sent();
            *out = true;
            if key.counts_tokens() {
                *charged = key.charge(Instant::now());
            }
        }
    }
}

impl Ticket {
    /// The response head is in: the request no longer counts as in flight. What settles its
    /// tokens once its answer's usage is read, when its key counts tokens. A retry is not
    /// charged again: the request's one charge is settled by the answer it ends with.
    pub fn into_spend(mut self) -> Option<Spend> {
        let Held::Tracked { key, out, charged } = std::mem::take(&mut self.0) else {
            return None;
        };
        if out {
            key.returned();
        }
        (out && key.counts_tokens()).then_some(Spend {
            key,
            charged,
            settled: false,
        })
    }
}

/// A request's answer, to settle what it spent in its pace key's tokens (see `key`); dropped
/// unsettled (its usage not read), it gives the request's charge back.
#[derive(Debug)]
pub struct Spend {
    key: Arc<Key>,
    charged: u32,
    settled: bool,
}

impl Spend {
    /// The answer spent `tokens`.
    pub fn settle(mut self, tokens: &crate::llm::Tokens) {
        self.settled = true;
        self.key.spent(tokens, self.charged, Instant::now());
    }
}

impl Drop for Spend {
    fn drop(&mut self) {
        if !self.settled && self.charged > 0 {
            self.key.refund(self.charged, Instant::now());
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Held::Tracked { key, out: true, .. } = &self.0 {
            key.returned();
        }
    }
}

impl Pacer {
    /// The pacer of the upstream `label`.
    pub fn new(label: Arc<str>, config: PaceConfig, metrics: &Metrics) -> Arc<Self> {
        Arc::new(Pacer {
            config: Mutex::new(config),
            metrics: metrics.pace(&label),
            label,
            keys: Mutex::default(),
            known: Default::default(),
            hash_key: Default::default(),
        })
    }

    /// Takes the settings of a reloaded upstream of the same name.
    pub fn configure(&self, config: PaceConfig) {
        *self.config.lock().unwrap_or_else(|e| e.into_inner()) = config;
    }

    /// Decides for a request with `headers` (as they will be sent), which asked for `asked`
    /// and must have its response head by `deadline`. `credentials`: where its credential is
    /// read, in order.
    #[inline]
    pub fn admit(
        &self,
        config: &PaceConfig,
        headers: &HeaderMap,
        credentials: &Credentials,
        asked: Asked,
        deadline: Option<Instant>,
    ) -> (Ticket, Pass) {
        if !config.enabled {
            return (Ticket::default(), Pass::Go);
        }
        // Most requests carry no credential field and no tag: the anonymous key, at once.
        let id = if !asked.credential && asked.tag.is_none() && !credentials.injected {
            0
        } else {
            self.key_id(headers, credentials, asked)
        };
        if !self.known.load(std::sync::atomic::Ordering::Acquire) {
            return (Ticket(Held::Untracked(id)), Pass::Go);
        }
        self.admit_known(config, id, asked.priority, deadline)
    }

    #[cold]
    fn admit_known(
        &self,
        config: &PaceConfig,
        id: KeyId,
        priority: Priority,
        deadline: Option<Instant>,
    ) -> (Ticket, Pass) {
        let key = self.key(id);
        let now = Instant::now();
        let give_up = deadline.map_or(now + config.max_wait, |at| at.min(now + config.max_wait));
        let pass = match key.admit(now, config, priority, give_up) {
            Verdict::Go => Pass::Go,
            Verdict::Wait(place) => {
                self.metrics.waits.inc();
                Pass::Wait(Box::new(Waiting::new(
                    key.clone(),
                    place,
                    give_up,
                    *config,
                    self.metrics.clone(),
                )))
            }
            Verdict::Refuse(reset) => {
                self.metrics.rejected.inc();
                Pass::Refuse(Refusal::until(reset, now))
            }
        };
        let held = Held::Tracked {
            key,
            out: false,
            charged: 0,
        };
        (Ticket(held), pass)
    }

    /// The key of a request: its credential (the first of `credentials` present) and its tag.
    fn key_id(&self, headers: &HeaderMap, credentials: &Credentials, asked: Asked) -> KeyId {
        let tag = asked.tag;
        let look = asked.credential || credentials.injected;
        let credential = credentials
            .names
            .iter()
            .take(if look { credentials.names.len() } else { 0 })
            .find_map(|name| headers.get(name));
        if credential.is_none() && tag.is_none() {
            return 0;
        }
        let mut hasher = self.hash_key.build_hasher();
        credential.map(|v| v.as_bytes()).hash(&mut hasher);
        tag.hash(&mut hasher);
        // 0 stays the key of requests that carry neither.
        hasher.finish().max(1)
    }

    /// The state of key `id`, made when new. A key nothing holds (no request out or waiting,
    /// no reset or `Retry-After` ahead) is forgotten when the map has doubled since the last
    /// sweep: credentials and `x-egress-pace-key` values come and go, and a key they leave
    /// behind knows nothing that still binds.
    fn key(&self, id: KeyId) -> Arc<Key> {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(key) = keys.map.get(&id) {
            return key.clone();
        }
        if keys.map.len() >= keys.sweep_at {
            let now = Instant::now();
            keys.map
                .retain(|_, key| Arc::strong_count(key) > 1 || key.binds(now));
            keys.sweep_at = (keys.map.len() * 2).max(MIN_SWEEP);
        }
        let key = Arc::new(Key::new(id, self.metrics.clone()));
        keys.map.insert(id, key.clone());
        key
    }

    /// Credits what a response head with `status` says (its fields in `headers`, or as the
    /// lines of `wire`) to the key of `ticket`. Cheap when it carries no limit field.
    #[inline]
    pub fn observe(
        &self,
        config: &PaceConfig,
        ticket: &Ticket,
        status: u16,
        headers: &HeaderMap,
        wire: Option<&WireFields>,
    ) {
        if !config.enabled {
            return;
        }
        let limits = match wire {
            Some(wire) => wire.has_limit_fields(),
            None => headers
                .keys()
                .any(|name| crate::wire::names::is_limit_field(name.as_str().as_bytes())),
        };
        if limits {
            self.observe_fields(config, ticket, status, headers, wire);
        }
    }

    #[cold]
    fn observe_fields(
        &self,
        config: &PaceConfig,
        ticket: &Ticket,
        status: u16,
        headers: &HeaderMap,
        wire: Option<&WireFields>,
    ) {
        let mut malformed = |bad: report::Malformed| self.malformed(bad);
        let now = SystemTime::now();
        let report = match wire {
            Some(wire) => Report::read(status, wire.fields(), now, &mut malformed),
            None => Report::read(
                status,
                headers.iter().map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes())),
                now,
                &mut malformed,
            ),
        };
        if report.is_empty() {
            return;
        }
        let (key, counted) = match &ticket.0 {
            Held::Tracked { key, out, .. } => (key.clone(), *out),
            Held::Untracked(id) => (self.key(*id), false),
            Held::Off => return,
        };
        self.known.store(true, std::sync::atomic::Ordering::Release);
        key.apply(&report, Instant::now(), config, counted);
        self.set_remaining_gauges();
    }

    /// Whether an answer ever carried a limit field: then this pacer holds what the upstream
    /// said, which must outlive its connections.
    pub fn was_told(&self) -> bool {
        self.known.load(std::sync::atomic::Ordering::Acquire)
    }

    /// How long the key of `ticket` holds a retry of its request: a `Retry-After`, or no
    /// quota left; `None` when open.
    pub fn holds_for(&self, config: &PaceConfig, ticket: &Ticket) -> Option<Duration> {
        let key = self.known_key(config, ticket)?;
        key.holds_for(Instant::now(), config)
    }

    /// A retry of `ticket`'s request goes: it counts against its key's window.
    pub fn again(&self, config: &PaceConfig, ticket: &Ticket) {
        if let Some(key) = self.known_key(config, ticket) {
            key.again(Instant::now(), config);
        }
    }

    /// The state of `ticket`'s key, when pacing is on and knows it (an answer to a request
    /// admitted before any may have taught it since).
    fn known_key(&self, config: &PaceConfig, ticket: &Ticket) -> Option<Arc<Key>> {
        match (&ticket.0, config.enabled) {
            (Held::Tracked { key, .. }, true) => Some(key.clone()),
            (Held::Untracked(id), true) => {
                let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
                keys.map.get(id).cloned()
            }
            _ => None,
        }
    }

    /// Counts a limit field the upstream sent that was ignored, and logs the first.
    fn malformed(&self, bad: report::Malformed) {
        if self.metrics.header_errors.inc() == 0 {
            tracing::warn!(
                upstream = %self.label, header = %bad.header, value = %bad.value, error = %bad.why,
                "ignored a rate-limit field the upstream sent (logged once per upstream, counted in egress_pace_header_errors_total)"
            );
        }
    }

    /// `egress_upstream_ratelimit_remaining`: the lowest over the keys, per unit.
    fn set_remaining_gauges(&self) {
        let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let left: Vec<(Option<u64>, Option<u64>)> = keys.map.values().map(|key| key.remaining()).collect();
        drop(keys);
        set_gauge(
            &self.metrics.remaining_requests,
            left.iter().filter_map(|l| l.0).min(),
        );
        set_gauge(
            &self.metrics.remaining_tokens,
            left.iter().filter_map(|l| l.1).min(),
        );
    }

    /// The keys as `/debug/pools` shows them.
    pub fn report(&self) -> PaceReport {
        let config = *self.config.lock().unwrap_or_else(|e| e.into_inner());
        let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let mut keys: Vec<KeyReport> = keys.map.values().map(|key| key.report(now, &config)).collect();
        keys.sort_by(|a, b| a.key.cmp(&b.key));
        PaceReport {
            upstream: self.label.to_string(),
            keys,
        }
    }

    /// The upstream's label.
    pub fn label(&self) -> &str {
        &self.label
    }
}

fn set_gauge(gauge: &Gauge, value: Option<u64>) {
    if let Some(value) = value {
        gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
    }
}

/// One upstream's pace keys, as `/debug/pools` shows them.
#[derive(Debug, Clone, Serialize)]
pub struct PaceReport {
    /// The upstream's label.
    pub upstream: String,
    /// Its keys, by hash.
    pub keys: Vec<KeyReport>,
}

/// One pace key.
#[derive(Debug, Clone, Serialize)]
pub struct KeyReport {
    /// The first eight hex digits of the key's hash.
    pub key: String,
    /// Requests left before the reset, as the sidecar counts them (the last figure, less
    /// what went since); `None` when unknown.
    pub remaining_requests: Option<i64>,
    /// Tokens left, as last reported.
    pub remaining_tokens: Option<u64>,
    /// Milliseconds to the reset that binds (requests, else tokens), when known.
    pub reset_ms: Option<u64>,
    /// Whether requests for it wait now (a `Retry-After`, or no quota left).
    pub closed: bool,
    /// Requests waiting.
    pub waiters: usize,
}

/// The pacers alive now, for `/debug/pools`.
#[derive(Debug, Default)]
pub struct Registry {
    pacers: Mutex<Vec<Weak<Pacer>>>,
}

impl Registry {
    /// Adds `pacer`; it leaves when its last upstream is dropped.
    pub fn register(&self, pacer: &Arc<Pacer>) {
        let mut pacers = self.pacers.lock().unwrap_or_else(|e| e.into_inner());
        pacers.retain(|p| p.strong_count() > 0);
        pacers.push(Arc::downgrade(pacer));
    }

    /// Forgets pacers that are gone (a weak handle keeps a pacer's memory until dropped).
    pub fn prune(&self) {
        let mut pacers = self.pacers.lock().unwrap_or_else(|e| e.into_inner());
        crate::resident::prune_weak(&mut pacers);
    }

    /// The live pacers that know of a key, by upstream.
    pub fn report(&self) -> Vec<PaceReport> {
        let pacers = self.pacers.lock().unwrap_or_else(|e| e.into_inner());
        let mut reports: Vec<PaceReport> = pacers
            .iter()
            .filter_map(Weak::upgrade)
            .map(|p| p.report())
            .filter(|r| !r.keys.is_empty())
            .collect();
        reports.sort_by(|a, b| a.upstream.cmp(&b.upstream));
        reports
    }
}

/// How long after a reset the next window's requests go: a reset written in milliseconds may
/// be rounded down by a millisecond, and the two clocks tick apart.
const RESET_GUARD: Duration = Duration::from_millis(20);

/// How long a report of what is left, with no reset, is taken to hold (Azure sends only the
/// remaining counts): a request goes again after it, and its answer says more.
const UNKNOWN_RESET: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests;
