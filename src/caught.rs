//! The net under the request path: a panic while a request's or a downstream connection's
//! future is polled is caught, logged in the span it happened in, and counted
//! (`egress_panics_total`), instead of ending its task with nothing but the panic hook's line
//! on stderr and a connection closed under the application.
//!
//! Panics are bugs, and the code avoids them (outside values are bounded where they are
//! parsed: `crate::duration`); this is what is left when one gets through. Where a response
//! can still be written the caller answers `502` with `x-egress-error: internal`
//! (`crate::proxy`); where it cannot, the connection closes (`crate::downstream`).
//!
//! A caught future is never polled again: its state is whatever the panic left, so the caller
//! drops it, which runs the destructors of what it held (a pool lease closes its connection,
//! a permit goes back), as the runtime would have.

use std::any::Any;
use std::borrow::Borrow;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};

use prometheus_client::metrics::counter::Counter;

/// A panic caught while polling, with its message.
#[derive(Debug)]
pub struct Panicked(pub String);

pin_project_lite::pin_project! {
    /// `future` under the net: its output, or the panic that ended it. A struct, not an
    /// `async fn`, because an `async fn` taking the future by value and pinning it holds it
    /// twice in its own state (the argument's room and the pinned local's): 1,176 bytes more
    /// in every connection's exchanges.
    #[derive(Debug)]
    pub struct Caught<F, C> {
        #[pin]
        future: F,
        // `&Counter` on the request path (no reference count per request), `Counter` for a
        // spawned task.
        panics: C,
    }
}

impl<F: Future, C: Borrow<Counter>> Caught<F, C> {
    /// `future`, its panics counted in `panics`.
    pub fn new(future: F, panics: C) -> Self {
        Caught { future, panics }
    }
}

impl<F: Future, C: Borrow<Counter>> Future for Caught<F, C> {
    type Output = Result<F::Output, Panicked>;

    /// Polls the future, catching a panic: logs it (the current span is the request's or the
    /// connection's), counts it, and returns its message. Like any future, it is not polled
    /// after its end (a panicked `async` block would only panic again, and be caught again).
    ///
    /// `AssertUnwindSafe`: what the future shares with other tasks is behind locks that
    /// tolerate poisoning (`unwrap_or_else(PoisonError::into_inner)`) or atomics, and the
    /// future itself is dropped without another poll.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let future = this.future;
        match catch_unwind(AssertUnwindSafe(|| future.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Err(payload) => {
                let message = message(payload.as_ref());
                Borrow::<Counter>::borrow(&*this.panics).inc();
                tracing::error!(panic = %message, "panic caught: a bug, please report it");
                Poll::Ready(Err(Panicked(message)))
            }
        }
    }
}

/// A panic's message: the `&str` or `String` given to `panic!`, else a placeholder.
fn message(payload: &(dyn Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "(no message)".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_is_caught_counted_and_its_state_dropped() {
        struct Held(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Held {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let panics = Counter::default();
        let held = Held(dropped.clone());
        let outcome = Caught::new(
            async move {
                let _held = held;
                tokio::task::yield_now().await;
                let n: u64 = std::hint::black_box(u64::MAX);
                n + 1
            },
            &panics,
        )
        .await;
        let Err(Panicked(message)) = outcome else {
            panic!("not caught: {outcome:?}");
        };
        assert!(message.contains("overflow"), "{message}");
        assert_eq!(panics.get(), 1);
        assert!(
            dropped.load(std::sync::atomic::Ordering::SeqCst),
            "what it held was dropped"
        );

        let fine = Caught::new(async { 7 }, &panics).await;
        assert!(matches!(fine, Ok(7)));
        assert_eq!(panics.get(), 1);
    }
}
