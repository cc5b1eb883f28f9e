//! The admission step: whether a routed request goes upstream now, after a wait, or not at all.
//!
//! [`super::Proxy::handle`] asks once per request, after routing and header rewriting and
//! before the upstream send (the pool, or an upgrade's own connection), with what a decision
//! can rest on: the routed upstream, the request's head as it will be sent, where it came from,
//! what it asked of pacing, and its deadline. When the upstream has a fleet's rate limit
//! (`global_rate_limit`), its cache of descriptors over their limit may refuse at once, before
//! pacing takes a place in its window. Then pacing to the upstream's advertised rate limits
//! (`pace`) decides, and hands back the request's [`Ticket`], which credits the response to its
//! pace key; after pacing's wait, if any, the rate-limit service's check. What that grants goes
//! with the request: fields to add to it, where its answer's tokens are charged, and what a
//! retry counts again.
//!
//! The answer is an [`Admission`], not a future: the request path does not carry a wait's state
//! for requests that never wait, and an admitted request costs a comparison.

use std::future::Future;
use std::pin::Pin;

use http::Request;

use crate::clients::Source;
use crate::error::{ErrorKind, ProxyError};
use crate::global_rate_limit::{self, Decision, Granted, Refusal};
use crate::pace::{self, Pass, Ticket};
use crate::upstream::{Deadline, Upstream};
use crate::wire::RequestBody;

/// A request at the admission step.
#[derive(Debug)]
pub struct Admitting<'a> {
    /// The upstream it was routed to.
    pub upstream: &'a Upstream,
    /// The request, headers rewritten for the upstream; a step may add headers to it.
    pub request: &'a mut Request<RequestBody>,
    /// Where it came from.
    pub source: &'a Source,
    /// When it must have its response head, if ever: a wait that would end past it is no use.
    pub deadline: Option<Deadline>,
    /// `x-egress-pace-key` and `x-egress-priority`.
    pub pace: pace::Asked,
    /// What the upstream's global rate limit counts the request as, when it has one.
    pub global_rate_limit: Option<Box<global_rate_limit::Asking>>,
}

/// A wait before a request may go: what it is granted, or an error to answer with instead.
pub type Wait = Pin<Box<dyn Future<Output = Result<Granted, ProxyError>> + Send>>;

/// What the admission step decided.
#[must_use]
pub enum Admission {
    /// Send it now.
    Now,
    /// Send it once this wait ends well.
    After(Wait),
    /// Answer with this error; nothing goes upstream.
    Refused(ProxyError),
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Admission::Now => f.write_str("Now"),
            Admission::After(_) => f.write_str("After(..)"),
            Admission::Refused(err) => f.debug_tuple("Refused").field(err).finish(),
        }
    }
}

impl Admission {
    /// Waits out the decision: `Ok` when the request may go.
    pub async fn granted(self) -> Result<Granted, ProxyError> {
        match self {
            Admission::Now => Ok(Granted::default()),
            Admission::After(wait) => wait.await,
            Admission::Refused(err) => Err(err),
        }
    }
}

/// The admission policy a proxy applies: pacing, then the fleet's global rate limit.
#[derive(Default)]
pub struct Admit {
    /// What unit tests decide instead.
    #[cfg(test)]
    probe: Option<Probe>,
}

/// A test's admission decision.
#[cfg(test)]
pub(crate) type Probe = Box<dyn Fn(&mut Admitting<'_>) -> Admission + Send + Sync>;

impl std::fmt::Debug for Admit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admit").finish_non_exhaustive()
    }
}

impl Admit {
    /// An admission step that decides as `probe` says.
    #[cfg(test)]
    pub(crate) fn probed(probe: Probe) -> Self {
        Admit { probe: Some(probe) }
    }

    /// Decides for `request`; the ticket goes with it to the upstream send.
    #[inline]
    pub fn admit(&self, request: Admitting<'_>) -> (Admission, Ticket) {
        #[cfg(test)]
        if let Some(probe) = &self.probe {
            let mut request = request;
            return (probe(&mut request), Ticket::default());
        }
        let Admitting {
            upstream,
            request,
            deadline,
            pace,
            global_rate_limit,
            ..
        } = request;
        let label = || upstream.label().to_owned();
        // The limiter's cache first: a request it refuses takes nothing of pacing's window.
        let check = match (upstream.global_rate_limit(), global_rate_limit) {
            (Some(limiter), Some(asking)) => match limiter.check(asking, deadline.map(|d| d.at)) {
                Decision::Refused(refusal) => {
                    let refused = Admission::Refused(over_global_limit(label(), refusal));
                    return (refused, Ticket::default());
                }
                Decision::Ask(check) => Some(check),
            },
            _ => None,
        };
        let (ticket, pass) = upstream.pace(request, pace, deadline);
        let admission = match (pass, check) {
            (Pass::Refuse(refusal), _) => Admission::Refused(rate_limited(label(), refusal)),
            (Pass::Go, None) => Admission::Now,
            (Pass::Wait(waiting), None) => {
                let label = label();
                Admission::After(Box::pin(async move {
                    waiting.await.map_err(|refusal| rate_limited(label, refusal))?;
                    Ok(Granted::default())
                }))
            }
            (pass, Some(check)) => {
                let label = label();
                Admission::After(Box::pin(async move {
                    if let Pass::Wait(waiting) = pass {
                        waiting
                            .await
                            .map_err(|refusal| rate_limited(label.clone(), refusal))?;
                    }
                    check.await.map_err(|refusal| over_global_limit(label, refusal))
                }))
            }
        };
        (admission, ticket)
    }
}

/// The answer to a request the global rate limit refuses.
fn over_global_limit(upstream: String, refusal: Refusal) -> ProxyError {
    match refusal {
        Refusal::OverLimit {
            retry_after_secs,
            headers,
        } => ProxyError::new(
            ErrorKind::RateLimited,
            format!(
                "the fleet's rate limit (global_rate_limit) is spent; the rate-limit service says it resets in {retry_after_secs}s"
            ),
        )
        .with_upstream(upstream)
        .with_retry_after(retry_after_secs)
        .with_headers(headers),
        Refusal::Unavailable(why) => ProxyError::new(
            ErrorKind::RateLimitUnavailable,
            format!("{why}, and global_rate_limit.failure_mode is deny"),
        )
        .with_upstream(upstream),
    }
}

/// The answer to a request pacing would hold too long.
fn rate_limited(upstream: String, refusal: pace::Refusal) -> ProxyError {
    ProxyError::new(
        ErrorKind::RateLimited,
        format!(
            "the upstream's rate limit leaves no room before pace.max_wait or the request's deadline; its quota resets in {}s",
            refusal.retry_after_secs
        ),
    )
    .with_upstream(upstream)
    .with_retry_after(refusal.retry_after_secs)
}

#[cfg(test)]
mod tests;
