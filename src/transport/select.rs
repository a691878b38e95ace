//! Choosing the transport of each peer: shared memory for ranks on the same host, TCP otherwise.
//!
//! Every pair first gets an authenticated TCP connection (bootstrap). On it both ends then
//! *offer* shared memory when the transport table ([`super::table`]) picks it: the peer's host
//! identity (hostname + boot id + network namespace, or `OXCCL_HOSTID`) equals theirs and
//! `OXCCL_TRANSPORT` is not `tcp`. When both offer, the lower rank creates
//! the segment and sends its [`Descriptor`]; the higher rank maps it and answers ok or why not.
//! A refusal (e.g. /proc of the peer not accessible) falls back to TCP with an INFO line,
//! unless `OXCCL_TRANSPORT=shm` demands shared memory, which makes it an error, as does a peer
//! on another host.
//!
//! The handshake runs in phases over all new connections at once (send every offer, read every
//! offer, send every descriptor, answer every descriptor, read every answer): every read waits
//! only for bytes the peer sends before its own first read of that phase, so ranks building
//! several links in different orders cannot wait on each other in a cycle.

use super::shm::{Descriptor, Segment, ShmLink, COOKIE_LEN};
use super::table;
use super::tcp::TcpLink;
use super::Link;
use crate::error::{Error, Result};
use crate::net::wire::{self, Reader, Writer};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::config::TransportMode;

/// The transport mode `cfg` asks for, or `ncclInvalidArgument` for an unknown value.
pub fn mode_of(cfg: &crate::config::Config) -> Result<TransportMode> {
    cfg.transport.clone().map_err(Error::invalid_argument)
}

const OFFER: u8 = b'O';
const VERSION: u8 = 3;
/// Offer frame: OFFER, VERSION, shm wanted, sockets wanted (u8), stripe in KiB (u32 LE), then
/// the rail list ([`super::rails::encode`]).
const OFFER_LEN: usize = 8;
/// Frame that invites the extra sockets: port (u16 LE) and a random token.
const TOKEN_LEN: usize = 16;
const OK: u8 = 0;
const FAILED: u8 = 1;
const MAX_FRAME: usize = 4096;

/// One new connection going through the handshake.
struct Handshake {
    peer: usize,
    sock: TcpStream,
    shm: bool,
    seg: Option<Segment>,
    why_not: Option<String>,
    /// Sockets agreed for a TCP link (the smaller of both ends' `OXCCL_NSOCKS`) and stripe.
    nsocks: usize,
    stripe: usize,
    /// The extra sockets (index 1..), once connected.
    extra: Vec<TcpStream>,
    /// Higher rank: the listeners (one per rail) and token for the extra sockets.
    invite: Option<(Vec<TcpListener>, [u8; TOKEN_LEN])>,
    /// The peer's rails, from its offer, and the link's rails ([`super::rails::pair`]).
    peer_rails: Vec<crate::bootstrap::net::IfAddr>,
    pairs: Vec<super::rails::Pair>,
    /// Links with several rails: the stripe cycle from the rails' measured rates.
    cycle: Option<Vec<u8>>,
    /// Whether the table picked libfabric for this peer ([`super::ofi`]), and its handshake.
    ofi: bool,
    half: Option<super::ofi::Half>,
    /// The connection's keys (a TCP link under `OXCCL_WIRE_INTEGRITY` seals with them).
    keys: crate::bootstrap::auth::Keys,
}

