//! An upstream's pacing: whether a request goes now, waits or is refused (`pace`), and
//! crediting each response head, retried ones too, to the request's pace key.

use http::{Request, Response};

use super::{Deadline, Upstream};
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
    pub(super) fn paced(&self, ticket: &Ticket, resp: &Response<PooledBody>) {
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

    /// A retry of `ticket`'s request goes: it counts against its key's window.
    pub(super) fn pace_again(&self, ticket: &Ticket) {
        self.pacer.again(&self.settings.pace, ticket);
    }
}
