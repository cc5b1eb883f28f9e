//! Read buffers, header maps and write buffers kept between exchanges, a few per thread, so
//! that neither an idle downstream connection nor an idle pooled upstream connection holds
//! one, and a request does not allocate what the last one freed.
//!
//! Freeing a connection's buffer after every exchange keeps idle connections small, but the
//! sizes involved (2 KiB for a request head, 16 KiB for an upstream read) are past what
//! glibc's per-thread cache serves, so each exchange paid for a malloc and a free through its
//! slow paths: callgrind counted about 740 instructions per request for the upstream buffer
//! alone. The next exchange on the thread takes a kept buffer instead. A buffer given back may
//! still share its memory with the last response's head; `BytesMut::reserve` reuses it from
//! the start once that is gone, or allocates anew if it is not.
//!
//! A thread keeps as many as a busy pool has exchanges in flight (64 of each kind), so that
//! 64 keep-alive connections allocate nothing per request. That holds on one worker thread
//! (`current_thread` runtime), where every value given back returns to the thread that takes
//! the next. On several, values drift to the threads that give them back: each thread there
//! keeps at most [`STEADY_KEPT`] (two threads: 50-100 B more per idle client connection
//! with 64, `benches/RESULTS.md`).
//!
//! Every heap trim (every few seconds) asks each thread to release what it keeps
//! ([`release_surplus`]): a thread that took a kept value since the last ask keeps
//! [`STEADY_KEPT`] of each kind, what steady light traffic needs; one that took none keeps
//! none, so that a quiet sidecar holds no buffers (two threads' worth was about 0.6 MiB of heap,
//! and the pages it pinned, after a burst of idle connections or of hosts met once). Only a
//! thread can reach what it keeps: each answers when it next parks ([`release_if_asked`], the
//! runtime's `on_thread_park`), and the ask wakes the parked workers (see [`release_surplus`]).

use std::cell::{Cell, RefCell};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::LocalKey;

use bytes::BytesMut;
use http::HeaderMap;

/// One kind of buffer, kept per thread.
#[derive(Debug)]
pub struct Spares {
    kept: &'static LocalKey<RefCell<Vec<BytesMut>>>,
    /// At most this many kept per thread: what a burst leaves behind.
    per_thread: usize,
    /// A buffer that, reclaimed, would hold more (grown for a rare large head or a body) is
    /// freed, not kept. One whose memory something else still shares (the response head being
    /// written) cannot be reclaimed and is judged by the room it has left: the reads that
    /// filled it bound the allocation behind it (an upstream head is at most 64 KiB, read
    /// 16 KiB at a time).
    largest: usize,
}

thread_local! {
    static REQUEST_HEADS: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
    static UPSTREAM_READS: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
    static HEADER_MAPS: RefCell<Vec<HeaderMap>> = const { RefCell::new(Vec::new()) };
    static WRITE_BUFS: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
    /// This thread's cap on each kind, worked out at its first keep (0: not yet; see the
    /// module doc).
    static CAP: Cell<usize> = const { Cell::new(0) };
    /// The last ask to release ([`ASKED`]) this thread answered.
    static ANSWERED: Cell<u64> = const { Cell::new(0) };
    /// Whether this thread asked for a kept value since it last answered.
    static TOOK: Cell<bool> = const { Cell::new(false) };
}

/// Asks to release, counted: each thread answers an ask once.
static ASKED: AtomicU64 = AtomicU64::new(0);

/// What a thread that took kept values since the last trim keeps of each kind once it has
/// answered the trim's ask: what steady light traffic needs, and the most the sidecar kept
/// before the caps were raised to 64.
pub const STEADY_KEPT: usize = 16;

/// Asks every thread to release what it keeps (see the module doc), answers on this thread,
/// and wakes the runtime's other workers so that they answer too. The periodic heap trim calls
/// it before trimming; what the other threads free goes at the next trim. Under a steady load,
/// the next exchanges allocate again what went (a few dozen mallocs every few seconds).
pub fn release_surplus() {
    ASKED.fetch_add(1, Ordering::Relaxed);
    release_if_asked();
    wake_workers();
}

