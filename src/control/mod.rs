//! The control channel: one authenticated TCP connection per pair of ranks of a communicator,
//! and one more on each further rail both ranks share (`OXCCL_SOCKET_IFNAME` naming several
//! interfaces: [`Rails`]), beside its data links, carrying typed frames ([`frame`]):
//! heartbeats, abort and closing.
//! The data links carry data (and each operation's call signature, [`crate::mismatch`], a
//! fixed header before its data) and nothing else: how a failure travels is this module's.
//!
//! A communicator made by a rendezvous opens its channels at creation (`control::open`), every
//! rail's connections to every peer included, whether or not the pair ever makes a data link and
//! whatever transport that link uses, and hands them to the process's liveness thread
//! (`control::watch`), which serves every communicator of the process: it sends a heartbeat on every channel each second and reads them all. A peer is
//! declared dead when its channel stays silent for `OXCCL_LIVENESS_TIMEOUT_MS` (0 turns this
//! off, not the channel), or when the channel ends without a closing frame (its process died;
//! a channel of several connections: when all of them fall silent, or all end);
//! the communicator then fails with an error naming the peer, as [`crate::Communicator::abort`]
//! would fail it (a call blocked in a collective returns), and the detecting rank sends an
//! abort frame on its other channels, so every rank fails naming the dead peer. Destroying a
//! communicator, or exiting the process normally, sends closing frames: an orderly end is no
//! death. The heartbeats come from their own thread, so a rank busy in user code between calls
//! is never taken for dead.
//!
//! A call that fails for a reason of its own (a mismatch, a timeout, a data link's error)
//! settles its error here (`Membership::settle`): a closed data link may be the echo of a
//! peer's failure, so the peer's abort frame is waited for briefly and reported instead;
//! otherwise this rank's error goes out as an abort frame on every channel. A rank that
//! receives an abort frame fails at once (the liveness thread sets the failure and the abort
//! flag every wait checks, and shuts the data sockets) and forwards the frame on its other
//! channels, so the first failure's code and text reach every rank, between calls too
//! (`ncclCommGetAsyncError`).
//!
//! A child communicator (split, shrink, grow) has channels of its own and is also adopted by
//! its parent (`children`): a member's death that the parent's channels find fails the child
//! too, naming the member by its child and parent ranks. Only deaths are forwarded; the
//! parent's abort frames concern the parent alone. While a child is being made (its
//! rendezvous, its channels' set-up) it is a `Meeting` of the parent: a member found dead by
//! the parent's channels, before or during the meeting, ends its waits, even on a parent that
//! failed earlier (a shrink's). A channel whose peer sent an abort frame is still watched
//! for that peer's death.
//!
//! In-memory communicators have the same channels in memory (`mesh`): an abort is recorded
//! in the other ranks' communicators directly; nothing there can die silently.
//!
//! Every frame on a TCP channel is sealed ([`seal`]): numbered and tagged with a MAC under a
//! key of the channel and direction, derived in the authenticated handshake. A frame that
//! fails its MAC or arrives out of turn is never acted on: the channel is treated as
//! tampered with, and the communicator fails as for a broken channel, naming the peer's rank
//! and address (a relay on the path can drop or delay frames, and so end the job, but not
//! forge a reason). In-memory channels carry no MAC: they never leave the process. Text from
//! a peer (an abort's reason, host names) is cleaned ([`frame::clean`]) before it is logged
//! or returned.

mod children;
pub mod frame;
mod open;
pub mod seal;
mod watch;

pub(crate) use children::Meeting;
pub(crate) use open::open;

use crate::bootstrap::Conn;
use crate::error::{Error, ErrorKind};
use frame::Frame;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a call whose data link closed waits for the abort frame that may explain it
/// (the peer that failed first sends it before shutting its links).
pub const ABORT_GRACE: Duration = Duration::from_millis(250);

use crate::sync::lock;

/// A communicator's abort flag and failure, as [`Hooks`] shares them.
pub(crate) type Flags = (Arc<AtomicBool>, Arc<Mutex<Option<Error>>>);

