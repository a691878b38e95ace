//! Single-copy transfers for the shared-memory link (cross-memory attach, CMA).
//!
//! Through the ring (`super::ring`) a message is copied twice: the sender copies it in, the
//! receiver copies it out. For a large send the link can instead publish the *address* of the
//! sender's buffer, and the receiver copies straight out of the sender's memory with
//! `process_vm_readv(2)` (as Open MPI's vader/smsc and MPICH do): one pass over memory instead
//! of two, and no work at all on the sender's core.
//!
//! **Stream order.** A single-copy send is a *segment* of the link's byte stream that sits at
//! the ring position where it was posted. The sender posts it only when the ring holds no
//! partial step (so no element straddles the ring and the segment), and writes nothing into
//! the ring until the receiver has copied the whole segment; the receiver copies from the
//! segment once it has read the ring up to that position. The send counts as taken only as
//! far as the receiver has copied it (the sender may overwrite its buffer after that), so the
//! engine sees an ordinary send that progresses at the receiver's pace.
//!
//! **Shared words** (in the segment's header page, one 1 KiB slot per direction; sender's and
//! receiver's words on different 128-byte line pairs): `seq` (posts so far), `pos`, `addr`,
//! `len` (the sender's), `done` (bytes ever copied by single copy, the receiver's) and the
//! receiver's verdict `ok`. Sleeping uses the ring's flags: a receiver about to sleep raises
//! its reader flag and then looks at `seq`; a sender waiting for `done` raises its writer flag
//! and then looks at `done`; the other side checks the flag after its store (as in the ring).
//!
//! **Decided once at connect.** Each side writes its pid and the address of its own mapping of
//! the header into the header. The receiver of each direction reads the other side's header
//! through `process_vm_readv` and compares it with its own view: only when that works (same
//! user, no Yama restriction, no seccomp filter, `OXCCL_CMA` not 0 on the receiver) may it
//! set `ok`. By default (`OXCCL_CMA` unset) it then also times the kernel's copy against a
//! `memcpy` of the same bytes (1 MiB of its own memory, best of three each) and sets `ok` only
//! when the kernel's copy costs at most [`MAX_SLOWDOWN`] times as much: a single copy that runs
//! at half memcpy's speed or less gains nothing over the ring's two copies, which two cores
//! make at once (docs/PERFORMANCE.md, transport thresholds: on the 2-vCPU CI-like VM the kernel copies at
//! ~3 GB/s of CPU time against memcpy's ~7, so single copy stays off there). A sender posts
//! segments only after it saw `ok` set and with its own `OXCCL_CMA` not 0. Otherwise every
//! byte goes through the ring, as before.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

/// Bytes a receiver copies at a time into its bounce buffer for a reduction straight out of
/// the link (the reduction then reads them from the core's cache).
pub const BOUNCE: usize = 128 << 10;

/// Offset in the header page of side `s`'s pid (u32), header address (u64) and the CPU it last
/// waited on (u32, plus one; see `shm.rs`).
const SIDE: usize = 256;
/// Offset in the header page of the slot of ring `r` (1 KiB each).
const SLOT: usize = 1024;
const SEQ: usize = 0;
const POS: usize = 8;
const ADDR: usize = 16;
const LEN: usize = 24;
const DONE: usize = 128;
const OK: usize = 256;

/// Verdict values of the `ok` word.
const OK_UNKNOWN: u32 = 0;
const OK_YES: u32 = 1;
const OK_NO: u32 = 2;

/// Bytes of the header compared by the connect-time probe (magic, cookie, capacity).
const PROBE_LEN: usize = 32;

/// Largest cost of the kernel's copy relative to `memcpy` (same bytes, best of three) at which
/// the automatic mode turns single copy on.
pub const MAX_SLOWDOWN: f64 = 1.5;

use crate::config::CmaSetting;