/// Answers an ask to release (once each), on this thread: keeps [`STEADY_KEPT`] of each
/// kind if it asked for a kept value since it last answered, else none. The runtime's
/// `on_thread_park` hook: cheap when there is nothing to answer (a load and a compare).
pub fn release_if_asked() {
    let asked = ASKED.load(Ordering::Relaxed);
    let Ok(answered) = ANSWERED.try_with(|answered| answered.replace(asked)) else {
        return;
    };
    if answered == asked {
        return;
    }
    let busy = TOOK.try_with(|took| took.replace(false)).unwrap_or(false);
    let keep = if busy { STEADY_KEPT } else { 0 };
    truncate(&REQUEST_HEADS, keep);
    truncate(&UPSTREAM_READS, keep);
    truncate(&HEADER_MAPS, keep);
    truncate(&WRITE_BUFS, keep);
}

/// Frees what this thread keeps of one kind beyond `keep`.
fn truncate<T: 'static>(kept: &'static LocalKey<RefCell<Vec<T>>>, keep: usize) {
    let surplus = kept
        .try_with(|kept| {
            let mut kept = kept.borrow_mut();
            if keep == 0 {
                // The list's room goes too: a quiet thread holds nothing. (`split_off(0)`
                // would allocate the list a new room of the same size.)
                std::mem::take(&mut *kept)
            } else {
                let floor = keep.min(kept.len());
                kept.split_off(floor)
            }
        })
        .unwrap_or_default();
    // Freed once the borrow has ended.
    drop(surplus);
}

/// Wakes the runtime's parked workers, so that each parks again and answers the ask. A worker
/// with nothing to run stays parked (none wakes for a timer: one worker waits on the timers
/// and sockets for all; on tokio 1.54 the other of two did not wake in 8 s of timers), so
/// one empty task per worker is spawned: tokio wakes a parked worker
/// to steal when a second task is queued behind the one a worker runs next. Outside a
/// multi-threaded runtime there is no one else to wake.
fn wake_workers() {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
        return;
    }
    for _ in 0..runtime.metrics().num_workers() {
        runtime.spawn(async {});
    }
}

/// One kept value of this thread's, if it has one.
fn pop<T: 'static>(kept: &'static LocalKey<RefCell<Vec<T>>>) -> Option<T> {
    let _ = TOOK.try_with(|took| took.set(true));
    kept.try_with(|kept| kept.borrow_mut().pop()).ok().flatten()
}

/// Keeps `value` for this thread unless it keeps `most` already (or is exiting).
fn keep<T: 'static>(kept: &'static LocalKey<RefCell<Vec<T>>>, value: T, most: usize) {
    let most = most.min(thread_cap());
    let _ = kept.try_with(|kept| {
        let mut kept = kept.borrow_mut();
        if kept.len() < most {
            kept.push(value);
        }
    });
}

/// How many of a kind this thread may keep: any number on a `current_thread` runtime's thread
/// (or outside a runtime), [`STEADY_KEPT`] on a multi-threaded runtime's worker.
///
/// Inlined, with the first look at the runtime out of line: every take and give-back asks.
#[inline]
fn thread_cap() -> usize {
    CAP.try_with(|cap| match cap.get() {
        0 => learn_thread_cap(cap),
        known => known,
    })
    .unwrap_or(STEADY_KEPT)
}

#[cold]
#[inline(never)]
fn learn_thread_cap(cap: &Cell<usize>) -> usize {
    let several = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread);
    cap.set(if several { STEADY_KEPT } else { usize::MAX });
    cap.get()
}

/// Header maps kept per thread. Each request parses two (its own head and the upstream's
/// response head), and each map is two allocations; with tens of requests in flight on a
/// thread, glibc's per-thread cache (7 chunks per size) overflows and each of those four
/// mallocs and frees took its slow path (~100 instructions each at 64 connections, callgrind).
/// Sixty-four, a thread's share of a busy pool's exchanges: with 16, at 64 keep-alive
/// connections 43-69% of the maps were still made anew (callgrind's call counts).
const HEADER_MAPS_PER_THREAD: usize = 64;
/// A map whose table grew past this many fields (a rare large head) is freed, not kept.
const HEADER_MAP_LARGEST: usize = 64;

/// An empty header map with room for `fields`: a kept one if the thread has one.
pub fn header_map(fields: usize) -> HeaderMap {
    match pop(&HEADER_MAPS) {
        Some(mut map) => {
            map.reserve(fields);
            map
        }
        None => HeaderMap::with_capacity(fields),
    }
}

