//! An upstream's limits: its pacing, whether a request goes now, waits or is refused (`pace`),
//! crediting each response head, retried ones too, to the request's pace key; and the fleet's
//! rate limit its requests are checked against (`global_rate_limit`). A retry by policy counts
//! again against both.

use std::sync::Arc;

use http::{Request, Response};

use super::Timing;
use super::{Deadline, Shared, Upstream};
use crate::config::UpstreamSettings;
use crate::global_rate_limit::{Limiter, Recount};
use crate::pace::{self, Ticket};
use crate::pool::PooledBody;
use crate::wire::RequestBody;

impl Upstream {
    /// Whether `req` (its head as it will be sent) goes now, waits, or is refused by pacing;
    /// `asked`: what it asked of pacing; `deadline`: [`Upstream::deadline`].
    pub fn pace(
        &self,
        req: &Request<RequestBody>,
        asked: pace::Asked,
        deadline: Option<Deadline>,
    ) -> (Ticket, pace::Pass) {
        self.pacer.admit(
            &self.settings.pace,
            req.headers(),
            &self.credentials,
            asked,
            deadline.map(|d| d.at),
        )
    }

    /// Credits a response head to pacing.
    pub(super) fn paced(&self, ticket: &Ticket, resp: &Response<PooledBody<Timing>>) {
        self.pacer.observe(
            &self.settings.pace,
            ticket,
            resp.status().as_u16(),
            resp.headers(),
            resp.body().wire_fields(),
        );
    }

    /// How long the key of `ticket` holds a retry: a `Retry-After`, or no quota left; `None`
    /// when it is open (smoothing does not hold a retry, already a request of the window).
    pub(super) fn pace_hold(&self, ticket: &Ticket) -> Option<std::time::Duration> {
        self.pacer.holds_for(&self.settings.pace, ticket)
    }

    /// A retry of `req` goes: it counts against its pace key's window (`ticket`), and once
    /// more on the global rate limit's request descriptors when it was checked against them.
    pub(super) fn counts_again(&self, ticket: &Ticket, req: &Request<RequestBody>) {
        self.pacer.again(&self.settings.pace, ticket);
        if let Some(recount) = req.extensions().get::<Recount>() {
            recount.again();
        }
    }

    /// The global rate limit this upstream's requests are checked against; `None` when
    /// `global_rate_limit` counts nothing.
    pub fn global_rate_limit(&self) -> Option<&Arc<Limiter>> {
        self.global_rate_limit.as_ref()
    }
}

/// The limiter of the upstream `label` with `settings`, on the service it names.
pub(super) fn limiter(shared: &Shared, label: &str, settings: &UpstreamSettings) -> Option<Arc<Limiter>> {
    shared
        .rate_limit_services
        .limiter(label, &settings.global_rate_limit, &shared.metrics)
}

#[cfg(test)]
impl Upstream {
    /// Admits a bodyless request and credits a `200` carrying `fields` to its pace key.
    pub(crate) fn tell_pacer_for_test(&self, fields: &[(&'static str, &str)]) {
        let req = Request::new(RequestBody::Empty);
        let (ticket, _) = self.pace(&req, pace::Asked::default(), None);
        let mut headers = http::HeaderMap::new();
        for (name, value) in fields {
            headers.insert(*name, value.parse().unwrap());
        }
        self.pacer
            .observe(&self.settings.pace, &ticket, 200, &headers, None);
    }
}
