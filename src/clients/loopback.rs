//! Best-effort attribution of a loopback TCP source to the processes behind it.
//!
//! On a shared loopback (every container of a pod, or every process of a host) the peer IP says
//! nothing about who connected. The kernel does know: each of the client's sockets is a line in
//! `/proc/net/tcp` (or `tcp6`) with its local address, its remote address (one of our
//! listeners) and its inode, and the process holding it has a `/proc/PID/fd/N -> socket:[inode]`
//! link. Reading every process's fd table is costly, so this runs only for a source the leak
//! detector flags (its warning, and `/debug/clients`), off the runtime's threads, and within
//! [`MAX_PROCESSES`], [`MAX_FDS`] and [`SCAN_BUDGET`].
//!
//! Each fd link looked up costs kernel memory charged to the memory cgroup of the process that
//! looks, the sidecar's: a dentry and a procfs inode ([`FD_LINK_COST`]), kept in the dentry
//! cache until the kernel reclaims it. A leaking client with 10,000 connections would cost 9 MB,
//! which a memory budget counts as the sidecar's own and would shed connections for. So a scan
//! looks up at most the links its caller allows (the budget's room, `budget::fd_links_allowed`),
//! and probes fd numbers under each process's `FDSize` one by one rather than listing the
//! directory, as a listing makes an entry for every descriptor at once. The largest fd tables
//! go first: a leaking process holds the most descriptors.
//!
//! It only sees what the kernel lets the sidecar see: processes in its pid namespace (a pod with
//! `shareProcessNamespace: true`, compose's `pid: service:app`, or the host), whose fd tables it
//! may read (root, or the same uid). Anything else yields fewer owners, never wrong ones; the
//! counts of sockets found and fd tables unreadable say which.
//!
//! A leaking client holds many connections open at once, so owners are ranked by how many of
//! the source's connections to the sidecar each holds right now: the leaking process comes first
//! even when well-behaved processes share the address.
//!
//! Not handled here: Unix-socket peers (`process`, exact), when to scan (`Clients`).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Processes whose fd tables one scan reads at most.
pub const MAX_PROCESSES: usize = 4096;
/// Fd links one scan looks up at most, whatever its caller allows.
pub const MAX_FDS: usize = 262_144;
/// Kernel memory one fd link looked up costs the sidecar's memory cgroup: a dentry and a procfs
/// inode, measured at 900 B a link on Linux 6.18 (10,000 links read from a cgroup v1:
/// `memory.kmem.usage_in_bytes` up 9.0 MB), rounded up. Looking up an fd number that is not
/// open costs nothing that stays.
pub const FD_LINK_COST: u64 = 1 << 10;
/// Wall time one scan may take.
pub const SCAN_BUDGET: Duration = Duration::from_secs(1);

/// `/proc/net/tcp` state `0A`: a listening socket, never a client's.
const TCP_LISTEN: u8 = 0x0A;

/// One line of `/proc/net/tcp` or `/proc/net/tcp6`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketEntry {
    /// Local address (IPv4-mapped IPv6 addresses as IPv4).
    pub local: SocketAddr,
    /// Remote address.
    pub remote: SocketAddr,
    /// TCP state code (`01` established, `0A` listen, ...).
    pub state: u8,
    /// Owner uid.
    pub uid: u32,
    /// Socket inode; 0 for sockets no file refers to any more (TIME_WAIT).
    pub inode: u64,
}

/// A process holding connections from the source to the sidecar.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Owner {
    /// Pid in the sidecar's pid namespace.
    pub pid: u32,
    /// Executable (or command name, see `process::executable`).
    pub exe: Option<String>,
    /// The source's open connections to the sidecar this process holds.
    pub connections: usize,
}

/// What one scan found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scan {
    /// Most connections first.
    pub owners: Vec<Owner>,
    /// The source's open connections to the sidecar in the socket tables.
    pub sockets: usize,
    /// Processes whose fd table could not be read (permissions).
    pub unreadable: usize,
    /// A bound stopped the scan before every process was read.
    pub truncated: bool,
    /// The caller's allowance of fd links (the memory budget's room) stopped the scan before
    /// every process was read.
    pub memory_capped: bool,
    /// The socket tables could not be read at all.
    pub error: Option<String>,
}