/// What the liveness thread needs to fail one communicator (shared with it).
pub(crate) struct Hooks {
    /// This rank.
    pub(crate) rank: usize,
    /// Every rank's host name, for messages.
    pub(crate) hosts: Vec<String>,
    /// Silence that declares a peer dead; `None`: silence never does.
    pub(crate) liveness: Option<Duration>,
    /// The communicator's abort flag: a blocked call returns when it is set.
    pub(crate) aborted: Arc<AtomicBool>,
    /// The communicator's failure.
    pub(crate) failure: Arc<Mutex<Option<Error>>>,
    /// The communicator's sockets, shut on failure so that blocked reads return.
    pub(crate) sockets: Arc<Mutex<Vec<TcpStream>>>,
    /// The peer's death (or a peer's abort frame), once found here.
    down: Mutex<Option<Error>>,
    /// Whether `down` is set (read by every call, without a lock).
    told: AtomicBool,
    /// The children (split, shrink, grow) told of a member's death found here ([`children`]).
    children: Mutex<Vec<children::Adopted>>,
    /// The peers found dead here, with the error naming each (kept for children still to meet).
    deaths: Mutex<Vec<(usize, Error)>>,
    /// The children being made from this communicator ([`Meeting`]).
    meetings: Mutex<Vec<std::sync::Weak<children::Gathering>>>,
}

impl Hooks {
    /// Hooks on a communicator's flag, failure and sockets.
    pub(crate) fn new(
        rank: usize,
        hosts: &[String],
        liveness: Option<Duration>,
        aborted: Arc<AtomicBool>,
        failure: Arc<Mutex<Option<Error>>>,
        sockets: Arc<Mutex<Vec<TcpStream>>>,
    ) -> Hooks {
        // A host identity is `name:boot id:namespace`; messages need the name (as a peer
        // reported it: cleaned).
        let hosts = hosts.iter().map(|h| frame::clean(h.split(':').next().unwrap_or(h))).collect();
        Hooks {
            rank,
            hosts,
            liveness,
            aborted,
            failure,
            sockets,
            down: Mutex::new(None),
            told: AtomicBool::new(false),
            children: Mutex::new(Vec::new()),
            deaths: Mutex::new(Vec::new()),
            meetings: Mutex::new(Vec::new()),
        }
    }

    /// Fails the communicator with `e` (a peer's death) unless it failed already; whether it
    /// did. A failure only recorded from a peer's abort frame ([`Hooks::record`]) stays the
    /// one reported, but the death still interrupts a running call (it may wait on the dead).
    fn fail(&self, e: Error) -> bool {
        let mut f = lock(&self.failure);
        let first = f.is_none();
        if first {
            *f = Some(e.clone());
            *lock(&self.down) = Some(e);
        } else if !self.told.load(Ordering::SeqCst) {
            return false;
        }
        self.told.store(true, Ordering::SeqCst);
        drop(f);
        if !first && self.aborted.load(Ordering::SeqCst) {
            return false;
        }
        self.aborted.store(true, Ordering::SeqCst);
        for s in lock(&self.sockets).iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        first
    }

    /// A peer's abort frame (`e` names it) arrived: records it as the communicator's failure,
    /// unless it failed already; whether it did. Nothing is interrupted: a call running
    /// finishes what its peers already sent (the frame may overtake the data of an operation
    /// the sender completed), and fails only if a link closes; the next call is refused.
    fn record(&self, e: Error) -> bool {
        let mut f = lock(&self.failure);
        if f.is_some() {
            return false;
        }
        *f = Some(e.clone());
        *lock(&self.down) = Some(e);
        self.told.store(true, Ordering::SeqCst);
        true
    }

    /// Peer `from`'s abort frame arrived in memory: [`Hooks::record`]s it.
    fn aborted_by(&self, from: String, code: i32, reason: &str) {
        let kind = ErrorKind::from_code(code).filter(|&k| k != ErrorKind::InProgress).unwrap_or(ErrorKind::Remote);
        self.record(Error::new(kind, format!("rank {}: peer {from} failed: {}", self.rank, frame::clean(reason))));
    }

    /// Records `e`, this rank's own failure, unless the communicator failed already (then
    /// frames arriving later are not taken for the cause); whether it was recorded.
    fn own(&self, e: &Error) -> bool {
        let mut f = lock(&self.failure);
        if f.is_some() {
            return false;
        }
        *f = Some(e.clone());
        true
    }
}

