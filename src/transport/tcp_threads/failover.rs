//! Failover of a dead rail, for links with several rails (docs/RELIABILITY.md, "Rail failover").
//!
//! **What is kept.** A sender of such a link frees a byte of its send ring only once the peer's
//! kernel acknowledged it (`moved - SIOCOUTQ`): until then the ring holds every byte the peer may
//! not have. Bytes the peer's kernel acknowledged sit in its receive queue, readable even after
//! the rail went down.
//!
//! **Detection.** A socket that holds sent, unacknowledged bytes (or bytes the kernel cannot
//! send, with two or more of its zero-window probes unanswered in a row: the peer's window was
//! closed when the rail died, or no route is left) and sees none acknowledged for
//! `OXCCL_RAIL_TIMEOUT_MS`, or whose send or receive fails with anything but a reset or an end
//! of stream (the peer's process going away, which fails the link as before), reports its rail
//! to the link's watcher thread. Helper calls block for at most [`TICK`], so they look at the
//! failover state often.
//!
//! **Spares.** Each data socket `s` of a link with `R` rails has an idle spare connection on
//! every other rail: `R - 1` of them, the `k`-th on rail `(s mod R + k) mod R`
//! ([`spare_rail`]). A socket whose rail is lost moves to its first spare (in that order) whose
//! rail is not lost yet. Both ends know the same lost rails (each recovery is done by both), so
//! both pick the same spares, and the spare a socket takes is never in use: a socket leaves a
//! rail only when that rail is lost. So a link survives losing rails one after another, or
//! several at once, down to the last one.
//!
//! **Recovery** of rail `r` (every data socket on it), by the watcher of each end, over the
//! spare picked for the lowest of those sockets. Only the lower rank's watcher starts one: the
//! higher one, when its helpers report a rail, sends `FAILED r` on its spares of the other
//! rails (again every rail timeout until done), so two rails lost at once never have both ends
//! each waiting for the other's `FROZEN` on a different rail. Each end counts the asks it sent
//! and read on each spare, and a spare taking over has the asks still on it read off first.
//! 1. pause the helpers of the sockets (no more sending, freeing or reading on them); the
//!    senders' kept bytes start at their freed offsets;
//! 2. send `FROZEN r`; wait for the peer's (a peer whose watcher sees `FROZEN r` first starts
//!    the same steps); from then on the peer frees nothing more on those sockets. A spare whose
//!    peer does not answer within the wait is on a rail that died too: its rail is skipped and
//!    the next spare tried; the peer, seeing `FROZEN r` on that one, skips the same rails;
//! 3. drain each old socket's receive queue without blocking: the socket's count is what the
//!    receiver had put in its ring plus the drained bytes, which covers every byte the peer
//!    freed (it freed only bytes our kernel had acknowledged before its `FROZEN`);
//! 4. send `COUNTS r c... a...` (`a`: the asks sent on each spare taking over); read the peer's;
//! 5. shut the old sockets and hand each one's spare to its helpers: the sender resends from
//!    the peer's count (dropping the bytes before it), the receiver first delivers the drained
//!    bytes, then reads the spare.
//!
//! Each socket keeps its own byte stream and the stripe layout does not change, so the
//! receiver applies every stream byte once, in order. The spares on the lost rail are closed.
//! Losing the last rail fails the link: the rings close with an error naming the peer and the
//! rails. Rails found dead during a recovery (their spare did not answer) count as lost from
//! then on at both ends; their own sockets move when their recovery comes.

use super::super::ring::{Consumer, Producer};
use super::super::tcp::Layout;
use super::worker::{end_of_receiving, received, retry, Owned, Shared};
use super::CHUNK;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest a helper's blocking call on a socket of a link with several rails waits before the
/// helper looks at the failover state again.
pub(super) const TICK: Duration = Duration::from_millis(50);

/// Message tags on a spare connection.
const FROZEN: u8 = 0xF5;
const COUNTS: u8 = 0xC7;
/// The higher rank's ask that the lower one recover a rail (`FAILED r`).
const FAILED: u8 = 0xFA;

/// The rails of a link with several, as the TCP set-up hands them over.
pub struct RailPlan {
    /// Rails of the link: data socket `s` runs on rail `s mod rails`.
    pub rails: usize,
    /// This end's interface of each rail, for messages.
    pub names: Vec<String>,
    /// `rails - 1` spare connections per data socket: spare `j` (socket `j mod n` of the `n`
    /// data sockets) on rail [`spare_rail`]`(j, n, rails)`.
    pub spares: Vec<TcpStream>,
    /// `OXCCL_RAIL_TIMEOUT_MS`.
    pub timeout: Duration,
    /// This rank, for messages.
    pub me: usize,
}

