//! The upstreams met on the fly: the live ones, the record a quiet one leaves when it is let
//! go, and forgetting.
//!
//! An upstream made for an absolute-form request to an authority no configured upstream names
//! holds a pool, endpoints, a pacer, a connector and its settings: about 6 KB of heap, spread
//! over a dozen allocations. A forward proxy that meets thousands of hosts (webhook senders,
//! crawlers, multi-tenant callers) kept all of that for every host until it was forgotten 5
//! minutes after its last request: 12 KB of resident memory per host once the heap between
//! those allocations could not be handed back (issue 47).
//!
//! So an on-the-fly upstream that has gone quiet is let go (dropped), and the table keeps a
//! small record of it: the host is remembered. Quiet means: no connection of its pools is
//! open, nothing but the table holds it (no request in flight or waiting for a connection),
//! its pacer was never told a limit (that must outlive the connections, or the next burst
//! stampedes), and no request routed to it for [`QUIET`]. The record keeps when the host was last used and, if its pool learned
//! anything of the upstream's idle timeout, that learning; the next request makes the
//! upstream again from the `defaults` in force, with that learning. Nothing else carries over:
//! the endpoints' outlier state and latency averages, the retry budget and the pool's counters
//! start afresh, as for a host met for the first time. Its metric series stay while it is
//! remembered (the `upstream` label is the same host:port).
//!
//! The records are kept by a keyed 64-bit hash of the scheme and authority, inline in one
//! table: no allocation per host. A record holding the host's name would be a small
//! allocation made when the host was first met, among its upstream's, and thousands of them
//! would pin the heap pages those upstreams freed. Two hosts of one hash (about one chance in
//! 10^12 among 5,000) would share a learned idle timeout, nothing more.
//!
//! A host unused for [`FORGET`] (live with no connection open, or remembered) is forgotten,
//! and with it the metric series of its label and its place under the label cap (256), unless
//! another host in the table bears the same label (`http://` and `https://` to one host:port).
//! [`Table::sweep`] does both, from a task that runs every [`SWEEP_EVERY`].
//!
//! Not handled here: which requests reach the table, and making an upstream (`routing`,
//! `upstream`).

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::config::{Authority, Scheme};
use crate::pool::learn::IdleLearner;
use crate::upstream::Upstream;

/// An on-the-fly upstream unused this long (and holding no connection) is forgotten.
pub const FORGET: Duration = Duration::from_secs(300);
/// An on-the-fly upstream quiet for this long is let go, and its host remembered.
pub const QUIET: Duration = Duration::from_secs(10);
/// How often the table is swept.
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// What identifies an on-the-fly upstream.
pub(super) type Key = (Scheme, Authority);

/// A live on-the-fly upstream and when a request last used it.
#[derive(Debug)]
pub(super) struct Met {
    pub(super) upstream: Arc<Upstream>,
    pub(super) used: Instant,
}

/// What a quiet upstream leaves: when it was last used, what its pool learned of the
/// upstream's idle timeout (`None` when nothing), and the `upstream` label of its metric series
/// when it has one of its own (one of the first 256: `None` past the cap), so that forgetting
/// the host removes them.
#[derive(Debug)]
struct Remembered {
    used: Instant,
    learned: Option<Box<IdleLearner>>,
    label: Option<Box<str>>,
}

/// The table's maps, behind its lock.
#[derive(Debug, Default)]
pub(super) struct Maps {
    pub(super) live: HashMap<Key, Met>,
    /// By [`Table::fingerprint`].
    remembered: FxHashMap<u64, Remembered>,
}

/// The on-the-fly upstreams: live, and remembered.
#[derive(Debug, Default)]
pub struct Table {
    maps: Mutex<Maps>,
    /// Keys the records' hashes: hosts a client names cannot be chosen to collide.
    hasher: RandomState,
}

/// What a sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Live upstreams let go, their hosts remembered.
    pub released: usize,
    /// Hosts forgotten, live or remembered.
    pub forgotten: usize,
}

/// `/debug/pools`' `on_the_fly`: how many hosts the table holds.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct OnTheFlyReport {
    /// Upstreams with their pools.
    pub live: usize,
    /// Hosts remembered by their record only.
    pub remembered: usize,
}

