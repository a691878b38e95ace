//! A single-producer, single-consumer byte ring in memory shared by two processes (shared
//! memory transport) or two threads (TCP helper threads, in a [`HeapRing`]).
//!
//! Layout of one ring (`RING_HEADER` bytes of control, then `cap` bytes of data, `cap` a power
//! of two): every control word sits on its own 128-byte line pair so that the producer's and
//! the consumer's writes never share a cache line (nor an adjacent-line prefetch pair).
//!
//! | offset | word | written by |
//! | --- | --- | --- |
//! | 0 | `tail`: bytes ever published | producer |
//! | 128 | `head`: bytes ever consumed | consumer |
//! | 256 | `reader_asleep`: the consumer is about to sleep waiting for data | consumer (set), producer (clear) |
//! | 384 | `writer_asleep`: the producer is about to sleep waiting for room | producer (set), consumer (clear) |
//! | 512 | `closed`: one side shut the link down | either |
//!
//! The producer copies bytes in, then publishes them with a release store of `tail`; the
//! consumer reads `tail` with acquire, reads the bytes, then frees them with a release store of
//! `head`. The producer caches `head` and rereads it only when the cache shows too little room,
//! so a steady stream costs a shared-line transfer per batch, not per byte; the consumer
//! rereads `tail` on every look, to take the largest batch there is. Large writes are
//! published in slices of [`PUBLISH_SLICE`] bytes so the consumer starts on the first slice
//! while the producer copies the next.
//!
//! Sleeping is the caller's business (see `shm.rs`): a side that wants to sleep sets its
//! `*_asleep` flag, then calls [`Consumer::readable`]/[`Producer::writable`] again after a
//! `SeqCst` fence; the other side, after publishing, fences and checks the flag. Either the
//! sleeper sees the new bytes or the other side sees the flag (Dekker), so no wake-up is lost.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// Control bytes in front of each ring's data (one page, so data is page-aligned).
pub const RING_HEADER: usize = 4096;
/// Bytes published at a time by a large write.
pub const PUBLISH_SLICE: usize = 64 << 10;

const TAIL: usize = 0;
const HEAD: usize = 128;
const READER_ASLEEP: usize = 256;
const WRITER_ASLEEP: usize = 384;
const CLOSED: usize = 512;

/// Total bytes one ring of `cap` data bytes occupies.
pub const fn ring_bytes(cap: usize) -> usize {
    RING_HEADER + cap
}

/// The shared part of one ring: a pointer to its header and capacity. Both ends hold one.
#[derive(Clone, Copy)]
struct Shared {
    base: *mut u8,
    cap: usize,
}

// SAFETY: `Shared` points into memory that both ends access only through atomics (control
// words) or under the publish/consume protocol (data), so moving it to another thread is fine.
unsafe impl Send for Shared {}

impl Shared {
    /// # Safety
    /// `base` must point to `ring_bytes(cap)` bytes, 128-byte aligned, valid for the lifetime of
    /// every end built on it; `cap` must be a power of two.
    unsafe fn new(base: *mut u8, cap: usize) -> Shared {
        debug_assert!(cap.is_power_of_two() && base as usize % 128 == 0);
        Shared { base, cap }
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is one of the 8-aligned control offsets inside the header (see `new`).
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as in `word64`.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header inside the same allocation.
        unsafe { self.base.add(RING_HEADER) }
    }

    fn closed(&self) -> bool {
        self.word32(CLOSED).load(Ordering::Acquire) != 0
    }

