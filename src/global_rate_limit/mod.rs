//! The global rate limit (`global_rate_limit`), one for the whole fleet: a rate-limit service speaking Envoy's
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` (envoyproxy/ratelimit on
//! Redis, Kuadrant's Limitador) keeps the counts every sidecar of the fleet shares; this module
//! asks it before a request goes, and tells it what answers spent in tokens. No store is ours.
//!
//! - A [`Limiter`] per upstream with descriptors: what a request is counted as
//!   ([`Limiter::describe`]), the check before it goes ([`Limiter::check`]), the token reports
//!   after its answer ([`Charge`]).
//! - A [`Service`] per service URL, shared by every upstream that names it and kept across
//!   reloads while one does: its connection (`channel`) and the descriptors it said are over
//!   their limit (`cache`).
//!
//! The messages and the client are the ones `envoy-types` generates from Envoy's own
//! `rls.proto` (with `prost` and `tonic`): hand-written messages would drift from the protocol
//! the services implement, and generating them here would need `protoc` and Envoy's proto tree
//! at build time. Envoy-types asks tonic for its transport, so tonic's server is compiled, but
//! nothing of it is used: calls go over this module's own HTTP/2 connection.
//!
//! Token descriptors (those with a `{ key: unit, value: tokens }` entry) are checked before a
//! request with a per-descriptor `hits_addend` of 0, which counts nothing (the request-level
//! `hits_addend` of 0 is proto3's unset value and counts one), and charged after the answer with
//! its tokens, batched per [`REPORT_EVERY`] per descriptor.

pub mod cache;
mod channel;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry as PbEntry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use http::{HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;

pub use channel::CallError;
use channel::Channel;

use crate::config::{DescriptorSpec, Entry, FailureMode, GlobalRateLimitConfig, ServiceUrl, TlsConfig};
use crate::metrics::{GlobalRateLimitMetrics, Metrics};

/// How long token reports gather before one call carries them.
pub const REPORT_EVERY: Duration = Duration::from_millis(100);
/// How long reports wait for a service without a connection before they are tried again.
const REPORT_RETRY: Duration = Duration::from_secs(1);
/// The longest reset believed: a day (a service's absurd answer must not overflow a clock).
const LONGEST_RESET_SECS: i64 = 86_400;

/// The services upstreams name, each once.
#[derive(Debug, Default)]
pub struct Services {
    by_url: Mutex<HashMap<(ServiceUrl, TlsConfig), Weak<Service>>>,
}

impl Services {
    /// The limiter of the upstream named `upstream` with `config`; `None` when it counts nothing.
    pub fn limiter(
        &self,
        upstream: &str,
        config: &GlobalRateLimitConfig,
        metrics: &Metrics,
    ) -> Option<Arc<Limiter>> {
        let url = config.service.as_ref().filter(|_| config.is_on())?;
        let service = self.service(url, &config.tls);
        Some(Arc::new(Limiter {
            upstream: upstream.to_owned(),
            domain: config.domain.clone(),
            specs: config.descriptors.clone(),
            needs_app: config
                .descriptors
                .iter()
                .flat_map(|d| &d.entries)
                .any(|e| *e == Entry::App),
            timeout: config.timeout,
            failure_mode: config.failure_mode,
            max_wait: config.max_wait,
            service,
            metrics: metrics.global_rate_limit(upstream),
            batch: Mutex::default(),
        }))
    }

    fn service(&self, url: &ServiceUrl, tls: &TlsConfig) -> Arc<Service> {
        let mut by_url = self.by_url.lock().unwrap_or_else(|p| p.into_inner());
        by_url.retain(|_, service| service.strong_count() > 0);
        let key = (url.clone(), tls.clone());
        if let Some(service) = by_url.get(&key).and_then(Weak::upgrade) {
            return service;
        }
        let channel = Channel::new(url, tls).inspect_err(|why| {
            tracing::error!(service = %url, error = %why, "rate-limit service unusable: every check fails");
        });
        if let Ok(channel) = &channel {
            channel.warm();
        }
        let service = Arc::new(Service {
            channel,
            over: cache::OverLimit::default(),
        });
        by_url.insert(key, Arc::downgrade(&service));
        service
    }
}

/// One rate-limit service: its connection and what it said is spent.
#[derive(Debug)]
pub struct Service {
    channel: Result<Arc<Channel>, String>,
    over: cache::OverLimit,
}

/// One upstream's global rate limit: its descriptors, the service that keeps them, and what happens when
/// it says no or nothing.
#[derive(Debug)]
pub struct Limiter {
    upstream: String,
    domain: String,
    specs: Vec<DescriptorSpec>,
    needs_app: bool,
    timeout: Duration,
    failure_mode: FailureMode,
    max_wait: Duration,
    service: Arc<Service>,
    metrics: GlobalRateLimitMetrics,
    /// Token reports not yet sent.
    batch: Mutex<Batch>,
}

/// What a request is counted as: its descriptors, filled in.
#[derive(Debug)]
pub struct Asking {
    descriptors: Vec<RateLimitDescriptor>,
    keys: Vec<cache::Key>,
    /// Which descriptors count tokens.
    tokens: Vec<bool>,
}

/// What the limiter decided without a call, or the call that decides.
#[must_use]
pub enum Decision {
    /// Over a limit the cache knows, with no wait allowed: nothing is asked.
    Refused(Refusal),
    /// The check to wait for.
    Ask(Pin<Box<dyn Future<Output = Result<Granted, Refusal>> + Send>>),
}

impl std::fmt::Debug for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Decision::Refused(refusal) => f.debug_tuple("Refused").field(refusal).finish(),
            Decision::Ask(_) => f.write_str("Ask(..)"),
        }
    }
}

/// A request may go.
#[derive(Debug, Default)]
pub struct Granted {
    /// The service's `request_headers_to_add`.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Where the answer's tokens go, when the upstream reports them.
    pub charge: Option<Charge>,
    /// What a retry by policy counts once more.
    pub recount: Option<Recount>,
}

/// A request may not go.
#[derive(Debug)]
pub enum Refusal {
    /// A descriptor is over its limit.
    OverLimit {
        /// Seconds until the last of its over-limit descriptors resets.
        retry_after_secs: u64,
        /// The service's `response_headers_to_add`.
        headers: Vec<(HeaderName, HeaderValue)>,
    },
    /// The service did not answer, and `failure_mode` is `deny`.
    Unavailable(CallError),
}

impl Limiter {
    /// Its descriptors include the app: [`Limiter::describe`] wants it.
    pub fn needs_app(&self) -> bool {
        self.needs_app
    }

    /// The descriptors of a request with `headers`, sent by `app`; `None` when none applies
    /// (each needs a header the request lacks).
    pub fn describe(&self, headers: &HeaderMap, app: Option<&str>) -> Option<Box<Asking>> {
        let mut asking = Asking {
            descriptors: Vec::with_capacity(self.specs.len()),
            keys: Vec::with_capacity(self.specs.len()),
            tokens: Vec::with_capacity(self.specs.len()),
        };
        for spec in &self.specs {
            let tokens = spec.counts_tokens();
            let Some(entries) = spec
                .entries
                .iter()
                .map(|entry| self.fill(entry, headers, app))
                .collect::<Option<Vec<PbEntry>>>()
            else {
                continue;
            };
            let descriptor = RateLimitDescriptor {
                entries,
                // Checked, not counted: tokens are counted when the answer says how many.
                hits_addend: tokens.then_some(UInt64Value { value: 0 }),
                ..Default::default()
            };
            asking.keys.push(self.service.over.key(&self.domain, &descriptor));
            asking.descriptors.push(descriptor);
            asking.tokens.push(tokens);
        }
        (!asking.descriptors.is_empty()).then(|| Box::new(asking))
    }

    fn fill(&self, entry: &Entry, headers: &HeaderMap, app: Option<&str>) -> Option<PbEntry> {
        let (key, value) = match entry {
            Entry::Upstream => ("upstream", self.upstream.as_str()),
            Entry::App => ("app", app.unwrap_or("unknown")),
            Entry::Header { name } => {
                // Not dropped for bytes outside ASCII: a tenant must not escape its limit so.
                let value = String::from_utf8_lossy(headers.get(name.as_str())?.as_bytes()).into_owned();
                return Some(PbEntry {
                    key: name.clone(),
                    value,
                });
            }
            Entry::Literal { key, value } => (key.as_str(), value.as_str()),
        };
        Some(PbEntry {
            key: key.to_owned(),
            value: value.to_owned(),
        })
    }

    /// The check of `asking`: refused at once when the cache knows a descriptor is spent and
    /// no wait is allowed, else a call. `deadline`: when the request must have its answer.
    pub fn check(self: &Arc<Self>, asking: Box<Asking>, deadline: Option<Instant>) -> Decision {
        let now = Instant::now();
        if let Some(until) = self.service.over.spent_until(&asking.keys, now) {
            if !self.may_wait(now, until, now, deadline) {
                self.metrics.cached.inc();
                return Decision::Refused(over_limit(until - now, Vec::new()));
            }
        }
        Decision::Ask(Box::pin(self.clone().ask(asking, deadline, now)))
    }

    /// A wait from `now` to `until`, for a request that came at `came`, is within `max_wait` and
    /// its deadline.
    fn may_wait(&self, now: Instant, until: Instant, came: Instant, deadline: Option<Instant>) -> bool {
        !self.max_wait.is_zero()
            && until.saturating_duration_since(came) <= self.max_wait
            && deadline.is_none_or(|d| until <= d)
            && until > now
    }

    async fn ask(
        self: Arc<Self>,
        asking: Box<Asking>,
        deadline: Option<Instant>,
        came: Instant,
    ) -> Result<Granted, Refusal> {
        loop {
            let now = Instant::now();
            if let Some(until) = self.service.over.spent_until(&asking.keys, now) {
                self.metrics.cached.inc();
                if !self.may_wait(now, until, came, deadline) {
                    return Err(over_limit(until - now, Vec::new()));
                }
                tokio::time::sleep_until(until).await;
                continue;
            }
            let request = RateLimitRequest {
                domain: self.domain.clone(),
                descriptors: asking.descriptors.clone(),
                ..Default::default()
            };
            let answer = match self.call(request).await {
                Ok(answer) => answer,
                Err(failed) => {
                    return match self.failure_mode {
                        FailureMode::Allow => Ok(self.granted(*asking, Vec::new())),
                        FailureMode::Deny => Err(Refusal::Unavailable(failed)),
                    };
                }
            };
            if answer.overall_code == Code::Ok as i32 {
                return Ok(self.granted(*asking, header_pairs(&answer.request_headers_to_add)));
            }
            let now = Instant::now();
            let reset = self.note_spent(&asking.keys, &answer, now);
            let until = now + reset;
            if !self.may_wait(now, until, came, deadline) {
                return Err(over_limit(reset, header_pairs(&answer.response_headers_to_add)));
            }
            tokio::time::sleep_until(until).await;
        }
    }

    /// What the request `asking` described may do: its token descriptors charged with its
    /// answer's tokens, its request descriptors counted again by a retry.
    fn granted(self: &Arc<Self>, asking: Asking, headers: Vec<(HeaderName, HeaderValue)>) -> Granted {
        let Asking {
            descriptors,
            keys,
            tokens,
        } = asking;
        let (mut token_descriptors, mut request_descriptors) = (Vec::new(), Vec::new());
        for ((mut descriptor, key), counts_tokens) in descriptors.into_iter().zip(keys).zip(tokens) {
            // Set again when reported.
            descriptor.hits_addend = None;
            if counts_tokens {
                token_descriptors.push((key, descriptor));
            } else {
                request_descriptors.push((key, descriptor));
            }
        }
        let charge = (!token_descriptors.is_empty()).then(|| Charge {
            limiter: self.clone(),
            descriptors: token_descriptors,
        });
        let recount = (!request_descriptors.is_empty()).then(|| Recount {
            limiter: self.clone(),
            descriptors: request_descriptors,
        });
        Granted {
            headers,
            charge,
            recount,
        }
    }

    /// Caches the descriptors `answer` says are over their limit; the longest wait among them.
    fn note_spent(&self, keys: &[cache::Key], answer: &RateLimitResponse, now: Instant) -> Duration {
        let mut longest = Duration::ZERO;
        for (status, &key) in answer.statuses.iter().zip(keys) {
            if status.code != Code::OverLimit as i32 {
                continue;
            }
            let reset = status
                .duration_until_reset
                .as_ref()
                .map(|d| {
                    Duration::new(
                        d.seconds.clamp(0, LONGEST_RESET_SECS) as u64,
                        d.nanos.clamp(0, 999_999_999) as u32,
                    )
                })
                .unwrap_or_default();
            if !reset.is_zero() {
                self.service.over.spent(key, now + reset);
            }
            longest = longest.max(reset);
        }
        longest
    }

    /// One call, counted by result and timed.
    async fn call(&self, request: RateLimitRequest) -> Result<RateLimitResponse, CallError> {
        let started = Instant::now();
        let result = match &self.service.channel {
            Ok(channel) => channel.should_rate_limit(request, self.timeout).await,
            Err(why) => Err(CallError::Down(why.clone())),
        };
        self.metrics.seconds.observe(started.elapsed().as_secs_f64());
        // Codes other than OK and OVER_LIMIT (UNKNOWN, or one from a newer protocol) are failures.
        let result = result.and_then(|answer| match Code::try_from(answer.overall_code) {
            Ok(Code::Ok | Code::OverLimit) => Ok(answer),
            _ => Err(CallError::Failed(format!(
                "the service answered code {}",
                answer.overall_code
            ))),
        });
        let counter = match &result {
            Ok(answer) if answer.overall_code == Code::Ok as i32 => &self.metrics.ok,
            Ok(_) => &self.metrics.over_limit,
            Err(CallError::Timeout(_)) => &self.metrics.timeout,
            Err(_) => &self.metrics.error,
        };
        counter.inc();
        result
    }

    /// Adds each report's hits to its descriptor's, sent after `wait` with those gathered
    /// meanwhile (or with a flush already on its way).
    fn report(
        self: Arc<Self>,
        reports: impl IntoIterator<Item = (cache::Key, RateLimitDescriptor, u64)>,
        wait: Duration,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut batch = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        for (key, descriptor, hits) in reports {
            let pending = batch.pending.entry(key).or_insert((descriptor, 0));
            pending.1 = pending.1.saturating_add(hits);
        }
        if !batch.flushing {
            batch.flushing = true;
            drop(batch);
            runtime.spawn(self.flush_after(wait));
        }
    }

    async fn flush_after(self: Arc<Self>, wait: Duration) {
        tokio::time::sleep(wait).await;
        let pending = {
            let mut batch = self.batch.lock().unwrap_or_else(|p| p.into_inner());
            batch.flushing = false;
            std::mem::take(&mut batch.pending)
        };
        let (keys, descriptors): (Vec<_>, Vec<_>) = pending
            .into_iter()
            .map(|(key, (mut descriptor, tokens))| {
                descriptor.hits_addend = Some(UInt64Value { value: tokens });
                (key, descriptor)
            })
            .unzip();
        let request = RateLimitRequest {
            domain: self.domain.clone(),
            descriptors,
            ..Default::default()
        };
        let descriptors = request.descriptors.clone();
        match self.call(request).await {
            Ok(answer) => {
                self.note_spent(&keys, &answer, Instant::now());
            }
            // Nothing was sent: kept for the connection to come back. (A call that failed or
            // timed out may have been counted already: not sent twice.)
            Err(CallError::Down(_)) => {
                let reports = keys.into_iter().zip(descriptors).map(|(key, mut descriptor)| {
                    let hits = descriptor.hits_addend.take().map_or(0, |h| h.value);
                    (key, descriptor, hits)
                });
                self.report(reports, REPORT_RETRY);
            }
            Err(failed) => {
                tracing::debug!(upstream = %self.upstream, error = %failed, "report not delivered");
            }
        }
    }
}

/// Token reports gathering for one call.
#[derive(Debug, Default)]
struct Batch {
    pending: HashMap<cache::Key, (RateLimitDescriptor, u64)>,
    /// A flush is on its way.
    flushing: bool,
}

/// Where an admitted request's answer charges its tokens: the token descriptors it was checked
/// against.
#[derive(Debug)]
pub struct Charge {
    limiter: Arc<Limiter>,
    descriptors: Vec<(cache::Key, RateLimitDescriptor)>,
}

impl Charge {
    /// The answer spent `tokens`.
    pub fn tokens(self, tokens: u64) {
        if tokens > 0 {
            let reports = self.descriptors.into_iter().map(|(key, d)| (key, d, tokens));
            self.limiter.report(reports, REPORT_EVERY);
        }
    }
}

/// A granted request's request descriptors, carried in its extensions to the upstream send: a
/// retry by policy reaches the upstream once more and is counted once more (reported with the
/// token reports, not checked: the request was admitted, and a retry's wait is its own).
#[derive(Debug, Clone)]
pub struct Recount {
    limiter: Arc<Limiter>,
    descriptors: Vec<(cache::Key, RateLimitDescriptor)>,
}

impl Recount {
    /// The request goes upstream once more.
    pub fn again(&self) {
        let reports = self.descriptors.iter().map(|(key, d)| (*key, d.clone(), 1));
        self.limiter.clone().report(reports, REPORT_EVERY);
    }
}

fn over_limit(reset: Duration, headers: Vec<(HeaderName, HeaderValue)>) -> Refusal {
    // Rounded up: asked back a second early, the application would find the window closed.
    let secs = reset.as_secs() + u64::from(reset.subsec_nanos() > 0);
    Refusal::OverLimit {
        retry_after_secs: secs.max(1),
        headers,
    }
}

/// The service's headers that can be sent: valid names and values, none that frames a message
/// or that the sidecar sets itself.
fn header_pairs(
    headers: &[envoy_types::pb::envoy::config::core::v3::HeaderValue],
) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter_map(|h| {
            let name = HeaderName::from_bytes(h.key.as_bytes()).ok()?;
            let value = if h.raw_value.is_empty() {
                HeaderValue::from_str(&h.value).ok()?
            } else {
                HeaderValue::from_bytes(&h.raw_value).ok()?
            };
            (!reserved(&name)).then_some((name, value))
        })
        .collect()
}

fn reserved(name: &HeaderName) -> bool {
    use http::header::*;
    [
        CONNECTION,
        CONTENT_LENGTH,
        TRANSFER_ENCODING,
        HOST,
        TE,
        TRAILER,
        UPGRADE,
        CONTENT_TYPE,
        RETRY_AFTER,
    ]
    .contains(name)
        || name == AUTHORIZATION
        || name == PROXY_AUTHORIZATION
        || name.as_str().starts_with("x-egress-")
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

#[cfg(test)]
pub(crate) mod tests;
