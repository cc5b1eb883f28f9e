//! The pool's queueing and dial rules, against real HTTP/1.1 connections over in-memory pipes whose
//! dials the test releases one by one.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use super::idle::IDLE_SURPLUS_GRACE;
use super::*;
use crate::connector::Place;
use crate::wire::RequestBody;

/// Dials an in-memory HTTP/1.1 server; each dial waits for a permit from `gate`.
#[derive(Debug)]
struct GatedConnector {
    gate: Arc<Semaphore>,
    in_flight: Arc<AtomicUsize>,
    peak_in_flight: Arc<AtomicUsize>,
    dials: Arc<AtomicUsize>,
}

impl GatedConnector {
    fn new() -> Self {
        GatedConnector {
            gate: Arc::new(Semaphore::new(0)),
            in_flight: Arc::default(),
            peak_in_flight: Arc::default(),
            dials: Arc::default(),
        }
    }

    async fn dial(&self, place: Box<dyn Place>) -> Result<Dialed, ProxyError> {
        self.dials.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak_in_flight.fetch_max(now, Ordering::SeqCst);
        let permit = self.gate.acquire().await.expect("gate open");
        permit.forget();
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        super::in_memory::dial(place, 4096).await
    }
}

impl Connect for Arc<GatedConnector> {
    fn connect(
        &self,
        place: Box<dyn Place>,
    ) -> Pin<Box<dyn Future<Output = Result<Dialed, ProxyError>> + Send + '_>> {
        Box::pin(self.dial(place))
    }
}

fn config(max_connections: usize, max_connecting: usize) -> PoolConfig {
    PoolConfig {
        max_connections,
        max_idle: max_connections,
        idle_timeout: Duration::from_secs(30),
        max_lifetime: None,
        max_requests_per_connection: None,
        max_pending: 100,
        pending_timeout: Duration::from_secs(30),
        max_connecting,
    }
}

fn pool(config: PoolConfig, connector: &Arc<GatedConnector>) -> Arc<Pool> {
    Pool::new(
        "test".into(),
        config,
        Negotiated::Http1,
        100,
        Box::new(connector.clone()),
        crate::endpoint::Set::single(
            "test".into(),
            ([127, 0, 0, 1], 1).into(),
            crate::metrics::Metrics::new().upstream("test"),
        ),
        crate::metrics::Metrics::new().upstream("test"),
    )
}

/// Sends one real request on the lease and reads the response to its end.
async fn use_once(lease: &mut Lease) {
    let mut req = http::Request::builder()
        .uri("/")
        .body(RequestBody::Empty)
        .unwrap();
    let resp = lease
        .send(&mut req, &mut crate::wire::HeadLines::default())
        .await
        .expect("response");
    lease.read_to_end(resp.into_body()).await.expect("body");
}

async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
}

#[tokio::test]
async fn a_burst_dials_at_most_max_connecting_at_once_and_never_past_the_cap() {
    let connector = Arc::new(GatedConnector::new());
    let pool = pool(config(6, 2), &connector);
    let mut waiting = Vec::new();
    for _ in 0..10 {
        let pool = pool.clone();
        waiting.push(tokio::spawn(async move { pool.checkout().await }));
    }
    settle().await;
    assert_eq!(connector.in_flight.load(Ordering::SeqCst), 2, "dials in flight");
    assert_eq!(pool.snapshot().pending, 10);
    // Release dials one at a time: each finished dial makes room for another, up to the cap.
    for _ in 0..10 {
        connector.gate.add_permits(1);
        settle().await;
    }
    assert_eq!(connector.peak_in_flight.load(Ordering::SeqCst), 2);
    assert_eq!(
        connector.dials.load(Ordering::SeqCst),
        6,
        "dials stop at max_connections"
    );
    let snapshot = pool.snapshot();
    assert_eq!(snapshot.open, 6);
    assert_eq!(snapshot.pending, 4, "the rest wait for a connection to free up");
    // Six requests hold connections; giving them back serves the other four without a dial.
    let mut leases = Vec::new();
    for task in waiting.iter_mut().take(10) {
        if task.is_finished() {
            leases.push(task.await.unwrap().unwrap());
        }
    }
    assert_eq!(leases.len(), 6);
    for mut lease in leases {
        use_once(&mut lease).await;
        lease.release();
    }
    settle().await;
    assert!(waiting.iter().all(|t| t.is_finished()), "a waiter was not served");
    assert_eq!(connector.dials.load(Ordering::SeqCst), 6);
}

