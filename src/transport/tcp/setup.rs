//! The TCP row of the transport table ([`crate::transport::table`]): its fields of the
//! handshake, its set-up phases (pairing the rails, opening the extra sockets, measuring the
//! rails) and the link it makes. TCP also takes every peer whose shared-memory or libfabric
//! set-up failed.

use super::TcpLink;
use crate::bootstrap::net::IfAddr;
use crate::config::TransportMode;
use crate::error::{Error, Result};
use crate::net::wire::{self, Reader, Writer};
use crate::transport::rails;
use crate::transport::select::{Handshake, Setup};
use crate::transport::Link;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Frame that invites the extra sockets: port (u16 LE) and a random token.
const TOKEN_LEN: usize = 16;

/// A TCP link's fields of the handshake.
pub struct Fields {
    /// Sockets agreed (the smaller of both ends' `OXCCL_NSOCKS`, then per rail) and stripe.
    pub nsocks: usize,
    pub stripe: usize,
    /// The extra sockets (index 1..), once connected.
    pub extra: Vec<TcpStream>,
    /// Links with several rails: an idle spare connection per data socket on every other rail,
    /// `nsocks × (rails - 1)` ([`crate::transport::tcp_threads::spare_rail`]); failover moves a
    /// dead rail's sockets onto them ([`crate::transport::tcp_threads::RailPlan`]).
    pub spares: Vec<TcpStream>,
    /// Higher rank: the listeners (one per rail) and token for the extra sockets.
    invite: Option<(Vec<TcpListener>, [u8; TOKEN_LEN])>,
    /// The peer's rails, from its offer, and the link's rails ([`rails::pair`]).
    pub peer_rails: Vec<IfAddr>,
    pub pairs: Vec<rails::Pair>,
    /// Links with several rails: the stripe cycle from the rails' measured rates.
    cycle: Option<Vec<u8>>,
}

impl Fields {
    /// Before the offers: one socket, this end's stripe.
    pub fn new(stripe: usize) -> Fields {
        Fields {
            nsocks: 1,
            stripe,
            extra: Vec::new(),
            spares: Vec::new(),
            invite: None,
            peer_rails: Vec::new(),
            pairs: Vec::new(),
            cycle: None,
        }
    }
}

/// Whether handshake `p` ends as a TCP link: neither shared memory nor libfabric came up.
fn tcp_bound(p: &Handshake) -> bool {
    !p.shm && !p.half.as_ref().is_some_and(|h| h.ok())
}

/// The TCP row's set-up: pairs the rails of every link that ends as TCP, then opens the extra
/// sockets and measures the rails, each in phases over all peers at once.
pub fn setup(cx: &Setup, ps: &mut [Handshake]) -> Result<()> {
    for p in ps.iter_mut().filter(|p| tcp_bound(p)) {
        pair_rails(cx, p)?;
    }
    extra_sockets(cx.me, ps, cx.deadline)?;
    measure_rails(cx.me, ps, cx.deadline)
}

/// The TCP link of handshake `p` (sealed under `OXCCL_WIRE_INTEGRITY`), or the error of
/// `OXCCL_TRANSPORT=shm` when shared memory was wanted and failed.
pub fn connect(cx: &Setup, mut p: Handshake) -> Result<Box<dyn Link>> {
    let why = p.why_not.take().unwrap_or_else(|| format!("another host, or {}=tcp", crate::log::var_name("TRANSPORT")));
    if cx.mode == TransportMode::Shm {
        return Err(Error::system(format!(
            "rank {}: {}=shm, but shared memory with rank {} failed: {why}",
            cx.me,
            crate::log::var_name("TRANSPORT"),
            p.peer
        )));
    }
    let keys = p.keys.clone();
    let link = tcp_link(cx.me, cx.cfg, p, &why)?;
    if cx.cfg.wire_integrity {
        return Ok(Box::new(crate::transport::sealed::SealedLink::new(link, &keys)));
    }
    Ok(link)
}

