//! Values a reload replaces while requests read them: the routes, the policy, the downstream
//! settings. A leaf so that what reads a live value need not know what reloads it.

use std::sync::RwLock;

/// A value a reload replaces; readers take a copy (cheap: a small struct or an `Arc`).
#[derive(Debug, Default)]
pub struct Live<T>(RwLock<T>);

impl<T: Clone> Live<T> {
    /// Holds `value` until the next [`Live::set`].
    pub fn new(value: T) -> Self {
        Live(RwLock::new(value))
    }

    /// The current value.
    pub fn get(&self) -> T {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the value.
    pub fn set(&self, value: T) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = value;
    }
}
