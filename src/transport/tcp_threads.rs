//! TCP links whose sockets are driven by helper threads (`OXCCL_NTHREADS`), as NCCL's socket
//! transport does with `NCCL_SOCKET_NTHREADS`.
//!
//! The wire format is the one of [`super::tcp::TcpLink`]: one ordered stream striped over the
//! link's sockets in units of the agreed stripe, so an end with helper threads talks to an end
//! without them. What changes is who makes the system calls. Each socket has two in-process
//! [`ring`](super::ring)s, one per direction. The engine copies outgoing bytes into the send
//! ring of the socket the stream position maps to, and reads (or reduces in place) incoming
//! bytes out of the receive rings, without a system call. `T` helpers each own the sockets
//! `s` with `s mod T = t`; a helper is a sender thread and a receiver thread, both using
//! blocking I/O straight from and into the rings.
//!
//! **Ordering.** A thread owning several sockets always works on the one whose next stripe
//! comes first in the stream, and never reads or writes past that stripe's end. Then the
//! earliest stripe not yet delivered is always being worked on by both ends (every earlier
//! stripe is done), so blocking calls cannot wait on each other in a cycle, whatever the
//! peer's thread count.
//!
//! **Wake-ups.** The rings' sleep flags (Dekker, see [`super::ring`]) decide who wakes whom:
//! a helper with nothing to do parks, and the engine unparks it after moving bytes; the
//! engine sleeps in poll(2) on an `eventfd` that a helper writes after moving bytes the
//! engine announced it is waiting for, or when a socket fails.
//!
//! **Failover.** A link with several rails keeps each sent byte in its send ring until the
//! peer's kernel acknowledged it, and moves the sockets of a rail that stops moving data to
//! spare connections on the other rails (`tcp_threads/failover.rs`, [`RailPlan`]); links with
//! one rail are unchanged.
//!
//! **End of life.** A failing socket closes its rings after the bytes already read, so the
//! engine reads everything the peer sent before it sees the error.
//! Dropping the link first lets the send rings drain (bounded by the communicator timeout,
//! at most 30 s), as closing a socket lets its kernel buffer drain; then it shuts the sockets
//! and joins the threads.

mod failover;
mod worker;

use super::ring::{Consumer, HeapRing, Producer};
use super::tcp::Layout;
use super::{Interest, Link};
use crate::error::{Error, Result};
pub use failover::{spare_rail, RailPlan};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};
use worker::{recv_loop, ring_capacity, send_loop, Owned, Shared};

/// Most helper threads per peer.
pub const MAX_THREADS: usize = crate::config::MAX_THREADS;

/// Largest single send(2) or recv(2) of a helper: ring room is freed (and filled) in pieces
/// of this size, so the engine and the helper overlap.
const CHUNK: usize = 256 << 10;

/// A stripe's last bytes, when fewer than this, are joined with the next stripe's first ones
/// for in-place reductions (more than the largest element, 16 bytes).
const STRADDLE: usize = 16;

/// How long dropping a link that was shut down (after a failure) waits for its senders to
/// hand over what the engine already counted as sent.
const SHUTDOWN_FLUSH: Duration = Duration::from_millis(500);

/// A data connection to one peer over one or several sockets, driven by helper threads.
pub struct ThreadedTcpLink {
    // Field order: the ring ends go before the rings they point into (`_rings`).
    tx: Vec<Producer>,
    rx: Vec<Consumer>,
    layout: Layout,
    sent: u64,
    received: u64,
    /// Thread of the sender and of the receiver serving socket `s` at `[s % threads]`.
    senders: Vec<Thread>,
    receivers: Vec<Thread>,
    joins: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
    peer_rank: usize,
    peer_addr: String,
    /// Bytes of each send ring.
    cap: usize,
    /// Longest a drop waits for the send rings to drain on a healthy link.
    linger: Duration,
    /// Links with several rails: the failover state shared with the helpers and the watcher.
    ctl: Option<Arc<failover::Ctl>>,
    _rings: Vec<Arc<HeapRing>>,
}

impl ThreadedTcpLink {
    /// A link over `socks` (in the same order at both ends), striping the stream in units of
    /// `stripe` bytes, with `threads` helpers (at least 1, at most the sockets); dropping it
    /// waits up to `linger` for the bytes counted as sent to reach the peer (the communicator's
    /// timeout, at most 30 s).
    pub fn new(
        socks: Vec<TcpStream>,
        stripe: usize,
        peer_rank: usize,
        threads: usize,
        linger: Duration,
    ) -> Result<ThreadedTcpLink> {
        let n = socks.len();
        let layout = Layout::round_robin(n, stripe.max(super::tcp::MIN_STRIPE));
        Self::with_layout(socks, layout, peer_rank, threads, linger)
    }

