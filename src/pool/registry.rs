//! The pools alive now, retired ones included until their last connection closes: what
//! `/debug/pools`, the memory budget and the shutdown walk, and what the gauges read.

use std::sync::{Arc, Mutex, Weak};

use super::Pool;
use crate::metrics::{PoolCounts, PoolSource};

/// Every pool made, held weakly: a pool lives as long as its upstream or its last connection.
#[derive(Debug, Default)]
pub struct Registry(Mutex<Vec<Weak<Pool>>>);

impl Registry {
    /// Adds `pool`, forgetting pools that are gone.
    pub fn register(&self, pool: &Arc<Pool>) {
        let mut pools = self.0.lock().unwrap_or_else(|p| p.into_inner());
        pools.retain(|weak| weak.strong_count() > 0);
        pools.push(Arc::downgrade(pool));
    }

    /// Forgets pools that are gone (a weak handle keeps a pool's memory until dropped), and
    /// gives the list's room back when most of it is empty.
    pub fn prune(&self) {
        let mut pools = self.0.lock().unwrap_or_else(|p| p.into_inner());
        crate::resident::prune_weak(&mut pools);
    }

    /// Every pool alive now, in the order they were made.
    pub fn live(&self) -> Vec<Arc<Pool>> {
        let pools = self.0.lock().unwrap_or_else(|p| p.into_inner());
        pools.iter().filter_map(Weak::upgrade).collect()
    }

    /// Upstream connections open now, over every pool (draining ones included).
    pub fn open_connections(&self) -> usize {
        self.live().iter().map(|p| p.open_connections()).sum()
    }
}

impl PoolSource for Pool {
    fn counts(&self) -> PoolCounts {
        let s = self.snapshot();
        PoolCounts {
            open: s.open,
            idle: s.idle + s.idle_http2,
            pending: s.pending,
            learned_idle_timeout: s.learned_idle_timeout,
            endpoints: {
                let e = self.endpoints().counts();
                [e.active, e.ejected, e.draining]
            },
        }
    }
}
