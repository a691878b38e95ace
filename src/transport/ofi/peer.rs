//! [`LinkRx`]: a link's state inside its rail (under the rail's mutex): where its peer is, its
//! tag prefixes, its staging slots, what is posted and in flight, and the credit the peer gave.
//! The stream logic on top of it is [`super::link::OfiLink`].

use super::link::signal;
use super::rail::{tag, Ctx, State};
use super::sys;
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// The staging memory of a link: `2 * depth` slots of `chunk` bytes, registered where the
/// provider asks for it (`FI_MR_LOCAL`). Mapped on its own (not from the allocator): returned
/// to the system when the link closes, and never the reason the allocator's thresholds move
/// (glibc serves the next block of that size from its heap after one such block is freed, and
/// keeps it).
struct Staging {
    base: *mut u8,
    len: usize,
    desc: *mut c_void,
    mr: *mut c_void,
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: mapped with this length in `LinkRx::new`; no operation points into it any
        // more (its link is idle, or the endpoint closed first: `rail::Core`'s drop).
        unsafe {
            sys::oxccl_ofi_mr_close(self.mr);
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

/// Where a link's peer is and how its tags look.
pub struct PeerAddr {
    /// The peer's handle in the rail's address vector.
    pub fi_addr: u64,
    /// The peer's endpoint address (hex), for messages.
    pub name: String,
    /// The prefix the peer chose for what this end sends it.
    pub send_prefix: u64,
    /// The prefix this end chose for what it receives.
    pub recv_prefix: u64,
}

/// A link's state inside its rail (under the rail's mutex).
pub struct LinkRx {
    pub(super) peer: PeerAddr,
    /// The prefix of this link's receives (the drain fails the link on a message with it).
    pub recv_prefix: u64,
    mem: Staging,
    /// One context per slot: sends `0..depth`, receives `depth..2 * depth`.
    pub(super) ctx: Box<[Ctx]>,
    pub(super) chunk: usize,
    pub(super) depth: usize,
    pub(super) directed: bool,
    pub(super) tx_busy: Vec<bool>,
    /// Per send slot: the length of the message it holds (kept past its completion on a link
    /// with several rails, until the peer consumed it: [`LinkRx::keep`]).
    pub(super) tx_len: Vec<usize>,
    pub(super) in_flight: usize,
    pub(super) send_seq: u64,
    /// The peer posted receives for every sequence number below this.
    pub(super) credit: u64,
    /// Per receive slot: the length of the message it holds once complete.
    pub(super) rx_len: Vec<Option<usize>>,
    /// Per receive slot: the sequence number it must be posted for, while not yet posted.
    pub(super) rx_repost: Vec<Option<u64>>,
    pub(super) rx_posted: Vec<bool>,
    pub(super) recv_seq: u64,
    pub(super) rx_off: usize,
    pub(super) error: Option<String>,
    /// The engine sleeps on this link: wake it through `wake` on any completion.
    pub(super) armed: bool,
    pub(super) wake: RawFd,
    /// The link was dropped; freed once nothing of it is in the provider's hands.
    pub closing: bool,
    /// The link has several rails: message `s` is sent from slot `s % depth`, whose bytes stay
    /// until the peer consumed `s` (a credit above `s + depth`), so a failed rail's unreceived
    /// messages can be sent again; an error completion marks the rail `broken` instead of
    /// failing the link.
    pub(super) keep: bool,
    /// Why the rail failed under this link (an error completion), for its failover.
    pub(super) broken: Option<String>,
    /// The last completion of this link's operations, or the last send posted while none was
    /// in flight (links that `keep` only).
    pub(super) last_done: Instant,
    /// Since when the provider has refused (`FI_EAGAIN`) every send of this link on the rail,
    /// with no completion since (links that `keep` only).
    pub(super) refused: Option<Instant>,
    /// After a failover, until the peer's resume: sends wait (the receiver's window is unknown).
    pub(super) awaiting: bool,
    /// Sequence numbers to send again from their slots (after the peer's resume), in order.
    pub(super) resend: VecDeque<u64>,
}

// SAFETY: the raw pointers are the staging memory and its registration, owned here and used
// only under the rail's mutex.
unsafe impl Send for LinkRx {}

impl LinkRx {
    pub(super) fn new(
        st: &State,
        mr_local: bool,
        id: u64,
        peer: PeerAddr,
        chunk: usize,
        depth: usize,
        wake: RawFd,
    ) -> Result<Self> {
        let len = 2 * depth * chunk;
        // SAFETY: an anonymous private mapping; no memory preconditions.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(Error::system(format!("mapping {len} bytes of ofi staging: {e}")));
        }
        let base = base.cast::<u8>();
        let mut mem = Staging { base, len, desc: std::ptr::null_mut(), mr: std::ptr::null_mut() };
        if mr_local {
            // SAFETY: the region is ours and valid for its length; the registration is closed
            // before the memory is freed (`Staging`'s drop).
            let rc = unsafe { sys::oxccl_ofi_mr_reg(st.ep(), base.cast(), len, &mut mem.desc, &mut mem.mr) };
            if rc != 0 {
                return Err(Error::system(format!("libfabric fi_mr_reg of the staging memory: {}", sys::strerror(rc))));
            }
        }
        // SAFETY: a valid endpoint.
        let directed = unsafe { sys::oxccl_ofi_directed(st.ep()) != 0 };
        Ok(LinkRx {
            recv_prefix: peer.recv_prefix,
            peer,
            mem,
            ctx: Ctx::slots(id, 2 * depth),
            chunk,
            depth,
            directed,
            tx_busy: vec![false; depth],
            tx_len: vec![0; depth],
            in_flight: 0,
            send_seq: 0,
            credit: 0,
            rx_len: vec![None; depth],
            rx_repost: (0..depth as u64).map(Some).collect(),
            rx_posted: vec![false; depth],
            recv_seq: 0,
            rx_off: 0,
            error: None,
            armed: false,
            wake,
            closing: false,
            keep: false,
            broken: None,
            last_done: Instant::now(),
            refused: None,
            awaiting: false,
            resend: VecDeque::new(),
        })
    }

    pub(super) fn slot(&self, i: usize) -> *mut u8 {
        // SAFETY: `i < 2 * depth`, so the slot lies inside the staging allocation.
        unsafe { self.mem.base.add(i * self.chunk) }
    }

    pub(super) fn ctx_ptr(&mut self, i: usize) -> *mut c_void {
        let c: *mut Ctx = &mut self.ctx[i];
        c.cast()
    }

    /// Staging bytes this link holds.
    pub fn staging_bytes(&self) -> usize {
        self.mem.len
    }

    /// Whether nothing of this link is in the provider's hands.
    pub fn idle(&self) -> bool {
        self.in_flight == 0 && !self.rx_posted.iter().any(|p| *p)
    }

    /// Wakes the engine if it sleeps on this link.
    pub fn wake(&mut self) {
        if self.armed && self.wake >= 0 {
            self.armed = false;
            signal(self.wake);
        }
    }

    /// Fails the link: traffic that no oxccl peer sends.
    pub fn unexpected(&mut self, what: String) {
        let from = if self.directed {
            format!("{} (this link's peer endpoint)", self.peer.name)
        } else {
            "an unknown sender (the provider matches receives by tag alone)".to_string()
        };
        self.error.get_or_insert(format!("unexpected traffic from {from}: {what}"));
        self.armed = true;
        self.wake();
    }

    /// Operation `slot` completed (`err`: with that error, described by `why`).
    pub fn completed(&mut self, slot: usize, len: usize, err: i32, why: &str) {
        if self.keep {
            self.last_done = Instant::now();
            self.refused = None;
        }
        if slot < self.depth {
            self.tx_busy[slot] = false;
            self.in_flight -= 1;
        } else {
            self.rx_posted[slot - self.depth] = false;
            if err == 0 && len == 0 {
                // Never sent by an oxccl stream (a send takes at least one byte).
                self.unexpected("an empty message".into());
            } else if err == 0 {
                self.rx_len[slot - self.depth] = Some(len);
            }
        }
        if err != 0 && !(self.closing && err == sys::ECANCELED) {
            if self.keep {
                // The rail failed under a link with others: its failover decides.
                if !self.closing {
                    self.broken.get_or_insert(why.to_string());
                }
            } else {
                self.error.get_or_insert(why.to_string());
            }
        }
    }

    /// Posts the receives that are due; returns whether any was (a provider that is out of
    /// room gets the rest later).
    pub(super) fn repost(&mut self, ep: *mut sys::Ep) -> Result<bool> {
        let mut any = false;
        for j in 0..self.depth {
            let Some(seq) = self.rx_repost[j] else { continue };
            let (buf, ctx) = (self.slot(self.depth + j), self.ctx_ptr(self.depth + j));
            let t = tag(self.peer.recv_prefix, seq);
            // SAFETY: the slot and its context stay valid until the completion is read (the
            // link's state stays in the rail until it is idle, or the endpoint closes first).
            let rc = unsafe {
                sys::oxccl_ofi_trecv(ep, buf.cast(), self.chunk, self.mem.desc, self.peer.fi_addr, t, 0, ctx)
            };
            match rc {
                0 => {
                    self.rx_repost[j] = None;
                    self.rx_posted[j] = true;
                    any = true;
                }
                sys::EAGAIN => break,
                rc => return Err(self.fail(format!("posting a receive failed: {}", sys::strerror(rc)))),
            }
        }
        Ok(any)
    }

    /// The first sequence number whose receive is not posted: what the peer may send below.
    pub(super) fn posted_below(&self) -> u64 {
        let pending = self.rx_repost.iter().flatten().min().copied();
        pending.unwrap_or(u64::MAX).min(self.recv_seq + self.depth as u64)
    }

    /// Withdraws every posted receive (the link is closing).
    pub(super) fn cancel_all(&mut self, ep: *mut sys::Ep) {
        for j in 0..self.depth {
            if self.rx_posted[j] {
                let ctx = self.ctx_ptr(self.depth + j);
                // SAFETY: a valid endpoint; the context is the posted receive's.
                unsafe { sys::oxccl_ofi_cancel(ep, ctx) };
            }
        }
    }

    pub(super) fn fail(&mut self, why: String) -> Error {
        self.error.get_or_insert(why.clone());
        Error::remote(why)
    }

    pub(super) fn check(&self) -> Result<()> {
        match &self.error {
            Some(e) => Err(Error::remote(e.clone())),
            None => Ok(()),
        }
    }

    /// The unread bytes of the message with sequence number `seq`, if it has arrived.
    pub(super) fn ready(&self, seq: u64, from: usize) -> Option<&[u8]> {
        let j = (seq % self.depth as u64) as usize;
        let len = self.rx_len[j]?;
        // SAFETY: the slot holds `len <= chunk` bytes the provider completed; nothing writes
        // it until it is reposted, which happens only after its bytes are consumed.
        Some(unsafe { std::slice::from_raw_parts(self.slot(self.depth + j).add(from), len - from) })
    }

    /// Consumes `n` bytes of the stream (at most what [`LinkRx::ready`] offers in order).
    pub(super) fn consume(&mut self, mut n: usize) {
        while n > 0 {
            let j = (self.recv_seq % self.depth as u64) as usize;
            let len = self.rx_len[j].expect("consumed bytes were ready");
            let k = n.min(len - self.rx_off);
            self.rx_off += k;
            n -= k;
            if self.rx_off == len {
                self.rx_len[j] = None;
                self.rx_repost[j] = Some(self.recv_seq + self.depth as u64);
                self.recv_seq += 1;
                self.rx_off = 0;
            }
        }
    }

    pub(super) fn readable(&self) -> bool {
        self.ready(self.recv_seq, self.rx_off).is_some()
    }

    pub(super) fn can_send(&self) -> bool {
        let slot_free = if self.keep {
            !self.tx_busy[(self.send_seq % self.depth as u64) as usize]
        } else {
            self.in_flight < self.depth
        };
        !self.awaiting && self.send_seq < self.credit && slot_free && self.resend.is_empty()
    }

    /// Copies up to one message's worth of `bufs` into a free send slot and posts it, within
    /// the peer's credit.
    pub(super) fn send(&mut self, ep: *mut sys::Ep, bufs: &[&[u8]]) -> Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 || self.send_seq >= self.credit || self.awaiting {
            return Ok(0);
        }
        if self.keep && !self.pump(ep)? {
            return Ok(0);
        }
        let i = if self.keep {
            let i = (self.send_seq % self.depth as u64) as usize;
            if self.tx_busy[i] {
                return Ok(0);
            }
            i
        } else {
            let Some(i) = self.tx_busy.iter().position(|b| !b) else { return Ok(0) };
            i
        };
        let dst = self.slot(i);
        let mut n = 0;
        for b in bufs {
            let k = b.len().min(self.chunk - n);
            // SAFETY: `dst` is send slot `i` (free: no send in flight from it), `chunk` bytes
            // long, and `n + k <= chunk`.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), dst.add(n), k) };
            n += k;
            if n == self.chunk {
                break;
            }
        }
        let ctx = self.ctx_ptr(i);
        let t = tag(self.peer.send_prefix, self.send_seq);
        // SAFETY: the slot holds `n` bytes and, with its context, stays untouched until the
        // send's completion is read (tx_busy) or the endpoint is closed.
        let rc = unsafe { sys::oxccl_ofi_tsend(ep, dst.cast(), n, self.mem.desc, self.peer.fi_addr, t, ctx) };
        match rc {
            0 => {
                if self.keep && self.in_flight == 0 {
                    self.last_done = Instant::now();
                }
                self.tx_busy[i] = true;
                self.tx_len[i] = n;
                self.in_flight += 1;
                self.send_seq += 1;
                self.refused = None;
                Ok(n)
            }
            sys::EAGAIN => {
                if self.keep {
                    self.refused.get_or_insert_with(Instant::now);
                }
                Ok(0)
            }
            rc => Err(self.fail(format!("posting a send failed: {}", sys::strerror(rc)))),
        }
    }

