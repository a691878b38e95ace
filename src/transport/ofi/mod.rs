//! The libfabric (OFI) transport between hosts: one code path for InfiniBand/RoCE
//! (`verbs;ofi_rxm`), AWS EFA (`efa`), Slingshot (`cxi`) and, where there is no RDMA NIC,
//! libfabric's TCP providers (`tcp;ofi_rxm`, `tcp`), which is how it is tested.
//!
//! `OXCCL_NET` (`NCCL_NET`) chooses: `auto` (default) takes this transport for peers on other
//! hosts only where libfabric offers a provider of a real fabric ([`REAL_FABRICS`]), `ofi`
//! forces it (an error where it cannot be used), `socket` never uses it. `OXCCL_OFI_PROVIDER`,
//! else `FI_PROVIDER`, names the provider. Peers on the same host keep shared memory.
//!
//! libfabric is optional twice over: build.rs compiles the C shim (`shim.c`, the `oxccl_ofi`
//! cfg) only where its headers exist, and the shim loads `libfabric.so.1` at run time, so the
//! library never depends on it. Without either, `OXCCL_NET=ofi` is a clear error and `auto`
//! quietly uses sockets.
//!
//! Links are made in the transport handshake ([`crate::transport::select`]): each end takes
//! the process's endpoint for the NIC of the authenticated connection ([`rail::Rail`], opened
//! on first use, bound to the address that `OXCCL_SOCKET_IFNAME` or the bootstrap chose, and
//! shared by every peer), and sends over that connection its endpoint's name, chunk, depth and
//! a random tag prefix for what it will receive; each inserts the other's address and
//! confirms; the link itself is [`link::OfiLink`].

#[cfg(oxccl_ofi)]
pub mod endpoint;
#[cfg(oxccl_ofi)]
pub mod link;
#[cfg(oxccl_ofi)]
mod peer;
#[cfg(oxccl_ofi)]
mod probe;
#[cfg(oxccl_ofi)]
pub mod rail;
pub mod setup;
#[cfg(oxccl_ofi)]
mod sys;

use crate::config::{Config, NetMode};
use crate::error::{Error, Result};
use crate::net::wire::{self, Reader, Writer};
use crate::transport::Link;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Providers of real fabrics: where `OXCCL_NET=auto` takes this transport.
pub const REAL_FABRICS: [&str; 5] = ["verbs", "efa", "cxi", "psm3", "opx"];

/// Whether `provider` (e.g. `verbs;ofi_rxm`) runs over one of [`REAL_FABRICS`].
pub fn is_real_fabric(provider: &str) -> bool {
    let core = provider.split(';').next().unwrap_or("");
    REAL_FABRICS.contains(&core)
}

/// Whether this build can use libfabric and it loaded; the reason otherwise.
pub fn loaded() -> std::result::Result<(), String> {
    #[cfg(oxccl_ofi)]
    {
        static LOADED: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
        LOADED
            .get_or_init(|| {
                let mut err = [0u8; 512];
                // SAFETY: `err` is writable for its length; the shim loads libfabric once.
                let rc = unsafe { sys::oxccl_ofi_load(err.as_mut_ptr().cast(), err.len()) };
                if rc == 0 {
                    Ok(())
                } else {
                    Err(format!("libfabric could not be loaded ({}): install libfabric1", sys::text(&err)))
                }
            })
            .clone()
    }
    #[cfg(not(oxccl_ofi))]
    Err("oxccl was built without libfabric: install libfabric-dev and rebuild".into())
}