/// Turns freshly authenticated connections `(peer, stream)` of rank `me` into links, choosing
/// each one's transport (see the module docs). `hosts` is every rank's host identity. Clones
/// of the extra sockets of striped TCP links are added to `extra_socks` (so that an abort can
/// shut them).
pub fn build(
    me: usize,
    conns: Vec<(usize, crate::bootstrap::Conn)>,
    hosts: &[String],
    cfg: &crate::config::Config,
    deadline: Instant,
    extra_socks: &mut Vec<TcpStream>,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    if conns.is_empty() {
        return Ok(Vec::new());
    }
    let mode = mode_of(cfg)?;
    super::ofi::integrity_check(me, cfg)?;
    let (my_socks, my_stripe) = (cfg.nsocks, cfg.socket_stripe);
    let my_rails = super::rails::local(cfg);
    let mut ps: Vec<Handshake> = conns
        .into_iter()
        .map(|(peer, c)| Handshake {
            peer,
            sock: c.stream,
            keys: c.keys,
            shm: false,
            seg: None,
            why_not: None,
            nsocks: 1,
            stripe: my_stripe,
            extra: Vec::new(),
            invite: None,
            peer_rails: Vec::new(),
            pairs: Vec::new(),
            cycle: None,
            ofi: false,
            half: None,
        })
        .collect();
    // 1. Offers.
    for p in &mut ps {
        let same = hosts.get(p.peer).is_some_and(|h| *h == hosts[me]);
        let kind = table::pick(cfg, &table::Peer { same_host: same, in_process: false }).kind;
        (p.shm, p.ofi) = (kind == table::Kind::Shm, kind == table::Kind::Ofi);
        wire::write_frame(&mut p.sock, &offer_frame(p.shm, p.ofi, my_socks, my_stripe, &my_rails))?;
        if !same && mode == TransportMode::Shm {
            return Err(Error::invalid_usage(format!(
                "rank {me}: {}=shm, but rank {} is on host {} and this rank on {}",
                crate::log::var_name("TRANSPORT"),
                p.peer,
                hosts.get(p.peer).map(String::as_str).unwrap_or("?"),
                hosts[me]
            )));
        }
    }
    for p in &mut ps {
        let f = wire::read_frame(&mut p.sock, MAX_FRAME, deadline)
            .map_err(|e| e.context(format!("rank {me}: transport handshake with rank {}", p.peer)))?;
        if f.len() < OFFER_LEN || f[0] != OFFER || f[1] != VERSION {
            return Err(Error::remote(format!("rank {}: malformed transport offer (another oxccl version?)", p.peer)));
        }
        let mut r = Reader::new(&f[OFFER_LEN..]);
        p.peer_rails = super::rails::decode(&mut r)
            .and_then(|l| r.finish().map(|_| l))
            .map_err(|e| e.context(format!("rank {}: transport offer", p.peer)))?;
        p.nsocks = my_socks.min(f[3].max(1) as usize);
        let theirs = u32::from_le_bytes([f[4], f[5], f[6], f[7]]) as usize * 1024;
        p.stripe = my_stripe.min(theirs).max(super::tcp::MIN_STRIPE);
        if p.shm && f[2] & 1 == 0 {
            p.shm = false;
            p.why_not = Some("the peer did not offer shared memory (OXCCL_TRANSPORT=tcp there?)".into());
        }
        if p.ofi && f[2] & 2 == 0 {
            p.why_not = Some("the peer did not offer OFI (OXCCL_NET=socket there, or no fabric?)".into());
        }
    }
    // 1b. libfabric endpoints: both ends open one and send its name, insert the other's, and
    // confirm (each phase writes before it reads, as above).
    let ofi = |p: &Handshake| p.ofi && p.why_not.is_none();
    for p in ps.iter_mut().filter(|p| ofi(p)) {
        p.half = Some(super::ofi::hello(cfg, &mut p.sock)?);
    }
    for p in ps.iter_mut().filter(|p| p.half.is_some()) {
        let h = p.half.as_mut().expect("filtered");
        super::ofi::meet(h, &mut p.sock, deadline)
            .map_err(|e| e.context(format!("rank {me}: libfabric setup with rank {}", p.peer)))?;
    }
    for p in ps.iter_mut().filter(|p| p.half.is_some()) {
        let h = p.half.as_mut().expect("filtered");
        super::ofi::confirm(h, &mut p.sock, deadline)
            .map_err(|e| e.context(format!("rank {me}: libfabric setup with rank {}", p.peer)))?;
    }
    // 2. The lower rank of each pair creates the segment.
    let here = crate::wait::ranks_here(hosts, me);
    let ring = cfg.shm_ring.unwrap_or_else(|| super::shm::default_ring(here, crate::wait::crowded(here)));
    for p in ps.iter_mut().filter(|p| p.shm && me < p.peer) {
        let mut w = Writer::default();
        match Segment::create(ring) {
            Ok((seg, d)) => {
                w.bytes(&[OK]).u32(d.pid).u32(d.fd).u64(d.len).bytes(&d.cookie);
                p.seg = Some(seg);
            }
            Err(e) => {
                w.bytes(&[FAILED]).str(e.message());
                p.shm = false;
                p.why_not = Some(format!("creating the segment failed: {}", e.message()));
            }
        }
        wire::write_frame(&mut p.sock, &w.0)?;
    }
    // 3. The higher rank maps it and answers.
    for p in ps.iter_mut().filter(|p| p.shm && me > p.peer) {
        let f = wire::read_frame(&mut p.sock, MAX_FRAME, deadline)
            .map_err(|e| e.context(format!("rank {me}: shared-memory setup with rank {}", p.peer)))?;
        let mut w = Writer::default();
        match parse_descriptor(&f).and_then(|d| d.map(|d| Segment::open(&d)).transpose()) {
            Ok(Some(seg)) => {
                w.bytes(&[OK]);
                p.seg = Some(seg);
            }
            Ok(None) => {
                p.shm = false;
                p.why_not = Some("the peer could not create a segment".into());
                continue;
            }
            Err(e) => {
                w.bytes(&[FAILED]).str(e.message());
                p.shm = false;
                p.why_not = Some(format!("mapping the peer's segment failed: {}", e.message()));
            }
        }
        wire::write_frame(&mut p.sock, &w.0)?;
    }
    // 4. The creator learns whether the peer mapped it; then nobody needs the descriptor.
    for p in ps.iter_mut().filter(|p| p.shm && me < p.peer) {
        let f = wire::read_frame(&mut p.sock, MAX_FRAME, deadline)
            .map_err(|e| e.context(format!("rank {me}: shared-memory setup with rank {}", p.peer)))?;
        let mut r = Reader::new(&f);
        if r.bytes(1)? != [OK] {
            p.shm = false;
            p.why_not = Some(format!("the peer could not map the segment: {}", r.str(MAX_FRAME).unwrap_or_default()));
            p.seg = None;
        } else if let Some(s) = p.seg.as_mut() {
            s.close_fd();
        }
    }
    // TCP links get rails (a libfabric link that came up has its own, `ofi::rail`).
    for p in ps.iter_mut().filter(|p| !p.shm && !p.half.as_ref().is_some_and(|h| h.ok())) {
        pair_rails(me, cfg, &my_rails, p)?;
    }
    extra_sockets(me, &mut ps, deadline)?;
    measure_rails(me, &mut ps, deadline)?;
    for p in &ps {
        extra_socks.extend(p.extra.iter().filter_map(|s| s.try_clone().ok()));
    }
    ps.into_iter().map(|p| finish(me, mode, cfg, p)).collect()
}

