//! The liveness thread: one per process, serving every communicator's control channels. It
//! sleeps in `poll(2)` on them, sends heartbeats every [`BEAT`] (more often when a
//! communicator's liveness timeout is under 4 beats), reads every frame, and fails a
//! communicator whose peer died ([`super::Hooks`]); it exits when no channel is left.

use super::frame::Frame;
use super::{lock, Hooks};
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
    heard: Instant,
    pid: Option<u32>,
    buf: Vec<u8>,
    /// When the channel ended (or failed to take a heartbeat).
    eof: Option<Instant>,
    /// The peer sent `closing`.
    closed: bool,
    /// This channel's peer has been reported dead; nothing more is looked at.
    reported: bool,
    /// The peer's abort frame has been reported: later frames but heartbeats and closing are
    /// ignored, and the channel is still watched for the peer's death.
    aborted: bool,
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
pub(super) fn join(hooks: &Arc<Hooks>, chans: Vec<(usize, TcpStream)>) -> Result<u64> {
    let pid = std::process::id();
    let hello = Frame::Heartbeat { pid }.encode();
    for (_, s) in &chans {
        s.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
        // The first heartbeat at once: the peer learns this process's id.
        let _ = crate::net::nosig::send(s, &hello);
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
    r.chans.extend(chans.into_iter().map(|(peer, s)| Chan {
        owner: pid,
        member: id,
        hooks: hooks.clone(),
        peer,
        s,
        heard: now,
        pid: None,
        buf: Vec::new(),
        eof: None,
        closed: false,
        reported: false,
        aborted: false,
    }));
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

/// Sends `f` on every open channel of communicator `id`.
pub(super) fn broadcast(id: u64, f: &Frame) {
    let r = lock(&REG);
    for c in r.chans.iter().filter(|c| c.member == id && c.eof.is_none()) {
        let _ = super::send_frame(&c.s, f);
    }
}

/// Removes a communicator's channels, each after a closing frame.
pub(super) fn leave(id: u64) {
    let closing = Frame::Closing.encode();
    let mut r = lock(&REG);
    for c in r.chans.iter().filter(|c| c.member == id && c.eof.is_none()) {
        let _ = crate::net::nosig::send(&c.s, &closing);
    }
    r.chans.retain(|c| c.member != id);
}

/// At a normal exit, every channel of this process gets a closing frame (a process that
/// returns from `main` without destroying its communicators did not die).
extern "C" fn at_exit() {
    let r = match REG.try_lock() {
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
    let closing = Frame::Closing.encode();
    for c in r.chans.iter().filter(|c| c.eof.is_none()) {
        let _ = crate::net::nosig::send(&c.s, &closing);
    }
}

fn run() {
    let pid = std::process::id();
    let beat = Frame::Heartbeat { pid }.encode();
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
                events: libc::POLLIN,
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
            if beating && c.eof.is_none() {
                match crate::net::nosig::send(&c.s, &beat) {
                    Ok(_) => {}
                    Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::Interrupted) => {}
                    Err(_) => c.eof = Some(now),
                }
            }
            if let Some((e, death)) = c.step(now) {
                c.reported |= death;
                found.push((i, (e, death)));
            }
        }
        for (i, (e, death)) in found {
            report(&r, i, e, death);
        }
    }
}

/// Reports what channel `i` of `r` found (`death`: its peer died, else a failure it was told
/// of): the failure spreads to the children holding that peer, and an abort frame goes to the
/// member's other peers when this is the member's first failure.
fn report(r: &Registry, i: usize, e: Error, death: bool) {
    let (member, peer, hooks) = (r.chans[i].member, r.chans[i].peer, r.chans[i].hooks.clone());
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
                let frame = Frame::Abort { code: ke.kind().code(), reason: ke.message().to_string() }.encode();
                for ch in r.chans.iter().filter(|k| k.member == kid_id && k.peer != c && k.eof.is_none()) {
                    let _ = crate::net::nosig::send(&ch.s, &frame);
                }
            }
        }
    }
    if !(if death { hooks.fail(e.clone()) } else { hooks.record(e.clone()) }) {
        return;
    }
    crate::warn!("{}", e.message());
    let frame = Frame::Abort { code: e.kind().code(), reason: e.message().to_string() }.encode();
    for c in r.chans.iter().filter(|c| c.member == member && c.peer != peer && c.eof.is_none()) {
        let _ = crate::net::nosig::send(&c.s, &frame);
    }
}

impl Chan {
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

    /// Reads what arrived and checks the clock: the failure to report, if any, and whether it
    /// is the peer's death (else its abort frame).
    fn step(&mut self, now: Instant) -> Option<(Error, bool)> {
        if self.closed || self.reported {
            return None;
        }
        let me = self.hooks.rank;
        if self.eof.is_none() {
            let mut tmp = [0u8; 512];
            loop {
                match (&self.s).read(&mut tmp) {
                    Ok(0) => {
                        self.eof = Some(now);
                        break;
                    }
                    Ok(n) => {
                        self.heard = now;
                        self.buf.extend_from_slice(&tmp[..n]);
                        if self.buf.len() > MAX_BUFFERED {
                            break;
                        }
                    }
                    Err(e) if e.kind() == IoKind::Interrupted => {}
                    Err(e) if e.kind() == IoKind::WouldBlock => break,
                    Err(_) => {
                        self.eof = Some(now);
                        break;
                    }
                }
            }
            loop {
                match Frame::take(&mut self.buf) {
                    Ok(None) => break,
                    Ok(Some(Frame::Heartbeat { pid })) => self.pid = Some(pid),
                    Ok(Some(Frame::Closing)) => {
                        self.closed = true;
                        return None;
                    }
                    Ok(Some(Frame::Abort { .. })) if self.aborted => {}
                    Ok(Some(Frame::Abort { code, reason })) => {
                        let kind = ErrorKind::from_code(code).filter(|&k| k != ErrorKind::InProgress);
                        let kind = kind.unwrap_or(ErrorKind::Remote);
                        self.aborted = true;
                        let e = Error::new(kind, format!("rank {me}: peer {} failed: {reason}", self.who()));
                        return Some((e, false));
                    }
                    Err(e) => {
                        let e = Error::remote(format!(
                            "rank {me}: peer {} broke its control channel: {}",
                            self.who(),
                            e.message()
                        ));
                        return Some((e, true));
                    }
                }
            }
            if self.buf.len() > MAX_BUFFERED {
                let e = Error::remote(format!("rank {me}: peer {} flooded its control channel", self.who()));
                return Some((e, true));
            }
        }
        if let Some(t) = self.eof {
            return (now.duration_since(t) >= EOF_GRACE).then(|| {
                let e = Error::remote(format!(
                    "rank {me}: peer {} closed its control channel without closing: its process died or was killed",
                    self.who()
                ));
                (e, true)
            });
        }
        let silent = now.duration_since(self.heard);
        let limit = self.hooks.liveness?;
        (silent >= limit).then(|| {
            let e = Error::remote(format!(
                "rank {me}: peer {} stopped answering heartbeats for {:.1} s (OXCCL_LIVENESS_TIMEOUT_MS={})",
                self.who(),
                silent.as_secs_f64(),
                limit.as_millis()
            ));
            (e, true)
        })
    }
}