/// The rail of spare `j` of a link with `nsocks` data sockets over `rails` rails: spare `j`
/// serves data socket `s = j mod nsocks` (on rail `s mod rails`) and runs on the
/// `(j / nsocks + 1)`-th rail after that one.
pub fn spare_rail(j: usize, nsocks: usize, rails: usize) -> usize {
    let (s, k) = (j % nsocks.max(1), j / nsocks.max(1) + 1);
    (s % rails + k) % rails
}

/// The spare data socket `s` moves to when its rail is lost, with `lost` the rails lost so far
/// (its own rail among them): the first of its spares, in [`spare_rail`] order, whose rail is
/// not lost; `None` when every rail is.
pub(super) fn pick_spare(s: usize, nsocks: usize, lost: &[bool]) -> Option<usize> {
    let rails = lost.len();
    (0..rails.saturating_sub(1)).map(|k| k * nsocks + s).find(|&j| !lost[spare_rail(j, nsocks, rails)])
}

/// One data socket's failover state, shared by the watcher and the socket's helpers.
#[derive(Default)]
struct Slot {
    /// The rail the socket runs on now.
    rail: usize,
    /// A clone of the socket in use (for draining and shutting it).
    sock: Option<TcpStream>,
    /// The sender paused, its ring's kept bytes starting at this offset of the socket's stream.
    tx_paused: Option<u64>,
    /// The receiver paused, having put this many bytes of the socket's stream in its ring.
    rx_paused: Option<u64>,
    /// The sender's new connection, and the offset the peer has up to.
    tx_new: Option<(TcpStream, u64)>,
    /// The receiver's new connection, and the old socket's drained bytes to deliver first.
    rx_new: Option<(TcpStream, Vec<u8>)>,
}

/// The higher rank's asks (`FAILED r`) on each spare: sent by this end, read from the peer.
pub(super) struct Notes {
    sent: Vec<u32>,
    read: Vec<u32>,
}

/// What the watcher and the helpers of a link with several rails share.
pub(super) struct Ctl {
    rails: usize,
    timeout: Duration,
    names: Vec<String>,
    me: usize,
    peer_rank: usize,
    /// Set by the watcher: the helpers of socket `s` stop using it.
    pausing: Vec<AtomicBool>,
    slots: Vec<Mutex<Slot>>,
    /// Sockets reported failed, with the first reason each.
    reports: Mutex<Vec<Option<String>>>,
    /// Every rail to the peer failed: helpers close their rings and exit.
    pub(super) dead: AtomicBool,
    /// Clones of the spares, for shutting them.
    spares: Vec<TcpStream>,
}

/// Per-socket state of a helper of a link with several rails.
#[derive(Default)]
pub(super) struct HelperState {
    /// The socket is paused for a recovery.
    paused: bool,
    /// The socket failed (reported); nothing more is sent or read on it until it is replaced.
    broken: bool,
    /// Receivers: bytes drained from the old socket, delivered before the new one's.
    pending: Vec<u8>,
    /// Senders: the acknowledged offset last seen, and since when no byte was acknowledged.
    acked: u64,
    since: Option<Instant>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    crate::sync::lock(m)
}

impl Ctl {
    /// The shared state of a link over `socks` with `plan`'s rails.
    pub(super) fn new(socks: &[TcpStream], plan: &RailPlan, peer_rank: usize) -> std::io::Result<Ctl> {
        let mut slots = Vec::with_capacity(socks.len());
        for (s, sock) in socks.iter().enumerate() {
            slots.push(Mutex::new(Slot { rail: s % plan.rails, sock: Some(sock.try_clone()?), ..Slot::default() }));
        }
        Ok(Ctl {
            rails: plan.rails,
            timeout: plan.timeout,
            names: plan.names.clone(),
            me: plan.me,
            peer_rank,
            pausing: socks.iter().map(|_| AtomicBool::new(false)).collect(),
            slots,
            reports: Mutex::new(vec![None; socks.len()]),
            dead: AtomicBool::new(false),
            spares: plan.spares.iter().map(|s| s.try_clone()).collect::<std::io::Result<_>>()?,
        })
    }