    /// As [`ThreadedTcpLink::new`], the stream cut over the sockets as `layout` says.
    pub(super) fn with_layout(
        socks: Vec<TcpStream>,
        layout: Layout,
        peer_rank: usize,
        threads: usize,
        linger: Duration,
    ) -> Result<ThreadedTcpLink> {
        Self::with_rails(socks, layout, peer_rank, threads, linger, None)
    }

    /// As [`ThreadedTcpLink::with_layout`]; with `rails`, data socket `s` runs on rail
    /// `s mod rails.rails` and a dead rail's sockets move to their spares ([`failover`]).
    pub(super) fn with_rails(
        socks: Vec<TcpStream>,
        layout: Layout,
        peer_rank: usize,
        threads: usize,
        linger: Duration,
        rails: Option<RailPlan>,
    ) -> Result<ThreadedTcpLink> {
        let n = socks.len();
        if rails.as_ref().is_some_and(|r| r.rails < 2 || r.spares.len() != n * (r.rails - 1)) {
            return Err(Error::internal("a TCP link's rails need a spare per socket on every other rail"));
        }
        if n == 0 || n > super::tcp::MAX_SOCKS || n as u64 != layout.nsocks {
            return Err(Error::internal(format!("a TCP link needs 1 to {} sockets, got {n}", super::tcp::MAX_SOCKS)));
        }
        let threads = threads.clamp(1, n.min(MAX_THREADS));
        let stripe = layout.stripe as usize;
        let peer_addr = socks[0].peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let shared = Arc::new(Shared::new(&socks, rails.is_some())?);
        let ctl = match &rails {
            Some(plan) => {
                for s in &plan.spares {
                    super::tcp::tune(s)?;
                }
                Some(Arc::new(
                    failover::Ctl::new(&socks, plan, peer_rank).map_err(|e| Error::from_io("dup of a socket", e))?,
                ))
            }
            None => None,
        };
        let rx_cap = ring_capacity(n, stripe);
        // With several rails a send ring also keeps what the kernel sent until it is
        // acknowledged: room for a socket buffer of that on top, so the window stays as wide.
        let cap = match &rails {
            Some(_) => (rx_cap + failover::send_buffer(&socks[0])).next_power_of_two(),
            None => rx_cap,
        };
        let rings: Vec<Arc<HeapRing>> =
            (0..2 * n).map(|i| Arc::new(HeapRing::new(if i % 2 == 0 { cap } else { rx_cap }))).collect();
        let (mut tx, mut rx) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut outs: Vec<Vec<Owned<Consumer>>> = (0..threads).map(|_| Vec::new()).collect();
        let mut ins: Vec<Vec<Owned<Producer>>> = (0..threads).map(|_| Vec::new()).collect();
        for (s, sock) in socks.into_iter().enumerate() {
            // SAFETY: each ring gets exactly one producer and one consumer, here; the rings are
            // kept alive by `_rings` (the link) and by each helper's clone of the list until the
            // ends are gone (the link's fields drop ends before rings; helpers drop theirs on exit).
            let ((p_out, c_out), (p_in, c_in)) = unsafe { (rings[2 * s].ends(), rings[2 * s + 1].ends()) };
            let back = sock.try_clone().map_err(|e| Error::from_io("dup of a socket", e))?;
            tx.push(p_out);
            rx.push(c_in);
            let fo = failover::HelperState::default;
            outs[s % threads].push(Owned { index: s, sock, end: c_out, moved: 0, live: true, fo: fo() });
            ins[s % threads].push(Owned { index: s, sock: back, end: p_in, moved: 0, live: true, fo: fo() });
        }
        let mut link = ThreadedTcpLink {
            tx,
            rx,
            layout,
            sent: 0,
            received: 0,
            senders: Vec::new(),
            receivers: Vec::new(),
            joins: Vec::new(),
            shared,
            peer_rank,
            peer_addr,
            cap,
            linger,
            ctl,
            _rings: rings,
        };
        link.start_helpers(outs, ins)?;
        if let Some(plan) = rails {
            link.start_watcher(plan)?;
        }
        Ok(link)
    }