    /// Sets a sleep flag, then fences so that the caller's next look at the ring is ordered
    /// after it (the sleeper's half of the protocol).
    fn raise(&self, flag: usize) {
        self.word32(flag).store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// After a fence, whether a sleep flag was set; clears it (the waker's half: one wake-up
    /// per sleep).
    fn take(&self, flag: usize) -> bool {
        fence(Ordering::SeqCst);
        let f = self.word32(flag);
        f.load(Ordering::Relaxed) != 0 && f.swap(0, Ordering::AcqRel) != 0
    }

    fn close(&self) {
        self.word32(CLOSED).store(1, Ordering::Release);
    }
}

/// Clears a ring's control words (done once by whoever creates the memory, before sharing it).
///
/// # Safety
/// As [`Producer::new`]; no end may be in use yet.
pub unsafe fn init(base: *mut u8, cap: usize) {
    // SAFETY: forwarded from the caller.
    let s = unsafe { Shared::new(base, cap) };
    for off in [TAIL, HEAD] {
        s.word64(off).store(0, Ordering::Relaxed);
    }
    for off in [READER_ASLEEP, WRITER_ASLEEP, CLOSED] {
        s.word32(off).store(0, Ordering::Relaxed);
    }
    fence(Ordering::SeqCst);
}

/// One ring in heap memory, for two threads of one process (TCP helper threads).
pub struct HeapRing {
    ptr: *mut u8,
    layout: std::alloc::Layout,
    cap: usize,
}

// SAFETY: plain heap memory, accessed only through the ring protocol (atomics and the
// publish/consume discipline) by at most one producer and one consumer.
unsafe impl Send for HeapRing {}
// SAFETY: as above.
unsafe impl Sync for HeapRing {}

impl HeapRing {
    /// Allocates and initialises a ring of `cap` data bytes (`cap` a power of two).
    pub fn new(cap: usize) -> HeapRing {
        assert!(cap.is_power_of_two(), "ring capacity must be a power of two");
        let layout = std::alloc::Layout::from_size_align(ring_bytes(cap), 4096).expect("ring layout");
        // SAFETY: the size is non-zero (the header alone is a page).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: a fresh allocation of `ring_bytes(cap)` bytes, page-aligned, no end exists yet.
        unsafe { init(ptr, cap) };
        HeapRing { ptr, layout, cap }
    }

    /// Data bytes of the ring.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The ring's two ends.
    ///
    /// # Safety
    /// The ends must not outlive `self`, and at most one producer and one consumer may exist
    /// for this ring at any time.
    pub unsafe fn ends(&self) -> (Producer, Consumer) {
        // SAFETY: forwarded from the caller; the memory was initialised in `new`.
        unsafe { (Producer::new(self.ptr, self.cap), Consumer::new(self.ptr, self.cap)) }
    }
}

impl Drop for HeapRing {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// The writing end of a ring.
pub struct Producer {
    s: Shared,
    tail: u64,
    head_cache: u64,
}

/// The reading end of a ring.
pub struct Consumer {
    s: Shared,
    head: u64,
    tail_cache: u64,
}

impl Producer {
    /// The producer of the ring at `base`.
    ///
    /// # Safety
    /// `base` must point to `ring_bytes(cap)` bytes, 128-byte aligned and initialised with
    /// [`init`], that stay mapped while this end lives; `cap` must be a power of two; at most
    /// one producer and one consumer may exist per ring.
    pub unsafe fn new(base: *mut u8, cap: usize) -> Producer {
        // SAFETY: forwarded from the caller.
        let s = unsafe { Shared::new(base, cap) };
        let tail = s.word64(TAIL).load(Ordering::Acquire);
        Producer { s, tail, head_cache: s.word64(HEAD).load(Ordering::Acquire) }
    }

    /// Free bytes, at least `want` if that many are free (the consumer's index is reread only
    /// when the cached one shows less room than that).
    pub fn writable_for(&mut self, want: usize) -> usize {
        let free = self.s.cap - (self.tail - self.head_cache) as usize;
        if free >= want {
            return free;
        }
        self.head_cache = self.s.word64(HEAD).load(Ordering::Acquire);
        self.s.cap - (self.tail - self.head_cache) as usize
    }

    /// Free bytes (rereads the consumer's index).
    pub fn writable(&mut self) -> usize {
        self.writable_for(usize::MAX)
    }