/// Pairs the rails of a TCP link to `p` ([`rails::pair`]) and sets its socket count:
/// `nsocks` per rail, at most [`super::MAX_SOCKS`] in all. A link whose connection reached the
/// higher rank (the dialled one) elsewhere than at its bootstrap address was dialled over a
/// further rail because the bootstrap's did not answer ([`crate::bootstrap::connect_peer_until`]):
/// it keeps that rail alone (no striping or spares on the others), which both ends see alike.
fn pair_rails(cx: &Setup, p: &mut Handshake) -> Result<()> {
    let (me, cfg, mine) = (cx.me, cx.cfg, &cx.rails[..]);
    let local = p.sock.local_addr().map_err(|e| Error::from_io("local_addr", e))?.ip();
    let remote = p.sock.peer_addr().map_err(|e| Error::from_io("peer_addr", e))?.ip();
    rails::note_unused(cfg, local);
    let (higher, dialled_at) = if me < p.peer { (p.peer, remote) } else { (me, local) };
    let detour = cx.homes.get(higher).is_some_and(|&h| h != dialled_at);
    let (mut pairs, alone) = if me < p.peer {
        rails::pair(mine, &p.tcp.peer_rails, (local, remote))
    } else {
        rails::pair(&p.tcp.peer_rails, mine, (remote, local))
    };
    if detour && pairs.len() > 1 {
        crate::info!(
            "rank {me}: rank {}: link made on rail {} (the bootstrap's rail did not answer): that rail alone",
            p.peer,
            if me < p.peer { &pairs[0].lower.name } else { &pairs[0].higher.name }
        );
        pairs.truncate(1);
    }
    if !alone.is_empty() && !mine.is_empty() {
        crate::info!(
            "rank {me}: rank {}: no partner on the same subnet for {}",
            p.peer,
            alone.iter().map(|a| format!("{} {}", a.name, a.addr)).collect::<Vec<_>>().join(", ")
        );
    }
    let per_rail = p.tcp.nsocks.min(super::MAX_SOCKS / pairs.len()).max(1);
    p.tcp.nsocks = per_rail * pairs.len();
    p.tcp.pairs = pairs;
    Ok(())
}

