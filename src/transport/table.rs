//! The transports as a table tried in order, after NCCL's list of `ncclTransport`s: the first
//! row whose `can_connect` accepts a peer is the transport of the link to it.
//!
//! Each row also owns its part of the phased handshake of [`super::select::build`] (NCCL's
//! `setup` and `connect`): `setup` runs the row's phases over every new connection (each row
//! takes the ones it carries) and `connect` makes the link of one whose set-up came through.
//! The peer's offer, or a failed set-up, can still turn a shared-memory or libfabric choice
//! into TCP there. In-memory links come from [`super::mem::mesh`] instead, when a
//! communicator's ranks are threads of one process.

use super::select::{Handshake, Setup};
use super::Link;
use crate::config::{Config, TransportMode};
use crate::error::{Error, Result};

/// A kind of link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Ranks that are threads of one process ([`super::mem`]).
    Mem,
    /// Ranks on one host ([`super::shm`]).
    Shm,
    /// libfabric between hosts ([`super::ofi`]), where `OXCCL_NET` asks for it.
    Ofi,
    /// Anything else ([`super::tcp`], [`super::tcp_threads`]).
    Tcp,
}

/// What the choice of transport knows about a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Whether the peer's host identity ([`crate::bootstrap::host_id`]: hostname, boot id and
    /// network namespace, or `OXCCL_HOSTID`) equals this rank's.
    pub same_host: bool,
    /// Whether the peer is a thread of this process.
    pub in_process: bool,
}

/// One row of [`TRANSPORTS`].
#[derive(Debug)]
pub struct Transport {
    /// The link it makes.
    pub kind: Kind,
    /// Its name in log lines.
    pub name: &'static str,
    /// Whether it can carry the link to a peer, under the settings `cfg`.
    pub can_connect: fn(cfg: &Config, peer: &Peer) -> bool,
    /// Its set-up phases, run over every connection of the handshake; it acts on the ones it
    /// carries. The rows run in table order, the same on every rank.
    pub setup: fn(cx: &Setup, ps: &mut [Handshake]) -> Result<()>,
    /// Makes the link of a handshake whose set-up it carried through.
    pub connect: fn(cx: &Setup, p: Handshake) -> Result<Box<dyn Link>>,
}

fn mem_can_connect(_: &Config, peer: &Peer) -> bool {
    peer.in_process
}

/// In-memory links are not made in the handshake: nothing to set up.
fn mem_setup(_: &Setup, _: &mut [Handshake]) -> Result<()> {
    Ok(())
}

/// In-memory links come from [`super::mem::mesh`], never from a handshake.
fn mem_connect(_: &Setup, p: Handshake) -> Result<Box<dyn Link>> {
    Err(Error::internal(format!(
        "rank {}: in-memory links are made by transport::mem::mesh, not the handshake",
        p.peer
    )))
}

/// Same host, and not turned off by `OXCCL_TRANSPORT=tcp`.
fn shm_can_connect(cfg: &Config, peer: &Peer) -> bool {
    !peer.in_process && peer.same_host && !matches!(cfg.transport, Ok(TransportMode::Tcp))
}

/// Not in this process, not taken by shared memory, and `OXCCL_NET` is `ofi`, or `auto` with a
/// real fabric present ([`super::ofi::wanted`]); never under `OXCCL_WIRE_INTEGRITY`, which
/// ofi links do not offer ([`super::ofi::integrity_check`]).
fn ofi_can_connect(cfg: &Config, peer: &Peer) -> bool {
    !peer.in_process && !cfg.wire_integrity && super::ofi::wanted(cfg)
}

fn tcp_can_connect(_: &Config, peer: &Peer) -> bool {
    !peer.in_process
}

/// The transports, in the order they are tried.
pub const TRANSPORTS: [Transport; 4] = [
    Transport {
        kind: Kind::Mem,
        name: "in-memory",
        can_connect: mem_can_connect,
        setup: mem_setup,
        connect: mem_connect,
    },
    Transport {
        kind: Kind::Shm,
        name: "shared memory",
        can_connect: shm_can_connect,
        setup: super::shm::setup::setup,
        connect: super::shm::setup::connect,
    },
    Transport {
        kind: Kind::Ofi,
        name: "OFI",
        can_connect: ofi_can_connect,
        setup: super::ofi::setup::setup,
        connect: super::ofi::setup::connect,
    },
    // Last: it also takes every peer whose shared-memory or libfabric set-up failed.
    Transport {
        kind: Kind::Tcp,
        name: "TCP",
        can_connect: tcp_can_connect,
        setup: super::tcp::setup::setup,
        connect: super::tcp::setup::connect,
    },
];