/// Keeps `map`, emptied, for the next head parsed on this thread, unless it is too large or
/// enough are kept. Its values go now (they may share a head's bytes).
pub fn give_back_headers(mut map: HeaderMap) {
    if map.capacity() == 0 {
        // One an HTTP/2 upstream emptied (it takes the fields): nothing to keep or free.
        return forget_empty(map);
    }
    if map.capacity() > HEADER_MAP_LARGEST {
        return;
    }
    map.clear();
    keep(&HEADER_MAPS, map, HEADER_MAPS_PER_THREAD);
}

/// Puts `map` in `slot`: a head's map, still the empty one `Request::new` or `Response::new`
/// made.
///
/// An empty map holds no memory, yet dropping it ran the destructors of its three fields (61
/// instructions, for each request and each response); see [`forget_empty`].
pub fn set_headers(slot: &mut HeaderMap, map: HeaderMap) {
    forget_empty(std::mem::replace(slot, map));
}

/// Drops `map`, or, if it has no room, forgets it: a map that never grew its table holds no
/// memory (`HeaderMap::new`, which `Request::new` and `Response::new` use, does not allocate:
/// its documentation says so), so there is nothing to free.
fn forget_empty(map: HeaderMap) {
    if map.capacity() == 0 {
        std::mem::forget(map);
    }
}

/// Bytes encoded for writing: a request head going up, or a response head going down with
/// the small body frames coalesced behind it. Taken from the thread's kept buffers, and given
/// back when dropped, whichever way the exchange ends.
///
/// Each request encoded two heads into fresh vectors. With 8 requests in flight on a thread,
/// glibc's per-thread cache (7 chunks per size) ran out and their frees took the slow path
/// (callgrind).
#[derive(Debug, Default)]
pub struct WriteBuf(Vec<u8>);

/// Write buffers kept per thread: as many as header maps, for the same reason (with 16, 68% of
/// the exchanges at 64 connections allocated one, on the profile-guided build).
const WRITE_BUFS_PER_THREAD: usize = 64;
/// A write buffer grown past this (a large head, or body bytes coalesced) is freed, not kept:
/// a thread keeps at most 256 KiB of them, and most hold one head (a few hundred bytes).
const WRITE_BUF_LARGEST: usize = 4096;

impl WriteBuf {
    /// An empty buffer with room for `capacity` bytes: a kept one if the thread has one.
    pub fn take(capacity: usize) -> WriteBuf {
        let mut buf = pop(&WRITE_BUFS).unwrap_or_default();
        buf.reserve(capacity);
        WriteBuf(buf)
    }
}

impl Deref for WriteBuf {
    type Target = Vec<u8>;

    fn deref(&self) -> &Vec<u8> {
        &self.0
    }
}

impl DerefMut for WriteBuf {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }
}

impl Drop for WriteBuf {
    fn drop(&mut self) {
        let capacity = self.0.capacity();
        if capacity == 0 || capacity > WRITE_BUF_LARGEST {
            return;
        }
        let mut buf = std::mem::take(&mut self.0);
        buf.clear();
        keep(&WRITE_BUFS, buf, WRITE_BUFS_PER_THREAD);
    }
}

/// Downstream connections' read buffers (request heads and bodies).
pub static DOWNSTREAM: Spares = Spares {
    kept: &REQUEST_HEADS,
    per_thread: 8,
    largest: 8 * 1024,
};

/// Pooled HTTP/1.1 upstream connections' read buffers. With four, at 8 requests in flight on
/// a thread about half the exchanges found none and allocated 16 KiB (and freed one at their
/// end): 281 instructions per request at 8 connections, 761 at 64 (callgrind). With sixteen,
/// at 64 connections 55-69% of the exchanges still did, through malloc's slow path (290
/// instructions for the malloc alone). What a thread keeps after a burst is at most 64 x
/// `largest` (2 MiB), 1 MiB when the buffers are as allocated, until [`release_surplus`]
/// leaves 16 (256 KiB).
pub static UPSTREAM: Spares = Spares {
    kept: &UPSTREAM_READS,
    per_thread: 64,
    largest: 32 * 1024,
};

impl Spares {
    /// A kept buffer, or an empty one (which allocates on first use).
    pub fn take(&self) -> BytesMut {
        pop(self.kept).unwrap_or_default()
    }

    /// Keeps `buf`, emptied, for the next exchange on this thread, unless it is too large or
    /// enough are kept.
    pub fn give_back(&self, mut buf: BytesMut) {
        buf.clear();
        // `capacity` is the room after the buffer's start, which reads have moved on: reclaim
        // the whole allocation (when nothing else shares it) before judging its size.
        if buf.capacity() == 0 || buf.try_reclaim(self.largest + 1) {
            return;
        }
        keep(self.kept, buf, self.per_thread);
    }

