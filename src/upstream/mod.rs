//! An upstream: its identity (label, scheme, authority), settings and pool, and sending one
//! request on a pooled connection under its deadlines (`response_header_timeout`,
//! `request_timeout`, `body_idle_timeout`) with its retries.
//!
//! Two kinds of retry. Connection-level, always on: a request an HTTP/2 connection could not
//! open a stream for is sent again on another connection; a request written on a *reused* connection
//! which then failed before any response is sent once more if it is idempotent (GET, HEAD,
//! OPTIONS, TRACE, PUT, DELETE, or any request with `Idempotency-Key`) and has no body. By
//! policy (`retry.attempts` > 0, not `x-egress-retry: off`): the failures and statuses of
//! `retry.on`, after a wait (`retry`), within the budget, away from the endpoint that failed;
//! a response head that reached the app is never retried, and a body is replayed only when it
//! passed whole within `retry.buffer_body_up_to`. Everything else is answered as it came.
//!
//! Not handled here: header rewriting (`proxy::headers`), the pool itself (`pool`).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::{HeaderValue, Request, Response};

use crate::config::{Authority, Config, Protocol, Scheme, TlsConfig, UpstreamConfig, UpstreamSettings};
mod classify;
mod fit;
mod grpc;
mod paced;
mod retry;
mod rules;
mod spec;
mod timed;
mod traced;
mod usage;

use grpc::GrpcPool;
use retry::{is_idempotent, Reason, Retries};
pub use spec::{PoolKey, Spec};
pub use timed::{CutCounters, Deadline, Deadlines, TimedBody, Timing};
pub use usage::Reading;

use crate::connector::parent::Parent;
use crate::connector::{dial, h1, http2, tls, Io};
use crate::duration::DurationError;
use crate::endpoint::{self, dns::Resolver};
use crate::error::{ErrorKind, ProxyError};
use crate::global_rate_limit;
use crate::metrics::{Metrics, PoolSource, UpstreamMetrics};
use crate::pace::{self, Pacer, Ticket};
use crate::policy::Guard;
use crate::pool::learn::IdleLearner;
use crate::pool::{self, Lease, Pool, PooledBody, SendError, ServedBy, UpstreamBody};
use crate::wire::{HeadLines, KeptCopy, RequestBody};

/// What every upstream is built with: the policy its connector checks, the metrics it counts
/// in, and the registry its pool joins.
#[derive(Debug, Clone)]
pub struct Shared {
    /// The policy in force and the sidecar's own listeners, shared with every connector.
    pub guard: Arc<Guard>,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// The pools alive now.
    pub pools: Arc<pool::Registry>,
    /// The resolver every endpoint set and tunnel asks.
    pub resolver: Arc<Resolver>,
    /// The pacers alive now.
    pub paces: Arc<pace::Registry>,
    /// The rate-limit services upstreams name (`global_rate_limit`).
    pub rate_limit_services: Arc<global_rate_limit::Services>,
}

/// How often a request handed back unsent may be tried on yet another connection.
const MAX_UNSENT_ATTEMPTS: usize = 3;

/// One upstream and its pool.
#[derive(Debug)]
pub struct Upstream {
    label: Arc<str>,
    scheme: Scheme,
    authority: Authority,
    aliases: Vec<Authority>,
    settings: UpstreamSettings,
    host_header: HeaderValue,
    /// `host_header` as a URI authority, for absolute targets through a parent proxy: cloned
    /// per request, not formatted and parsed again. (HTTP/2 streams name the pool connection's
    /// origin instead: `http2_origin`.)
    uri_authority: Option<http::uri::Authority>,
    pool: Arc<Pool>,
    /// The endpoints every pool of this upstream and its dedicated connections dial (the
    /// parent's, through a parent).
    endpoints: Arc<endpoint::Set>,
    /// The parent proxy connections go through, if any.
    parent: Option<Arc<Parent>>,
    /// The policy and the sidecar's own listeners, which dedicated connections are checked
    /// against (the pool's connector holds its own).
    guard: Arc<Guard>,
    /// Requests go to the parent in absolute-form (plain HTTP/1.1 through a parent).
    forward: bool,
    /// The h2c pool for gRPC requests, when this upstream speaks HTTP/1.1 on plain TCP only
    /// because `protocol` is `auto` (`grpc`).
    grpc: Option<GrpcPool>,
    /// TLS settings, for dedicated (upgrade) connections; `None` for plain TCP.
    tls: Option<TlsConfig>,
    /// The HTTP/1.1-only TLS config for dedicated connections, built on first use.
    upgrade_tls: OnceLock<Result<tls::TlsConnector, String>>,
    metrics: UpstreamMetrics,
    /// The retry budget and the backoff's jitter.
    retries: Retries,
    /// Where cut response bodies are counted.
    cuts: CutCounters,
    /// `request_headers`, if any.
    rules: Option<rules::Rules>,
    /// Pacing to the limits this upstream advertises; carried over reloads that keep its name.
    pacer: Arc<Pacer>,
    /// Where a request's credential is read, for its pace key: the usual names, then those
    /// `request_headers` sets.
    credentials: pace::Credentials,
    /// How answers are read for the token usage they report (`llm.usage`).
    usage: Option<Arc<Reading>>,
    /// The global rate limit requests are checked against (a rate-limit service's).
    global_rate_limit: Option<Arc<global_rate_limit::Limiter>>,
    key: PoolKey,
}

