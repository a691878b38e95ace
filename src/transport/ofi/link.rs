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
pub use super::peer::{LinkRx, PeerAddr};
pub use super::rail::Rail;
use super::sys;
use crate::error::{Error, Result};
use crate::transport::{Interest, Link};
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// The last credit written to the peer for this rail.
    granted: u64,
}

/// Credits name their rail in the top byte; the sequence number is below it.
const CREDIT_RAIL_SHIFT: u32 = 56;

/// A link to one peer through libfabric, over one rail or striped over several.
pub struct OfiLink {
    /// The rails the link uses: the NIC of the pair's connection first, then one per further
    /// rail pair both ends opened.
    rails: Vec<OnRail>,
    /// Message `k` of the stream goes on rail `cycle[k % cycle.len()]` (the same at both ends).
    cycle: Vec<u8>,
    /// Messages of the stream sent, and fully received, so far.
    send_msg: u64,
    recv_msg: u64,
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
}

/// Reads the completion queue of a rail (which also makes the provider progress), waking the
/// links that got completions, except `skip` (the caller).
fn progress(st: &mut super::rail::State, skip: u64) {
    let mut woken = Vec::new();
    st.progress(&mut woken);
    for id in woken.iter().filter(|id| **id != skip) {
        if let Some(l) = st.peers.get_mut(id) {
            l.wake();
        }
    }
}