    /// Why the rail made no progress for this link for `timeout` (links that `keep` only): a
    /// send in flight with no completion of the link's operations, or the provider refusing
    /// every send.
    pub(super) fn stalled(&self, now: Instant, timeout: Duration) -> Option<String> {
        let ms = timeout.as_millis();
        if !self.keep {
            None
        } else if self.in_flight > 0 && now.saturating_duration_since(self.last_done) >= timeout {
            Some(format!("a send in flight saw no completion for {ms} ms"))
        } else if self.refused.is_some_and(|t| now.saturating_duration_since(t) >= timeout) {
            Some(format!("the provider refused every send for {ms} ms"))
        } else {
            None
        }
    }

    /// Whether a message has arrived that the stream has not read yet.
    pub(super) fn holds_unread(&self) -> bool {
        self.rx_len.iter().any(Option::is_some)
    }

    /// Sends again the messages the peer's resume named, within its credit; whether none is
    /// left to send.
    pub(super) fn pump(&mut self, ep: *mut sys::Ep) -> Result<bool> {
        while let Some(&s) = self.resend.front() {
            let i = (s % self.depth as u64) as usize;
            if s >= self.credit || self.tx_busy[i] {
                return Ok(false);
            }
            let (buf, ctx) = (self.slot(i), self.ctx_ptr(i));
            let t = tag(self.peer.send_prefix, s);
            // SAFETY: slot `i` holds message `s`'s `tx_len[i]` bytes (copied at the failover,
            // not overwritten since: message `s + depth` is not sent before the peer consumed
            // `s`) and, with its context, stays untouched until the completion is read.
            let rc = unsafe {
                sys::oxccl_ofi_tsend(ep, buf.cast(), self.tx_len[i], self.mem.desc, self.peer.fi_addr, t, ctx)
            };
            match rc {
                0 => {
                    if self.in_flight == 0 {
                        self.last_done = Instant::now();
                    }
                    self.tx_busy[i] = true;
                    self.in_flight += 1;
                    self.resend.pop_front();
                    self.refused = None;
                }
                sys::EAGAIN => {
                    self.refused.get_or_insert_with(Instant::now);
                    return Ok(false);
                }
                rc => return Err(self.fail(format!("posting a send failed: {}", sys::strerror(rc)))),
            }
        }
        Ok(true)
    }

