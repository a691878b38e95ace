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
//! (8 bytes, big-endian, only ever growing) on a TCP connection beside the endpoints, which
//! also carries the failover's words and whose end-of-file tells of a dead peer. Each rail has
//! one such credit connection between its two addresses (the first rail's is the pair's
//! authenticated connection; the others are the connections its rails were measured on), and
//! an end writes on the first of its rails still working ([`OfiLink`]'s `writer`), so the words
//! outlive any one rail. So a link's message never arrives before its receive, and the rail's
//! drain receives can take every message that matches none.
//!
//! A link with several rails survives the loss of all but one: a rail that fails (an error
//! completion, or no progress for `OXCCL_RAIL_TIMEOUT_MS`: [`OfiLink`]'s `watch`) has its
//! share of the stream moved onto a working rail's endpoint with its sequence numbers, the
//! receiver keeping what arrived and the sender sending again, from slots it keeps until the
//! peer consumed them, only what the receiver's resume lacks (docs/RDMA.md, "Rail failover").
//! A rail's credit connection that ends or fails while another lives fails that rail over
//! too, after [`CONN_GRACE`] (a peer that exits closes them all at once: a dead peer).
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

/// A link's place on one rail: the state of the stream's share on rail index `r` (the stripe
/// cycle's), carried by the endpoint of rail `carrier` (`r` until a failover moves it).
struct OnRail {
    rail: Arc<Rail>,
    id: u64,
    /// The last credit written to the peer for this rail.
    granted: u64,
    /// The rail whose endpoint carries this share.
    carrier: usize,
    /// How many failovers moved this share (both ends count the same).
    gen: u8,
}

/// One of the link's rails as set up: its endpoint, the peer's address on it, its name.
struct Phys {
    rail: Arc<Rail>,
    fi_addr: u64,
    peer_name: String,
    name: String,
    /// Why it failed, once it did.
    dead: Option<String>,
}

/// Credits name their share (stripe rail) in the top byte and its failover generation in the
/// next; the sequence number is below them.
const CREDIT_RAIL_SHIFT: u32 = 56;
const CREDIT_GEN_SHIFT: u32 = 48;
const CREDIT_SEQ_MASK: u64 = (1 << CREDIT_GEN_SHIFT) - 1;
/// How long a rail's credit connection may have ended while another lives before that rail is
/// failed over (the connections of a peer that exits end within this of each other).
pub const CONN_GRACE: Duration = Duration::from_millis(200);

