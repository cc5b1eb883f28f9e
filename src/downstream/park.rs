//! Long-idle keep-alive application connections and quiet tunnels, parked outside any task.
//!
//! A leaking client leaves thousands of keep-alive connections here, each waiting for a request
//! that never comes. Waiting in a task costs the task, its future, a timer entry and the
//! runtime's socket registration: about 2 KiB each. So after [`PARK_AFTER`] idle a connection's
//! task ends, and what remains is its socket, registered with an epoll instance of this module's
//! own, and a record of 80 bytes in the lot.
//!
//! One task wakes for all of them. The sidecar starts it with its listeners, so that its
//! tasks at rest (`egress_runtime_tasks`) do not grow by one the first time a connection
//! parks, which a leak watch would read as a leak; a context served without the app (unit
//! tests) starts it with the first parked connection. What it does:
//! - a readable socket (the next request, or the client closing) gets a fresh connection task;
//! - an idle timeout that runs out closes the connection here, as does
//!   `downstream.max_idle_connections` (longest idle first, as nginx reuses keep-alive
//!   connections under `worker_connections` pressure) and draining.
//!
//! TCP and Unix-socket connections park alike: the lot keeps each as its bare descriptor and,
//! when it wakes, hands it back to a task of the type its `Source` names.
//!
//! Under load connections idle for microseconds between requests and never get here; parking
//! and waking cost four `epoll_ctl` calls, paid only by connections idle for [`PARK_AFTER`].
//!
//! Quiet tunnels (CONNECT, WebSocket) park here too, after [`PARK_AFTER`] without a byte
//! either way: both sockets as bare descriptors under one token, and a record of the
//! tunnel (its count, its access-log line) instead of a task holding the splice and two
//! runtime registrations. Either socket turning readable puts the tunnel back in a task to
//! splice on; its idle timeout closes it here. A leaky client behind `HTTPS_PROXY` leaves one
//! idle tunnel per leak, and idle WebSockets wait for minutes between messages. Only tunnels
//! whose upstream is plain TCP park (TLS state cannot wait as a descriptor), and only while
//! both directions are open with nothing held; the others wait in their tasks, as all do once
//! draining starts. A tunnel that pauses longer than [`PARK_AFTER`] (a model's response
//! streamed through it waits seconds for its first token) pays a park and a wake per pause:
//! eight `epoll_ctl` calls and a task, tens of microseconds. Parking later lets a burst of new
//! tunnels hold their tasks' memory all at once, which the heap then keeps: after 1 s, 1,850 B
//! per idle tunnel; after 100 ms, 1,130 B (`benches/idle_memory.sh`).
//!
//! [`PARK_AFTER`]: super::PARK_AFTER

use std::io;
use std::net::{SocketAddr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Events, Token};
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::conn::Session;
use super::stream::Stream;
use super::{finish, spawn_connection, splice_apart, Context, Held, Served, TunnelEnds};
use crate::clients::Process;
use crate::clients::Source;
use crate::routing::Arrival;
use crate::tunnel::Dormant;
use order::{Deadlines, Slots};

mod order;

/// Readiness events taken from the epoll instance per call.
const EVENTS: usize = 256;

/// Parked connections and the epoll instance that watches them.
#[derive(Debug)]
pub struct Parking {
    /// Registers sockets with the epoll instance; `None` if it could not be created, and then
    /// connections wait in their tasks.
    registry: Option<mio::Registry>,
    /// The epoll instance, until the parking task takes it.
    poll: Mutex<Option<mio::Poll>>,
    lot: Mutex<Lot>,
    /// Tells the parking task that the earliest deadline moved.
    rearm: Notify,
    /// Connections handed back to a task of their own.
    resumed: AtomicU64,
}

/// The records, each kind in one buffer ([`order`]): the record and the deadline are kept
/// small, as a leaking client leaves thousands (`benches/compare.sh`, workload 3).
#[derive(Debug)]
struct Lot {
    next: u64,
    /// By sequence number, which is the order they were parked in: longest idle first.
    parked: Slots<Parked>,
    /// Quiet tunnels by sequence number.
    tunnels: Slots<ParkedTunnel>,
    /// Of connections and tunnels.
    deadlines: Deadlines<Deadline>,
    /// The instant deadlines count from.
    epoch: Instant,
    /// `egress_downstream_parked_connections`, kept equal to `parked.len()`.
    counted: Gauge,
    task: TaskState,
}

