//! TCP transport: nonblocking sockets driven by the engine with poll(2), one or several per peer.
//!
//! With several sockets (`OXCCL_NSOCKS`) a link stays one ordered byte stream: the stream is
//! cut into *stripes* of `OXCCL_SOCKET_STRIPE` bytes (at least 64 KiB) and stripe `k` travels on
//! socket `k mod nsocks`. Both ends count the bytes they have sent and received, so each knows
//! which socket the next byte goes to or comes from without any framing; the receiver reads the
//! stripes back in order. A message shorter than a stripe therefore takes one socket (two when
//! it straddles a stripe boundary), one system call as before, while a large one is spread over
//! every socket, whose kernel buffers fill in parallel. With one socket (the default, see
//! `OXCCL_NSOCKS`) the link behaves exactly as a single-socket link.

pub mod setup;

use super::{Interest, Link};
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// Largest vectored transfer gathered through a stack buffer instead of readv/writev.
const SMALL: usize = 4096;

/// Most sockets per peer (NCCL's limit too).
pub const MAX_SOCKS: usize = crate::config::MAX_SOCKS;
/// Smallest stripe (NCCL's minimum task size for socket striping).
pub const MIN_STRIPE: usize = crate::config::MIN_STRIPE;

/// Longest cycle of a weighted layout ([`Layout::weighted`]).
pub(super) const CYCLE: usize = MAX_SOCKS;

/// How a link's byte stream is cut over its sockets: stripe `k` (of `stripe` bytes) travels on
/// socket `k mod nsocks`, or, for a weighted layout, on socket `cycle[k mod len]`. Links with and
/// without helper threads ([`super::tcp_threads`]) both use it, so their ends agree on the wire.
#[derive(Clone, Copy, Debug)]
pub(super) struct Layout {
    /// Sockets of the link.
    pub(super) nsocks: u64,
    /// Bytes per stripe.
    pub(super) stripe: u64,
    /// Weighted layouts: the socket of each stripe of one cycle (`len` entries; 0: round robin).
    cycle: [u8; CYCLE],
    len: u8,
}

impl Layout {
    /// Stripe `k` on socket `k mod nsocks`.
    pub(super) fn round_robin(nsocks: usize, stripe: usize) -> Layout {
        Layout { nsocks: nsocks as u64, stripe: stripe as u64, cycle: [0; CYCLE], len: 0 }
    }

    /// Stripe `k` on socket `cycle[k mod cycle.len()]`; every socket below `nsocks` must appear
    /// in `cycle` (at most [`CYCLE`] entries), else an error.
    pub(super) fn weighted(nsocks: usize, stripe: usize, cycle: &[u8]) -> Result<Layout> {
        let complete = (0..nsocks).all(|s| cycle.contains(&(s as u8)));
        if cycle.is_empty() || cycle.len() > CYCLE || !complete || cycle.iter().any(|&c| c as usize >= nsocks) {
            return Err(Error::internal(format!("bad stripe cycle {cycle:?} for {nsocks} sockets")));
        }
        let mut l = Layout::round_robin(nsocks, stripe);
        l.cycle[..cycle.len()].copy_from_slice(cycle);
        l.len = cycle.len() as u8;
        Ok(l)
    }

    /// The socket of stream stripe `k`.
    fn socket_of(&self, k: u64) -> usize {
        if self.len == 0 {
            (k % self.nsocks) as usize
        } else {
            self.cycle[(k % u64::from(self.len)) as usize] as usize
        }
    }

    /// The socket carrying stream byte `pos`, and how many bytes from `pos` stay on it (up to the
    /// end of the last of the consecutive stripes on that socket).
    pub(super) fn slot(&self, pos: u64) -> (usize, usize) {
        if self.nsocks == 1 {
            return (0, usize::MAX);
        }
        let k = pos / self.stripe;
        let s = self.socket_of(k);
        let run = (1..u64::from(self.len)).take_while(|&j| self.socket_of(k + j) == s).count() as u64;
        (s, (self.stripe - pos % self.stripe + run * self.stripe) as usize)
    }

    /// For a socket that has moved `moved` of its own bytes: the stream index of its current
    /// stripe, and the bytes left in it.
    pub(super) fn next(&self, index: usize, moved: u64) -> (u64, usize) {
        if self.nsocks == 1 {
            return (0, usize::MAX);
        }
        let (n, room) = (moved / self.stripe, (self.stripe - moved % self.stripe) as usize);
        if self.len == 0 {
            return (n * self.nsocks + index as u64, room);
        }
        let cycle = &self.cycle[..self.len as usize];
        let per = cycle.iter().filter(|&&c| c as usize == index).count() as u64;
        let nth = (n % per.max(1)) as usize;
        let at = cycle.iter().enumerate().filter(|(_, &c)| c as usize == index).nth(nth).map_or(0, |(i, _)| i);
        ((n / per.max(1)) * u64::from(self.len) + at as u64, room)
    }