/// A rail's credit connection: TCP between the rail's two addresses, read for the peer's
/// credits and failover words.
struct Conn {
    sock: TcpStream,
    /// The bytes of a word read so far (a partial credit, or a partial resume).
    input: [u8; RESUME_LEN],
    got: usize,
    /// When and why it ended (end-of-file or an error); it is read no more.
    ended: Option<(Instant, String)>,
    /// Its end was acted on (the rail failed over, or had failed already).
    settled: bool,
}
/// Control words on the credit connection (top byte; rails are fewer than 128): a rail's
/// share failed (`[FAIL, r, gen, 0...]`), and the receiver's resume of a moved share
/// (`[RESUME, r, gen, 0, prefix u32]`, then the first unread sequence number, the arrived
/// bitmask of the window after it, and the credit: 32 bytes).
const FAIL: u8 = 0xFE;
const RESUME: u8 = 0xFD;
const RESUME_LEN: usize = 32;

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
    /// One credit connection per rail of `phys` (by index).
    conns: Vec<Conn>,
    /// The connection this end writes its words on: the first whose rail and connection work.
    cur: usize,
    peer_rank: usize,
    peer_addr: String,
    provider: String,
    down: AtomicBool,
    /// Longest a dropped link waits for its sends to complete.
    linger: Duration,
    /// The rails as set up, by index (failover state).
    phys: Vec<Phys>,
    /// Control words for the peer, written before any further credit.
    ctl_out: Vec<u8>,
    /// Every control word queued so far, in order: written again, whole, on the next credit
    /// connection when this end moves to it (the peer ignores those it acted on).
    ctl_log: Vec<u8>,
    /// A rail is declared failed after this long without progress (`OXCCL_RAIL_TIMEOUT_MS`).
    rail_timeout: Duration,
    /// This rank, for messages.
    me: usize,
    /// The stream's next message (number) has not arrived since this instant, while a later
    /// one did on another rail.
    behind: Option<(u64, Instant)>,
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
    /// index; `[0]` for one rail); messages of at most `chunk` bytes, `depths[k]` in flight each
    /// way on rail `k` (the same at both ends); `socks` are the rails' credit connections (one per rail, the pair's connection
    /// first), kept for credits, failover words and their end-of-file. Posts the first receives
    /// and grants them to the peer.
    pub fn new(
        rails: Vec<(Arc<Rail>, PeerAddr)>,
        cycle: Vec<u8>,
        chunk: usize,
        depths: Vec<usize>,
        socks: Vec<TcpStream>,
        peer_rank: usize,
        linger: Duration,
    ) -> Result<OfiLink> {
        if rails.is_empty() || cycle.is_empty() || cycle.iter().any(|&r| r as usize >= rails.len()) {
            return Err(Error::internal("an ofi link with no rails or a stripe cycle outside them"));
        }
        if depths.len() != rails.len() || depths.iter().any(|&d| d == 0 || d > 64) {
            return Err(Error::internal("an ofi link needs a depth of 1 to 64 per rail"));
        }
        if socks.len() != rails.len() {
            return Err(Error::internal("an ofi link needs one credit connection per rail"));
        }
        let mut conns = Vec::with_capacity(socks.len());
        for sock in socks {
            sock.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
            // Credits are 8 bytes: never held back to fill a segment.
            sock.set_nodelay(true).map_err(|e| Error::from_io("TCP_NODELAY", e))?;
            conns.push(Conn { sock, input: [0; RESUME_LEN], got: 0, ended: None, settled: false });
        }
        let peer_addr = conns[0].sock.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let wake = eventfd()?;
        let provider = rails[0].0.provider.clone();
        let mut link = OfiLink {
            rails: Vec::with_capacity(rails.len()),
            cycle,
            send_msg: 0,
            recv_msg: 0,
            wake,
            conns,
            cur: 0,
            peer_rank,
            peer_addr,
            provider,
            down: AtomicBool::new(false),
            linger,
            phys: Vec::new(),
            ctl_out: Vec::new(),
            ctl_log: Vec::new(),
            rail_timeout: Duration::from_secs(2),
            me: usize::MAX,
            behind: None,
        };
        let several = rails.len() > 1;
        // From here the link's drop withdraws what was posted (and closes `wake`).
        for (k, (rail, peer)) in rails.into_iter().enumerate() {
            let mut st = rail.core.lock();
            let id = st.next_id();
            link.phys.push(Phys {
                rail: rail.clone(),
                fi_addr: peer.fi_addr,
                peer_name: peer.name.clone(),
                name: format!("endpoint {}", super::rail::hex(&rail.addr)),
                dead: None,
            });
            let mut l = LinkRx::new(&st, rail.mr_local, id, peer, chunk, depths[k], wake)?;
            l.keep = several;
            let posted = l.repost(st.ep());
            st.peers.insert(id, l);
            link.rails.push(OnRail { rail: rail.clone(), id, granted: 0, carrier: k, gen: 0 });
            if posted? {
                st.requeue_drains()?;
            }
        }
        link.grant()?;
        Ok(link)
    }

    /// Names the link's rails (`names[r]` for rail `r`, e.g. `rail1 10.0.1.1 -> rail1
    /// 10.0.1.2`) and this rank for the failover's messages, and sets how long a rail may make
    /// no progress before it is declared failed.
    pub fn set_failover(&mut self, me: usize, names: Vec<String>, timeout: Duration) {
        for (p, n) in self.phys.iter_mut().zip(names) {
            p.name = n;
        }
        self.me = me;
        self.rail_timeout = timeout;
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

    /// The credit connection to write on: the first whose rail has not failed and which has not
    /// ended. Moving to another one drops what was queued for the old one and queues every
    /// control word so far, then every share's credit again (the old one may have lost them;
    /// the peer ignores what it already acted on).
    fn writer(&mut self) -> usize {
        let next = (0..self.conns.len()).find(|&p| self.phys[p].dead.is_none() && self.conns[p].ended.is_none());
        if let Some(p) = next.filter(|&p| p != self.cur) {
            self.cur = p;
            self.ctl_out = self.ctl_log.clone();
            for on in &mut self.rails {
                on.granted = 0;
            }
        }
        self.cur
    }

    /// Queues a control word for the peer (and keeps it for a later credit connection).
    fn queue_ctl(&mut self, w: &[u8]) {
        self.ctl_out.extend_from_slice(w);
        self.ctl_log.extend_from_slice(w);
    }

    /// Writes the peer's new credit of each rail where it grew (later, on the next call, if the
    /// socket is full). A credit is 8 bytes, big-endian: the share's index in the top byte, its
    /// failover generation in the next, the first sequence number not posted on it below them.
    fn grant(&mut self) -> Result<()> {
        if !self.flush_ctl()? {
            return Ok(());
        }
        let fd = self.conns[self.cur].sock.as_raw_fd();
        for r in 0..self.rails.len() {
            let upto = self.with(r, false, |l, _| Ok(l.posted_below()))?;
            if upto <= self.rails[r].granted {
                continue;
            }
            let gen = u64::from(self.rails[r].gen);
            let b =
                ((r as u64) << CREDIT_RAIL_SHIFT | gen << CREDIT_GEN_SHIFT | (upto & CREDIT_SEQ_MASK)).to_be_bytes();
            // SAFETY: sends 8 bytes from a valid array on our socket; MSG_NOSIGNAL: a closed
            // peer is an error code, never SIGPIPE (a host program may not ignore it).
            let n = unsafe { libc::send(fd, b.as_ptr().cast(), 8, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if n == 8 {
                self.rails[r].granted = upto;
                continue;
            }
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                // Full (written on a later call) or interrupted.
                ErrorKind::WouldBlock | ErrorKind::Interrupted if n < 0 => Ok(()),
                // The peer is gone, or this connection is: what it sent can still be read; its
                // end-of-file tells the rest.
                ErrorKind::BrokenPipe | ErrorKind::ConnectionReset if n < 0 => Ok(()),
                _ if n >= 0 => Err(self.remote("connection failed: a short write of a credit")),
                _ if self.conns.len() > 1 => Ok(()),
                _ => Err(self.remote(&format!("connection failed: {e}"))),
            };
        }
        Ok(())
    }

    /// Writes the queued control words (as far as the socket takes them); whether all went.
    fn flush_ctl(&mut self) -> Result<bool> {
        let w = self.writer();
        let fd = self.conns[w].sock.as_raw_fd();
        while !self.ctl_out.is_empty() {
            // SAFETY: sends from a valid buffer of that length on our socket; MSG_NOSIGNAL as
            // in `grant`.
            let n = unsafe {
                libc::send(
                    fd,
                    self.ctl_out.as_ptr().cast(),
                    self.ctl_out.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                self.ctl_out.drain(..n as usize);
                continue;
            }
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                ErrorKind::WouldBlock | ErrorKind::Interrupted => Ok(false),
                ErrorKind::BrokenPipe | ErrorKind::ConnectionReset => Ok(false),
                _ if self.conns.len() > 1 => Ok(false),
                _ => Err(self.remote(&format!("connection failed: {e}"))),
            };
        }
        Ok(true)
    }

    /// Reads credits and control words from every credit connection that has not ended;
    /// `Ok(false)` once all have (the peer closed them).
    fn read_credits(&mut self) -> Result<bool> {
        let mut buf = [0u8; 256];
        let several = self.conns.len() > 1;
        for c in 0..self.conns.len() {
            if self.conns[c].ended.is_some() {
                continue;
            }
            let mut best = vec![0u64; self.rails.len()];
            loop {
                let got = (&self.conns[c].sock).read(&mut buf);
                match got {
                    Ok(0) => {
                        self.conns[c].ended = Some((Instant::now(), "its credit connection was closed".into()));
                        break;
                    }
                    Ok(n) => {
                        for &b in &buf[..n] {
                            self.take_byte(c, b, &mut best)?;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == ErrorKind::ConnectionReset || several => {
                        self.conns[c].ended = Some((Instant::now(), format!("its credit connection failed: {e}")));
                        break;
                    }
                    Err(e) => return Err(self.remote(&format!("connection failed: {e}"))),
                }
            }
            self.apply_credits(&mut best)?;
        }
        Ok(self.conns.iter().any(|c| c.ended.is_none()))
    }

    /// One byte read from credit connection `c`: completes a credit (raising `best`, the
    /// share's credit read so far, where it is of the share's current generation) or a
    /// control word (acted on at once, after the credits read before it).
    fn take_byte(&mut self, c: usize, b: u8, best: &mut [u64]) -> Result<()> {
        let conn = &mut self.conns[c];
        conn.input[conn.got] = b;
        conn.got += 1;
        let top = conn.input[0];
        if conn.got < 8 || (top == RESUME && conn.got < RESUME_LEN) {
            return Ok(());
        }
        conn.got = 0;
        let w = conn.input;
        if top == FAIL || top == RESUME {
            // Credits read so far belong before the control word.
            self.apply_credits(best)?;
            return self.control(&w);
        }
        let v = u64::from_be_bytes(w[..8].try_into().expect("8 bytes"));
        let (r, gen) = ((v >> CREDIT_RAIL_SHIFT) as usize, (v >> CREDIT_GEN_SHIFT) as u8);
        let Some(best) = best.get_mut(r) else {
            return Err(self.remote(&format!("sent a credit for rail {r} of a link with {}", self.rails.len())));
        };
        let now = self.rails[r].gen;
        if gen == now {
            *best = (*best).max(v & CREDIT_SEQ_MASK);
        } else if gen.wrapping_sub(now) < 128 {
            // Every credit of a later generation follows, on its connection, the resume that
            // this end must have acted on first.
            return Err(self.remote(&format!(
                "sent a credit for rail {r} after failover {gen}, but this end is at failover {now}"
            )));
        }
        // Else a credit of the state the share left, read late on another connection: ignored.
        Ok(())
    }

    /// Raises each rail's credit to what was read (and clears `best`); a share that waits for
    /// its resume after a failover ignores the credits of the rail it left.
    fn apply_credits(&mut self, best: &mut [u64]) -> Result<()> {
        for (r, best) in best.iter_mut().enumerate() {
            let b = std::mem::take(best);
            if b > 0 {
                self.with(r, false, |l, _| {
                    if !l.awaiting {
                        l.credit = l.credit.max(b);
                    }
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    /// A control word from the peer: a share it found failed, or its resume of a moved one.
    /// Words this end acted on already (written again on a later credit connection) are
    /// ignored.
    fn control(&mut self, w: &[u8; RESUME_LEN]) -> Result<()> {
        let (r, gen) = (w[1] as usize, w[2]);
        if r >= self.rails.len() {
            return Err(self.remote(&format!("sent a failover word for rail {r} of a link with {}", self.rails.len())));
        }
        if w[0] == FAIL {
            // Ignored where this end moved that share already.
            if self.rails[r].gen == gen {
                let carrier = self.rails[r].carrier;
                self.failover(carrier, "the peer found it failed".into(), false)?;
            }
            return Ok(());
        }
        let word = |k: usize| u64::from_be_bytes(w[8 * k..8 * k + 8].try_into().expect("8 bytes"));
        let prefix = u64::from(u32::from_be_bytes(w[4..8].try_into().expect("4 bytes")));
        let (base, arrived, credit) = (word(1), word(2), word(3));
        let now = self.rails[r].gen;
        if now != gen {
            if now.wrapping_sub(gen) < 128 {
                // A resume of an earlier failover, acted on already.
                return Ok(());
            }
            return Err(
                self.remote(&format!("resumed rail {r} after failover {gen}, but this end is at failover {now}"))
            );
        }
        self.with(r, false, |l, ep| {
            if !l.awaiting {
                // This failover's resume again, acted on already.
                return Ok(());
            }
            l.resume(prefix, base, arrived, credit)?;
            l.pump(ep).map(|_| ())
        })
    }

    /// The rail `p` failed (`why`; `found`: found here, so the peer is told): every share it
    /// carries moves to the first rail still working, or, with none left, the link fails.
    fn failover(&mut self, p: usize, why: String, found: bool) -> Result<()> {
        if self.phys[p].dead.is_some() {
            return Ok(());
        }
        self.phys[p].dead = Some(why.clone());
        let Some(q) = self.phys.iter().position(|x| x.dead.is_none()) else {
            let before: Vec<String> = self
                .phys
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != p)
                .map(|(_, x)| format!("{} ({})", x.name, x.dead.as_deref().unwrap_or("")))
                .collect();
            let what = format!(
                "is unreachable: its last OFI rail {} failed ({why}){}",
                self.phys[p].name,
                if before.is_empty() { String::new() } else { format!(", after {}", before.join(", ")) }
            );
            for c in &self.conns {
                let _ = c.sock.shutdown(std::net::Shutdown::Both);
            }
            return Err(self.remote(&what));
        };
        let moved: Vec<usize> = (0..self.rails.len()).filter(|&r| self.rails[r].carrier == p).collect();
        for &r in &moved {
            if found {
                self.queue_ctl(&[FAIL, r as u8, self.rails[r].gen, 0, 0, 0, 0, 0]);
            }
            self.move_share(r, q)?;
        }
        crate::warn!(
            "rank {}: OFI rail {} to rank {} ({}, {}) failed ({why}); its messages moved to {}",
            self.me,
            self.phys[p].name,
            self.peer_rank,
            self.peer_addr,
            self.provider,
            self.phys[q].name
        );
        self.behind = None;
        self.grant()
    }

    /// Moves the stream's share `r` onto the endpoint of rail `q`: withdraws its receives on
    /// the failed rail, takes over what arrived and what was sent ([`LinkRx::take_over`]),
    /// posts the missing receives under a fresh prefix and queues the resume for the peer.
    fn move_share(&mut self, r: usize, q: usize) -> Result<()> {
        let fresh = super::rail::new_prefix()?;
        let (chunk, depth) = {
            let on = &self.rails[r];
            let st = on.rail.core.lock();
            let l = st.peers.get(&on.id).ok_or_else(|| Error::internal("ofi link state missing"))?;
            (l.chunk, l.depth)
        };
        let target = self.phys[q].rail.clone();
        let peer = PeerAddr {
            fi_addr: self.phys[q].fi_addr,
            name: self.phys[q].peer_name.clone(),
            send_prefix: 0,
            recv_prefix: fresh,
        };
        // One rail locked at a time (as the progress threads do): the new state is nobody
        // else's until it is inserted.
        let (id, mut nl) = {
            let mut st = target.core.lock();
            let id = st.next_id();
            (id, LinkRx::new(&st, target.mr_local, id, peer, chunk, depth, self.wake)?)
        };
        {
            let on = &self.rails[r];
            let mut st_old = on.rail.core.lock();
            let ep_old = st_old.ep();
            let old = st_old.peers.get_mut(&on.id).ok_or_else(|| Error::internal("ofi link state missing"))?;
            old.closing = true;
            old.armed = false;
            old.wake = -1;
            old.cancel_all(ep_old);
            nl.take_over(old);
        }
        let mut st_new = target.core.lock();
        let ep = st_new.ep();
        let posted = nl.repost(ep).map_err(|e| self.wrap(e))?;
        let (base, arrived, credit) = (nl.recv_seq, nl.arrived(), nl.posted_below());
        st_new.peers.insert(id, nl);
        if posted {
            st_new.requeue_drains()?;
        }
        drop(st_new);
        let gen = self.rails[r].gen.wrapping_add(1);
        let mut w = [0u8; RESUME_LEN];
        w[..4].copy_from_slice(&[RESUME, r as u8, gen, 0]);
        w[4..8].copy_from_slice(&(fresh as u32).to_be_bytes());
        for (k, v) in [base, arrived, credit].into_iter().enumerate() {
            w[8 * (k + 1)..8 * (k + 2)].copy_from_slice(&v.to_be_bytes());
        }
        self.queue_ctl(&w);
        self.rails[r] = OnRail { rail: target, id, granted: credit, carrier: q, gen };
        Ok(())
    }

    /// Finds failed rails of a link with several (an error completion; a send in flight with
    /// no completion, or every send refused by the provider, for the rail timeout; or the
    /// stream's next message missing for that long on its rail while a later one arrived on
    /// another) and fails them over.
    fn watch(&mut self) -> Result<()> {
        if self.phys.len() < 2 {
            return Ok(());
        }
        let now = Instant::now();
        let t = self.rail_timeout;
        // A credit connection that ended while another lives (a peer that exits closes all
        // within the grace): its rail fails over.
        for p in 0..self.conns.len() {
            let Some((since, why)) = self.conns[p].ended.clone() else { continue };
            if self.conns[p].settled {
                continue;
            }
            if self.phys[p].dead.is_some() {
                self.conns[p].settled = true;
            } else if now.saturating_duration_since(since) >= CONN_GRACE.min(t) {
                self.conns[p].settled = true;
                return self.failover(p, why, true);
            }
        }
        for r in 0..self.rails.len() {
            let carrier = self.rails[r].carrier;
            if self.phys[carrier].dead.is_some() {
                continue;
            }
            let why = self.with(r, false, |l, _| Ok(l.broken.clone().or_else(|| l.stalled(now, t))))?;
            if let Some(why) = why {
                return self.failover(carrier, why, true);
            }
        }
        let k = self.recv_msg;
        let r = self.rail_of(k);
        let carrier = self.rails[r].carrier;
        let waiting = !self.with(r, false, |l, _| Ok(l.readable()))?;
        let mut later = false;
        if waiting {
            for s in (0..self.rails.len()).filter(|&s| self.rails[s].carrier != carrier) {
                later |= self.with(s, false, |l, _| Ok(l.holds_unread()))?;
            }
        }
        match self.behind {
            _ if !later => self.behind = None,
            Some((kk, since)) if kk == k => {
                if now.saturating_duration_since(since) >= t {
                    let why = format!(
                        "message {k} of the stream missing for {} ms while later ones arrived on other rails",
                        t.as_millis()
                    );
                    return self.failover(carrier, why, true);
                }
            }
            _ => self.behind = Some((k, now)),
        }
        Ok(())
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
        let missing = || Error::internal("ofi link state missing");
        let mut step = |l1: &mut LinkRx, l2: &mut LinkRx| -> Result<(usize, u64)> {
            l1.check().and_then(|_| l2.check()).map_err(|e| self.wrap(e))?;
            let (seq1, seq2) = (l1.recv_seq, l2.recv_seq);
            let Some(a) = l1.ready(seq1, l1.rx_off) else { return Ok((0, 0)) };
            let a = &a[..a.len().min(max)];
            let b =
                if a.len() < max { l2.ready(seq2, l2.rx_off).map(|b| &b[..b.len().min(max - a.len())]) } else { None };
            let (alen, blen) = (a.len(), b.map_or(0, <[u8]>::len));
            let used = f(a, b.unwrap_or(&[])).min(alen + blen);
            l1.consume(used.min(alen));
            // Bytes of the next message only once the current one is used up.
            let rest = used - used.min(alen);
            if rest > 0 {
                l2.consume(rest);
            }
            Ok((used, (l1.recv_seq - seq1) + (l2.recv_seq - seq2)))
        };
        let (used, msgs) = if Arc::ptr_eq(&o1.rail.core, &o2.rail.core) {
            // Both shares on one endpoint (after a failover): one lock; the second state is
            // taken out of the map for the step and put back (its operations' contexts and
            // staging are boxed and mapped, so they do not move).
            let mut g = o1.rail.core.lock();
            let mut l2 = g.peers.remove(&o2.id).ok_or_else(missing)?;
            let r = match g.peers.get_mut(&o1.id) {
                Some(l1) => step(l1, &mut l2),
                None => Err(missing()),
            };
            g.peers.insert(o2.id, l2);
            r?
        } else {
            let first_is_1 = Arc::as_ptr(&o1.rail.core) < Arc::as_ptr(&o2.rail.core);
            let (mut g1, mut g2);
            if first_is_1 {
                g1 = o1.rail.core.lock();
                g2 = o2.rail.core.lock();
            } else {
                g2 = o2.rail.core.lock();
                g1 = o1.rail.core.lock();
            }
            let l1 = g1.peers.get_mut(&o1.id).ok_or_else(missing)?;
            let l2 = g2.peers.get_mut(&o2.id).ok_or_else(missing)?;
            step(l1, l2)?
        };
        self.recv_msg += msgs;
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
        Some(self.conns[self.cur].sock.as_raw_fd())
    }

    fn poll_set(&self, interest: Interest, out: &mut Vec<libc::pollfd>) -> bool {
        // The credit connections that have not ended (credits, end-of-file), the progress
        // threads' wake-ups, and, to read, the providers' own descriptors (so arriving data
        // wakes without the thread's hop).
        for c in self.conns.iter().filter(|c| c.ended.is_none()) {
            out.push(libc::pollfd { fd: c.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
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
        if alive {
            self.watch()?;
        }
        // Receives the provider had no room for, and a credit the socket had no room for.
        self.repost_and_grant()?;
        let (rr, sr) = (self.rail_of(self.recv_msg), self.rail_of(self.send_msg));
        for r in 0..self.rails.len() {
            let wait_fd = self.rails[r].rail.core.wait_fd;
            let ready = self.with(r, true, |l, ep| {
                if l.keep {
                    // Messages to send again after a failover (as far as credit allows).
                    l.pump(ep)?;
                }
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
        for c in &self.conns {
            let _ = c.sock.shutdown(std::net::Shutdown::Both);
        }
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