    /// A helper found socket `s` failed.
    fn report(&self, s: usize, why: String) {
        crate::info!("rail socket {s} to rank {}: {why}", self.peer_rank);
        let mut r = lock(&self.reports);
        if r[s].is_none() {
            r[s] = Some(why);
        }
    }

    /// Tests: reports every socket on rail `rail` failed, as a helper finding it dead would.
    #[cfg(test)]
    pub(super) fn fail_rail(&self, rail: usize) {
        for s in 0..self.slots.len() {
            if lock(&self.slots[s]).rail == rail {
                self.report(s, "failed by the test".into());
            }
        }
    }

    /// Tests: the rails the data sockets run on now, each once, in order.
    #[cfg(test)]
    pub(super) fn rails_in_use(&self) -> Vec<usize> {
        let mut r: Vec<usize> = self.slots.iter().map(|s| lock(s).rail).collect();
        r.sort_unstable();
        r.dedup();
        r
    }

    /// Tests: whether any socket is reported failed (now).
    #[cfg(test)]
    pub(super) fn reported(&self) -> bool {
        lock(&self.reports).iter().any(Option::is_some)
    }

    /// Shuts every spare (the link is stopping).
    pub(super) fn shutdown(&self) {
        for s in &self.spares {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn rail_name(&self, r: usize) -> &str {
        self.names.get(r).map_or("?", |n| n.as_str())
    }
}

/// Sets a helper socket blocking with [`TICK`] timeouts.
pub(super) fn tick_timeouts(s: &TcpStream) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(TICK))?;
    s.set_write_timeout(Some(TICK))
}

/// The payload a socket's send buffer holds (the kernel reports twice the size asked for, half
/// of it for its bookkeeping), 4 to 64 MiB (autotuned buffers grow to about 4 MiB).
pub(super) fn send_buffer(s: &TcpStream) -> usize {
    socket2::SockRef::from(s).send_buffer_size().map_or(0, |b| b / 2).clamp(4 << 20, 64 << 20)
}

/// A socket's send queue: (bytes not yet acknowledged, of which not yet sent).
fn send_queue(s: &TcpStream) -> (u64, u64) {
    let (mut outq, mut unsent): (libc::c_int, libc::c_int) = (0, 0);
    // SAFETY: both ioctls write one int through the pointer given, on a socket we own.
    unsafe {
        libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut outq);
        libc::ioctl(s.as_raw_fd(), libc::SIOCOUTQNSD, &mut unsent);
    }
    (outq.max(0) as u64, unsent.max(0) as u64)
}

/// Zero-window probes of a socket not answered in a row (`tcpi_probes`): the kernel probes a
/// socket whose bytes it holds but cannot send (the peer's window closed, or no route), and any
/// answer resets the count, so a live peer that does not read keeps it at 0 or 1.
fn unanswered_probes(s: &TcpStream) -> u8 {
    // SAFETY: an all-zero `tcp_info` is valid (integers only).
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `info`, on a socket we own.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if r == 0 {
        info.tcpi_probes
    } else {
        0
    }
}

/// Whether an error means the peer's process went away (its kernel reset the connection), as
/// opposed to a path that stopped working.
fn peer_gone(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted)
}

/// The earliest (in stream order) of the sockets a helper still serves.
fn first<E>(layout: &Layout, owned: &[Owned<E>]) -> Option<usize> {
    (0..owned.len()).filter(|&k| owned[k].live).min_by_key(|&k| layout.next(owned[k].index, owned[k].moved).0)
}