/// The offer: byte 2 holds 1 for shared memory and 2 for libfabric; the rails follow.
fn offer_frame(shm: bool, ofi: bool, nsocks: usize, stripe: usize, rails: &[crate::bootstrap::net::IfAddr]) -> Vec<u8> {
    let kib = ((stripe >> 10) as u32).to_le_bytes();
    let want = u8::from(shm) | (u8::from(ofi) << 1);
    let mut w = Writer::default();
    w.bytes(&[OFFER, VERSION, want, nsocks.min(super::tcp::MAX_SOCKS) as u8, kib[0], kib[1], kib[2], kib[3]]);
    super::rails::encode(rails, &mut w);
    w.0
}

/// Pairs the rails of a TCP link to `p` ([`super::rails::pair`]) and sets its socket count:
/// `nsocks` per rail, at most [`super::tcp::MAX_SOCKS`] in all.
fn pair_rails(
    me: usize,
    cfg: &crate::config::Config,
    mine: &[crate::bootstrap::net::IfAddr],
    p: &mut Handshake,
) -> Result<()> {
    let local = p.sock.local_addr().map_err(|e| Error::from_io("local_addr", e))?.ip();
    let remote = p.sock.peer_addr().map_err(|e| Error::from_io("peer_addr", e))?.ip();
    super::rails::note_unused(cfg, local);
    let (pairs, alone) = if me < p.peer {
        super::rails::pair(mine, &p.peer_rails, (local, remote))
    } else {
        super::rails::pair(&p.peer_rails, mine, (remote, local))
    };
    if !alone.is_empty() && !mine.is_empty() {
        crate::info!(
            "rank {me}: rank {}: no partner on the same subnet for {}",
            p.peer,
            alone.iter().map(|a| format!("{} {}", a.name, a.addr)).collect::<Vec<_>>().join(", ")
        );
    }
    let per_rail = p.nsocks.min(super::tcp::MAX_SOCKS / pairs.len()).max(1);
    p.nsocks = per_rail * pairs.len();
    p.pairs = pairs;
    Ok(())
}

