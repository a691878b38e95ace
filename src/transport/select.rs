//! Choosing the transport of each peer: shared memory for ranks on the same host, libfabric or
//! TCP otherwise.
//!
//! Every pair first gets an authenticated TCP connection (bootstrap). On it both ends then
//! *offer* the transport that the transport table ([`super::table`]) picks for the peer: shared
//! memory when the peer's host identity (hostname + boot id + network namespace, or
//! `OXCCL_HOSTID`) equals theirs and `OXCCL_TRANSPORT` is not `tcp`; libfabric where `OXCCL_NET`
//! asks for it. The offer also carries the TCP fields (sockets, stripe, rails). Then each row
//! of the table runs its own set-up phases ([`super::table::Transport::setup`]) and makes the
//! links it carries ([`super::table::Transport::connect`]). A refusal (e.g. /proc of the peer
//! not accessible) falls back to TCP with an INFO line, unless `OXCCL_TRANSPORT=shm` demands
//! shared memory (or `OXCCL_NET=ofi` libfabric), which makes it an error, as does a peer on
//! another host under `OXCCL_TRANSPORT=shm`.
//!
//! The handshake runs in phases over all new connections at once (send every offer, read every
//! offer, then each row's phases in table order): every read waits only for bytes the peer
//! sends before its own first read of that phase, so ranks building several links in different
//! orders cannot wait on each other in a cycle.

use super::shm::Segment;
use super::table::{self, Kind};
use super::Link;
use crate::bootstrap::net::IfAddr;
use crate::config::{Config, TransportMode};
use crate::error::{Error, Result};
use crate::net::wire::{self, Reader, Writer};
use std::net::TcpStream;
use std::time::Instant;

/// The transport mode `cfg` asks for, or `ncclInvalidArgument` for an unknown value.
pub fn mode_of(cfg: &Config) -> Result<TransportMode> {
    cfg.transport.clone().map_err(Error::invalid_argument)
}

const OFFER: u8 = b'O';
/// 4: the libfabric hello lists one endpoint per rail pair.
const VERSION: u8 = 4;
/// Offer frame: OFFER, VERSION, shm wanted, sockets wanted (u8), stripe in KiB (u32 LE), then
/// the rail list ([`super::rails::encode`]).
const OFFER_LEN: usize = 8;
/// Longest handshake frame.
pub(crate) const MAX_FRAME: usize = 4096;

/// What every row's set-up knows about this rank.
pub struct Setup<'a> {
    /// This rank.
    pub me: usize,
    /// Its settings.
    pub cfg: &'a Config,
    /// `OXCCL_TRANSPORT`.
    pub mode: TransportMode,
    /// Every rank's host identity.
    pub hosts: &'a [String],
    /// When the handshake gives up.
    pub deadline: Instant,
    /// This rank's rails ([`super::rails::local`]).
    pub rails: Vec<IfAddr>,
    /// Every rank's bootstrap (data listener) address, indexed by rank; empty where unknown.
    pub homes: Vec<std::net::IpAddr>,
}

/// One new connection going through the handshake; each row reads and writes its own fields.
pub struct Handshake {
    /// The peer.
    pub peer: usize,
    /// The authenticated connection.
    pub sock: TcpStream,
    /// Shared memory still wanted by both ends, and its segment once made ([`super::shm::setup`]).
    pub shm: bool,
    pub seg: Option<Segment>,
    /// Why the transport picked for the peer was not made (the INFO line of the TCP link).
    pub why_not: Option<String>,
    /// The TCP fields ([`super::tcp::setup`]).
    pub tcp: super::tcp::setup::Fields,
    /// Whether the table picked libfabric for this peer, and its handshake ([`super::ofi::setup`]).
    pub ofi: bool,
    pub half: Option<super::ofi::Half>,
    /// The connection's keys (a TCP link under `OXCCL_WIRE_INTEGRITY` seals with them).
    pub keys: crate::bootstrap::auth::Keys,
}