    /// Copies as much of `buf` as fits and publishes it; returns the bytes taken.
    pub fn write(&mut self, buf: &[u8]) -> usize {
        let mut done = 0;
        while done < buf.len() {
            let free = self.writable_for((buf.len() - done).min(PUBLISH_SLICE));
            if free == 0 {
                break;
            }
            let n = free.min(buf.len() - done).min(PUBLISH_SLICE);
            let pos = (self.tail as usize) & (self.s.cap - 1);
            let first = n.min(self.s.cap - pos);
            // SAFETY: [pos, pos+first) and [0, n-first) lie in the data area and are free
            // (between tail and head + cap), so the consumer does not read them until `tail`
            // is published below, and nothing else of this end writes them while these
            // views live (this function holds `&mut self`); `buf` is a distinct slice.
            let (x, y) = unsafe {
                (
                    std::slice::from_raw_parts_mut(self.s.data().add(pos), first),
                    std::slice::from_raw_parts_mut(self.s.data(), n - first),
                )
            };
            super::copy::copy(x, &buf[done..done + first]);
            super::copy::copy(y, &buf[done + first..done + n]);
            self.tail += n as u64;
            self.s.word64(TAIL).store(self.tail, Ordering::Release);
            done += n;
        }
        done
    }

    /// Bytes ever published (the stream position of the next byte written).
    pub fn position(&self) -> u64 {
        self.tail
    }

    /// Whether the consumer announced it is going to sleep waiting for data; clears the flag
    /// (so one wake-up is sent per sleep). Call after publishing.
    pub fn take_reader_asleep(&self) -> bool {
        self.s.take(READER_ASLEEP)
    }

    /// Announces that this producer is going to sleep until there is room; returns the free
    /// bytes seen after the announcement (non-zero: do not sleep).
    pub fn announce_sleep(&mut self) -> usize {
        self.s.raise(WRITER_ASLEEP);
        self.head_cache = self.s.word64(HEAD).load(Ordering::Acquire);
        self.writable()
    }

    /// The free bytes from the write position up to the end of the data area (at most the
    /// free room), to be filled in place and then published with [`Producer::publish`]; empty
    /// when the ring is full.
    pub fn free_slice(&mut self) -> &mut [u8] {
        let free = self.writable();
        let pos = (self.tail as usize) & (self.s.cap - 1);
        let n = free.min(self.s.cap - pos);
        // SAFETY: [pos, pos+n) lies in the data area and is free (between tail and head + cap),
        // so the consumer does not read it until `publish` moves `tail` past it; the slice
        // borrows `self` mutably, so no other write of this end overlaps it.
        unsafe { std::slice::from_raw_parts_mut(self.s.data().add(pos), n) }
    }

    /// Publishes the first `n` bytes of the last [`Producer::free_slice`], filled in place.
    pub fn publish(&mut self, n: usize) {
        debug_assert!(n <= self.s.cap - (self.tail - self.head_cache) as usize);
        self.tail += n as u64;
        self.s.word64(TAIL).store(self.tail, Ordering::Release);
    }

    /// Whether either end closed the ring.
    pub fn closed(&self) -> bool {
        self.s.closed()
    }

    /// Marks the ring closed (the consumer fails once it has read what was published).
    pub fn close(&self) {
        self.s.close()
    }
}

impl Consumer {
    /// The consumer of the ring at `base`.
    ///
    /// # Safety
    /// As [`Producer::new`].
    pub unsafe fn new(base: *mut u8, cap: usize) -> Consumer {
        // SAFETY: forwarded from the caller.
        let s = unsafe { Shared::new(base, cap) };
        let head = s.word64(HEAD).load(Ordering::Acquire);
        Consumer { s, head, tail_cache: s.word64(TAIL).load(Ordering::Acquire) }
    }

    /// Published, unread bytes.
    pub fn readable(&mut self) -> usize {
        self.tail_cache = self.s.word64(TAIL).load(Ordering::Acquire);
        (self.tail_cache - self.head) as usize
    }

