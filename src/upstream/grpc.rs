//! gRPC to a plain-TCP upstream whose `protocol` is `auto`: such an upstream is spoken to in
//! HTTP/1.1 (nothing on plain TCP says it knows HTTP/2), which cannot carry gRPC (it needs
//! trailers, and its streams are meant to multiplex). So gRPC requests (`POST`, as gRPC
//! always is, with `content-type: application/grpc…`) to it get an h2c pool of their own,
//! HTTP/2 with prior knowledge, made on the first one: a leaky gRPC client's calls then share a connection or two
//! instead of one per client connection. `protocol: http1` is respected as written.

use std::sync::{Arc, OnceLock};

use http::header::CONTENT_TYPE;
use http::HeaderMap;

use super::{PoolKey, Shared, Upstream};
use crate::config::{Protocol, UpstreamSettings};
use crate::metrics::PoolSource;
use crate::pool::Pool;

/// The h2c pool for gRPC requests of an upstream that speaks HTTP/1.1 otherwise.
#[derive(Debug)]
pub(super) struct GrpcPool {
    pool: OnceLock<Arc<Pool>>,
    shared: Shared,
}

impl GrpcPool {
    /// For an upstream that needs one (`auto` on plain TCP); `previous` is the same upstream
    /// before a reload that kept its pool key, whose gRPC pool carries over.
    pub(super) fn for_upstream(
        key: &PoolKey,
        settings: &UpstreamSettings,
        shared: &Shared,
        previous: Option<&Upstream>,
    ) -> Option<Self> {
        if key.scheme != crate::config::Scheme::Http || settings.protocol != Protocol::Auto {
            return None;
        }
        let pool = OnceLock::new();
        let carried = previous.and_then(|p| p.grpc.as_ref()).and_then(|g| g.pool.get());
        if let Some(previous) = carried {
            previous.reconfigure(settings.pool, settings.http2.max_streams_per_connection as usize);
            let _ = pool.set(previous.clone());
        }
        Some(GrpcPool {
            pool,
            shared: shared.clone(),
        })
    }

    /// The pool, made on first use.
    pub(super) fn pool(&self, upstream: &Upstream) -> &Arc<Pool> {
        self.pool.get_or_init(|| {
            let mut settings = upstream.settings.clone();
            settings.protocol = Protocol::Http2;
            let pool = Upstream::new_pool(
                &upstream.key,
                &settings,
                &self.shared.guard,
                (&upstream.endpoints, upstream.parent.as_ref()),
                upstream.metrics.clone(),
            );
            let source: Arc<dyn PoolSource> = pool.clone();
            upstream.metrics.watch_pool(Arc::downgrade(&source));
            self.shared.pools.register(&pool);
            tracing::debug!(upstream = %upstream.label, "h2c pool for gRPC requests");
            pool
        })
    }

    /// The pool, if one was made.
    pub(super) fn made(&self) -> Option<&Arc<Pool>> {
        self.pool.get()
    }
}

/// Whether a request is gRPC (`application/grpc`, `application/grpc+proto`, ...).
pub(super) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}