/// Opens the extra sockets of TCP links with more than one, in phases like the rest of the
/// handshake: (5) the higher rank of each pair listens on a fresh port of each rail's address
/// and sends the ports and a random token on the authenticated connection; (6) the lower rank
/// connects `nsocks - 1` times, socket `s` from and to the addresses of rail `s mod rails`, and
/// sends the token and the socket's index on each; (7) the higher rank accepts them, dropping
/// connections without the token. A link with several rails also opens a spare connection
/// per data socket on every other rail the same way (indices `nsocks..rails × nsocks`, spare
/// `i - nsocks` on rail [`crate::transport::tcp_threads::spare_rail`]), for failover. Indices
/// travel as u16 (up to 64 × 8 connections). (The control channel's connections on every rail
/// are the channel's own, opened at creation: [`crate::control`].)
fn extra_sockets(me: usize, ps: &mut [Handshake], deadline: Instant) -> Result<()> {
    let striped = |p: &Handshake| tcp_bound(p) && p.tcp.nsocks > 1;
    for p in ps.iter_mut().filter(|p| striped(p) && me > p.peer) {
        let mut token = [0u8; TOKEN_LEN];
        crate::net::random_bytes(&mut token)?;
        let mut w = Writer::default();
        w.bytes(&token);
        let mut ls = Vec::new();
        for pair in &p.tcp.pairs {
            let l = TcpListener::bind((pair.higher.addr, 0))
                .map_err(|e| Error::from_io("binding the extra-socket listener", e))?;
            w.bytes(&l.local_addr().map_err(|e| Error::from_io("local_addr", e))?.port().to_le_bytes());
            ls.push(l);
        }
        wire::write_frame(&mut p.sock, &w.0)?;
        p.tcp.invite = Some((ls, token));
    }
    for p in ps.iter_mut().filter(|p| striped(p) && me < p.peer) {
        let rails = p.tcp.pairs.len();
        let f = wire::read_frame(&mut p.sock, TOKEN_LEN + 2 * rails, deadline)
            .map_err(|e| e.context(format!("rank {me}: extra sockets with rank {}", p.peer)))?;
        if f.len() != TOKEN_LEN + 2 * rails {
            return Err(Error::remote(format!("rank {}: malformed extra-socket invitation", p.peer)));
        }
        for i in 1..connections(p.tcp.nsocks, rails) {
            let r = rail_of(i, p.tcp.nsocks, rails);
            let (pair, at) = (&p.tcp.pairs[r], TOKEN_LEN + 2 * r);
            let addr = std::net::SocketAddr::new(pair.higher.addr, u16::from_le_bytes([f[at], f[at + 1]]));
            let mut s = if rails == 1 {
                super::connect_retry(addr, deadline)?
            } else {
                rails::connect_from(pair.lower.addr, addr, deadline)?
            };
            let mut w = Writer::default();
            w.bytes(&f[..TOKEN_LEN]).bytes(&(i as u16).to_le_bytes());
            wire::write_frame(&mut s, &w.0)?;
            if i < p.tcp.nsocks {
                p.tcp.extra.push(s);
            } else {
                p.tcp.spares.push(s);
            }
        }
    }
    for p in ps.iter_mut().filter(|p| striped(p) && me > p.peer) {
        let (ls, token) = p.tcp.invite.take().expect("invited in phase 5");
        let (nsocks, all) = (p.tcp.nsocks, connections(p.tcp.nsocks, ls.len()));
        let mut got: Vec<Option<TcpStream>> = (1..all).map(|_| None).collect();
        for (r, l) in ls.iter().enumerate() {
            let want = |i: usize| rail_of(i, nsocks, ls.len()) == r;
            while (1..all).any(|i| want(i) && got[i - 1].is_none()) {
                let mut s = super::accept_until(l, deadline, &|| false)
                    .map_err(|e| e.context(format!("rank {me}: extra sockets from rank {}", p.peer)))?;
                let Ok(f) = wire::read_frame(
                    &mut s,
                    TOKEN_LEN + 2,
                    Instant::now() + Duration::from_secs(5).min(deadline.saturating_duration_since(Instant::now())),
                ) else {
                    continue;
                };
                let idx = f.get(TOKEN_LEN..TOKEN_LEN + 2).map_or(0, |i| u16::from_le_bytes([i[0], i[1]]) as usize);
                if f.len() == TOKEN_LEN + 2
                    && f[..TOKEN_LEN] == token
                    && (1..all).contains(&idx)
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
        let mut got: Vec<TcpStream> = got.into_iter().map(|s| s.expect("all arrived")).collect();
        p.tcp.spares = got.split_off(nsocks - 1);
        p.tcp.extra = got;
    }
    Ok(())
}

/// Connections of a link with `nsocks` data sockets over `rails` rails: the data sockets, and
/// with several rails a spare per data socket on every other rail.
fn connections(nsocks: usize, rails: usize) -> usize {
    if rails > 1 {
        rails * nsocks
    } else {
        nsocks
    }
}

/// The rail of connection `i` (data socket `i < nsocks` on rail `i mod rails`, then the spares,
/// [`crate::transport::tcp_threads::spare_rail`]).
fn rail_of(i: usize, nsocks: usize, rails: usize) -> usize {
    if i < nsocks {
        i % rails
    } else {
        crate::transport::tcp_threads::spare_rail(i - nsocks, nsocks, rails)
    }
}

/// Measures the rails of every link with several ([`rails::probe`]), one peer at a time in
/// rank order (so no two ranks wait on each other in a cycle): both ends send their measured
/// rates on the authenticated connection, and both take each rail's weight as the smaller of
/// its two directions, so both build the same stripe cycle ([`rails::cycle`]).
fn measure_rails(me: usize, ps: &mut [Handshake], deadline: Instant) -> Result<()> {
    let mut order: Vec<usize> = (0..ps.len()).filter(|&i| tcp_bound(&ps[i]) && ps[i].tcp.pairs.len() > 1).collect();
    order.sort_by_key(|&i| ps[i].peer);
    for i in order {
        let p = &mut ps[i];
        let rails = p.tcp.pairs.len();
        let mut socks: Vec<&TcpStream> = vec![&p.sock];
        socks.extend(p.tcp.extra.iter().take(rails - 1));
        let ctx = |e: Error| e.context(format!("rank {me}: measuring the rails to rank {}", p.peer));
        let mine = rails::probe(&socks, rails::PROBE, deadline).map_err(ctx)?;
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
        p.tcp.cycle = Some(rails::cycle(p.tcp.nsocks / rails, &weights));
    }
    Ok(())
}

/// The TCP link of handshake `p` (its sockets, stripe layout, rails and helper threads), with
/// its INFO line ending in `why` (why not shared memory).
fn tcp_link(me: usize, cfg: &crate::config::Config, mut p: Handshake, why: &str) -> Result<Box<dyn Link>> {
    // A link with several rails gets a helper thread per rail by default: one engine thread
    // waiting on one socket at a time leaves the other rails idle (docs/PERFORMANCE.md,
    // "Several NICs").
    let wanted = if cfg.nthreads == 0 && p.tcp.pairs.len() > 1 { p.tcp.pairs.len() } else { cfg.nthreads };
    let threads = wanted.min(1 + p.tcp.extra.len());
    let rails = if let Some(c) = &p.tcp.cycle {
        let shares = rails::shares(c, p.tcp.pairs.len());
        let pairs = rails::describe(&p.tcp.pairs, me < p.peer, &shares);
        format!("{} rails ({pairs}; shares by measured rate), ", p.tcp.pairs.len())
    } else {
        String::new()
    };
    let driver =
        if threads == 0 { "driven by the engine thread".to_string() } else { format!("{threads} helper thread(s)") };
    crate::info!("rank {me}: rank {} via TCP, {rails}{} socket(s), {driver} ({why})", p.peer, 1 + p.tcp.extra.len());
    // Messages about a link with several rails name them (this end's interfaces).
    let names: Vec<&str> =
        p.tcp.pairs.iter().map(|r| if me < p.peer { r.lower.name.as_str() } else { r.higher.name.as_str() }).collect();
    let names = (names.len() > 1).then(|| names.join(", "));
    let mut socks = vec![p.sock];
    socks.extend(p.tcp.extra);
    let layout = match &p.tcp.cycle {
        Some(c) => super::Layout::weighted(socks.len(), p.tcp.stripe, c)?,
        None => super::Layout::round_robin(socks.len(), p.tcp.stripe),
    };
    // Several rails (always with helper threads, above): a dead rail's sockets fail over.
    let plan = (p.tcp.pairs.len() > 1 && p.tcp.spares.len() == socks.len() * (p.tcp.pairs.len() - 1)).then(|| {
        crate::transport::tcp_threads::RailPlan {
            rails: p.tcp.pairs.len(),
            names: p
                .tcp
                .pairs
                .iter()
                .map(|r| if me < p.peer { r.lower.name.clone() } else { r.higher.name.clone() })
                .collect(),
            spares: std::mem::take(&mut p.tcp.spares),
            timeout: cfg.rail_timeout,
            me,
        }
    });
    Ok(if threads > 0 {
        let linger = cfg.timeout.min(Duration::from_secs(30));
        let l =
            crate::transport::tcp_threads::ThreadedTcpLink::with_rails(socks, layout, p.peer, threads, linger, plan)?;
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
