//! Resident memory that nothing uses: the pages of code and read-only data that start-up
//! touched and the request path never will again, and heap memory freed after a burst that
//! the allocator keeps.
//!
//! The kernel maps file pages in windows of 64 KiB (fault-around) around every page a process
//! touches, and they stay mapped for the life of the process. Parsing the command line and the
//! YAML config, building the TLS roots, the metrics registry and the runtime run code from
//! dozens of crates once; measured with `perf record -e page-faults`, start-up faulted 59
//! windows of the executable and the request path 15. Without this module about 3 MiB of a
//! 6 MiB RSS is code that ran once.
//!
//! [`StartupMappings::release`] tells the kernel, once start-up is done, that the process no
//! longer needs those pages (`madvise(MADV_DONTNEED)`). For a private mapping that was never
//! written that discards nothing: the page cache keeps the file's pages, and the next access
//! maps them again, exactly as after the kernel reclaimed them under memory pressure, which it
//! may do at any time anyway. The request path faults back the windows it uses on its first
//! requests.
//!
//! Only mappings that were there before `main` ran are released (the executable and the
//! libraries it links, which are never unmapped), and only while they are still private,
//! read-only and hold no copy-on-write page, in memory (`Anonymous`) or swapped out (`Swap`):
//! a relocated RELRO region has such pages, and releasing it would throw its relocations
//! away.

use std::io;
use std::time::Duration;

/// How often freed heap memory is handed back to the kernel (see [`trim_heap`]).
pub const TRIM_EVERY: Duration = Duration::from_secs(5);

/// Hands freed heap memory back to the kernel; `true` if any was.
///
/// glibc gives memory back on `free` only from the top of the main heap. A burst of
/// connections (each with its request state and buffers while in flight) leaves free chunks
/// between allocations that live on, such as pooled connections, and those pages stayed
/// resident: 15.8 KB per pooled connection after a burst of 1000 slow requests
/// (`benches/idle_memory.sh`), and 1.34x the pre-storm RSS 30 s after the leaky storm
/// (`benches/compare.sh`, workload 5). `malloc_trim` releases the whole free pages inside
/// free chunks of every arena (`MADV_DONTNEED`); a page used again is faulted back in.
pub fn trim_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only releases memory glibc's allocator holds as free; it takes
        // the arenas' locks itself.
        #[allow(unsafe_code)]
        let released = unsafe { libc::malloc_trim(0) };
        released == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// The size from which glibc serves an allocation with a mapping of its own: its default.
pub const MMAP_THRESHOLD: usize = 128 * 1024;

/// Keeps glibc's threshold for mapping large blocks at [`MMAP_THRESHOLD`]; call it first thing.
///
/// By default glibc raises the threshold to the size of every mapped block freed (up to 32
/// MiB), and its heap-trim threshold to twice that. After the first `/metrics` read with 256
/// upstream labels (1.6 MB of text in a `String` that doubles) or a burst's large tables, later
/// blocks of up to that size come from the heap, where small allocations made beside them pin
/// their pages once they are freed. A forward proxy that met 5,000 hosts, with `/metrics` read
/// after the burst and after the idle-out, kept 5.3 MiB more than at its start once it had
/// forgotten them, 3.1 MiB with the threshold fixed (`benches/many_hosts.py --admin`, issue
/// 47). Setting it also keeps the trim threshold at its default, 128 KiB. What it costs: a
/// block of 128 KiB or more is mapped and unmapped each time; no request-path allocation is
/// that large (buffers are 16 KiB).
pub fn fix_mmap_threshold() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt sets one of glibc's allocator parameters, under the allocator's own
        // lock; the value is in range for a c_int, and no memory is touched.
        #[allow(unsafe_code)]
        let set = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) };
        set == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Whether a collection holding `len` in room for `capacity` should give its room back: a
/// burst (of hosts, pools, labels) must not leave its tables' size behind once it is gone.
/// Under a quarter used, and past 64, so that a small one does not shrink and grow in turn;
/// or empty. Without the last, each table kept the room its last shrink left, for the last few
/// dozen entries: 60 KB, all the live heap that 5,000 forgotten hosts left
/// (`benches/many_hosts.py` under valgrind's massif, issue 47).
pub fn mostly_empty(len: usize, capacity: usize) -> bool {
    (capacity > 64 && len < capacity / 4) || (len == 0 && capacity > 0)
}

/// Drops the dead handles of `list` (a weak handle keeps its value's allocation until it is
/// dropped), and gives the list's room back when [`mostly_empty`].
pub fn prune_weak<T: ?Sized>(list: &mut Vec<std::sync::Weak<T>>) {
    list.retain(|weak| weak.strong_count() > 0);
    if mostly_empty(list.len(), list.capacity()) {
        list.shrink_to_fit();
    }
}