impl Table {
    pub(super) fn lock(&self) -> MutexGuard<'_, Maps> {
        self.maps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live upstream for `key`, used now; else one `make` makes (given what the host's
    /// record kept), which the table keeps.
    pub(super) fn get_or_make(
        &self,
        key: Key,
        now: Instant,
        make: impl FnOnce(&Key, Option<IdleLearner>) -> Arc<Upstream>,
    ) -> Arc<Upstream> {
        let mut maps = self.lock();
        if let Some(live) = maps.live.get_mut(&key) {
            live.used = now;
            return live.upstream.clone();
        }
        let learned = match maps.remembered.is_empty() {
            true => None,
            false => maps
                .remembered
                .remove(&self.fingerprint(&key))
                .and_then(|d| d.learned)
                .map(|l| *l),
        };
        let upstream = make(&key, learned);
        maps.live.insert(
            key,
            Met {
                upstream: upstream.clone(),
                used: now,
            },
        );
        upstream
    }

    /// Lets quiet upstreams go and forgets hosts unused for [`FORGET`]; gives back the
    /// maps' room when most of it is empty. `forget_label` is called, under the table's lock
    /// (no upstream is made meanwhile), with each metric label a forgotten host had of its own
    /// and no host left in the table has.
    pub fn sweep(&self, now: Instant, mut forget_label: impl FnMut(&str)) -> Swept {
        let mut swept = Swept::default();
        let mut released = Vec::new();
        let mut labels: Vec<Box<str>> = Vec::new();
        let mut maps = self.lock();
        maps.live.retain(|key, live| {
            let unused = now.saturating_duration_since(live.used);
            // Only the table holds it: no request is on it or waiting for its pool.
            let alone = Arc::strong_count(&live.upstream) == 1;
            if !alone || live.upstream.open_connections() > 0 {
                return true;
            }
            if unused >= FORGET {
                swept.forgotten += 1;
                labels.extend(own_label(&live.upstream).map(Box::from));
                return false;
            }
            if unused < QUIET || live.upstream.pacer_was_told() {
                return true;
            }
            let learned = live.upstream.take_learning().map(Box::new);
            let label = own_label(&live.upstream).map(Box::from);
            released.push((
                self.fingerprint(key),
                Remembered {
                    used: live.used,
                    learned,
                    label,
                },
            ));
            false
        });
        swept.released = released.len();
        let before = maps.remembered.len();
        maps.remembered.retain(|_, r| {
            let keep = now.saturating_duration_since(r.used) < FORGET;
            if !keep {
                labels.extend(r.label.take());
            }
            keep
        });
        swept.forgotten += before - maps.remembered.len();
        maps.remembered.extend(released);
        if !labels.is_empty() {
            // http:// and https:// to one host:port are two hosts under one label.
            let live = maps.live.values().filter_map(|m| own_label(&m.upstream));
            let remembered = maps.remembered.values().filter_map(|r| r.label.as_deref());
            let held: HashSet<&str> = live.chain(remembered).collect();
            for label in labels.iter().filter(|l| !held.contains(&***l)) {
                forget_label(label);
            }
        }
        shrink_if_sparse(&mut maps.live);
        shrink_if_sparse(&mut maps.remembered);
        swept
    }

    /// How many hosts are live and remembered now.
    pub fn report(&self) -> OnTheFlyReport {
        let maps = self.lock();
        OnTheFlyReport {
            live: maps.live.len(),
            remembered: maps.remembered.len(),
        }
    }

    fn fingerprint(&self, key: &Key) -> u64 {
        self.hasher.hash_one(key)
    }
}

/// The upstream's metric label when it is its own (not `other`, which hosts past the label
/// cap share).
fn own_label(upstream: &Upstream) -> Option<&str> {
    Some(upstream.metrics_label()).filter(|label| *label != crate::metrics::OTHER)
}

/// Gives a map's room back once [`crate::resident::mostly_empty`].
fn shrink_if_sparse<K: Eq + std::hash::Hash, V, S: BuildHasher>(map: &mut HashMap<K, V, S>) {
    if crate::resident::mostly_empty(map.len(), map.capacity()) {
        map.shrink_to_fit();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use http::{HeaderMap, Uri};

    use super::*;
    use crate::routing::tests::router;
    use crate::routing::{Arrival, Router};

    fn route(router: &Router, url: &str) -> Arc<Upstream> {
        let uri: Uri = url.parse().unwrap();
        router
            .route(&Arrival::Forward, &uri, &HeaderMap::new())
            .unwrap()
            .upstream
    }

    fn swept(released: usize, forgotten: usize) -> Swept {
        Swept { released, forgotten }
    }

    fn counts(router: &Router) -> (usize, usize) {
        let r = router.on_the_fly().report();
        (r.live, r.remembered)
    }

    /// A learner that has seen the upstream close three idle connections at 5 s.
    fn learned_5s() -> IdleLearner {
        let mut learner = IdleLearner::default();
        let now = tokio::time::Instant::now();
        for i in 0..3 {
            learner.observe(Duration::from_secs(5), now + Duration::from_secs(i));
        }
        assert!(learner.learned(now + Duration::from_secs(3)).is_some());
        learner
    }

    #[test]
    fn a_quiet_host_is_let_go_keeping_what_its_pool_learned_and_is_made_again() {
        let router = router("");
        let first = route(&router, "http://127.1.0.1:8080/");
        assert!(Arc::ptr_eq(&first, &route(&router, "http://127.1.0.1:8080/x")));
        first.pool().resume_learning(learned_5s());
        // Held by a request: live whatever its age.
        let at = Instant::now() + QUIET;
        assert_eq!(router.sweep_on_the_fly(at), Swept::default());
        let weak = Arc::downgrade(&first);
        drop(first);
        // Not quiet long enough yet.
        assert_eq!(router.sweep_on_the_fly(Instant::now()), Swept::default());
        assert_eq!(counts(&router), (1, 0));
        assert_eq!(router.sweep_on_the_fly(at), swept(1, 0));
        assert_eq!(counts(&router), (0, 1));
        assert!(weak.upgrade().is_none(), "the upstream is dropped");
        assert!(router.shared.pools.live().is_empty(), "and its pool with it");

        let again = route(&router, "http://127.1.0.1:8080/");
        assert_eq!(counts(&router), (1, 0));
        assert_eq!(
            again.pool().report().idle_close_observations,
            3,
            "what it learned came back"
        );
        assert!(again.pool().snapshot().learned_idle_timeout.is_some());
        assert_eq!(router.shared.pools.live().len(), 1);
    }

    #[test]
    fn hosts_unused_for_five_minutes_are_forgotten_live_or_remembered() {
        let router = router("");
        drop(route(&router, "http://127.1.0.1:8080/"));
        drop(route(&router, "https://127.1.0.2:8443/"));
        assert_eq!(router.sweep_on_the_fly(Instant::now() + QUIET), swept(2, 0));
        drop(route(&router, "http://127.1.0.2:8443/"));
        assert_eq!(counts(&router), (1, 2), "http and https are two hosts");
        assert_eq!(router.sweep_on_the_fly(Instant::now() + FORGET), swept(0, 3));
        assert_eq!(counts(&router), (0, 0));
        // Forgotten, it is met afresh: nothing learned.
        let again = route(&router, "http://127.1.0.1:8080/");
        assert_eq!(again.pool().report().idle_close_observations, 0);
    }

    #[test]
    fn a_pacer_told_a_limit_keeps_its_upstream_live_until_forgotten() {
        let router = router("");
        let up = route(&router, "http://127.1.0.1:8080/");
        up.tell_pacer_for_test(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "30s"),
        ]);
        assert!(up.pacer_was_told());
        drop(up);
        assert_eq!(router.sweep_on_the_fly(Instant::now() + QUIET), Swept::default());
        assert_eq!(counts(&router), (1, 0));
        assert_eq!(router.sweep_on_the_fly(Instant::now() + FORGET), swept(0, 1));
    }

