//! A connection task's one timer, kept across its waits for the next request.
//!
//! A timer made for each wait cost its registration in the runtime's timer wheel and its
//! removal when the request came first: a lock and a wheel update each, about 500
//! instructions per request in callgrind, the largest single item on the keep-alive path.
//! A kept timer is moved later instead, which is an atomic compare-and-swap while it has not
//! gone off, and the wheel hears of the move only when the old deadline comes.
//!
//! The catch is that a kept timer stays armed after its wait. Left holding the task's waker,
//! it went off during the exchange that followed whenever that exchange outlasted the wait's
//! deadline (any remote upstream's, against a 5 ms quiet wait) and woke the task for nothing.
//! So the timer holds a waker of ours, a gate that passes a wake on to the task only while a
//! wait is on: after its wait the timer goes off unheard, and the next wait arms it again.
//! tokio offers no cheaper way to disarm: `Sleep` has no cancel short of drop, and drop is the
//! lock this saves. Handing the timer a no-op waker after each wait did the same for 100
//! instructions more per request (a poll, and the task's waker dropped and cloned again).
//!
//! A wait may also end up to [`SLACK`] late: a timer already set within that span is left as
//! it is, and one moved is set to the span's far end. Between requests that follow closely
//! (the quiet wait) the timer is then moved once every few milliseconds rather than at every
//! request, each move 143 instructions (callgrind). A flag, not a duration, says so: the
//! waits are in every idle connection's future.
//!
//! A timer left standing by a quiet wait (one with slack, a few milliseconds long) also
//! stands in for the watch on the client's close while a request that arrived in that wait
//! is answered ([`WaitTimer::hold`]): the watch, a read and a readiness registration on the
//! socket (about 200 instructions per request, callgrind), is armed only once the timer has
//! gone off, so only for an exchange that outlasts the quiet wait, and never for the quick
//! ones that make up a busy connection's traffic. The gate is open while the hold lasts.
//!
//! A timer left standing is not polled again either: it holds the gate's waker from the poll
//! after its last move, and tells whether it went off (`Sleep::is_elapsed`) without one. A
//! poll of the `Sleep` took the task's budget check and the timer's waker slot, about 200
//! instructions, at every wait between requests of a busy connection (callgrind, 8 clients,
//! where the slack leaves the timer standing at four waits in five).

use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use atomic_waker::AtomicWaker;
use tokio::time::{Instant, Sleep};

/// A connection task's wait timer: a `Sleep` pinned in the task, and the gate it wakes
/// through once it has been armed.
pub(super) struct WaitTimer<'a> {
    sleep: Pin<&'a mut Sleep>,
    /// Made when the timer is first armed: a connection whose waits all end at once (or that
    /// closes before any) touches neither the heap nor the timer wheel.
    gate: Option<(Arc<Gate>, Waker)>,
}

/// How late a wait with slack may end.
pub(super) const SLACK: Duration = Duration::from_millis(5);

/// A `Sleep` for a [`WaitTimer`]; each wait sets its deadline, so `at` is any instant (one the
/// caller has saves a clock read).
pub(super) fn sleep(at: Instant) -> Sleep {
    tokio::time::sleep_until(at)
}

impl<'a> WaitTimer<'a> {
    pub(super) fn new(sleep: Pin<&'a mut Sleep>) -> Self {
        WaitTimer { sleep, gate: None }
    }

    /// While the task waits on something else, a wake from this timer when it goes off, if
    /// it was last armed by a wait with slack: then within [`SLACK`] of that wait's span, a
    /// few milliseconds (a timer that has gone off already ends the hold at its first poll).
    /// `None` when the timer is not sure to go off soon (never armed, or armed by a longer
    /// wait).
    pub(super) fn hold(&self) -> Option<Hold<'_>> {
        let (gate, _) = self.gate.as_ref()?;
        // Listening: it holds the gate's waker, so its going off reaches the gate.
        if !(gate.listening.load(Ordering::Relaxed) && gate.soon.load(Ordering::Relaxed)) {
            return None;
        }
        gate.open.store(true, Ordering::Release);
        // Gone off before the gate opened, its wake went unheard: `gone_off` sees it at its
        // first poll.
        Some(Hold {
            gate,
            sleep: self.sleep.as_ref().get_ref(),
        })
    }

    /// Runs `wait` until it ends, or until `until` (with `slack`, a time up to [`SLACK`]
    /// later) (`None`). The timer is armed only if `wait` does not end at once, as
    /// `tokio::time::timeout_at` would.
    pub(super) async fn before<F: Future>(
        &mut self,
        until: Instant,
        slack: bool,
        wait: F,
    ) -> Option<F::Output> {
        Before {
            timer: self,
            until,
            slack,
            wait: pin!(wait),
            armed: false,
        }
        .await
    }
}

