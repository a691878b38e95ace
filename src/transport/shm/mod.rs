//! Shared-memory transport for two ranks on one host.
//!
//! A pair of ranks shares one segment: an anonymous `memfd` (never a file in `/dev/shm`, so a
//! crash cannot leak one) holding two rings (`super::ring`), one per direction. The rank that
//! creates it sends its pid and descriptor number over the pair's authenticated TCP connection;
//! the peer opens `/proc/<pid>/fd/<n>`, checks that the file is sealed against any change of
//! size, of the stated size and holds the random cookie (`sealed`), maps it, and closes its
//! descriptor. From then on the memory lives exactly as long as a mapping does.
//!
//! The TCP connection stays open beside the rings as the **liveness and doorbell** channel:
//! the engine polls it together with the TCP links of other peers. A side about to sleep sets
//! its flag in the ring header ([`super::ring::Consumer::announce_sleep`]); the other side, after
//! moving bytes, sees the flag and writes one byte on the socket. The hot path therefore makes
//! no system call; a dead peer shows up as end-of-file on the socket (the kernel closes it even
//! after `kill -9`), and a peer that shut the link down sets the rings' `closed` word.

use super::cma::{self, Header};
use super::ring::{Consumer, Producer};
use super::{Interest, Link};
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

/// Largest vectored send gathered into one ring write.
const SMALL: usize = 4096;

/// Data bytes per ring direction when the user sets none and ranks outnumber CPUs, or more
/// than two ranks share the host: a rank that the scheduler takes off its CPU leaves its peers
/// this much to write before they stall (docs/PERFORMANCE.md).
pub const RING_DEFAULT: usize = 1 << 20;

/// Data bytes per ring direction for two ranks alone on a host with a CPU each: a smaller ring
/// keeps the bytes in flight and the caller's buffers in the cores' caches together (the ring's
/// whole memory cycles through the caches, in flight or not), and still holds a whole one-shot
/// exchange (256 KiB and its signature) at once (docs/PERFORMANCE.md, transport thresholds).
pub const RING_PAIR: usize = 512 << 10;

/// The ring size for `ranks_here` ranks on a host, `crowded` when they outnumber its CPUs
/// ([`crate::wait::crowded`]), when `OXCCL_SHM_RING` is not set: [`RING_PAIR`] for two ranks
/// with a CPU each, otherwise [`RING_DEFAULT`].
pub fn default_ring(ranks_here: usize, crowded: bool) -> usize {
    if ranks_here == 2 && !crowded {
        RING_PAIR
    } else {
        RING_DEFAULT
    }
}

/// Data bytes per ring direction in this process's settings: `OXCCL_SHM_RING` (rounded up to
/// a power of two, at least 4 KiB), or [`RING_DEFAULT`]. Links take their communicator's own
/// value.
pub fn ring_capacity() -> usize {
    crate::config::process().shm_ring.unwrap_or(RING_DEFAULT)
}

pub mod arena;
pub mod hostmem;
pub mod lane;
pub mod sealed;
mod segment;
pub mod setup;
pub use segment::{Descriptor, Segment, COOKIE_LEN};

/// A link to a peer on the same host through a shared segment.
pub struct ShmLink {
    // Field order: the ring ends go before the segment they point into.
    tx: Producer,
    rx: Consumer,
    sock: TcpStream,
    peer_rank: usize,
    peer_addr: String,
    /// Gathers small vectored sends (allocated once).
    small: Vec<u8>,
    /// Single-copy sends ([`cma`]); `None` when `OXCCL_CMA=0` here.
    cma_tx: Option<cma::Tx>,
    /// Single-copy receives (disabled when this side cannot read the peer).
    cma_rx: cma::Rx,
    /// Whether the ring holds the first part of a send whose rest is still to come (then the
    /// rest goes through the ring too: no element may straddle the ring and a segment).
    ring_partial: bool,
    /// The segment's header, this side's index in it (0: creator) and the CPU this side last
    /// published there (plus one).
    hdr: Header,
    side: usize,
    cpu: u32,
    /// The small-message lane ([`lane`]).
    lane: lane::Lane,
    _seg: Segment,
}