/// `OXCCL_CMA` / `NCCL_CMA` of this process ([`crate::config::Config::cma`]): `None` when
/// single copy is off.
pub fn setting() -> Option<CmaSetting> {
    crate::config::process().cma
}

/// The words of one header page (the segment's first page, mapped in both processes).
#[derive(Clone, Copy)]
pub struct Header {
    base: *mut u8,
}

// SAFETY: the header page is shared memory accessed only through atomics here.
unsafe impl Send for Header {}

impl Header {
    /// The header page at `base`.
    ///
    /// # Safety
    /// `base` must point to a mapped, 4096-byte, page-aligned header that outlives every use.
    pub unsafe fn new(base: *mut u8) -> Header {
        Header { base }
    }

    fn u64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= 4096);
        // SAFETY: `off` is an 8-aligned offset inside the mapped header page (see `new`).
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn u32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off % 4 == 0 && off + 4 <= 4096);
        // SAFETY: as in `u64`.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    /// Writes this process's pid and its address of the header as side `side` (0: creator).
    pub fn publish_self(&self, side: usize) {
        self.u64(SIDE + side * 128 + 8).store(self.base as u64, Ordering::Relaxed);
        self.u32(SIDE + side * 128).store(std::process::id(), Ordering::Release);
    }

    /// Records that side `side` last looked for data on CPU `cpu` (written only when it changed).
    pub fn set_cpu(&self, side: usize, cpu: u32) {
        self.u32(SIDE + side * 128 + 16).store(cpu, Ordering::Relaxed);
    }

    /// The CPU side `side` last looked for data on, plus one (0: not known).
    pub fn cpu(&self, side: usize) -> u32 {
        self.u32(SIDE + side * 128 + 16).load(Ordering::Relaxed)
    }

    fn side(&self, side: usize) -> (u32, u64) {
        let pid = self.u32(SIDE + side * 128).load(Ordering::Acquire);
        (pid, self.u64(SIDE + side * 128 + 8).load(Ordering::Relaxed))
    }

    /// Overwrites side `side`'s published header address (tests: a probe that the kernel
    /// refuses).
    #[cfg(test)]
    pub(crate) fn corrupt_side(&self, side: usize) {
        self.u64(SIDE + side * 128 + 8).store(8, Ordering::Relaxed);
    }

    /// The receiver of ring `ring` decides whether it reads the other side's (`peer`) memory:
    /// reads that side's header through `process_vm_readv` and compares it with its own view;
    /// in the automatic mode (`set`, normally [`setting`]) also compares the kernel's copy
    /// with `memcpy` (1 MiB, best of three, once per process). Records and returns the verdict, with the reason.
    pub fn probe(&self, ring: usize, peer: usize, set: Option<CmaSetting>) -> (bool, String) {
        let Some(set) = set else {
            return self.record(ring, false, "off (OXCCL_CMA=0)".into());
        };
        let (pid, addr) = self.side(peer);
        let mut got = [0u8; PROBE_LEN];
        let read = if pid == 0 { Ok(0) } else { read_remote(pid, addr, &mut [&mut got]) };
        // SAFETY: the first PROBE_LEN bytes of the header are written once by the creator
        // before the peer maps it, and only read afterwards.
        let mine = unsafe { std::slice::from_raw_parts(self.base, PROBE_LEN) };
        match read {
            Ok(n) if n == PROBE_LEN && got[..] == mine[..] => {}
            Ok(_) => return self.record(ring, false, "off (the peer's memory reads differently)".into()),
            Err(e) => return self.record(ring, false, format!("off (not permitted: {e})")),
        }
        if set.forced {
            return self.record(ring, true, "on (OXCCL_CMA)".into());
        }
        let ratio = kernel_copy_cost();
        let on = ratio <= MAX_SLOWDOWN;
        let why = format!(
            "{} (kernel copy {ratio:.2}x the time of memcpy, limit {MAX_SLOWDOWN})",
            if on { "on" } else { "off" }
        );
        self.record(ring, on, why)
    }

    fn record(&self, ring: usize, ok: bool, why: String) -> (bool, String) {
        self.u32(SLOT * (1 + ring) + OK).store(if ok { OK_YES } else { OK_NO }, Ordering::Release);
        (ok, why)
    }

    /// The verdict recorded by the receiver of ring `ring` (false while unknown).
    pub fn verdict(&self, ring: usize) -> bool {
        self.slot(ring).verdict() == OK_YES
    }

    fn slot(&self, ring: usize) -> Slot {
        Slot { h: *self, off: SLOT * (1 + ring) }
    }
}