impl Scan {
    /// Why no owner was found, for operators; `None` when some were.
    pub fn note(&self) -> Option<String> {
        if !self.owners.is_empty() {
            return None;
        }
        Some(match (&self.error, self.sockets) {
            (Some(e), _) => format!("cannot read /proc/net/tcp: {e}"),
            (None, 0) => "no open connection from this source now".to_owned(),
            (None, n) if self.memory_capped => format!(
                "{n} open connections; the fd tables holding them were not read in full: each \
                 descriptor looked up costs the sidecar about 1 KiB of kernel memory, and the \
                 memory budget has no room for more now"
            ),
            (None, n) => format!(
                "{n} open connections, held by no process visible here ({} fd tables unreadable{}); \
                 the sidecar needs the clients' pid namespace and root or their uid",
                self.unreadable,
                if self.truncated { ", scan cut short" } else { "" }
            ),
        })
    }

    /// `pid 1234 (/usr/bin/app) 98 connections, ...` for the leak warning.
    pub fn describe(&self) -> String {
        if let Some(note) = self.note() {
            return note;
        }
        let owners = self
            .owners
            .iter()
            .map(|o| {
                let exe = o.exe.as_deref().unwrap_or("?");
                format!("pid {} ({exe}) {} connections", o.pid, o.connections)
            })
            .collect::<Vec<_>>()
            .join(", ");
        if self.truncated || self.memory_capped {
            format!("{owners} (fd tables read in part: at least these)")
        } else {
            owners
        }
    }
}

/// How much of a socket table is read at a time.
const TABLE_READ_BUFFER: usize = 8 << 10;

/// Parses `/proc/net/tcp` or `/proc/net/tcp6` text; lines that do not parse are skipped. (The
/// sidecar reads its tables a buffer at a time; whole texts are its tests'.)
#[cfg(test)]
pub fn parse_table(text: &str) -> Vec<SocketEntry> {
    text.lines().skip(1).filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<SocketEntry> {
    // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
    let mut fields = line.split_whitespace().skip(1);
    let local = parse_socket_addr(fields.next()?)?;
    let remote = parse_socket_addr(fields.next()?)?;
    let state = u8::from_str_radix(fields.next()?, 16).ok()?;
    let uid = fields.nth(3)?.parse().ok()?;
    let inode = fields.nth(1)?.parse().ok()?;
    Some(SocketEntry {
        local,
        remote,
        state,
        uid,
        inode,
    })
}

/// Adds the inodes of `source`'s client ends in the table at `path` to `wanted`, a line at a
/// time: with a leak storm the table holds tens of thousands of sockets (6 MB of text for
/// 40,000), which read whole would be the sidecar's biggest allocation.
fn client_ends(
    path: &Path,
    source: IpAddr,
    listeners: &[SocketAddr],
    wanted: &mut HashMap<u64, ()>,
) -> io::Result<()> {
    use std::io::BufRead;
    let mut reader = io::BufReader::with_capacity(TABLE_READ_BUFFER, std::fs::File::open(path)?);
    let mut line = String::new();
    let mut header = true;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        if std::mem::take(&mut header) {
            continue;
        }
        if let Some(entry) = parse_line(&line).filter(|e| is_client_end(e, source, listeners)) {
            wanted.insert(entry.inode, ());
        }
    }
}