impl ShmLink {
    /// Builds one end over `seg`; `creator` says which ring this side writes. `sock` is the
    /// pair's connection, kept for liveness and wake-ups.
    pub fn new(seg: Segment, creator: bool, sock: TcpStream, peer_rank: usize) -> Result<ShmLink> {
        ShmLink::new_with(seg, creator, sock, peer_rank, cma::setting())
    }

    /// [`ShmLink::new`] with single copy set up as `set` says.
    fn new_with(
        seg: Segment,
        creator: bool,
        sock: TcpStream,
        peer_rank: usize,
        set: Option<crate::config::CmaSetting>,
    ) -> Result<ShmLink> {
        sock.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
        let peer_addr = sock.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let (t, r) = if creator { (0, 1) } else { (1, 0) };
        let h = seg.cma_header();
        // The creator reads ring 1: it probes the opener, which published itself before it
        // answered the handshake; the opener probed the creator when it mapped the segment.
        let (can_read, why) = if creator { h.probe(1, 1, set) } else { (h.verdict(0), seg.cma_why.clone()) };
        crate::info!("shared memory with rank {peer_rank}: single-copy receives {why}");
        let cma_tx = set.map(|s| cma::Tx::new(h, t, s.min));
        let cma_rx = cma::Rx::new(h, r, r, can_read);
        // SAFETY: both rings lie in `seg`, which the link owns and drops after the ends; the
        // creator initialised them; each process holds one producer and one consumer per ring.
        let (tx, rx) = unsafe { (Producer::new(seg.ring_base(t), seg.cap), Consumer::new(seg.ring_base(r), seg.cap)) };
        // SAFETY: the lane pages lie in `seg` (zeroed by the creator's memfd), which outlives
        // the lane; this side writes only page `t`.
        let lane = unsafe { lane::Lane::new(seg.lane_page(t), seg.lane_page(r)) };
        Ok(ShmLink {
            tx,
            rx,
            sock,
            peer_rank,
            peer_addr,
            small: vec![0; SMALL],
            cma_tx,
            cma_rx,
            ring_partial: false,
            hdr: h,
            side: usize::from(!creator),
            cpu: 0,
            lane,
            _seg: seg,
        })
    }

    /// Two connected ends in this process (for benchmarks and tests): a fresh segment and a
    /// loopback TCP connection as the doorbell.
    pub fn pair(cap: usize) -> Result<(ShmLink, ShmLink)> {
        ShmLink::pair_with(cap, cma::setting())
    }

    /// [`ShmLink::pair`] with single copy set up as `set` says.
    pub fn pair_with(cap: usize, set: Option<crate::config::CmaSetting>) -> Result<(ShmLink, ShmLink)> {
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| Error::from_io("bind", e))?;
        let a = TcpStream::connect(l.local_addr().map_err(|e| Error::from_io("getsockname", e))?)
            .map_err(|e| Error::from_io("connect", e))?;
        let (b, _) = l.accept().map_err(|e| Error::from_io("accept", e))?;
        let (mut seg, desc) = Segment::create(cap)?;
        let other = Segment::open_with(&desc, set)?;
        seg.close_fd();
        Ok((ShmLink::new_with(seg, true, a, 1, set)?, ShmLink::new_with(other, false, b, 0, set)?))
    }

    /// Whether single copy is used (sending, receiving): each is decided by the receiver's
    /// probe at connect and both ends' `OXCCL_CMA`.
    pub fn single_copy(&mut self) -> (bool, bool) {
        (self.cma_tx.as_mut().is_some_and(|c| c.enabled()), self.cma_rx.enabled())
    }

    fn remote(&self, what: &str) -> Error {
        Error::remote(format!("peer rank {} ({}, shared memory) {what}", self.peer_rank, self.peer_addr))
    }

    /// Wakes the peer (one byte on the socket). A full socket already holds wake-ups, and a
    /// dead peer is reported by the next wait, so errors are ignored here.
    fn doorbell(&self) {
        let _ = super::nosig::send(&self.sock, &[1]);
    }

    /// Reads pending wake-ups (one byte `1` each) and discards them; `Ok(false)` when the peer
    /// closed the connection (only wake-ups travel on the socket).
    fn drain(&mut self) -> Result<bool> {
        let mut buf = [0u8; 64];
        loop {
            match (&self.sock).read(&mut buf) {
                Ok(0) => return Ok(false),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // A peer that exits with wake-ups still unread in its socket resets it instead
                // of closing it: the same "peer closed" as end-of-file, so what it already put
                // in the shared ring is still read before the closure is reported.
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(false),
                Err(e) => return Err(self.remote(&format!("connection failed: {e}"))),
            }
        }
    }
}