/// What one request asks of its exchange beyond the upstream's settings.
#[derive(Debug, Clone, Default)]
pub struct Asked {
    /// `x-egress-timeout`: this request's `request_timeout` (zero: none).
    pub timeout: Option<Duration>,
    /// `x-egress-retry: off`: no retries by policy.
    pub no_retry: bool,
    /// `x-egress-pace-key` and `x-egress-priority`.
    pub pace: pace::Asked,
    /// `x-egress-app`: who spends what the answer reports (`llm`).
    pub app: Option<HeaderValue>,
}

enum Failure {
    /// The HTTP/2 connection could not open a stream: nothing reached the upstream, and the
    /// request is still in place.
    Unsent(ProxyError),
    /// An HTTP/2 upstream refused the stream without processing it.
    Refused(ProxyError),
    /// The request (or part of it) was written.
    Sent(ProxyError),
}

/// What the retry policy keeps of a request it may send again.
struct Retrying {
    idempotent: bool,
    /// The body as it was sent, for sending again; `None` when there was none.
    kept: Option<KeptCopy>,
}

/// A request the policy sends again, after its first attempt.
struct Again {
    req: Request<RequestBody>,
    retrying: Retrying,
    /// The request's deadline.
    at: Option<tokio::time::Instant>,
}

/// A failed attempt: why, and on which endpoint when one was reached.
type Attempted = (ProxyError, Option<Arc<endpoint::Endpoint>>);

/// What the connection-level retries of one request have spent.
struct Tries {
    idempotent: bool,
    /// The one retry of a refused stream or a stale connection was made.
    retried: bool,
    /// HTTP/2 attempts that could not open a stream.
    unsent: usize,
}

/// What one failed attempt leaves for deciding whether it goes again.
struct Attempt {
    /// The connection had served before.
    reused: bool,
    http2: bool,
    bodyless: bool,
}

impl Upstream {
    /// An upstream from the config file.
    pub fn configured(cfg: &UpstreamConfig, shared: &Shared) -> Self {
        Self::new(Spec::configured(cfg), shared, None)
    }

    /// An upstream met through an absolute-form request, with `defaults`.
    /// `learned` is what the host's pool learned before it was let go, if anything.
    pub fn dynamic(
        scheme: Scheme,
        authority: Authority,
        config: &Config,
        shared: &Shared,
        learned: Option<IdleLearner>,
    ) -> Self {
        let up = Self::new(Spec::dynamic(scheme, authority, config), shared, None);
        if let Some(learned) = learned {
            up.pool.resume_learning(learned);
        }
        up
    }