/// Opens the extra sockets of TCP links with more than one, in phases like the rest of the
/// handshake: (5) the higher rank of each pair listens on a fresh port of each rail's address
/// and sends the ports and a random token on the authenticated connection; (6) the lower rank
/// connects `nsocks - 1` times, socket `s` from and to the addresses of rail `s mod rails`, and
/// sends the token and the socket's index on each; (7) the higher rank accepts them, dropping
/// connections without the token.
fn extra_sockets(me: usize, ps: &mut [Handshake], deadline: Instant) -> Result<()> {
    let striped = |p: &Handshake| !p.shm && p.nsocks > 1;
    for p in ps.iter_mut().filter(|p| striped(p) && me > p.peer) {
        let mut token = [0u8; TOKEN_LEN];
        crate::net::random_bytes(&mut token)?;
        let mut w = Writer::default();
        w.bytes(&token);
        let mut ls = Vec::new();
        for pair in &p.pairs {
            let l = TcpListener::bind((pair.higher.addr, 0))
                .map_err(|e| Error::from_io("binding the extra-socket listener", e))?;
            w.bytes(&l.local_addr().map_err(|e| Error::from_io("local_addr", e))?.port().to_le_bytes());
            ls.push(l);
        }
        wire::write_frame(&mut p.sock, &w.0)?;
        p.invite = Some((ls, token));
    }
    for p in ps.iter_mut().filter(|p| striped(p) && me < p.peer) {
        let rails = p.pairs.len();
        let f = wire::read_frame(&mut p.sock, TOKEN_LEN + 2 * rails, deadline)
            .map_err(|e| e.context(format!("rank {me}: extra sockets with rank {}", p.peer)))?;
        if f.len() != TOKEN_LEN + 2 * rails {
            return Err(Error::remote(format!("rank {}: malformed extra-socket invitation", p.peer)));
        }
        for i in 1..p.nsocks {
            let (pair, at) = (&p.pairs[i % rails], TOKEN_LEN + 2 * (i % rails));
            let addr = std::net::SocketAddr::new(pair.higher.addr, u16::from_le_bytes([f[at], f[at + 1]]));
            let mut s = if rails == 1 {
                super::tcp::connect_retry(addr, deadline)?
            } else {
                super::rails::connect_from(pair.lower.addr, addr, deadline)?
            };
            let mut w = Writer::default();
            w.bytes(&f[..TOKEN_LEN]).bytes(&[i as u8]);
            wire::write_frame(&mut s, &w.0)?;
            p.extra.push(s);
        }
    }
    for p in ps.iter_mut().filter(|p| striped(p) && me > p.peer) {
        let (ls, token) = p.invite.take().expect("invited in phase 5");
        let mut got: Vec<Option<TcpStream>> = (1..p.nsocks).map(|_| None).collect();
        for (r, l) in ls.iter().enumerate() {
            let want = |i: usize| i % ls.len() == r;
            while (1..p.nsocks).any(|i| want(i) && got[i - 1].is_none()) {
                let mut s = super::tcp::accept_until(l, deadline, &|| false)
                    .map_err(|e| e.context(format!("rank {me}: extra sockets from rank {}", p.peer)))?;
                let Ok(f) = wire::read_frame(
                    &mut s,
                    TOKEN_LEN + 1,
                    Instant::now() + Duration::from_secs(5).min(deadline.saturating_duration_since(Instant::now())),
                ) else {
                    continue;
                };
                let idx = f.get(TOKEN_LEN).map_or(0, |&i| i as usize);
                if f.len() == TOKEN_LEN + 1
                    && f[..TOKEN_LEN] == token
                    && (1..p.nsocks).contains(&idx)
                    && want(idx)
                    && got[idx - 1].is_none()
                {
                    got[idx - 1] = Some(s);
                } else {
                    crate::warn!(
                        "rank {me}: dropped a connection without the token on the extra-socket port for rank {}",
                        p.peer
                    );
                }
            }
        }
        p.extra = got.into_iter().map(|s| s.expect("all arrived")).collect();
    }
    Ok(())
}