    /// Starts the helpers: thread `t` sends `outs[t]`'s sockets and receives `ins[t]`'s.
    fn start_helpers(&mut self, outs: Vec<Vec<Owned<Consumer>>>, ins: Vec<Vec<Owned<Producer>>>) -> Result<()> {
        let (layout, peer_rank) = (self.layout, self.peer_rank);
        let who = format!("rank {peer_rank} ({})", self.peer_addr);
        for (t, (out, inn)) in outs.into_iter().zip(ins).enumerate() {
            let spawn = |dir: &str, f: Box<dyn FnOnce() + Send>| {
                std::thread::Builder::new()
                    .name(format!("oxccl-{dir}{t}-r{peer_rank}"))
                    .stack_size(256 << 10)
                    .spawn(f)
                    .map_err(|e| Error::from_io("spawning a TCP helper thread", e))
            };
            // Each thread holds the rings until its ring ends are gone (dropped inside the loop).
            let (shared, who2, keep, ctl) = (self.shared.clone(), who.clone(), self._rings.clone(), self.ctl.clone());
            self.shared.senders.fetch_add(1, Ordering::AcqRel);
            let h = spawn(
                "tx",
                Box::new(move || {
                    let _keep = keep;
                    match ctl {
                        Some(ctl) => failover::send_loop(out, layout, shared, ctl, who2),
                        None => send_loop(out, layout, shared, who2),
                    }
                }),
            )
            .inspect_err(|_| {
                self.shared.senders.fetch_sub(1, Ordering::AcqRel);
            })?;
            self.senders.push(h.thread().clone());
            self.joins.push(h);
            let (shared, who2, keep, ctl) = (self.shared.clone(), who.clone(), self._rings.clone(), self.ctl.clone());
            let h = spawn(
                "rx",
                Box::new(move || {
                    let _keep = keep;
                    match ctl {
                        Some(ctl) => failover::recv_loop(inn, layout, shared, ctl, who2),
                        None => recv_loop(inn, layout, shared, who2),
                    }
                }),
            )?;
            self.receivers.push(h.thread().clone());
            self.joins.push(h);
        }
        Ok(())
    }

    /// Starts the watcher of a link with several rails ([`failover::watch`]).
    fn start_watcher(&mut self, plan: RailPlan) -> Result<()> {
        let Some(ctl) = self.ctl.clone() else { return Ok(()) };
        let (shared, peer_rank) = (self.shared.clone(), self.peer_rank);
        let who = format!("rank {peer_rank} ({})", self.peer_addr);
        let h = std::thread::Builder::new()
            .name(format!("oxccl-rails-r{peer_rank}"))
            .stack_size(256 << 10)
            .spawn(move || failover::watch(ctl, shared, plan.spares, peer_rank, who))
            .map_err(|e| Error::from_io("spawning a TCP rail watcher", e))?;
        self.joins.push(h);
        Ok(())
    }

    /// Names the link's rails after its address in messages (`10.0.0.2:4000 over eth0, eth1`).
    pub(super) fn over_rails(mut self, rails: &str) -> Self {
        self.peer_addr = format!("{} over {rails}", self.peer_addr);
        self
    }

    fn threads(&self) -> usize {
        self.senders.len().max(1)
    }

    fn remote(&self, what: &str) -> Error {
        Error::remote(format!("peer rank {} ({}) {what}", self.peer_rank, self.peer_addr))
    }

    /// The error for a failed ring: the helper's reason, or a shutdown.
    fn failed(&self) -> Error {
        match self.shared.error_text() {
            Some(t) => Error::remote(t),
            None => self.remote("shut the link down"),
        }
    }

    /// Wakes the sender of socket `s` when it sleeps waiting for bytes.
    fn kick_sender(&self, s: usize) {
        if self.tx[s].take_reader_asleep() {
            if let Some(t) = self.senders.get(s % self.threads()) {
                t.unpark();
            }
        }
    }

    /// Wakes the receiver of socket `s` when it sleeps waiting for room.
    fn kick_receiver(&self, s: usize) {
        if self.rx[s].take_writer_asleep() {
            if let Some(t) = self.receivers.get(s % self.threads()) {
                t.unpark();
            }
        }
    }

    /// Whether every send ring is empty (all bytes handed to the kernel), or no sender is left.
    fn flushed(&mut self) -> bool {
        let cap = self.cap;
        self.shared.senders.load(Ordering::Acquire) == 0 || self.tx.iter_mut().all(|p| p.writable() == cap)
    }