    /// Builds the upstream `spec` describes. When `previous` has the same [`PoolKey`], its pool
    /// (and connections) carry over with the new pool settings applied; otherwise a new pool is
    /// made.
    pub fn new(spec: Spec, shared: &Shared, previous: Option<&Upstream>) -> Self {
        let key = spec.pool_key();
        let Spec {
            label,
            scheme,
            authority,
            aliases,
            addresses,
            settings,
            met_on_the_fly,
        } = spec;
        let upstream_metrics = match met_on_the_fly {
            true => shared.metrics.upstream_met_on_the_fly(&label),
            false => shared.metrics.upstream(&label),
        };
        let max_streams = settings.http2.max_streams_per_connection as usize;
        let pacer = match previous.filter(|p| p.label == label) {
            Some(previous) => {
                previous.pacer.configure(settings.pace);
                previous.pacer.clone()
            }
            None => {
                let pacer = Pacer::new(label.clone(), settings.pace, &shared.metrics);
                shared.paces.register(&pacer);
                pacer
            }
        };
        let previous = previous.filter(|p| p.key == key);
        let grpc = GrpcPool::for_upstream(&key, &settings, shared, previous);
        let parent = match previous {
            Some(previous) => previous.parent.clone(),
            None => key
                .parent
                .as_ref()
                .map(|route| Arc::new(Parent::new(route.clone()))),
        };
        let endpoints = match previous {
            Some(previous) => {
                previous.endpoints.reconfigure(settings.balance, settings.outlier);
                previous.endpoints.clone()
            }
            // Through a parent, connections go to the parent's addresses, which the operator
            // chose: the policy judges the upstream's name at routing, not the parent.
            None => endpoint::Set::new(endpoint::SetSpec {
                label: label.clone(),
                authority: parent.as_ref().map_or(&authority, |p| p.authority()).clone(),
                addresses: if parent.is_some() { Vec::new() } else { addresses },
                parent: parent.as_ref().map(|p| p.shown().clone()),
                balance: settings.balance,
                outlier: settings.outlier,
                resolver: shared.resolver.clone(),
                metrics: upstream_metrics.clone(),
            }),
        };
        let pool = match previous {
            Some(previous) => {
                previous.pool.reconfigure(settings.pool, max_streams);
                previous.pool.clone()
            }
            None => {
                let pool = Self::new_pool(
                    &key,
                    &settings,
                    &shared.guard,
                    (&endpoints, parent.as_ref()),
                    upstream_metrics.clone(),
                );
                let source: Arc<dyn PoolSource> = pool.clone();
                upstream_metrics.watch_pool(Arc::downgrade(&source));
                shared.pools.register(&pool);
                pool
            }
        };
        let retries = Retries::new(settings.retry.budget, &label);
        let rules = rules::Rules::new(&settings.request_headers);
        let credentials = pace::Credentials::new(rules.iter().flat_map(rules::Rules::set_names));
        let cuts = CutCounters {
            request: upstream_metrics.timeouts("request"),
            body_idle: upstream_metrics.timeouts("body_idle"),
        };
        let host_header = host_header(scheme, &authority);
        let usage = Reading::new(settings.llm.usage, &label, &authority, &shared.metrics);
        let global_rate_limit = paced::limiter(shared, &label, &settings);
        Upstream {
            uri_authority: http::uri::Authority::try_from(host_header.as_bytes()).ok(),
            host_header,
            label,
            scheme,
            authority,
            aliases,
            forward: parent.is_some() && scheme == Scheme::Http && settings.protocol != Protocol::Http2,
            settings,
            pool,
            endpoints,
            parent,
            guard: shared.guard.clone(),
            grpc,
            tls: key.tls.clone(),
            upgrade_tls: OnceLock::new(),
            retries,
            cuts,
            rules,
            pacer,
            credentials,
            usage,
            global_rate_limit,
            metrics: upstream_metrics,
            key,
        }
    }

    fn new_pool(
        key: &PoolKey,
        settings: &UpstreamSettings,
        guard: &Arc<Guard>,
        (endpoints, parent): (&Arc<endpoint::Set>, Option<&Arc<Parent>>),
        metrics: UpstreamMetrics,
    ) -> Arc<Pool> {
        let label = &key.label;
        let protocol = settings.protocol;
        let connector_tls = (key.scheme == Scheme::Https).then(|| {
            tls::TlsConnector::new(
                &settings.tls,
                &key.authority.host,
                dial::Connector::alpn(protocol),
            )
            .inspect_err(|why| {
                tracing::error!(upstream = %label, "TLS origination unavailable: {why}");
            })
        });
        // What the pool can know before the first dial: only TLS with `auto` leaves it to ALPN.
        let known = match (protocol, key.scheme) {
            (Protocol::Http2, _) => pool::Negotiated::Http2,
            (Protocol::Http1, _) | (Protocol::Auto, Scheme::Http) => pool::Negotiated::Http1,
            (Protocol::Auto, Scheme::Https) => pool::Negotiated::Unknown,
        };
        let target = dial::OwnedTarget {
            label: label.clone(),
            authority: key.authority.clone(),
            endpoints: endpoints.clone(),
            connect_timeout: settings.connect_timeout,
            guard: guard.clone(),
            parent: parent.cloned(),
            origin: http2_origin(key.scheme, &key.authority),
        };
        let connector = dial::Connector::new(target, connector_tls, protocol, settings.http2.clone());
        Pool::new(
            label.clone(),
            settings.pool,
            known,
            settings.http2.max_streams_per_connection as usize,
            Box::new(connector),
            endpoints.clone(),
            metrics,
        )
    }