/// Measures the rails of every link with several ([`super::rails::probe`]), one peer at a time in
/// rank order (so no two ranks wait on each other in a cycle): both ends send their measured
/// rates on the authenticated connection, and both take each rail's weight as the smaller of
/// its two directions, so both build the same stripe cycle ([`super::rails::cycle`]).
fn measure_rails(me: usize, ps: &mut [Handshake], deadline: Instant) -> Result<()> {
    let mut order: Vec<usize> = (0..ps.len()).filter(|&i| !ps[i].shm && ps[i].pairs.len() > 1).collect();
    order.sort_by_key(|&i| ps[i].peer);
    for i in order {
        let p = &mut ps[i];
        let rails = p.pairs.len();
        let mut socks: Vec<&TcpStream> = vec![&p.sock];
        socks.extend(p.extra.iter().take(rails - 1));
        let ctx = |e: Error| e.context(format!("rank {me}: measuring the rails to rank {}", p.peer));
        let mine = super::rails::probe(&socks, super::rails::PROBE, deadline).map_err(ctx)?;
        let mut w = Writer::default();
        for r in &mine {
            w.u64(r.to_bits());
        }
        wire::write_frame(&mut p.sock, &w.0)?;
        let f = wire::read_frame(&mut p.sock, 8 * rails, deadline).map_err(ctx)?;
        let mut rd = Reader::new(&f);
        let theirs: Vec<f64> = (0..rails).map(|_| rd.u64().map(f64::from_bits)).collect::<Result<_>>()?;
        rd.finish()?;
        let weights: Vec<f64> = mine.iter().zip(&theirs).map(|(a, b)| a.min(*b)).collect();
        p.cycle = Some(super::rails::cycle(p.nsocks / rails, &weights));
    }
    Ok(())
}

/// Parses the creator's message: `Some(descriptor)`, or `None` when it reports a failure.
fn parse_descriptor(f: &[u8]) -> Result<Option<Descriptor>> {
    let mut r = Reader::new(f);
    if r.bytes(1)? != [OK] {
        return Ok(None);
    }
    let (pid, fd, len) = (r.u32()?, r.u32()?, r.u64()?);
    let mut cookie = [0u8; COOKIE_LEN];
    cookie.copy_from_slice(r.bytes(COOKIE_LEN)?);
    r.finish()?;
    Ok(Some(Descriptor { pid, fd, len, cookie }))
}