    /// Moves up to `len` bytes of the stream from position `*pos` on, one piece per stripe:
    /// `op(socket, range)` moves a prefix of `range` (offsets into the caller's buffer, all on
    /// `socket`) and returns its length. Advances `*pos` by what moved, even when `op` fails
    /// after earlier pieces; stops after the first piece that moved less than asked.
    pub(super) fn pieces(
        &self,
        len: usize,
        pos: &mut u64,
        mut op: impl FnMut(usize, std::ops::Range<usize>) -> Result<usize>,
    ) -> Result<usize> {
        let mut done = 0;
        while done < len {
            let (socket, room) = self.slot(*pos);
            let want = room.min(len - done);
            let n = op(socket, done..done + want)?;
            done += n;
            *pos += n as u64;
            if n < want {
                break;
            }
        }
        Ok(done)
    }
}

/// A data connection to one peer over one or several sockets.
pub struct TcpLink {
    socks: Vec<TcpStream>,
    layout: Layout,
    sent: u64,
    received: u64,
    peer_rank: usize,
    peer_addr: String,
    /// Gathers small vectored transfers (allocated once: zeroing a stack buffer on every
    /// attempt of a spinning receive costs more than the copy).
    small: Vec<u8>,
}

impl TcpLink {
    /// Wraps a connected, handshaken stream: sets it nonblocking with NODELAY and big buffers.
    pub fn new(stream: TcpStream, peer_rank: usize) -> Result<TcpLink> {
        Self::striped(vec![stream], MIN_STRIPE, peer_rank)
    }

    /// A link over `socks` (in the same order at both ends; the first is the one the
    /// connection was set up on), striping the stream in units of `stripe` bytes.
    pub fn striped(socks: Vec<TcpStream>, stripe: usize, peer_rank: usize) -> Result<TcpLink> {
        if socks.is_empty() || socks.len() > MAX_SOCKS {
            return Err(Error::internal(format!("a TCP link needs 1 to {MAX_SOCKS} sockets, got {}", socks.len())));
        }
        let n = socks.len();
        Self::with_layout(socks, Layout::round_robin(n, stripe.max(MIN_STRIPE)), peer_rank)
    }

    /// A link over `socks` cut as `layout` says (both ends use the same).
    pub(super) fn with_layout(socks: Vec<TcpStream>, layout: Layout, peer_rank: usize) -> Result<TcpLink> {
        if socks.len() as u64 != layout.nsocks {
            return Err(Error::internal("a TCP link's layout does not match its sockets"));
        }
        for s in &socks {
            tune(s)?;
            s.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
        }
        let peer_addr = socks[0].peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        Ok(TcpLink { socks, layout, sent: 0, received: 0, peer_rank, peer_addr, small: vec![0; SMALL] })
    }

    /// Names the link's rails after its address in messages (`10.0.0.2:4000 over eth0, eth1`).
    pub(super) fn over_rails(mut self, rails: &str) -> Self {
        self.peer_addr = format!("{} over {rails}", self.peer_addr);
        self
    }

    /// A second handle on the first socket (for aborting from another thread).
    pub fn try_clone_stream(&self) -> Option<TcpStream> {
        self.socks[0].try_clone().ok()
    }

    /// Number of sockets this link stripes over.
    pub fn sockets(&self) -> usize {
        self.socks.len()
    }

    fn remote(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::remote(format!("peer rank {} ({}) {what}: {e}", self.peer_rank, self.peer_addr))
    }

    /// The socket carrying stream byte `pos`, and how many bytes from `pos` stay on it.
    fn slot(&self, pos: u64) -> (usize, usize) {
        self.layout.slot(pos)
    }
}

/// Socket buffer size to request (`OXCCL_SOCKET_BUF`, default 4 MiB; 0 leaves the kernel's
/// autotuning in charge). 4 MiB measured slightly faster on loopback (docs/PERFORMANCE.md).
fn socket_buffer() -> usize {
    crate::config::process().socket_buf
}

