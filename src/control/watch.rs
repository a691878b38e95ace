//! The liveness thread: one per process, serving every communicator's control channels. It
//! sleeps in `poll(2)` on them, sends heartbeats every [`BEAT`] (more often when a
//! communicator's liveness timeout is under 4 beats), reads every frame, and fails a
//! communicator whose peer died ([`super::Hooks`]); it exits when no channel is left.
//!
//! A peer's channel is one connection, or one per rail both ends share (opened at creation,
//! `control::open`; [`add`]): the connections of one (communicator, peer) are adjacent in the registry and
//! judged together ([`judge`]). Every connection carries the heartbeats and every frame sent
//! to the peer; a frame is acted on once (a closing or abort frame on one connection settles
//! its siblings too). The peer is heard while any connection delivers valid frames, and dies
//! only when all of them end (closed without closing, or a send failed) or all stay silent
//! for the liveness timeout; one connection ending while another lives is dropped with a WARN
//! naming its rail.

use super::frame::{clean, Frame};
use super::seal::{Opener, Refused, Sealer};
use super::{lock, Hooks};
use crate::bootstrap::Conn;
use crate::error::{Error, ErrorKind, Result};
use std::io::{ErrorKind as IoKind, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

/// How often a heartbeat goes out on every channel.
pub const BEAT: Duration = Duration::from_secs(1);
/// Longest sleep between two looks at the clock.
const NAP: Duration = Duration::from_millis(250);
/// How long a channel that ended without a closing frame waits before its peer is declared
/// dead: the data links, which end at the same moment, report first with their own words.
const EOF_GRACE: Duration = Duration::from_millis(250);
/// Most unread bytes kept per channel (a peer that sends more without a whole frame is
/// misbehaving).
const MAX_BUFFERED: usize = 64 << 10;

struct Chan {
    /// The process that registered it (a forked child's copy is its parent's).
    owner: u32,
    member: u64,
    hooks: Arc<Hooks>,
    peer: usize,
    s: TcpStream,
    /// The peer's address, for messages.
    addr: String,
    /// Seals what goes out ([`super::seal`]).
    sealer: Sealer,
    /// Checks what comes in.
    opener: Opener,
    /// Sealed bytes the socket did not take yet (sent before anything else).
    out: Vec<u8>,
    heard: Instant,
    pid: Option<u32>,
    buf: Vec<u8>,
    /// When the channel ended (or failed to take a heartbeat).
    eof: Option<Instant>,
    /// Reading ended (end of stream or an error). A failed send sets `eof` first; what the
    /// peer sent before it closed (its closing frame) is still read until this is set.
    drained: bool,
    /// The peer sent `closing`.
    closed: bool,
    /// This channel's peer has been reported dead; nothing more is looked at.
    reported: bool,
    /// The peer's abort frame has been reported: later frames but heartbeats and closing are
    /// ignored, and the channel is still watched for the peer's death.
    aborted: bool,
    /// Bytes that are not the peer's arrived: nothing more is read, but this end's own
    /// failure still goes out on it (the peer learns why).
    tampered: bool,
    /// This end's interface (rail) the connection runs on, where the peer's channel has a
    /// connection per rail; empty for a channel of one connection.
    rail: String,
    /// Silent past the liveness timeout while a sibling is heard (noted once, until heard).
    quiet: bool,
    /// Ended while a sibling lives: removed at the end of the thread's pass.
    dropped: bool,
}

struct Registry {
    chans: Vec<Chan>,
    /// The process whose liveness thread runs (none after a fork, in the child).
    thread_pid: Option<u32>,
    next_id: u64,
}

static REG: Mutex<Registry> = Mutex::new(Registry { chans: Vec::new(), thread_pid: None, next_id: 0 });

/// Adds a communicator's channels; starts the thread if it is not running. The communicator's
/// id in the registry.
pub(super) fn join(hooks: &Arc<Hooks>, chans: Vec<(usize, Conn)>) -> Result<u64> {
    let pid = std::process::id();
    for (_, c) in &chans {
        c.stream.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
    }
    let mut r = lock(&REG);
    let id = r.next_id;
    r.next_id += 1;
    let now = Instant::now();
    if r.thread_pid.is_some_and(|p| p != pid) {
        // A forked child: the channels inherited are its parent's, read by the parent's
        // thread; this process must not take their bytes.
        r.chans.retain(|c| c.owner == pid);
    }
    for (peer, c) in chans {
        r.chans.push(Chan::new(pid, id, hooks.clone(), peer, c, String::new(), now));
    }
    if r.thread_pid != Some(pid) {
        std::thread::Builder::new()
            .name("oxccl-liveness".into())
            .spawn(run)
            .map_err(|e| Error::system(format!("cannot start the liveness thread: {e}")))?;
        r.thread_pid = Some(pid);
        static AT_EXIT: Once = Once::new();
        // SAFETY: atexit(3) with a function that takes and returns nothing and never unwinds.
        AT_EXIT.call_once(|| unsafe {
            libc::atexit(at_exit);
        });
    }
    Ok(id)
}

/// Adds connections to the channel of communicator `id` to `peer`, one per further rail
/// ((this end's interface, connection)), `first` naming the rail of the channel's first
/// connection. Nothing is added to a channel that is gone, closed or whose peer was found
/// dead (the connections are dropped).
pub(super) fn add(id: u64, peer: usize, first: &str, rails: Vec<(String, Conn)>) {
    let pid = std::process::id();
    for (_, c) in &rails {
        if c.stream.set_nonblocking(true).is_err() {
            return;
        }
    }
    let mut r = lock(&REG);
    let group: Vec<usize> =
        (0..r.chans.len()).filter(|&i| r.chans[i].member == id && r.chans[i].peer == peer).collect();
    let (Some(&head), Some(&last)) = (group.first(), group.last()) else { return };
    if r.chans[head].owner != pid || group.iter().any(|&i| r.chans[i].closed || r.chans[i].reported) {
        return;
    }
    if r.chans[head].rail.is_empty() {
        r.chans[head].rail = first.to_string();
    }
    let (hooks, aborted, now) = (r.chans[head].hooks.clone(), r.chans[head].aborted, Instant::now());
    for (k, (rail, c)) in rails.into_iter().enumerate() {
        let mut chan = Chan::new(pid, id, hooks.clone(), peer, c, rail, now);
        // A peer whose abort frame was acted on: its copy on this connection is not.
        chan.aborted = aborted;
        r.chans.insert(last + 1 + k, chan);
    }
}

/// How many connections of communicator `id`'s channel to `peer` are in the registry (tests).
#[cfg(test)]
pub(super) fn connections(id: u64, peer: usize) -> usize {
    lock(&REG).chans.iter().filter(|c| c.member == id && c.peer == peer).count()
}

/// Sends `f` on every open channel of communicator `id`.
pub(super) fn broadcast(id: u64, f: &Frame) {
    let mut r = lock(&REG);
    let now = Instant::now();
    r.chans.iter_mut().filter(|c| c.member == id).for_each(|c| c.send(f, now));
}

/// Removes a communicator's channels, each after a closing frame.
pub(super) fn leave(id: u64) {
    let mut r = lock(&REG);
    let now = Instant::now();
    r.chans.iter_mut().filter(|c| c.member == id).for_each(|c| c.send(&Frame::Closing, now));
    r.chans.retain(|c| c.member != id);
}

/// At a normal exit, every channel of this process gets a closing frame (a process that
/// returns from `main` without destroying its communicators did not die).
extern "C" fn at_exit() {
    let mut r = match REG.try_lock() {
        Ok(r) => r,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        // The liveness thread holds it only for moments; a frozen holder is not waited for.
        Err(std::sync::TryLockError::WouldBlock) => {
            std::thread::sleep(Duration::from_millis(5));
            match REG.try_lock() {
                Ok(r) => r,
                Err(_) => return,
            }
        }
    };
    if r.thread_pid != Some(std::process::id()) {
        return; // a forked child: the channels are its parent's
    }
    let now = Instant::now();
    r.chans.iter_mut().for_each(|c| c.send(&Frame::Closing, now));
}

fn run() {
    let beat = Frame::Heartbeat { pid: std::process::id() };
    let mut next_beat = Instant::now() + BEAT;
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        let (wait, period) = {
            let mut r = lock(&REG);
            if r.chans.is_empty() {
                r.thread_pid = None;
                return;
            }
            // At least 4 beats within the shortest liveness timeout.
            let shortest = r.chans.iter().filter_map(|c| c.hooks.liveness).min().unwrap_or(BEAT);
            let period = (shortest / 4).clamp(Duration::from_millis(10), BEAT);
            next_beat = next_beat.min(Instant::now() + period);
            fds.clear();
            fds.extend(r.chans.iter().filter(|c| c.listening()).map(|c| libc::pollfd {
                fd: c.s.as_raw_fd(),
                events: libc::POLLIN | if c.out.is_empty() { 0 } else { libc::POLLOUT },
                revents: 0,
            }));
            let grace = r.chans.iter().any(|c| c.eof.is_some() && !c.closed && !c.reported);
            let wait = next_beat.saturating_duration_since(Instant::now()).min(NAP);
            if grace {
                (wait.min(Duration::from_millis(25)), period)
            } else {
                (wait, period)
            }
        };
        // SAFETY: `fds` is a valid array of its length. A descriptor closed meanwhile (a
        // communicator destroyed) only wakes this early: the streams read below are the
        // registry's own.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait.as_millis() as libc::c_int) };
        let mut r = lock(&REG);
        let now = Instant::now();
        let beating = now >= next_beat;
        if beating {
            next_beat = now + period;
        }
        let mut found = Vec::new();
        for (i, c) in r.chans.iter_mut().enumerate() {
            c.flush(now);
            // A heartbeat only on a channel that took everything before it (none queue up).
            if beating && c.out.is_empty() {
                c.send(&beat, now);
            }
            if let Some((e, death)) = c.step(now) {
                found.push((i, e, death));
            }
        }
        found.extend(judge(&mut r.chans, now));
        for (i, e, death) in found {
            let (member, peer) = (r.chans[i].member, r.chans[i].peer);
            let siblings = |c: &&mut Chan| c.member == member && c.peer == peer;
            if death {
                // One death per peer: a sibling may have found it in this pass already.
                if r.chans.iter().any(|c| c.member == member && c.peer == peer && c.reported) {
                    continue;
                }
                r.chans.iter_mut().filter(siblings).for_each(|c| c.reported = true);
            } else {
                // The same abort frame arrives on every connection: acted on once.
                r.chans.iter_mut().filter(siblings).for_each(|c| c.aborted = true);
            }
            report(&mut r, i, e, death, now);
        }
        r.chans.retain(|c| !c.dropped);
    }
}