/// `0100007F:1F90` or 32 hex digits and a port. The kernel prints each 32-bit word of the
/// address as a native-endian integer, so its bytes in memory order are the address's bytes.
fn parse_socket_addr(text: &str) -> Option<SocketAddr> {
    let (addr, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(addr)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(addr.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(canonical(ip), port))
}

/// IPv4-mapped IPv6 addresses (a dual-stack socket's view of an IPv4 peer) as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// Whether `entry` is the client's end of a connection from `source` to one of `listeners`.
pub fn is_client_end(entry: &SocketEntry, source: IpAddr, listeners: &[SocketAddr]) -> bool {
    entry.inode != 0
        && entry.state != TCP_LISTEN
        && entry.local.ip() == canonical(source)
        && listeners.iter().any(|l| {
            l.port() == entry.remote.port()
                && (l.ip().is_unspecified() || canonical(l.ip()) == entry.remote.ip())
        })
}

/// Finds the processes (under `proc_root`, `/proc` outside tests) holding the client ends of
/// `source`'s connections to `listeners`, looking up at most `max_links` fd links.
pub fn scan(proc_root: &Path, source: IpAddr, listeners: &[SocketAddr], max_links: usize) -> Scan {
    let mut scan = Scan::default();
    let mut wanted: HashMap<u64, ()> = HashMap::new();
    let mut read_any = false;
    for table in ["net/tcp", "net/tcp6"] {
        match client_ends(&proc_root.join(table), source, listeners, &mut wanted) {
            Ok(()) => read_any = true,
            Err(e) if !read_any && table == "net/tcp6" => scan.error = Some(e.to_string()),
            Err(_) => {}
        }
    }
    scan.sockets = wanted.len();
    if wanted.is_empty() {
        return scan;
    }
    let counts = match owners_of(proc_root, &wanted, max_links, &mut scan) {
        Ok(counts) => counts,
        Err(e) => {
            scan.error = Some(e.to_string());
            return scan;
        }
    };
    scan.owners = counts
        .into_iter()
        .map(|(pid, connections)| Owner {
            pid,
            exe: super::process::executable(proc_root, pid),
            connections,
        })
        .collect();
    scan.owners
        .sort_by(|a, b| b.connections.cmp(&a.connections).then(a.pid.cmp(&b.pid)));
    scan
}

/// Looks up fd links, largest tables first, until every wanted inode is found or a bound is
/// hit; pid -> sockets held.
fn owners_of(
    proc_root: &Path,
    wanted: &HashMap<u64, ()>,
    max_links: usize,
    scan: &mut Scan,
) -> io::Result<HashMap<u32, usize>> {
    let started = Instant::now();
    let allowed = max_links.min(MAX_FDS);
    let (mut links, mut found) = (0usize, 0usize);
    let mut counts = HashMap::new();
    'tables: for (pid, size) in fd_tables(proc_root, scan)? {
        let dir = proc_root.join(pid.to_string()).join("fd");
        for fd in 0..size {
            if found == wanted.len() {
                break 'tables;
            }
            if links == allowed {
                if allowed < MAX_FDS {
                    scan.memory_capped = true;
                } else {
                    scan.truncated = true;
                }
                break 'tables;
            }
            if started.elapsed() > SCAN_BUDGET {
                scan.truncated = true;
                break 'tables;
            }
            let target = match std::fs::read_link(dir.join(fd.to_string())) {
                Ok(target) => target,
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                    scan.unreadable += 1;
                    continue 'tables;
                }
                Err(_) => continue, // not open (or the process exited)
            };
            links += 1;
            if socket_inode(&target).is_some_and(|inode| wanted.contains_key(&inode)) {
                *counts.entry(pid).or_insert(0) += 1;
                found += 1;
            }
        }
    }
    Ok(counts)
}