/// The sender side of a socket between two sends: frees what the peer's kernel acknowledged,
/// watches for a stall, and takes part in a recovery (pauses; takes the replacement).
fn tx_turn(o: &mut Owned<Consumer>, ctl: &Ctl, shared: &Shared, now: Instant) {
    let s = o.index;
    if o.fo.paused {
        if ctl.pausing[s].load(Ordering::Acquire) {
            return;
        }
        let Some((sock, resume)) = lock(&ctl.slots[s]).tx_new.take() else { return };
        let kept = o.end.position();
        let (moved, readable) = (o.moved, o.end.readable() as u64);
        if resume < kept || resume > moved || resume - kept > readable {
            ctl.report(s, format!("the peer's count {resume} is outside the kept bytes {kept}..{moved}"));
            ctl.dead.store(true, Ordering::Release);
            return;
        }
        o.end.consume((resume - kept) as usize);
        (o.moved, o.sock) = (resume, sock);
        o.fo = HelperState { acked: resume, ..HelperState::default() };
        if o.end.take_writer_asleep() {
            shared.notify();
        }
        return;
    }
    if o.moved > o.end.position() && !o.fo.broken {
        let (outq, unsent) = send_queue(&o.sock);
        let acked = o.moved.saturating_sub(outq);
        let kept = o.end.position();
        if acked > kept {
            o.end.readable();
            o.end.consume((acked - kept) as usize);
            if o.end.take_writer_asleep() {
                shared.notify();
            }
        }
        // Bytes in flight, or bytes the kernel cannot send whose window probes go unanswered
        // (the peer's window was closed when the rail died, or this end has no route left).
        let waiting = outq > unsent || (unsent > 0 && unanswered_probes(&o.sock) >= 2);
        if waiting && acked == o.fo.acked {
            let since = *o.fo.since.get_or_insert(now);
            if now.duration_since(since) >= ctl.timeout {
                o.fo.broken = true;
                ctl.report(s, format!("no byte acknowledged for {} ms", ctl.timeout.as_millis()));
            }
        } else {
            (o.fo.acked, o.fo.since) = (acked, None);
        }
    } else {
        o.fo.since = None;
    }
    if ctl.pausing[s].load(Ordering::Acquire) {
        o.fo.paused = true;
        lock(&ctl.slots[s]).tx_paused = Some(o.end.position());
    }
}

/// [`super::worker::send_loop`] for a link with several rails: the ring keeps each byte until
/// the peer's kernel acknowledged it, and a socket can be paused and replaced.
pub(super) fn send_loop(
    mut owned: Vec<Owned<Consumer>>,
    layout: Layout,
    shared: Arc<Shared>,
    ctl: Arc<Ctl>,
    peer: String,
) {
    let mut nap = Duration::from_micros(20);
    let clean = loop {
        if ctl.dead.load(Ordering::Acquire) {
            break false;
        }
        let stop = shared.stop.load(Ordering::Acquire);
        let now = Instant::now();
        for o in owned.iter_mut() {
            tx_turn(o, &ctl, &shared, now);
        }
        let Some(k) = first(&layout, &owned) else { break true };
        let o = &mut owned[k];
        if o.fo.paused || o.fo.broken {
            if stop {
                break false;
            }
            std::thread::sleep(TICK / 10);
            continue;
        }
        let at = (o.moved - o.end.position()) as usize;
        let readable = o.end.readable();
        if at >= readable {
            // The earliest stripe has nothing unsent, so neither have the later ones.
            if stop || o.end.closed() {
                break true;
            }
            if readable == 0 {
                if o.end.announce_sleep() == 0 && !o.end.closed() && !shared.stop.load(Ordering::Acquire) {
                    std::thread::park_timeout(TICK);
                }
            } else {
                // Everything is with the kernel: wait for acknowledgements to free room.
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
            continue;
        }
        nap = Duration::from_micros(20);
        let (_, room) = layout.next(o.index, o.moved);
        let (a, b) = o.end.peek();
        let rest = if at < a.len() { &a[at..] } else { &b[at - a.len()..] };
        let n = rest.len().min(room).min(CHUNK);
        match super::super::nosig::send(&o.sock, &rest[..n]) {
            Ok(m) if m > 0 => o.moved += m as u64,
            Err(e) if retry(&e) => {}
            Err(e) if !peer_gone(&e) => {
                o.fo.broken = true;
                ctl.report(o.index, format!("send: {e}"));
            }
            r => {
                let why = r.err().map_or_else(|| "end of stream".to_string(), |e| e.to_string());
                if !shared.stop.load(Ordering::Acquire) {
                    shared.fail(format!("peer {peer}: connection failed while sending: {why}"));
                }
                break false;
            }
        }
    };
    for o in &owned {
        if clean {
            let _ = o.sock.shutdown(std::net::Shutdown::Write);
        } else {
            o.end.close();
        }
    }
    shared.senders.fetch_sub(1, Ordering::AcqRel);
    shared.notify();
}

/// The receiver side of a socket between two reads: takes part in a recovery (pauses; takes
/// the replacement and the drained bytes) and delivers drained bytes as ring room allows.
fn rx_turn(o: &mut Owned<Producer>, ctl: &Ctl, shared: &Shared) {
    let s = o.index;
    if o.fo.paused {
        if ctl.pausing[s].load(Ordering::Acquire) {
            return;
        }
        let Some((sock, drained)) = lock(&ctl.slots[s]).rx_new.take() else { return };
        // Bytes drained by an earlier recovery and not delivered yet come first.
        let mut pending = std::mem::take(&mut o.fo.pending);
        pending.extend_from_slice(&drained);
        o.sock = sock;
        o.fo = HelperState { pending, ..HelperState::default() };
    } else if ctl.pausing[s].load(Ordering::Acquire) {
        o.fo.paused = true;
        lock(&ctl.slots[s]).rx_paused = Some(o.moved + o.fo.pending.len() as u64);
        return;
    }
    while !o.fo.pending.is_empty() {
        let buf = o.end.free_slice();
        let n = buf.len().min(o.fo.pending.len());
        if n == 0 {
            break;
        }
        buf[..n].copy_from_slice(&o.fo.pending[..n]);
        o.end.publish(n);
        o.fo.pending.drain(..n);
        o.moved += n as u64;
        if o.end.take_reader_asleep() {
            shared.notify();
        }
    }
}

/// [`super::worker::recv_loop`] for a link with several rails: a socket can be paused and
/// replaced; a failure other than the peer's going away is reported, not fatal.
pub(super) fn recv_loop(
    mut owned: Vec<Owned<Producer>>,
    layout: Layout,
    shared: Arc<Shared>,
    ctl: Arc<Ctl>,
    peer: String,
) {
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        if ctl.dead.load(Ordering::Acquire) {
            for o in &owned {
                o.end.close();
            }
            shared.notify();
            return;
        }
        for o in owned.iter_mut() {
            rx_turn(o, &ctl, &shared);
        }
        let Some(k) = first(&layout, &owned) else { return };
        let (_, room) = layout.next(owned[k].index, owned[k].moved);
        let o = &mut owned[k];
        if o.end.closed() {
            return;
        }
        if o.fo.paused || o.fo.broken {
            std::thread::sleep(TICK / 10);
            continue;
        }
        if o.end.writable() == 0 || !o.fo.pending.is_empty() {
            if o.end.announce_sleep() == 0 && !o.end.closed() {
                std::thread::park_timeout(TICK);
            }
            continue;
        }
        let buf = o.end.free_slice();
        let n = buf.len().min(room).min(CHUNK);
        match (&o.sock).read(&mut buf[..n]) {
            Ok(m) if m > 0 => received(o, m, &shared),
            Err(e) if retry(&e) => {}
            Err(e) if !peer_gone(&e) => {
                o.fo.broken = true;
                ctl.report(o.index, format!("receive: {e}"));
            }
            // The peer ended the stream or reset it.
            r => end_of_receiving(o, r, &shared, &peer),
        }
    }
}