    #[test]
    fn forgetting_a_host_removes_its_series_unless_another_host_bears_its_label() {
        let router = router("");
        let series = |label: &str| {
            let needle = format!("upstream=\"{label}\"");
            let text = router.shared.metrics.render();
            text.lines().filter(|l| l.contains(&needle)).count()
        };
        drop(route(&router, "https://127.1.0.1:8443/"));
        let plain = route(&router, "http://127.1.0.1:8443/");
        let made = series("127.1.0.1:8443");
        assert!(made > 0);
        // The https host is let go, then forgotten; the http one, under the same label, is
        // held by a request.
        router.sweep_on_the_fly(Instant::now() + QUIET);
        assert_eq!(counts(&router), (1, 1));
        assert_eq!(router.sweep_on_the_fly(Instant::now() + FORGET), swept(0, 1));
        assert_eq!(series("127.1.0.1:8443"), made, "still the label of a live host");
        drop(plain);
        router.sweep_on_the_fly(Instant::now() + FORGET);
        assert_eq!(counts(&router), (0, 0));
        assert_eq!(series("127.1.0.1:8443"), 0, "{}", router.shared.metrics.render());
    }

    #[test]
    fn a_burst_of_hosts_gives_its_table_room_back() {
        let router = router("");
        for i in 0..2000 {
            drop(route(
                &router,
                &format!("http://127.1.{}.{}:80/", i / 250, i % 250 + 1),
            ));
        }
        router.sweep_on_the_fly(Instant::now() + QUIET);
        assert_eq!(counts(&router), (0, 2000));
        assert_eq!(
            router.on_the_fly.lock().live.capacity(),
            0,
            "the live map's room is given back"
        );
        router.sweep_on_the_fly(Instant::now() + FORGET);
        assert_eq!(counts(&router), (0, 0));
        assert_eq!(router.on_the_fly.lock().remembered.capacity(), 0);
    }
}
