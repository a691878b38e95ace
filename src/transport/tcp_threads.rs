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
//! **End of life.** A failing socket closes its rings after the bytes already read, so the
//! engine reads everything the peer sent (an abort frame included) before it sees the error.
//! Dropping the link first lets the send rings drain (bounded by the communicator timeout,
//! at most 30 s), as closing a socket lets its kernel buffer drain; then it shuts the sockets
//! and joins the threads.

use super::ring::{Consumer, HeapRing, Producer};
use super::tcp::Layout;
use super::{Interest, Link};
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

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

/// Longest a helper stays parked before it looks again (a safety net; wake-ups are explicit).
const PARK: Duration = Duration::from_millis(100);

/// Deprecated-internal: helpers per peer for TCP links in this process's settings
/// ([`crate::config::Config::nthreads`]: `OXCCL_NTHREADS`, else `NCCL_SOCKET_NTHREADS`; NCCL's
/// `NCCL_NTHREADS` is its CUDA block size and is not read); 0 (the default) drives the sockets
/// from the engine's own thread ([`super::tcp::TcpLink`]). At most [`MAX_THREADS`], and never
/// more than the link's sockets. Links take a communicator's own value.
pub fn nthreads() -> usize {
    crate::config::process().nthreads
}

/// Data bytes of each ring: 4 MiB shared by the sockets, at least two stripes per socket.
fn ring_capacity(nsocks: usize, stripe: usize) -> usize {
    ((4usize << 20) / nsocks).max(2 * stripe).max(64 << 10).next_power_of_two()
}

/// What the engine and the helpers of one link share.
struct Shared {
    /// Written by helpers to wake the engine (poll(2)s it).
    event: OwnedFd,
    /// The first socket failure, for the engine's error message.
    error: Mutex<Option<String>>,
    /// Set when the link is shut down or dropped: helpers exit.
    stop: AtomicBool,
    /// The link's sockets (clones), for shutdown.
    socks: Vec<TcpStream>,
    /// Sender threads still running (a link whose senders are all gone has nothing to flush).
    senders: std::sync::atomic::AtomicUsize,
}

