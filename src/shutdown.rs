//! The shutdown signal: SIGTERM or SIGINT (Ctrl-C).
//!
//! `main` passes [`signal`] to [`crate::run`]; tests pass any future they complete themselves.

/// Completes on SIGTERM or SIGINT. The handlers are installed by the call, not the first poll,
/// so that a signal arriving before the caller awaits it is not met by the default action (exit).
/// Must be called inside a runtime.
#[cfg(unix)]
pub fn signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate()).inspect_err(|e| tracing::warn!("no SIGTERM handler: {e}"));
    let int = signal(SignalKind::interrupt()).inspect_err(|e| tracing::warn!("no SIGINT handler: {e}"));
    async move {
        let mut term = term.ok();
        let mut int = int.ok();
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
