//! The shutdown signal: SIGTERM or SIGINT (Ctrl-C).
//!
//! `main` passes [`signal`] to [`crate::run`]; tests pass any future they complete themselves.

/// Completes on SIGTERM or SIGINT. The handlers are installed by the call, not the first poll,
/// so that a signal arriving before the caller awaits it is not met by the default action (exit).
/// Must be called inside a runtime.
#[cfg(unix)]
pub fn signal() -> impl std::future::Future<Output = ()> {
    let mut signals = Signals::new();
    async move { signals.recv().await }
}

/// SIGTERM and SIGINT, one after another: the first starts the drain, the second cuts it short.
/// One listener for both, installed once, so that a second signal sent right after the first
/// is counted even before anything awaits it (a listener installed after the first signal
/// missed it).
#[cfg(unix)]
#[derive(Debug)]
pub struct Signals {
    term: Option<tokio::signal::unix::Signal>,
    int: Option<tokio::signal::unix::Signal>,
}

#[cfg(unix)]
impl Default for Signals {
    fn default() -> Self {
        Signals::new()
    }
}

#[cfg(unix)]
impl Signals {
    /// Installs the handlers. Must be called inside a runtime.
    pub fn new() -> Self {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate()).inspect_err(|e| tracing::warn!("no SIGTERM handler: {e}"));
        let int = signal(SignalKind::interrupt()).inspect_err(|e| tracing::warn!("no SIGINT handler: {e}"));
        Signals {
            term: term.ok(),
            int: int.ok(),
        }
    }

    /// The next SIGTERM or SIGINT since the last one this returned (signals that arrive
    /// together may count as one).
    pub async fn recv(&mut self) {
        let Signals { term, int } = self;
        tokio::select! {
            Some(_) = async { term.as_mut()?.recv().await } => {}
            Some(_) = async { int.as_mut()?.recv().await } => {}
            else => std::future::pending().await,
        }
    }
}

/// Completes on Ctrl-C.
#[cfg(not(unix))]
pub fn signal() -> impl std::future::Future<Output = ()> {
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