/// An idle deadline, in nanoseconds after the lot's epoch: half the size of an `Instant`.
type Deadline = u64;

#[derive(Debug, Default, PartialEq, Eq)]
enum TaskState {
    #[default]
    NotStarted,
    Running,
    /// Draining started (or the epoll instance failed): nothing is parked any more.
    Closed,
}

/// What a parked connection keeps: 80 bytes.
#[derive(Debug)]
struct Parked {
    stream: OwnedFd,
    tally: Tally,
    peer: PackedSource,
    deadline: Deadline,
    held: Held,
    arrival: Arrival,
}

/// What a parked tunnel keeps.
#[derive(Debug)]
struct ParkedTunnel {
    client: OwnedFd,
    tunnel: Dormant,
    deadline: Deadline,
    served: Served,
    held: Held,
    peer: PackedSource,
}

/// A parked connection's [`Source`] in 16 bytes where a socket address takes 32: an IPv4 client
/// (the usual one, on loopback) inline, an IPv6 one boxed.
#[derive(Debug)]
enum PackedSource {
    V4(SocketAddrV4),
    V6(Box<SocketAddr>),
    Unix(Arc<Process>),
}

impl From<Source> for PackedSource {
    fn from(peer: Source) -> Self {
        match peer {
            Source::Tcp(SocketAddr::V4(addr)) => PackedSource::V4(addr),
            Source::Tcp(addr) => PackedSource::V6(Box::new(addr)),
            Source::Unix(process) => PackedSource::Unix(process),
        }
    }
}

impl From<PackedSource> for Source {
    fn from(peer: PackedSource) -> Self {
        match peer {
            PackedSource::V4(addr) => Source::Tcp(SocketAddr::V4(addr)),
            PackedSource::V6(addr) => Source::Tcp(*addr),
            PackedSource::Unix(process) => Source::Unix(process),
        }
    }
}

/// A connection's requests (saturating at 2^31 - 1) and, in the top bit, whether its source
/// leaks: one word where the two took two.
#[derive(Debug, Clone, Copy)]
struct Tally(u32);

impl Tally {
    const LEAKY: u32 = 1 << 31;

    fn new(requests: u64, leaky: bool) -> Self {
        let requests = requests.min(u64::from(Self::LEAKY - 1)) as u32;
        Tally(requests | if leaky { Self::LEAKY } else { 0 })
    }

    fn requests(self) -> u64 {
        u64::from(self.0 & !Self::LEAKY)
    }

    fn leaky(self) -> bool {
        self.0 & Self::LEAKY != 0
    }
}

impl Parking {
    /// `counted` is `egress_downstream_parked_connections`.
    pub(super) fn new(counted: Gauge) -> Self {
        let poll = mio::Poll::new()
            .and_then(|poll| Ok((poll.registry().try_clone()?, poll)))
            .inspect_err(|e| tracing::warn!(error = %e, "cannot create an epoll instance: idle connections stay in their tasks"))
            .ok();
        let (registry, poll) = poll.unzip();
        Parking {
            registry,
            poll: Mutex::new(poll),
            lot: Mutex::new(Lot {
                next: 0,
                parked: Slots::default(),
                tunnels: Slots::default(),
                deadlines: Deadlines::default(),
                epoch: Instant::now(),
                counted,
                task: TaskState::default(),
            }),
            rearm: Notify::new(),
            resumed: AtomicU64::new(0),
        }
    }

    /// Starts the task that wakes for parked connections, unless it runs already (or ran, and
    /// draining ended it) or nothing can be parked.
    pub fn start(&self, ctx: &Arc<Context>) {
        if self.available() && self.lock().starts_task() {
            tokio::spawn(run(ctx.clone()));
        }
    }

    /// Whether idle connections can be parked.
    pub(super) fn available(&self) -> bool {
        self.registry.is_some()
    }

    /// Connections parked now.
    pub fn len(&self) -> usize {
        self.lock().parked.len()
    }

    /// Connections handed back to a task since start.
    pub fn resumed(&self) -> u64 {
        self.resumed.load(Ordering::Relaxed)
    }

