//! Opening a communicator's control channels: every pair of ranks connects once more through
//! the data listener's authenticated handshake, with [`Purpose::Control`] (the higher rank is
//! dialled, the lower accepted, as for data links). Where both ends have several rails
//! (`OXCCL_SOCKET_IFNAME`, [`crate::transport::rails`]), the channel then gets one more
//! connection on each further rail ([`rails`]), whether or not the pair ever makes a data link,
//! and whatever transport its data link uses.

use super::Rails;
use crate::bootstrap::accept::{self, Extra, InProgress};
use crate::bootstrap::net::IfAddr;
use crate::bootstrap::{self, Bootstrap, Conn, Purpose};
use crate::error::{Error, Result};
use crate::net::wire::{self, Reader, Writer};
use crate::transport::rails as nics;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Every channel's first connection (peer rank, connection with its keys), and the further
/// connections of those with several rails.
pub(crate) type Opened = (Vec<(usize, Conn)>, Vec<Rails>);

/// A control channel to every other rank of `b`'s table: (peer rank, connection with its
/// keys), and the further connections of each channel whose ends share several rails of
/// `mine` (this rank's rails) and the peer's. Data links that arrive meanwhile go to `extra`.
/// Bounded by `deadline`; ends early when `abort` says so (dialling a peer as well as waiting
/// for one).
pub(crate) fn open(
    b: &Bootstrap,
    keep: &mut InProgress,
    extra: &mut Extra,
    mine: &[IfAddr],
    deadline: Instant,
    abort: &dyn Fn() -> bool,
) -> Result<Opened> {
    let mut out = Vec::new();
    for p in b.rank + 1..b.peers.len() {
        let s = bootstrap::connect_peer_until(b, p, Purpose::Control, deadline, abort)
            .map_err(|e| e.context(format!("rank {}: opening the control channel to rank {p}", b.rank)))?;
        out.push((p, s));
    }
    let mut want: Vec<usize> = (0..b.rank)
        .filter(|&p| match extra.remove(&(Purpose::Control, p)) {
            Some(s) => {
                out.push((p, s));
                false
            }
            None => true,
        })
        .collect();
    if !want.is_empty() {
        out.extend(accept::accept_for(b, keep, Purpose::Control, &mut want, extra, deadline, abort)?);
    }
    let more = rails(b.rank, &mut out, mine, deadline, abort)?;
    Ok((out, more))
}

/// First byte of a rail offer on a new control connection, and the offer's version.
const OFFER: u8 = b'R';
const VERSION: u8 = 1;
/// Longest offer or invitation.
const MAX_FRAME: usize = 4096;
/// Bytes of the token that admits a further rail's connection.
const TOKEN_LEN: usize = 16;

/// One peer's channel on its way to several rails.
struct Peer {
    /// Index in the channels.
    at: usize,
    /// The rails of the pair ([`nics::pair`]; the first is the channel's connection's).
    pairs: Vec<nics::Pair>,
    /// Higher rank: the listeners of the further rails and the token.
    invite: Option<(Vec<TcpListener>, [u8; TOKEN_LEN])>,
    /// The further rails' connections: this end's interface, connection and keys.
    more: Vec<(String, Conn)>,
}

