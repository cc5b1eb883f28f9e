//! What the crate's unit tests need to serve real downstream connections: a context, a
//! forward-proxy listener, a loopback connection, and a poll.

use std::net::SocketAddr;
use std::sync::Arc;

use super::Context;
use crate::config::Config;
use crate::policy::Guard;
use crate::proxy::admit::Admit;
use crate::proxy::Proxy;
use crate::routing::{Arrival, Router};
use crate::upstream::Shared;

/// A context over `config` whose guard refuses `local`, with `limit` connection permits. The
/// draining sender is leaked, so draining never starts.
pub(crate) fn context(config: Config, local: Vec<SocketAddr>, limit: usize) -> Arc<Context> {
    let (ctx, drain_tx) = context_with_drain(config, local, limit);
    std::mem::forget(drain_tx);
    ctx
}

/// [`context`], and the sender that starts draining it.
pub(crate) fn context_with_drain(
    config: Config,
    local: Vec<SocketAddr>,
    limit: usize,
) -> (Arc<Context>, tokio::sync::watch::Sender<bool>) {
    context_admitting(config, local, limit, Admit::default())
}

/// [`context_with_drain`], its proxy admitting requests as `admit` decides.
fn context_admitting(
    config: Config,
    local: Vec<SocketAddr>,
    limit: usize,
    admit: Admit,
) -> (Arc<Context>, tokio::sync::watch::Sender<bool>) {
    let config = Arc::new(config);
    let (drain_tx, drain) = tokio::sync::watch::channel(false);
    let shared = Shared {
        guard: Arc::new(Guard::new(local, config.policy.clone())),
        metrics: Default::default(),
        paces: Default::default(),
        rate_limit_services: Default::default(),
        pools: Default::default(),
        resolver: Arc::new(crate::endpoint::dns::Resolver::new(&config.dns)),
    };
    let metrics = shared.metrics.clone();
    let proxy = Proxy::new(Router::new(config.clone(), &[], shared)).with_admit(admit);
    let ctx = Context::new(config.downstream, proxy, drain, metrics, Default::default(), None);
    let ctx = Arc::new(Context {
        limit: Arc::new(tokio::sync::Semaphore::new(limit)),
        ..ctx
    });
    (ctx, drain_tx)
}

/// A forward-proxy listener served with `yaml`, for tests that read the downstream counters.
pub(crate) async fn serve_for_test(yaml: &str) -> (SocketAddr, Arc<Context>) {
    let (me, ctx, drain_tx) = serve_with_drain(yaml).await;
    std::mem::forget(drain_tx);
    (me, ctx)
}

/// [`serve_for_test`], its proxy admitting requests as `admit` decides.
pub(crate) async fn serve_admitting(yaml: &str, admit: Admit) -> (SocketAddr, Arc<Context>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let me = listener.local_addr().unwrap();
    let config = crate::config::parse(yaml, &Default::default()).unwrap();
    let (ctx, drain_tx) = context_admitting(config, vec![me], 16, admit);
    std::mem::forget(drain_tx);
    tokio::spawn(super::serve(listener, Arrival::Forward, ctx.clone()));
    (me, ctx)
}

/// [`serve_for_test`], and the sender that starts draining it.
pub(crate) async fn serve_with_drain(
    yaml: &str,
) -> (SocketAddr, Arc<Context>, tokio::sync::watch::Sender<bool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let me = listener.local_addr().unwrap();
    let config = crate::config::parse(yaml, &Default::default()).unwrap();
    let (ctx, drain_tx) = context_with_drain(config, vec![me], 16);
    tokio::spawn(super::serve(listener, Arrival::Forward, ctx.clone()));
    (me, ctx, drain_tx)
}

/// A plain upstream answering every request `ok` (no keep-alive limit), and the count of the
/// requests it read.
pub(crate) async fn ok_upstream() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    counted.fetch_add(1, Ordering::SeqCst);
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if s.write_all(ok).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, requests)
}

/// Both ends of a loopback TCP connection: (client, server).
pub(crate) async fn tcp_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (server, _) = listener.accept().await.unwrap();
    (client, server)
}

/// Polls `cond` every 20 ms for up to 3 s.
pub(crate) async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..150 {
        if cond() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    false
}