    /// Waits until [`ThreadedTcpLink::flushed`] or `deadline`.
    fn flush_until(&mut self, deadline: Instant) {
        let mut pause = Duration::from_micros(20);
        while !self.flushed() && Instant::now() < deadline {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// [`Link::recv_in_place`] where the current stripe (on socket `s`) has only `room` bytes
    /// left: they are copied out (at most [`STRADDLE`] bytes) and shown first, followed by the
    /// readable start of the next stripe's socket, so that an element split by the stripe
    /// boundary can be used; only once the whole rest of this stripe is there.
    fn recv_across(
        &mut self,
        s: usize,
        room: usize,
        max: usize,
        f: &mut dyn FnMut(&[u8], &[u8]) -> usize,
    ) -> Result<usize> {
        let mut head = [0u8; STRADDLE];
        if self.rx[s].readable() < room {
            if self.rx[s].closed() && self.rx[s].readable() < room {
                return Err(self.failed());
            }
            return Ok(0);
        }
        {
            let (a, b) = self.rx[s].peek();
            let na = a.len().min(room);
            head[..na].copy_from_slice(&a[..na]);
            head[na..room].copy_from_slice(&b[..room - na]);
        }
        let (next, _) = self.layout.slot(self.received + room as u64);
        let closed = self.rx[next].closed();
        let (a, _) = self.rx[next].peek();
        let nb = a.len().min(max - room);
        let used = f(&head[..room], &a[..nb]).min(room + nb);
        let (from_s, from_next) = (used.min(room), used.saturating_sub(room));
        if used == 0 && closed {
            // Closed before the look: nothing more will come to complete the element.
            return Err(self.failed());
        }
        if from_s > 0 {
            self.rx[s].consume(from_s);
            self.kick_receiver(s);
        }
        if from_next > 0 {
            self.rx[next].consume(from_next);
            self.kick_receiver(next);
        }
        self.received += used as u64;
        Ok(used)
    }

    /// Stops the link: the engine's next transfer fails; receivers stop (their sockets' read
    /// sides are shut, which ends blocked reads); senders hand over what the send rings still
    /// hold, then end the stream (see [`send_loop`]; `Drop` bounds the wait).
    fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        for p in &self.tx {
            p.close();
        }
        for c in &self.rx {
            c.close();
        }
        for s in &self.shared.socks {
            let _ = s.shutdown(std::net::Shutdown::Read);
        }
        if let Some(ctl) = &self.ctl {
            ctl.shutdown();
        }
        for t in self.senders.iter().chain(&self.receivers) {
            t.unpark();
        }
    }
}

impl Shared {
    /// The state shared with the helpers of a link over `socks`: a wake-up eventfd and each
    /// socket's clone, made blocking with no timeouts.
    fn new(socks: &[TcpStream], rails: bool) -> Result<Shared> {
        // SAFETY: eventfd with flags only; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::from_io("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let event = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut clones = Vec::with_capacity(socks.len());
        for s in socks {
            super::tcp::tune(s)?;
            s.set_nonblocking(false).map_err(|e| Error::from_io("set_nonblocking", e))?;
            // The handshake left a receive timeout on the socket; helpers block without one
            // (the engine owns the timeout, and shutting the socket ends a blocked call).
            // With several rails they wake every `failover::TICK` to look at the failover state.
            if rails {
                failover::tick_timeouts(s).map_err(|e| Error::from_io("socket timeouts", e))?;
            } else {
                s.set_read_timeout(None).map_err(|e| Error::from_io("SO_RCVTIMEO", e))?;
                s.set_write_timeout(None).map_err(|e| Error::from_io("SO_SNDTIMEO", e))?;
            }
            clones.push(s.try_clone().map_err(|e| Error::from_io("dup of a socket", e))?);
        }
        Ok(Shared {
            event,
            error: Mutex::new(None),
            stop: AtomicBool::new(false),
            socks: clones,
            senders: std::sync::atomic::AtomicUsize::new(0),
        })
    }
}

impl Drop for ThreadedTcpLink {
    fn drop(&mut self) {
        // Bytes the engine counts as sent must reach the peer, as with a closed socket: up to
        // `linger` on a healthy link, a short grace after a failure.
        let limit = if self.shared.stop.load(Ordering::Acquire) { SHUTDOWN_FLUSH } else { self.linger };
        self.flush_until(Instant::now() + limit);
        self.stop();
        for s in &self.shared.socks {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for h in self.joins.drain(..) {
            let _ = h.join();
        }
    }
}

impl Link for ThreadedTcpLink {
    fn try_send(&mut self, buf: &[u8]) -> Result<usize> {
        let (layout, mut pos) = (self.layout, self.sent);
        let r = layout.pieces(buf.len(), &mut pos, |s, r| {
            if self.tx[s].closed() {
                return Err(self.failed());
            }
            let n = self.tx[s].write(&buf[r]);
            if n > 0 {
                self.kick_sender(s);
            }
            Ok(n)
        });
        self.sent = pos;
        r
    }