/// Sets TCP_NODELAY, and the socket buffer size when one is configured (best effort).
pub fn tune(stream: &TcpStream) -> Result<()> {
    stream.set_nodelay(true).map_err(|e| Error::from_io("TCP_NODELAY", e))?;
    let size = socket_buffer();
    if size > 0 {
        let s = socket2::SockRef::from(stream);
        let _ = s.set_send_buffer_size(size);
        let _ = s.set_recv_buffer_size(size);
    }
    Ok(())
}

/// Runs one nonblocking I/O call on a socket, mapping its outcome: bytes moved, 0 for "would
/// block", or an error (a closed connection is an error, never `Ok(0)`).
fn io(link: &TcpLink, len: usize, what: &str, mut call: impl FnMut() -> std::io::Result<usize>) -> Result<usize> {
    loop {
        return match call() {
            Ok(0) if len > 0 => Err(link.remote("closed the connection", "end of stream")),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(0),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => Err(link.remote(what, e)),
        };
    }
}

impl Link for TcpLink {
    fn try_send(&mut self, buf: &[u8]) -> Result<usize> {
        let (layout, mut pos) = (self.layout, self.sent);
        let r = layout.pieces(buf.len(), &mut pos, |i, r| {
            let sock = &self.socks[i];
            io(self, r.len(), "connection failed while sending", || super::nosig::send(sock, &buf[r.clone()]))
        });
        self.sent = pos;
        r
    }

    fn try_send_vectored(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total <= SMALL {
            // Small pieces (a signature and a small message) are gathered into one buffer and
            // sent with send(2), which costs less in the kernel than writev(2).
            let mut tmp = std::mem::take(&mut self.small);
            let n = super::gather(bufs, &mut tmp);
            let r = self.try_send(&tmp[..n]);
            self.small = tmp;
            return r;
        }
        let (i, room) = self.slot(self.sent);
        if total > room {
            // Crosses a stripe boundary: one piece at a time (the caller comes back for the rest).
            return match bufs.iter().find(|b| !b.is_empty()) {
                Some(b) => self.try_send(b),
                None => Ok(0),
            };
        }
        let slices: Vec<std::io::IoSlice<'_>> = bufs.iter().map(|b| std::io::IoSlice::new(b)).collect();
        let sock = &self.socks[i];
        let n = io(self, total, "connection failed while sending", || super::nosig::send_vectored(sock, &slices))?;
        self.sent += n as u64;
        Ok(n)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        let (layout, mut pos) = (self.layout, self.received);
        let r = layout.pieces(buf.len(), &mut pos, |i, r| {
            let mut sock = &self.socks[i];
            let dst = &mut buf[r];
            io(self, dst.len(), "connection failed while receiving", || sock.read(dst))
        });
        self.received = pos;
        r
    }

