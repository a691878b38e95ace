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
/// no key crosses the wire. A rail of either end left without a partner is left out with an
/// INFO line (but an address both ends have: ranks on one host).
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
        // An address both ends have (ranks on one host) pairs with nothing by design: not noted.
        let both = |a: &IfAddr| mine.iter().any(|m| m.addr == a.addr) && theirs.iter().any(|t| t.addr == a.addr);
        let alone: Vec<&IfAddr> = alone.iter().filter(|a| !both(a)).collect();
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

#[cfg(test)]
mod tests {
    use super::super::frame::Frame;
    use super::super::seal::{Opener, Sealer};
    use super::super::tests::pair;
    use super::*;
    use crate::bootstrap::auth::{Keys, KEY_LEN};
    use std::io::{Read, Write};

    /// Rank `r`'s rails: its channels run on 127.0.0.1 (rail0); ranks but 3 have a rail1 at
    /// 127.0.1.(r + 1), on the same /8 (rank 3 has no rails).
    fn rails_of(r: usize) -> Vec<IfAddr> {
        let at = |name: &str, addr: String| IfAddr { name: name.into(), addr: addr.parse().unwrap(), prefix: 8 };
        if r == 3 {
            return Vec::new();
        }
        vec![at("rail0", "127.0.0.1".into()), at("rail1", format!("127.0.1.{}", r + 1))]
    }

    #[test]
    fn every_pair_with_two_rails_gets_a_sealed_connection_on_rail1_and_the_channels_stay_in_step() {
        // A channel between every two of 4 ranks; the keys of (i, j): i sends under [10 i + j].
        let key = |i: usize, j: usize| [(10 * i + j) as u8; KEY_LEN];
        let mut chans: Vec<Vec<(usize, Conn)>> = (0..4).map(|_| Vec::new()).collect();
        for i in 0..4 {
            for j in i + 1..4 {
                let (a, b) = pair();
                chans[i].push((j, Conn { stream: a, keys: Keys { send: key(i, j), recv: key(j, i) } }));
                chans[j].push((i, Conn { stream: b, keys: Keys { send: key(j, i), recv: key(i, j) } }));
            }
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let got: Vec<Opened> = std::thread::scope(|s| {
            let ts: Vec<_> = chans
                .into_iter()
                .enumerate()
                .map(|(r, mut c)| {
                    s.spawn(move || {
                        let more = rails(r, &mut c, &rails_of(r), deadline, &|| false).unwrap();
                        (c, more)
                    })
                })
                .collect();
            ts.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let more = |i: usize, j: usize| got[i].1.iter().find(|m| m.peer == j);
        for i in 0..4 {
            for j in (0..4).filter(|&j| j != i) {
                let Some(m) = more(i, j) else {
                    assert!(i == 3 || j == 3, "rank {i} has no further rail to rank {j}");
                    continue;
                };
                assert!(i != 3 && j != 3, "rank {i}: a further rail to rank {j}, which has none on its side");
                assert_eq!((m.first.as_str(), m.more.len(), m.more[0].0.as_str()), ("rail0", 1, "rail1"));
                let c = &m.more[0].1;
                assert_eq!(c.stream.local_addr().unwrap().ip().to_string(), format!("127.0.1.{}", i + 1));
                assert_eq!(c.stream.peer_addr().unwrap().ip().to_string(), format!("127.0.1.{}", j + 1));
                assert_eq!(c.keys, Keys { send: key(i, j), recv: key(j, i) }.for_rail(1));
            }
        }
        // A frame sealed at one end of each rail1 connection opens at the other; the channels'
        // first connections carry on with nothing of the set-up left unread.
        for i in 0..3 {
            for j in i + 1..3 {
                let (a, b) = (&more(i, j).unwrap().more[0].1, &more(j, i).unwrap().more[0].1);
                (&a.stream).write_all(&Sealer::new(a.keys.send).seal(&Frame::Heartbeat { pid: 7 })).unwrap();
                let mut buf = vec![0u8; 64];
                b.stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let n = (&b.stream).read(&mut buf).unwrap();
                buf.truncate(n);
                assert_eq!(Opener::new(b.keys.recv).take(&mut buf).ok().flatten(), Some(Frame::Heartbeat { pid: 7 }));
            }
        }
        for i in 0..4 {
            for j in (0..4).filter(|&j| j != i) {
                let c = |r: usize, p: usize| &got[r].0.iter().find(|(q, _)| *q == p).unwrap().1.stream;
                c(i, j).write_all(&[i as u8, j as u8]).unwrap();
                let mut two = [0u8; 2];
                c(j, i).set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                c(j, i).read_exact(&mut two).unwrap();
                assert_eq!(two, [i as u8, j as u8]);
            }
        }
    }

    #[test]
    fn a_malformed_rail_offer_fails_naming_the_peer() {
        let (a, mut b) = pair();
        let keys = Keys { send: [1; KEY_LEN], recv: [2; KEY_LEN] };
        wire::write_frame(&mut b, b"X1").unwrap();
        let mut chans = vec![(1, Conn { stream: a, keys })];
        let e = rails(0, &mut chans, &rails_of(0), Instant::now() + Duration::from_secs(5), &|| false).unwrap_err();
        assert!(e.message().contains("rank 1: malformed rail offer"), "{e}");
        // Aborted while waiting for an offer: ends at once, whatever the deadline.
        let (a, _b) = pair();
        let mut chans = vec![(1, Conn { stream: a, keys: Keys { send: [1; KEY_LEN], recv: [2; KEY_LEN] } })];
        let t = Instant::now();
        let e = rails(0, &mut chans, &[], Instant::now() + Duration::from_secs(60), &|| true).unwrap_err();
        assert!(e.message().contains("aborted") && t.elapsed() < Duration::from_secs(5), "{e}");
    }
}