impl Shared {
    /// Wakes the engine (an eventfd counter increment; a full counter already wakes it).
    fn notify(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a local array to our eventfd.
        let _ = unsafe { libc::write(self.event.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Clears pending wake-ups.
    fn drain(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a local array from our nonblocking eventfd.
        let _ = unsafe { libc::read(self.event.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }

    /// Records a socket failure (the first one is kept) and wakes the engine.
    fn fail(&self, text: String) {
        let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_none() {
            *e = Some(text);
        }
        drop(e);
        self.notify();
    }

    fn error_text(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// One socket as a helper thread sees it: its index, its stream, and its ring end.
struct Owned<E> {
    index: usize,
    sock: TcpStream,
    end: E,
    /// Bytes moved on this socket so far.
    moved: u64,
    /// False once the socket failed (receivers go on serving their other sockets).
    live: bool,
}

/// What a helper thread needs of the stripe rule (shared with [`super::tcp::TcpLink`]).
impl Layout {
    /// For a socket that has moved `moved` of its own bytes: the stream index of its current
    /// stripe, and the bytes left in it.
    fn next(&self, index: usize, moved: u64) -> (u64, usize) {
        if self.nsocks == 1 {
            return (0, usize::MAX);
        }
        ((moved / self.stripe) * self.nsocks + index as u64, (self.stripe - moved % self.stripe) as usize)
    }

    /// Among `owned` (live ones only), the one whose current stripe comes first in the stream.
    fn first<E>(&self, owned: &[Owned<E>]) -> Option<usize> {
        (0..owned.len()).filter(|&k| owned[k].live).min_by_key(|&k| self.next(owned[k].index, owned[k].moved).0)
    }
}

/// Whether a blocking call's error only means "try again" (a signal, or a timeout that some
/// other code set on the socket).
fn retry(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Appends the bytes `a` then `b` to `kept`, keeping at most an abort frame's length.
fn remember(kept: &mut Vec<u8>, a: &[u8], b: &[u8]) {
    let max = crate::abort::MAX_FRAME;
    if b.len() >= max {
        crate::abort::keep_tail(kept, &b[b.len() - max..]);
        return;
    }
    crate::abort::keep_tail(kept, &a[a.len().saturating_sub(max - b.len())..]);
    crate::abort::keep_tail(kept, b);
}

/// Parks the calling helper until woken or [`PARK`] passes.
fn park() {
    std::thread::park_timeout(PARK);
}

/// A sender thread: moves bytes from the send rings of its sockets onto them, in stream order.
/// Once the link is shut down it still hands over the bytes the engine counted as sent (as a
/// socket's kernel buffer would), then ends the stream (FIN); a failed socket ends it at once.
fn send_loop(mut owned: Vec<Owned<Consumer>>, layout: Layout, shared: Arc<Shared>, peer: String) {
    if send_until_drained(&mut owned, layout, &shared, &peer) {
        for o in &owned {
            let _ = o.sock.shutdown(std::net::Shutdown::Write);
        }
    }
    shared.senders.fetch_sub(1, Ordering::AcqRel);
    shared.notify();
}

/// The body of [`send_loop`]: `true` when it stopped because the link was shut down and every
/// ring was drained, `false` on a socket failure.
fn send_until_drained(owned: &mut [Owned<Consumer>], layout: Layout, shared: &Shared, peer: &str) -> bool {
    while let Some(k) = layout.first(owned) {
        let (_, room) = layout.next(owned[k].index, owned[k].moved);
        let o = &mut owned[k];
        if o.end.readable() == 0 {
            if o.end.closed() || shared.stop.load(Ordering::Acquire) {
                // The engine fills the stripes in stream order, so this thread's other rings,
                // which carry later stripes, are empty too.
                return true;
            }
            if o.end.announce_sleep() == 0 && !o.end.closed() && !shared.stop.load(Ordering::Acquire) {
                park();
            }
            continue;
        }
        let (a, _) = o.end.peek();
        let n = a.len().min(room).min(CHUNK);
        let r = super::nosig::send(&o.sock, &a[..n]);
        match r {
            Ok(0) => {
                fail_all(shared, owned, format!("peer {peer} closed the connection (end of stream)"));
                return false;
            }
            Ok(m) => {
                o.end.consume(m);
                o.moved += m as u64;
                if o.end.take_writer_asleep() {
                    shared.notify();
                }
            }
            Err(e) if retry(&e) => {}
            Err(e) => {
                fail_all(shared, owned, format!("peer {peer}: connection failed while sending: {e}"));
                return false;
            }
        }
    }
    true
}

/// A sender failed: records why and closes its rings, so the engine's next send fails.
fn fail_all(shared: &Shared, owned: &[Owned<Consumer>], text: String) {
    if !shared.stop.load(Ordering::Acquire) {
        shared.fail(text);
    }
    for o in owned {
        o.end.close();
    }
    shared.notify();
}

/// A receiver thread: moves bytes from its sockets into their receive rings, in stream order,
/// never past the end of a socket's current stripe.
fn recv_loop(mut owned: Vec<Owned<Producer>>, layout: Layout, shared: Arc<Shared>, peer: String) {
    while let Some(k) = layout.first(&owned) {
        let (_, room) = layout.next(owned[k].index, owned[k].moved);
        let o = &mut owned[k];
        if o.end.closed() || shared.stop.load(Ordering::Acquire) {
            return;
        }
        if o.end.writable() == 0 {
            if o.end.announce_sleep() == 0 && !o.end.closed() {
                park();
            }
            continue;
        }
        let buf = o.end.free_slice();
        let n = buf.len().min(room).min(CHUNK);
        let r = (&o.sock).read(&mut buf[..n]);
        match r {
            Ok(m) if m > 0 => {
                o.end.publish(m);
                o.moved += m as u64;
                if o.end.take_reader_asleep() {
                    shared.notify();
                }
            }
            Err(e) if retry(&e) => {}
            r => {
                // End of stream or an error: what was read stays readable; then the ring fails.
                if !shared.stop.load(Ordering::Acquire) {
                    shared.fail(match r {
                        Err(e) => format!("peer {peer}: connection failed while receiving: {e}"),
                        _ => format!("peer {peer} closed the connection (end of stream)"),
                    });
                }
                o.end.close();
                o.live = false;
                shared.notify();
            }
        }
    }
}

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
    cap: usize,
    /// The last bytes (at most an abort frame's length) that in-place reads consumed since the
    /// last copying read: the engine keeps no copy of them, and a peer's abort frame taken for
    /// data must still be found by [`Link::salvage`].
    consumed: Vec<u8>,
    _rings: Vec<Arc<HeapRing>>,
}

impl ThreadedTcpLink {
    /// A link over `socks` (in the same order at both ends), striping the stream in units of
    /// `stripe` bytes, with `threads` helpers (at least 1, at most the sockets).
    pub fn new(socks: Vec<TcpStream>, stripe: usize, peer_rank: usize, threads: usize) -> Result<ThreadedTcpLink> {
        let n = socks.len();
        if n == 0 || n > super::tcp::MAX_SOCKS {
            return Err(Error::internal(format!("a TCP link needs 1 to {} sockets, got {n}", super::tcp::MAX_SOCKS)));
        }
        let threads = threads.clamp(1, n.min(MAX_THREADS));
        let stripe = stripe.max(super::tcp::MIN_STRIPE);
        let layout = Layout { nsocks: n as u64, stripe: stripe as u64 };
        let peer_addr = socks[0].peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        // SAFETY: eventfd with flags only; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::from_io("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let event = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut clones = Vec::with_capacity(n);
        for s in &socks {
            super::tcp::tune(s)?;
            s.set_nonblocking(false).map_err(|e| Error::from_io("set_nonblocking", e))?;
            // The handshake left a receive timeout on the socket; helpers block without one
            // (the engine owns the timeout, and shutting the socket ends a blocked call).
            s.set_read_timeout(None).map_err(|e| Error::from_io("SO_RCVTIMEO", e))?;
            s.set_write_timeout(None).map_err(|e| Error::from_io("SO_SNDTIMEO", e))?;
            clones.push(s.try_clone().map_err(|e| Error::from_io("dup of a socket", e))?);
        }
        let shared = Arc::new(Shared {
            event,
            error: Mutex::new(None),
            stop: AtomicBool::new(false),
            socks: clones,
            senders: std::sync::atomic::AtomicUsize::new(0),
        });
        let cap = ring_capacity(n, stripe);
        let rings: Vec<Arc<HeapRing>> = (0..2 * n).map(|_| Arc::new(HeapRing::new(cap))).collect();
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
            outs[s % threads].push(Owned { index: s, sock, end: c_out, moved: 0, live: true });
            ins[s % threads].push(Owned { index: s, sock: back, end: p_in, moved: 0, live: true });
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
            consumed: Vec::new(),
            _rings: rings,
        };
        let who = format!("rank {peer_rank} ({})", link.peer_addr);
        for (t, (out, inn)) in outs.into_iter().zip(ins).enumerate() {
            let spawn = |dir: &str, f: Box<dyn FnOnce() + Send>| {
                std::thread::Builder::new()
                    .name(format!("oxccl-{dir}{t}-r{peer_rank}"))
                    .stack_size(256 << 10)
                    .spawn(f)
                    .map_err(|e| Error::from_io("spawning a TCP helper thread", e))
            };
            // Each thread holds the rings until its ring ends are gone (dropped inside the loop).
            let (shared, who2, keep) = (link.shared.clone(), who.clone(), link._rings.clone());
            link.shared.senders.fetch_add(1, Ordering::AcqRel);
            let h = spawn(
                "tx",
                Box::new(move || {
                    let _keep = keep;
                    send_loop(out, layout, shared, who2)
                }),
            )
            .inspect_err(|_| {
                link.shared.senders.fetch_sub(1, Ordering::AcqRel);
            })?;
            link.senders.push(h.thread().clone());
            link.joins.push(h);
            let (shared, who2, keep) = (link.shared.clone(), who.clone(), link._rings.clone());
            let h = spawn(
                "rx",
                Box::new(move || {
                    let _keep = keep;
                    recv_loop(inn, layout, shared, who2)
                }),
            )?;
            link.receivers.push(h.thread().clone());
            link.joins.push(h);
        }
        Ok(link)
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

    /// The readable bytes of receive ring `s` (a copy of at most the last 64 KiB).
    fn ring_tail(&mut self, s: usize) -> Vec<u8> {
        let (a, b) = self.rx[s].peek();
        let mut v = Vec::with_capacity(a.len() + b.len());
        v.extend_from_slice(a);
        v.extend_from_slice(b);
        let keep = v.len().saturating_sub(64 << 10);
        v.split_off(keep)
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
        remember(&mut self.consumed, &head[..from_s], &a[..from_next]);
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
        for t in self.senders.iter().chain(&self.receivers) {
            t.unpark();
        }
    }
}

impl Drop for ThreadedTcpLink {
    fn drop(&mut self) {
        // Bytes the engine counts as sent must reach the peer, as with a closed socket: up to
        // the timeout (at most 30 s) on a healthy link, a short grace after a failure.
        let limit = if self.shared.stop.load(Ordering::Acquire) {
            SHUTDOWN_FLUSH
        } else {
            crate::config::timeout().min(Duration::from_secs(30))
        };
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
                self.consumed.clear();
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
                remember(&mut self.consumed, &a[..used.min(na)], &b[..used.saturating_sub(na)]);
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

    fn send_abort(&mut self, frame: &[u8], at_boundary: bool, limit: Duration) {
        if at_boundary {
            let deadline = Instant::now() + limit;
            crate::abort::write_bounded(frame, limit, |b| self.try_send(b));
            // The frame must leave before the link is shut down.
            self.flush_until(deadline);
        }
    }

    fn salvage(&mut self, tail: &mut Vec<u8>) -> bool {
        crate::abort::keep_tail(tail, &std::mem::take(&mut self.consumed));
        let mut buf = [0u8; 4096];
        let closed = loop {
            match self.try_recv(&mut buf) {
                Ok(0) => break false,
                Ok(n) => crate::abort::keep_tail(tail, &buf[..n]),
                Err(_) => break true,
            }
        };
        if closed && crate::abort::parse_tail(tail).is_none() {
            // The stream stopped at a failed socket; the frame may sit on another one.
            for s in 0..self.rx.len() {
                let t = self.ring_tail(s);
                if crate::abort::parse_tail(&t).is_some() {
                    tail.clear();
                    crate::abort::keep_tail(tail, &t);
                    break;
                }
            }
        }
        closed
    }

    fn peek_abort(&mut self) -> Option<(crate::error::ErrorKind, String)> {
        (0..self.rx.len()).find_map(|s| {
            if self.rx[s].readable() == 0 {
                return None;
            }
            crate::abort::parse_tail(&self.ring_tail(s))
        })
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
mod tests {
    use super::super::tcp::tests::{bytes, exchange, socket_pairs};
    use super::super::tcp::{TcpLink, MIN_STRIPE};
    use super::super::Links;
    use super::*;

    fn threaded_pair(n: usize, stripe: usize, threads: [usize; 2]) -> (ThreadedTcpLink, ThreadedTcpLink) {
        let (a, b) = socket_pairs(n);
        (
            ThreadedTcpLink::new(a, stripe, 1, threads[0]).unwrap(),
            ThreadedTcpLink::new(b, stripe, 0, threads[1]).unwrap(),
        )
    }

    #[test]
    fn streams_arrive_in_order_over_helper_threads() {
        // Both ends threaded, with thread counts that differ between the ends and divide the
        // sockets unevenly.
        for (socks, stripe, threads) in [
            (1, MIN_STRIPE, [1, 1]),
            (2, MIN_STRIPE, [1, 2]),
            (3, MIN_STRIPE, [2, 3]),
            (4, 192 << 10, [2, 4]),
            (8, MIN_STRIPE, [3, 1]),
        ] {
            let (mut a, mut b) = threaded_pair(socks, stripe, threads);
            for (i, &len) in [1usize, 7, 65_537, 1 << 20, 3 * (1 << 20) + 12_345].iter().enumerate() {
                let msg = bytes(len, (socks * 100 + i) as u64);
                for (sp, rp) in [(len, len), (4_099, 70_001), (MIN_STRIPE + 1, 1 << 21)] {
                    let [ab, ba] = exchange(&mut a, &mut b, &msg, sp.max(1), rp.max(1));
                    let what = format!("{socks} sockets, threads {threads:?}, {len} bytes, pieces {sp}/{rp}");
                    assert!(ab == msg, "{what}: a->b differs");
                    assert!(ba == msg, "{what}: b->a differs");
                }
            }
        }
    }

    #[test]
    fn a_threaded_end_talks_to_an_engine_driven_end() {
        for (socks, threads) in [(1, 1), (4, 2)] {
            let (a, b) = socket_pairs(socks);
            let mut a = ThreadedTcpLink::new(a, MIN_STRIPE, 1, threads).unwrap();
            let mut b = TcpLink::striped(b, MIN_STRIPE, 0).unwrap();
            for (i, &len) in [13usize, 200_001, 5 << 20].iter().enumerate() {
                let msg = bytes(len, 7 + i as u64);
                let [ab, ba] = exchange(&mut a, &mut b, &msg, 100_003, 77_777);
                assert!(ab == msg && ba == msg, "{socks} sockets, {threads} threads, {len} bytes differ");
            }
        }
    }

    #[test]
    fn in_place_reads_stop_at_stripe_ends_and_see_every_byte() {
        let (mut a, mut b) = threaded_pair(3, MIN_STRIPE, [2, 1]);
        let msg = bytes(5 * MIN_STRIPE + 999, 42);
        let mut sent = 0;
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while got.len() < msg.len() {
            assert!(Instant::now() < deadline, "stalled at {} of {}", got.len(), msg.len());
            if sent < msg.len() {
                sent += b.try_send(&msg[sent..]).unwrap();
            }
            let before = got.len();
            let used = a
                .recv_in_place(msg.len() - got.len(), &mut |x, y| {
                    got.extend_from_slice(x);
                    got.extend_from_slice(y);
                    x.len() + y.len()
                })
                .unwrap()
                .unwrap();
            assert_eq!(used, got.len() - before);
            // A view never crosses a stripe boundary (it comes from one socket's ring).
            assert!(before / MIN_STRIPE == (got.len().max(1) - 1) / MIN_STRIPE || used == 0);
        }
        assert!(got == msg);
    }

    #[test]
    fn in_place_elements_may_straddle_a_stripe_boundary() {
        // As the engine's reductions do: only whole 8-byte elements are used, one of them
        // possibly split between the two views. The stream is offset by 3 bytes so elements
        // straddle every stripe boundary.
        let (mut a, mut b) = threaded_pair(3, MIN_STRIPE, [2, 2]);
        let lead = bytes(3, 1);
        let msg = bytes(4 * MIN_STRIPE + 8 * 1001, 77);
        let mut stream = lead.clone();
        stream.extend_from_slice(&msg);
        let mut sent = 0;
        let mut first = [0u8; 3];
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut got_lead = 0;
        let mut got = Vec::new();
        while got.len() < msg.len() {
            assert!(Instant::now() < deadline, "stalled at {} of {}", got.len(), msg.len());
            if sent < stream.len() {
                sent += b.try_send(&stream[sent..]).unwrap();
            }
            if got_lead < 3 {
                got_lead += a.try_recv(&mut first[got_lead..]).unwrap();
                continue;
            }
            let used = a
                .recv_in_place(msg.len() - got.len(), &mut |x, y| {
                    if x.len() >= 8 {
                        let n = x.len() / 8 * 8;
                        got.extend_from_slice(&x[..n]);
                        n
                    } else if x.len() + y.len() >= 8 {
                        got.extend_from_slice(x);
                        got.extend_from_slice(&y[..8 - x.len()]);
                        8
                    } else {
                        0
                    }
                })
                .unwrap()
                .unwrap();
            if used == 0 {
                // What the engine does when nothing moved: arm, and sleep only when told to.
                if a.arm(Interest { read: true, write: false }).unwrap() {
                    Links::wait(
                        &[(&a as &dyn Link, Interest { read: true, write: false })],
                        None,
                        Duration::from_secs(5),
                    )
                    .unwrap();
                }
            }
        }
        assert_eq!(first.to_vec(), lead);
        assert!(got == msg, "elements differ");
    }

    #[test]
    fn a_peer_that_closes_within_an_element_fails_in_place_reads() {
        // The peer leaves 3 bytes (less than an element) and closes: an in-place reduction can
        // never use them, so the link must fail rather than report "nothing yet" forever.
        for (socks, lead) in [(1, 0), (2, MIN_STRIPE - 2)] {
            let (mut a, b) = threaded_pair(socks, MIN_STRIPE, [1, 1]);
            let mut b = b;
            let data = bytes(lead + 3, 5);
            let mut sent = 0;
            while sent < data.len() {
                sent += b.try_send(&data[sent..]).unwrap();
            }
            drop(b);
            let mut skip = vec![0u8; lead];
            let mut got = 0;
            let deadline = Instant::now() + Duration::from_secs(10);
            while got < lead {
                got += a.try_recv(&mut skip[got..]).unwrap();
                assert!(Instant::now() < deadline);
            }
            let err = loop {
                assert!(Instant::now() < deadline, "{socks} sockets: no error within 10 s");
                let r = a.recv_in_place(8, &mut |x, y| if x.len() + y.len() >= 8 { 8 } else { 0 });
                match r {
                    Ok(Some(0)) => std::thread::sleep(Duration::from_millis(1)),
                    Ok(n) => panic!("used {n:?} bytes of 3"),
                    Err(e) => break e,
                }
            };
            assert!(err.message().contains("closed"), "{}", err.message());
        }
    }

    #[test]
    fn dropping_a_link_delivers_what_it_took_then_the_peer_sees_the_close() {
        for socks in [1, 4] {
            let (mut a, mut b) = threaded_pair(socks, MIN_STRIPE, [2, 2]);
            let msg = bytes(3 << 20, socks as u64);
            // `b` takes as much as its rings hold and is dropped at once; the drop must flush.
            let sender = std::thread::spawn(move || {
                let mut sent = 0;
                while sent < msg.len() {
                    sent += b.try_send(&msg[sent..]).unwrap();
                    std::thread::yield_now();
                }
                drop(b);
                msg
            });
            let mut got = Vec::new();
            let mut buf = vec![0u8; 100_000];
            let deadline = Instant::now() + Duration::from_secs(20);
            let err = loop {
                assert!(Instant::now() < deadline, "no end of stream within 20 s");
                match a.try_recv(&mut buf) {
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => break e,
                }
            };
            let msg = sender.join().unwrap();
            assert!(got == msg, "{socks} sockets: got {} of {} bytes before the error", got.len(), msg.len());
            assert!(err.message().contains("closed"), "{}", err.message());
        }
    }

    #[test]
    fn a_shut_down_link_still_hands_over_what_it_took() {
        // Like a socket's kernel buffer: bytes the engine counted as sent reach the peer even
        // when the link is shut down (an error elsewhere) right after, then the stream ends.
        let (mut a, mut b) = threaded_pair(2, MIN_STRIPE, [1, 2]);
        let msg = bytes(1 << 20, 3);
        let mut sent = 0;
        while sent < msg.len() {
            sent += a.try_send(&msg[sent..]).unwrap();
        }
        a.shutdown();
        assert!(a.try_send(b"more").is_err(), "a shut-down link takes no more bytes");
        let mut got = Vec::new();
        let mut buf = vec![0u8; 65_536];
        let deadline = Instant::now() + Duration::from_secs(10);
        let err = loop {
            assert!(Instant::now() < deadline, "no end of stream within 10 s");
            match b.try_recv(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => break e,
            }
        };
        assert!(got == msg, "got {} of {} bytes", got.len(), msg.len());
        assert!(err.message().contains("closed"), "{}", err.message());
    }

    #[test]
    fn an_abort_frame_is_found_on_whichever_socket_it_lies() {
        let (a, b) = socket_pairs(4);
        let mut a = ThreadedTcpLink::new(a, MIN_STRIPE, 1, 2).unwrap();
        let mut b = TcpLink::striped(b, MIN_STRIPE, 0).unwrap();
        // Two and a half stripes of data first: the frame lands on the third socket.
        let data = bytes(2 * MIN_STRIPE + 1000, 9);
        let frame =
            crate::abort::encode(crate::error::ErrorKind::InvalidUsage, "rank 0 called all_reduce, rank 1 broadcast");
        let mut all = data.clone();
        all.extend_from_slice(&frame);
        let mut sent = 0;
        let deadline = Instant::now() + Duration::from_secs(10);
        while sent < all.len() {
            assert!(Instant::now() < deadline);
            sent += b.try_send(&all[sent..]).unwrap();
        }
        // Between operations the frame is seen without consuming anything.
        let found = loop {
            assert!(Instant::now() < deadline, "peek_abort found no frame");
            if let Some(f) = a.peek_abort() {
                break f;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(found.0, crate::error::ErrorKind::InvalidUsage);
        assert!(found.1.contains("broadcast"), "{}", found.1);
        b.shutdown();
        drop(b);
        let mut tail = Vec::new();
        while !a.salvage(&mut tail) {
            assert!(Instant::now() < deadline, "salvage never saw the close");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (kind, text) = crate::abort::parse_tail(&tail).expect("the frame is in the salvaged tail");
        assert_eq!((kind, text), found);
    }

    #[test]
    fn the_engine_sleeps_until_a_helper_has_bytes_for_it() {
        let (mut a, mut b) = threaded_pair(2, MIN_STRIPE, [1, 1]);
        let read = Interest { read: true, write: false };
        assert!(a.arm(read).unwrap(), "nothing to read: may sleep");
        let start = Instant::now();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(b.try_send(b"x").unwrap(), 1);
            b
        });
        Links::wait(&[(&a as &dyn Link, read)], None, Duration::from_secs(10)).unwrap();
        let waited = start.elapsed();
        assert!(waited < Duration::from_secs(5), "woke only after {waited:?}");
        let mut got = [0u8; 1];
        let deadline = Instant::now() + Duration::from_secs(5);
        while a.try_recv(&mut got).unwrap() == 0 {
            assert!(Instant::now() < deadline);
        }
        assert_eq!(&got, b"x");
        assert!(!a.arm(Interest { read: false, write: true }).unwrap(), "room to write: do not sleep");
        drop(t.join().unwrap());
    }

    #[test]
    fn shutdown_ends_helpers_blocked_on_a_peer_that_does_not_read() {
        let (mut a, b) = threaded_pair(2, MIN_STRIPE, [2, 2]);
        let msg = vec![5u8; 64 << 20];
        // Fill the rings and the kernel buffers: `b` never reads.
        let mut sent = 0;
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            sent += a.try_send(&msg[sent..]).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(sent < msg.len(), "64 MiB fit into buffers of a peer that reads nothing");
        let start = Instant::now();
        a.shutdown();
        drop(a);
        drop(b);
        assert!(start.elapsed() < Duration::from_secs(5), "shutdown and drop took {:?}", start.elapsed());
    }
}