/// Turns freshly authenticated connections `(peer, stream)` of rank `me` into links, choosing
/// each one's transport (see the module docs). `hosts` is every rank's host identity. Clones
/// of the extra sockets of striped TCP links are added to `extra_socks` (so that an abort can
/// shut them). `homes` is every rank's bootstrap address ([`Setup::homes`]).
pub fn build(
    me: usize,
    conns: Vec<(usize, crate::bootstrap::Conn)>,
    hosts: &[String],
    homes: Vec<std::net::IpAddr>,
    cfg: &Config,
    deadline: Instant,
    extra_socks: &mut Vec<TcpStream>,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    if conns.is_empty() {
        return Ok(Vec::new());
    }
    let mode = mode_of(cfg)?;
    super::ofi::integrity_check(me, cfg)?;
    let cx = Setup { me, cfg, mode, hosts, deadline, rails: super::rails::local(cfg), homes };
    let mut ps = send_offers(&cx, conns)?;
    read_offers(&cx, &mut ps)?;
    for row in &table::TRANSPORTS {
        (row.setup)(&cx, &mut ps)?;
    }
    for p in &mut ps {
        extra_socks.extend(p.tcp.extra.iter().filter_map(|s| s.try_clone().ok()));
    }
    ps.into_iter()
        .map(|mut p| {
            let kind = settle(&cx, &mut p)?;
            let peer = p.peer;
            Ok((peer, (table::row(kind).connect)(&cx, p)?))
        })
        .collect()
}

/// Phase 1a: asks the table for each peer's transport and sends the offers.
fn send_offers(cx: &Setup, conns: Vec<(usize, crate::bootstrap::Conn)>) -> Result<Vec<Handshake>> {
    let (me, hosts) = (cx.me, cx.hosts);
    let mut ps = Vec::with_capacity(conns.len());
    for (peer, c) in conns {
        let same = hosts.get(peer).is_some_and(|h| *h == hosts[me]);
        let kind = table::pick(cx.cfg, &table::Peer { same_host: same, in_process: false }).kind;
        let mut p = Handshake {
            peer,
            sock: c.stream,
            keys: c.keys,
            shm: kind == Kind::Shm,
            seg: None,
            why_not: None,
            tcp: super::tcp::setup::Fields::new(cx.cfg.socket_stripe),
            ofi: kind == Kind::Ofi,
            half: None,
        };
        let offer = offer_frame(p.shm, p.ofi, cx.cfg.nsocks, cx.cfg.socket_stripe, &cx.rails);
        wire::write_frame(&mut p.sock, &offer)?;
        if !same && cx.mode == TransportMode::Shm {
            return Err(Error::invalid_usage(format!(
                "rank {me}: {}=shm, but rank {peer} is on host {} and this rank on {}",
                crate::log::var_name("TRANSPORT"),
                hosts.get(peer).map(String::as_str).unwrap_or("?"),
                hosts[me]
            )));
        }
        ps.push(p);
    }
    Ok(ps)
}

/// Phase 1b: reads the peers' offers; the TCP fields take the smaller of both ends' values.
fn read_offers(cx: &Setup, ps: &mut [Handshake]) -> Result<()> {
    for p in ps {
        let f = wire::read_frame(&mut p.sock, MAX_FRAME, cx.deadline)
            .map_err(|e| e.context(format!("rank {}: transport handshake with rank {}", cx.me, p.peer)))?;
        if f.len() < OFFER_LEN || f[0] != OFFER || f[1] != VERSION {
            return Err(Error::remote(format!("rank {}: malformed transport offer (another oxccl version?)", p.peer)));
        }
        let mut r = Reader::new(&f[OFFER_LEN..]);
        p.tcp.peer_rails = super::rails::decode(&mut r)
            .and_then(|l| r.finish().map(|_| l))
            .map_err(|e| e.context(format!("rank {}: transport offer", p.peer)))?;
        p.tcp.nsocks = cx.cfg.nsocks.min(f[3].max(1) as usize);
        let theirs = u32::from_le_bytes([f[4], f[5], f[6], f[7]]) as usize * 1024;
        p.tcp.stripe = cx.cfg.socket_stripe.min(theirs).max(super::tcp::MIN_STRIPE);
        if p.shm && f[2] & 1 == 0 {
            p.shm = false;
            p.why_not = Some("the peer did not offer shared memory (OXCCL_TRANSPORT=tcp there?)".into());
        }
        if p.ofi && f[2] & 2 == 0 {
            p.why_not = Some("the peer did not offer OFI (OXCCL_NET=socket there, or no fabric?)".into());
        }
    }
    Ok(())
}

