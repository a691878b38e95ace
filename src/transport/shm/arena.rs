//! The host arena: one shared mapping for all ranks of a communicator on one host, for the
//! arena all-reduce (`crate::engine::arena`).
//!
//! Pair segments move a rank's data to one peer at a time; an all-reduce over them copies
//! each byte into and out of several rings. In the arena every rank copies its input once
//! into its own *slot*, all ranks meet at a barrier, each rank reduces its slice of the
//! vector straight out of all slots, meets the others again, and copies the other ranks'
//! reduced slices out: about 4.75 passes over the message per rank at 4 ranks, against ~6.75
//! through the rings, and two synchronisations per piece instead of one per chunk and peer
//! (docs/PERFORMANCE.md).
//!
//! **Layout** (an anonymous memfd, like the pair segments, so a crash leaks nothing):
//!
//! | offset | what |
//! | --- | --- |
//! | 0 | magic (8 B), cookie (16 B), ranks (u32 at 24), slot bytes (u64 at 32) |
//! | 128 | `bell` (u32): bumped to wake sleepers |
//! | 256 | `sleepers` (u32): ranks about to sleep or asleep on `bell` |
//! | 4096 + 128 r | rank r's line: `arrived` (u32, the last barrier it reached), its process id (u32 at +4, written at set-up), its call's stamp (24 B at +8), the descriptors of its call's send and receive buffers when they are shareable (`super::hostmem`, 48 B each at +32 and +80; id 0: not shareable) |
//! | [`Arena::data`] | two halves, each one slot of `slot` bytes per rank |
//!
//! **Barriers.** Rank r arrives at barrier g by storing g in its `arrived` word; barrier g is
//! passed when every rank's word has reached g (compared with wrapping arithmetic: a rank is
//! at most one barrier ahead of another). A rank about to sleep counts itself in `sleepers`,
//! reads `bell`, looks at the words again and sleeps in `futex(2)` on `bell`; an arriving rank
//! stores its word, then reads `sleepers` and, when it is not zero, bumps `bell` and wakes
//! every sleeper (Dekker, as in the lane: one of the two sees the other's store).
//!
//! **Setting up.** The lowest rank creates the memfd and sends its pid, descriptor number,
//! length and cookie to every other rank as a lane message (`super::lane`); each opens
//! `/proc/<pid>/fd/<n>`, checks length, magic and cookie, and answers on the lane; the creator
//! closes its descriptor once all answered.

use super::hostmem::{BufDesc, DESC_LEN};
use super::lane::{futex_wait, futex_wake};
use super::sealed::{self, close_fd, open_peer, Expect};
use super::segment::{map, memfd};
use crate::error::{Error, Result};
use std::os::fd::RawFd;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

/// Magic at the start of an arena.
const MAGIC: &[u8; 8] = b"OXARENA\x01";
const COOKIE: usize = sealed::COOKIE_LEN;
const HEADER: usize = 4096;
const BELL: usize = 128;
const SLEEPERS: usize = 256;
/// Bytes of a rank's control line.
const LINE: usize = 128;
const _: () = assert!(BUFS >= STAMP + STAMP_LEN && BUFS + 2 * DESC_LEN <= LINE);
/// Offset of the rank's process id (u32) in its line.
const PID: usize = 4;
/// Offset of the stamp in a rank's line.
const STAMP: usize = 8;
/// Offset of the send buffer's descriptor in a rank's line (the receive buffer's follows).
const BUFS: usize = 32;
/// Bytes of a stamp.
pub const STAMP_LEN: usize = 24;

/// What the creator sends so that the others can open the arena.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Creator's process id.
    pub pid: u32,
    /// The memfd's descriptor number in the creator.
    pub fd: u32,
    /// Mapping length in bytes.
    pub len: u64,
    /// Random bytes written in the header.
    pub cookie: [u8; COOKIE],
}

/// Bytes of an encoded [`Descriptor`].
pub const DESCRIPTOR_LEN: usize = 16 + COOKIE;

impl Descriptor {
    /// The descriptor as bytes (for a lane message).
    pub fn encode(&self) -> [u8; DESCRIPTOR_LEN] {
        let mut b = [0u8; DESCRIPTOR_LEN];
        b[0..4].copy_from_slice(&self.pid.to_le_bytes());
        b[4..8].copy_from_slice(&self.fd.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..].copy_from_slice(&self.cookie);
        b
    }

