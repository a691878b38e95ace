//! The libfabric row of the transport table ([`crate::transport::table`]): its set-up phases
//! and the link it makes. Both ends pair their rails ([`rails::pair`]), open an endpoint per
//! rail and send their names ([`super::hello`]),
//! insert the other's ([`super::meet`]) and confirm ([`super::confirm`]); each phase writes
//! before it reads; links with several rails then measure them (`measure`). A failure leaves the handshake to TCP, or fails it under `OXCCL_NET=ofi`
//! ([`crate::transport::select`] settles which).

use crate::error::{Error, Result};
use crate::net::wire::{self, Reader, Writer};
use crate::transport::rails;
use crate::transport::select::{Handshake, Setup};
use crate::transport::Link;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// The libfabric row's set-up over every handshake where both ends offered it.
pub fn setup(cx: &Setup, ps: &mut [Handshake]) -> Result<()> {
    let ctx =
        |me: usize, peer: usize| move |e: Error| e.context(format!("rank {me}: libfabric setup with rank {peer}"));
    for p in ps.iter_mut().filter(|p| p.ofi && p.why_not.is_none()) {
        let pairs = rail_pairs(cx, p)?;
        p.half = Some(super::hello(cx.cfg, &mut p.sock, pairs, cx.me < p.peer)?);
    }
    for p in ps.iter_mut().filter(|p| p.half.is_some()) {
        let h = p.half.as_mut().expect("filtered");
        super::meet(h, &mut p.sock, cx.deadline).map_err(ctx(cx.me, p.peer))?;
    }
    for p in ps.iter_mut().filter(|p| p.half.is_some()) {
        let h = p.half.as_mut().expect("filtered");
        super::confirm(h, &mut p.sock, cx.deadline).map_err(ctx(cx.me, p.peer))?;
    }
    measure(cx, ps)
}
/// Random bytes that admit a measuring connection.
const TOKEN_LEN: usize = 16;

/// Measures the rails of every libfabric link with several, one peer at a time in rank order
/// (so no two ranks wait on each other in a cycle), as TCP measures its own
/// ([`rails::probe`]): for each further rail the higher rank listens on its rail address and
/// sends the ports and a random token on the authenticated connection; the lower rank connects
/// from its rail address and sends the token; then both send [`rails::PROBE`] bytes each way on
/// the connection and these sockets at once, exchange their rates and take each rail's slower
/// direction as its weight (the rates are those of the interfaces' IP paths, which the
/// libfabric endpoints bound to the same addresses take). The link keeps these sockets as its
/// further rails' credit connections ([`super::link::OfiLink`]).
fn measure(cx: &Setup, ps: &mut [Handshake]) -> Result<()> {
    let several = |p: &Handshake| p.half.as_ref().is_some_and(|h| h.ok() && h.rail_addrs().len() > 1);
    let mut order: Vec<usize> = (0..ps.len()).filter(|&i| several(&ps[i])).collect();
    order.sort_by_key(|&i| ps[i].peer);
    for i in order {
        let p = &mut ps[i];
        let (me, peer) = (cx.me, p.peer);
        let ctx = |e: Error| e.context(format!("rank {me}: measuring the OFI rails to rank {peer}"));
        let addrs = p.half.as_ref().expect("filtered").rail_addrs();
        let extra = rail_sockets(me, peer, &mut p.sock, &addrs[1..], cx.deadline).map_err(ctx)?;
        let mut socks: Vec<&TcpStream> = vec![&p.sock];
        socks.extend(extra.iter());
        let mine = rails::probe(&socks, rails::PROBE, cx.deadline).map_err(ctx)?;
        let mut w = Writer::default();
        for r in &mine {
            w.u64(r.to_bits());
        }
        wire::write_frame(&mut p.sock, &w.0)?;
        let f = wire::read_frame(&mut p.sock, 8 * addrs.len(), cx.deadline).map_err(ctx)?;
        let mut rd = Reader::new(&f);
        let theirs: Vec<f64> = (0..addrs.len()).map(|_| rd.u64().map(f64::from_bits)).collect::<Result<_>>()?;
        rd.finish()?;
        let h = p.half.as_mut().expect("filtered");
        h.weights = Some(mine.iter().zip(&theirs).map(|(a, b)| a.min(*b)).collect());
        h.socks = extra;
    }
    Ok(())
}