/// Where a communicator's channels are.
enum Channels {
    /// In the liveness thread's registry, under this id.
    Tcp(u64),
    /// In memory: every rank's hooks, by rank.
    Mem(Arc<Vec<Arc<Hooks>>>),
}

/// A communicator's place in the liveness thread: its channels leave (with closing frames)
/// when this is dropped.
pub(crate) struct Membership {
    hooks: Arc<Hooks>,
    chans: Channels,
}

impl Membership {
    /// The failure the control channel found (a dead peer, or a peer's abort frame), if any:
    /// the cause to report for whatever a call saw afterwards.
    pub(crate) fn down(&self) -> Option<Error> {
        lock(&self.hooks.down).clone()
    }

    /// Whether [`Membership::down`] is set (one atomic load).
    pub(crate) fn told(&self) -> bool {
        self.hooks.told.load(Ordering::Relaxed)
    }

    /// A call failed with `e`: the error to report, after telling the peers. When `e` may be
    /// the echo of a peer's failure (a closed link: up to [`ABORT_GRACE`]; any other failure
    /// but a mismatch found here: 20 ms), a peer's abort frame is waited for and its reason
    /// reported instead (a mismatch found elsewhere also replaces any other failure but one
    /// of its own kind; a peer's death that interrupted the call replaces any). Otherwise `e`
    /// goes out as an abort frame on every channel.
    pub(crate) fn settle(&self, e: Error) -> Error {
        let grace = match e.kind() {
            ErrorKind::Remote => ABORT_GRACE,
            ErrorKind::InvalidUsage => Duration::ZERO,
            _ => Duration::from_millis(20),
        };
        let deadline = Instant::now() + grace;
        loop {
            if let Some(d) = self.down() {
                // A death found on the channel interrupted the call (the abort flag): it is the cause.
                let interrupted = self.hooks.aborted.load(Ordering::SeqCst);
                if interrupted
                    || e.kind() == ErrorKind::Remote
                    || (d.kind() == ErrorKind::InvalidUsage && e.kind() != d.kind())
                {
                    return d;
                }
                return e;
            }
            if self.hooks.aborted.load(Ordering::SeqCst) {
                // `abort` from this process: its peers learn of it from the shut links.
                return e;
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if !self.hooks.own(&e) {
            return e;
        }
        match &self.chans {
            Channels::Tcp(id) => {
                watch::broadcast(*id, &Frame::Abort { code: e.kind().code(), reason: e.message().into() })
            }
            Channels::Mem(all) => spread_in_memory(all, self.hooks.rank, e.kind().code(), e.message()),
        }
        e
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Channels::Tcp(id) = self.chans {
            watch::leave(id);
        }
    }
}

/// Records `from`'s abort in every other in-memory rank (each is reached directly: nothing
/// needs forwarding).
fn spread_in_memory(all: &[Arc<Hooks>], from: usize, code: i32, reason: &str) {
    for h in all.iter().filter(|h| h.rank != from) {
        h.aborted_by(format!("rank {from} (in-memory)"), code, reason);
    }
}

/// In-memory control channels between the communicators of `hooks` (one per rank, by rank).
pub(crate) fn mesh(hooks: Vec<Hooks>) -> Vec<Membership> {
    let all: Arc<Vec<Arc<Hooks>>> = Arc::new(hooks.into_iter().map(Arc::new).collect());
    all.iter().map(|h| Membership { hooks: h.clone(), chans: Channels::Mem(all.clone()) }).collect()
}

/// Seals `f` with `sealer` and writes it on a control channel without raising SIGPIPE (the
/// liveness thread queues what a non-blocking channel does not take; this sends once).
pub fn send_frame(s: &TcpStream, sealer: &mut seal::Sealer, f: &Frame) -> std::io::Result<usize> {
    crate::net::nosig::send(s, &sealer.seal(f))
}

/// The further connections of the control channel to `peer`, one per rail both ends share
/// beyond the channel's first (the bootstrap's), opened with the channel at creation
/// (`control::open`).
#[derive(Debug)]
pub struct Rails {
    /// The peer.
    pub peer: usize,
    /// This end's interface of the bootstrap's rail (the channel's first connection's).
    pub first: String,
    /// This end's interface of each further rail, and its connection with its keys.
    pub more: Vec<(String, Conn)>,
}

impl Membership {
    /// Adds each of `rails` to its peer's channel: heartbeats and frames go on every
    /// connection, and the peer dies only when all of them end or fall silent ([`watch`]).
    /// In-memory channels take none.
    pub(crate) fn add_rails(&self, rails: Vec<Rails>) {
        if let Channels::Tcp(id) = self.chans {
            for r in rails {
                watch::add(id, r.peer, &r.first, r.more);
            }
        }
    }
}

/// Hands `chans` (peer rank, connected channel with its keys) to the liveness thread for the
/// communicator of `hooks`.
pub(crate) fn watch(hooks: Hooks, chans: Vec<(usize, Conn)>) -> crate::error::Result<Membership> {
    let hooks = Arc::new(hooks);
    let id = watch::join(&hooks, chans)?;
    Ok(Membership { hooks, chans: Channels::Tcp(id) })
}

#[cfg(test)]
mod tests {
    use super::frame::Frame;
    use super::seal::{Opener, Sealer};
    use super::*;
    use crate::bootstrap::auth::{Keys, KEY_LEN};
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Instant;

    /// A connected pair on loopback: (the end handed to the liveness thread, the peer's end).
    pub(super) fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    /// The peer's end of a test channel: its stream, sealer and opener.
    pub(super) struct Far {
        pub(super) s: TcpStream,
        sealer: Sealer,
        opener: Opener,
    }

    impl Far {
        /// Sends `f`, sealed as the peer would.
        pub(super) fn send(&mut self, f: &Frame) {
            self.s.write_all(&self.sealer.seal(f)).unwrap();
        }

        /// Every frame received within `limit`, up to the first abort or closing.
        pub(super) fn frames(&mut self, limit: Duration) -> Vec<Frame> {
            let end = Instant::now() + limit;
            let (mut buf, mut out, mut tmp) = (Vec::new(), Vec::new(), [0u8; 256]);
            loop {
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                self.s.set_read_timeout(Some(left)).unwrap();
                let Ok(n @ 1..) = self.s.read(&mut tmp) else { break };
                buf.extend_from_slice(&tmp[..n]);
                while let Some(f) = self.opener.take(&mut buf).unwrap() {
                    out.push(f);
                }
                if out.iter().any(|f| matches!(f, Frame::Abort { .. } | Frame::Closing)) {
                    break;
                }
            }
            out
        }
    }

    /// A channel: the end handed to the liveness thread (with its keys) and the peer's end.
    pub(super) fn channel() -> (Conn, Far) {
        let (a, b) = pair();
        let (mine, theirs) = ([1u8; KEY_LEN], [2u8; KEY_LEN]);
        let far = Far { s: b, sealer: Sealer::new(theirs), opener: Opener::new(mine) };
        (Conn { stream: a, keys: Keys { send: mine, recv: theirs } }, far)
    }

    /// A member, its failure and abort flag, and the peers' ends of its two channels.
    type Member = (Membership, Arc<Mutex<Option<Error>>>, Arc<AtomicBool>, Far, Far);

    /// Rank 0 of 3 with channels to ranks 1 and 2.
    fn member(liveness: Option<Duration>) -> Member {
        let (failure, aborted) = (Arc::new(Mutex::new(None)), Arc::new(AtomicBool::new(false)));
        let hosts = ["h0:boot:net".to_string(), "h1:boot:net".to_string(), "h2:boot:net".to_string()];
        let hooks = Hooks::new(0, &hosts, liveness, aborted.clone(), failure.clone(), Default::default());
        let ((a1, b1), (a2, b2)) = (channel(), channel());
        (watch(hooks, vec![(1, a1), (2, a2)]).unwrap(), failure, aborted, b1, b2)
    }

    /// The last abort frame of `got` (a heartbeat read in the same chunk may follow it).
    fn last_abort(got: &[Frame]) -> Option<&Frame> {
        got.iter().rev().find(|f| matches!(f, Frame::Abort { .. }))
    }

    /// Waits up to `limit` for the failure.
    pub(super) fn failed_within(failure: &Mutex<Option<Error>>, limit: Duration) -> Option<Error> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(e) = lock(failure).clone() {
                return Some(e);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    #[test]
    fn a_channel_ending_without_closing_fails_the_communicator_and_warns_the_others() {
        let (m, failure, aborted, b1, mut b2) = member(Some(Duration::from_secs(60)));
        drop(b1);
        let e = failed_within(&failure, Duration::from_secs(5)).expect("rank 1's end is a death");
        assert_eq!(e.kind(), crate::error::ErrorKind::Remote);
        assert!(e.message().contains("rank 0: peer rank 1 (h1") && e.message().contains("without closing"), "{e}");
        assert!(aborted.load(Ordering::SeqCst));
        assert_eq!(m.down().map(|d| d.message().to_string()), Some(e.message().to_string()));
        let got = b2.frames(Duration::from_secs(5));
        assert!(matches!(got.first(), Some(Frame::Heartbeat { pid }) if *pid == std::process::id()), "{got:?}");
        match last_abort(&got) {
            Some(Frame::Abort { code: 6, reason }) => assert_eq!(reason, e.message()),
            other => panic!("rank 2 should get an abort frame, got {other:?}"),
        }
    }

    #[test]
    fn an_abort_frame_is_recorded_without_interrupting_and_a_later_death_interrupts() {
        let (m, failure, aborted, mut b1, b2) = member(None);
        b1.send(&Frame::Abort { code: 5, reason: "rank 1: collective mismatch".into() });
        let e = failed_within(&failure, Duration::from_secs(5)).expect("rank 1's abort is recorded");
        assert_eq!(e.kind(), crate::error::ErrorKind::InvalidUsage);
        assert!(
            e.message().starts_with("rank 0: peer rank 1 (h1") && e.message().ends_with("collective mismatch"),
            "{e}"
        );
        assert!(m.told() && !aborted.load(Ordering::SeqCst), "an abort frame interrupts no running call");
        drop(b2);
        let t = Instant::now();
        while !aborted.load(Ordering::SeqCst) {
            assert!(t.elapsed() < Duration::from_secs(5), "rank 2's death did not interrupt");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(lock(&failure).as_ref().map(|f| f.message().to_string()), Some(e.message().to_string()));
    }

    #[test]
    fn a_silent_peer_is_declared_dead_and_a_beating_one_is_not() {
        let (m, failure, _, mut b1, _b2) = member(Some(Duration::from_millis(1500)));
        // Rank 1 keeps beating; rank 2 says nothing after the connection.
        let t = Instant::now();
        let e = loop {
            b1.send(&Frame::Heartbeat { pid: 77 });
            if let Some(e) = failed_within(&failure, Duration::from_millis(300)) {
                break e;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "rank 2 was never declared dead");
        };
        assert!(t.elapsed() >= Duration::from_millis(1400), "declared dead after {:?}", t.elapsed());
        assert!(e.message().contains("peer rank 2 (h2)") && e.message().contains("heartbeats for 1."), "{e}");
        drop(m);
    }

    #[test]
    fn two_members_keep_each_other_alive_under_a_short_timeout_and_part_in_order() {
        let hosts = ["a".to_string(), "b".to_string()];
        let (x, y) = channel();
        let y = Conn { stream: y.s, keys: Keys { send: [2; KEY_LEN], recv: [1; KEY_LEN] } };
        let member = |rank, s| {
            let failure = Arc::new(Mutex::new(None));
            let hooks = Hooks::new(
                rank,
                &hosts,
                Some(Duration::from_millis(300)),
                Default::default(),
                failure.clone(),
                Default::default(),
            );
            (watch(hooks, vec![(1 - rank, s)]).unwrap(), failure)
        };
        let ((m0, f0), (m1, f1)) = (member(0, x), member(1, y));
        // 5 timeouts long: the thread beats at least 4 times per timeout.
        assert!(failed_within(&f0, Duration::from_millis(1500)).is_none(), "rank 0 failed");
        assert!(lock(&f1).is_none(), "rank 1 failed");
        drop(m1);
        assert!(failed_within(&f0, Duration::from_millis(600)).is_none(), "rank 1's destroy is no death");
        drop(m0);
    }

    #[test]
    fn closing_is_no_death_and_destroy_sends_closing() {
        let (m, failure, _, mut b1, mut b2) = member(Some(Duration::from_secs(60)));
        b1.send(&Frame::Closing);
        drop(b1);
        assert!(failed_within(&failure, Duration::from_millis(800)).is_none(), "an orderly close is no death");
        drop(m);
        assert_eq!(b2.frames(Duration::from_secs(5)).last(), Some(&Frame::Closing));
    }

    #[test]
    fn a_forged_or_replayed_frame_fails_the_channel_as_tampered_and_its_reason_is_never_reported() {
        // Forged: a plain abort frame (what a relay without the key can write).
        let (_m, failure, aborted, mut b1, mut b2) = member(None);
        let forged = Frame::Abort { code: 5, reason: "collective mismatch (FORGED)".into() };
        b1.s.write_all(&forged.encode()).unwrap();
        b1.s.write_all(&[0; seal::TRAILER]).unwrap();
        let e = failed_within(&failure, Duration::from_secs(5)).expect("the forgery is caught");
        assert!(!e.message().contains("FORGED"), "{e}");
        let addr = b1.s.local_addr().unwrap().to_string();
        assert!(e.message().contains(&format!("peer rank 1 (h1) at {addr} was tampered with")), "{e}");
        assert!(e.message().contains("failed its MAC"), "{e}");
        assert_eq!(e.kind(), ErrorKind::Remote);
        assert!(aborted.load(Ordering::SeqCst), "a tampered channel fails the communicator at once");
        // Rank 2 hears this rank's own reason, never the forged one.
        match last_abort(&b2.frames(Duration::from_secs(5))) {
            Some(Frame::Abort { reason, .. }) => assert_eq!(reason, e.message()),
            other => panic!("rank 2 should get an abort frame, got {other:?}"),
        }
        // Replayed: a genuine frame copied by the relay; what follows is not acted on.
        let (_m, failure, _, mut b1, _b2) = member(None);
        let mut sealer = Sealer::new([2; KEY_LEN]);
        let beat = sealer.seal(&Frame::Heartbeat { pid: 9 });
        let abort = sealer.seal(&Frame::Abort { code: 5, reason: "NOT ACTED ON".into() });
        b1.s.write_all(&[&beat[..], &beat[..], &abort[..]].concat()).unwrap();
        let e = failed_within(&failure, Duration::from_secs(5)).expect("the replay is caught");
        assert!(e.message().contains("frame #0 arrived where #1 was due (replayed or reordered)"), "{e}");
        assert!(!e.message().contains("NOT ACTED ON"), "{e}");
    }

    #[test]
    fn a_reason_with_control_characters_is_cleaned_before_it_is_recorded() {
        let (_m, failure, _, mut b1, _b2) = member(None);
        b1.send(&Frame::Abort { code: 5, reason: "mismatch\n\x1b[2K[INFO] all fine\x1b[0m".into() });
        let e = failed_within(&failure, Duration::from_secs(5)).expect("recorded");
        assert!(e.message().chars().all(|c| !c.is_control()), "{:?}", e.message());
        assert!(e.message().ends_with("mismatch\\u{a}\\u{1b}[2K[INFO] all fine\\u{1b}[0m"), "{:?}", e.message());
    }

    /// A connection of a further rail: the end handed to the liveness thread (keys of rail
    /// `rail` of a link whose keys are the test channel's) and the peer's end.
    fn rail_channel(rail: usize) -> (Conn, Far) {
        let (a, b) = pair();
        let keys = Keys { send: [1u8; KEY_LEN], recv: [2u8; KEY_LEN] }.for_rail(rail);
        let far = Far { s: b, sealer: Sealer::new(keys.recv), opener: Opener::new(keys.send) };
        (Conn { stream: a, keys }, far)
    }

    /// A member, its failure and abort flag, and the peers' ends (rank 1's rail0 and rail1,
    /// rank 2's).
    type OverRails = (Membership, Arc<Mutex<Option<Error>>>, Arc<AtomicBool>, [Far; 3]);

    /// Rank 0 of 3 whose channel to rank 1 has a connection on rail0 and one on rail1, and
    /// to rank 2 one.
    fn member_over_rails(liveness: Option<Duration>) -> OverRails {
        let (m, failure, aborted, b1, b2) = member(liveness);
        let (c, r1) = rail_channel(1);
        m.add_rails(vec![Rails { peer: 1, first: "rail0".into(), more: vec![("rail1".into(), c)] }]);
        (m, failure, aborted, [b1, r1, b2])
    }

    /// The registry id of a TCP membership.
    fn id(m: &Membership) -> u64 {
        match m.chans {
            Channels::Tcp(id) => id,
            Channels::Mem(_) => unreachable!("a TCP membership"),
        }
    }

    #[test]
    fn a_peer_heard_on_one_rail_lives_an_ended_connection_is_dropped_and_silence_on_all_is_death() {
        let (m, failure, _, [mut r0, mut r1, mut b2]) = member_over_rails(Some(Duration::from_millis(600)));
        assert_eq!(watch::connections(id(&m), 1), 2);
        // Heartbeats go on every connection. Rank 1 (on rail1) and rank 2 beat before each
        // read, so that neither is silent for a timeout while this end listens.
        for on_rail1 in [false, true] {
            r1.send(&Frame::Heartbeat { pid: 11 });
            b2.send(&Frame::Heartbeat { pid: 12 });
            let far = if on_rail1 { &mut r1 } else { &mut r0 };
            let got = far.frames(Duration::from_millis(200));
            assert!(matches!(got.first(), Some(Frame::Heartbeat { .. })), "{got:?}");
        }
        // Rank 1 beats on rail1 only, for 2.5 timeouts: it lives (rank 2 beats too).
        let beat = |r1: &mut Far, b2: &mut Far, ms: u64| {
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(ms) {
                r1.send(&Frame::Heartbeat { pid: 11 });
                b2.send(&Frame::Heartbeat { pid: 12 });
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        beat(&mut r1, &mut b2, 1500);
        assert!(lock(&failure).is_none(), "rank 1 is heard on rail1: {:?}", lock(&failure));
        // Rail0's connection ends: dropped, no death.
        drop(r0);
        beat(&mut r1, &mut b2, 800);
        assert!(lock(&failure).is_none(), "one connection's end is no death: {:?}", lock(&failure));
        assert_eq!(watch::connections(id(&m), 1), 1, "the ended connection is dropped");
        // Rank 1 falls silent on its last connection: dead within the bound (rank 2 beats on).
        let t = Instant::now();
        let e = loop {
            b2.send(&Frame::Heartbeat { pid: 12 });
            if let Some(e) = failed_within(&failure, Duration::from_millis(50)) {
                break e;
            }
            assert!(t.elapsed() < Duration::from_secs(5), "rank 1 was never declared dead");
        };
        assert!(e.message().contains("peer rank 1 (h1:11) stopped answering heartbeats for 0."), "{e}");
        assert!(e.message().ends_with("(OXCCL_LIVENESS_TIMEOUT_MS=600)"), "{e}");
        drop(m);
    }

    #[test]
    fn an_abort_on_every_rail_is_acted_on_once_and_death_takes_every_connection_ending() {
        let (m, failure, aborted, [mut r0, mut r1, mut b2]) = member_over_rails(None);
        let abort = Frame::Abort { code: 5, reason: "rank 1: collective mismatch".into() };
        r0.send(&abort);
        r1.send(&abort);
        let e = failed_within(&failure, Duration::from_secs(5)).expect("rank 1's abort is recorded");
        assert!(
            e.message().starts_with("rank 0: peer rank 1 (h1") && e.message().ends_with("collective mismatch"),
            "{e}"
        );
        // Rank 2 hears it once.
        let got = b2.frames(Duration::from_secs(5));
        assert!(matches!(last_abort(&got), Some(Frame::Abort { code: 5, .. })), "{got:?}");
        let more = b2.frames(Duration::from_millis(500));
        assert!(!more.iter().any(|f| matches!(f, Frame::Abort { .. })), "forwarded twice: {more:?}");
        // One connection's end is no death; both are.
        drop(r1);
        std::thread::sleep(Duration::from_millis(600));
        assert!(!aborted.load(Ordering::SeqCst), "rank 1 lives on rail0");
        drop(r0);
        let t = Instant::now();
        while !aborted.load(Ordering::SeqCst) {
            assert!(t.elapsed() < Duration::from_secs(5), "rank 1's death was not found");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(m.down().map(|d| d.message().to_string()), Some(e.message().to_string()));
    }

    #[test]
    fn closing_on_one_rail_closes_the_channel_and_destroy_closes_every_rail() {
        let (m, failure, _, [r0, mut r1, _b2]) = member_over_rails(Some(Duration::from_secs(60)));
        r1.send(&Frame::Closing);
        drop((r0, r1));
        assert!(failed_within(&failure, Duration::from_millis(800)).is_none(), "an orderly close is no death");
        drop(m);
        let (m, _, _, [mut r0, mut r1, _b2]) = member_over_rails(Some(Duration::from_secs(60)));
        drop(m);
        for far in [&mut r0, &mut r1] {
            assert_eq!(far.frames(Duration::from_secs(5)).last(), Some(&Frame::Closing));
        }
    }

    #[test]
    fn tampering_on_a_further_rail_fails_the_communicator_and_the_peer_hears_why_on_every_rail() {
        let (_m, failure, aborted, [mut r0, mut r1, mut b2]) = member_over_rails(None);
        r1.s.write_all(&Frame::Closing.encode()).unwrap();
        r1.s.write_all(&[0; seal::TRAILER]).unwrap();
        let e = failed_within(&failure, Duration::from_secs(5)).expect("the forgery is caught");
        assert!(e.message().contains("peer rank 1 (h1)") && e.message().contains("was tampered with"), "{e}");
        assert!(aborted.load(Ordering::SeqCst));
        for far in [&mut r0, &mut r1, &mut b2] {
            match last_abort(&far.frames(Duration::from_secs(5))) {
                Some(Frame::Abort { reason, .. }) => assert_eq!(reason, e.message()),
                other => panic!("an abort frame on every connection, got {other:?}"),
            }
        }
    }

    /// An in-memory mesh of `n`: each rank's membership, failure and abort flag.
    fn mem_mesh(n: usize) -> Vec<(Membership, Flags)> {
        let hosts = vec!["in-memory".to_string(); n];
        let flags: Vec<Flags> = (0..n).map(|_| Default::default()).collect();
        let hooks = flags
            .iter()
            .enumerate()
            .map(|(r, (a, f))| Hooks::new(r, &hosts, None, a.clone(), f.clone(), Default::default()));
        mesh(hooks.collect()).into_iter().zip(flags).collect()
    }

    #[test]
    fn a_settled_failure_reaches_every_rank_without_interrupting_it() {
        let ranks = mem_mesh(3);
        let mine = Error::invalid_usage("rank 1: all_reduce: collective mismatch: rank 1 called x, rank 0 called y");
        let got = ranks[1].0.settle(mine.clone());
        assert_eq!(got.message(), mine.message(), "a mismatch found here is reported as it is");
        assert_eq!(lock(&ranks[1].1 .1).as_ref().map(|e| e.message().to_string()), Some(mine.message().to_string()));
        for r in [0, 2] {
            let e = lock(&ranks[r].1 .1).clone().expect("every other rank has the failure");
            assert_eq!(e.kind(), ErrorKind::InvalidUsage);
            assert!(e.message().starts_with(&format!("rank {r}: peer rank 1 (in-memory) failed: ")), "{e}");
            assert!(e.message().contains("collective mismatch: rank 1 called x, rank 0 called y"), "{e}");
            assert!(!ranks[r].1 .0.load(Ordering::SeqCst), "a peer's abort interrupts no running call");
            assert!(ranks[r].0.told());
        }
        // Rank 0's own call then fails on a closed link: the peer's reason is reported.
        let t = Instant::now();
        let e = ranks[0].0.settle(Error::remote("rank 0: all_reduce step 2: peer rank 1 closed the connection"));
        assert!(e.message().contains("peer rank 1 (in-memory) failed") && e.kind() == ErrorKind::InvalidUsage, "{e}");
        assert!(t.elapsed() < ABORT_GRACE, "a reason already there is not waited for");
    }

    #[test]
    fn a_closed_link_without_a_reason_is_reported_after_the_grace_and_sent() {
        let ranks = mem_mesh(2);
        let t = Instant::now();
        let e = ranks[0].0.settle(Error::remote("rank 0: peer rank 1 closed the connection"));
        assert!(t.elapsed() >= ABORT_GRACE, "waited only {:?} for a reason", t.elapsed());
        assert_eq!(e.message(), "rank 0: peer rank 1 closed the connection");
        let told = lock(&ranks[1].1 .1).clone().expect("rank 1 is told");
        assert_eq!(told.kind(), ErrorKind::Remote);
        assert!(told.message().contains("rank 0: peer rank 1 closed the connection"), "{told}");
    }
}