/// Runs [`trim_heap`] every [`TRIM_EVERY`], for the life of the runtime, and logs (debug)
/// how much anonymous memory each trim that released some gave back. `before_each` runs
/// first, on the same thread: what frees memory the allocator holds for it (`spare`'s
/// surplus), so that the trim can hand it back.
pub async fn trim_heap_periodically(before_each: fn()) {
    let mut every = tokio::time::interval(TRIM_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        before_each();
        let before = anonymous_kib();
        if trim_heap() {
            let after = anonymous_kib();
            tracing::debug!(
                released_kib = before.saturating_sub(after),
                anonymous_kib = after,
                "heap trimmed"
            );
        }
    }
}

/// `RssAnon` of this process, in KiB (0 if unreadable).
fn anonymous_kib() -> u64 {
    status_kib("RssAnon:").unwrap_or(0)
}

/// This process's resident set (`VmRSS`) in bytes: what the memory budget and the
/// `egress_process_resident_memory_bytes` gauge read. The one reader of the process's memory
/// from `/proc`.
pub fn rss_bytes() -> io::Result<u64> {
    status_kib("VmRSS:")
        .map(|kib| kib * 1024)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no VmRSS in /proc/self/status"))
}

/// A `... kB` field of `/proc/self/status`, which is in KiB whatever the page size.
fn status_kib(name: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| field_kib(l, name))
}

/// The file-backed mappings present when the process started.
#[derive(Debug, Default)]
pub struct StartupMappings {
    ranges: Vec<Mapping>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Mapping {
    start: usize,
    end: usize,
    path: String,
}

/// What [`StartupMappings::release`] gave back.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Mappings released.
    pub mappings: usize,
    /// Their resident bytes just before.
    pub bytes: u64,
    /// Mappings the kernel refused to advise (locked memory, say); the others still go.
    pub failed: usize,
}

impl StartupMappings {
    /// Records the file-backed mappings present now; call it first thing in `main`, before
    /// anything could load a library (name resolution may `dlopen` NSS modules later, and those
    /// can be unloaded again).
    pub fn snapshot() -> io::Result<Self> {
        let maps = std::fs::read_to_string("/proc/self/maps")?;
        let ranges = maps
            .lines()
            .filter_map(|line| parse_header(line).map(|(mapping, _)| mapping))
            .filter(|m| m.path.starts_with('/'))
            .collect();
        Ok(StartupMappings { ranges })
    }

    /// Releases the resident pages of every recorded mapping that is still private, read-only
    /// and without copy-on-write pages.
    pub fn release(&self) -> io::Result<Released> {
        let smaps = std::fs::read_to_string("/proc/self/smaps")?;
        let mut released = Released::default();
        for candidate in releasable(&smaps) {
            if !self.ranges.contains(&candidate.mapping) {
                continue;
            }
            match advise_dontneed(candidate.mapping.start, candidate.mapping.end) {
                Ok(()) => {
                    released.mappings += 1;
                    released.bytes += candidate.rss_kib * 1024;
                }
                Err(_) => released.failed += 1,
            }
        }
        Ok(released)
    }
}

/// Resident KiB of the mappings in `smaps` text (of any process) that [`StartupMappings::release`]
/// would release if it had recorded them: what a process holds that could go.
pub fn releasable_kib(smaps: &str) -> u64 {
    releasable(smaps).iter().map(|c| c.rss_kib).sum()
}

#[derive(Debug, PartialEq, Eq)]
struct Candidate {
    mapping: Mapping,
    rss_kib: u64,
}

/// Mappings in `/proc/self/smaps` text that are private, not writable, backed by a file, and
/// hold no copy-on-write page: none resident (`Anonymous`) and none swapped out (`Swap`).
/// A mapping missing either line is left alone.
fn releasable(smaps: &str) -> Vec<Candidate> {
    #[derive(Default)]
    struct Seen {
        rss_kib: u64,
        anonymous_kib: Option<u64>,
        swap_kib: Option<u64>,
    }
    let mut out = Vec::new();
    let mut current: Option<(Mapping, bool)> = None;
    let mut seen = Seen::default();
    let mut finish = |current: Option<(Mapping, bool)>, seen: &Seen| {
        if let Some((mapping, true)) = current {
            if seen.anonymous_kib == Some(0) && seen.swap_kib == Some(0) {
                out.push(Candidate {
                    mapping,
                    rss_kib: seen.rss_kib,
                });
            }
        }
    };
    for line in smaps.lines() {
        if let Some((mapping, perms)) = parse_header(line) {
            finish(current.take(), &seen);
            let eligible = perms.len() == 4
                && perms.as_bytes()[1] == b'-'
                && perms.as_bytes()[3] == b'p'
                && mapping.path.starts_with('/');
            current = Some((mapping, eligible));
            seen = Seen::default();
        } else if let Some(kib) = field_kib(line, "Rss:") {
            seen.rss_kib = kib;
        } else if let Some(kib) = field_kib(line, "Anonymous:") {
            seen.anonymous_kib = Some(kib);
        } else if let Some(kib) = field_kib(line, "Swap:") {
            seen.swap_kib = Some(kib);
        }
    }
    finish(current, &seen);
    out
}