impl ShmLink {
    /// Writes `buf` into the ring (as far as it fits) and wakes a sleeping reader.
    fn ring_send(&mut self, buf: &[u8]) -> Result<usize> {
        let n = self.tx.write(buf);
        if n > 0 {
            self.ring_partial = n < buf.len();
            if self.tx.take_reader_asleep() {
                self.doorbell();
            }
        }
        Ok(n)
    }

    /// Reads the stream into `a`, then on into `b`: bytes of the bounce buffer, then the ring,
    /// then a single-copy segment that starts where the ring's bytes end.
    fn recv2(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        let want = a.len() + b.len();
        let mut bufs = [a, b];
        let mut n = self.cma_rx.take_buffered(&mut bufs);
        if n < want && !self.cma_rx.buffered() {
            // One copy-out and one release of ring space (one publication of `head`, one check
            // of the writer's sleep flag) for both pieces.
            let (x, y) = self.rx.peek();
            let mut k = 0;
            for src in [x, y] {
                let mut src = src;
                for dst in bufs.iter_mut() {
                    let m = src.len().min(dst.len());
                    super::copy::copy(&mut dst[..m], &src[..m]);
                    src = &src[m..];
                    k += m;
                    let rest = std::mem::take(dst);
                    *dst = &mut rest[m..];
                }
            }
            if k > 0 {
                self.rx.consume(k);
                n += k;
            }
        }
        if n < want && self.cma_rx.active(self.rx.position()) {
            let (rank, addr) = (self.peer_rank, &self.peer_addr);
            let who = |w: &str| Error::remote(format!("peer rank {rank} ({addr}, shared memory): its buffer {w}"));
            n += self.cma_rx.copy(&mut bufs, &who)?;
        }
        if n == 0 {
            if want > 0 {
                if self.rx.closed() {
                    return Err(self.remote("shut the link down"));
                }
                self.idle();
            }
            return Ok(0);
        }
        if self.rx.take_writer_asleep() {
            self.doorbell();
        }
        Ok(n)
    }

    /// [`Link::recv_in_place`] from the bounce buffer, refilled from the single-copy segment.
    fn recv_in_place_cma(&mut self, max: usize, f: &mut dyn FnMut(&[u8], &[u8]) -> usize) -> Result<usize> {
        let (rank, addr) = (self.peer_rank, &self.peer_addr);
        let who = |w: &str| Error::remote(format!("peer rank {rank} ({addr}, shared memory): its buffer {w}"));
        let bytes = self.cma_rx.fill(&who)?;
        let na = bytes.len().min(max);
        // Once the segment is done, bytes left in the bounce buffer (less than an element
        // when a send split one, which the sender avoids) continue in the ring.
        let (tail, _) = if na < 16 && na < max { self.rx.peek() } else { (&[][..], &[][..]) };
        let nb = tail.len().min(max - na);
        let used = f(&bytes[..na], &tail[..nb]).min(na + nb);
        let from_ring = used.saturating_sub(na);
        self.cma_rx.consume(used - from_ring);
        if from_ring > 0 {
            self.rx.consume(from_ring);
        }
        // The refill (or the ring) freed the sender's buffer or room: wake it if it sleeps.
        if self.rx.take_writer_asleep() {
            self.doorbell();
        }
        Ok(used)
    }