/// A wait on a [`WaitTimer`].
struct Before<'t, 'a, F> {
    timer: &'t mut WaitTimer<'a>,
    until: Instant,
    slack: bool,
    wait: Pin<&'t mut F>,
    armed: bool,
}

impl<F: Future> Future for Before<'_, '_, F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Poll::Ready(out) = self.wait.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        let this = &mut *self;
        let (gate, waker) = this.timer.gate.get_or_insert_with(Gate::new);
        gate.register(cx.waker());
        if !this.armed {
            this.armed = true;
            gate.open.store(true, Ordering::Release);
            // A deadline in the span has not gone off (it is still to come) and stands.
            // Moved later than its last deadline: a compare-and-swap. Earlier, or gone off:
            // the wheel's lock, as a new timer would take.
            let latest = if this.slack {
                this.until + SLACK
            } else {
                this.until
            };
            gate.soon.store(this.slack, Ordering::Relaxed);
            let set = this.timer.sleep.deadline();
            if set < this.until || set > latest {
                this.timer.sleep.as_mut().reset(latest);
                gate.listening.store(false, Ordering::Relaxed);
            }
        }
        if gate.listening.load(Ordering::Relaxed) {
            // Gone off means past its deadline, which lies in this wait's span (it was not
            // moved): the wait is over.
            return if this.timer.sleep.is_elapsed() {
                Poll::Ready(None)
            } else {
                Poll::Pending
            };
        }
        let polled = this.timer.sleep.as_mut().poll(&mut Context::from_waker(waker));
        gate.listening.store(polled.is_pending(), Ordering::Relaxed);
        polled.map(|()| None)
    }
}

impl<F> Drop for Before<'_, '_, F> {
    /// However the wait ended (a `select!` may drop it), what follows is not woken.
    fn drop(&mut self) {
        if let (true, Some((gate, _))) = (self.armed, &self.timer.gate) {
            gate.open.store(false, Ordering::Release);
        }
    }
}

/// A [`WaitTimer::hold`]: the task is woken when the timer goes off, until this is dropped.
pub(super) struct Hold<'t> {
    gate: &'t Gate,
    sleep: &'t Sleep,
}