    /// The key deciding whether a reloaded spec can keep this upstream's pool.
    pub fn pool_key(&self) -> &PoolKey {
        &self.key
    }

    /// The label in logs and metrics: the configured name, or host:port.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The upstream's own authority and its aliases.
    pub fn authorities(&self) -> impl Iterator<Item = &Authority> {
        std::iter::once(&self.authority).chain(&self.aliases)
    }

    /// The `Host` header requests to this upstream carry.
    pub fn host_header(&self) -> &HeaderValue {
        &self.host_header
    }

    /// Whether the sidecar originates TLS to this upstream.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The upstream's own authority (from `url`, or the request for on-the-fly upstreams).
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// TCP (and TLS) connect deadline.
    pub fn connect_timeout(&self) -> Duration {
        self.settings.connect_timeout
    }

    /// The settings this upstream was built with (its overrides over `defaults`).
    pub fn settings(&self) -> &UpstreamSettings {
        &self.settings
    }

    /// Opens a connection outside the pool that speaks HTTP/1.1 (TLS with ALPN `http/1.1` for
    /// https upstreams), for exchanges that take the connection over (upgrades).
    pub async fn dial_dedicated(&self) -> Result<Box<dyn Io>, ProxyError> {
        let deadline = tokio::time::Instant::now() + self.settings.connect_timeout;
        let target = dial::DialTarget {
            label: &self.label,
            authority: &self.authority,
            resolve: dial::Resolve::Endpoints(&self.endpoints),
            connect_timeout: self.settings.connect_timeout,
            guard: &self.guard,
        };
        let tcp = dial::tcp(target).await?;
        let io = match &self.parent {
            None => h1::Transport::Plain(tcp),
            Some(parent) => {
                // Through a parent, an upgraded connection is a tunnel, whatever the scheme.
                let timeout = self.settings.connect_timeout;
                let mut io = parent.secure(tcp, &self.label, deadline).await?;
                parent
                    .tunnel_by(&mut io, &self.authority, &self.label, deadline, timeout)
                    .await?;
                io
            }
        };
        let Some(tls_config) = &self.tls else {
            return Ok(Box::new(io));
        };
        let connector = self
            .upgrade_tls
            .get_or_init(|| tls::TlsConnector::new(tls_config, &self.authority.host, &[b"http/1.1"]))
            .as_ref()
            .map_err(|why| self.error(ErrorKind::TlsFailed, why.clone()))?;
        Ok(Box::new(
            dial::handshake_tls(&target, connector, io, deadline).await?,
        ))
    }

    /// Whether a step of this upstream's request path reads or writes the request's fields by
    /// names a request may keep as lines ([`HeadLines`]): its header rules, its global rate
    /// limit's descriptors, its parent proxy's `Host`, and reading LLM usage that asks a known
    /// provider for `Accept-Encoding: identity`. Then the lines go into the map first.
    pub fn reads_request_fields(&self) -> bool {
        self.rules.is_some()
            || self.global_rate_limit().is_some()
            || self.parent.is_some()
            || self.usage().is_some_and(|reading| reading.always)
    }

    /// Applies `request_headers` to a request about to go to this upstream.
    pub fn rewrite_headers(&self, headers: &mut http::HeaderMap) {
        if let Some(rules) = &self.rules {
            rules.apply(headers);
        }
        if !self.settings.tracing.propagate {
            crate::trace::strip_context(headers);
        }
    }

    /// The endpoints this upstream's connections go to.
    pub fn endpoints(&self) -> &Arc<endpoint::Set> {
        &self.endpoints
    }