/// The providers libfabric offers for tagged reliable datagrams (only `provider` when given),
/// in its order of preference.
pub fn providers(provider: Option<&str>) -> std::result::Result<Vec<String>, String> {
    loaded()?;
    #[cfg(oxccl_ofi)]
    {
        let prov = provider.map(|p| std::ffi::CString::new(p).unwrap_or_default());
        let mut out = vec![0u8; 4096];
        // SAFETY: the provider string is NUL-terminated and outlives the call; `out` is
        // writable for its length.
        let rc = unsafe {
            sys::oxccl_ofi_providers(
                prov.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if rc != 0 {
            return Err(format!("fi_getinfo: {}", sys::strerror(rc)));
        }
        Ok(sys::text(&out).lines().map(String::from).collect())
    }
    #[cfg(not(oxccl_ofi))]
    {
        let _ = provider;
        unreachable!("loaded() fails without libfabric")
    }
}

/// The provider `OXCCL_NET=auto` uses: the configured one if it is a real fabric, else
/// libfabric's first real-fabric provider; `None` (use sockets) without one. Probed once per
/// process and provider setting.
pub fn auto_provider(cfg: &Config) -> Option<String> {
    type Probes = Vec<(Option<String>, Option<String>)>;
    static PROBED: std::sync::Mutex<Probes> = std::sync::Mutex::new(Vec::new());
    let mut probed = crate::sync::lock(&PROBED);
    if let Some((_, found)) = probed.iter().find(|(k, _)| *k == cfg.ofi_provider) {
        return found.clone();
    }
    let found = providers(cfg.ofi_provider.as_deref()).ok().and_then(|ps| ps.into_iter().find(|p| is_real_fabric(p)));
    probed.push((cfg.ofi_provider.clone(), found.clone()));
    found
}

/// Whether the transport table may give a peer on another host this transport.
pub fn wanted(cfg: &Config) -> bool {
    match cfg.net {
        Ok(NetMode::Ofi) => true,
        Ok(NetMode::Auto) => auto_provider(cfg).is_some(),
        _ => false,
    }
}

/// Whether `OXCCL_NET=ofi` demands this transport.
pub fn forced(cfg: &Config) -> bool {
    matches!(cfg.net, Ok(NetMode::Ofi))
}

/// One of this process's libfabric endpoints (a rail): public facts only.
#[derive(Clone, Debug)]
pub struct EndpointInfo {
    /// The provider (`tcp;ofi_rxm`, ...).
    pub provider: String,
    /// The endpoint's address as peers insert it (for TCP providers an IP address and port).
    pub address: Vec<u8>,
    /// Messages that matched no link's receive and were dropped.
    pub discarded: u64,
    /// Links using the endpoint, closed ones that still wait for the provider included.
    pub links: usize,
}

/// The process's open libfabric endpoints (none without libfabric).
pub fn endpoints() -> Vec<EndpointInfo> {
    #[cfg(oxccl_ofi)]
    {
        rail::Rail::all()
            .iter()
            .map(|r| {
                let st = r.core.lock();
                EndpointInfo {
                    provider: r.provider.clone(),
                    address: r.addr.clone(),
                    discarded: st.discarded(),
                    links: st.peers.len(),
                }
            })
            .collect()
    }
    #[cfg(not(oxccl_ofi))]
    Vec::new()
}

/// A bare libfabric endpoint of its own, outside any communicator, that sends tagged messages
/// to any endpoint address: what any process that reaches the fabric can do. Tests use it to
/// play a stranger; only providers that need no memory registration (the TCP ones) work.
pub struct Probe {
    #[cfg(oxccl_ofi)]
    inner: probe::Inner,
}

impl Probe {
    /// Opens an endpoint of `provider` bound to the IP address `node`.
    pub fn open(provider: &str, node: &str) -> Result<Probe> {
        loaded().map_err(Error::system)?;
        #[cfg(oxccl_ofi)]
        return Ok(Probe { inner: probe::Inner::open(provider, node)? });
        #[cfg(not(oxccl_ofi))]
        {
            let _ = (provider, node);
            unreachable!("loaded() fails without libfabric")
        }
    }

    /// Sends each `(tag, payload)` to the endpoint at `to`; returns how many went.
    pub fn send_all(&mut self, to: &[u8], msgs: &mut dyn Iterator<Item = (u64, Vec<u8>)>) -> Result<usize> {
        #[cfg(oxccl_ofi)]
        return self.inner.send_all(to, msgs);
        #[cfg(not(oxccl_ofi))]
        {
            let _ = (to, msgs);
            unreachable!("a Probe cannot exist without libfabric")
        }
    }
}

/// `OXCCL_WIRE_INTEGRITY=1` with `OXCCL_NET=ofi`: an error, since ofi links carry no MAC
/// (never a silent downgrade); with `auto`, ofi is not taken and a WARN says so once.
pub fn integrity_check(me: usize, cfg: &Config) -> Result<()> {
    if !cfg.wire_integrity {
        return Ok(());
    }
    if forced(cfg) {
        return Err(Error::invalid_usage(format!(
            "rank {me}: {}=1 is not offered over libfabric links ({}=ofi): use {}=socket, or turn integrity off",
            crate::log::var_name("WIRE_INTEGRITY"),
            crate::log::var_name("NET"),
            crate::log::var_name("NET")
        )));
    }
    if matches!(cfg.net, Ok(NetMode::Auto)) && auto_provider(cfg).is_some() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            crate::warn!(
                "rank {me}: {}=1: links to other hosts use TCP with a MAC per chunk, not the libfabric fabric found (ofi links carry no MAC)",
                crate::log::var_name("WIRE_INTEGRITY")
            )
        });
    }
    Ok(())
}