/// The verdicts on every peer's channel (its connections are adjacent) that the clock gives:
/// (a connection's index, the failure, whether a death). A closing frame on one connection
/// closes the channel. A channel whose connections all ended, the last [`EOF_GRACE`] ago, is
/// a death; one connection that ended while a sibling lives is dropped with a WARN. Silence
/// of every connection for the liveness timeout is a death; one connection's silence while a
/// sibling is heard is noted (INFO), once.
fn judge(chans: &mut [Chan], now: Instant) -> Vec<(usize, Error, bool)> {
    let mut out = Vec::new();
    let mut a = 0;
    while a < chans.len() {
        let (member, peer) = (chans[a].member, chans[a].peer);
        let b = a + chans[a..].iter().take_while(|c| c.member == member && c.peer == peer).count();
        let group = &mut chans[a..b];
        let start = a;
        a = b;
        if group.iter().any(|c| c.closed) {
            group.iter_mut().for_each(|c| c.closed = true);
            continue;
        }
        if group.iter().any(|c| c.reported) {
            continue;
        }
        let me = group[0].hooks.rank;
        let who = group.iter().find(|c| c.pid.is_some()).unwrap_or(&group[0]).who();
        // Ended connections.
        let ended = |c: &Chan| c.eof.is_some_and(|t| now.duration_since(t) >= EOF_GRACE);
        if group.iter().all(|c| c.eof.is_some()) {
            if group.iter().all(ended) {
                let e = Error::remote(format!(
                    "rank {me}: peer {who} closed its control channel without closing: its process died or was killed"
                ));
                out.push((start, e, true));
            }
            continue;
        }
        for c in group.iter_mut().filter(|c| ended(c)) {
            c.dropped = true;
        }
        let live: Vec<String> = group.iter().filter(|c| c.eof.is_none()).map(|c| c.rail.clone()).collect();
        for c in group.iter().filter(|c| c.dropped) {
            crate::warn!(
                "rank {me}: the control connection to peer {who} over rail {} ended (closed, or a send failed); the channel goes on over {}",
                c.rail,
                live.join(", ")
            );
        }
        // Silence.
        let Some(limit) = group[0].hooks.liveness else { continue };
        let heard = group.iter().filter(|c| !c.dropped).map(|c| c.heard).max().unwrap_or(now);
        let silent = now.duration_since(heard);
        if silent >= limit {
            let e = Error::remote(format!(
                "rank {me}: peer {who} stopped answering heartbeats for {:.1} s (OXCCL_LIVENESS_TIMEOUT_MS={})",
                silent.as_secs_f64(),
                limit.as_millis()
            ));
            out.push((start, e, true));
            continue;
        }
        for c in group.iter_mut().filter(|c| !c.dropped && c.eof.is_none()) {
            let quiet = now.duration_since(c.heard);
            if quiet < limit {
                c.quiet = false;
            } else if !c.quiet {
                c.quiet = true;
                crate::info!(
                    "rank {me}: the control connection to peer {who} over rail {} is silent for {:.1} s; the peer is heard over {}",
                    c.rail,
                    quiet.as_secs_f64(),
                    live.iter().filter(|r| **r != c.rail).cloned().collect::<Vec<_>>().join(", ")
                );
            }
        }
    }
    out
}