    /// The parent proxy this upstream is reached through, if any.
    pub fn parent(&self) -> Option<&Arc<Parent>> {
        self.parent.as_ref()
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Connections open now, in the pool and the gRPC pool if there is one.
    pub fn open_connections(&self) -> usize {
        let grpc = self.grpc.as_ref().and_then(GrpcPool::made);
        self.pool.open_connections() + grpc.map_or(0, |p| p.open_connections())
    }

    /// The `upstream` label of its metric series (its own, or `other` past the label cap).
    pub fn metrics_label(&self) -> &str {
        self.metrics.label()
    }

    /// Whether a response ever told its pacer a limit: such an upstream must outlive its
    /// connections (see `routing::on_the_fly`).
    pub fn pacer_was_told(&self) -> bool {
        self.pacer.was_told()
    }

    /// What the pool learned of the upstream's idle timeout, taken, if anything.
    pub fn take_learning(&self) -> Option<IdleLearner> {
        self.pool.take_learning()
    }

    /// Closes the pools: idle connections now, busy ones when their exchange ends.
    pub fn retire(&self, reason: &'static str) {
        self.pool.retire(reason);
        if let Some(pool) = self.grpc.as_ref().and_then(GrpcPool::made) {
            pool.retire(reason);
        }
    }

    /// The pool a request goes through: gRPC to an upstream spoken to in HTTP/1.1 by default
    /// goes through the h2c one.
    fn pool_for(&self, req: &Request<RequestBody>) -> &Arc<Pool> {
        match &self.grpc {
            // gRPC is always POST: other requests skip the Content-Type lookup.
            Some(grpc) if req.method() == http::Method::POST && grpc::is_grpc(req.headers()) => {
                grpc.pool(self)
            }
            _ => &self.pool,
        }
    }

    /// Counts a header value this upstream sent that was ignored, and logs the first.
    fn ignored_header(&self, header: &'static str, value: &str, why: DurationError) {
        if self.metrics.ignored_header(header) {
            let value: String = value.chars().take(64).collect();
            tracing::warn!(
                upstream = %self.label, header, value, error = %why,
                "ignored a header the upstream sent (logged once per upstream and header, counted in egress_upstream_ignored_headers_total)"
            );
        }
    }

    fn error(&self, kind: ErrorKind, cause: impl Into<String>) -> ProxyError {
        ProxyError::new(kind, cause).with_upstream(&*self.label)
    }

    /// When a request sent now must have its response head: the `x-egress-timeout` it `asked`
    /// for, else this upstream's `request_timeout`; `None` when neither is set (or either is
    /// zero).
    pub fn deadline(&self, asked: Option<Duration>) -> Option<Deadline> {
        let limit = asked.or(self.settings.request_timeout).filter(|d| !d.is_zero())?;
        Some(Deadline::after(limit))
    }

    /// Sends an origin-form request and returns the response head; the body streams from the
    /// pooled connection, under the exchange's deadlines, and gives it back when it ends.
    /// `deadline` is [`Upstream::deadline`], taken before the request was admitted: a wait for
    /// admission counts against it. `no_retry`: the application asked for no retries by policy.
    ///
    /// `ticket` is the request's place in pacing ([`Upstream::pace`]), marked going: every
    /// response head, retried ones too, is credited to it. (Marked by the caller: a `mut`
    /// parameter would be held twice in this future.)
    ///
    /// The request is lent and left spent (see `Proxy::handle`).
    ///
    /// The fields are in `req`'s map or in `lines` ([`HeadLines`]); a request that goes on
    /// a path that owns it (a deadline, a retry by policy) has them moved into the map.
    pub async fn send(
        &self,
        req: &mut Request<RequestBody>,
        lines: &mut HeadLines,
        no_retry: bool,
        deadline: Option<Deadline>,
        ticket: Ticket,
    ) -> Result<Response<TimedBody>, ProxyError> {
        if let Some(idle) = self.settings.body_idle_timeout {
            req.body_mut().set_idle_timeout(idle);
        }
        let mut retries = 0;
        // A request's future is moved, whole, a few times on its way down: the deadline's
        // machinery, which most requests never use, is boxed rather than carried by all.
        let result = match deadline {
            // send_with_policy, written out: its answer is not moved once more on the way.
            None => {
                let retrying = self.retrying(req, !no_retry);
                let first = self.send_with_retries(req, lines, None, &mut retries).await;
                match self.goes_again(retrying, &first) {
                    None => self.answered_once(first, &ticket),
                    Some(retrying) => {
                        lines.into_map(req.headers_mut());
                        let again = Again {
                            req: crate::wire::take_request(req),
                            retrying,
                            at: None,
                        };
                        Box::pin(self.send_again(again, first, &mut retries, &ticket)).await
                    }
                }
            }
            Some(deadline) => {
                lines.into_map(req.headers_mut());
                Box::pin(self.send_by_policy(
                    crate::wire::take_request(req),
                    !no_retry,
                    (deadline.at, deadline.limit()),
                    &mut retries,
                    &ticket,
                ))
                .await
            }
        };
        let code = match &result {
            Ok(resp) => resp.status().as_u16(),
            Err(err) => self.failed(err).status().as_u16(),
        };
        self.metrics.request(code);
        let deadlines = Deadlines {
            // From the parameter, not a copy taken before the awaits: the future holds it once.
            at: deadline.map(|d| d.at),
            idle: self.settings.body_idle_timeout,
        };
        let spend = ticket.into_spend();
        result.map(|resp| resp.map(|body| TimedBody::new(body, deadlines, retries).with_spend(spend)))
    }

    /// [`Upstream::send_with_policy`] under the request's deadline `at` (`limit` after its
    /// start), past which it is `504 request_timeout`.
    async fn send_by_policy(
        &self,
        req: Request<RequestBody>,
        allowed: bool,
        (at, limit): (tokio::time::Instant, Duration),
        retries: &mut u32,
        ticket: &Ticket,
    ) -> Result<Response<PooledBody<Timing>>, ProxyError> {
        let sending = self.send_with_policy(req, allowed, Some(at), retries, ticket);
        match tokio::time::timeout_at(at, sending).await {
            Ok(result) => result,
            Err(_) => {
                self.cuts.request.inc();
                Err(self.error(
                    ErrorKind::RequestTimeout,
                    format!(
                        "no response head within request_timeout ({})",
                        humantime::format_duration(limit)
                    ),
                ))
            }
        }
    }

    /// Sends `req` with the connection-level retries, and again by policy while `allowed`.
    async fn send_with_policy(
        &self,
        mut req: Request<RequestBody>,
        allowed: bool,
        at: Option<tokio::time::Instant>,
        retries: &mut u32,
        ticket: &Ticket,
    ) -> Result<Response<PooledBody<Timing>>, ProxyError> {
        let retrying = self.retrying(&mut req, allowed);
        let first = self
            .send_with_retries(&mut req, &mut HeadLines::default(), None, retries)
            .await;
        match self.goes_again(retrying, &first) {
            None => self.answered_once(first, ticket),
            Some(retrying) => {
                Box::pin(self.send_again(Again { req, retrying, at }, first, retries, ticket)).await
            }
        }
    }

    /// The answer of a request sent once, credited to pacing.
    fn answered_once(
        &self,
        first: Result<Response<PooledBody<Timing>>, Attempted>,
        ticket: &Ticket,
    ) -> Result<Response<PooledBody<Timing>>, ProxyError> {
        if let Ok(resp) = &first {
            self.paced(ticket, resp);
        }
        first.map_err(|(err, _)| err)
    }

    /// What the retry policy keeps of `req` before its first attempt; `None` when it is not
    /// retried by policy (none configured, or not `allowed`). Every request counts towards
    /// the budget, retried or not.
    fn retrying(&self, req: &mut Request<RequestBody>, allowed: bool) -> Option<Retrying> {
        let policy = &self.settings.retry;
        if policy.attempts == 0 {
            return None;
        }
        self.retries.deposit();
        allowed.then(|| Retrying {
            idempotent: is_idempotent(req),
            kept: req.body_mut().keep(policy.buffer_body_up_to),
        })
    }

    /// `retrying` when the policy sends the request again after `first`, its first answer.
    fn goes_again<T>(
        &self,
        retrying: Option<Retrying>,
        first: &Result<Response<T>, Attempted>,
    ) -> Option<Retrying> {
        retrying.filter(|r| Reason::of(&self.settings.retry, first, r.idempotent).is_some())
    }

    /// Sends the request of `again` by policy after `result`, until an answer is not to be
    /// retried or the attempts run out. A wait that would end past the request's deadline is
    /// not waited: the answer in hand goes to the app instead of a later `request_timeout`.
    async fn send_again(
        &self,
        again: Again,
        mut result: Result<Response<PooledBody<Timing>>, Attempted>,
        retries: &mut u32,
        ticket: &Ticket,
    ) -> Result<Response<PooledBody<Timing>>, ProxyError> {
        let policy = &self.settings.retry;
        let Again {
            mut req,
            retrying: Retrying { idempotent, kept },
            at,
        } = again;
        // Each answer is credited to pacing once, the last one too.
        let mut credited = false;
        for retry in 0..policy.attempts {
            let Some(reason) = Reason::of(policy, &result, idempotent) else {
                break;
            };
            // Every request of the key waits out a `Retry-After`, not only this one's retry.
            if let (Ok(resp), false) = (&result, credited) {
                self.paced(ticket, resp);
                credited = true;
            }
            // What goes again: the same head, with the body untouched when nothing was sent,
            // else as it was kept (whole, or not at all).
            let body = match &kept {
                _ if reason.nothing_sent() => None,
                None => Some(RequestBody::Empty),
                Some(copy) => match copy.replay() {
                    Some(body) => Some(body),
                    None => break,
                },
            };
            let wait = match &mut result {
                Ok(resp) => match retry::asked_wait(resp, &mut |header, value, why| {
                    self.ignored_header(header, value, why)
                }) {
                    Some(asked) if asked > policy.retry_after_max => break,
                    Some(asked) => asked,
                    None => self.retries.backoff(policy.backoff, retry),
                },
                Err(_) => self.retries.backoff(policy.backoff, retry),
            };
            // A closed key (this answer's `Retry-After`, no quota left) holds the retry too.
            let wait = wait.max(self.pace_hold(ticket).unwrap_or_default());
            if at.is_some_and(|at| tokio::time::Instant::now() + wait >= at) {
                break;
            }
            if !self.retries.withdraw() {
                self.metrics.retry_budget_exhausted.inc();
                break;
            }
            let avoid = match result {
                Ok(resp) => {
                    let endpoint = resp.body().endpoint();
                    // Read off what is left of a short answer, so its connection is kept.
                    retry::drain(resp.into_body()).await;
                    endpoint
                }
                Err((err, endpoint)) => {
                    tracing::debug!(upstream = %self.label, error = %err, "retrying by policy");
                    endpoint
                }
            };
            self.retried(&mut req, &reason.label());
            *retries += 1;
            // The wait holds no connection: the response and its lease are gone.
            tokio::time::sleep(wait).await;
            self.counts_again(ticket, &req);
            if let Some(body) = body {
                *req.body_mut() = body;
            }
            result = self
                .send_with_retries(&mut req, &mut HeadLines::default(), avoid.as_ref(), retries)
                .await;
            credited = false;
        }
        if let (Ok(resp), false) = (&result, credited) {
            self.paced(ticket, resp);
        }
        result.map_err(|(err, _)| err)
    }

    /// Sends `req` (on a connection away from `avoid`, when the pool has one) with the
    /// connection-level retries. A failure names the endpoint it happened on, if known.
    /// Afterwards `req` keeps its head (both protocols take only the body), and its body
    /// unless it was sent.
    async fn send_with_retries(
        &self,
        req: &mut Request<RequestBody>,
        lines: &mut HeadLines,
        avoid: Option<&Arc<endpoint::Endpoint>>,
        retries: &mut u32,
    ) -> Result<Response<PooledBody<Timing>>, Attempted> {
        let mut tries = Tries {
            idempotent: is_idempotent(req),
            retried: false,
            unsent: 0,
        };
        loop {
            let mut client_span = self.attempt_span(req, *retries);
            let pool = self.pool_for(req);
            let mut lease = match pool.checkout_avoiding(avoid).await {
                Ok(lease) => lease,
                Err(err) => return Err(traced::failed(client_span, (err, None))),
            };
            self.fit_request(req, lease.is_http2());
            let served = lease.served();
            traced::leased(&mut client_span, &lease, &served);
            let (reused, http2) = (served.reused, served.http2);
            // Both protocols give back all of the request but its body, so a bodyless one can
            // go again as it is.
            let bodyless = req.body().is_empty();
            let outcome = self.exchange(&mut lease, req, lines).await;
            let failure = match outcome {
                Ok(resp) => return traced::answered(client_span, self.answered(resp, lease, served)),
                Err(failure) => traced::failure(client_span, failure),
            };
            let attempt = Attempt {
                reused,
                http2,
                bodyless,
            };
            self.retry_on_connection(failure, attempt, &mut lease, req, &mut tries)?;
            *retries += 1;
        }
    }

    /// A response head: the request's, unless the parent refused our proxy credentials.
    fn answered(
        &self,
        resp: Response<UpstreamBody>,
        lease: Lease,
        served: ServedBy,
    ) -> Result<Response<PooledBody<Timing>>, Attempted> {
        // Only the parent asks a client for proxy credentials: it refused ours. The
        // connection closes with the lease (its body unread); a 407 is not retried.
        if self.forward && resp.status() == http::StatusCode::PROXY_AUTHENTICATION_REQUIRED {
            let parent = self.parent.as_ref().expect("forward implies a parent");
            let reason = resp.status().canonical_reason().unwrap_or("");
            return Err((
                parent.refused(&self.label, 407, reason, "a request"),
                lease.endpoint(),
            ));
        }
        Ok(resp.map(|body| PooledBody::new(body, lease, served, Timing::default())))
    }

    /// After a failed attempt: `Ok` when the request goes again on another connection (`req`
    /// ready to send, the retry counted in the metrics), else the failure to answer with.
    fn retry_on_connection(
        &self,
        failure: Failure,
        attempt: Attempt,
        lease: &mut Lease,
        req: &mut Request<RequestBody>,
        tries: &mut Tries,
    ) -> Result<(), Attempted> {
        let Attempt {
            reused,
            http2,
            bodyless,
        } = attempt;
        match failure {
            Failure::Unsent(err) => {
                tries.unsent += 1;
                // A connection that cannot open streams takes no more.
                lease.mark_draining();
                if tries.unsent >= MAX_UNSENT_ATTEMPTS {
                    return Err((err, lease.endpoint()));
                }
                self.retried(req, "unsent");
            }
            Failure::Refused(err) => {
                // The upstream did not process the stream, so any method may go again, once,
                // if it has no body to have been sent.
                lease.mark_draining();
                if tries.retried || !bodyless {
                    return Err((err, lease.endpoint()));
                }
                tracing::debug!(upstream = %self.label, error = %err, "stream refused; retrying once");
                tries.retried = true;
                self.retried(req, "refused_stream");
            }
            // A reused HTTP/1.1 connection may have been closed by the upstream as the
            // request went out; an HTTP/2 connection that dies takes streams with it. Either
            // way an idempotent request without a body and without a response may go again.
            Failure::Sent(err) => {
                let again = !tries.retried
                    && bodyless
                    && tries.idempotent
                    && (reused || http2)
                    && err.kind() == ErrorKind::UpstreamReset;
                // A reused connection the upstream closed as the request went out is the
                // keep-alive race, not the endpoint failing.
                if err.kind() == ErrorKind::UpstreamReset && !(again && reused) {
                    lease.reset();
                }
                if !again {
                    return Err((err, lease.endpoint()));
                }
                tracing::debug!(upstream = %self.label, error = %err, "stale connection; retrying once");
                tries.retried = true;
                self.retried(req, "stale_connection");
            }
        }
        Ok(())
    }

    async fn exchange(
        &self,
        lease: &mut Lease,
        req: &mut Request<RequestBody>,
        lines: &mut HeadLines,
    ) -> Result<Response<UpstreamBody>, Failure> {
        let started = lease.granted();
        // The send's future is made where it is awaited: bound to a name first, it was built
        // and then moved into place, a copy of its whole state per request (callgrind).
        let result = match self.settings.response_header_timeout {
            // From `started`: `timeout` would read the clock again.
            Some(limit) => match tokio::time::timeout_at(started + limit, lease.send(req, lines)).await {
                Ok(result) => result,
                Err(_) => {
                    self.metrics.timed_out("response_header");
                    return Err(Failure::Sent(self.error(
                        ErrorKind::ResponseTimeout,
                        format!(
                            "no response head within response_header_timeout ({})",
                            humantime::format_duration(limit)
                        ),
                    )));
                }
            },
            None => lease.send(req, lines).await,
        };
        if result.is_ok() {
            let arrived = tokio::time::Instant::now();
            self.metrics.duration.observe(arrived - started);
            lease.response_arrived(arrived);
        }
        result.map_err(|e| match e {
            SendError::Http1(e) => Failure::Sent(self.classify_h1(&e)),
            SendError::Http2(e) => {
                let (err, refused) = self.classify_h2(&e);
                match (&e, refused) {
                    (http2::Error::Unsent(_), _) => Failure::Unsent(err),
                    (_, true) => Failure::Refused(err),
                    (_, false) => Failure::Sent(err),
                }
            }
        })
    }
}

/// What HTTP/2 streams to the upstream name in `:scheme` and `:authority`: its `Host`.
fn http2_origin(scheme: Scheme, authority: &Authority) -> Option<http2::Origin> {
    let authority = http::uri::Authority::try_from(host_header(scheme, authority).as_bytes()).ok()?;
    let scheme = match scheme {
        Scheme::Http => http::uri::Scheme::HTTP,
        Scheme::Https => http::uri::Scheme::HTTPS,
    };
    Some(http2::Origin { scheme, authority })
}

/// `host[:port]`, leaving out the scheme's default port.
fn host_header(scheme: Scheme, authority: &Authority) -> HeaderValue {
    let text = match (
        authority.port == scheme.default_port(),
        authority.host.contains(':'),
    ) {
        (true, false) => authority.host.clone(),
        (true, true) => format!("[{}]", authority.host),
        (false, _) => authority.to_string(),
    };
    HeaderValue::from_str(&text).expect("validated authority is a valid header value")
}