const OK: u8 = 0;
const FAILED: u8 = 1;
const MAX_FRAME: usize = 4096;

/// One end of an ofi link going through the handshake.
pub struct Half {
    /// Per rail pair ([`Half::pairs`]): this end's endpoint on it, if it opened one.
    #[cfg(oxccl_ofi)]
    rails: Vec<Option<std::sync::Arc<rail::Rail>>>,
    /// The rails both ends opened: endpoint, peer address, and the pair's index.
    #[cfg(oxccl_ofi)]
    used: Vec<(std::sync::Arc<rail::Rail>, link::PeerAddr, usize)>,
    /// The tag prefix this end chose for what it receives, per rail pair.
    recv_prefix: Vec<u64>,
    /// The rail pairs ([`crate::transport::rails::pair`]); the first is the connection's.
    pairs: Vec<crate::transport::rails::Pair>,
    /// Whether this end is the lower rank of the pair (its addresses are `Pair::lower`).
    me_lower: bool,
    /// The used rails' measured rates (bytes/s, the slower direction), once measured
    /// ([`setup`]); equal shares without.
    weights: Option<Vec<f64>>,
    /// The credit connections of the used rails after the first (the pair's connection is the
    /// first's), made when the rails were measured ([`setup`]), in the link's order.
    socks: Vec<TcpStream>,
    /// The provider of this end's endpoint.
    pub provider: String,
    chunk: usize,
    depth: usize,
    /// Why the link is not made, once something failed at either end.
    pub why_not: Option<String>,
}

impl Half {
    /// Whether both ends have agreed so far.
    pub fn ok(&self) -> bool {
        self.why_not.is_none()
    }

    /// This end's and the peer's IP address of each rail the link uses (both ends opened one),
    /// in the link's order.
    fn rail_addrs(&self) -> Vec<(std::net::IpAddr, std::net::IpAddr)> {
        #[cfg(oxccl_ofi)]
        return self
            .used
            .iter()
            .map(|u| {
                let p = &self.pairs[u.2];
                if self.me_lower {
                    (p.lower.addr, p.higher.addr)
                } else {
                    (p.higher.addr, p.lower.addr)
                }
            })
            .collect();
        #[cfg(not(oxccl_ofi))]
        Vec::new()
    }
}

/// Opens this end's endpoints, one per rail pair of `pairs` (the first bound to the address of
/// `sock`, the pair's connection; the others to this end's address of their pair; the list is
/// the same at both ends, [`crate::transport::rails::pair`]), and writes their description to
/// the peer, or why it could not.
pub fn hello(
    cfg: &Config,
    sock: &mut TcpStream,
    pairs: Vec<crate::transport::rails::Pair>,
    me_lower: bool,
) -> Result<Half> {
    let mut h = Half {
        #[cfg(oxccl_ofi)]
        rails: Vec::new(),
        #[cfg(oxccl_ofi)]
        used: Vec::new(),
        recv_prefix: Vec::new(),
        pairs,
        me_lower,
        weights: None,
        socks: Vec::new(),
        provider: String::new(),
        chunk: cfg.ofi_chunk,
        depth: cfg.ofi_depth,
        why_not: None,
    };
    let mut w = Writer::default();
    match open(cfg, sock, &mut h) {
        Ok(addrs) => {
            w.bytes(&[OK]).u32(h.chunk as u32).u32(h.depth as u32).str(&h.provider);
            w.bytes(&[addrs.len() as u8]);
            for (addr, prefix) in addrs.iter().zip(&h.recv_prefix) {
                match addr {
                    Some(a) => w.bytes(&[OK]).u32(a.len() as u32).bytes(a).u32(*prefix as u32),
                    None => w.bytes(&[FAILED]),
                };
            }
        }
        Err(why) => {
            w.bytes(&[FAILED]).str(&why);
            h.why_not = Some(why);
        }
    }
    wire::write_frame(sock, &w.0)?;
    Ok(h)
}