impl Hold<'_> {
    /// Ends once the timer has gone off (the gate passes its wake on).
    pub(super) async fn gone_off(&self) {
        std::future::poll_fn(|cx| {
            self.gate.register(cx.waker());
            if self.sleep.is_elapsed() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.gate.open.store(false, Ordering::Release);
    }
}

/// Passes the timer's wake on to the task while a wait, or a [`Hold`], is open.
struct Gate {
    open: AtomicBool,
    /// The `Sleep` was polled with this gate's waker since it was last set, and was pending
    /// then: it wakes the gate when it goes off, and needs no poll till it is set again.
    /// Here rather than beside the gate: every connection's future holds the timer. Only the
    /// task reads and writes it.
    listening: AtomicBool,
    /// It was last armed by a wait with slack (a short one): it goes off within a few
    /// milliseconds of that wait, unless armed again first.
    soon: AtomicBool,
    task: AtomicWaker,
    /// The data pointer of the waker `task` holds (0 for none, as after a wake, which takes
    /// it): the task's waker is the same at every wait, and registering it again took two
    /// locked instructions per request (about forty cycles). A pointer to what the waker
    /// wakes, kept alive by the clone in `task`, so no other waker's can take its value while
    /// it is there.
    registered: AtomicUsize,
}

impl Gate {
    fn new() -> (Arc<Gate>, Waker) {
        let gate = Arc::new(Gate {
            open: AtomicBool::new(false),
            listening: AtomicBool::new(false),
            soon: AtomicBool::new(false),
            task: AtomicWaker::new(),
            registered: AtomicUsize::new(0),
        });
        let waker = Waker::from(gate.clone());
        (gate, waker)
    }

    /// Wakes `task` when the gate passes a wake on, unless it already does.
    fn register(&self, task: &Waker) {
        let data = task.data() as usize;
        if self.registered.load(Ordering::Relaxed) != data {
            self.task.register(task);
            self.registered.store(data, Ordering::Relaxed);
        }
    }
}

impl Wake for Gate {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.open.load(Ordering::Acquire) {
            // The wake takes the waker out: the task registers one again at its next poll
            // (which comes after this store).
            self.registered.store(0, Ordering::Relaxed);
            self.task.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::{poll_fn, Future};
    use std::pin::pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    use std::time::Duration;

    use tokio::time::Instant;

    /// A wait that ends before its timer leaves the timer unable to wake the task: an awaited
    /// operation that outlasts the timer's deadline is polled only when it is ready.
    #[tokio::test]
    async fn a_timer_left_armed_wakes_nothing() {
        let mut sleep = pin!(super::sleep(Instant::now()));
        let mut timer = super::WaitTimer::new(sleep.as_mut());
        let now = Instant::now();
        let ended = timer
            .before(now + Duration::from_millis(5), false, yielded_once())
            .await;
        assert_eq!(ended, Some(()), "the wait ended first, with its timer armed");

        // The exchange that follows: it outlasts the timer's deadline by far.
        let mut done = pin!(tokio::time::sleep(Duration::from_millis(60)));
        let mut polls = 0;
        poll_fn(|cx| {
            polls += 1;
            done.as_mut().poll(cx)
        })
        .await;
        assert_eq!(
            polls, 2,
            "polled once, then once when done: the kept timer woke nothing"
        );
    }

    /// A timer moved later goes off at its new deadline, not at the one it had when armed.
    #[tokio::test]
    async fn a_timer_moved_later_goes_off_at_its_new_deadline() {
        let mut sleep = pin!(super::sleep(Instant::now()));
        let mut timer = super::WaitTimer::new(sleep.as_mut());
        let start = Instant::now();
        let first = timer
            .before(start + Duration::from_millis(10), false, yielded_once())
            .await;
        assert_eq!(first, Some(()));
        let until = start + Duration::from_millis(80);
        let second = timer.before(until, false, std::future::pending::<()>()).await;
        assert_eq!(second, None, "the timer ended the wait");
        assert!(Instant::now() >= until, "not before its new deadline");
    }

    /// A timer moved earlier, and one armed again after going off, end their waits on time.
    #[tokio::test]
    async fn a_timer_moved_earlier_or_gone_off_still_ends_its_wait() {
        let mut sleep = pin!(super::sleep(Instant::now()));
        let mut timer = super::WaitTimer::new(sleep.as_mut());
        let start = Instant::now();
        let far = timer
            .before(start + Duration::from_secs(60), false, yielded_once())
            .await;
        assert_eq!(far, Some(()));
        let until = start + Duration::from_millis(20);
        let earlier = timer.before(until, false, std::future::pending::<()>()).await;
        assert_eq!(earlier, None);
        assert!(Instant::now() >= until);
        let again = Instant::now() + Duration::from_millis(20);
        let after = timer.before(again, false, std::future::pending::<()>()).await;
        assert_eq!(after, None, "armed again after going off");
        assert!(Instant::now() >= again);
    }

    /// A wait with slack sets its timer to the span's far end; the next wait whose span holds
    /// that deadline leaves the timer as it is and ends there, within its span; one whose span
    /// does not moves it.
    #[tokio::test]
    async fn a_timer_within_a_waits_slack_stands() {
        let mut sleep = pin!(super::sleep(Instant::now()));
        let mut timer = super::WaitTimer::new(sleep.as_mut());
        let start = Instant::now();
        let first = timer
            .before(start + Duration::from_millis(10), true, yielded_once())
            .await;
        assert_eq!(first, Some(()));
        let set = start + Duration::from_millis(10) + super::SLACK;
        assert_eq!(timer.sleep.deadline(), set, "the span's far end");

        let until = start + Duration::from_millis(12);
        let second = timer.before(until, true, std::future::pending::<()>()).await;
        assert_eq!(second, None, "the timer ended the wait");
        assert_eq!(timer.sleep.deadline(), set, "not moved: within the span");
        assert!(Instant::now() >= set, "at the deadline it kept, in the span");

        let third = Instant::now() + Duration::from_millis(10);
        let ended = timer.before(third, true, std::future::pending::<()>()).await;
        assert_eq!(ended, None, "armed again after going off");
        assert_eq!(timer.sleep.deadline(), third + super::SLACK, "moved: gone off");
    }

    /// A quiet wait's timer (armed with slack) left standing holds a watch deferred until it
    /// goes off: the task is woken then, through the gate the hold opened, and not before.
    #[tokio::test]
    async fn a_quiet_waits_timer_wakes_a_hold_when_it_goes_off() {
        let mut sleep = pin!(super::sleep(Instant::now()));
        let mut timer = super::WaitTimer::new(sleep.as_mut());
        let start = Instant::now();
        let until = start + Duration::from_millis(30);
        assert_eq!(timer.before(until, true, yielded_once()).await, Some(()));
        let hold = timer.hold().expect("a quiet wait's timer stands");
        let mut gone_off = pin!(hold.gone_off());
        let mut polls = 0;
        poll_fn(|cx| {
            polls += 1;
            gone_off.as_mut().poll(cx)
        })
        .await;
        assert!(Instant::now() >= until, "not before the timer's deadline");
        assert_eq!(polls, 2, "polled once, then woken once, by the timer");
    }

    /// A timer that will not go off soon holds nothing: never armed, or armed by a wait
    /// without slack (an idle timeout's, minutes away). One that went off ends a hold at once.
    #[tokio::test]
    async fn only_a_timer_due_soon_holds_a_watch() {
        let mut sleep = pin!(super::sleep(Instant::now()));
        let mut timer = super::WaitTimer::new(sleep.as_mut());
        assert!(timer.hold().is_none(), "never armed");
        let far = Instant::now() + Duration::from_secs(60);
        assert_eq!(timer.before(far, false, yielded_once()).await, Some(()));
        assert!(timer.hold().is_none(), "armed for a long wait");

        let soon = Instant::now() + Duration::from_millis(5);
        assert_eq!(timer.before(soon, true, yielded_once()).await, Some(()));
        tokio::time::sleep_until(soon + super::SLACK + Duration::from_millis(5)).await;
        let hold = timer.hold().expect("armed by a quiet wait");
        let mut polls = 0;
        poll_fn(|cx| {
            polls += 1;
            pin!(hold.gone_off()).poll(cx)
        })
        .await;
        assert_eq!(polls, 1, "gone off already: over at the first poll");
    }

    /// The timer's wake goes to the waker of the wait it ends, when that wait is polled with
    /// another waker than the one before (the gate registers a waker only when it changes).
    #[tokio::test]
    async fn a_wait_polled_with_another_waker_is_woken_through_it() {
        let mut sleep = pin!(super::sleep(Instant::now()));
        let mut timer = super::WaitTimer::new(sleep.as_mut());
        let (first, first_woken) = counting_waker();
        let (second, second_woken) = counting_waker();
        let start = Instant::now();
        {
            let wait = pin!(timer.before(
                start + Duration::from_secs(60),
                false,
                std::future::pending::<()>()
            ));
            assert!(wait.poll(&mut Context::from_waker(&first)).is_pending());
        }
        let until = start + Duration::from_millis(20);
        let mut wait = pin!(timer.before(until, false, std::future::pending::<()>()));
        assert!(wait.as_mut().poll(&mut Context::from_waker(&second)).is_pending());
        tokio::time::sleep_until(until + Duration::from_millis(30)).await;
        assert_eq!(second_woken.load(Ordering::Relaxed), 1, "the wait's own waker");
        assert_eq!(first_woken.load(Ordering::Relaxed), 0, "not the one before");
        let ended = wait.poll(&mut Context::from_waker(&second));
        assert_eq!(ended, Poll::Ready(None), "the timer ended the wait");
    }

    /// A waker that counts its wakes.
    fn counting_waker() -> (Waker, Arc<AtomicUsize>) {
        struct Counting(Arc<AtomicUsize>);
        impl Wake for Counting {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let count = Arc::new(AtomicUsize::new(0));
        (Waker::from(Arc::new(Counting(count.clone()))), count)
    }

    /// Ends on its second poll, so that `before` arms its timer.
    async fn yielded_once() {
        let mut polled = false;
        poll_fn(|cx| {
            if polled {
                return Poll::Ready(());
            }
            polled = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        })
        .await
    }
}
