//! What does it cost to take a warm HTTP/1.1 connection out of the pool and give it back, with
//! and without one request on it?
//!
//! The pool holds real hyper client connections over `tokio::io::duplex` pipes to a tiny hyper
//! server answering an empty 200 (as `src/pool/pool_tests.rs` does), so the numbers contain no
//! sockets: `http1_checkout_release_warm` is the pool's own bookkeeping (lock, idle list, lease,
//! metrics); `http1_checkout_request_release_warm` adds one request and response through hyper
//! over the pipe, the proxy's per-request upstream work minus the syscalls. One connection is
//! dialed before measuring and every iteration reuses it (the dial count is checked at the end).
//! Single-threaded runtime, like the sidecar with `TOKIO_WORKER_THREADS=1`.
//!
//! Run: `cargo bench --bench pool --features test-support` (numbers are reported, not asserted);
//! the feature brings in `pool::in_memory`, which the release binary leaves out.

// criterion_group! defines an undocumented `pub fn` for the group.
#![allow(missing_docs)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use egress_sidecar::config::{self, Overrides};
use egress_sidecar::connector::{Connect, Dialed, Place};
use egress_sidecar::error::ProxyError;
use egress_sidecar::metrics::Metrics;
use egress_sidecar::pool::{Negotiated, Pool};
use egress_sidecar::wire::RequestBody;

/// Dials an in-memory HTTP/1.1 server answering every request with an empty 200.
#[derive(Debug, Default)]
struct DuplexConnector {
    dials: Arc<AtomicUsize>,
}

impl DuplexConnector {
    async fn dial(&self, place: Box<dyn Place>) -> Result<Dialed, ProxyError> {
        self.dials.fetch_add(1, Ordering::Relaxed);
        egress_sidecar::pool::in_memory::dial(place, 16 * 1024).await
    }
}

impl Connect for DuplexConnector {
    fn connect(
        &self,
        place: Box<dyn Place>,
    ) -> Pin<Box<dyn Future<Output = Result<Dialed, ProxyError>> + Send + '_>> {
        Box::pin(self.dial(place))
    }
}

/// A pool with the default settings (`defaults.pool` of an empty config); its dials count in
/// `dials`.
fn pool(dials: &Arc<AtomicUsize>) -> Arc<Pool> {
    let defaults = config::parse("", &Overrides::default()).expect("empty config is valid");
    Pool::new(
        "bench".into(),
        defaults.defaults.pool,
        Negotiated::Http1,
        100,
        Box::new(DuplexConnector { dials: dials.clone() }),
        egress_sidecar::endpoint::Set::single(
            "bench".into(),
            ([127, 0, 0, 1], 1).into(),
            Metrics::new().upstream("bench"),
        ),
        Metrics::new().upstream("bench"),
    )
}

async fn checkout_release(pool: &Arc<Pool>) {
    let lease = pool.checkout().await.expect("checkout");
    lease.release();
}

async fn checkout_request_release(pool: &Arc<Pool>) {
    let mut lease = pool.checkout().await.expect("checkout");
    let mut req = http::Request::builder()
        .uri("/")
        .header(http::header::HOST, "bench.internal")
        .body(RequestBody::Empty)
        .expect("request");
    let resp = lease
        .send(&mut req, &mut egress_sidecar::wire::HeadLines::default())
        .await
        .expect("response");
    lease.read_to_end(resp.into_body()).await.expect("body");
    lease.release();
}

fn bench_pool(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dials = Arc::new(AtomicUsize::new(0));
    let pool = pool(&dials);
    // Warm: one connection dialed and used once, idle in the pool.
    rt.block_on(checkout_request_release(&pool));

    c.bench_function("http1_checkout_release_warm", |b| {
        b.to_async(&rt).iter(|| checkout_release(&pool));
    });
    c.bench_function("http1_checkout_request_release_warm", |b| {
        b.to_async(&rt).iter(|| checkout_request_release(&pool));
    });
    let dials = dials.load(Ordering::Relaxed);
    if dials != 1 {
        eprintln!("note: the pool dialed {dials} connections; every iteration should have reused one");
    }
}

criterion_group!(benches, bench_pool);
criterion_main!(benches);
