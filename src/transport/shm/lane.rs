//! The small-message lane of a shared-memory link: one message per operation each way, in
//! slots that the receiver polls, for the small all-reduce path (`crate::engine::lane`).
//!
//! The ring (`super::super::ring`) moves a message with three shared-line transfers at least:
//! the data, the producer's `tail` and the consumer's `head`, plus the sleep-flag checks. A
//! lane message is one slot whose sequence word is written last, in the same cache line as
//! the message's header and first 40 bytes: an 8-byte all-reduce costs one line transfer each
//! way, which is what Open MPI's shared-memory "fast boxes" achieve.
//!
//! **Layout** (one 4 KiB page per direction, after the segment's header page): two 1 KiB
//! slots, then the reader's sleep word on its own line.
//!
//! | slot offset | field |
//! | --- | --- |
//! | 0 | `seq` (u32): the operation number this slot holds, stored last (release) |
//! | 4 | payload length (u32) |
//! | 8 | collective tag, type, operator (u8 each), reserved |
//! | 12 | reserved (u32) |
//! | 16 | count argument (u64) |
//! | 24 | payload, up to [`MAX`] bytes |
//!
//! **Why two slots suffice.** Operation `k` uses slot `k mod 2`. A sender writes slot `k mod 2`
//! during its operation `k`, after it completed operation `k - 1`, which needed the peer's lane
//! message of `k - 1`; the peer posted that after completing its own operation `k - 2`,
//! including the read of this side's message `k - 2` from the same slot. So a slot is never
//! overwritten before it was read, with no acknowledgement traffic (the lane is used only by
//! exchanges where each operation sends one message each way on the pair).
//!
//! **Notice.** A rank that will send a partner its message only in a later round (after
//! earlier partners answered) first writes a *notice* of the call on that partner's page (the
//! header alone, with the operation number it will use). A partner that runs another
//! operation and waits for this rank there finds the notice and reports the mismatch, instead
//! of waiting for a message that comes only after ranks stuck elsewhere answer.
//!
//! **Sleeping.** A reader that gave up spinning raises its sleep word, looks at `seq` again and
//! sleeps in `futex(2)` on `seq` (the segment is a shared mapping, so the futex is shared by
//! both processes); a sender stores `seq` with a sequentially consistent exchange, then reads
//! the sleep word and wakes the reader when it is raised (Dekker: one of the two sees the
//! other's store). The wait is bounded so that the caller can look for a dead peer.

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

/// Bytes of the lane region in a segment (one page per direction).
pub const BYTES: usize = 2 * DIR;
/// Bytes of one direction's page.
pub(super) const DIR: usize = 4096;
/// Bytes of one slot.
const SLOT: usize = 1024;
/// Offset of the payload in a slot.
const PAYLOAD: usize = 24;
/// Largest payload of a lane message.
pub const MAX: usize = SLOT - PAYLOAD;
/// Offset in a direction's page of its reader's sleep word.
const SLEEP: usize = 2 * SLOT;
/// Offset in a direction's page of the writer's notice of its next operation (a header as in a
/// slot, without payload), on its own line.
const NOTICE: usize = SLEEP + 128;

/// What a lane message says about the call that sent it, compared by the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Stamp {
    /// Collective tag (`crate::mismatch`'s).
    pub tag: u8,
    /// `ncclDataType_t` value.
    pub dtype: u8,
    /// `ncclRedOp_t` value.
    pub op: u8,
    /// Payload bytes.
    pub len: u32,
    /// Count argument of the call.
    pub count: u64,
}

impl Stamp {
    /// The stamp as the 24-byte header of a message (also the stream form, `crate::engine::lane`),
    /// with `seq` in front.
    pub fn encode(&self, seq: u32) -> [u8; PAYLOAD] {
        let mut h = [0u8; PAYLOAD];
        h[0..4].copy_from_slice(&seq.to_le_bytes());
        h[4..8].copy_from_slice(&self.len.to_le_bytes());
        h[8] = self.tag;
        h[9] = self.dtype;
        h[10] = self.op;
        h[12..16].copy_from_slice(&STREAM_MAGIC.to_le_bytes());
        h[16..24].copy_from_slice(&self.count.to_le_bytes());
        h
    }

    /// Decodes [`Stamp::encode`]'s header: `(seq, stamp)`, or `None` when the magic is wrong.
    pub fn decode(h: &[u8; PAYLOAD]) -> Option<(u32, Stamp)> {
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        if u32_at(12) != STREAM_MAGIC {
            return None;
        }
        let count = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
        Some((u32_at(0), Stamp { tag: h[8], dtype: h[9], op: h[10], len: u32_at(4), count }))
    }
}

/// Bytes of a message header.
pub const HEADER: usize = PAYLOAD;
/// Marks a lane header ("OXLN").
const STREAM_MAGIC: u32 = 0x4e4c_584f;

