//! A hand-written DNS responder over UDP for tests that resolve through a server they control:
//! A records for one name from a list the test changes at runtime, queries counted by type, and
//! failures (SERVFAIL, NXDOMAIN, silence) switched on and off at runtime.

use super::*;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU32, AtomicU8};
use std::time::Instant;

use tokio::net::UdpSocket;

/// Record types, as numbered on the wire.
pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;

const RCODE_NOERROR: u16 = 0;
const RCODE_FORMERR: u16 = 1;
const RCODE_SERVFAIL: u16 = 2;
const RCODE_NXDOMAIN: u16 = 3;
const RCODE_NOTIMP: u16 = 4;

struct Zone {
    /// The one name answered, lowercase, without the root dot.
    name: String,
    records: Mutex<Vec<Ipv4Addr>>,
    ttl: AtomicU32,
    /// Questions seen for the name, by type.
    queries: Mutex<Vec<u16>>,
    /// Questions for other names (answered NXDOMAIN).
    other_queries: AtomicUsize,
    /// How questions for the name are met: a [`DnsMode`] as its index.
    mode: AtomicU8,
    /// When A records were last sent for the name.
    last_answer: Mutex<Option<Instant>>,
}

/// How a [`DnsServer`] meets questions for its name; the test switches it at runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DnsMode {
    /// The records (for A; NOERROR without answers for any other type).
    Answer = 0,
    /// SERVFAIL, at once, for every type.
    ServFail = 1,
    /// NXDOMAIN, at once, for every type.
    NxDomain = 2,
    /// No reply at all: the resolver waits out its own timeout.
    Silent = 3,
}

/// A UDP DNS server on 127.0.0.1:0 answering for one name: its A records (the current list,
/// with the current TTL); NOERROR without answers for any other type (AAAA included); NXDOMAIN
/// for any other name. [`DnsServer::set_mode`] makes it fail instead (SERVFAIL, NXDOMAIN, or
/// silence). Runs until dropped.
pub struct DnsServer {
    pub addr: SocketAddr,
    zone: Arc<Zone>,
    stop: Option<oneshot::Sender<()>>,
}

impl DnsServer {
    pub async fn start(name: &str, records: &[Ipv4Addr], ttl: u32) -> Self {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let zone = Arc::new(Zone {
            name: name.trim_end_matches('.').to_ascii_lowercase(),
            records: Mutex::new(records.to_vec()),
            ttl: AtomicU32::new(ttl),
            queries: Mutex::new(Vec::new()),
            other_queries: AtomicUsize::new(0),
            mode: AtomicU8::new(DnsMode::Answer as u8),
            last_answer: Mutex::new(None),
        });
        let (stop, mut stopped) = oneshot::channel::<()>();
        let served = zone.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            loop {
                let (n, from) = tokio::select! {
                    r = socket.recv_from(&mut buf) => match r { Ok(p) => p, Err(_) => continue },
                    _ = &mut stopped => return,
                };
                if let Some(reply) = served.answer(&buf[..n]) {
                    let _ = socket.send_to(&reply, from).await;
                }
            }
        });
        DnsServer {
            addr,
            zone,
            stop: Some(stop),
        }
    }

    /// The A records answered from now on.
    pub fn set_records(&self, records: &[Ipv4Addr]) {
        *self.zone.records.lock().unwrap() = records.to_vec();
    }

    pub fn set_ttl(&self, ttl: u32) {
        self.zone.ttl.store(ttl, Ordering::SeqCst);
    }

    /// How questions for the name are met from now on.
    pub fn set_mode(&self, mode: DnsMode) {
        self.zone.mode.store(mode as u8, Ordering::SeqCst);
    }

    /// When A records for the name were last sent (None: never).
    pub fn last_answer(&self) -> Option<Instant> {
        *self.zone.last_answer.lock().unwrap()
    }

    /// Questions for names other than this server's (each answered NXDOMAIN).
    pub fn other_queries(&self) -> usize {
        self.zone.other_queries.load(Ordering::SeqCst)
    }

    /// Questions of type `qtype` for the name so far.
    pub fn queries(&self, qtype: u16) -> usize {
        self.zone
            .queries
            .lock()
            .unwrap()
            .iter()
            .filter(|t| **t == qtype)
            .count()
    }

    /// Every question for the name so far.
    pub fn all_queries(&self) -> usize {
        self.zone.queries.lock().unwrap().len()
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// One question: the name as sent (for echoing back), lowercased, its type and class.
struct Question<'a> {
    wire: &'a [u8],
    name: String,
    qtype: u16,
}

fn u16_at(buf: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*buf.get(at)?, *buf.get(at + 1)?]))
}

