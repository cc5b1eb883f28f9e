//! Who is at the other end of a Unix-socket connection: the credentials the kernel recorded
//! when the peer called `connect` (`SO_PEERCRED`: pid, uid), and its executable from `/proc`.
//!
//! Reading `/proc` costs a few syscalls, and a leaking process opens a connection per request,
//! so lookups are cached per (pid, uid) for [`CACHE_TTL`] and at most [`CACHE_MAX`] processes.
//! A pid the kernel reuses for a new process within the TTL, under the same uid, would be taken
//! for the old one: that needs the whole pid space to wrap within seconds. Past the TTL the
//! start time read from `/proc/PID/stat` tells the two apart, and it is part of the source key
//! in [`super::Source`], so the leak detector never adds one process's connections to another's.
//!
//! Not handled here: attributing TCP connections (`loopback`).

use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a process looked up stays cached.
pub const CACHE_TTL: Duration = Duration::from_secs(5);
/// Processes cached at most.
pub const CACHE_MAX: usize = 1024;

/// A process connected over the Unix socket, as identified at accept.
///
/// Equal when pid, uid and start time are: `exe` is description, not identity (a process that
/// `exec`s keeps its pid and start time but changes executable).
#[derive(Debug, Clone)]
pub struct Process {
    /// Pid in the sidecar's pid namespace; `None` when the peer's namespace hides it.
    pub pid: Option<u32>,
    /// Effective uid at connect.
    pub uid: u32,
    /// Start time in clock ticks after boot (`/proc/PID/stat` field 22), telling a reused pid
    /// from the process that had it before; `None` when unreadable.
    pub start_time: Option<u64>,
    /// `/proc/PID/exe`, or `/proc/PID/comm` where that link cannot be read.
    pub exe: Option<Box<str>>,
}

impl PartialEq for Process {
    fn eq(&self, other: &Self) -> bool {
        (self.pid, self.uid, self.start_time) == (other.pid, other.uid, other.start_time)
    }
}

impl Eq for Process {}

impl Hash for Process {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.pid, self.uid, self.start_time).hash(state);
    }
}

impl fmt::Display for Process {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.pid, &self.exe) {
            (Some(pid), Some(exe)) => write!(f, "pid {pid} ({exe}) uid {}", self.uid),
            (Some(pid), None) => write!(f, "pid {pid} uid {}", self.uid),
            (None, _) => write!(f, "pid ? uid {}", self.uid),
        }
    }
}

impl Process {
    /// Reads what `/proc` has on `pid` (under `proc_root`, `/proc` outside tests).
    pub fn read(proc_root: &Path, pid: Option<u32>, uid: u32) -> Process {
        let Some(pid) = pid else {
            return Process {
                pid: None,
                uid,
                start_time: None,
                exe: None,
            };
        };
        let start_time = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat"))
            .ok()
            .and_then(|stat| start_time(&stat));
        Process {
            pid: Some(pid),
            uid,
            start_time,
            exe: executable(proc_root, pid).map(String::into_boxed_str),
        }
    }
}

/// Field 22 of `/proc/PID/stat`. The command name (field 2) is in parentheses and may itself
/// hold spaces and parentheses, so fields are counted from the last `)`.
pub fn start_time(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name: field 22 is the 20th.
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// The executable's path, or its command name where the link is not readable (another user's
/// process without `CAP_SYS_PTRACE`, or a kernel thread).
pub fn executable(proc_root: &Path, pid: u32) -> Option<String> {
    let dir = proc_root.join(pid.to_string());
    if let Ok(target) = std::fs::read_link(dir.join("exe")) {
        return Some(target.to_string_lossy().into_owned());
    }
    let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
    let comm = comm.trim_end_matches('\n');
    (!comm.is_empty()).then(|| comm.to_owned())
}

#[derive(Debug)]
struct Cached {
    process: Arc<Process>,
    read_at: Instant,
}

/// Processes looked up recently, by (pid, uid).
#[derive(Debug, Default)]
pub struct ProcessCache {
    entries: Mutex<HashMap<(u32, u32), Cached>>,
}

impl ProcessCache {
    /// The process behind a peer's credentials: from the cache, or read from `/proc`.
    pub fn lookup(&self, pid: Option<u32>, uid: u32) -> Arc<Process> {
        let Some(pid) = pid.filter(|&p| p != 0) else {
            return Arc::new(Process::read(Path::new("/proc"), None, uid));
        };
        let now = Instant::now();
        if let Some(hit) = self.lock().get(&(pid, uid)) {
            if now.duration_since(hit.read_at) < CACHE_TTL {
                return hit.process.clone();
            }
        }
        // Read outside the lock: `/proc` reads are quick but not free.
        let process = Arc::new(Process::read(Path::new("/proc"), Some(pid), uid));
        let mut entries = self.lock();
        if entries.len() >= CACHE_MAX && !entries.contains_key(&(pid, uid)) {
            entries.retain(|_, c| now.duration_since(c.read_at) < CACHE_TTL);
            if entries.len() >= CACHE_MAX {
                if let Some(oldest) = entries.iter().min_by_key(|(_, c)| c.read_at).map(|(k, _)| *k) {
                    entries.remove(&oldest);
                }
            }
        }
        entries.insert(
            (pid, uid),
            Cached {
                process: process.clone(),
                read_at: now,
            },
        );
        process
    }

    /// Processes cached now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(u32, u32), Cached>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_is_field_22_even_with_parentheses_in_the_name() {
        let stat = "4242 (we (ird) name) S 1 4242 4242 0 -1 4194560 120 0 0 0 1 2 0 0 20 0 1 0 987654 \
                    12345678 300 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(start_time(stat), Some(987_654));
        assert_eq!(start_time("4242 (truncated) S 1"), None);
    }

    #[test]
    fn this_process_is_read_with_its_executable_and_start_time() {
        let me = std::process::id();
        let process = Process::read(Path::new("/proc"), Some(me), 0);
        let exe = std::env::current_exe().unwrap();
        assert_eq!(process.exe.as_deref(), Some(exe.to_str().unwrap()));
        assert!(process.start_time.is_some());
        assert_eq!(process.to_string(), format!("pid {me} ({}) uid 0", exe.display()));
    }

    #[test]
    fn a_missing_exe_link_falls_back_to_comm() {
        let root = std::env::temp_dir().join(format!("egress-proc-fixture-{}", std::process::id()));
        std::fs::create_dir_all(root.join("77")).unwrap();
        std::fs::write(root.join("77/comm"), "leaky-worker\n").unwrap();
        assert_eq!(executable(&root, 77).as_deref(), Some("leaky-worker"));
        assert_eq!(executable(&root, 78), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_cache_reads_proc_once_per_process_and_stays_bounded() {
        let cache = ProcessCache::default();
        let me = std::process::id();
        let first = cache.lookup(Some(me), 0);
        let again = cache.lookup(Some(me), 0);
        assert!(
            Arc::ptr_eq(&first, &again),
            "the second connection is served from the cache"
        );
        let other_uid = cache.lookup(Some(me), 1);
        assert!(
            !Arc::ptr_eq(&first, &other_uid),
            "a different uid is a different process"
        );
        for pid in 0..(CACHE_MAX as u32 + 10) {
            cache.lookup(Some(4_000_000 + pid), 0);
        }
        assert!(cache.len() <= CACHE_MAX, "{} cached", cache.len());
        assert_eq!(
            cache.lookup(Some(0), 5).pid,
            None,
            "pid 0: hidden by a pid namespace"
        );
    }
}
