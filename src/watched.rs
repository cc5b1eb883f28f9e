//! Files whose content the sidecar uses while they change under it (a mounted Secret, a
//! certificate cert-manager rotates): looked at (a stat each) at most once per [`RECHECK`],
//! re-read and parsed when a modification time or length changed, the last good value kept
//! while they are missing or do not parse.
//!
//! Not a file watcher (inotify): a Kubernetes Secret update is an atomic symlink swap a minute
//! or so after the change, which a stat a second sees without a thread or a descriptor per file.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

/// How often the files are looked at: not per use.
pub const RECHECK: Duration = Duration::from_secs(1);

/// Parses the files' contents, in the order of their paths.
pub type Parse<T> = fn(&[Vec<u8>]) -> Result<T, String>;

/// A value read from one or more files, kept current.
pub struct Watched<T> {
    paths: Vec<PathBuf>,
    parse: Parse<T>,
    last: Mutex<Option<Last<T>>>,
}

struct Last<T> {
    checked: Instant,
    /// Each file's modification time and length at the last read.
    stamps: Vec<Option<(Option<SystemTime>, u64)>>,
    value: Option<T>,
}

impl<T> fmt::Debug for Watched<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the value: these files hold credentials.
        f.debug_struct("Watched")
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

impl<T: Clone> Watched<T> {
    /// The value of the files at `paths`, as `parse` makes it.
    pub fn new(paths: Vec<PathBuf>, parse: Parse<T>) -> Self {
        Watched {
            paths,
            parse,
            last: Mutex::new(None),
        }
    }

    /// The first path (for messages).
    pub fn path(&self) -> &Path {
        &self.paths[0]
    }

    /// The current value: the last one read, looked at again once [`RECHECK`] has passed.
    /// `None` while the files never read and parsed.
    pub fn get(&self) -> Option<T> {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(last) = last.as_mut() {
            if now.saturating_duration_since(last.checked) < RECHECK {
                return last.value.clone();
            }
            last.checked = now;
        }
        let stamps: Vec<_> = self.paths.iter().map(|p| stamp(p)).collect();
        if let Some(last) = last.as_ref() {
            // Unchanged, or (partly) gone: keep what was read.
            if last.stamps == stamps || stamps.iter().any(Option::is_none) {
                return last.value.clone();
            }
        }
        let read: Result<Vec<Vec<u8>>, String> = self
            .paths
            .iter()
            .map(|p| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display())))
            .collect();
        let fresh = read.and_then(|contents| (self.parse)(&contents));
        let value = match fresh {
            Ok(value) => Some(value),
            Err(why) => {
                tracing::warn!(file = %self.path().display(), "keeping the last value: {why}");
                last.as_ref().and_then(|l| l.value.clone())
            }
        };
        *last = Some(Last {
            checked: now,
            stamps,
            value: value.clone(),
        });
        value
    }
}

fn stamp(path: &Path) -> Option<(Option<SystemTime>, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok(), meta.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(contents: &[Vec<u8>]) -> Result<String, String> {
        let text = String::from_utf8_lossy(&contents[0]).trim().to_owned();
        if text.is_empty() {
            return Err("empty".into());
        }
        Ok(text)
    }

    #[tokio::test(start_paused = true)]
    async fn the_value_follows_the_file_once_a_recheck() {
        let dir = std::env::temp_dir().join(format!("egress-watched-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("value");
        std::fs::write(&file, "one\n").unwrap();
        let watched = Watched::new(vec![file.clone()], text);
        assert_eq!(watched.get().as_deref(), Some("one"));
        std::fs::write(&file, "twotwo\n").unwrap();
        assert_eq!(
            watched.get().as_deref(),
            Some("one"),
            "looked at once per RECHECK"
        );
        tokio::time::advance(RECHECK).await;
        assert_eq!(watched.get().as_deref(), Some("twotwo"));
        std::fs::write(&file, "\n").unwrap();
        tokio::time::advance(RECHECK).await;
        assert_eq!(
            watched.get().as_deref(),
            Some("twotwo"),
            "a bad value keeps the last"
        );
        std::fs::remove_file(&file).unwrap();
        tokio::time::advance(RECHECK).await;
        assert_eq!(
            watched.get().as_deref(),
            Some("twotwo"),
            "a missing file keeps the last"
        );
        let _ = std::fs::remove_dir_all(&dir);
        assert!(!format!("{watched:?}").contains("twotwo"), "never shown");
    }
}