    /// A receive found nothing. When the peer last waited on this very CPU (ranks that are not
    /// pinned and that the scheduler put on one core), the bytes this side waits for can only
    /// come once the peer runs: give it the core now instead of spinning first. Publishes this
    /// side's CPU for the peer's same check (a store only when it changed).
    fn idle(&mut self) {
        if self.colocated() {
            std::thread::yield_now();
        }
    }

    /// Whether the peer last waited on the CPU this side runs on (publishing this side's CPU
    /// for the peer's same check): then what this side waits for comes only once the peer
    /// gets this core.
    pub fn colocated(&mut self) -> bool {
        // SAFETY: sched_getcpu has no preconditions.
        let cpu = unsafe { libc::sched_getcpu() };
        if cpu < 0 {
            return false;
        }
        let mine = cpu as u32 + 1;
        if mine != self.cpu {
            self.cpu = mine;
            self.hdr.set_cpu(self.side, mine);
        }
        self.hdr.cpu(1 - self.side) == mine
    }

    /// The small-message lane of this link.
    pub fn lane(&mut self) -> &mut lane::Lane {
        &mut self.lane
    }

    /// What a side waiting on the lane looks at now and then: a closed or shut link (an
    /// error), and bytes in the ring: the peer runs an operation that is
    /// not the lane's (the calls differ). Returns the first ring bytes (at most `out.len()`,
    /// not consumed: the start of the peer's operation signature, when mismatch detection is
    /// on), or 0 when the ring is empty.
    pub fn lane_check(&mut self, out: &mut [u8]) -> Result<usize> {
        let alive = self.drain()?;
        if !alive || self.rx.closed() {
            return Err(self.remote("closed the connection (process exited or failed)"));
        }
        let (a, b) = self.rx.peek();
        // The first bytes only: the ring may hold far more than `out`.
        let na = a.len().min(out.len());
        out[..na].copy_from_slice(&a[..na]);
        let nb = b.len().min(out.len() - na);
        out[na..na + nb].copy_from_slice(&b[..nb]);
        let n = na + nb;
        if n == 0 && self.cma_rx.active(self.rx.position()) {
            // A single-copy segment with no ring bytes before it: data, without a signature.
            return Ok(out.len().min(1));
        }
        Ok(n)
    }

    /// The peer's message (or notice) on the lane that this side has not taken, while nothing
    /// of an earlier operation is left to read: the peer runs a small all-reduce (the lane's)
    /// where this side runs another operation. Its stamp, or `None`.
    pub fn lane_unexpected(&mut self) -> Option<lane::Stamp> {
        let seq = self.lane.next_seq();
        // The lane first: the peer published every ring byte of its earlier operations
        // before it wrote there.
        let stamp = if self.lane.ready(seq) { Some(self.lane.take(seq, &mut [])) } else { self.lane.notice(seq) }?;
        if self.rx.readable() > 0 || self.cma_rx.buffered() || self.cma_rx.active(self.rx.position()) {
            return None;
        }
        Some(stamp)
    }
}

impl Link for ShmLink {
    fn try_send(&mut self, buf: &[u8]) -> Result<usize> {
        if self.tx.closed() {
            return Err(self.remote("shut the link down"));
        }
        if let Some(c) = self.cma_tx.as_mut() {
            if c.busy() {
                return c.progress(buf);
            }
            if !self.ring_partial && c.wants(buf.len()) {
                c.post(buf, self.tx.position());
                if self.tx.take_reader_asleep() {
                    self.doorbell();
                }
                return self.cma_tx.as_mut().map_or(Ok(0), |c| c.progress(buf));
            }
        }
        self.ring_send(buf)
    }