/// Reports what channel `i` of `r` found (`death`: its peer died, else a failure it was told
/// of): the failure spreads to the children holding that peer, and an abort frame goes to the
/// member's other peers (and back on a tampered channel) when this is the member's first failure.
fn report(r: &mut Registry, i: usize, e: Error, death: bool, now: Instant) {
    let (member, peer, hooks) = (r.chans[i].member, r.chans[i].peer, r.chans[i].hooks.clone());
    // A tampered connection's peer is alive: it hears this end's failure on all its connections.
    let back = r.chans[i].tampered;
    // The children holding the dead peer fail too (and theirs, and so on), and so do
    // the children being made, whether or not the parent had failed.
    let mut heirs = if death { vec![(hooks.clone(), peer, e.clone())] } else { Vec::new() };
    while let Some((parent, peer, e)) = heirs.pop() {
        parent.died(peer, &e);
        for (kid, c, kid_id) in super::children::heirs(&parent, peer) {
            let ke = super::children::death(kid.rank, c, peer, &e);
            heirs.push((kid.clone(), c, ke.clone()));
            if kid.fail(ke.clone()) {
                crate::warn!("{}", ke.message());
                let frame = Frame::Abort { code: ke.kind().code(), reason: ke.message().to_string() };
                for ch in r.chans.iter_mut().filter(|k| k.member == kid_id && k.peer != c) {
                    ch.send(&frame, now);
                }
            }
        }
    }
    if !(if death { hooks.fail(e.clone()) } else { hooks.record(e.clone()) }) {
        return;
    }
    crate::warn!("{}", e.message());
    let frame = Frame::Abort { code: e.kind().code(), reason: e.message().to_string() };
    for c in r.chans.iter_mut().filter(|c| c.member == member && (c.peer != peer || back)) {
        c.send(&frame, now);
    }
}

