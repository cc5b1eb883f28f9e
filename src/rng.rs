//! One cheap random source for what needs spread, not secrecy: p2c_ewma's draws, backoff
//! jitter, access-log sampling. xorshift64 on a shared word: concurrent draws may read the same
//! state and draw alike, which spreading tolerates.

use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicU64, Ordering};

/// A xorshift64 generator shared by reference.
#[derive(Debug)]
pub struct Xorshift(AtomicU64);

impl Xorshift {
    /// A generator seeded from `salt` and the process's random hasher keys, so that two
    /// processes, or two upstreams, do not draw alike.
    pub fn seeded(salt: impl Hash) -> Self {
        // xorshift must not start at 0.
        Xorshift(AtomicU64::new(
            std::collections::hash_map::RandomState::new().hash_one(salt) | 1,
        ))
    }

    /// The next draw.
    pub fn next(&self) -> u64 {
        let mut x = self.0.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0.store(x, Ordering::Relaxed);
        x
    }

    /// A draw in `0..n` (`n` > 0).
    pub fn below(&self, n: u64) -> u64 {
        self.next() % n
    }

    /// A draw in `[0, 1)`.
    pub fn unit(&self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_spread_over_their_range() {
        let rng = Xorshift::seeded("test");
        let mut seen = [0u32; 4];
        for _ in 0..4000 {
            seen[rng.below(4) as usize] += 1;
        }
        assert!(seen.iter().all(|n| (800..1200).contains(n)), "{seen:?}");
        assert!((0..1000).map(|_| rng.unit()).all(|u| (0.0..1.0).contains(&u)));
    }
}