/// Opens the endpoints; returns each rail pair's endpoint address (`None`: not opened here).
/// The first rail's must open; a further rail that cannot is left out (both ends then skip it).
fn open(cfg: &Config, sock: &TcpStream, h: &mut Half) -> std::result::Result<Vec<Option<Vec<u8>>>, String> {
    loaded()?;
    #[cfg(oxccl_ofi)]
    {
        let provider = match (&cfg.ofi_provider, &cfg.net) {
            (Some(p), _) => Some(p.clone()),
            (None, Ok(NetMode::Auto)) => auto_provider(cfg),
            (None, _) => None,
        };
        let ip = sock.local_addr().map_err(|e| format!("local_addr: {e}"))?.ip().to_string();
        let (first, bound) = match rail::Rail::get(provider.as_deref(), Some(&ip)) {
            Ok(r) => (r, true),
            Err(bound) => {
                // Providers not addressed by IP (efa, cxi, psm3, opx) take no source address.
                let r = rail::Rail::get(provider.as_deref(), None)
                    .map_err(|e| format!("{} (and bound to {ip}: {})", e.message(), bound.message()))?;
                crate::info!("libfabric: provider {} could not bind {ip} ({}); unbound", r.provider, bound.message());
                (r, false)
            }
        };
        h.provider = first.provider.clone();
        let mut rails = vec![Some(first)];
        for p in h.pairs.iter().skip(1) {
            let mine = if h.me_lower { &p.lower } else { &p.higher };
            // Unbound endpoints cannot be told apart by NIC: one rail only.
            let r = if bound {
                match rail::Rail::get(Some(&h.provider), Some(&mine.addr.to_string())) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        crate::info!(
                            "libfabric: no endpoint on {} {} ({}); that rail is left out",
                            mine.name,
                            mine.addr,
                            e.message()
                        );
                        None
                    }
                }
            } else {
                None
            };
            rails.push(r);
        }
        let mut addrs = Vec::with_capacity(rails.len());
        for r in &rails {
            h.recv_prefix.push(rail::new_prefix().map_err(|e| e.message().to_string())?);
            if let Some(r) = r {
                h.chunk = h.chunk.min(r.max_msg.max(4096));
            }
            addrs.push(r.as_ref().map(|r| r.addr.clone()));
        }
        h.rails = rails;
        Ok(addrs)
    }
    #[cfg(not(oxccl_ofi))]
    {
        let _ = (cfg, sock, h);
        unreachable!("loaded() fails without libfabric")
    }
}