/// The offer: byte 2 holds 1 for shared memory and 2 for libfabric; the rails follow.
fn offer_frame(shm: bool, ofi: bool, nsocks: usize, stripe: usize, rails: &[IfAddr]) -> Vec<u8> {
    let kib = ((stripe >> 10) as u32).to_le_bytes();
    let want = u8::from(shm) | (u8::from(ofi) << 1);
    let mut w = Writer::default();
    w.bytes(&[OFFER, VERSION, want, nsocks.min(super::tcp::MAX_SOCKS) as u8, kib[0], kib[1], kib[2], kib[3]]);
    super::rails::encode(rails, &mut w);
    w.0
}

/// The row that makes the link of `p` after every set-up ran: libfabric where both ends
/// agreed, shared memory where the segment is mapped, else TCP; or the error of
/// `OXCCL_NET=ofi` when libfabric was picked and failed.
fn settle(cx: &Setup, p: &mut Handshake) -> Result<Kind> {
    if p.half.as_ref().is_some_and(|h| h.ok()) {
        return Ok(Kind::Ofi);
    }
    if let Some(h) = p.half.take() {
        p.why_not = h.why_not;
    }
    if p.ofi && super::ofi::forced(cx.cfg) {
        return Err(super::ofi::unavailable(cx.me, p.peer, &p.why_not.take().unwrap_or_default()));
    }
    Ok(if p.shm && p.seg.is_some() { Kind::Shm } else { Kind::Tcp })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::setup::{parse_descriptor, FAILED, OK};
    use std::net::TcpListener;
    use std::time::Duration;

    /// A connected pair of blocking loopback streams.
    fn streams() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    /// Rank 0 runs `build` against a hand-played rank 1 on the same host; returns rank 0's link.
    fn against(peer: impl FnOnce(&mut TcpStream) + Send) -> Box<dyn Link> {
        // The defaults (transport auto, one socket), whatever the environment says.
        let cfg = crate::config::Config::default();
        let (a, mut b) = streams();
        let hosts = vec!["h".to_string(), "h".to_string()];
        let deadline = Instant::now() + Duration::from_secs(10);
        std::thread::scope(|s| {
            s.spawn(move || peer(&mut b));
            let keys = crate::bootstrap::auth::Keys { send: [0; 32], recv: [0; 32] };
            let conn = crate::bootstrap::Conn { stream: a, keys };
            let mut links = build(0, vec![(1, conn)], &hosts, Vec::new(), &cfg, deadline, &mut Vec::new()).unwrap();
            links.pop().unwrap().1
        })
    }

    fn offer(s: &mut TcpStream, shm: bool) {
        wire::write_frame(s, &offer_frame(shm, false, 1, super::super::tcp::MIN_STRIPE, &[])).unwrap();
        let theirs = wire::read_frame(s, MAX_FRAME, Instant::now() + Duration::from_secs(10)).unwrap();
        assert_eq!(theirs[..3], [OFFER, VERSION, 1], "same host: rank 0 offers shared memory");
    }

    #[test]
    fn a_peer_that_cannot_map_the_segment_gets_tcp() {
        let link = against(|s| {
            offer(s, true);
            let d = wire::read_frame(s, MAX_FRAME, Instant::now() + Duration::from_secs(10)).unwrap();
            assert!(parse_descriptor(&d).unwrap().is_some(), "rank 0 sent a descriptor");
            let mut w = Writer::default();
            w.bytes(&[FAILED]).str("refused for the test");
            wire::write_frame(s, &w.0).unwrap();
        });
        assert!(!link.describe().contains("shared memory"), "{}", link.describe());
    }

    #[test]
    fn a_peer_that_does_not_offer_gets_tcp_and_one_that_maps_gets_shm() {
        let link = against(|s| offer(s, false));
        assert!(!link.describe().contains("shared memory"), "{}", link.describe());
        let link = against(|s| {
            offer(s, true);
            let d = wire::read_frame(s, MAX_FRAME, Instant::now() + Duration::from_secs(10)).unwrap();
            let seg = Segment::open(&parse_descriptor(&d).unwrap().unwrap()).unwrap();
            assert!(seg.capacity() >= 4096);
            wire::write_frame(s, &[OK]).unwrap();
        });
        assert!(link.describe().contains("shared memory"), "{}", link.describe());
    }
}