    /// Whether no connection is parked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes over an idle connection whose task is ending. It has been idle for
    /// [`PARK_AFTER`](super::PARK_AFTER).
    pub(super) fn park<S: Stream>(&self, conn: Session<S>, held: Held, arrival: Arrival, ctx: &Arc<Context>) {
        let Session {
            stream,
            peer,
            requests,
            leaky,
            idle_deadline: deadline,
            ..
        } = conn;
        let not_parked = |held| ended(ctx, &peer, requests, false, held);
        let Some(registry) = &self.registry else {
            return not_parked(held);
        };
        let stream = match stream.into_parked() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "cannot park an idle connection");
                return not_parked(held);
            }
        };
        let max_idle = ctx.config.get().max_idle_connections.max(1);

        let mut lot = self.lock();
        if lot.task == TaskState::Closed {
            drop(lot);
            return not_parked(held);
        }
        let seq = lot.next;
        let fd = stream.as_raw_fd();
        if let Err(e) = registry.register(&mut SourceFd(&fd), token(seq), mio::Interest::READABLE) {
            drop(lot);
            tracing::warn!(error = %e, "cannot park an idle connection");
            return not_parked(held);
        }
        lot.next += 1;
        let deadline = lot.deadline(deadline);
        let parked = Parked {
            stream,
            tally: Tally::new(requests, leaky),
            peer: peer.into(),
            deadline,
            held,
            arrival,
        };
        lot.insert(seq, parked);
        let mut evicted = Vec::new();
        while lot.parked.len() > max_idle {
            evicted.extend(lot.pop_first());
        }
        self.watch(lot, (deadline, seq), ctx);
        for parked in evicted {
            close_idle(parked, ctx);
        }
    }

    /// Takes over a quiet tunnel whose task is ending ([`PARK_AFTER`](super::PARK_AFTER)
    /// without a byte, its upstream already out of the runtime), to close at `deadline`.
    /// Draining, or should its sockets not be parked, it goes back to a task that does not
    /// park it again.
    pub(super) fn park_tunnel<S: Stream>(
        &self,
        stream: S,
        tunnel: Dormant,
        ends: TunnelEnds,
        deadline: Instant,
        ctx: &Arc<Context>,
    ) {
        let TunnelEnds { served, held, peer } = ends;
        let client = match stream.into_parked() {
            Ok(client) => client,
            Err(e) => {
                tracing::debug!(error = %e, "cannot park a quiet tunnel");
                let _ = tunnel.close_failed(e);
                return finish(ctx, &peer, served, held);
            }
        };
        let mut parked = ParkedTunnel {
            client,
            tunnel,
            deadline: 0,
            served,
            held,
            peer: peer.into(),
        };
        let mut lot = self.lock();
        let seq = lot.next;
        let registered = match &self.registry {
            Some(registry) if lot.task != TaskState::Closed => parked.register(registry, token(seq)),
            _ => Err(io::Error::other("parking is closed")),
        };
        if let Err(e) = registered {
            drop(lot);
            tracing::debug!(error = %e, "cannot park a quiet tunnel");
            return parked.resume(deadline, false, ctx);
        }
        lot.next += 1;
        parked.deadline = lot.deadline(deadline);
        let key = (parked.deadline, seq);
        lot.deadlines.push(parked.deadline, seq);
        lot.tunnels.push(seq, parked);
        self.watch(lot, key, ctx);
    }

    /// After a record went in under `key`: starts the parking task with the first record,
    /// and tells it when the earliest deadline moved.
    fn watch(&self, mut lot: MutexGuard<'_, Lot>, key: (Deadline, u64), ctx: &Arc<Context>) {
        let earliest = lot.first_deadline() == Some(key);
        let start = lot.starts_task();
        drop(lot);
        if start {
            tokio::spawn(run(ctx.clone()));
        } else if earliest {
            self.rearm.notify_one();
        }
    }

    /// Quiet tunnels parked now.
    pub fn tunnels(&self) -> usize {
        self.lock().tunnels.len()
    }

    /// Hands a connection whose socket turned readable back to a task of its own; one whose
    /// client closed it (`read_closed`, and nothing left to read) is closed here instead. A
    /// leaking client that exits closes thousands at once, and a task for each would be the
    /// very memory spike the budget guards against.
    fn wake(&self, seq: u64, read_closed: bool, ctx: &Arc<Context>) {
        // Uncounted (by the lot) before its task can answer, so a client never sees it counted
        // as parked.
        let (parked, deadline) = {
            let mut lot = self.lock();
            match lot.remove_with_instant(seq) {
                Some(parked) => parked,
                None => {
                    let Some(tunnel) = lot.remove_tunnel(seq) else {
                        return;
                    };
                    let deadline = lot.instant(tunnel.deadline);
                    drop(lot);
                    if let Some(registry) = &self.registry {
                        tunnel.deregister(registry);
                    }
                    return tunnel.resume(deadline, true, ctx);
                }
            }
        };
        if let Some(registry) = &self.registry {
            let _ = registry.deregister(&mut SourceFd(&parked.stream.as_raw_fd()));
        }
        if read_closed && !has_bytes(&parked.stream) {
            return parked.close(ctx, false);
        }
        let Parked {
            stream,
            tally,
            peer,
            held,
            arrival,
            ..
        } = parked;
        self.resumed.fetch_add(1, Ordering::Relaxed);
        let woken = Woken {
            peer: peer.into(),
            requests: tally.requests(),
            leaky: tally.leaky(),
            deadline,
            held,
            arrival,
        };
        match woken.peer {
            Source::Tcp(_) => woken.resume(tokio::net::TcpStream::from_std(stream.into()), ctx),
            Source::Unix(_) => woken.resume(tokio::net::UnixStream::from_std(stream.into()), ctx),
        }
    }

    /// Wakes every connection the epoll instance reports ready.
    fn wake_ready(&self, poll: &mut mio::Poll, events: &mut Events, ctx: &Arc<Context>) -> io::Result<()> {
        loop {
            match poll.poll(events, Some(Duration::ZERO)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let mut taken = 0;
            for event in events.iter() {
                taken += 1;
                self.wake(event.token().0 as u64, event.is_read_closed(), ctx);
            }
            if taken < events.capacity() {
                return Ok(());
            }
        }
    }

    /// Closes the connections whose idle timeout ran out.
    fn expire(&self, now: Instant, ctx: &Context) {
        loop {
            let (expired, tunnel) = {
                let mut lot = self.lock();
                let now = lot.deadline(now);
                match lot.first_deadline() {
                    Some((deadline, seq)) if deadline <= now => (lot.remove(seq), lot.remove_tunnel(seq)),
                    _ => return,
                }
            };
            if let Some(parked) = expired {
                close_idle(parked, ctx);
            }
            if let Some(tunnel) = tunnel {
                tunnel.close_idle(ctx);
            }
        }
    }

    /// Closes up to `n` parked connections, longest idle first, counted as idle closes: the
    /// memory budget's first step. Returns how many.
    pub(crate) fn shed_longest_idle(&self, n: usize, ctx: &Context) -> usize {
        let shed: Vec<Parked> = {
            let mut lot = self.lock();
            std::iter::from_fn(|| lot.pop_first()).take(n).collect()
        };
        let count = shed.len();
        for parked in shed {
            close_idle(parked, ctx);
        }
        count
    }

    /// Closes every parked connection and parks no more (draining closes idle connections);
    /// parked tunnels go back to tasks, to live on as tunnels do while draining.
    fn close_all(&self, ctx: &Arc<Context>) {
        let (parked, tunnels) = {
            let mut lot = self.lock();
            lot.task = TaskState::Closed;
            lot.deadlines.clear();
            lot.counted.dec_by(lot.parked.len() as i64);
            let parked: Vec<Parked> = lot.parked.take_all().collect();
            let epoch = lot.epoch;
            let tunnels: Vec<_> = lot
                .tunnels
                .take_all()
                .map(|tunnel| (instant(epoch, tunnel.deadline), tunnel))
                .collect();
            (parked, tunnels)
        };
        for parked in parked {
            parked.close(ctx, false);
        }
        for (deadline, tunnel) in tunnels {
            if let Some(registry) = &self.registry {
                tunnel.deregister(registry);
            }
            tunnel.resume(deadline, false, ctx);
        }
    }

    fn earliest_deadline(&self) -> Option<Instant> {
        let mut lot = self.lock();
        lot.first_deadline().map(|(deadline, _)| lot.instant(deadline))
    }

    fn lock(&self) -> MutexGuard<'_, Lot> {
        self.lot.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Lot {
    /// Whether the caller is to start the task (it then counts as running).
    fn starts_task(&mut self) -> bool {
        let start = self.task == TaskState::NotStarted;
        if start {
            self.task = TaskState::Running;
        }
        start
    }

    fn insert(&mut self, seq: u64, parked: Parked) {
        self.deadlines.push(parked.deadline, seq);
        self.parked.push(seq, parked);
        self.counted.inc();
    }

    fn remove(&mut self, seq: u64) -> Option<Parked> {
        let parked = self.parked.remove(seq)?;
        self.counted.dec();
        self.taken();
        Some(parked)
    }

    fn remove_tunnel(&mut self, seq: u64) -> Option<ParkedTunnel> {
        let tunnel = self.tunnels.remove(seq)?;
        self.taken();
        Some(tunnel)
    }

    /// The earliest deadline of a record still parked, and its sequence number.
    fn first_deadline(&mut self) -> Option<(Deadline, u64)> {
        let Lot {
            parked,
            tunnels,
            deadlines,
            ..
        } = self;
        deadlines.first(|seq| parked.get(seq).is_some() || tunnels.get(seq).is_some())
    }

    /// After a record was taken: its deadline entry goes in time.
    fn taken(&mut self) {
        let Lot {
            parked,
            tunnels,
            deadlines,
            ..
        } = self;
        let live = parked.len() + tunnels.len();
        deadlines.taken(live, |seq| {
            parked.get(seq).is_some() || tunnels.get(seq).is_some()
        });
    }

    /// [`Lot::remove`], with the record's deadline as an instant.
    fn remove_with_instant(&mut self, seq: u64) -> Option<(Parked, Instant)> {
        let parked = self.remove(seq)?;
        let deadline = self.instant(parked.deadline);
        Some((parked, deadline))
    }

    fn pop_first(&mut self) -> Option<Parked> {
        let (_, parked) = self.parked.pop_first()?;
        self.counted.dec();
        self.taken();
        Some(parked)
    }

    /// `at` as a [`Deadline`]; an instant before the epoch (none is: deadlines lie ahead) as
    /// the epoch.
    fn deadline(&self, at: Instant) -> Deadline {
        at.saturating_duration_since(self.epoch)
            .as_nanos()
            .try_into()
            .unwrap_or(u64::MAX)
    }

    fn instant(&self, deadline: Deadline) -> Instant {
        instant(self.epoch, deadline)
    }
}

/// `deadline` as an instant, counted from `epoch`.
fn instant(epoch: Instant, deadline: Deadline) -> Instant {
    epoch + Duration::from_nanos(deadline)
}

/// Whether a request (or any byte) waits on a socket whose client shut down its side: a
/// client may send its last request and close its writing half at once.
fn has_bytes(fd: &OwnedFd) -> bool {
    // The socket is non-blocking (tokio's, converted); an error means nothing will come.
    matches!(super::stream::recv_peek(fd.as_raw_fd(), &mut [0u8; 1]), Ok(n) if n > 0)
}

fn token(seq: u64) -> Token {
    // Sequence numbers stay far below usize::MAX on the 64-bit targets this runs on.
    Token(seq as usize)
}

/// A parked connection on its way back to a task, but for its socket.
struct Woken {
    peer: Source,
    requests: u64,
    leaky: bool,
    /// The idle period's deadline, kept if the wake brought no request after all.
    deadline: Instant,
    held: Held,
    arrival: Arrival,
}

impl Woken {
    fn resume<S: Stream>(self, stream: io::Result<S>, ctx: &Arc<Context>) {
        let Woken {
            peer,
            requests,
            leaky,
            deadline,
            held,
            arrival,
        } = self;
        match stream {
            Ok(stream) => spawn_connection(
                Session::resume(stream, peer, requests, leaky, deadline),
                held,
                arrival,
                ctx.clone(),
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot resume a parked connection");
                ended(ctx, &peer, requests, false, held);
            }
        }
    }
}

/// Closes a connection that stayed idle too long or was evicted, counted as an idle close.
fn close_idle(parked: Parked, ctx: &Context) {
    ctx.count_idle_close(parked.tally.requests());
    parked.close(ctx, true);
}

impl Parked {
    fn close(self, ctx: &Context, idle_closed: bool) {
        let Parked {
            stream,
            tally,
            peer,
            held,
            ..
        } = self;
        drop(stream);
        ended(ctx, &peer.into(), tally.requests(), idle_closed, held);
    }
}

impl ParkedTunnel {
    /// Watches both sockets under one token: either readable wakes the tunnel.
    fn register(&self, registry: &mio::Registry, token: Token) -> io::Result<()> {
        let (client, upstream) = (self.client.as_raw_fd(), self.tunnel.upstream_fd().as_raw_fd());
        registry.register(&mut SourceFd(&client), token, mio::Interest::READABLE)?;
        registry
            .register(&mut SourceFd(&upstream), token, mio::Interest::READABLE)
            .inspect_err(|_| {
                let _ = registry.deregister(&mut SourceFd(&client));
            })
    }

    fn deregister(&self, registry: &mio::Registry) {
        let _ = registry.deregister(&mut SourceFd(&self.client.as_raw_fd()));
        let _ = registry.deregister(&mut SourceFd(&self.tunnel.upstream_fd().as_raw_fd()));
    }

    /// Back to a task, to splice on from its last move (`deadline` less the idle timeout);
    /// `parks`: whether that task may park it again.
    fn resume(self, deadline: Instant, parks: bool, ctx: &Arc<Context>) {
        let since = deadline
            .checked_sub(ctx.config.get().idle_timeout)
            .unwrap_or(deadline);
        let ends = TunnelEnds {
            served: self.served,
            held: self.held,
            peer: self.peer.into(),
        };
        let client = self.client;
        let tunnel = Resumed {
            tunnel: self.tunnel,
            since,
            parks,
            ends,
        };
        match tunnel.ends.peer {
            Source::Tcp(_) => tunnel.start(tokio::net::TcpStream::from_std(client.into()), ctx),
            Source::Unix(_) => tunnel.start(tokio::net::UnixStream::from_std(client.into()), ctx),
        }
    }

    /// Closes a tunnel whose idle timeout ran out while parked.
    fn close_idle(self, ctx: &Context) {
        drop(self.client);
        self.tunnel.close_idle();
        finish(ctx, &self.peer.into(), self.served, self.held);
    }
}

/// A parked tunnel on its way back to a task, but for its client socket.
struct Resumed {
    tunnel: Dormant,
    since: Instant,
    parks: bool,
    ends: TunnelEnds,
}

impl Resumed {
    fn start<S: Stream>(self, client: io::Result<S>, ctx: &Arc<Context>) {
        let woken = match client {
            Ok(client) => self.tunnel.wake().map(|tunnel| (client, tunnel)),
            Err(e) => Err(self.tunnel.close_failed(e)),
        };
        let ends = self.ends;
        match woken {
            Ok((client, tunnel)) => splice_apart(client, tunnel, self.since, self.parks, ends, ctx.clone()),
            Err(e) => {
                tracing::warn!(error = %e, "cannot resume a parked tunnel");
                finish(ctx, &ends.peer, ends.served, ends.held);
            }
        }
    }
}

/// The accounting for a connection that ends here rather than in its task.
fn ended(ctx: &Context, peer: &Source, requests: u64, idle_closed: bool, held: Held) {
    finish(
        ctx,
        peer,
        Served {
            requests,
            idle_closed,
        },
        held,
    );
}

/// The parking task: wakes readable connections, closes expired ones, and closes all of them
/// when draining starts.
async fn run(ctx: Arc<Context>) {
    let parking = &ctx.parking;
    let Some(poll) = parking.poll.lock().unwrap_or_else(|p| p.into_inner()).take() else {
        return;
    };
    // SAFETY: `mio::Poll` owns its epoll descriptor, keeps it open until dropped and always
    // reports the same one, which is all `register_with_interest` asks.
    #[allow(unsafe_code)]
    let registered = unsafe { AsyncFd::register_with_interest(poll, tokio::io::Interest::READABLE) };
    let mut poll = match registered {
        Ok(poll) => poll,
        Err(e) => {
            tracing::error!(error = %e, "cannot watch parked connections: closing them");
            return parking.close_all(&ctx);
        }
    };
    let mut events = Events::with_capacity(EVENTS);
    let mut drain = ctx.drain.clone();
    loop {
        let earliest = parking.earliest_deadline();
        tokio::select! {
            ready = poll.readable_mut() => {
                let woken = ready.and_then(|mut guard| {
                    let woken = parking.wake_ready(guard.get_inner_mut(), &mut events, &ctx);
                    guard.clear_ready();
                    woken
                });
                if let Err(e) = woken {
                    tracing::error!(error = %e, "cannot watch parked connections: closing them");
                    return parking.close_all(&ctx);
                }
            }
            () = tokio::time::sleep_until(earliest.unwrap_or_else(Instant::now)), if earliest.is_some() => {
                parking.expire(Instant::now(), &ctx);
            }
            () = parking.rearm.notified() => {}
            _ = drain.wait_for(|draining| *draining) => return parking.close_all(&ctx),
        }
    }
}

#[cfg(test)]
mod tests;
