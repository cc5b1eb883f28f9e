//! An upstream attempt's OpenTelemetry span (`trace::Attempt`), for a traced request: begun
//! before the pool is asked, told what the pool gave, ended by the response head or the failure;
//! and the reason each retry is made, counted and told to the next attempt's span.

use http::{Request, Response};

use super::{Attempted, Failure, Upstream};
use crate::pool::{Lease, ServedBy};
use crate::trace::{self, Attempt};
use crate::wire::RequestBody;

impl Upstream {
    /// The span of the attempt about to send `req` (its `resend_count`th resend), when the
    /// request is traced.
    pub(super) fn attempt_span(
        &self,
        req: &mut Request<RequestBody>,
        resend_count: u32,
    ) -> Option<Box<Attempt>> {
        let target = trace::Target {
            scheme: self.scheme.as_str(),
            host: &self.authority.host,
            port: self.authority.port,
        };
        Attempt::begin(req, target, resend_count, self.settings.tracing.propagate)
    }

    /// Counts a retry for `reason`, and names it on the next attempt's span.
    pub(super) fn retried(&self, req: &mut Request<RequestBody>, reason: &str) {
        self.metrics.retried(reason);
        trace::retrying(req, reason);
    }
}

/// What the pool gave the attempt.
pub(super) fn leased(span: &mut Option<Box<Attempt>>, lease: &Lease, served: &ServedBy) {
    if let Some(span) = span {
        span.leased(lease.granted(), served.endpoint, served.reused, served.http2);
    }
}

/// The attempt's answer, as it goes on.
pub(super) fn answered<T>(
    span: Option<Box<Attempt>>,
    answer: Result<Response<T>, Attempted>,
) -> Result<Response<T>, Attempted> {
    if let Some(span) = span {
        match &answer {
            Ok(resp) => span.answered(resp.status().as_u16()),
            Err((err, _)) => span.failed(err.kind().as_str()),
        }
    }
    answer
}

/// The attempt failed before it had a connection.
pub(super) fn failed(span: Option<Box<Attempt>>, attempted: Attempted) -> Attempted {
    if let Some(span) = span {
        span.failed(attempted.0.kind().as_str());
    }
    attempted
}

/// The attempt failed on its connection.
pub(super) fn failure(span: Option<Box<Attempt>>, failure: Failure) -> Failure {
    if let Some(span) = span {
        let (Failure::Unsent(err) | Failure::Refused(err) | Failure::Sent(err)) = &failure;
        span.failed(err.kind().as_str());
    }
    failure
}