    fn try_send_vectored(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        if self.tx.closed() {
            return Err(self.remote("shut the link down"));
        }
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        if want <= SMALL && bufs.len() > 1 {
            // Small pieces (a signature and a small message) are gathered first, so they are
            // published with one store of the ring's tail (one shared-line transfer).
            let mut tmp = std::mem::take(&mut self.small);
            let n = super::gather(bufs, &mut tmp);
            let r = self.ring_send(&tmp[..n]);
            self.small = tmp;
            return r;
        }
        // Every piece goes into the ring in order (a large one, once all before it went, by
        // single copy); one wake-up check for all of them.
        let mut total = 0;
        for b in bufs {
            if b.is_empty() {
                continue;
            }
            if self.cma_tx.as_ref().is_some_and(|c| c.busy()) {
                break;
            }
            if !self.ring_partial && self.cma_tx.as_mut().is_some_and(|c| c.wants(b.len())) {
                if total > 0 && self.tx.take_reader_asleep() {
                    self.doorbell();
                }
                return Ok(total + self.try_send(b)?);
            }
            let n = self.tx.write(b);
            total += n;
            if n > 0 {
                self.ring_partial = n < b.len();
            }
            if n < b.len() {
                break;
            }
        }
        if total > 0 && self.tx.take_reader_asleep() {
            self.doorbell();
        }
        Ok(total)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        if !self.cma_rx.enabled() {
            let n = self.rx.read(buf);
            if n > 0 {
                if self.rx.take_writer_asleep() {
                    self.doorbell();
                }
            } else if !buf.is_empty() {
                if self.rx.closed() {
                    return Err(self.remote("shut the link down"));
                }
                self.idle();
            }
            return Ok(n);
        }
        self.recv2(buf, &mut [])
    }

    fn try_recv_vectored(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        self.recv2(a, b)
    }

    fn recv_in_place(&mut self, max: usize, f: &mut dyn FnMut(&[u8], &[u8]) -> usize) -> Result<Option<usize>> {
        if self.cma_rx.buffered() || (self.rx.readable() == 0 && self.cma_rx.active(self.rx.position())) {
            return self.recv_in_place_cma(max, f).map(Some);
        }
        let (a, b) = self.rx.peek();
        let na = a.len().min(max);
        let nb = b.len().min(max - na);
        if na + nb == 0 {
            if max > 0 {
                if self.rx.closed() {
                    return Err(self.remote("shut the link down"));
                }
                self.idle();
            }
            return Ok(Some(0));
        }
        let used = f(&a[..na], &b[..nb]).min(na + nb);
        if used > 0 {
            self.rx.consume(used);
            if self.rx.take_writer_asleep() {
                self.doorbell();
            }
        }
        Ok(Some(used))
    }

    fn supports_in_place(&self) -> bool {
        true
    }

    fn forward_space(&mut self) -> Option<(*mut u8, usize)> {
        if self.tx.closed() || self.cma_tx.as_ref().is_some_and(|c| c.busy()) {
            return None;
        }
        let room = self.tx.free_slice();
        Some((room.as_mut_ptr(), room.len()))
    }

    fn forward_publish(&mut self, n: usize, more: bool) {
        if n == 0 {
            return;
        }
        self.tx.publish(n);
        self.ring_partial = more;
        if self.tx.take_reader_asleep() {
            self.doorbell();
        }
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.sock.as_raw_fd())
    }

    fn poll_events(&self, _interest: Interest) -> i16 {
        // Wake-ups for both directions, and end-of-file, arrive as readable bytes.
        libc::POLLIN
    }

    fn arm(&mut self, interest: Interest) -> Result<bool> {
        let alive = self.drain()?;
        if interest.read
            && (self.cma_rx.buffered()
                || self.rx.announce_sleep() > 0
                || self.cma_rx.active(self.rx.position())
                || self.rx.closed())
        {
            return Ok(false);
        }
        if !alive {
            return Err(self.remote("closed the connection (process exited or failed)"));
        }
        if interest.write {
            // While a single-copy send is outstanding, the ring is not what the sender waits
            // for: it waits for the receiver's copy (the receiver sees the flag after its copy).
            let room = self.tx.announce_sleep() > 0;
            let moved = match self.cma_tx.as_ref().filter(|c| c.busy()) {
                Some(c) => c.moved(),
                None => room,
            };
            if moved || self.tx.closed() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn describe(&self) -> String {
        format!("rank {} ({}, shared memory)", self.peer_rank, self.peer_addr)
    }

    fn shm(&mut self) -> Option<&mut ShmLink> {
        Some(self)
    }

    fn shutdown(&self) {
        self.tx.close();
        self.rx.close();
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests;