    fn try_send_vectored(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        let mut total = 0;
        for b in bufs {
            let n = self.try_send(b)?;
            total += n;
            if n < b.len() {
                break;
            }
        }
        Ok(total)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        let (layout, mut pos) = (self.layout, self.received);
        let r = layout.pieces(buf.len(), &mut pos, |s, r| {
            let first = r.start == 0;
            let dst = &mut buf[r];
            let mut n = self.rx[s].read(dst);
            if n == 0 && self.rx[s].closed() {
                // The close is ordered after the last bytes: look once more before failing (a
                // later piece returns what the earlier ones read, and fails on the next call).
                n = self.rx[s].read(dst);
                if n == 0 && first {
                    return Err(self.failed());
                }
            }
            if n > 0 {
                self.kick_receiver(s);
            }
            Ok(n)
        });
        self.received = pos;
        r
    }

    fn try_recv_vectored(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        let n = self.try_recv(a)?;
        if n < a.len() || b.is_empty() {
            return Ok(n);
        }
        Ok(n + self.try_recv(b)?)
    }

    fn supports_in_place(&self) -> bool {
        true
    }

    fn recv_in_place(&mut self, max: usize, f: &mut dyn FnMut(&[u8], &[u8]) -> usize) -> Result<Option<usize>> {
        let (s, room) = self.layout.slot(self.received);
        if max > room && room < STRADDLE {
            // The stripe ends within a few bytes: an element may straddle it, so the view
            // joins this stripe's last bytes with the start of the next socket's stripe.
            return self.recv_across(s, room, max, f).map(Some);
        }
        let max = max.min(room);
        // A closed ring whose bytes cannot be used (none, or less than an element) fails;
        // the close is ordered after the last bytes, so look once more after seeing it.
        let mut looked_after_close = false;
        loop {
            let closed = self.rx[s].closed();
            let (a, b) = self.rx[s].peek();
            let na = a.len().min(max);
            let nb = b.len().min(max - na);
            let used = if na + nb == 0 { 0 } else { f(&a[..na], &b[..nb]).min(na + nb) };
            if used > 0 {
                self.rx[s].consume(used);
                self.received += used as u64;
                self.kick_receiver(s);
                return Ok(Some(used));
            }
            if max == 0 || !(closed || self.rx[s].closed()) {
                return Ok(Some(0));
            }
            if looked_after_close {
                return Err(self.failed());
            }
            looked_after_close = true;
        }
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.shared.event.as_raw_fd())
    }

    fn poll_events(&self, _interest: Interest) -> i16 {
        libc::POLLIN
    }

    fn arm(&mut self, interest: Interest) -> Result<bool> {
        self.shared.drain();
        if interest.read {
            let (s, room) = self.layout.slot(self.received);
            let ready = self.rx[s].announce_sleep();
            if self.rx[s].closed() {
                return Ok(false);
            }
            if room < STRADDLE && ready >= room {
                // The rest of this stripe is here but shorter than an element may be: an
                // in-place reduction waits for the next stripe's first bytes.
                let (next, _) = self.layout.slot(self.received + room as u64);
                if self.rx[next].announce_sleep() > 0 || self.rx[next].closed() {
                    return Ok(false);
                }
            } else if ready > 0 {
                return Ok(false);
            }
        }
        if interest.write {
            let (s, _) = self.layout.slot(self.sent);
            if self.tx[s].announce_sleep() > 0 || self.tx[s].closed() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn describe(&self) -> String {
        format!(
            "rank {} ({}, {} socket(s), {} helper thread(s))",
            self.peer_rank,
            self.peer_addr,
            self.rx.len(),
            self.threads()
        )
    }

    fn shutdown(&self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests;
