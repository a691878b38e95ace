//! [`OfiLink`]: one ordered byte stream to a peer over the process's libfabric endpoint of a
//! NIC ([`Rail`]), which every peer shares; the link's own state in the rail is [`LinkRx`].
//!
//! The stream is cut into messages of at most `chunk` bytes, each sent with `fi_tsend` from one
//! of `depth` staging slots, tagged with the receiver's random prefix and its sequence number
//! ([`super::rail::tag`]). The receiver keeps a receive posted for each of the next `depth`
//! sequence numbers (one staging slot each, directed to the peer's address where the provider
//! can), so messages land in order whatever order the provider completes them in, and reads
//! the stream out of the slots in sequence (or reduces straight out of them,
//! [`Link::recv_in_place`]). A sender sends message `s` only once the receiver said it posted
//! the receive for `s`: the receiver writes the first sequence number it has not posted
//! (8 bytes, big-endian, only ever growing) on the pair's authenticated TCP connection, which
//! stays open beside the endpoint for that and for its end-of-file (a dead peer). So a link's
//! message never arrives before its receive, and the rail's drain receives can take every
//! message that matches none.
//!
//! libfabric's providers progress only when the completion queue is read; the rail's one
//! progress thread reads it whenever the provider's descriptor signals and wakes the engine of
//! a link through the link's eventfd (in its poll set) when a completion arrives while the
//! engine sleeps on it.

pub use super::endpoint::Endpoint;
pub use super::rail::Rail;
use super::rail::{tag, Ctx, State};
use super::sys;
use crate::error::{Error, Result};
use crate::transport::{Interest, Link};
use std::ffi::c_void;
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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
    peer: PeerAddr,
    /// The prefix of this link's receives (the drain fails the link on a message with it).
    pub recv_prefix: u64,
    mem: Staging,
    /// One context per slot: sends `0..depth`, receives `depth..2 * depth`.
    ctx: Box<[Ctx]>,
    chunk: usize,
    depth: usize,
    directed: bool,
    tx_busy: Vec<bool>,
    in_flight: usize,
    send_seq: u64,
    /// The peer posted receives for every sequence number below this.
    credit: u64,
    /// Per receive slot: the length of the message it holds once complete.
    rx_len: Vec<Option<usize>>,
    /// Per receive slot: the sequence number it must be posted for, while not yet posted.
    rx_repost: Vec<Option<u64>>,
    rx_posted: Vec<bool>,
    recv_seq: u64,
    rx_off: usize,
    error: Option<String>,
    /// The engine sleeps on this link: wake it through `wake` on any completion.
    armed: bool,
    wake: RawFd,
    /// The link was dropped; freed once nothing of it is in the provider's hands.
    pub closing: bool,
}

// SAFETY: the raw pointers are the staging memory and its registration, owned here and used
// only under the rail's mutex.
unsafe impl Send for LinkRx {}

impl LinkRx {
    fn new(
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
        })
    }

    fn slot(&self, i: usize) -> *mut u8 {
        // SAFETY: `i < 2 * depth`, so the slot lies inside the staging allocation.
        unsafe { self.mem.base.add(i * self.chunk) }
    }

    fn ctx_ptr(&mut self, i: usize) -> *mut c_void {
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
            self.error.get_or_insert(why.to_string());
        }
    }

    /// Posts the receives that are due; returns whether any was (a provider that is out of
    /// room gets the rest later).
    fn repost(&mut self, ep: *mut sys::Ep) -> Result<bool> {
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
    fn posted_below(&self) -> u64 {
        let pending = self.rx_repost.iter().flatten().min().copied();
        pending.unwrap_or(u64::MAX).min(self.recv_seq + self.depth as u64)
    }

    /// Withdraws every posted receive (the link is closing).
    fn cancel_all(&mut self, ep: *mut sys::Ep) {
        for j in 0..self.depth {
            if self.rx_posted[j] {
                let ctx = self.ctx_ptr(self.depth + j);
                // SAFETY: a valid endpoint; the context is the posted receive's.
                unsafe { sys::oxccl_ofi_cancel(ep, ctx) };
            }
        }
    }

    fn fail(&mut self, why: String) -> Error {
        self.error.get_or_insert(why.clone());
        Error::remote(why)
    }

    fn check(&self) -> Result<()> {
        match &self.error {
            Some(e) => Err(Error::remote(e.clone())),
            None => Ok(()),
        }
    }

    /// The unread bytes of the message with sequence number `seq`, if it has arrived.
    fn ready(&self, seq: u64, from: usize) -> Option<&[u8]> {
        let j = (seq % self.depth as u64) as usize;
        let len = self.rx_len[j]?;
        // SAFETY: the slot holds `len <= chunk` bytes the provider completed; nothing writes
        // it until it is reposted, which happens only after its bytes are consumed.
        Some(unsafe { std::slice::from_raw_parts(self.slot(self.depth + j).add(from), len - from) })
    }

    /// Consumes `n` bytes of the stream (at most what [`LinkRx::ready`] offers in order).
    fn consume(&mut self, mut n: usize) {
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

    fn readable(&self) -> bool {
        self.ready(self.recv_seq, self.rx_off).is_some()
    }

    fn can_send(&self) -> bool {
        self.send_seq < self.credit && self.in_flight < self.depth
    }

    /// Copies up to one message's worth of `bufs` into a free send slot and posts it, within
    /// the peer's credit.
    fn send(&mut self, ep: *mut sys::Ep, bufs: &[&[u8]]) -> Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 || self.send_seq >= self.credit {
            return Ok(0);
        }
        let Some(i) = self.tx_busy.iter().position(|b| !b) else { return Ok(0) };
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
                self.tx_busy[i] = true;
                self.in_flight += 1;
                self.send_seq += 1;
                Ok(n)
            }
            sys::EAGAIN => Ok(0),
            rc => Err(self.fail(format!("posting a send failed: {}", sys::strerror(rc)))),
        }
    }
}