    /// Which of the messages `recv_seq..recv_seq + depth` have arrived (bit `s - recv_seq`).
    pub(super) fn arrived(&self) -> u64 {
        (0..self.depth as u64).filter(|k| self.ready(self.recv_seq + k, 0).is_some()).fold(0, |m, k| m | 1 << k)
    }

    /// Takes over the stream of `old`, a link's state on a rail that failed: the messages it
    /// received and the stream has not read (copied, with the read offset), receives to post
    /// for the others of its window, and the bytes of the messages it sent that the peer may
    /// not have (sent again only after the peer's resume: `awaiting`). `old`'s receives must
    /// be withdrawn already, so nothing it receives later is read.
    pub(super) fn take_over(&mut self, old: &LinkRx) {
        let d = self.depth as u64;
        self.keep = true;
        self.recv_seq = old.recv_seq;
        self.rx_off = old.rx_off;
        for k in 0..d {
            let s = old.recv_seq + k;
            let j = (s % d) as usize;
            self.rx_posted[j] = false;
            match old.ready(s, 0) {
                Some(src) => {
                    // SAFETY: receive slot `j` is `chunk` bytes, as long as `old`'s (one link's
                    // chunk), and no operation points into this new state's slots yet.
                    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.slot(self.depth + j), src.len()) };
                    self.rx_len[j] = Some(src.len());
                    self.rx_repost[j] = None;
                }
                None => {
                    self.rx_len[j] = None;
                    self.rx_repost[j] = Some(s);
                }
            }
        }
        self.send_seq = old.send_seq;
        for s in old.send_seq.saturating_sub(d)..old.send_seq {
            let j = (s % d) as usize;
            // SAFETY: send slot `j` of `old` holds message `s` (fixed slots, kept until the peer
            // consumed it); the provider only reads it, and this state's slot is not in use.
            unsafe { std::ptr::copy_nonoverlapping(old.slot(j), self.slot(j), old.tx_len[j]) };
            self.tx_len[j] = old.tx_len[j];
        }
        self.credit = 0;
        self.awaiting = true;
        self.last_done = Instant::now();
        self.refused = None;
    }

    /// The peer's resume of a failed-over stream: its prefix for what this end sends, the first
    /// message it has not read, which of the next `depth` it holds, and its credit. Queues the
    /// others this end sent for sending again.
    pub(super) fn resume(&mut self, prefix: u64, base: u64, arrived: u64, credit: u64) -> Result<()> {
        let d = self.depth as u64;
        if !self.awaiting || base > self.send_seq || base + d < self.send_seq {
            return Err(Error::remote(format!(
                "resumed a failed-over rail at message {base}, but {} were sent and {} resume was due",
                self.send_seq,
                if self.awaiting { "a" } else { "no" }
            )));
        }
        self.peer.send_prefix = prefix;
        self.awaiting = false;
        self.credit = credit;
        self.resend = (base..self.send_seq).filter(|s| arrived & (1 << (s - base)) == 0).collect();
        Ok(())
    }
}