/// Parses the question that starts at byte 12 (uncompressed labels, as every resolver sends).
fn question(msg: &[u8]) -> Option<Question<'_>> {
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*msg.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None; // a compression pointer or a reserved label type
        }
        labels.push(String::from_utf8_lossy(msg.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let qtype = u16_at(msg, at)?;
    u16_at(msg, at + 2)?; // the class
    Some(Question {
        wire: &msg[12..at + 4],
        name: labels.join("."),
        qtype,
    })
}

impl Zone {
    /// The reply to `msg`; None for what is not a query at all (too short, or a response), and
    /// in [`DnsMode::Silent`].
    fn answer(&self, msg: &[u8]) -> Option<Vec<u8>> {
        let id = u16_at(msg, 0)?;
        let flags = u16_at(msg, 2)?;
        if flags & 0x8000 != 0 {
            return None;
        }
        let opcode = (flags >> 11) & 0xf;
        let recursion_desired = flags & 0x0100;
        // QR, the query's opcode and RD, RA; AA since this server is the name's authority.
        let reply_flags = |rcode: u16| 0x8000 | (opcode << 11) | 0x0400 | recursion_desired | 0x0080 | rcode;
        let header = |rcode: u16, questions: u16, answers: u16| {
            let mut out = Vec::with_capacity(512);
            for field in [id, reply_flags(rcode), questions, answers, 0, 0] {
                out.extend_from_slice(&field.to_be_bytes());
            }
            out
        };
        if opcode != 0 {
            return Some(header(RCODE_NOTIMP, 0, 0));
        }
        if u16_at(msg, 4)? != 1 {
            return Some(header(RCODE_FORMERR, 0, 0));
        }
        let Some(q) = question(msg) else {
            return Some(header(RCODE_FORMERR, 0, 0));
        };
        let failure = |rcode: u16| {
            let mut out = header(rcode, 1, 0);
            out.extend_from_slice(q.wire);
            Some(out)
        };
        if q.name != self.name {
            self.other_queries.fetch_add(1, Ordering::SeqCst);
            return failure(RCODE_NXDOMAIN);
        }
        self.queries.lock().unwrap().push(q.qtype);
        match self.mode.load(Ordering::SeqCst) {
            m if m == DnsMode::ServFail as u8 => return failure(RCODE_SERVFAIL),
            m if m == DnsMode::NxDomain as u8 => return failure(RCODE_NXDOMAIN),
            m if m == DnsMode::Silent as u8 => return None,
            _ => {}
        }
        let records = if q.qtype == TYPE_A {
            self.records.lock().unwrap().clone()
        } else {
            Vec::new()
        };
        let ttl = self.ttl.load(Ordering::SeqCst);
        if !records.is_empty() {
            *self.last_answer.lock().unwrap() = Some(Instant::now());
        }
        let mut out = header(RCODE_NOERROR, 1, records.len() as u16);
        out.extend_from_slice(q.wire);
        for ip in records {
            out.extend_from_slice(&[0xc0, 12]); // the name: a pointer to the question's
            out.extend_from_slice(&TYPE_A.to_be_bytes());
            out.extend_from_slice(&1u16.to_be_bytes()); // IN
            out.extend_from_slice(&ttl.to_be_bytes());
            out.extend_from_slice(&4u16.to_be_bytes());
            out.extend_from_slice(&ip.octets());
        }
        Some(out)
    }
}

// === a tiny client, to check the server itself ===

/// A query for `name` of type `qtype` with id `id` and RD set.
pub fn dns_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut out = Vec::new();
    for field in [id, 0x0100, 1, 0, 0, 0] {
        out.extend_from_slice(&field.to_be_bytes());
    }
    for label in name.trim_end_matches('.').split('.') {
        out.push(label.len() as u8);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    out.extend_from_slice(&qtype.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out
}

/// What a reply said: its id, rcode, and the A records with their TTLs.
#[derive(Debug, PartialEq, Eq)]
pub struct DnsReply {
    pub id: u16,
    pub rcode: u16,
    pub a: Vec<(Ipv4Addr, u32)>,
}

/// Parses a reply to a [`dns_query`] (answers whose names are pointers, as [`DnsServer`]'s).
pub fn parse_dns_reply(msg: &[u8]) -> Option<DnsReply> {
    let id = u16_at(msg, 0)?;
    let flags = u16_at(msg, 2)?;
    assert!(flags & 0x8000 != 0, "not a response");
    let answers = u16_at(msg, 6)?;
    let mut at = 12;
    if u16_at(msg, 4)? == 1 {
        while *msg.get(at)? != 0 {
            at += 1 + usize::from(msg[at]);
        }
        at += 5;
    }
    let mut a = Vec::new();
    for _ in 0..answers {
        at += 2; // the name pointer
        let rtype = u16_at(msg, at)?;
        let ttl = u32::from_be_bytes(msg.get(at + 4..at + 8)?.try_into().ok()?);
        let len = usize::from(u16_at(msg, at + 8)?);
        let data = msg.get(at + 10..at + 10 + len)?;
        if rtype == TYPE_A && len == 4 {
            a.push((Ipv4Addr::new(data[0], data[1], data[2], data[3]), ttl));
        }
        at += 10 + len;
    }
    Some(DnsReply {
        id,
        rcode: flags & 0xf,
        a,
    })
}

/// Sends `query` to `server` and waits (up to 2 s) for the reply.
pub async fn ask_dns(server: SocketAddr, query: &[u8]) -> DnsReply {
    let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    socket.send_to(query, server).await.unwrap();
    let mut buf = [0u8; 1500];
    let (n, _) = tokio::time::timeout(Duration::from_secs(2), socket.recv_from(&mut buf))
        .await
        .expect("a DNS reply within 2 s")
        .unwrap();
    parse_dns_reply(&buf[..n]).expect("a well-formed DNS reply")
}
