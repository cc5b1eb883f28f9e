//! Hot reload: on SIGHUP, or when the config file's content changes, the file is loaded again
//! (flags and environment variables still win) and applied without dropping a request.
//!
//! - A config that fails validation, or that changes what cannot change in place (the
//!   `listen`, `listen_unix`, `admin` and route-mode `upstreams[].listen` sockets, `budget`
//!   `access_log` and `tracing`), is rejected: the error is logged,
//!   `egress_config_reloads_total{result="failure"}` counts it,
//!   `egress_config_last_reload_successful` turns 0, and the old config keeps serving.
//! - Otherwise routing, policy and downstream settings switch at once; each upstream whose
//!   [`PoolKey`](crate::upstream::PoolKey) did not change keeps its pool and connections with the
//!   new pool limits applied; upstreams that left the config, or whose key changed, get a new
//!   pool while the old one drains (idle connections close now, busy ones when their exchange
//!   ends).
//!
//! The file is polled rather than watched through inotify: a Kubernetes ConfigMap volume swaps a
//! symlink to a new directory, which inotify watches on the file miss, and an editor's
//! half-written save would otherwise be loaded. A change is applied once two polls read the
//! same new content.
//!
//! Not handled here: what each setting does (the modules owning them).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::{self, Config, Overrides};
use crate::metrics::Metrics;

/// How often the config file is read for changes.
pub const FILE_POLL: Duration = Duration::from_millis(500);

/// What a reload did to the configured upstreams.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Kept their pool and connections (new pool limits applied).
    pub kept: usize,
    /// New names.
    pub added: usize,
    /// Same name, but where or how connections are made changed: a new pool, the old drains.
    pub replaced: usize,
    /// Gone from the config: their pools drain.
    pub removed: usize,
}

/// What a reload acts on, handed in by the wiring so that reloading need not know the router or
/// the downstream server.
pub trait Apply: Send + Sync {
    /// The config in force.
    fn config(&self) -> Arc<Config>;
    /// Puts `config` in force; it has passed the checks of what is fixed at start.
    fn apply(&self, config: Config) -> Summary;
}

/// Where a reload reads its config from: the same file and overrides as at start.
#[derive(Debug, Clone, Default)]
pub struct ConfigSource {
    /// The config file (`--config` / `EGRESS_CONFIG`); without one only SIGHUP reloads.
    pub path: Option<PathBuf>,
    /// Flags and environment variables, which win over the file.
    pub overrides: Overrides,
}

/// What triggers reloads: SIGHUP, and changes to the source's file.
#[derive(Debug)]
pub struct Watcher {
    source: ConfigSource,
    hangup: Option<Hangup>,
}

#[cfg(unix)]
type Hangup = tokio::signal::unix::Signal;
#[cfg(not(unix))]
type Hangup = ();

impl Watcher {
    /// Installs the SIGHUP handler now, inside a runtime: a SIGHUP that arrived between binding
    /// the listeners and the first poll of [`watch`] would otherwise end the process (the
    /// default action).
    pub fn new(source: ConfigSource) -> Self {
        Watcher {
            source,
            hangup: hangup_signal(),
        }
    }
}

/// Reloads on SIGHUP and on file changes until `stop` flips to true.
pub async fn watch(
    watcher: Watcher,
    target: Arc<dyn Apply>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let Watcher { source, mut hangup } = watcher;
    let mut applied = read(&source).await;
    let mut candidate: Option<Option<Vec<u8>>> = None;
    let mut poll = tokio::time::interval(FILE_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = recv(&mut hangup) => {
                applied = read(&source).await;
                candidate = None;
                reload(&source, &*target, &metrics, "SIGHUP");
            }
            _ = poll.tick(), if source.path.is_some() => {
                let now = read(&source).await;
                if now == applied {
                    candidate = None;
                } else if candidate.as_ref() == Some(&now) {
                    applied = now;
                    candidate = None;
                    reload(&source, &*target, &metrics, "config file changed");
                } else {
                    candidate = Some(now);
                }
            }
            // The guard `wait_for` returns must not live across the other branches' awaits.
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
    }
}

async fn read(source: &ConfigSource) -> Option<Vec<u8>> {
    // A config file is a few KiB: reading it on the runtime thread is cheaper than a hop to the
    // blocking pool.
    std::fs::read(source.path.as_ref()?).ok()
}

#[cfg(unix)]
fn hangup_signal() -> Option<Hangup> {
    use tokio::signal::unix::{signal, SignalKind};
    signal(SignalKind::hangup())
        .inspect_err(|e| tracing::warn!("SIGHUP reload unavailable: {e}"))
        .ok()
}