pub(super) fn eventfd() -> Result<RawFd> {
    // SAFETY: eventfd has no memory preconditions.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::from_io("eventfd", std::io::Error::last_os_error()));
    }
    Ok(fd)
}

pub(super) fn signal(fd: RawFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd we own.
    let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

fn drain_fd(fd: RawFd) {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a valid u64 from a nonblocking eventfd we own.
    let _ = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
}

/// A link's place on one rail.
struct OnRail {
    rail: Arc<Rail>,
    id: u64,
}

/// A link to one peer through libfabric.
pub struct OfiLink {
    /// The rails the link uses (one today: the NIC of the pair's connection).
    rails: Vec<OnRail>,
    wake: RawFd,
    sock: TcpStream,
    peer_rank: usize,
    peer_addr: String,
    provider: String,
    down: AtomicBool,
    /// Longest a dropped link waits for its sends to complete.
    linger: Duration,
    /// Credit bytes read so far (a partial value).
    credit_in: [u8; 8],
    credit_got: usize,
    /// The last credit written to the peer.
    granted: u64,
}

impl OfiLink {
    /// A link on `rail` to `peer` (inserted into the rail's address vector), messages of at most
    /// `chunk` bytes, `depth` in flight each way; `sock` is the pair's connection, kept for
    /// credits and its end-of-file. Posts the first receives and grants them to the peer.
    pub fn new(
        rail: Arc<Rail>,
        peer: PeerAddr,
        chunk: usize,
        depth: usize,
        sock: TcpStream,
        peer_rank: usize,
        linger: Duration,
    ) -> Result<OfiLink> {
        sock.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
        let peer_addr = sock.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let wake = eventfd()?;
        let id = {
            let mut st = rail.core.lock();
            let id = st.next_id();
            let mut l = match LinkRx::new(&st, rail.mr_local, id, peer, chunk, depth, wake) {
                Ok(l) => l,
                Err(e) => {
                    // SAFETY: ours, never shared.
                    unsafe { libc::close(wake) };
                    return Err(e);
                }
            };
            let posted = l.repost(st.ep());
            st.peers.insert(id, l);
            if posted? {
                st.requeue_drains()?;
            }
            id
        };
        let provider = rail.provider.clone();
        let mut link = OfiLink {
            rails: vec![OnRail { rail, id }],
            wake,
            sock,
            peer_rank,
            peer_addr,
            provider,
            down: AtomicBool::new(false),
            linger,
            credit_in: [0; 8],
            credit_got: 0,
            granted: 0,
        };
        link.grant()?;
        Ok(link)
    }

    fn remote(&self, what: &str) -> Error {
        Error::remote(format!("peer rank {} ({}, OFI {}) {what}", self.peer_rank, self.peer_addr, self.provider))
    }

    fn wrap(&self, e: Error) -> Error {
        if e.message().starts_with("unexpected traffic") {
            // Not the peer's doing: name the link, blame no rank.
            return Error::system(format!(
                "the OFI link to rank {} ({}, {}) failed: {}",
                self.peer_rank,
                self.peer_addr,
                self.provider,
                e.message()
            ));
        }
        self.remote(e.message())
    }

    /// Runs `f` on this link's state in its rail, after reading the completion queue when
    /// `progress` (waking the other links that got completions).
    fn with<T>(&self, progress: bool, f: impl FnOnce(&mut LinkRx, *mut sys::Ep) -> Result<T>) -> Result<T> {
        let on = &self.rails[0];
        let mut st = on.rail.core.lock();
        if progress {
            let mut woken = Vec::new();
            st.progress(&mut woken);
            for id in woken.iter().filter(|id| **id != on.id) {
                if let Some(l) = st.peers.get_mut(id) {
                    l.wake();
                }
            }
        }
        let ep = st.ep();
        let l = st.peers.get_mut(&on.id).ok_or_else(|| Error::internal("ofi link state missing"))?;
        let r = l.check().and_then(|_| f(l, ep));
        r.map_err(|e| self.wrap(e))
    }

    /// Posts the receives that are due, moves the drains behind them and tells the peer.
    fn repost_and_grant(&mut self) -> Result<()> {
        {
            let on = &self.rails[0];
            let mut st = on.rail.core.lock();
            let ep = st.ep();
            let l = st.peers.get_mut(&on.id).ok_or_else(|| Error::internal("ofi link state missing"))?;
            if l.repost(ep).map_err(|e| self.wrap(e))? {
                st.requeue_drains()?;
            }
        }
        self.grant()
    }

    /// Writes the peer's new credit when it grew (later, on the next call, if the socket is
    /// full).
    fn grant(&mut self) -> Result<()> {
        let upto = self.with(false, |l, _| Ok(l.posted_below()))?;
        if upto <= self.granted {
            return Ok(());
        }
        let b = upto.to_be_bytes();
        // SAFETY: sends 8 bytes from a valid array on our socket; MSG_NOSIGNAL: a closed peer
        // is an error code, never SIGPIPE (a host program may not ignore it).
        let n =
            unsafe { libc::send(self.sock.as_raw_fd(), b.as_ptr().cast(), 8, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n == 8 {
            self.granted = upto;
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            // Full (written on a later call) or interrupted.
            ErrorKind::WouldBlock | ErrorKind::Interrupted if n < 0 => Ok(()),
            // The peer is gone: what it sent can still be read; its end-of-file tells the rest.
            ErrorKind::BrokenPipe | ErrorKind::ConnectionReset if n < 0 => Ok(()),
            _ if n >= 0 => Err(self.remote("connection failed: a short write of a credit")),
            _ => Err(self.remote(&format!("connection failed: {e}"))),
        }
    }

    /// Reads credits from the socket; `Ok(false)` once the peer closed it.
    fn read_credits(&mut self) -> Result<bool> {
        let mut buf = [0u8; 256];
        let mut best = 0u64;
        let alive = loop {
            match (&self.sock).read(&mut buf) {
                Ok(0) => break false,
                Ok(n) => {
                    for &b in &buf[..n] {
                        self.credit_in[self.credit_got] = b;
                        self.credit_got += 1;
                        if self.credit_got == 8 {
                            best = best.max(u64::from_be_bytes(self.credit_in));
                            self.credit_got = 0;
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break true,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => break false,
                Err(e) => return Err(self.remote(&format!("connection failed: {e}"))),
            }
        };
        if best > 0 {
            self.with(false, |l, _| {
                l.credit = l.credit.max(best);
                Ok(())
            })?;
        }
        Ok(alive)
    }

    /// The provider's name.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Whether the provider gave the completion queue a wait descriptor (else the progress
    /// thread polls it every millisecond).
    pub fn has_wait_fd(&self) -> bool {
        self.rails[0].rail.core.wait_fd >= 0
    }

    /// Copies the stream's next bytes into `a`, then `b`.
    fn copy_out(l: &mut LinkRx, a: &mut [u8], b: &mut [u8]) -> usize {
        let mut done = 0;
        for dst in [a, b] {
            let mut off = 0;
            while off < dst.len() {
                let (seq, from) = (l.recv_seq, l.rx_off);
                let Some(src) = l.ready(seq, from) else { break };
                let k = src.len().min(dst.len() - off);
                dst[off..off + k].copy_from_slice(&src[..k]);
                l.consume(k);
                off += k;
            }
            done += off;
            if off < dst.len() {
                break;
            }
        }
        done
    }
}

impl Link for OfiLink {
    fn try_send(&mut self, buf: &[u8]) -> Result<usize> {
        self.try_send_vectored(&[buf])
    }

    fn try_send_vectored(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        let n = self.with(false, |l, ep| l.send(ep, bufs))?;
        if n > 0 || bufs.iter().all(|b| b.is_empty()) {
            return Ok(n);
        }
        // Out of credit or slots: read the peer's credits and the completion queue, try again.
        self.read_credits()?;
        self.with(true, |l, ep| l.send(ep, bufs))
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.try_recv_vectored(buf, &mut [])
    }

    fn try_recv_vectored(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        let readable = self.with(false, |l, _| Ok(l.readable()))?;
        let done = self.with(!readable, |l, _| Ok(OfiLink::copy_out(l, a, b)))?;
        // Give the consumed slots back to the provider now (and tell the peer), so its next
        // messages can land while the engine works.
        if done > 0 {
            self.repost_and_grant()?;
        }
        Ok(done)
    }

    fn supports_in_place(&self) -> bool {
        true
    }

    fn recv_in_place(&mut self, max: usize, f: &mut dyn FnMut(&[u8], &[u8]) -> usize) -> Result<Option<usize>> {
        let readable = self.with(false, |l, _| Ok(l.readable()))?;
        let used = self.with(!readable, |l, _| {
            let (seq, from) = (l.recv_seq, l.rx_off);
            let Some(a) = l.ready(seq, from) else { return Ok(0) };
            let a = &a[..a.len().min(max)];
            let b = if a.len() < max { l.ready(seq + 1, 0).map(|b| &b[..b.len().min(max - a.len())]) } else { None };
            let used = f(a, b.unwrap_or(&[]));
            l.consume(used);
            Ok(used)
        })?;
        if used > 0 {
            self.repost_and_grant()?;
        }
        Ok(Some(used))
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.sock.as_raw_fd())
    }

    fn poll_set(&self, interest: Interest, out: &mut Vec<libc::pollfd>) -> bool {
        // The socket (credits, end-of-file), the progress thread's wake-ups, and, to read, the
        // provider's own descriptor (so arriving data wakes without the thread's hop).
        out.push(libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        out.push(libc::pollfd { fd: self.wake, events: libc::POLLIN, revents: 0 });
        let wait_fd = self.rails[0].rail.core.wait_fd;
        if interest.read && wait_fd >= 0 {
            out.push(libc::pollfd { fd: wait_fd, events: libc::POLLIN, revents: 0 });
        }
        true
    }

    fn arm(&mut self, interest: Interest) -> Result<bool> {
        drain_fd(self.wake);
        let alive = self.read_credits()?;
        // Receives the provider had no room for, and a credit the socket had no room for.
        self.repost_and_grant()?;
        let wait_fd = self.rails[0].rail.core.wait_fd;
        let ready = self.with(true, |l, ep| {
            if (interest.read && l.readable()) || (interest.write && l.can_send()) {
                return Ok(true);
            }
            if l.rx_repost.iter().any(Option::is_some) {
                return Ok(true);
            }
            // SAFETY: a valid endpoint, used under the rail's lock.
            if wait_fd >= 0 && unsafe { sys::oxccl_ofi_trywait(ep) } != 0 {
                return Ok(true);
            }
            l.armed = true;
            Ok(false)
        })?;
        if ready {
            return Ok(false);
        }
        if !alive {
            return Err(self.remote("closed the connection (process exited or failed)"));
        }
        Ok(true)
    }

    fn describe(&self) -> String {
        format!("rank {} ({}, OFI {})", self.peer_rank, self.peer_addr, self.provider)
    }

    fn shutdown(&self) {
        self.down.store(true, Ordering::Relaxed);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for OfiLink {
    fn drop(&mut self) {
        let down = self.down.load(Ordering::Relaxed);
        // Sends the engine counted as sent may still be in the provider's hands: let them
        // complete (bounded) before the link's receives are withdrawn, as a socket's buffer
        // would.
        let end = Instant::now() + if down { Duration::ZERO } else { self.linger };
        let settle = Instant::now() + Duration::from_secs(1);
        let on = &self.rails[0];
        let mut cancelled = false;
        loop {
            let mut st = on.rail.core.lock();
            let mut woken = Vec::new();
            st.progress(&mut woken);
            let ep = st.ep();
            let Some(l) = st.peers.get_mut(&on.id) else { break };
            let now = Instant::now();
            if !cancelled && (l.in_flight == 0 || l.error.is_some() || now >= end) {
                l.closing = true;
                l.armed = false;
                l.wake = -1;
                l.cancel_all(ep);
                cancelled = true;
            }
            if cancelled && (l.idle() || now >= settle.max(end)) {
                let kept = (!l.idle()).then(|| l.staging_bytes());
                st.reap();
                if let Some(bytes) = kept {
                    crate::info!(
                        "{}: the closed OFI link keeps its {} KiB of staging until the provider returns its operations (endpoint shared, not closed)",
                        self.describe(),
                        bytes >> 10
                    );
                }
                break;
            }
            drop(st);
            std::thread::sleep(Duration::from_micros(200));
        }
        // SAFETY: ours, closed once; the link's state no longer signals it (wake = -1).
        unsafe { libc::close(self.wake) };
    }
}

#[cfg(test)]
#[path = "link_tests.rs"]
mod tests;
