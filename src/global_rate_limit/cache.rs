//! Descriptors a rate-limit service said are over their limit, until their reset: while one is
//! known spent, a request that counts on it is answered here, with no call (a storm of requests
//! over a limit costs the service nothing).
//!
//! Keyed by a keyed hash of the domain and the descriptor's entries (SipHash with this process's
//! random keys: no application can aim two descriptors at one key).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tokio::time::Instant;

/// A descriptor's key in the cache (and in the token batch).
pub type Key = u64;

/// The over-limit descriptors of one service.
#[derive(Debug)]
pub struct OverLimit {
    hasher: RandomState,
    until: Mutex<HashMap<Key, Instant>>,
    /// The latest reset in the map, as nanoseconds after `base`, read without the lock: once
    /// it has passed, every entry has, and most requests find nothing spent.
    latest: AtomicU64,
    base: Instant,
}

impl Default for OverLimit {
    fn default() -> Self {
        OverLimit {
            hasher: RandomState::new(),
            until: Mutex::default(),
            latest: AtomicU64::new(0),
            base: Instant::now(),
        }
    }
}

impl OverLimit {
    /// The key of `descriptor` in `domain`.
    pub fn key(&self, domain: &str, descriptor: &RateLimitDescriptor) -> Key {
        let entries = descriptor
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()));
        self.hasher
            .hash_one((domain, entries.collect::<smallvec::SmallVec<[_; 4]>>()))
    }

    /// The latest reset among `keys` still over their limit at `now`, if any is.
    pub fn spent_until(&self, keys: &[Key], now: Instant) -> Option<Instant> {
        if self.nanos(now) >= self.latest.load(Ordering::Relaxed) {
            return None;
        }
        let until = self.until.lock().unwrap_or_else(|p| p.into_inner());
        keys.iter()
            .filter_map(|key| until.get(key).copied())
            .filter(|at| *at > now)
            .max()
    }

    /// `key` is over its limit until `at`.
    pub fn spent(&self, key: Key, at: Instant) {
        let mut until = self.until.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        // Expired entries go as new ones come: the map holds what is spent now, no more.
        until.retain(|_, reset| *reset > now);
        until.insert(key, at);
        self.latest.fetch_max(self.nanos(at), Ordering::Relaxed);
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use std::time::Duration;

    fn descriptor(pairs: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: pairs
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_spent_descriptor_is_known_until_its_reset_and_no_other_is() {
        let cache = OverLimit::default();
        let now = Instant::now();
        let a = cache.key("egress", &descriptor(&[("upstream", "partner")]));
        let b = cache.key("egress", &descriptor(&[("upstream", "llm")]));
        let a_elsewhere = cache.key("other", &descriptor(&[("upstream", "partner")]));
        assert_ne!(a, b);
        assert_ne!(a, a_elsewhere);
        assert_eq!(cache.spent_until(&[a, b], now), None);
        cache.spent(a, now + Duration::from_secs(30));
        cache.spent(b, now + Duration::from_secs(10));
        assert_eq!(cache.spent_until(&[a_elsewhere], now), None);
        assert_eq!(cache.spent_until(&[b], now), Some(now + Duration::from_secs(10)));
        assert_eq!(
            cache.spent_until(&[b, a], now),
            Some(now + Duration::from_secs(30))
        );
        assert_eq!(cache.spent_until(&[a], now + Duration::from_secs(30)), None);
    }

    #[test]
    fn entries_split_differently_are_different_descriptors() {
        let cache = OverLimit::default();
        let joined = cache.key("d", &descriptor(&[("ab", "c")]));
        let split = cache.key("d", &descriptor(&[("a", "bc")]));
        let two = cache.key("d", &descriptor(&[("a", "b"), ("c", "")]));
        assert_ne!(joined, split);
        assert_ne!(joined, two);
    }
}