/// One direction's slot.
#[derive(Clone, Copy)]
struct Slot {
    h: Header,
    off: usize,
}

impl Slot {
    fn w64(&self, k: usize) -> &AtomicU64 {
        self.h.u64(self.off + k)
    }
    fn verdict(&self) -> u32 {
        self.h.u32(self.off + OK).load(Ordering::Acquire)
    }
}

/// Bytes each timing of [`kernel_copy_cost`] copies: more than a core's L2, as the large
/// messages single copy is for.
const PROBE_BYTES: usize = 1 << 20;

/// The time the kernel's copy (`process_vm_readv` of this process's own anonymous memory)
/// takes relative to `memcpy` of the same [`PROBE_BYTES`], best of three each; measured once
/// per process (a property of the host's kernel and CPU, ~3 ms).
fn kernel_copy_cost() -> f64 {
    static COST: OnceLock<f64> = OnceLock::new();
    *COST.get_or_init(|| {
        let src = vec![1u8; PROBE_BYTES];
        let mut dst = vec![0u8; PROBE_BYTES];
        let best = |f: &mut dyn FnMut() -> bool| {
            (0..3)
                .map(|_| {
                    let t = std::time::Instant::now();
                    if f() {
                        t.elapsed().as_secs_f64()
                    } else {
                        f64::INFINITY
                    }
                })
                .fold(f64::INFINITY, f64::min)
        };
        let me = std::process::id();
        let kernel =
            best(&mut || read_remote(me, src.as_ptr() as u64, &mut [&mut dst[..]]).is_ok_and(|n| n == PROBE_BYTES));
        let user = best(&mut || {
            dst.copy_from_slice(std::hint::black_box(&src[..]));
            true
        });
        kernel / user.max(1e-9)
    })
}