/// The watcher of a link with several rails: serves the peer's `FROZEN` messages on the
/// spares and the helpers' reports, recovering one rail at a time ([`recover`]); fails the
/// link when a recovery fails.
pub(super) fn watch(ctl: Arc<Ctl>, shared: Arc<Shared>, spares: Vec<TcpStream>, peer_rank: usize, peer: String) {
    let mut spares: Vec<Option<TcpStream>> = spares.into_iter().map(Some).collect();
    // The rails lost so far (recovered from, by both ends).
    let mut lost = vec![false; ctl.rails];
    // Only the lower rank starts recoveries (two ends starting two rails at once would each
    // wait for the other); the higher one asks it to, again every rail timeout until done.
    let lead = ctl.me < peer_rank;
    let mut asked: Vec<Option<Instant>> = vec![None; ctl.rails];
    // When the higher rank first asked for each rail still reported; unanswered for three
    // exchange waits (the lower one gone deaf, or every ask on a dead rail), it recovers the
    // rail itself, which fails the link if no spare answers.
    let mut first_ask: Vec<Option<Instant>> = vec![None; ctl.rails];
    let mut notes = Notes { sent: vec![0; spares.len()], read: vec![0; spares.len()] };
    while !shared.stop.load(Ordering::Acquire) && !ctl.dead.load(Ordering::Acquire) {
        let ids: Vec<usize> = (0..spares.len()).filter(|&s| spares[s].is_some()).collect();
        let mut fds: Vec<libc::pollfd> = ids
            .iter()
            .map(|&s| libc::pollfd {
                fd: spares[s].as_ref().map_or(-1, |x| x.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a valid array of `fds.len()` pollfds for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 20) };
        // (rail, the spare the peer's FROZEN came on, why)
        let mut todo: Option<(usize, Option<usize>, String)> = None;
        for (i, &s) in ids.iter().enumerate() {
            if fds[i].revents == 0 || todo.is_some() {
                continue;
            }
            let mut m = [0u8; 2];
            let sp = spares[s].as_ref().expect("polled spares are there");
            let _ = sp.set_read_timeout(Some(Duration::from_secs(1)));
            match (&*sp).read_exact(&mut m) {
                Ok(()) if m[0] == FROZEN && (m[1] as usize) < ctl.rails => {
                    todo = Some((m[1] as usize, Some(s), "the peer found it failed".into()));
                }
                Ok(()) if m[0] == FAILED && (m[1] as usize) < ctl.rails => {
                    notes.read[s] += 1;
                    if lead {
                        todo = Some((m[1] as usize, None, "the peer found it failed".into()));
                    }
                }
                // The peer closed its spares (its link is going away), or garbage: unused.
                _ => spares[s] = None,
            }
        }
        if todo.is_none() {
            let reports = lock(&ctl.reports).clone();
            let mine: Vec<(usize, String)> =
                reports.into_iter().enumerate().filter_map(|(s, why)| Some((lock(&ctl.slots[s]).rail, why?))).collect();
            if lead {
                todo = mine.into_iter().next().map(|(rail, why)| (rail, None, why));
            } else {
                for (r, first) in first_ask.iter_mut().enumerate() {
                    if !mine.iter().any(|(rail, _)| *rail == r) {
                        *first = None;
                    }
                }
                let late = |r: usize| first_ask[r].is_some_and(|t| t.elapsed() >= exchange_wait(&ctl) * 3);
                if let Some((rail, why)) = mine.iter().find(|(r, _)| late(*r)) {
                    todo = Some((*rail, None, format!("{why}; the peer did not start its recovery")));
                }
                for (rail, _) in mine.into_iter().filter(|_| todo.is_none()) {
                    first_ask[rail].get_or_insert_with(Instant::now);
                    if asked[rail].is_some_and(|t| t.elapsed() < ctl.timeout) {
                        continue;
                    }
                    asked[rail] = Some(Instant::now());
                    // On every spare of another rail still in use: one of them reaches the peer.
                    for (j, sp) in spares.iter().enumerate() {
                        let on = spare_rail(j, ctl.slots.len(), ctl.rails);
                        if let Some(sp) = sp.as_ref().filter(|_| on != rail && !lost[on]) {
                            let _ = sp.set_write_timeout(Some(TICK));
                            if (&*sp).write_all(&[FAILED, rail as u8]).is_ok() {
                                notes.sent[j] += 1;
                            }
                        }
                    }
                }
            }
        }
        let Some((rail, peer_started, why)) = todo else { continue };
        match recover(&ctl, &mut spares, &mut notes, &mut lost, rail, peer_started) {
            Ok(Some((n, to))) => {
                crate::warn!(
                    "rank {}: rail {} to {peer} failed ({why}); its {n} socket(s) moved to {to}",
                    ctl.me,
                    ctl.rail_name(rail)
                );
            }
            Ok(None) => {}
            Err(e) => {
                let names: Vec<&str> = (0..ctl.rails).map(|r| ctl.rail_name(r)).collect();
                shared.fail(format!(
                    "peer {peer}: rail {} failed ({why}) and moving its sockets to the other rails failed ({e}): \
                     no rail to rank {peer_rank} works (rails {})",
                    ctl.rail_name(rail),
                    names.join(", ")
                ));
                ctl.dead.store(true, Ordering::Release);
                // The peer learns it from its sockets' ends, if any path still reaches it.
                for s in shared.socks.iter().chain(&ctl.spares) {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
                for slot in &ctl.slots {
                    if let Some(s) = &lock(slot).sock {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                }
                shared.notify();
            }
        }
    }
}

/// How long a recovery waits for the peer on a spare, and for its helper threads to pause.
fn exchange_wait(ctl: &Ctl) -> Duration {
    ctl.timeout.max(Duration::from_millis(500)) * 2 + Duration::from_secs(1)
}

/// Recovers rail `rail` (module comment, steps 1 to 5), `lost` the rails lost before (marked
/// lost too once it succeeded); `peer_started`: the peer's `FROZEN` was read already, on that
/// spare. Returns the sockets moved and the rails they moved to (`None`: no socket runs on that
/// rail any more), or why it failed.
fn recover(
    ctl: &Ctl,
    spares: &mut [Option<TcpStream>],
    notes: &mut Notes,
    lost: &mut [bool],
    rail: usize,
    peer_started: Option<usize>,
) -> Result<Option<(usize, String)>, String> {
    let socks: Vec<usize> = (0..ctl.slots.len()).filter(|&s| lock(&ctl.slots[s]).rail == rail).collect();
    if socks.is_empty() {
        return Ok(None);
    }
    let n = ctl.slots.len();
    // The rails this recovery must not move to: the lost ones, this one, and any whose spare
    // did not answer `FROZEN` (dead too: two rails lost at once), as found by either end.
    let mut after = lost.to_vec();
    after[rail] = true;
    if let Some(j) = peer_started {
        // The peer moved past the spares before `j` (theirs did not answer): so does this end.
        let s0 = socks[0];
        if j % n.max(1) != s0 % n.max(1) || after[spare_rail(j, n, ctl.rails)] {
            return Err(format!("the peer froze rail {rail} on spare {j}, not one of socket {s0}'s spares left"));
        }
        for k in 0..j / n.max(1) {
            after[spare_rail(k * n + s0, n, ctl.rails)] = true;
        }
    }
    let pick = |after: &[bool], spares: &[Option<TcpStream>]| -> Result<Vec<usize>, String> {
        let mut picked = Vec::with_capacity(socks.len());
        for &s in &socks {
            let Some(j) = pick_spare(s, n, after) else {
                let gone: Vec<&str> =
                    (0..ctl.rails).filter(|&r| after[r] && r != rail).map(|r| ctl.rail_name(r)).collect();
                let before =
                    if gone.is_empty() { String::new() } else { format!("; lost before: {}", gone.join(", ")) };
                return Err(format!("it was the last rail{before}"));
            };
            if spares[j].is_none() {
                return Err(format!(
                    "the spare of socket {s} on rail {} is closed",
                    ctl.rail_name(spare_rail(j, n, ctl.rails))
                ));
            }
            picked.push(j);
        }
        Ok(picked)
    };
    let mut picked = pick(&after, spares)?;
    if let Some(j) = peer_started.filter(|&j| j != picked[0]) {
        return Err(format!("the peer froze rail {rail} on spare {j}, this end picked spare {}", picked[0]));
    }
    let wait = exchange_wait(ctl);
    // 1. Pause the helpers of the rail's sockets.
    for &s in &socks {
        let mut st = lock(&ctl.slots[s]);
        (st.tx_paused, st.rx_paused) = (None, None);
        ctl.pausing[s].store(true, Ordering::Release);
    }
    let deadline = Instant::now() + wait;
    while !socks.iter().all(|&s| {
        let st = lock(&ctl.slots[s]);
        st.tx_paused.is_some() && st.rx_paused.is_some()
    }) {
        if Instant::now() >= deadline {
            return Err("the helper threads did not pause".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // 2. FROZEN both ways, over the spare of the lowest socket. A spare whose peer does not
    // answer in time is on a rail that died too: both ends then go on to the next spare (the
    // peer's FROZEN on it tells the other end to skip the same ones).
    let coord = loop {
        let coord = picked[0];
        let c = spares[coord].as_ref().expect("checked by pick");
        let io = |what: &str, e: std::io::Error| format!("{what} on spare {coord}: {e}");
        let frozen = (|| {
            c.set_write_timeout(Some(wait)).map_err(|e| io("SO_SNDTIMEO", e))?;
            c.set_read_timeout(Some(wait)).map_err(|e| io("SO_RCVTIMEO", e))?;
            (&*c).write_all(&[FROZEN, rail as u8]).map_err(|e| io("sending FROZEN", e))?;
            if peer_started.is_none() {
                let mut m = [FAILED, 0];
                // The peer's asks sent before it saw this FROZEN come first: skipped (it asks
                // again for a rail still to recover).
                while m[0] == FAILED {
                    (&*c).read_exact(&mut m).map_err(|e| io("waiting for the peer's FROZEN", e))?;
                    notes.read[coord] += u32::from(m[0] == FAILED);
                }
                if m != [FROZEN, rail as u8] {
                    return Err(format!("the peer answered {m:?} for rail {rail}"));
                }
            }
            Ok(())
        })();
        match frozen {
            Ok(()) => break coord,
            Err(e) if peer_started.is_some() => return Err(e),
            Err(e) => {
                let dead = spare_rail(coord, n, ctl.rails);
                crate::info!(
                    "rank {}: rail {} to rank {}: its spare on rail {} did not answer ({e}); trying the next",
                    ctl.me,
                    ctl.rail_name(rail),
                    ctl.peer_rank,
                    ctl.rail_name(dead)
                );
                after[dead] = true;
                picked = pick(&after, spares).map_err(|why| format!("{e}; {why}"))?;
            }
        }
    };
    let c = spares[coord].as_ref().expect("checked by pick");
    let io = |what: &str, e: std::io::Error| format!("{what} on spare {coord}: {e}");
    // 3. Drain the old sockets.
    let mut drained = Vec::with_capacity(socks.len());
    for &s in &socks {
        let st = lock(&ctl.slots[s]);
        let mut got = Vec::new();
        if let Some(old) = &st.sock {
            let _ = old.set_nonblocking(true);
            let mut buf = vec![0u8; 256 << 10];
            loop {
                match (&*old).read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let _ = old.shutdown(std::net::Shutdown::Both);
        }
        drained.push((st.rx_paused.unwrap_or(0) + got.len() as u64, got));
    }
    // 4. Counts both ways.
    let mut w = vec![COUNTS, rail as u8, socks.len() as u8];
    for (count, _) in &drained {
        w.extend_from_slice(&count.to_le_bytes());
    }
    // Then the asks this end sent on each spare taking over, which the other end reads off
    // the spare before any data.
    for &j in &picked {
        w.extend_from_slice(&notes.sent[j].to_le_bytes());
    }
    (&*c).write_all(&w).map_err(|e| io("sending the counts", e))?;
    let mut r = vec![0u8; 3 + 12 * socks.len()];
    (&*c).read_exact(&mut r).map_err(|e| io("waiting for the peer's counts", e))?;
    if r[..3] != [COUNTS, rail as u8, socks.len() as u8] {
        return Err(format!("the peer's counts for rail {rail} are malformed"));
    }
    // 5. The spares take over.
    let mut to: Vec<&str> = Vec::new();
    for (i, ((&s, &j), (_, got))) in socks.iter().zip(&picked).zip(drained).enumerate() {
        let theirs = u64::from_le_bytes(r[3 + 8 * i..11 + 8 * i].try_into().expect("8 bytes"));
        let at = 3 + 8 * socks.len() + 4 * i;
        let asks = u32::from_le_bytes(r[at..at + 4].try_into().expect("4 bytes"));
        let spare = spares[j].take().expect("checked by pick");
        // The peer's asks on this spare not read yet: off the stream before the data.
        let mut skip = vec![0u8; 2 * asks.saturating_sub(notes.read[j]) as usize];
        spare.set_read_timeout(Some(wait)).map_err(|e| io("SO_RCVTIMEO", e))?;
        (&spare).read_exact(&mut skip).map_err(|e| io("reading the peer's asks", e))?;
        if skip.chunks(2).any(|m| m[0] != FAILED) {
            return Err(format!("the peer's asks on spare {j} are malformed"));
        }
        tick_timeouts(&spare).map_err(|e| io("setting up", e))?;
        let (tx, rx) = (spare.try_clone().map_err(|e| io("dup", e))?, spare.try_clone().map_err(|e| io("dup", e))?);
        let mut st = lock(&ctl.slots[s]);
        st.rail = spare_rail(j, ctl.slots.len(), ctl.rails);
        st.sock = Some(spare);
        (st.tx_new, st.rx_new) = (Some((tx, theirs)), Some((rx, got)));
        lock(&ctl.reports)[s] = None;
        ctl.pausing[s].store(false, Ordering::Release);
        let name = ctl.rail_name(st.rail);
        if !to.contains(&name) {
            to.push(name);
        }
    }
    // The lost rails' spares serve nothing any more: this one's, and those of any rail found
    // dead with it (its own sockets move when their recovery comes).
    lost.copy_from_slice(&after);
    for (j, sp) in spares.iter_mut().enumerate() {
        if lost[spare_rail(j, ctl.slots.len(), ctl.rails)] {
            if let Some(sp) = sp.take() {
                let _ = sp.shutdown(std::net::Shutdown::Both);
            }
        }
    }
    Ok(Some((socks.len(), to.join(", "))))
}