/// `start-end perms offset dev inode [path]`: the mapping and its permissions, or `None` for
/// any other line.
fn parse_header(line: &str) -> Option<(Mapping, &str)> {
    let mut fields = line.split_ascii_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    let perms = fields.next()?;
    let _offset = fields.next()?;
    let _device = fields.next()?;
    let _inode = fields.next()?;
    // A path may hold spaces; the kernel pads before it, so the rest of the line is the path.
    let path = fields.collect::<Vec<_>>().join(" ");
    Some((Mapping { start, end, path }, perms))
}

fn field_kib(line: &str, name: &str) -> Option<u64> {
    let value = line.strip_prefix(name)?.trim();
    value.strip_suffix("kB")?.trim().parse().ok()
}

fn advise_dontneed(start: usize, end: usize) -> io::Result<()> {
    // SAFETY: the range is a whole mapping that was present before `main` (so it is the
    // executable or a library it links, never unmapped while the process runs), and the
    // kernel reported it private, read-only and without copy-on-write pages, resident or in
    // swap, just now: every page in it equals the file's, no Rust value owns it, and
    // MADV_DONTNEED only drops the page table entries, which the next access restores from the
    // page cache. (A debugger or uprobe breakpoint set in the instant between the smaps read
    // and this call would be lost; one set before is a copy-on-write page and excluded.)
    #[allow(unsafe_code)]
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_fixed_mmap_threshold() {
        assert!(fix_mmap_threshold());
    }

    const SMAPS: &str = "\
55f2e2967000-55f2e2b19000 r--p 00000000 fe:00 7300016                    /usr/bin/egress sidecar
Size:               1736 kB
Rss:                 692 kB
Anonymous:             0 kB
Swap:                  0 kB
VmFlags: rd mr mw me dw sd
55f2e2b19000-55f2e30b3000 r-xp 001b1000 fe:00 7300016                    /usr/bin/egress sidecar
Rss:                2960 kB
Anonymous:             0 kB
Swap:                  0 kB
55f2e30b3000-55f2e30de000 r--p 0074a000 fe:00 7300016                    /usr/bin/egress sidecar
Rss:                 172 kB
Anonymous:           172 kB
Swap:                  0 kB
55f2e30de000-55f2e30e2000 rw-p 00774000 fe:00 7300016                    /usr/bin/egress sidecar
Rss:                  16 kB
Anonymous:            16 kB
Swap:                  0 kB
55f2fbffb000-55f2fc03c000 rw-p 00000000 00:00 0                          [heap]
Rss:                 136 kB
Anonymous:           136 kB
Swap:                  0 kB
7fac91935000-7fac91937000 r-xp 00000000 00:00 0                          [vdso]
Rss:                   4 kB
Anonymous:             0 kB
Swap:                  0 kB
7fac91668000-7fac917be000 r-xp 00026000 fe:00 326269                     /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 928 kB
Anonymous:             0 kB
Swap:                  0 kB
7fac917c0000-7fac917c1000 r--s 00000000 fe:00 326270                     /dev/shm/shared
Rss:                   4 kB
Anonymous:             0 kB
Swap:                  0 kB
7fac91602000-7fac91640000 r--p 00039000 fe:00 326270                     /usr/lib/x86_64-linux-gnu/libssl.so.3
Rss:                   0 kB
Anonymous:             0 kB
Swap:                 24 kB
";

    #[test]
    fn only_clean_private_read_only_file_mappings_are_releasable() {
        let found: Vec<(usize, u64, String)> = releasable(SMAPS)
            .into_iter()
            .map(|c| (c.mapping.start, c.rss_kib, c.mapping.path))
            .collect();
        assert_eq!(
            found,
            vec![
                (0x55f2e2967000, 692, "/usr/bin/egress sidecar".to_string()),
                (0x55f2e2b19000, 2960, "/usr/bin/egress sidecar".to_string()),
                (
                    0x7fac91668000,
                    928,
                    "/usr/lib/x86_64-linux-gnu/libc.so.6".to_string()
                ),
            ],
            "the relocated RELRO regions (one resident, one swapped out), writable, anonymous, \
             shared and pseudo-file mappings stay"
        );
    }

    #[test]
    fn a_mapping_without_anonymous_and_swap_lines_is_not_released() {
        let header = "7fac91668000-7fac917be000 r-xp 00026000 fe:00 1 /lib/x.so\nRss: 8 kB\n";
        for smaps in [
            header.to_string(),
            format!("{header}Anonymous: 0 kB\n"),
            format!("{header}Swap: 0 kB\n"),
        ] {
            assert!(
                releasable(&smaps).is_empty(),
                "unknown CoW state: keep it\n{smaps}"
            );
        }
    }

    /// A private read-only mapping of a file of our own, so that nothing else in this test
    /// process touches its pages.
    struct FileMapping {
        start: usize,
        len: usize,
    }

    impl FileMapping {
        #[allow(unsafe_code)]
        fn new(path: &std::path::Path, len: usize) -> Self {
            use std::os::fd::AsRawFd;
            let file = std::fs::File::open(path).unwrap();
            // SAFETY: a fresh mapping of a file opened here; the test reads it through
            // `byte` only while it is mapped.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE,
                    file.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(addr, libc::MAP_FAILED);
            FileMapping {
                start: addr as usize,
                len,
            }
        }

        #[allow(unsafe_code)]
        fn byte(&self, offset: usize) -> u8 {
            assert!(offset < self.len);
            // SAFETY: in bounds of a live read-only mapping.
            unsafe { std::ptr::read_volatile((self.start + offset) as *const u8) }
        }

        fn rss_kib(&self) -> u64 {
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
            let mut inside = false;
            for line in smaps.lines() {
                if let Some((m, _)) = parse_header(line) {
                    inside = m.start == self.start;
                } else if inside {
                    if let Some(kib) = field_kib(line, "Rss:") {
                        return kib;
                    }
                }
            }
            panic!("mapping not in smaps")
        }

        fn as_startup(&self, path: &std::path::Path) -> StartupMappings {
            StartupMappings {
                ranges: vec![Mapping {
                    start: self.start,
                    end: self.start + self.len,
                    path: path.to_str().unwrap().to_string(),
                }],
            }
        }
    }

    impl Drop for FileMapping {
        #[allow(unsafe_code)]
        fn drop(&mut self) {
            // SAFETY: unmaps what `new` mapped; nothing refers to it any more.
            unsafe { libc::munmap(self.start as *mut libc::c_void, self.len) };
        }
    }

    #[test]
    fn released_pages_leave_rss_and_come_back_unchanged_on_use() {
        const LEN: usize = 1 << 20;
        let path = std::env::temp_dir().join(format!("egress-resident-{}", std::process::id()));
        let contents: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &contents).unwrap();
        let mapping = FileMapping::new(&path, LEN);
        let sum: u64 = (0..LEN).step_by(4096).map(|i| u64::from(mapping.byte(i))).sum();
        assert!(sum > 0);
        assert_eq!(mapping.rss_kib(), 1024, "every page touched");

        let released = mapping.as_startup(&path).release().unwrap();
        assert_eq!(
            released,
            Released {
                mappings: 1,
                bytes: LEN as u64,
                failed: 0
            }
        );
        assert_eq!(mapping.rss_kib(), 0, "released pages are no longer resident");

        for i in (0..LEN).step_by(4093) {
            assert_eq!(mapping.byte(i), contents[i], "byte {i} after the release");
        }
        assert!(mapping.rss_kib() > 0, "used pages came back");
        drop(mapping);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_mapping_from_after_the_snapshot_is_not_released() {
        const LEN: usize = 64 << 10;
        // The snapshot comes first, as in `main`; the mapping after it, like a library that
        // name resolution loads later.
        let startup = StartupMappings::snapshot().unwrap();
        let path = std::env::temp_dir().join(format!("egress-resident-late-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; LEN]).unwrap();
        let mapping = FileMapping::new(&path, LEN);
        assert_eq!(mapping.byte(0), 7);
        let before = mapping.rss_kib();
        assert!(before > 0);
        let released = startup.release().unwrap();
        assert!(
            released.mappings > 0,
            "the snapshot's own mappings went: {released:?}"
        );
        assert_eq!(mapping.rss_kib(), before, "the later mapping stayed");
        drop(mapping);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_snapshot_holds_the_test_executable() {
        let startup = StartupMappings::snapshot().unwrap();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        assert!(
            startup
                .ranges
                .iter()
                .any(|m| std::path::Path::new(&m.path) == exe),
            "{exe:?} not in {:?}",
            startup.ranges
        );
    }
}