    /// Buffers this thread keeps now.
    pub fn kept(&self) -> usize {
        self.kept.try_with(|kept| kept.borrow().len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Buf;

    use super::*;

    /// Only a map that holds no memory is forgotten: one with values is dropped, and its
    /// values with it.
    #[test]
    fn only_a_map_of_no_capacity_is_forgotten() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;

        struct Owner(Arc<AtomicBool>);
        impl AsRef<[u8]> for Owner {
            fn as_ref(&self) -> &[u8] {
                b"value"
            }
        }
        impl Drop for Owner {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }

        let dropped = Arc::new(AtomicBool::new(false));
        let value = bytes::Bytes::from_owner(Owner(dropped.clone()));
        let mut map = HeaderMap::new();
        map.insert("x-owned", http::HeaderValue::from_maybe_shared(value).unwrap());
        let mut req = http::Request::new(());
        assert_eq!(
            req.headers().capacity(),
            0,
            "what set_headers replaces holds nothing"
        );
        set_headers(req.headers_mut(), map);
        assert_eq!(req.headers()["x-owned"], "value");
        assert!(!dropped.load(Ordering::SeqCst));
        forget_empty(std::mem::take(req.headers_mut()));
        assert!(dropped.load(Ordering::SeqCst), "a map with values is dropped");
    }

    #[test]
    fn a_thread_keeps_a_few_buffers_and_no_empty_or_large_ones() {
        UPSTREAM.give_back(BytesMut::new());
        assert_eq!(UPSTREAM.kept(), 0, "nothing allocated, nothing kept");
        UPSTREAM.give_back(BytesMut::with_capacity(UPSTREAM.largest + 1));
        assert_eq!(UPSTREAM.kept(), 0, "a grown buffer is freed");
        let mut consumed = BytesMut::with_capacity(UPSTREAM.largest * 2);
        consumed.extend_from_slice(&vec![b'x'; UPSTREAM.largest * 2 - 100]);
        consumed.advance(UPSTREAM.largest * 2 - 100);
        assert!(consumed.capacity() <= 100, "only the room left shows");
        UPSTREAM.give_back(consumed);
        assert_eq!(UPSTREAM.kept(), 0, "judged by its whole allocation");
        for _ in 0..UPSTREAM.per_thread + 2 {
            UPSTREAM.give_back(BytesMut::with_capacity(16 * 1024));
        }
        assert_eq!(
            UPSTREAM.kept(),
            UPSTREAM.per_thread,
            "a burst leaves at most per_thread"
        );
        assert_eq!(DOWNSTREAM.kept(), 0, "each kind keeps its own");
        let taken: Vec<BytesMut> = (0..UPSTREAM.per_thread + 2).map(|_| UPSTREAM.take()).collect();
        let kept = taken.iter().filter(|b| b.capacity() >= 16 * 1024).count();
        assert_eq!(kept, UPSTREAM.per_thread);
        assert_eq!(UPSTREAM.kept(), 0);
    }

    #[test]
    fn the_surplus_of_a_burst_goes_and_the_rest_stays() {
        for _ in 0..UPSTREAM.per_thread {
            UPSTREAM.give_back(BytesMut::with_capacity(16 * 1024));
        }
        let maps: Vec<HeaderMap> = (0..HEADER_MAPS_PER_THREAD)
            .map(|_| HeaderMap::with_capacity(4))
            .collect();
        maps.into_iter().for_each(give_back_headers);
        for _ in 0..WRITE_BUFS_PER_THREAD {
            drop(WriteBuf(Vec::with_capacity(256)));
        }
        DOWNSTREAM.give_back(BytesMut::with_capacity(2048));
        let counts = || {
            (
                UPSTREAM.kept(),
                HEADER_MAPS.with(|kept| kept.borrow().len()),
                WRITE_BUFS.with(|kept| kept.borrow().len()),
                DOWNSTREAM.kept(),
            )
        };
        assert_eq!(counts(), (64, 64, 64, 1), "a burst's worth kept");
        give_back_headers(header_map(4));
        release_surplus();
        assert_eq!(
            counts(),
            (STEADY_KEPT, STEADY_KEPT, STEADY_KEPT, 1),
            "a thread that took one since the last trim keeps what steady light traffic needs"
        );
        UPSTREAM.give_back(UPSTREAM.take());
        release_surplus();
        assert_eq!(counts(), (STEADY_KEPT, STEADY_KEPT, STEADY_KEPT, 1));
        release_surplus();
        assert_eq!(counts(), (0, 0, 0, 0), "a quiet thread keeps none");
        let room = UPSTREAM_READS.with(|kept| kept.borrow().capacity());
        assert_eq!(room, 0, "nor the room to keep them");
    }

    /// A worker that is parked when the trim asks answers too: the runtime's other workers
    /// are woken, and each releases what it keeps when it parks again.
    #[test]
    fn a_parked_worker_releases_what_it_keeps() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .on_thread_park(release_if_asked)
            .build()
            .unwrap();
        runtime.block_on(async {
            let (giver, kept) = tokio::spawn(async {
                for _ in 0..STEADY_KEPT {
                    UPSTREAM.give_back(BytesMut::with_capacity(1024));
                }
                (std::thread::current().id(), UPSTREAM.kept())
            })
            .await
            .unwrap();
            assert_eq!(kept, STEADY_KEPT);
            // The ask, once the giver has parked with nothing to do (no timer or socket wakes
            // it here), from outside the workers: only the wake reaches it.
            std::thread::sleep(Duration::from_millis(100));
            release_surplus();
            // Not the runtime's timer, which would wake the worker that waits on it.
            std::thread::sleep(Duration::from_millis(500));
            let mut seen = None;
            for _ in 0..1000 {
                let probe =
                    tokio::spawn(
                        async move { (std::thread::current().id() == giver).then(|| UPSTREAM.kept()) },
                    );
                if let Some(kept) = probe.await.unwrap() {
                    seen = Some(kept);
                    break;
                }
            }
            assert_eq!(seen, Some(0), "the giver, quiet, released all it kept");
        });
    }

