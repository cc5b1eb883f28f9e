//! Values a reload replaces while requests read them: the routes, the policy, the downstream
//! settings. A leaf so that what reads a live value need not know what reloads it.
//!
//! A read takes the lock and copies the value. A reader that reads it for every request keeps
//! a [`Seen`] copy instead, and takes the lock only after a reload: each read took a
//! lock and its release, two atomic read-modify-writes, three times per keep-alive request,
//! where the version check is a plain load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

/// A value a reload replaces; readers take a copy (cheap: a small struct or an `Arc`).
#[derive(Debug, Default)]
pub struct Live<T> {
    value: RwLock<T>,
    /// Moves on at each [`Live::set`], under the write lock.
    version: AtomicU64,
}

/// A reader's copy of one [`Live`] value, and the version it copied. Keep one per `Live` read:
/// a copy taken from another would be handed out as this one's.
#[derive(Debug, Clone)]
pub struct Seen<T>(Option<(u64, T)>);

impl<T> Default for Seen<T> {
    fn default() -> Self {
        Seen(None)
    }
}

impl<T: Clone> Live<T> {
    /// Holds `value` until the next [`Live::set`].
    pub fn new(value: T) -> Self {
        Live {
            value: RwLock::new(value),
            version: AtomicU64::new(0),
        }
    }

    /// The current value.
    pub fn get(&self) -> T {
        self.value.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// What `f` makes of the current value, read in place: no copy (for an `Arc`, no count
    /// taken and given back, two atomic read-modify-writes). `f` runs under the read lock, so
    /// it should be short.
    pub fn with<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.value.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The current value, from `seen` while no reload came since it was copied there.
    pub fn read<'s>(&self, seen: &'s mut Seen<T>) -> &'s T {
        let version = self.version.load(Ordering::Acquire);
        if !matches!(&seen.0, Some((copied, _)) if *copied == version) {
            let value = self.value.read().unwrap_or_else(|p| p.into_inner());
            // Under the read lock the version cannot move: it is the value's.
            seen.0 = Some((self.version.load(Ordering::Acquire), value.clone()));
        }
        &seen.0.as_ref().expect("copied above").1
    }

    /// Replaces the value.
    pub fn set(&self, value: T) {
        let mut current = self.value.write().unwrap_or_else(|p| p.into_inner());
        *current = value;
        self.version.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::{Live, Seen};

    #[test]
    fn a_seen_copy_is_read_until_the_next_set() {
        let live = Live::new(1);
        let mut seen = Seen::default();
        assert_eq!(*live.read(&mut seen), 1);
        assert_eq!(*live.read(&mut seen), 1);
        live.set(2);
        assert_eq!(*live.read(&mut seen), 2, "a reload reaches the next read");
        assert_eq!(live.get(), 2);
        let mut other = Seen::default();
        live.set(3);
        assert_eq!(*live.read(&mut other), 3);
        assert_eq!(*live.read(&mut seen), 3);
        assert_eq!(live.with(|v| v * 2), 6);
    }
}