/// Copies from `addr` in process `pid` into `bufs` in order; returns the bytes copied.
fn read_remote(pid: u32, addr: u64, bufs: &mut [&mut [u8]]) -> std::io::Result<usize> {
    let local: Vec<libc::iovec> = bufs
        .iter_mut()
        .filter(|b| !b.is_empty())
        .map(|b| libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: b.len() })
        .collect();
    let total: usize = local.iter().map(|v| v.iov_len).sum();
    if total == 0 {
        return Ok(0);
    }
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: total };
    loop {
        // SAFETY: the local iovecs describe writable buffers this function borrows mutably;
        // the remote range is only read by the kernel, in the other process, which checks it.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, local.as_ptr(), local.len() as _, &remote, 1, 0) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The sending half of a direction.
pub struct Tx {
    slot: Slot,
    min: usize,
    /// Whether the receiver said it can read this process (None until it said).
    usable: Option<bool>,
    seq: u64,
    /// The outstanding post: its address, length, `done` when posted, bytes reported taken.
    posted: Option<(u64, usize, u64, usize)>,
}

impl Tx {
    /// The sender of ring `ring` over `h` (single copy from `min` bytes on).
    pub fn new(h: Header, ring: usize, min: usize) -> Tx {
        let slot = h.slot(ring);
        Tx { slot, min, usable: None, seq: slot.w64(SEQ).load(Ordering::Acquire), posted: None }
    }

    /// Whether a send of `len` bytes should be posted for single copy now.
    pub fn wants(&mut self, len: usize) -> bool {
        len >= self.min && self.posted.is_none() && self.enabled()
    }

    /// Whether the receiver said it reads this process's memory (false until it said).
    pub fn enabled(&mut self) -> bool {
        match self.usable {
            Some(u) => u,
            None => match self.slot.verdict() {
                OK_UNKNOWN => false,
                v => {
                    self.usable = Some(v == OK_YES);
                    v == OK_YES
                }
            },
        }
    }

    /// Whether a post is outstanding.
    pub fn busy(&self) -> bool {
        self.posted.is_some()
    }

    /// Posts `buf` as the segment at stream position `pos`. The caller keeps `buf` unchanged
    /// and passes its untaken rest to [`Tx::progress`] until all of it was taken.
    pub fn post(&mut self, buf: &[u8], pos: u64) {
        debug_assert!(self.posted.is_none());
        let s = &self.slot;
        s.w64(POS).store(pos, Ordering::Relaxed);
        s.w64(ADDR).store(buf.as_ptr() as u64, Ordering::Relaxed);
        s.w64(LEN).store(buf.len() as u64, Ordering::Relaxed);
        let base = s.w64(DONE).load(Ordering::Acquire);
        self.seq += 1;
        s.w64(SEQ).store(self.seq, Ordering::Release);
        self.posted = Some((buf.as_ptr() as u64, buf.len(), base, 0));
    }

    /// Bytes of the outstanding post newly copied by the receiver; `buf` must be its untaken
    /// rest (what the engine passes again). Clears the post once all of it was copied.
    pub fn progress(&mut self, buf: &[u8]) -> Result<usize> {
        let Some((addr, len, base, reported)) = self.posted else { return Ok(0) };
        if buf.as_ptr() as u64 != addr + reported as u64 || buf.len() != len - reported {
            return Err(Error::internal(
                "shared-memory link: a send changed its buffer while the peer was copying it (single copy)",
            ));
        }
        let copied = (self.slot.w64(DONE).load(Ordering::Acquire) - base) as usize;
        let new = copied.min(len) - reported;
        self.posted = if copied >= len { None } else { Some((addr, len, base, reported + new)) };
        Ok(new)
    }

    /// Whether the receiver copied more of the outstanding post than was reported (call after
    /// raising the ring's writer flag: then the receiver sees the flag or this sees its copy).
    pub fn moved(&self) -> bool {
        self.posted.is_none_or(|(_, _, base, reported)| {
            (self.slot.w64(DONE).load(Ordering::Acquire) - base) as usize > reported
        })
    }
}

/// The receiving half of a direction.
pub struct Rx {
    slot: Slot,
    pid: u32,
    enabled: bool,
    seq: u64,
    done: u64,
    /// The segment being copied: sender's address and length, bytes copied.
    cur: Option<(u64, usize, usize)>,
    bounce: Vec<u8>,
    /// Unread bytes of `bounce`.
    bpos: usize,
    bend: usize,
}

impl Rx {
    /// The receiver of ring `ring` over `h`, reading from side `peer`; `enabled` is the
    /// verdict of [`Header::probe`].
    ///
    /// The receiver starts from the slot's initial state (no post, nothing copied: a new
    /// segment is zeroed), never from what the slot holds now: the sender may post as soon as
    /// the verdict is recorded, which is before this end exists (the opener records it when it
    /// maps the segment, the creator at the end of its probe). A start read from the slot
    /// would count that first post as already seen, and both ranks would wait for each other
    /// until the timeout.
    pub fn new(h: Header, ring: usize, peer: usize, enabled: bool) -> Rx {
        let slot = h.slot(ring);
        Rx { slot, pid: h.side(peer).0, enabled, seq: 0, done: 0, cur: None, bounce: Vec::new(), bpos: 0, bend: 0 }
    }

    /// Whether this side reads the peer's memory.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether bytes wait in the bounce buffer (they come before anything in the ring).
    pub fn buffered(&self) -> bool {
        self.bpos < self.bend
    }

    /// Whether a segment is being copied at ring position `head` (a new post there starts).
    pub fn active(&mut self, head: u64) -> bool {
        if self.cur.is_some() {
            return true;
        }
        if !self.enabled {
            return false;
        }
        let seq = self.slot.w64(SEQ).load(Ordering::Acquire);
        if seq == self.seq || self.slot.w64(POS).load(Ordering::Relaxed) != head {
            return false;
        }
        let (addr, len) = (self.slot.w64(ADDR).load(Ordering::Relaxed), self.slot.w64(LEN).load(Ordering::Relaxed));
        self.seq = seq;
        self.cur = Some((addr, len as usize, 0));
        true
    }

    /// Moves bounce bytes into `bufs` (in order); returns the bytes moved.
    pub fn take_buffered(&mut self, bufs: &mut [&mut [u8]]) -> usize {
        let mut n = 0;
        for b in bufs.iter_mut() {
            let k = b.len().min(self.bend - self.bpos);
            b[..k].copy_from_slice(&self.bounce[self.bpos..self.bpos + k]);
            self.bpos += k;
            n += k;
            let rest = std::mem::take(b);
            *b = &mut rest[k..];
        }
        n
    }

    /// Copies from the active segment into `bufs` (in order, at most what is left of it);
    /// returns the bytes copied. The caller then wakes the sender if it sleeps.
    pub fn copy(&mut self, bufs: &mut [&mut [u8]], peer: &dyn Fn(&str) -> Error) -> Result<usize> {
        let Some((addr, len, off)) = self.cur else { return Ok(0) };
        let mut left = len - off;
        let mut cut: Vec<&mut [u8]> = Vec::with_capacity(bufs.len());
        for b in bufs.iter_mut() {
            let k = b.len().min(left);
            left -= k;
            cut.push(&mut b[..k]);
        }
        let n = read_remote(self.pid, addr + off as u64, &mut cut)
            .map_err(|e| peer(&format!("could not be read by single copy (process_vm_readv): {e}")))?;
        self.advance(n);
        Ok(n)
    }

    /// Bytes ready for a reduction: the bounce buffer's unread bytes, refilled from the active
    /// segment when fewer than 16 (an element never straddles the refill).
    pub fn fill(&mut self, peer: &dyn Fn(&str) -> Error) -> Result<&[u8]> {
        if self.bend - self.bpos < 16 {
            if let Some((addr, len, off)) = self.cur {
                if self.bounce.is_empty() {
                    self.bounce = vec![0; BOUNCE];
                }
                self.bounce.copy_within(self.bpos..self.bend, 0);
                self.bend -= self.bpos;
                self.bpos = 0;
                let k = (BOUNCE - self.bend).min(len - off);
                let (pid, at) = (self.pid, self.bend);
                let n = read_remote(pid, addr + off as u64, &mut [&mut self.bounce[at..at + k]])
                    .map_err(|e| peer(&format!("could not be read by single copy (process_vm_readv): {e}")))?;
                self.bend += n;
                self.advance(n);
            }
        }
        Ok(&self.bounce[self.bpos..self.bend])
    }

    /// Frees `n` bytes of the bounce buffer (after [`Rx::fill`]).
    pub fn consume(&mut self, n: usize) {
        self.bpos += n;
        debug_assert!(self.bpos <= self.bend);
    }

    fn advance(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let Some((addr, len, off)) = self.cur else { return };
        self.done += n as u64;
        self.slot.w64(DONE).store(self.done, Ordering::Release);
        self.cur = if off + n >= len { None } else { Some((addr, len, off + n)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_a_missing_process_or_address_fails() {
        let mut b = [0u8; 8];
        assert!(read_remote(std::process::id(), 8, &mut [&mut b]).is_err(), "an unmapped address");
        let src = [7u8; 8];
        assert_eq!(read_remote(std::process::id(), src.as_ptr() as u64, &mut [&mut b]).unwrap(), 8);
        assert_eq!(b, src);
    }
}