/// The processes under `proc_root` but the sidecar, each with the size of its fd table (its
/// highest open descriptor is below it), largest first.
fn fd_tables(proc_root: &Path, scan: &mut Scan) -> io::Result<Vec<(u32, u32)>> {
    let me = std::process::id();
    let mut tables = Vec::new();
    for entry in std::fs::read_dir(proc_root)? {
        let Some(pid) = entry
            .ok()
            .and_then(|e| e.file_name().to_str()?.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        if tables.len() == MAX_PROCESSES {
            scan.truncated = true;
            break;
        }
        if let Some(size) = fd_table_size(proc_root, pid) {
            tables.push((pid, size));
        }
    }
    tables.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    Ok(tables)
}

/// `FDSize` in `/proc/PID/status`; `None` once the process is gone.
fn fd_table_size(proc_root: &Path, pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(proc_root.join(pid.to_string()).join("status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("FDSize:")?.trim().parse().ok())
}

/// The inode of an fd link `socket:[12345]`.
fn socket_inode(target: &Path) -> Option<u64> {
    target
        .to_str()?
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Real lines (Linux 6.x, x86_64): a listener on 127.0.0.1:15080, a client 127.0.0.1:40312
    // connected to it (both ends), and a TIME_WAIT socket.
    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:3AE8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 51234 1 0000000000000000 100 0 0 10 0
   1: 0100007F:9D78 0100007F:3AE8 01 00000000:00000000 00:00000000 00000000  1000        0 61001 1 0000000000000000 20 4 30 10 -1
   2: 0100007F:3AE8 0100007F:9D78 01 00000000:00000000 00:00000000 00000000     0        0 61002 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:9D7A 0100007F:3AE8 06 00000000:00000000 03:00000E5B 00000000     0        0 0 3 0000000000000000
";

    // ::1 client to [::1]:15080, and a v4-mapped client (::ffff:127.0.0.2) to a dual-stack
    // listener on [::]:15080.
    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:B0F2 00000000000000000000000001000000:3AE8 01 00000000:00000000 00:00000000 00000000  1000        0 72001 1 0000000000000000 20 4 31 10 -1
   1: 0000000000000000FFFF00000200007F:C350 0000000000000000FFFF00000100007F:3AE8 01 00000000:00000000 00:00000000 00000000     0        0 72002 1 0000000000000000 20 4 31 10 -1
";

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn ipv4_lines_parse() {
        let entries = parse_table(TCP);
        assert_eq!(entries.len(), 4);
        assert_eq!(
            entries[1],
            SocketEntry {
                local: addr("127.0.0.1:40312"),
                remote: addr("127.0.0.1:15080"),
                state: 1,
                uid: 1000,
                inode: 61001,
            }
        );
        assert_eq!(entries[0].state, TCP_LISTEN);
        assert_eq!(entries[3].inode, 0);
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn ipv6_lines_parse_and_mapped_addresses_become_ipv4() {
        let entries = parse_table(TCP6);
        assert_eq!(entries[0].local, addr("[::1]:45298"));
        assert_eq!(entries[0].remote, addr("[::1]:15080"));
        assert_eq!(entries[0].inode, 72001);
        assert_eq!(entries[1].local, addr("127.0.0.2:50000"));
        assert_eq!(entries[1].remote, addr("127.0.0.1:15080"));
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn only_the_client_end_of_a_live_connection_to_a_listener_matches() {
        let listener = [addr("127.0.0.1:15080")];
        let source = "127.0.0.1".parse().unwrap();
        let matched: Vec<u64> = parse_table(TCP)
            .iter()
            .filter(|e| is_client_end(e, source, &listener))
            .map(|e| e.inode)
            .collect();
        // Not the listener, not the sidecar's end, not the TIME_WAIT socket.
        assert_eq!(matched, [61001]);

        let any = [addr("[::]:15080")];
        let mapped = parse_table(TCP6);
        assert!(is_client_end(&mapped[1], "127.0.0.2".parse().unwrap(), &any));
        assert!(is_client_end(
            &mapped[1],
            "::ffff:127.0.0.2".parse().unwrap(),
            &any
        ));
        assert!(!is_client_end(&mapped[1], "127.0.0.1".parse().unwrap(), &any));
        assert!(is_client_end(
            &mapped[0],
            "::1".parse().unwrap(),
            &[addr("[::1]:15080")]
        ));
    }

    #[test]
    fn garbage_lines_are_skipped() {
        assert!(parse_table("header\nnot a socket line\n 0: zz:1 00:0 01 a b c 0 0 1\n").is_empty());
    }

    /// A fixture `/proc`: socket tables, and fd links and `status` for two processes: pid 100
    /// holds two of 127.0.0.1's connections (fds 0 and 2), pid 200 one of `::1`'s.
    struct FixtureProc(std::path::PathBuf);

    impl FixtureProc {
        fn new(name: &str) -> Self {
            let root = std::env::temp_dir().join(format!("egress-scan-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("net")).unwrap();
            let mut tcp = TCP.to_owned();
            tcp.push_str("   4: 0100007F:9D7C 0100007F:3AE8 01 00000000:00000000 00:00000000 00000000  1000        0 61003 1 0000000000000000 20 4 30 10 -1\n");
            std::fs::write(root.join("net/tcp"), tcp).unwrap();
            std::fs::write(root.join("net/tcp6"), TCP6).unwrap();
            for (pid, fd_size, links) in [
                (
                    100u32,
                    64,
                    &[(0, "socket:[61001]"), (1, "/dev/null"), (2, "socket:[61003]")][..],
                ),
                (200, 128, &[(0, "/dev/null"), (70, "socket:[72001]")][..]),
            ] {
                let fd = root.join(format!("{pid}/fd"));
                std::fs::create_dir_all(&fd).unwrap();
                for (n, target) in links {
                    std::os::unix::fs::symlink(target, fd.join(n.to_string())).unwrap();
                }
                std::fs::write(root.join(format!("{pid}/comm")), format!("app{pid}\n")).unwrap();
                std::fs::write(
                    root.join(format!("{pid}/status")),
                    format!("Name:\tapp{pid}\nFDSize:\t{fd_size}\nGroups:\t\n"),
                )
                .unwrap();
            }
            FixtureProc(root)
        }

        fn scan(&self, source: &str, max_links: usize) -> Scan {
            scan(
                &self.0,
                source.parse().unwrap(),
                &[addr("127.0.0.1:15080"), addr("[::1]:15080")],
                max_links,
            )
        }
    }

    impl Drop for FixtureProc {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Each owner's pid and connections, in the scan's order.
    fn held(scan: &Scan) -> Vec<(u32, usize)> {
        scan.owners.iter().map(|o| (o.pid, o.connections)).collect()
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn a_scan_counts_each_processes_connections_from_the_source() {
        let proc = FixtureProc::new("counts");
        let scan = proc.scan("127.0.0.1", MAX_FDS);
        assert_eq!(scan.sockets, 2);
        assert_eq!(
            scan.owners,
            [Owner {
                pid: 100,
                exe: Some("app100".into()),
                connections: 2
            }]
        );
        assert_eq!(scan.describe(), "pid 100 (app100) 2 connections");
        // The link past the 64th fd number is found: probing goes up to each table's FDSize.
        let scan = proc.scan("::1", MAX_FDS);
        assert_eq!(held(&scan), [(200, 1)]);
    }

    /// The memory budget's allowance: links looked up (open fds) count against it, fd numbers
    /// not open do not, and the largest table goes first.
    #[test]
    #[cfg(target_endian = "little")]
    fn a_scan_looks_up_no_more_links_than_allowed() {
        let proc = FixtureProc::new("allowed");
        // pid 200's table (FDSize 128) goes first and holds two links; then pid 100's fd 0.
        let scan = proc.scan("127.0.0.1", 3);
        assert!(scan.memory_capped && !scan.truncated, "{scan:?}");
        assert_eq!(held(&scan), [(100, 1)]);
        assert_eq!(
            scan.describe(),
            "pid 100 (app100) 1 connections (fd tables read in part: at least these)"
        );
        // Five links reach both of pid 100's sockets, and the scan stops there uncapped.
        let scan = proc.scan("127.0.0.1", 5);
        assert!(!scan.memory_capped, "{scan:?}");
        assert_eq!(scan.owners[0].connections, 2);

        let none = proc.scan("127.0.0.1", 0);
        assert!(none.owners.is_empty() && none.memory_capped);
        let note = none.note().unwrap();
        assert!(note.starts_with("2 open connections; the fd tables"), "{note}");
        assert!(note.contains("memory budget"), "{note}");
    }
}