/// Reads the peer's description, inserts its addresses (one per rail both ends opened), and
/// writes whether this end is ready.
pub fn meet(h: &mut Half, sock: &mut TcpStream, deadline: Instant) -> Result<()> {
    let f = wire::read_frame(sock, MAX_FRAME, deadline)?;
    let mut r = Reader::new(&f);
    let verdict: std::result::Result<(), String> = if r.bytes(1)? != [OK] {
        Err(format!("the peer could not open a libfabric endpoint: {}", r.str(MAX_FRAME).unwrap_or_default()))
    } else {
        let (chunk, depth) = (r.u32()? as usize, r.u32()? as usize);
        let provider = r.str(256)?;
        let n = r.bytes(1)?[0] as usize;
        let mut theirs = Vec::with_capacity(n);
        for _ in 0..n {
            theirs.push(if r.bytes(1)? == [OK] {
                let len = r.u32()? as usize;
                let addr = r.bytes(len)?.to_vec();
                Some((addr, u64::from(r.u32()?)))
            } else {
                None
            });
        }
        r.finish()?;
        h.chunk = h.chunk.min(chunk).max(4096);
        h.depth = h.depth.min(depth).max(1);
        if h.why_not.is_some() {
            Err(h.why_not.clone().unwrap_or_default())
        } else if provider != h.provider {
            Err(format!("the ends chose different providers ({} here, {provider} there)", h.provider))
        } else if n != h.pairs.len() || theirs.first().is_none_or(|t| t.is_none()) {
            Err(format!("the ends paired their rails differently ({} here, {n} there)", h.pairs.len()))
        } else {
            insert(h, &theirs)
        }
    };
    let mut w = Writer::default();
    match verdict {
        Ok(()) => {
            w.bytes(&[OK]);
        }
        Err(why) => {
            w.bytes(&[FAILED]).str(&why);
            h.why_not.get_or_insert(why);
        }
    }
    wire::write_frame(sock, &w.0)
}

/// Inserts the peer's address of every rail both ends opened.
fn insert(h: &mut Half, theirs: &[Option<(Vec<u8>, u64)>]) -> std::result::Result<(), String> {
    #[cfg(oxccl_ofi)]
    {
        for (i, (mine, theirs)) in h.rails.iter().zip(theirs).enumerate() {
            let (Some(rail), Some((addr, send_prefix))) = (mine, theirs) else { continue };
            let fi_addr = rail.core.lock().insert(addr).map_err(|e| e.message().to_string())?;
            let peer = link::PeerAddr {
                fi_addr,
                name: rail::hex(addr),
                send_prefix: *send_prefix,
                recv_prefix: h.recv_prefix[i],
            };
            h.used.push((rail.clone(), peer, i));
        }
        if h.used.first().is_none_or(|u| u.2 != 0) {
            return Err("no endpoint".into());
        }
        Ok(())
    }
    #[cfg(not(oxccl_ofi))]
    {
        let _ = (h, theirs);
        Err("built without libfabric".into())
    }
}

/// Reads whether the peer is ready too.
pub fn confirm(h: &mut Half, sock: &mut TcpStream, deadline: Instant) -> Result<()> {
    let f = wire::read_frame(sock, MAX_FRAME, deadline)?;
    let mut r = Reader::new(&f);
    if r.bytes(1)? != [OK] {
        let why = r.str(MAX_FRAME).unwrap_or_default();
        h.why_not.get_or_insert(format!("the peer is not ready: {why}"));
    }
    Ok(())
}