    /// Decodes [`Descriptor::encode`]'s bytes.
    pub fn decode(b: &[u8]) -> Option<Descriptor> {
        if b.len() != DESCRIPTOR_LEN {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Some(Descriptor {
            pid: u32_at(0),
            fd: u32_at(4),
            len: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            cookie: b[16..].try_into().expect("cookie bytes"),
        })
    }
}

/// One rank's mapping of the host arena.
pub struct Arena {
    base: *mut u8,
    len: usize,
    nranks: usize,
    slot: usize,
    fd: Option<RawFd>,
}

// SAFETY: the mapping is process-wide memory; the control words are accessed through atomics
// and the slots under the barrier protocol (module docs).
unsafe impl Send for Arena {}

/// Bytes of the control region (header page and the ranks' lines, whole pages).
fn control(nranks: usize) -> usize {
    HEADER + (nranks * LINE).div_ceil(4096) * 4096
}

/// Mapping length for `nranks` ranks with slots of `slot` bytes.
fn length(nranks: usize, slot: usize) -> Option<usize> {
    slot.checked_mul(nranks)?.checked_mul(2)?.checked_add(control(nranks))
}

impl Arena {
    /// Creates an arena for `nranks` ranks with slots of `slot` bytes (a multiple of 4096);
    /// its memfd stays open for the others until [`Arena::close_fd`].
    pub fn create(nranks: usize, slot: usize) -> Result<(Arena, Descriptor)> {
        assert!(nranks >= 2 && slot > 0 && slot % 4096 == 0, "arena of {nranks} slots of {slot} B");
        let len = length(nranks, slot).ok_or_else(|| Error::invalid_argument("arena size overflows"))?;
        let cookie = sealed::cookie()?;
        let (fd, base) = memfd(c"oxccl-arena", len, Some((8, &cookie)))?;
        let arena = Arena { base, len, nranks, slot, fd: Some(fd) };
        // SAFETY: the header page is the start of the fresh mapping (the cookie is in it);
        // nobody else maps it yet.
        unsafe {
            std::ptr::copy_nonoverlapping((nranks as u32).to_le_bytes().as_ptr(), base.add(24), 4);
            std::ptr::copy_nonoverlapping((slot as u64).to_le_bytes().as_ptr(), base.add(32), 8);
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), base, MAGIC.len());
        }
        let desc = Descriptor { pid: std::process::id(), fd: fd as u32, len: len as u64, cookie };
        Ok((arena, desc))
    }

    /// Opens the arena another rank created for `nranks` ranks, checking its size, magic,
    /// cookie and shape.
    pub fn open(d: &Descriptor, nranks: usize) -> Result<Arena> {
        if d.len < control(nranks) as u64 {
            return Err(Error::remote(format!("the host arena of {} bytes is too small for {nranks} ranks", d.len)));
        }
        let e = Expect {
            pid: d.pid,
            fd: d.fd,
            len: d.len,
            cookie: Some((8, &d.cookie)),
            members: None,
            what: "the host arena",
        };
        let fd = open_peer(&e, true)?;
        let mapped = map(fd, d.len as usize);
        close_fd(fd);
        let base = mapped?;
        let mut head = [0u8; 40];
        // SAFETY: the header lies in the mapping (length checked above); the creator wrote it
        // before it sent the descriptor.
        unsafe { std::ptr::copy_nonoverlapping(base, head.as_mut_ptr(), head.len()) };
        let mut arena = Arena { base, len: d.len as usize, nranks, slot: 0, fd: None };
        let ranks = u32::from_le_bytes(head[24..28].try_into().expect("4 bytes")) as usize;
        let slot = u64::from_le_bytes(head[32..40].try_into().expect("8 bytes")) as usize;
        if &head[..8] != MAGIC || head[8..8 + COOKIE] != d.cookie {
            return Err(Error::remote("the host arena has the wrong magic or cookie"));
        }
        if ranks != nranks || length(nranks, slot) != Some(arena.len) {
            return Err(Error::remote(format!("the host arena is for {ranks} ranks of {slot} B, not {nranks}")));
        }
        arena.slot = slot;
        Ok(arena)
    }

    /// Closes the creator's descriptor (once every rank mapped the arena, or gave up).
    pub fn close_fd(&mut self) {
        if let Some(fd) = self.fd.take() {
            close_fd(fd);
        }
    }

    /// Bytes of one slot.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Ranks sharing the arena.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The start of rank `r`'s slot in half `h` (0 or 1); `slot()` bytes.
    pub fn data(&self, h: usize, r: usize) -> *mut u8 {
        assert!(h < 2 && r < self.nranks, "arena slot {h}/{r}");
        // SAFETY: the slot lies inside the mapping (`length`).
        unsafe { self.base.add(control(self.nranks) + (h * self.nranks + r) * self.slot) }
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off % 4 == 0 && off + 4 <= control(self.nranks));
        // SAFETY: an aligned word of the control region, which lives as long as `self`; every
        // process accesses the control words only atomically.
        unsafe { AtomicU32::from_ptr(self.base.add(off).cast()) }
    }

    fn arrived(&self, r: usize) -> &AtomicU32 {
        self.word(HEADER + r * LINE)
    }

    /// Writes this process's id in rank `rank`'s line (at set-up, before its first arrival).
    pub fn set_pid(&self, rank: usize) {
        self.word(HEADER + rank * LINE + PID).store(std::process::id(), Ordering::Release);
    }

    /// The process id rank `r` wrote at set-up (0: none yet).
    pub fn pid(&self, r: usize) -> u32 {
        assert!(r < self.nranks);
        self.word(HEADER + r * LINE + PID).load(Ordering::Acquire)
    }

    /// Writes this rank's stamp (the description of its call) for the others to compare.
    pub fn set_stamp(&self, rank: usize, stamp: &[u8; STAMP_LEN]) {
        // SAFETY: the stamp field of this rank's own line; the others read it only after this
        // rank's next arrival (release), and it is rewritten only for a later call, after
        // every rank passed the barrier that follows their reads (engine docs).
        unsafe { std::ptr::copy_nonoverlapping(stamp.as_ptr(), self.base.add(HEADER + rank * LINE + STAMP), STAMP_LEN) }
    }

    /// Rank `r`'s stamp (valid once it arrived at a barrier of the current call).
    pub fn stamp(&self, r: usize) -> [u8; STAMP_LEN] {
        assert!(r < self.nranks);
        let mut s = [0u8; STAMP_LEN];
        // SAFETY: the stamp field of rank r's line, inside the control region; see `set_stamp`.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(HEADER + r * LINE + STAMP), s.as_mut_ptr(), STAMP_LEN) };
        s
    }

    /// Writes the descriptors of this rank's send and receive buffers for its call (as
    /// [`Arena::set_stamp`]: before its first arrival of the call).
    pub fn set_bufs(&self, rank: usize, send: &BufDesc, recv: &BufDesc) {
        let (a, b) = (send.encode(), recv.encode());
        // SAFETY: the descriptor fields of this rank's own line (BUFS + 2 * DESC_LEN <= LINE);
        // read by the others only after this rank's next arrival, as the stamp.
        unsafe {
            let at = self.base.add(HEADER + rank * LINE + BUFS);
            std::ptr::copy_nonoverlapping(a.as_ptr(), at, DESC_LEN);
            std::ptr::copy_nonoverlapping(b.as_ptr(), at.add(DESC_LEN), DESC_LEN);
        }
    }

    /// Rank `r`'s send and receive buffer descriptors (valid as [`Arena::stamp`]).
    pub fn bufs(&self, r: usize) -> (BufDesc, BufDesc) {
        assert!(r < self.nranks);
        let (mut a, mut b) = ([0u8; DESC_LEN], [0u8; DESC_LEN]);
        // SAFETY: the descriptor fields of rank r's line, inside the control region.
        unsafe {
            let at = self.base.add(HEADER + r * LINE + BUFS);
            std::ptr::copy_nonoverlapping(at, a.as_mut_ptr(), DESC_LEN);
            std::ptr::copy_nonoverlapping(at.add(DESC_LEN), b.as_mut_ptr(), DESC_LEN);
        }
        (BufDesc::decode(&a), BufDesc::decode(&b))
    }

    /// The barrier rank `r` reached last.
    pub fn reached(&self, r: usize) -> u32 {
        self.arrived(r).load(Ordering::Acquire)
    }

    /// Whether rank `r` has reached barrier `g`.
    pub fn has_reached(&self, r: usize, g: u32) -> bool {
        self.reached(r).wrapping_sub(g) as i32 >= 0
    }

    /// The first rank at or after `from` that has not reached barrier `g`, if any.
    pub fn missing(&self, from: usize, g: u32) -> Option<usize> {
        (from..self.nranks).find(|&r| !self.has_reached(r, g))
    }

    /// Arrives at barrier `g` and wakes sleepers.
    pub fn arrive(&self, rank: usize, g: u32) {
        self.arrived(rank).swap(g, Ordering::SeqCst);
        if self.word(SLEEPERS).load(Ordering::SeqCst) != 0 {
            let bell = self.word(BELL);
            bell.fetch_add(1, Ordering::SeqCst);
            futex_wake(bell);
        }
    }

    /// Sleeps until every rank reached barrier `g`, `limit` passed, or another arrival rang;
    /// returns whether all have reached it.
    pub fn sleep(&self, g: u32, limit: Duration) -> bool {
        let (bell, sleepers) = (self.word(BELL), self.word(SLEEPERS));
        sleepers.fetch_add(1, Ordering::SeqCst);
        let rung = bell.load(Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.missing(0, g).is_some() {
            futex_wait(bell, rung, limit);
        }
        sleepers.fetch_sub(1, Ordering::SeqCst);
        self.missing(0, g).is_none()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.close_fd();
        // SAFETY: `base`/`len` are the mapping made in `create`/`open`, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_opened_arena_shares_slots_and_barriers_with_its_creator() {
        let (a, d) = Arena::create(3, 4096).unwrap();
        assert_eq!(Descriptor::decode(&d.encode()), Some(d.clone()));
        let b = Arena::open(&d, 3).unwrap();
        assert!(Arena::open(&d, 4).is_err(), "a different rank count is refused");
        let bad = Descriptor { cookie: [9; COOKIE], ..d.clone() };
        assert!(Arena::open(&bad, 3).is_err(), "a wrong cookie is refused");
        // SAFETY: slot 2 of half 1 holds 4096 bytes in both mappings of the same memory.
        unsafe {
            *a.data(1, 2).add(4095) = 7;
            assert_eq!(*b.data(1, 2).add(4095), 7);
        }
        b.set_stamp(1, &[5; STAMP_LEN]);
        assert_eq!(a.stamp(1), [5; STAMP_LEN]);
        let d1 = BufDesc { pid: 1, fd: 2, id: 3, alloc_len: 4, off: 5, cookie: [6; 16] };
        let d2 = BufDesc { id: 9, ..d1 };
        b.set_bufs(2, &d1, &d2);
        assert_eq!(a.bufs(2), (d1, d2));
        assert_eq!(a.stamp(2), [0; STAMP_LEN], "the descriptors leave the stamp alone");
        b.set_pid(1);
        assert_eq!((a.pid(0), a.pid(1)), (0, std::process::id()));
        assert_eq!(a.stamp(1), [5; STAMP_LEN], "the pid leaves the stamp alone");
        for r in 0..3 {
            assert_eq!(a.missing(0, 1), Some(r));
            b.arrive(r, 1);
        }
        assert_eq!(a.missing(0, 1), None);
        assert!(!a.has_reached(0, 2) && a.has_reached(0, 0));
        // Wrapping: a barrier number past u32::MAX still compares after its predecessor.
        a.arrive(0, u32::MAX);
        assert!(a.has_reached(0, u32::MAX - 1) && !a.has_reached(0, 0));
        b.arrive(0, 0);
        assert!(a.has_reached(0, u32::MAX));
    }

    #[test]
    fn a_sleeper_wakes_at_the_last_arrival_and_times_out_without_it() {
        let (a, d) = Arena::create(2, 4096).unwrap();
        let t0 = std::time::Instant::now();
        a.arrive(0, 1);
        assert!(!a.sleep(1, Duration::from_millis(20)));
        assert!(t0.elapsed() >= Duration::from_millis(15), "the sleep lasts until its limit");
        let t = std::thread::spawn(move || {
            let b = Arena::open(&d, 2).unwrap();
            std::thread::sleep(Duration::from_millis(30));
            b.arrive(1, 1);
        });
        let t0 = std::time::Instant::now();
        let mut done = false;
        while !done && t0.elapsed() < Duration::from_secs(10) {
            done = a.sleep(1, Duration::from_secs(5));
        }
        t.join().unwrap();
        assert!(done && t0.elapsed() < Duration::from_secs(5), "woken by the arrival, not the limit");
    }
}