#[cfg(unix)]
async fn recv(hangup: &mut Option<Hangup>) {
    match hangup {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(not(unix))]
fn hangup_signal() -> Option<Hangup> {
    None
}

#[cfg(not(unix))]
async fn recv(_: &mut Option<Hangup>) {
    std::future::pending().await
}

/// Loads and applies the config, or logs why not; counts the outcome.
pub fn reload(source: &ConfigSource, target: &dyn Apply, metrics: &Metrics, why: &str) {
    let families = metrics.families();
    let result = config::load(source.path.as_deref(), &source.overrides)
        .map_err(|e| e.to_string())
        .and_then(|config| apply(target, config));
    match result {
        // Logged before counted: whoever sees the count can find the log line.
        Ok(summary) => {
            tracing::info!(
                trigger = why,
                kept = summary.kept,
                added = summary.added,
                replaced = summary.replaced,
                removed = summary.removed,
                "config reloaded"
            );
            families.reloads.get_or_create(&outcome("success")).inc();
            families.last_reload_successful.set(1);
        }
        Err(problems) => {
            tracing::error!(
                trigger = why,
                "config reload rejected; the previous config keeps serving: {}",
                problems.replace('\n', "; ")
            );
            families.reloads.get_or_create(&outcome("failure")).inc();
            families.last_reload_successful.set(0);
        }
    }
}

fn outcome(result: &'static str) -> crate::metrics::ResultLabel {
    crate::metrics::ResultLabel { result }
}

/// Applies a validated config, unless it changes a listening socket.
fn apply(target: &dyn Apply, config: Config) -> Result<Summary, String> {
    check_fixed_at_start(&target.config(), &config)?;
    Ok(target.apply(config))
}

/// The sockets are bound once, at start, and the memory budget is sized then; a reload that
/// changes either is refused as a whole rather than applied in part.
fn check_fixed_at_start(old: &Config, new: &Config) -> Result<(), String> {
    let mut problems = Vec::new();
    if old.budget != new.budget {
        problems.push("budget: changed; the memory budget is sized at start".to_owned());
    }
    if old.access_log != new.access_log {
        problems.push("access_log: changed; the access log is set up at start".to_owned());
    }
    if old.tracing != new.tracing {
        problems.push("tracing: changed; the span exporter is set up at start".to_owned());
    }
    if old.listen != new.listen {
        problems.push(format!("listen: changed from {} to {}", old.listen, new.listen));
    }
    if old.admin != new.admin {
        problems.push(format!("admin: changed from {} to {}", old.admin, new.admin));
    }
    if old.listen_unix != new.listen_unix {
        let show =
            |p: &Option<std::path::PathBuf>| p.as_ref().map_or("none".into(), |p| p.display().to_string());
        problems.push(format!(
            "listen_unix: changed from {} to {}",
            show(&old.listen_unix),
            show(&new.listen_unix)
        ));
    }
    let routes = |c: &Config| -> Vec<(String, std::net::SocketAddr)> {
        let mut v: Vec<_> = c
            .upstreams
            .iter()
            .filter_map(|u| u.listen.map(|l| (u.name.clone(), l)))
            .collect();
        v.sort();
        v
    };
    if routes(old) != routes(new) {
        problems.push("upstreams[].listen: route-mode listeners changed".to_owned());
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{}; restart the sidecar to change what is fixed at start",
        problems.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moving_a_listener_is_refused_naming_the_key() {
        let parse = |yaml: &str| config::parse(yaml, &Default::default()).unwrap();
        let old = parse("listen: 127.0.0.1:15080\nupstreams:\n  - { name: a, url: http://a.test, listen: 127.0.0.1:15090 }\n");
        let same = parse("listen: 127.0.0.1:15080\nupstreams:\n  - { name: a, url: http://b.test, listen: 127.0.0.1:15090 }\n");
        assert!(check_fixed_at_start(&old, &same).is_ok());
        let moved = parse("listen: 127.0.0.1:15082\nupstreams:\n  - { name: a, url: http://a.test, listen: 127.0.0.1:15091 }\n");
        let err = check_fixed_at_start(&old, &moved).unwrap_err();
        assert!(
            err.contains("listen: changed from 127.0.0.1:15080 to 127.0.0.1:15082"),
            "{err}"
        );
        assert!(err.contains("upstreams[].listen"), "{err}");
    }

    #[test]
    fn changing_the_budget_is_refused_naming_the_key() {
        let parse = |yaml: &str| config::parse(yaml, &Default::default()).unwrap();
        let old = parse("budget: { memory_fraction: 0.8 }\n");
        assert!(
            check_fixed_at_start(&old, &parse("")).is_ok(),
            "0.8 is the default"
        );
        let err = check_fixed_at_start(&old, &parse("budget: { memory_bytes: 64MiB }\n")).unwrap_err();
        assert!(err.starts_with("budget: changed"), "{err}");
    }
}
