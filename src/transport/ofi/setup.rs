//! The libfabric row of the transport table ([`crate::transport::table`]): its set-up phases
//! and the link it makes. Both ends pair their rails ([`rails::pair`]), open an endpoint per
//! rail and send their names ([`super::hello`]),
//! insert the other's ([`super::meet`]) and confirm ([`super::confirm`]); each phase writes
//! before it reads. A failure leaves the handshake to TCP, or fails it under `OXCCL_NET=ofi`
//! ([`crate::transport::select`] settles which).

use crate::error::{Error, Result};
use crate::transport::rails;
use crate::transport::select::{Handshake, Setup};
use crate::transport::Link;
use std::time::Duration;

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
    Ok(())
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
    super::link(cx.me, h, p.sock, p.peer, linger)
}
