//! The admission step: whether a routed request goes upstream now, after a wait, or not at all.
//!
//! [`super::Proxy::handle`] asks once per request, after routing and header rewriting and
//! before the upstream send (the pool, or an upgrade's own connection), with what a decision
//! can rest on: the routed upstream, the request's head as it will be sent, where it came from
//! and its deadline. Today every request is admitted at once; pacing to an upstream's advertised
//! rate limits and a fleet-wide quota decide here.
//!
//! The answer is an [`Admission`], not a future: the request path does not carry a wait's state
//! for requests that never wait, and an admitted request costs a comparison.

use std::future::Future;
use std::pin::Pin;

use http::Request;

use crate::clients::Source;
use crate::error::ProxyError;
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
}

/// A wait before a request may go: `Ok` to send it, an error to answer with instead.
pub type Wait = Pin<Box<dyn Future<Output = Result<(), ProxyError>> + Send>>;

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
    pub async fn granted(self) -> Result<(), ProxyError> {
        match self {
            Admission::Now => Ok(()),
            Admission::After(wait) => wait.await,
            Admission::Refused(err) => Err(err),
        }
    }
}

/// The admission policy a proxy applies; today it admits everything.
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

    /// Decides for `request`.
    #[inline]
    pub fn admit(&self, request: Admitting<'_>) -> Admission {
        #[cfg(test)]
        if let Some(probe) = &self.probe {
            let mut request = request;
            return probe(&mut request);
        }
        let _ = request;
        Admission::Now
    }
}

#[cfg(test)]
mod tests;