fn finish(
    me: usize,
    mode: TransportMode,
    cfg: &crate::config::Config,
    mut p: Handshake,
) -> Result<(usize, Box<dyn Link>)> {
    if let Some(h) = p.half.take() {
        if h.ok() {
            let linger = cfg.timeout.min(Duration::from_secs(30));
            return Ok((p.peer, super::ofi::link(me, h, p.sock, p.peer, linger)?));
        }
        p.why_not = h.why_not;
    }
    if p.ofi && super::ofi::forced(cfg) {
        let why = p.why_not.unwrap_or_default();
        return Err(super::ofi::unavailable(me, p.peer, &why));
    }
    match p.seg {
        Some(seg) if p.shm => {
            crate::info!("rank {me}: rank {} via shared memory ({} KiB per direction)", p.peer, seg.capacity() >> 10);
            Ok((p.peer, Box::new(ShmLink::new(seg, me < p.peer, p.sock, p.peer)?)))
        }
        _ => {
            let why = p
                .why_not
                .take()
                .unwrap_or_else(|| format!("another host, or {}=tcp", crate::log::var_name("TRANSPORT")));
            if mode == TransportMode::Shm {
                return Err(Error::system(format!(
                    "rank {me}: {}=shm, but shared memory with rank {} failed: {why}",
                    crate::log::var_name("TRANSPORT"),
                    p.peer
                )));
            }
            let keys = p.keys.clone();
            let peer = p.peer;
            let link = tcp_link(me, cfg, p, &why)?;
            if cfg.wire_integrity {
                return Ok((peer, Box::new(super::sealed::SealedLink::new(link, &keys))));
            }
            Ok((peer, link))
        }
    }
}

/// The TCP link of handshake `p` (its sockets, stripe layout, rails and helper threads), with
/// its INFO line ending in `why` (why not shared memory).
fn tcp_link(me: usize, cfg: &crate::config::Config, p: Handshake, why: &str) -> Result<Box<dyn Link>> {
    // A link with several rails gets a helper thread per rail by default: one engine thread
    // waiting on one socket at a time leaves the other rails idle (docs/PERFORMANCE.md,
    // "Several NICs").
    let wanted = if cfg.nthreads == 0 && p.pairs.len() > 1 { p.pairs.len() } else { cfg.nthreads };
    let threads = wanted.min(1 + p.extra.len());
    let rails = if let Some(c) = &p.cycle {
        let shares = super::rails::shares(c, p.pairs.len());
        let pairs = super::rails::describe(&p.pairs, me < p.peer, &shares);
        format!("{} rails ({pairs}; shares by measured rate), ", p.pairs.len())
    } else {
        String::new()
    };
    let driver =
        if threads == 0 { "driven by the engine thread".to_string() } else { format!("{threads} helper thread(s)") };
    crate::info!("rank {me}: rank {} via TCP, {rails}{} socket(s), {driver} ({why})", p.peer, 1 + p.extra.len());
    // Messages about a link with several rails name them (this end's interfaces).
    let names: Vec<&str> =
        p.pairs.iter().map(|r| if me < p.peer { r.lower.name.as_str() } else { r.higher.name.as_str() }).collect();
    let names = (names.len() > 1).then(|| names.join(", "));
    let mut socks = vec![p.sock];
    socks.extend(p.extra);
    let layout = match &p.cycle {
        Some(c) => super::tcp::Layout::weighted(socks.len(), p.stripe, c)?,
        None => super::tcp::Layout::round_robin(socks.len(), p.stripe),
    };
    Ok(if threads > 0 {
        let linger = cfg.timeout.min(Duration::from_secs(30));
        let l = super::tcp_threads::ThreadedTcpLink::with_layout(socks, layout, p.peer, threads, linger)?;
        Box::new(match &names {
            Some(n) => l.over_rails(n),
            None => l,
        })
    } else {
        let l = TcpLink::with_layout(socks, layout, p.peer)?;
        Box::new(match &names {
            Some(n) => l.over_rails(n),
            None => l,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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
            let mut links = build(0, vec![(1, conn)], &hosts, &cfg, deadline, &mut Vec::new()).unwrap();
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
