//! Read buffers kept between exchanges, a few per thread, so that neither an idle downstream
//! connection nor an idle pooled upstream connection holds one.
//!
//! Freeing a connection's buffer after every exchange keeps idle connections small, but the
//! sizes involved (2 KiB for a request head, 16 KiB for an upstream read) are past what
//! glibc's per-thread cache serves, so each exchange paid for a malloc and a free through its
//! slow paths: callgrind counted about 740 instructions per request for the upstream buffer
//! alone. The next exchange on the thread takes a kept buffer instead. A buffer given back may
//! still share its memory with the last response's head; `BytesMut::reserve` reuses it from
//! the start once that is gone, or allocates anew if it is not.

use std::cell::RefCell;
use std::thread::LocalKey;

use bytes::BytesMut;

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
}

/// Downstream connections' read buffers (request heads and bodies).
pub static DOWNSTREAM: Spares = Spares {
    kept: &REQUEST_HEADS,
    per_thread: 8,
    largest: 8 * 1024,
};

/// Pooled HTTP/1.1 upstream connections' read buffers.
pub static UPSTREAM: Spares = Spares {
    kept: &UPSTREAM_READS,
    per_thread: 4,
    largest: 32 * 1024,
};

impl Spares {
    /// A kept buffer, or an empty one (which allocates on first use).
    pub fn take(&self) -> BytesMut {
        self.kept
            .try_with(|kept| kept.borrow_mut().pop())
            .ok()
            .flatten()
            .unwrap_or_default()
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
        let _ = self.kept.try_with(|kept| {
            let mut kept = kept.borrow_mut();
            if kept.len() < self.per_thread {
                kept.push(buf);
            }
        });
    }

    /// Buffers this thread keeps now.
    pub fn kept(&self) -> usize {
        self.kept.try_with(|kept| kept.borrow().len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use bytes::Buf;

    use super::*;

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
        for _ in 0..6 {
            UPSTREAM.give_back(BytesMut::with_capacity(16 * 1024));
        }
        assert_eq!(UPSTREAM.kept(), 4, "a burst leaves at most four");
        assert_eq!(DOWNSTREAM.kept(), 0, "each kind keeps its own");
        let taken: Vec<BytesMut> = (0..6).map(|_| UPSTREAM.take()).collect();
        assert_eq!(taken.iter().filter(|b| b.capacity() >= 16 * 1024).count(), 4);
        assert_eq!(UPSTREAM.kept(), 0);
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
}