#[tokio::test]
async fn waiters_are_served_oldest_first() {
    let connector = Arc::new(GatedConnector::new());
    connector.gate.add_permits(1);
    let pool = pool(config(1, 1), &connector);
    let mut first = pool.checkout().await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5 {
        let (pool, order) = (pool.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let mut lease = pool.checkout().await.unwrap();
            order.lock().unwrap().push(i);
            use_once(&mut lease).await;
            lease.release();
        }));
        settle().await; // fixes the arrival order
    }
    use_once(&mut first).await;
    first.release();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    assert_eq!(connector.dials.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_cancelled_waiter_leaves_the_queue() {
    let connector = Arc::new(GatedConnector::new());
    let pool = pool(config(1, 1), &connector);
    let pool2 = pool.clone();
    let waiter = tokio::spawn(async move { pool2.checkout().await });
    settle().await;
    assert_eq!(pool.snapshot().pending, 1);
    waiter.abort();
    settle().await;
    assert_eq!(pool.snapshot().pending, 0);
    // The dial it caused still completes and its connection is kept idle for the next request.
    connector.gate.add_permits(1);
    settle().await;
    let snapshot = pool.snapshot();
    assert_eq!((snapshot.open, snapshot.idle), (1, 1));
}

#[tokio::test]
async fn a_dropped_lease_frees_its_place_under_the_cap() {
    let connector = Arc::new(GatedConnector::new());
    connector.gate.add_permits(2);
    let pool = pool(config(1, 1), &connector);
    let lease = pool.checkout().await.unwrap();
    let pool2 = pool.clone();
    let next = tokio::spawn(async move { pool2.checkout().await.map(|l| l.connection_id()) });
    settle().await;
    assert!(!next.is_finished(), "cap of 1 holds the second request");
    drop(lease); // an unfinished exchange: the connection is closed, not pooled
    let id = tokio::time::timeout(Duration::from_secs(2), next)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(id, 2, "served by a new connection");
    assert_eq!(connector.dials.load(Ordering::SeqCst), 2);
}

/// A pool with `max_idle: 1` and four idle connections; returns it, its connector and the id
/// of the most recently used connection.
async fn four_idle_over_max_idle_one() -> (Arc<Pool>, Arc<GatedConnector>, u64) {
    let connector = Arc::new(GatedConnector::new());
    connector.gate.add_permits(4);
    let mut cfg = config(4, 4);
    cfg.max_idle = 1;
    let pool = pool(cfg, &connector);
    let mut leases = Vec::new();
    for _ in 0..4 {
        leases.push(pool.checkout().await.unwrap());
    }
    let newest = leases.last().unwrap().connection_id();
    for mut lease in leases {
        use_once(&mut lease).await;
        lease.release();
    }
    (pool, connector, newest)
}

#[tokio::test]
async fn idle_connections_beyond_max_idle_close_after_a_grace() {
    let (pool, connector, _) = four_idle_over_max_idle_one().await;
    // All four are kept for now: closing them at once would churn under steady load.
    assert_eq!(pool.snapshot().idle, 4);
    tokio::time::sleep(IDLE_SURPLUS_GRACE + Duration::from_millis(300)).await;
    let snapshot = pool.snapshot();
    assert_eq!((snapshot.idle, snapshot.open), (1, 1), "{snapshot:?}");
    // The one kept is the most recently used; reusing it needs no dial.
    let lease = pool.checkout().await.unwrap();
    assert!(lease.is_reused());
    assert_eq!(connector.dials.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn the_memory_budget_closes_the_idle_surplus_without_the_grace() {
    let (pool, _connector, newest) = four_idle_over_max_idle_one().await;
    assert_eq!(pool.shed_idle_surplus(), 3, "all beyond max_idle, at once");
    settle().await;
    let snapshot = pool.snapshot();
    assert_eq!((snapshot.idle, snapshot.open), (1, 1), "{snapshot:?}");
    assert_eq!(pool.shed_idle_surplus(), 0, "max_idle connections stay");
    let lease = pool.checkout().await.unwrap();
    assert_eq!(
        lease.connection_id(),
        newest,
        "the most recently used one is kept"
    );
}

/// Where the response head of one exchange sat in memory; the head is dropped before this
/// returns, so that the read buffer behind it is the connection's alone again.
async fn exchange_head_address(pool: &Arc<Pool>) -> usize {
    let mut lease = pool.checkout().await.expect("lease");
    let mut req = http::Request::builder()
        .uri("/")
        .body(RequestBody::Empty)
        .unwrap();
    let resp = lease
        .send(&mut req, &mut crate::wire::HeadLines::default())
        .await
        .expect("response");
    let (mut parts, body) = resp.into_parts();
    let wire = lease
        .h1_mut()
        .and_then(crate::connector::h1::Connection::take_wire_fields);
    crate::wire::fields::into_map(wire, &mut parts.headers);
    let date = parts.headers.get(http::header::DATE).expect("hyper sends Date");
    let address = date.as_bytes().as_ptr() as usize;
    drop(parts);
    lease.read_to_end(body).await.expect("body");
    lease.release();
    address
}

#[tokio::test]
async fn a_finished_exchange_leaves_its_read_buffer_for_the_next_one() {
    let connector = Arc::new(GatedConnector::new());
    connector.gate.add_permits(10);
    let pool = pool(config(2, 2), &connector);
    assert_eq!(crate::spare::UPSTREAM.kept(), 0, "a fresh test thread");
    let first = exchange_head_address(&pool).await;
    assert_eq!(
        crate::spare::UPSTREAM.kept(),
        1,
        "the buffer went to the thread's spares, not to the idle connection"
    );
    // Had the buffer been freed, an allocation of its size would likely take its memory.
    let hog = Vec::<u8>::with_capacity(16 * 1024);
    let second = exchange_head_address(&pool).await;
    assert!(
        (first..first + 16 * 1024).contains(&second),
        "the second head ({second:#x}) is not in the first one's buffer ({first:#x})"
    );
    assert_eq!(crate::spare::UPSTREAM.kept(), 1);
    drop(hog);
}

#[tokio::test]
async fn a_retired_pool_reports_no_learned_idle_timeout() {
    let connector = Arc::new(GatedConnector::new());
    let pool = pool(config(4, 4), &connector);
    let start = Instant::now();
    for i in 0..3u64 {
        pool.lock()
            .learner
            .observe(Duration::from_secs(2), start + Duration::from_secs(i));
    }
    assert_eq!(pool.snapshot().learned_idle_timeout, Some(Duration::from_secs(2)));
    pool.retire("reload");
    assert_eq!(
        pool.snapshot().learned_idle_timeout,
        None,
        "its successor's gauge must not show the old backend's timeout"
    );
}

/// A connection given back as its response head arrived (its body came whole with the head)
/// is idle from that arrival, the clock read the exchange made, not from a read of its own.
#[tokio::test(start_paused = true)]
async fn a_lease_released_with_its_head_is_idle_from_the_heads_arrival() {
    let connector = Arc::new(GatedConnector::new());
    connector.gate.add_permits(1);
    let pool = pool(config(1, 1), &connector);
    let mut lease = pool.checkout().await.unwrap();
    use_once(&mut lease).await;
    lease.response_arrived(tokio::time::Instant::now());
    tokio::time::advance(Duration::from_secs(20)).await;
    lease.release_with_head();
    assert_eq!(pool.snapshot().idle, 1);
    // The 30 s idle timeout runs from the arrival: 10 s after the release, not 30.
    tokio::time::sleep(Duration::from_secs(11)).await;
    settle().await;
    assert_eq!(pool.snapshot().open, 0, "closed at its idle timeout");
}