/// One end's view of a link's lane: the page it writes and the page it reads.
pub struct Lane {
    tx: *mut u8,
    rx: *mut u8,
    /// Operations this end has sent on the lane (the number of the last one).
    seq: u32,
}

// SAFETY: the pages belong to the link's segment, which outlives the lane (same owner); they
// are accessed through atomics (sequence and sleep words) or under the slot protocol above.
unsafe impl Send for Lane {}

/// The 32-bit word at `p`, atomically accessed.
///
/// # Safety
/// `p` must be a 4-byte aligned word inside a lane page of a mapping that outlives `'a`.
unsafe fn word<'a>(p: *mut u8) -> &'a AtomicU32 {
    // SAFETY: the caller's contract; other processes access the word only atomically too.
    unsafe { AtomicU32::from_ptr(p.cast()) }
}

impl Lane {
    /// A lane writing the page at `tx` and reading the one at `rx`.
    ///
    /// # Safety
    /// Both must point to zero-initialised (or lane-written), page-aligned `DIR`-byte pages of
    /// a shared mapping that outlives the lane; exactly one lane writes each page.
    pub(super) unsafe fn new(tx: *mut u8, rx: *mut u8) -> Lane {
        Lane { tx, rx, seq: 0 }
    }

    /// The number of the next operation on this lane (the current one after [`Lane::post`]).
    pub fn next_seq(&self) -> u32 {
        self.seq.wrapping_add(1)
    }

    /// Sends the message of this end's next operation: `stamp` and `payload` (at most [`MAX`]
    /// bytes, `stamp.len` of them), then wakes the reader if it sleeps. Returns its number.
    pub fn post(&mut self, stamp: &Stamp, payload: &[u8]) -> u32 {
        assert!(payload.len() <= MAX && payload.len() == stamp.len as usize, "lane message too long");
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let slot = self.slot(self.tx, seq);
        let head = stamp.encode(seq);
        // SAFETY: the slot is inside this end's page (`new`), which the reader does not touch
        // until it sees `seq` (below), and has finished reading since operation `seq - 2` (see
        // the module docs). Header (but the sequence word) and payload fit in the slot.
        unsafe {
            std::ptr::copy_nonoverlapping(head.as_ptr().add(4), slot.add(4), PAYLOAD - 4);
            std::ptr::copy_nonoverlapping(payload.as_ptr(), slot.add(PAYLOAD), payload.len());
        }
        // SAFETY: the sequence word of the slot, and the sleep word of the page this end
        // writes, lie in the page (`new`), which outlives `self`.
        let (w, sleeping) = unsafe { (word(slot), word(self.tx.add(SLEEP))) };
        w.swap(seq, Ordering::SeqCst);
        if sleeping.load(Ordering::SeqCst) != 0 {
            futex_wake(w);
        }
        seq
    }

    /// Writes the notice of this end's next operation ([`Lane::post`] will send its message).
    pub fn announce(&mut self, stamp: &Stamp) {
        let seq = self.next_seq();
        let head = stamp.encode(seq);
        // SAFETY: the notice line lies in this end's page; its reader reads it only after it
        // saw the sequence word (stored last, release).
        unsafe {
            let at = self.tx.add(NOTICE);
            std::ptr::copy_nonoverlapping(head.as_ptr().add(4), at.add(4), PAYLOAD - 4);
            word(at).store(seq, Ordering::Release);
        }
    }

    /// Takes back the notice written by [`Lane::announce`] (the operation it announced is
    /// over without a lane message: the host arena's, `crate::engine::arena`).
    pub fn withdraw(&mut self) {
        // SAFETY: the notice line lies in this end's page; a sequence word that is not the
        // next operation's makes the peer ignore the notice.
        unsafe { word(self.tx.add(NOTICE)).store(self.seq, Ordering::Release) };
    }

    /// The peer's notice of its operation `seq`, if it wrote one.
    pub fn notice(&self, seq: u32) -> Option<Stamp> {
        // SAFETY: the notice line of the page this end reads; its header is complete once its
        // sequence word (acquire) says `seq`, and is rewritten only for a later operation.
        unsafe {
            let at = self.rx.add(NOTICE);
            if word(at).load(Ordering::Acquire) != seq {
                return None;
            }
            let mut head = [0u8; PAYLOAD];
            std::ptr::copy_nonoverlapping(at, head.as_mut_ptr(), PAYLOAD);
            Stamp::decode(&head).map(|(_, s)| s)
        }
    }

    /// Whether the peer's message of operation `seq` is there.
    pub fn ready(&self, seq: u32) -> bool {
        // SAFETY: the sequence word of a slot of the page this end reads (`new`).
        unsafe { word(self.slot(self.rx, seq)) }.load(Ordering::Acquire) == seq
    }