impl Chan {
    /// A connection of `hooks`' communicator (registry id `member`, registered by process
    /// `owner`) to `peer`, over `rail`; its first heartbeat goes out at once (the peer learns
    /// this process's id).
    fn new(owner: u32, member: u64, hooks: Arc<Hooks>, peer: usize, c: Conn, rail: String, now: Instant) -> Chan {
        let mut chan = Chan {
            owner,
            member,
            hooks,
            peer,
            addr: c.stream.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string()),
            s: c.stream,
            sealer: Sealer::new(c.keys.send),
            opener: Opener::new(c.keys.recv),
            out: Vec::new(),
            heard: now,
            pid: None,
            buf: Vec::new(),
            eof: None,
            drained: false,
            closed: false,
            reported: false,
            aborted: false,
            tampered: false,
            rail,
            quiet: false,
            dropped: false,
        };
        chan.send(&Frame::Heartbeat { pid: owner }, now);
        chan
    }

    /// Seals `f` and writes it behind whatever is queued; what the socket does not take waits
    /// for [`Chan::flush`] (a frame is never cut: a cut one would leave the peer a gap). A
    /// channel that ended, or whose peer lets [`MAX_BUFFERED`] bytes queue up, takes nothing.
    fn send(&mut self, f: &Frame, now: Instant) {
        if self.eof.is_some() || self.out.len() > MAX_BUFFERED {
            return;
        }
        let bytes = self.sealer.seal(f);
        self.out.extend_from_slice(&bytes);
        self.flush(now);
    }

    /// Writes what is queued, as far as the socket takes it.
    fn flush(&mut self, now: Instant) {
        while !self.out.is_empty() && self.eof.is_none() {
            match crate::net::nosig::send(&self.s, &self.out) {
                Ok(0) => break,
                Ok(n) => drop(self.out.drain(..n)),
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) if e.kind() == IoKind::WouldBlock => break,
                Err(_) => self.eof = Some(now),
            }
        }
    }

    /// Whether the channel is still read.
    fn listening(&self) -> bool {
        self.eof.is_none() && !self.closed && !self.reported
    }

    /// `rank p (host:pid)`.
    fn who(&self) -> String {
        let host = self.hooks.hosts.get(self.peer).map_or("?", |h| h.as_str());
        match self.pid {
            Some(pid) => format!("rank {} ({host}:{pid})", self.peer),
            None => format!("rank {} ({host})", self.peer),
        }
    }

    /// Acts on the whole frames read so far: `Some` when the channel is done with (`Some(None)`:
    /// the peer sent closing; else the failure to report and whether it is a death).
    /// Every valid frame is the peer heard (`now`).
    fn frames(&mut self, now: Instant) -> Option<Option<(Error, bool)>> {
        let me = self.hooks.rank;
        loop {
            let got = self.opener.take(&mut self.buf);
            if let Ok(Some(_)) = &got {
                self.heard = now;
            }
            match got {
                Ok(None) => return None,
                Ok(Some(Frame::Heartbeat { pid })) => self.pid = Some(pid),
                Ok(Some(Frame::Closing)) => {
                    self.closed = true;
                    return Some(None);
                }
                Ok(Some(Frame::Abort { .. })) if self.aborted => {}
                Ok(Some(Frame::Abort { code, reason })) => {
                    let kind = ErrorKind::from_code(code).filter(|&k| k != ErrorKind::InProgress);
                    self.aborted = true;
                    let text = format!("rank {me}: peer {} failed: {}", self.who(), clean(&reason));
                    return Some(Some((Error::new(kind.unwrap_or(ErrorKind::Remote), text), false)));
                }
                Err(Refused::Malformed(why)) => {
                    let e = Error::remote(format!("rank {me}: peer {} broke its control channel: {why}", self.who()));
                    return Some(Some((e, true)));
                }
                Err(Refused::Tampered(why)) => {
                    self.tampered = true;
                    let e = Error::remote(format!(
                        "rank {me}: the control channel from peer {} at {} was tampered with: {why}; nothing more from it is acted on",
                        self.who(),
                        self.addr
                    ));
                    return Some(Some((e, true)));
                }
            }
        }
    }

    /// Reads what arrived: the failure to report, if any, and whether it is the peer's death
    /// (else its abort frame). The clock's verdicts (an end, silence) are the channel's
    /// ([`judge`]).
    fn step(&mut self, now: Instant) -> Option<(Error, bool)> {
        if self.closed || self.reported || self.drained {
            return None;
        }
        let me = self.hooks.rank;
        let mut tmp = [0u8; 512];
        loop {
            match (&self.s).read(&mut tmp) {
                Ok(0) => {
                    self.eof.get_or_insert(now);
                    self.drained = true;
                    break;
                }
                Ok(n) => {
                    self.buf.extend_from_slice(&tmp[..n]);
                    if self.buf.len() > MAX_BUFFERED {
                        break;
                    }
                }
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) if e.kind() == IoKind::WouldBlock => break,
                Err(_) => {
                    self.eof.get_or_insert(now);
                    self.drained = true;
                    break;
                }
            }
        }
        if let Some(found) = self.frames(now) {
            return found;
        }
        if self.buf.len() > MAX_BUFFERED {
            let e = Error::remote(format!("rank {me}: peer {} flooded its control channel", self.who()));
            return Some((e, true));
        }
        None
    }
}