/// The row of `kind`.
pub fn row(kind: Kind) -> &'static Transport {
    TRANSPORTS.iter().find(|t| t.kind == kind).expect("every kind has a row")
}

/// The first row of [`TRANSPORTS`] that can connect to `peer` (every peer has one: TCP takes
/// whatever is not in-process).
pub fn pick(cfg: &Config, peer: &Peer) -> &'static Transport {
    TRANSPORTS.iter().find(|t| (t.can_connect)(cfg, peer)).expect("in-memory or TCP accepts every peer")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Config {
        let map: std::collections::HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(&move |k| map.get(k).cloned())
    }

    /// Host identities as `bootstrap::host_id` gives them (`OXCCL_HOSTID` fakes hosts).
    fn peer(my_host: &str, peer_host: &str, in_process: bool) -> Peer {
        Peer { same_host: my_host == peer_host, in_process }
    }

    #[test]
    fn the_table_picks_mem_then_shm_then_tcp() {
        let auto = cfg(&[]);
        assert_eq!(pick(&auto, &peer("h", "h", false)).kind, Kind::Shm, "one host");
        assert_eq!(pick(&auto, &peer("fake-a", "fake-b", false)).kind, Kind::Tcp, "two (fake) hosts");
        assert_eq!(pick(&auto, &peer("h", "h", true)).kind, Kind::Mem, "ranks as threads");
        assert_eq!(pick(&auto, &peer("a", "b", true)).kind, Kind::Mem, "threads, whatever the host ids");
        assert_eq!(TRANSPORTS.map(|t| t.name), ["in-memory", "shared memory", "OFI", "TCP"]);
    }

    #[test]
    fn ofi_takes_other_hosts_where_oxccl_net_asks_for_it() {
        let ofi = cfg(&[("OXCCL_NET", "ofi")]);
        assert_eq!(pick(&ofi, &peer("a", "b", false)).kind, Kind::Ofi, "another host");
        assert_eq!(pick(&ofi, &peer("h", "h", false)).kind, Kind::Shm, "the same host keeps shared memory");
        assert_eq!(pick(&ofi, &peer("a", "b", true)).kind, Kind::Mem);
        let both = cfg(&[("OXCCL_NET", "ofi"), ("OXCCL_TRANSPORT", "tcp")]);
        assert_eq!(pick(&both, &peer("h", "h", false)).kind, Kind::Ofi, "shared memory off: the network");
        let socket = cfg(&[("NCCL_NET", "Socket")]);
        assert_eq!(pick(&socket, &peer("a", "b", false)).kind, Kind::Tcp);
        // auto: only a real fabric (never tcp;ofi_rxm, which is all this machine may have).
        let auto = cfg(&[("OXCCL_OFI_PROVIDER", "tcp;ofi_rxm")]);
        assert_eq!(pick(&auto, &peer("a", "b", false)).kind, Kind::Tcp);
        // Integrity: TCP links only (with OXCCL_NET=ofi, building links fails by name).
        let sealed = cfg(&[("OXCCL_NET", "ofi"), ("OXCCL_WIRE_INTEGRITY", "1")]);
        assert_eq!(pick(&sealed, &peer("a", "b", false)).kind, Kind::Tcp);
        let e = super::super::ofi::integrity_check(3, &sealed).expect_err("never a silent downgrade");
        assert!(e.message().starts_with("rank 3: ") && e.message().contains("not offered over libfabric"), "{e}");
        let socket = cfg(&[("OXCCL_NET", "socket"), ("OXCCL_WIRE_INTEGRITY", "1")]);
        assert!(super::super::ofi::integrity_check(3, &socket).is_ok());
    }

    #[test]
    fn the_table_honours_the_settings_that_turn_shm_off() {
        for off in [&[("OXCCL_TRANSPORT", "tcp")][..], &[("NCCL_TRANSPORT", "socket")], &[("OXCCL_TRANSPORT", "TCP")]] {
            let c = cfg(off);
            assert_eq!(pick(&c, &peer("h", "h", false)).kind, Kind::Tcp, "{off:?}");
            assert_eq!(pick(&c, &peer("h", "h", true)).kind, Kind::Mem, "{off:?}: threads stay in memory");
        }
        for on in [&[("OXCCL_TRANSPORT", "shm")][..], &[("OXCCL_TRANSPORT", "auto")], &[("OXCCL_TRANSPORT", "")]] {
            assert_eq!(pick(&cfg(on), &peer("h", "h", false)).kind, Kind::Shm, "{on:?}");
        }
    }
}