/// Rank `me`'s link to `peer` of a completed handshake (`h.ok()`), with `sock` (and, for
/// further rails, the connections they were measured on) kept for credits and end-of-file; `linger` bounds how long a dropped link waits for its sends; a rail that
/// makes no progress for `rail_timeout` is failed over (links with several).
/// Logs the link at INFO, naming every rail with its share where there are several.
pub fn link(
    me: usize,
    h: Half,
    sock: TcpStream,
    peer: usize,
    linger: Duration,
    rail_timeout: Duration,
) -> Result<Box<dyn Link>> {
    #[cfg(oxccl_ofi)]
    {
        use crate::transport::rails;
        if h.used.is_empty() {
            return Err(Error::internal("ofi link without an endpoint"));
        }
        let name = h.used[0].1.name.clone();
        let pairs: Vec<rails::Pair> = h.used.iter().map(|u| h.pairs[u.2].clone()).collect();
        let (weights, how) = match &h.weights {
            Some(w) if w.len() == pairs.len() => (w.clone(), "shares by measured rate"),
            _ => (vec![1.0; pairs.len()], "equal shares"),
        };
        if h.socks.len() + 1 != pairs.len() {
            return Err(Error::internal("an ofi link with several rails but not one credit connection each"));
        }
        let cycle = rails::cycle(1, &weights);
        let shares = rails::shares(&cycle, pairs.len());
        let list = if pairs.len() > 1 {
            format!(", {} rails ({}; {how})", pairs.len(), rails::describe(&pairs, h.me_lower, &shares))
        } else {
            String::new()
        };
        let used: Vec<(std::sync::Arc<rail::Rail>, link::PeerAddr)> =
            h.used.into_iter().map(|(r, a, _)| (r, a)).collect();
        let names = pairs
            .iter()
            .map(|p| {
                let (mine, theirs) = if h.me_lower { (&p.lower, &p.higher) } else { (&p.higher, &p.lower) };
                format!("{} {} -> {} {}", mine.name, mine.addr, theirs.name, theirs.addr)
            })
            .collect();
        let mut socks = vec![sock];
        socks.extend(h.socks);
        let depths = rail_depths(h.depth, &weights);
        let mut l = link::OfiLink::new(used, cycle, h.chunk, depths.clone(), socks, peer, linger)?;
        l.set_failover(me, names, rail_timeout);
        crate::info!(
            "rank {me}: rank {peer} via OFI ({}) at {name}{list}, messages of {} KiB, {} in flight per rail ({} KiB of staging), completions {}",
            h.provider,
            h.chunk >> 10,
            depths.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(" / "),
            (2 * h.chunk * depths.iter().sum::<usize>()) >> 10,
            if l.has_wait_fd() { "waited for on the provider's descriptor" } else { "polled every millisecond" }
        );
        Ok(Box::new(l))
    }
    #[cfg(not(oxccl_ofi))]
    {
        let _ = (me, h, sock, peer, linger, rail_timeout);
        Err(Error::internal("built without libfabric"))
    }
}

/// Each rail's depth (messages in flight each way) for a link of `depth` (`OXCCL_OFI_DEPTH`,
/// both ends' smaller) over rails of `weights` (measured rates, the same at both ends): a rail
/// gets `depth` times its rate over the slowest rail's, rounded, at most 4 times `depth` and 64,
/// so each rail's window covers about as long as the slowest one's; with equal rates,
/// `depth` each.
pub fn rail_depths(depth: usize, weights: &[f64]) -> Vec<usize> {
    let min = weights.iter().copied().filter(|w| *w > 0.0).fold(f64::INFINITY, f64::min);
    weights
        .iter()
        .map(|w| {
            let ratio = if min.is_finite() && *w > 0.0 { w / min } else { 1.0 };
            let d = (depth as f64 * ratio).round() as usize;
            d.clamp(depth, (4 * depth).clamp(depth, 64))
        })
        .collect()
}

/// The error for `OXCCL_NET=ofi` when this transport could not be made with `peer`.
pub fn unavailable(me: usize, peer: usize, why: &str) -> Error {
    Error::system(format!(
        "rank {me}: {}=ofi, but the libfabric link to rank {peer} failed: {why}",
        crate::log::var_name("NET")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_faster_rail_gets_a_deeper_window_in_proportion_within_bounds() {
        assert_eq!(rail_depths(4, &[1.0]), [4]);
        assert_eq!(rail_depths(4, &[5.0, 5.0]), [4, 4]);
        assert_eq!(rail_depths(4, &[1.0e8, 2.0e8]), [4, 8]);
        assert_eq!(rail_depths(4, &[3.0, 1.0, 1.5]), [12, 4, 6]);
        assert_eq!(rail_depths(4, &[1.0, 10.0]), [4, 16], "at most 4 times the depth");
        assert_eq!(rail_depths(32, &[1.0, 3.0]), [32, 64], "at most 64 (the resume's bitmask)");
        assert_eq!(rail_depths(4, &[0.0, 2.0]), [4, 4], "an unmeasured rail counts as the slowest");
        assert_eq!(rail_depths(4, &[0.0, 0.0]), [4, 4]);
    }

    #[test]
    fn real_fabrics_are_told_from_tcp() {
        for p in ["verbs;ofi_rxm", "efa", "cxi", "psm3", "verbs", "opx"] {
            assert!(is_real_fabric(p), "{p}");
        }
        for p in ["tcp;ofi_rxm", "tcp", "sockets", "udp;ofi_rxd", "shm", "net", ""] {
            assert!(!is_real_fabric(p), "{p}");
        }
    }
}