    fn try_recv_vectored(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        if a.is_empty() && b.is_empty() {
            return Ok(0);
        }
        if a.len() + b.len() <= SMALL {
            // recv(2) into a buffer and a copy costs less than readv(2), and this is what the
            // engine calls over and over while it waits for a small message.
            let mut tmp = std::mem::take(&mut self.small);
            let r = self.try_recv(&mut tmp[..a.len() + b.len()]);
            if let Ok(n) = r {
                let k = n.min(a.len());
                a[..k].copy_from_slice(&tmp[..k]);
                b[..n - k].copy_from_slice(&tmp[k..n]);
            }
            self.small = tmp;
            return r;
        }
        // Large: the striped reads in order, the second buffer only once the first is full.
        let n = self.try_recv(a)?;
        if n < a.len() {
            return Ok(n);
        }
        Ok(n + self.try_recv(b)?)
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.socks[0].as_raw_fd())
    }

    fn poll_set(&self, interest: Interest, out: &mut Vec<libc::pollfd>) -> bool {
        if self.socks.len() == 1 {
            out.push(libc::pollfd { fd: self.socks[0].as_raw_fd(), events: self.poll_events(interest), revents: 0 });
            return true;
        }
        // Each direction waits on the socket its next byte uses.
        let r = self.socks[self.slot(self.received).0].as_raw_fd();
        let w = self.socks[self.slot(self.sent).0].as_raw_fd();
        match (interest.read, interest.write) {
            (true, true) if r == w => {
                out.push(libc::pollfd { fd: r, events: libc::POLLIN | libc::POLLOUT, revents: 0 })
            }
            (read, write) => {
                if read {
                    out.push(libc::pollfd { fd: r, events: libc::POLLIN, revents: 0 });
                }
                if write {
                    out.push(libc::pollfd { fd: w, events: libc::POLLOUT, revents: 0 });
                }
            }
        }
        true
    }

    fn describe(&self) -> String {
        if self.socks.len() == 1 {
            format!("rank {} ({})", self.peer_rank, self.peer_addr)
        } else {
            format!("rank {} ({}, {} sockets)", self.peer_rank, self.peer_addr, self.socks.len())
        }
    }

    fn shutdown(&self) {
        for s in &self.socks {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

pub use crate::net::connect::{connect_retry, connect_retry_within};

/// Accepts one connection on a nonblocking `listener`, waiting until `deadline`; `abort`
/// is checked between waits.
pub fn accept_until(listener: &TcpListener, deadline: Instant, abort: &dyn Fn() -> bool) -> Result<TcpStream> {
    listener.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
    let mut warned = false;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| Error::from_io("set_nonblocking", e))?;
                s.set_nodelay(true).map_err(|e| Error::from_io("TCP_NODELAY", e))?;
                return Ok(s);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                if abort() {
                    return Err(Error::invalid_usage("communicator was aborted while waiting for connections"));
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::timeout(format!(
                        "no connection arrived on {} before the deadline",
                        listener.local_addr().map(|a| a.to_string()).unwrap_or_default()
                    )));
                }
                let mut pfd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd on the stack, length 1.
                unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(100) as i32) };
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                // Out of descriptors: the connection waits in the backlog until one is free.
                if Instant::now() >= deadline {
                    return Err(Error::system(format!("accept: {e} until the deadline")));
                }
                if !std::mem::replace(&mut warned, true) {
                    crate::warn!("accept: {e}; retrying every 50 ms until a descriptor is free");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(Error::system(format!("accept: {e}"))),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    /// `n` connected loopback socket pairs: the two ends' sockets in the same order.
    pub(crate) fn socket_pairs(n: usize) -> (Vec<TcpStream>, Vec<TcpStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..n {
            a.push(TcpStream::connect(l.local_addr().unwrap()).unwrap());
            b.push(l.accept().unwrap().0);
        }
        (a, b)
    }

    /// Two links joined by `n` loopback socket pairs, striping in units of `stripe`.
    fn pair(n: usize, stripe: usize) -> (TcpLink, TcpLink) {
        let (a, b) = socket_pairs(n);
        (TcpLink::striped(a, stripe, 1).unwrap(), TcpLink::striped(b, stripe, 0).unwrap())
    }

    /// Deterministic bytes (an xorshift stream), different per seed.
    pub(crate) fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Sends `msgs` from `a` to `b` and `b` to `a` at once, offering the data in pieces of
    /// `send_piece` bytes (vectored in two halves every other time) and reading in pieces of
    /// `recv_piece`; returns what each side received.
    pub(crate) fn exchange(
        a: &mut dyn Link,
        b: &mut dyn Link,
        msg: &[u8],
        send_piece: usize,
        recv_piece: usize,
    ) -> [Vec<u8>; 2] {
        let mut out = [Vec::new(), Vec::new()];
        let mut sent = [0usize; 2];
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut turn = 0usize;
        while out.iter().any(|o| o.len() < msg.len()) {
            assert!(
                Instant::now() < deadline,
                "exchange stalled: sent {sent:?}, received {}/{}",
                out[0].len(),
                out[1].len()
            );
            for side in 0..2 {
                let (tx, rx): (&mut dyn Link, &mut dyn Link) =
                    if side == 0 { (&mut *a, &mut *b) } else { (&mut *b, &mut *a) };
                if sent[side] < msg.len() {
                    let end = (sent[side] + send_piece).min(msg.len());
                    let piece = &msg[sent[side]..end];
                    turn += 1;
                    sent[side] += if turn % 2 == 0 && piece.len() > 1 {
                        let (x, y) = piece.split_at(piece.len() / 2);
                        tx.try_send_vectored(&[x, y]).unwrap()
                    } else {
                        tx.try_send(piece).unwrap()
                    };
                }
                let got = &mut out[1 - side];
                if got.len() < msg.len() {
                    let mut buf = vec![0u8; recv_piece.min(msg.len() - got.len())];
                    let n = rx.try_recv(&mut buf).unwrap();
                    got.extend_from_slice(&buf[..n]);
                }
            }
        }
        out
    }

    #[test]
    fn striped_streams_arrive_in_order_for_odd_sizes_and_pieces() {
        for (socks, stripe) in [(1, MIN_STRIPE), (2, MIN_STRIPE), (3, MIN_STRIPE), (4, 192 << 10), (8, MIN_STRIPE)] {
            let (mut a, mut b) = pair(socks, stripe);
            // Several messages back to back on the same links: offsets carry over.
            for (i, &len) in [1usize, 7, 65_535, 65_537, 1 << 20, 3 * (1 << 20) + 12_345].iter().enumerate() {
                let msg = bytes(len, (socks * 100 + i) as u64);
                for (sp, rp) in [(len, len), (4_099, 70_001), (1 << 20, 13), (MIN_STRIPE + 1, 1 << 21)] {
                    if rp < 64 && len > (1 << 20) {
                        continue; // tiny reads of big messages only slow the test down
                    }
                    let [ab, ba] = exchange(&mut a, &mut b, &msg, sp.max(1), rp.max(1));
                    assert!(ab == msg, "{socks} sockets, stripe {stripe}, {len} bytes, pieces {sp}/{rp}: a->b differs");
                    assert!(ba == msg, "{socks} sockets, stripe {stripe}, {len} bytes, pieces {sp}/{rp}: b->a differs");
                }
            }
            assert_eq!(a.sent, a.received);
        }
    }

    #[test]
    fn stripes_rotate_over_the_sockets() {
        let (a, _b) = pair(3, MIN_STRIPE);
        let s = MIN_STRIPE as u64;
        assert_eq!(a.slot(0), (0, MIN_STRIPE));
        assert_eq!(a.slot(s - 1), (0, 1));
        assert_eq!(a.slot(s), (1, MIN_STRIPE));
        assert_eq!(a.slot(2 * s + 5), (2, MIN_STRIPE - 5));
        assert_eq!(a.slot(3 * s), (0, MIN_STRIPE));
        let (one, _c) = pair(1, MIN_STRIPE);
        assert_eq!(one.slot(12_345_678), (0, usize::MAX), "one socket: no striping");
    }

    #[test]
    fn weighted_layouts_map_each_sockets_stripes_back_to_the_stream() {
        for cycle in [&[0u8, 1, 1][..], &[1, 0, 1, 1, 2], &[0, 0, 1, 0], &[3, 2, 1, 0]] {
            let n = *cycle.iter().max().unwrap() as usize + 1;
            let l = Layout::weighted(n, MIN_STRIPE, cycle).unwrap();
            let s = MIN_STRIPE as u64;
            let mut seen = vec![0u64; n];
            for k in 0..200u64 {
                let (sock, room) = l.slot(k * s);
                assert_eq!(sock, cycle[(k % cycle.len() as u64) as usize] as usize, "cycle {cycle:?}, stripe {k}");
                assert_eq!(room as u64 % s, 0, "whole stripes from a stripe start");
                assert_eq!(l.slot(k * s + room as u64 - 1).0, sock, "room stays on socket {sock}");
                assert_ne!(l.slot(k * s + room as u64).0, sock, "the next socket after the run");
                assert_eq!(l.next(sock, seen[sock] * s + 5), (k, MIN_STRIPE - 5), "cycle {cycle:?}, stripe {k}");
                seen[sock] += 1;
            }
        }
        assert!(Layout::weighted(3, MIN_STRIPE, &[0, 1]).is_err(), "socket 2 never used");
        assert!(Layout::weighted(2, MIN_STRIPE, &[0, 1, 2]).is_err(), "no socket 2");
    }

    #[test]
    fn a_weighted_link_stays_one_ordered_stream() {
        let (a, b) = socket_pairs(2);
        let l = Layout::weighted(2, MIN_STRIPE, &[0, 1, 1]).unwrap();
        let (mut a, mut b) = (TcpLink::with_layout(a, l, 1).unwrap(), TcpLink::with_layout(b, l, 0).unwrap());
        for (i, &len) in [3usize, 65_537, (1 << 22) + 11].iter().enumerate() {
            let msg = bytes(len, 70 + i as u64);
            for (sp, rp) in [(len, len), (4_099, 70_001), (MIN_STRIPE + 1, 1 << 21)] {
                let [ab, ba] = exchange(&mut a, &mut b, &msg, sp, rp);
                assert!(ab == msg && ba == msg, "{len} bytes, pieces {sp}/{rp} differ");
            }
        }
    }

    #[test]
    fn a_closed_peer_is_an_error_on_every_socket_count() {
        for n in [1, 4] {
            let (mut a, b) = pair(n, MIN_STRIPE);
            b.shutdown();
            drop(b);
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut buf = [0u8; 16];
            loop {
                match a.try_recv(&mut buf) {
                    Err(e) => {
                        assert!(e.message().contains("closed"), "{}", e.message());
                        break;
                    }
                    Ok(0) => assert!(Instant::now() < deadline, "no error within 10 s"),
                    Ok(n) => panic!("read {n} bytes from a closed peer"),
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}