impl OfiLink {
    /// A link to `peer` over `rails`, each with the peer's address inserted into that rail's
    /// address vector, the stream's messages spread over them by `cycle` (one entry per rail
    /// index; `[0]` for one rail); messages of at most `chunk` bytes, `depth` in flight each way
    /// per rail; `sock` is the pair's connection, kept for credits and its end-of-file. Posts
    /// the first receives and grants them to the peer.
    pub fn new(
        rails: Vec<(Arc<Rail>, PeerAddr)>,
        cycle: Vec<u8>,
        chunk: usize,
        depth: usize,
        sock: TcpStream,
        peer_rank: usize,
        linger: Duration,
    ) -> Result<OfiLink> {
        if rails.is_empty() || cycle.is_empty() || cycle.iter().any(|&r| r as usize >= rails.len()) {
            return Err(Error::internal("an ofi link with no rails or a stripe cycle outside them"));
        }
        sock.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
        let peer_addr = sock.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let wake = eventfd()?;
        let provider = rails[0].0.provider.clone();
        let mut link = OfiLink {
            rails: Vec::with_capacity(rails.len()),
            cycle,
            send_msg: 0,
            recv_msg: 0,
            wake,
            sock,
            peer_rank,
            peer_addr,
            provider,
            down: AtomicBool::new(false),
            linger,
            credit_in: [0; 8],
            credit_got: 0,
        };
        // From here the link's drop withdraws what was posted (and closes `wake`).
        for (rail, peer) in rails {
            let mut st = rail.core.lock();
            let id = st.next_id();
            let mut l = LinkRx::new(&st, rail.mr_local, id, peer, chunk, depth, wake)?;
            let posted = l.repost(st.ep());
            st.peers.insert(id, l);
            link.rails.push(OnRail { rail: rail.clone(), id, granted: 0 });
            if posted? {
                st.requeue_drains()?;
            }
        }
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

    /// The rail of message `k` of the stream.
    fn rail_of(&self, k: u64) -> usize {
        self.cycle[(k % self.cycle.len() as u64) as usize] as usize
    }

    /// Runs `f` on this link's state in rail `r`, after reading the completion queue when
    /// `progress` (waking the other links that got completions).
    fn with<T>(&self, r: usize, progress: bool, f: impl FnOnce(&mut LinkRx, *mut sys::Ep) -> Result<T>) -> Result<T> {
        let on = &self.rails[r];
        let mut st = on.rail.core.lock();
        if progress {
            self::progress(&mut st, on.id);
        }
        let ep = st.ep();
        let l = st.peers.get_mut(&on.id).ok_or_else(|| Error::internal("ofi link state missing"))?;
        let r = l.check().and_then(|_| f(l, ep));
        r.map_err(|e| self.wrap(e))
    }

    /// Posts the receives that are due on every rail, moves the drains behind them and tells
    /// the peer.
    fn repost_and_grant(&mut self) -> Result<()> {
        for on in &self.rails {
            let mut st = on.rail.core.lock();
            let ep = st.ep();
            let l = st.peers.get_mut(&on.id).ok_or_else(|| Error::internal("ofi link state missing"))?;
            if l.repost(ep).map_err(|e| self.wrap(e))? {
                st.requeue_drains()?;
            }
        }
        self.grant()
    }

    /// Writes the peer's new credit of each rail where it grew (later, on the next call, if the
    /// socket is full). A credit is 8 bytes, big-endian: the rail's index in the top byte, the
    /// first sequence number not posted on that rail below it.
    fn grant(&mut self) -> Result<()> {
        for r in 0..self.rails.len() {
            let upto = self.with(r, false, |l, _| Ok(l.posted_below()))?;
            if upto <= self.rails[r].granted {
                continue;
            }
            let b = ((r as u64) << CREDIT_RAIL_SHIFT | upto).to_be_bytes();
            // SAFETY: sends 8 bytes from a valid array on our socket; MSG_NOSIGNAL: a closed
            // peer is an error code, never SIGPIPE (a host program may not ignore it).
            let n = unsafe {
                libc::send(self.sock.as_raw_fd(), b.as_ptr().cast(), 8, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
            };
            if n == 8 {
                self.rails[r].granted = upto;
                continue;
            }
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                // Full (written on a later call) or interrupted.
                ErrorKind::WouldBlock | ErrorKind::Interrupted if n < 0 => Ok(()),
                // The peer is gone: what it sent can still be read; its end-of-file tells the rest.
                ErrorKind::BrokenPipe | ErrorKind::ConnectionReset if n < 0 => Ok(()),
                _ if n >= 0 => Err(self.remote("connection failed: a short write of a credit")),
                _ => Err(self.remote(&format!("connection failed: {e}"))),
            };
        }
        Ok(())
    }

    /// Reads credits from the socket; `Ok(false)` once the peer closed it.
    fn read_credits(&mut self) -> Result<bool> {
        let mut buf = [0u8; 256];
        let mut best = vec![0u64; self.rails.len()];
        let alive = loop {
            match (&self.sock).read(&mut buf) {
                Ok(0) => break false,
                Ok(n) => {
                    for &b in &buf[..n] {
                        self.credit_in[self.credit_got] = b;
                        self.credit_got += 1;
                        if self.credit_got == 8 {
                            let v = u64::from_be_bytes(self.credit_in);
                            let r = (v >> CREDIT_RAIL_SHIFT) as usize;
                            let Some(best) = best.get_mut(r) else {
                                return Err(self.remote(&format!(
                                    "sent a credit for rail {r} of a link with {}",
                                    self.rails.len()
                                )));
                            };
                            *best = (*best).max(v & ((1 << CREDIT_RAIL_SHIFT) - 1));
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
        for (r, &b) in best.iter().enumerate().filter(|(_, b)| **b > 0) {
            self.with(r, false, |l, _| {
                l.credit = l.credit.max(b);
                Ok(())
            })?;
        }
        Ok(alive)
    }

    /// The provider's name.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// How many rails the link stripes its messages over.
    pub fn rails(&self) -> usize {
        self.rails.len()
    }

    /// Whether the provider gave every rail's completion queue a wait descriptor (else the
    /// progress threads poll them every millisecond).
    pub fn has_wait_fd(&self) -> bool {
        self.rails.iter().all(|on| on.rail.core.wait_fd >= 0)
    }

    /// Copies the stream's next bytes into `a`, then `b`, message by message from the rail each
    /// comes on; reads the completion queue of a rail whose next message has not arrived.
    fn copy_out(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        let mut done = 0;
        let mut progressed = vec![false; self.rails.len()];
        for dst in [a, b] {
            let mut off = 0;
            while off < dst.len() {
                let r = self.rail_of(self.recv_msg);
                let once = |progress: bool, dst: &mut [u8]| {
                    self.with(r, progress, |l, _| {
                        let (seq, from) = (l.recv_seq, l.rx_off);
                        let Some(src) = l.ready(seq, from) else { return Ok((0, 0)) };
                        let k = src.len().min(dst.len());
                        dst[..k].copy_from_slice(&src[..k]);
                        l.consume(k);
                        Ok((k, l.recv_seq - seq))
                    })
                };
                let (mut k, mut msgs) = once(false, &mut dst[off..])?;
                if k == 0 && !progressed[r] {
                    progressed[r] = true;
                    (k, msgs) = once(true, &mut dst[off..])?;
                }
                self.recv_msg += msgs;
                if k == 0 {
                    return Ok(done + off);
                }
                off += k;
            }
            done += off;
        }
        Ok(done)
    }

    /// Zero-copy read of the stream's next bytes: the current message and, where it ends
    /// before `max`, the next one (on its own rail, locked too: rails are locked in the order
    /// of their position in memory, as every link does, so two engines cannot wait on each
    /// other).
    fn in_place(&mut self, max: usize, f: &mut dyn FnMut(&[u8], &[u8]) -> usize) -> Result<usize> {
        let (r1, r2) = (self.rail_of(self.recv_msg), self.rail_of(self.recv_msg + 1));
        let readable = self.with(r1, false, |l, _| Ok(l.readable()))?;
        if r1 == r2 {
            let used = self.with(r1, !readable, |l, _| {
                let (seq, from) = (l.recv_seq, l.rx_off);
                let Some(a) = l.ready(seq, from) else { return Ok((0, 0)) };
                let a = &a[..a.len().min(max)];
                let b =
                    if a.len() < max { l.ready(seq + 1, 0).map(|b| &b[..b.len().min(max - a.len())]) } else { None };
                let used = f(a, b.unwrap_or(&[]));
                l.consume(used);
                Ok((used, l.recv_seq - seq))
            })?;
            self.recv_msg += used.1;
            return Ok(used.0);
        }
        if !readable {
            self.with(r1, true, |_, _| Ok(()))?;
        }
        let (o1, o2) = (&self.rails[r1], &self.rails[r2]);
        let first_is_1 = Arc::as_ptr(&o1.rail.core) < Arc::as_ptr(&o2.rail.core);
        let (mut g1, mut g2);
        if first_is_1 {
            g1 = o1.rail.core.lock();
            g2 = o2.rail.core.lock();
        } else {
            g2 = o2.rail.core.lock();
            g1 = o1.rail.core.lock();
        }
        let missing = || Error::internal("ofi link state missing");
        let l1 = g1.peers.get_mut(&o1.id).ok_or_else(missing)?;
        let l2 = g2.peers.get_mut(&o2.id).ok_or_else(missing)?;
        l1.check().and_then(|_| l2.check()).map_err(|e| self.wrap(e))?;
        let (seq1, seq2) = (l1.recv_seq, l2.recv_seq);
        let Some(a) = l1.ready(seq1, l1.rx_off) else { return Ok(0) };
        let a = &a[..a.len().min(max)];
        let b = if a.len() < max { l2.ready(seq2, l2.rx_off).map(|b| &b[..b.len().min(max - a.len())]) } else { None };
        let (alen, blen) = (a.len(), b.map_or(0, <[u8]>::len));
        let used = f(a, b.unwrap_or(&[])).min(alen + blen);
        l1.consume(used.min(alen));
        // Bytes of the next message only once the current one is used up.
        let rest = used - used.min(alen);
        if rest > 0 {
            l2.consume(rest);
        }
        self.recv_msg += (l1.recv_seq - seq1) + (l2.recv_seq - seq2);
        Ok(used)
    }

    /// Withdraws the link from one rail: lets its sends complete until `end`, then cancels its
    /// receives and gives the provider 1 s to return them.
    fn leave(&self, on: &OnRail, end: Instant) {
        // Set when the receives are withdrawn: the provider then has 1 s to return them.
        let mut cancelled: Option<Instant> = None;
        loop {
            let mut st = on.rail.core.lock();
            let mut woken = Vec::new();
            st.progress(&mut woken);
            let ep = st.ep();
            let Some(l) = st.peers.get_mut(&on.id) else { break };
            let now = Instant::now();
            if cancelled.is_none() && (l.in_flight == 0 || l.error.is_some() || now >= end) {
                l.closing = true;
                l.armed = false;
                l.wake = -1;
                l.cancel_all(ep);
                cancelled = Some(now + Duration::from_secs(1));
            }
            if cancelled.is_some_and(|settle| l.idle() || now >= settle) {
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
    }
}

impl Link for OfiLink {
    fn try_send(&mut self, buf: &[u8]) -> Result<usize> {
        self.try_send_vectored(&[buf])
    }

    fn try_send_vectored(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        let r = self.rail_of(self.send_msg);
        let mut n = self.with(r, false, |l, ep| l.send(ep, bufs))?;
        if n == 0 && !bufs.iter().all(|b| b.is_empty()) {
            // Out of credit or slots: read the peer's credits and the completion queue, try again.
            self.read_credits()?;
            n = self.with(r, true, |l, ep| l.send(ep, bufs))?;
        }
        if n > 0 {
            self.send_msg += 1;
        }
        Ok(n)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.try_recv_vectored(buf, &mut [])
    }

    fn try_recv_vectored(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        let done = self.copy_out(a, b)?;
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
        let used = self.in_place(max, f)?;
        if used > 0 {
            self.repost_and_grant()?;
        }
        Ok(Some(used))
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.sock.as_raw_fd())
    }

    fn poll_set(&self, interest: Interest, out: &mut Vec<libc::pollfd>) -> bool {
        // The socket (credits, end-of-file), the progress threads' wake-ups, and, to read, the
        // providers' own descriptors (so arriving data wakes without the thread's hop).
        out.push(libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        out.push(libc::pollfd { fd: self.wake, events: libc::POLLIN, revents: 0 });
        if interest.read {
            for on in &self.rails {
                let wait_fd = on.rail.core.wait_fd;
                if wait_fd >= 0 && !out.iter().any(|p| p.fd == wait_fd) {
                    out.push(libc::pollfd { fd: wait_fd, events: libc::POLLIN, revents: 0 });
                }
            }
        }
        true
    }

    fn arm(&mut self, interest: Interest) -> Result<bool> {
        drain_fd(self.wake);
        let alive = self.read_credits()?;
        // Receives the provider had no room for, and a credit the socket had no room for.
        self.repost_and_grant()?;
        let (rr, sr) = (self.rail_of(self.recv_msg), self.rail_of(self.send_msg));
        for r in 0..self.rails.len() {
            let wait_fd = self.rails[r].rail.core.wait_fd;
            let ready = self.with(r, true, |l, ep| {
                if (interest.read && r == rr && l.readable()) || (interest.write && r == sr && l.can_send()) {
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
        for on in &self.rails {
            self.leave(on, end);
        }
        // SAFETY: ours, closed once; the link's states no longer signal it (wake = -1).
        unsafe { libc::close(self.wake) };
    }
}

#[cfg(test)]
#[path = "link_tests.rs"]
mod tests;