    /// A multi-threaded runtime's worker keeps the steady count at most: values drift between
    /// its threads.
    #[test]
    fn a_worker_of_several_keeps_only_the_steady_count() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        let kept = runtime.block_on(async {
            tokio::spawn(async {
                for _ in 0..STEADY_KEPT * 2 {
                    UPSTREAM.give_back(BytesMut::with_capacity(1024));
                }
                UPSTREAM.kept()
            })
            .await
            .unwrap()
        });
        assert_eq!(kept, STEADY_KEPT);
    }

    #[test]
    fn a_header_map_comes_back_empty_and_large_ones_are_not_kept() {
        // Larger than a new map for 4 fields would be: telling the kept one from a new one.
        let mut map = header_map(32);
        map.insert("x-one", "1".parse().unwrap());
        let room = map.capacity();
        assert!(room > HeaderMap::<http::HeaderValue>::with_capacity(4).capacity());
        give_back_headers(map);
        let again = header_map(4);
        assert!(again.is_empty(), "emptied");
        assert_eq!(again.capacity(), room, "the same table, not a new one");
        give_back_headers(HeaderMap::with_capacity(HEADER_MAP_LARGEST * 2));
        assert_eq!(
            HEADER_MAPS.with(|kept| kept.borrow().len()),
            0,
            "a grown map is freed"
        );
    }

    #[test]
    fn a_buffer_comes_back_empty() {
        let mut buf = BytesMut::with_capacity(2048);
        buf.extend_from_slice(b"left over");
        DOWNSTREAM.give_back(buf);
        let again = DOWNSTREAM.take();
        assert!(again.is_empty());
        assert!(again.capacity() >= 2048);
    }

    #[test]
    fn a_write_buffer_is_kept_when_dropped_unless_grown() {
        let kept = || WRITE_BUFS.with(|kept| kept.borrow().len());
        let before = kept();
        let mut buf = WriteBuf::take(512);
        assert!(buf.capacity() >= 512);
        buf.extend_from_slice(b"HTTP/1.1 200 OK\r\n\r\n");
        let at = buf.as_ptr();
        drop(buf);
        assert_eq!(kept(), before + 1);
        let again = WriteBuf::take(256);
        assert!(again.is_empty(), "kept empty");
        assert_eq!(again.as_ptr(), at, "the same memory again");
        drop(again);
        let mut grown = WriteBuf::take(512);
        grown.extend_from_slice(&[0; WRITE_BUF_LARGEST + 1]);
        drop(grown);
        assert_eq!(kept(), before, "taken twice, kept once: the grown one was freed");
    }
}
