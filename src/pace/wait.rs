//! A request waiting its turn under a pace key, and the refusal of one that would wait too long.
//!
//! The first waiter of a key sleeps until the key opens and then goes, waking the next; the
//! others sleep until their time to give up, woken when they become first. A waiter dropped
//! (its application went away) leaves the queue at once, as the pool's queue does.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use super::key::{Key, Place, Turn};
use crate::config::PaceConfig;
use crate::metrics::PaceMetrics;

/// A request waiting under a pace key: `Ok` when it may go.
#[derive(Debug)]
pub struct Waiting {
    key: Arc<Key>,
    place: Place,
    give_up: Instant,
    config: PaceConfig,
    since: Instant,
    sleep: Pin<Box<Sleep>>,
    metrics: PaceMetrics,
    done: bool,
}

/// Pacing would hold the request past its `max_wait` or deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Whole seconds until the key's reset, rounded up: the answer's `Retry-After`.
    pub retry_after_secs: u64,
}

impl Refusal {
    /// The refusal of a request at `now` that cannot go before `reset`.
    pub(super) fn until(reset: Instant, now: Instant) -> Self {
        let wait = reset.saturating_duration_since(now);
        Refusal {
            // At least 1: `Retry-After: 0` would send the application straight back.
            retry_after_secs: (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1),
        }
    }
}

impl Waiting {
    pub(super) fn new(
        key: Arc<Key>,
        place: Place,
        give_up: Instant,
        config: PaceConfig,
        metrics: PaceMetrics,
    ) -> Self {
        let now = Instant::now();
        Waiting {
            key,
            place,
            give_up,
            config,
            since: now,
            sleep: Box::pin(tokio::time::sleep_until(now)),
            metrics,
            done: false,
        }
    }

    fn waited(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.since)
    }
}

impl Future for Waiting {
    type Output = Result<(), Refusal>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            let now = Instant::now();
            match this
                .key
                .turn(this.place, now, &this.config, this.give_up, cx.waker())
            {
                Turn::Go => {
                    this.done = true;
                    this.metrics.wait_seconds.observe(this.waited(now).as_secs_f64());
                    return Poll::Ready(Ok(()));
                }
                Turn::Refused(reset) => {
                    this.done = true;
                    this.metrics.rejected.inc();
                    return Poll::Ready(Err(Refusal::until(reset, now)));
                }
                Turn::Later(at) => {
                    this.sleep.as_mut().reset(at);
                    if this.sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                }
            }
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if !self.done {
            self.key.leave(self.place);
        }
    }
}