    /// Copies the peer's message of operation `seq` (which must be [`Lane::ready`]): its stamp,
    /// and its payload into `out` (as much as fits).
    pub fn take(&self, seq: u32, out: &mut [u8]) -> Stamp {
        let slot = self.slot(self.rx, seq);
        debug_assert!(self.ready(seq));
        let mut head = [0u8; PAYLOAD];
        // SAFETY: the slot is inside the peer's page; its writer published it (release store
        // of `seq`, acquired by `ready`) and leaves it alone until this end's next message
        // (module docs). The copy stays inside the slot: `n <= MAX`.
        unsafe {
            std::ptr::copy_nonoverlapping(slot, head.as_mut_ptr(), PAYLOAD);
            let stamp = Stamp::decode(&head).map(|(_, s)| s).unwrap_or_default();
            let n = (stamp.len as usize).min(MAX).min(out.len());
            std::ptr::copy_nonoverlapping(slot.add(PAYLOAD), out.as_mut_ptr(), n);
            stamp
        }
    }

    /// Sleeps until the peer's message of `seq` is there or `limit` passed (or a spurious
    /// wake-up); returns whether it is there.
    pub fn sleep(&self, seq: u32, limit: Duration) -> bool {
        // SAFETY: the slot's sequence word and the sleep word of the page this end reads.
        let (w, flag) = unsafe { (word(self.slot(self.rx, seq)), word(self.rx.add(SLEEP))) };
        flag.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let now = w.load(Ordering::SeqCst);
        if now != seq {
            futex_wait(w, now, limit);
        }
        flag.store(0, Ordering::Relaxed);
        self.ready(seq)
    }

    fn slot(&self, page: *mut u8, seq: u32) -> *mut u8 {
        // SAFETY: slot 0 or 1 of a lane page.
        unsafe { page.add((seq & 1) as usize * SLOT) }
    }
}

/// Sleeps while `w` holds `val`, at most `limit` (shared futex: other processes map it too).
pub(super) fn futex_wait(w: &AtomicU32, val: u32, limit: Duration) {
    let ts = libc::timespec { tv_sec: limit.as_secs() as libc::time_t, tv_nsec: limit.subsec_nanos() as libc::c_long };
    // SAFETY: `w` is a live, aligned 32-bit word; the kernel reads `ts` during the call only.
    unsafe {
        libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAIT, val, &ts as *const libc::timespec, 0usize, 0u32)
    };
}

/// Wakes every sleeper on `w`.
pub(super) fn futex_wake(w: &AtomicU32) {
    // SAFETY: `w` is a live, aligned 32-bit word; FUTEX_WAKE only uses its address.
    unsafe { libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two zeroed pages as a heap stand-in of a segment's lane region.
    fn region() -> Vec<u64> {
        vec![0u64; BYTES / 8]
    }

    #[test]
    fn a_message_crosses_once_and_slots_alternate() {
        let mut mem = region();
        let base = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: two zeroed pages that outlive both lanes; each lane writes its own page.
        let (mut a, b) = unsafe { (Lane::new(base, base.add(DIR)), Lane::new(base.add(DIR), base)) };
        for k in 1..=5u32 {
            assert!(!b.ready(k));
            let payload: Vec<u8> = (0..k as u8 * 3).collect();
            let stamp = Stamp { tag: 1, dtype: 7, op: 0, len: payload.len() as u32, count: k as u64 };
            assert_eq!(a.post(&stamp, &payload), k);
            assert!(b.ready(k) && !b.ready(k + 1));
            let mut out = [0u8; MAX];
            assert_eq!(b.take(k, &mut out), stamp);
            assert_eq!(&out[..payload.len()], &payload[..]);
        }
        assert_eq!(a.next_seq(), 6);
    }

    #[test]
    fn a_sleeper_is_woken_by_the_message_and_times_out_without_one() {
        let mut mem = region();
        let base = mem.as_mut_ptr().cast::<u8>() as usize;
        // SAFETY: as above; the writer thread ends before `mem` is dropped (joined below).
        let b = unsafe { Lane::new((base + DIR) as *mut u8, base as *mut u8) };
        let t0 = std::time::Instant::now();
        assert!(!b.sleep(1, Duration::from_millis(20)));
        assert!(t0.elapsed() >= Duration::from_millis(15), "the sleep must last until its limit");
        let w = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            // SAFETY: as above.
            let mut a = unsafe { Lane::new(base as *mut u8, (base + DIR) as *mut u8) };
            a.post(&Stamp { len: 4, ..Stamp::default() }, &[1, 2, 3, 4]);
        });
        let t0 = std::time::Instant::now();
        let mut got = false;
        while !got && t0.elapsed() < Duration::from_secs(10) {
            got = b.sleep(1, Duration::from_secs(5));
        }
        w.join().unwrap();
        assert!(got && t0.elapsed() < Duration::from_secs(5), "woken by the post, not the limit");
    }

    #[test]
    fn headers_round_trip_and_foreign_bytes_are_refused() {
        let s = Stamp { tag: 1, dtype: 9, op: 4, len: 1000, count: 1 << 40 };
        assert_eq!(Stamp::decode(&s.encode(77)), Some((77, s)));
        assert_eq!(Stamp::decode(&[0u8; HEADER]), None);
    }
}
