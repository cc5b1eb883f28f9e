//! The bound on idle keep-alive application connections (`downstream.max_idle_connections`).
//!
//! A leaking client can park thousands of idle connections here within one `idle_timeout`; each
//! costs little, but together they can push the sidecar over its memory limit. Connections that
//! have been idle for a moment enter a list in the order they went idle; when the list is over
//! its bound the longest idle is told to close (nginx's `reuse of keepalive connections` under
//! `worker_connections` pressure does the same).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// Idle connections in the order they went idle.
#[derive(Debug, Default)]
pub struct IdleList {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    waiting: BTreeMap<u64, Arc<Notify>>,
}

/// A connection's place in the list; leaving the idle wait drops it.
#[derive(Debug)]
pub struct IdleEntry<'a> {
    list: &'a IdleList,
    seq: u64,
    evict: Arc<Notify>,
}

impl IdleList {
    /// Adds a connection going idle; if that makes more than `max`, the longest idle ones are
    /// told to close.
    pub fn enter(&self, max: usize) -> IdleEntry<'_> {
        let evict = Arc::new(Notify::new());
        let mut inner = self.lock();
        let seq = inner.next;
        inner.next += 1;
        inner.waiting.insert(seq, evict.clone());
        while inner.waiting.len() > max.max(1) {
            if let Some((_, oldest)) = inner.waiting.pop_first() {
                // A stored permit: the connection sees it even if it is not polling right now.
                oldest.notify_one();
            }
        }
        IdleEntry {
            list: self,
            seq,
            evict,
        }
    }

    /// Connections in the list now.
    pub fn len(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Whether no connection is in the list.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl IdleEntry<'_> {
    /// Completes when this connection must close to keep the list within its bound.
    pub async fn evicted(&self) {
        self.evict.notified().await;
    }
}

impl Drop for IdleEntry<'_> {
    fn drop(&mut self) {
        self.list.lock().waiting.remove(&self.seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_longest_idle_is_evicted_first() {
        let list = IdleList::default();
        let first = list.enter(2);
        let second = list.enter(2);
        let third = list.enter(2);
        assert_eq!(list.len(), 2);
        let now = std::time::Duration::from_millis(10);
        assert!(tokio::time::timeout(now, first.evicted()).await.is_ok());
        assert!(tokio::time::timeout(now, second.evicted()).await.is_err());
        drop(second);
        assert_eq!(list.len(), 1);
        drop(third);
        drop(first);
        assert!(list.is_empty());
    }
}