/// The further connections of every channel of `chans` (rank `me`'s; past their handshake,
/// nothing else sent on them yet) over the rails both ends share, in phases over all peers at
/// once (every read waits only for bytes the peer writes before its own first read of that
/// phase, so no two ranks wait on each other in a cycle): (1) each end sends its rail list
/// `mine` on every channel, (2) reads the peer's and both pair them as the TCP data links do
/// ([`nics::pair`]); for a pair with several rails (3) the higher rank listens on its address
/// of each further rail and sends the ports and a random token, (4) the lower rank connects
/// from its address of each further rail and sends the token and the rail's index, (5) the
/// higher rank accepts them, dropping connections without the token. Each further connection
/// is sealed under the channel's keys for its rail ([`crate::bootstrap::auth::Keys::for_rail`]):
/// no key crosses the wire. A rail the peer offers that this rank cannot pair is left out with
/// an INFO line.
fn rails(
    me: usize,
    chans: &mut [(usize, Conn)],
    mine: &[IfAddr],
    deadline: Instant,
    abort: &dyn Fn() -> bool,
) -> Result<Vec<Rails>> {
    let ctx = |p: usize| move |e: Error| e.context(format!("rank {me}: the control channel's rails with rank {p}"));
    let mut w = Writer::default();
    w.bytes(&[OFFER, VERSION]);
    nics::encode(mine, &mut w);
    for (p, c) in chans.iter_mut() {
        wire::write_frame(&mut c.stream, &w.0).map_err(ctx(*p))?;
    }
    let mut peers = Vec::new();
    for (at, (p, c)) in chans.iter_mut().enumerate() {
        let f = read_until(&mut c.stream, MAX_FRAME, deadline, abort).map_err(ctx(*p))?;
        if f.len() < 2 || f[0] != OFFER || f[1] != VERSION {
            return Err(Error::remote(format!("rank {p}: malformed rail offer on the control channel")));
        }
        let mut r = Reader::new(&f[2..]);
        let theirs = nics::decode(&mut r).and_then(|l| r.finish().map(|_| l)).map_err(ctx(*p))?;
        let local = c.stream.local_addr().map_err(|e| Error::from_io("local_addr", e))?.ip();
        let remote = c.stream.peer_addr().map_err(|e| Error::from_io("peer_addr", e))?.ip();
        let (pairs, alone) = if me < *p {
            nics::pair(mine, &theirs, (local, remote))
        } else {
            nics::pair(&theirs, mine, (remote, local))
        };
        if !alone.is_empty() && !mine.is_empty() {
            crate::info!(
                "rank {me}: control channel to rank {p}: no partner on the same subnet for {}",
                alone.iter().map(|a| format!("{} {}", a.name, a.addr)).collect::<Vec<_>>().join(", ")
            );
        }
        if pairs.len() > 1 {
            peers.push(Peer { at, pairs, invite: None, more: Vec::new() });
        }
    }
    // (3) The higher rank invites.
    for q in peers.iter_mut() {
        let (p, c) = &mut chans[q.at];
        if me < *p {
            continue;
        }
        let mut token = [0u8; TOKEN_LEN];
        crate::net::random_bytes(&mut token)?;
        let mut w = Writer::default();
        w.bytes(&token);
        let mut ls = Vec::new();
        for pair in &q.pairs[1..] {
            let l = TcpListener::bind((pair.higher.addr, 0))
                .map_err(|e| Error::from_io(&format!("binding a control listener on {}", pair.higher.name), e))?;
            w.bytes(&l.local_addr().map_err(|e| Error::from_io("local_addr", e))?.port().to_le_bytes());
            ls.push(l);
        }
        wire::write_frame(&mut c.stream, &w.0).map_err(ctx(*p))?;
        q.invite = Some((ls, token));
    }
    // (4) The lower rank connects.
    for q in peers.iter_mut() {
        let (p, c) = &mut chans[q.at];
        if me > *p {
            continue;
        }
        let n = q.pairs.len() - 1;
        let f = read_until(&mut c.stream, TOKEN_LEN + 2 * n, deadline, abort).map_err(ctx(*p))?;
        if f.len() != TOKEN_LEN + 2 * n {
            return Err(Error::remote(format!("rank {p}: malformed control-rail invitation")));
        }
        for (k, pair) in q.pairs.iter().enumerate().skip(1) {
            let at = TOKEN_LEN + 2 * (k - 1);
            let to = SocketAddr::new(pair.higher.addr, u16::from_le_bytes([f[at], f[at + 1]]));
            let mut s = nics::connect_from(pair.lower.addr, to, deadline).map_err(ctx(*p))?;
            let mut w = Writer::default();
            w.bytes(&f[..TOKEN_LEN]).bytes(&[k as u8]);
            wire::write_frame(&mut s, &w.0).map_err(ctx(*p))?;
            q.more.push((pair.lower.name.clone(), Conn { stream: s, keys: c.keys.for_rail(k) }));
        }
    }
    // (5) The higher rank accepts.
    for q in peers.iter_mut().filter(|q| me > chans[q.at].0) {
        let (p, c) = &chans[q.at];
        let (ls, token) = q.invite.take().expect("invited in phase 3");
        for (k, l) in ls.iter().enumerate().map(|(i, l)| (i + 1, l)) {
            loop {
                let mut s = crate::transport::tcp::accept_until(l, deadline, abort).map_err(ctx(*p))?;
                let soon =
                    Instant::now() + Duration::from_secs(5).min(deadline.saturating_duration_since(Instant::now()));
                match wire::read_frame(&mut s, TOKEN_LEN + 1, soon) {
                    Ok(f) if f.len() == TOKEN_LEN + 1 && f[..TOKEN_LEN] == token && f[TOKEN_LEN] as usize == k => {
                        q.more.push((q.pairs[k].higher.name.clone(), Conn { stream: s, keys: c.keys.for_rail(k) }));
                        break;
                    }
                    _ => crate::warn!(
                        "rank {me}: dropped a connection without the token on a control-rail port for rank {p}"
                    ),
                }
            }
        }
    }
    Ok(peers
        .into_iter()
        .map(|q| {
            let peer = chans[q.at].0;
            let first = if me < peer { &q.pairs[0].lower.name } else { &q.pairs[0].higher.name };
            Rails { peer, first: first.clone(), more: q.more }
        })
        .collect())
}

/// [`wire::read_frame`] that waits for the first byte in short naps, ending when `abort` says
/// so (the frames here are a few bytes, written at once: the rest follows the first byte).
fn read_until(s: &mut TcpStream, max: usize, deadline: Instant, abort: &dyn Fn() -> bool) -> Result<Vec<u8>> {
    loop {
        if abort() {
            return Err(Error::invalid_usage("communicator was aborted while its control channels were opened"));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return wire::read_frame(s, max, deadline);
        }
        let mut pfd = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd on the stack, length 1.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(100) as libc::c_int) };
        if n > 0 {
            return wire::read_frame(s, max, deadline);
        }
    }
}