/// One TCP connection per rail of `addrs` (this end's and the peer's address), between the
/// same addresses as the rail's endpoints; the invitation and token travel on `sock`.
fn rail_sockets(
    me: usize,
    peer: usize,
    sock: &mut TcpStream,
    addrs: &[(IpAddr, IpAddr)],
    deadline: Instant,
) -> Result<Vec<TcpStream>> {
    if me > peer {
        let mut token = [0u8; TOKEN_LEN];
        crate::net::random_bytes(&mut token)?;
        let mut w = Writer::default();
        w.bytes(&token);
        let mut ls = Vec::new();
        for (mine, _) in addrs {
            let l =
                TcpListener::bind((*mine, 0)).map_err(|e| Error::from_io("binding a rail's measuring listener", e))?;
            w.bytes(&l.local_addr().map_err(|e| Error::from_io("local_addr", e))?.port().to_le_bytes());
            ls.push(l);
        }
        wire::write_frame(sock, &w.0)?;
        let mut out = Vec::new();
        for l in &ls {
            loop {
                let mut s = crate::transport::tcp::accept_until(l, deadline, &|| false)?;
                let wait = Duration::from_secs(5).min(deadline.saturating_duration_since(Instant::now()));
                match wire::read_frame(&mut s, TOKEN_LEN, Instant::now() + wait) {
                    Ok(f) if f[..] == token[..] => break out.push(s),
                    _ => crate::warn!(
                        "rank {me}: dropped a connection without the token on a rail-measuring port for rank {peer}"
                    ),
                }
            }
        }
        Ok(out)
    } else {
        let f = wire::read_frame(sock, TOKEN_LEN + 2 * addrs.len(), deadline)?;
        if f.len() != TOKEN_LEN + 2 * addrs.len() {
            return Err(Error::remote(format!("rank {peer}: malformed rail-measuring invitation")));
        }
        let mut out = Vec::new();
        for (k, (mine, theirs)) in addrs.iter().enumerate() {
            let at = TOKEN_LEN + 2 * k;
            let to = SocketAddr::new(*theirs, u16::from_le_bytes([f[at], f[at + 1]]));
            let mut s = rails::connect_from(*mine, to, deadline)?;
            let mut w = Writer::default();
            w.bytes(&f[..TOKEN_LEN]);
            wire::write_frame(&mut s, &w.0)?;
            out.push(s);
        }
        Ok(out)
    }
}

/// The rails of the link to `p`, paired as TCP pairs them ([`rails::pair`], the same list at
/// both ends): the connection's addresses first, then one pair per further subnet both ends
/// have among their `OXCCL_SOCKET_IFNAME` rails.
fn rail_pairs(cx: &Setup, p: &Handshake) -> Result<Vec<rails::Pair>> {
    let local = p.sock.local_addr().map_err(|e| Error::from_io("local_addr", e))?.ip();
    let remote = p.sock.peer_addr().map_err(|e| Error::from_io("peer_addr", e))?.ip();
    let (pairs, alone) = if cx.me < p.peer {
        rails::pair(&cx.rails, &p.tcp.peer_rails, (local, remote))
    } else {
        rails::pair(&p.tcp.peer_rails, &cx.rails, (remote, local))
    };
    if !alone.is_empty() && !cx.rails.is_empty() {
        crate::info!(
            "rank {}: rank {}: no partner on the same subnet for {} (OFI)",
            cx.me,
            p.peer,
            alone.iter().map(|a| format!("{} {}", a.name, a.addr)).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(pairs)
}

/// The libfabric link of a handshake whose ends agreed.
pub fn connect(cx: &Setup, mut p: Handshake) -> Result<Box<dyn Link>> {
    let h = p.half.take().ok_or_else(|| Error::internal("an ofi link without its handshake"))?;
    let linger = cx.cfg.timeout.min(Duration::from_secs(30));
    super::link(cx.me, h, p.sock, p.peer, linger, cx.cfg.rail_timeout)
}