    /// The readable bytes, in order: up to the end of the data area, then (if they wrap) from
    /// its start. The second part is empty unless the readable bytes wrap around.
    pub fn peek(&mut self) -> (&[u8], &[u8]) {
        let avail = self.readable();
        let pos = (self.head as usize) & (self.s.cap - 1);
        let first = avail.min(self.s.cap - pos);
        // SAFETY: both ranges are published (acquire-loaded tail) and not reused by the
        // producer until `head` moves past them, which only `consume` (taking `&mut self`, so
        // after these borrows end) does.
        unsafe {
            (
                std::slice::from_raw_parts(self.s.data().add(pos), first),
                std::slice::from_raw_parts(self.s.data(), avail - first),
            )
        }
    }

    /// Frees the first `n` readable bytes (`n` at most what [`Consumer::readable`] reported).
    pub fn consume(&mut self, n: usize) {
        debug_assert!(n as u64 <= self.tail_cache - self.head);
        self.head += n as u64;
        self.s.word64(HEAD).store(self.head, Ordering::Release);
    }

    /// Copies up to `buf.len()` readable bytes out and frees them; returns the bytes read.
    pub fn read(&mut self, buf: &mut [u8]) -> usize {
        let (a, b) = self.peek();
        let na = a.len().min(buf.len());
        let nb = b.len().min(buf.len() - na);
        super::copy::copy(&mut buf[..na], &a[..na]);
        super::copy::copy(&mut buf[na..na + nb], &b[..nb]);
        self.consume(na + nb);
        na + nb
    }

    /// Bytes ever consumed (the stream position of the next byte read).
    pub fn position(&self) -> u64 {
        self.head
    }

    /// Whether the producer announced it is going to sleep waiting for room; clears the flag.
    /// Call after consuming.
    pub fn take_writer_asleep(&self) -> bool {
        self.s.take(WRITER_ASLEEP)
    }

    /// Announces that this consumer is going to sleep until data arrives; returns the readable
    /// bytes seen after the announcement (non-zero: do not sleep).
    pub fn announce_sleep(&mut self) -> usize {
        self.s.raise(READER_ASLEEP);
        self.tail_cache = self.s.word64(TAIL).load(Ordering::Acquire);
        self.readable()
    }

    /// Whether either end closed the ring.
    pub fn closed(&self) -> bool {
        self.s.closed()
    }

    /// Marks the ring closed.
    pub fn close(&self) {
        self.s.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_rank_chunk_cap_is_two_publication_slices() {
        assert_eq!(crate::algo::select::SHM_PAIR_CHUNK, 2 * PUBLISH_SLICE);
    }

    #[test]
    fn empty_full_and_wraparound() {
        let cap = 64;
        let mem = HeapRing::new(cap);
        // SAFETY: one producer and one consumer, dropped before `mem`.
        let (mut p, mut c) = unsafe { mem.ends() };
        assert_eq!(c.readable(), 0);
        assert_eq!(c.read(&mut [0u8; 8]), 0);
        assert_eq!(p.writable(), cap);
        let data: Vec<u8> = (0..200u8).collect();
        // Fill completely: a further write takes nothing.
        assert_eq!(p.write(&data[..100]), cap);
        assert_eq!(p.writable(), 0);
        assert_eq!(p.write(&data[64..]), 0);
        let mut out = [0u8; 40];
        assert_eq!(c.read(&mut out), 40);
        assert_eq!(&out[..], &data[..40]);
        // 40 bytes free again; this write wraps around the end of the data area.
        assert_eq!(p.write(&data[64..104]), 40);
        let (a, b) = c.peek();
        assert_eq!((a.len(), b.len()), (24, 40), "peek splits at the end of the data area");
        assert_eq!(b, &data[64..104]);
        let mut rest = vec![0u8; 64];
        assert_eq!(c.read(&mut rest), 64);
        assert_eq!(&rest[..24], &data[40..64]);
        assert_eq!(&rest[24..], &data[64..104]);
        assert_eq!(c.readable(), 0);
        // Many laps with odd sizes keep the stream intact.
        let mut sent = Vec::new();
        let mut got = Vec::new();
        let mut k = 0usize;
        while got.len() < 5000 {
            let len = 1 + (k * 7) % 61;
            let chunk: Vec<u8> = (0..len).map(|i| ((k * 31 + i) % 251) as u8).collect();
            let n = p.write(&chunk);
            sent.extend_from_slice(&chunk[..n]);
            let mut buf = vec![0u8; 1 + (k * 13) % 50];
            let m = c.read(&mut buf);
            got.extend_from_slice(&buf[..m]);
            k += 1;
        }
        let mut buf = vec![0u8; cap];
        let m = c.read(&mut buf);
        got.extend_from_slice(&buf[..m]);
        assert_eq!(got, sent);
    }

    #[test]
    fn sleep_flags_and_close() {
        let cap = 64;
        let mem = HeapRing::new(cap);
        // SAFETY: one producer and one consumer, dropped before `mem`.
        let (mut p, mut c) = unsafe { mem.ends() };
        assert!(!p.take_reader_asleep());
        assert_eq!(c.announce_sleep(), 0);
        assert_eq!(p.write(b"abc"), 3);
        assert!(p.take_reader_asleep(), "the producer sees the sleeping consumer");
        assert!(!p.take_reader_asleep(), "once per sleep");
        assert_eq!(c.announce_sleep(), 3, "data published before the announcement is seen");
        assert_eq!(p.write(&[0u8; 100]), 61);
        assert_eq!(p.announce_sleep(), 0);
        assert_eq!(c.read(&mut [0u8; 10]), 10);
        assert!(c.take_writer_asleep());
        assert!(!c.take_writer_asleep());
        assert!(!c.closed() && !p.closed());
        p.close();
        assert!(c.closed() && p.closed());
    }

    #[test]
    fn concurrent_stream_checksum() {
        let cap = 4096;
        let mem = HeapRing::new(cap);
        // SAFETY: one producer and one consumer, dropped before `mem`.
        let (mut p, mut c) = unsafe { mem.ends() };
        let total: usize = 8 << 20;
        let byte = |i: usize| (i.wrapping_mul(2654435761) >> 7) as u8;
        let mut want = 0u64;
        for i in 0..total {
            want = want.wrapping_mul(31).wrapping_add(u64::from(byte(i)));
        }
        let got = std::thread::scope(|s| {
            s.spawn(move || {
                let mut sent = 0;
                let mut k = 0;
                while sent < total {
                    // Sizes vary from 1 byte to several laps of the ring.
                    let len = [1, 3, 64, 1000, 5000, 20000][k % 6].min(total - sent);
                    let chunk: Vec<u8> = (sent..sent + len).map(byte).collect();
                    let mut off = 0;
                    while off < len {
                        off += p.write(&chunk[off..]);
                        std::hint::spin_loop();
                    }
                    sent += len;
                    k += 1;
                }
            });
            let r = s.spawn(move || {
                let mut sum = 0u64;
                let mut n = 0;
                let mut k = 0;
                while n < total {
                    if k % 2 == 0 {
                        let mut buf = vec![0u8; [7, 333, 4096, 9000][k % 4]];
                        let m = c.read(&mut buf);
                        for &b in &buf[..m] {
                            sum = sum.wrapping_mul(31).wrapping_add(u64::from(b));
                        }
                        n += m;
                    } else {
                        let m = {
                            let (x, y) = c.peek();
                            for &b in x.iter().chain(y) {
                                sum = sum.wrapping_mul(31).wrapping_add(u64::from(b));
                            }
                            x.len() + y.len()
                        };
                        c.consume(m);
                        n += m;
                    }
                    k += 1;
                }
                sum
            });
            r.join().unwrap()
        });
        assert_eq!(got, want);
    }
}
