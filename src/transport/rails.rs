//! Rails of a TCP link: the network interfaces (NICs) a link to a peer on another host uses.
//!
//! With `OXCCL_SOCKET_IFNAME` set, every interface that matches it and is up is a *rail* of
//! this rank (one address per interface, IPv4 first). Both ends send their rail list in the
//! transport offer, on the authenticated bootstrap connection, and both compute the same
//! pairing from the two lists ([`pair`]): rail 0 is the pair of addresses the bootstrap
//! connection already joins, then each further rail of the lower rank is paired with an unused
//! rail of the higher rank on the same subnet. A rail with no partner on its subnet is left out
//! (and named in the link's INFO line). The link's sockets are spread over the pairs: socket
//! `s` runs on pair `s mod rails`, so the striped stream ([`super::tcp`]) gives each rail an
//! equal share of every large message.
//!
//! Without a filter a link uses the bootstrap's interface alone, as before; [`note_unused`]
//! then names, once per process, the other usable interfaces and the setting that uses them.

use crate::bootstrap::net::IfAddr;
use crate::error::{Error, Result};
use crate::net::wire::{Reader, Writer};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Most rails per link (more interfaces than this are ignored, with the first ones kept).
pub const MAX_RAILS: usize = 8;

/// This rank's rails: the interfaces passing `cfg`'s `OXCCL_SOCKET_IFNAME`, one address each
/// (IPv4 before IPv6), in the system's order; empty without a filter. Loopback is never a rail
/// (it reaches this host only).
pub fn local(cfg: &crate::config::Config) -> Vec<IfAddr> {
    let Some(filter) = &cfg.socket_ifname else { return Vec::new() };
    let all = crate::bootstrap::net::interfaces().unwrap_or_default();
    one_per_interface(all.into_iter().filter(|i| filter.matches(&i.name) && !i.addr.is_loopback()))
}

/// The first address of each interface, IPv4 before IPv6, at most [`MAX_RAILS`].
fn one_per_interface(addrs: impl Iterator<Item = IfAddr>) -> Vec<IfAddr> {
    let mut out: Vec<IfAddr> = Vec::new();
    for a in addrs {
        match out.iter_mut().find(|o| o.name == a.name) {
            Some(o) if o.addr.is_ipv6() && a.addr.is_ipv4() => *o = a,
            Some(_) => {}
            None => out.push(a),
        }
    }
    out.truncate(MAX_RAILS);
    out
}

/// Without `OXCCL_SOCKET_IFNAME`: one INFO line per process naming the other usable
/// interfaces (not loopback or docker) beside `used`, and the setting that would use them all.
pub fn note_unused(cfg: &crate::config::Config, used: IpAddr) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if cfg.socket_ifname.is_some() {
        return;
    }
    ONCE.call_once(|| {
        let all = crate::bootstrap::net::interfaces().unwrap_or_default();
        let usable = one_per_interface(
            all.into_iter().filter(|i| !i.addr.is_loopback() && !i.name.starts_with("docker") && i.name != "lo"),
        );
        let Some(mine) = usable.iter().find(|i| i.addr == used).map(|i| i.name.clone()) else { return };
        let others: Vec<String> =
            usable.iter().filter(|i| i.name != mine).map(|i| format!("{} ({})", i.name, i.addr)).collect();
        if !others.is_empty() {
            let names: Vec<&str> = usable.iter().map(|i| i.name.as_str()).collect();
            crate::info!(
                "TCP links use {mine} only; other usable interfaces: {}; {}=\"={}\" would use them all as rails",
                others.join(", "),
                crate::log::var_name("SOCKET_IFNAME"),
                names.join(",")
            );
        }
    });
}

/// Appends a rail list to an offer.
pub fn encode(rails: &[IfAddr], w: &mut Writer) {
    w.bytes(&[rails.len() as u8]);
    for r in rails {
        w.str(&r.name);
        match r.addr {
            IpAddr::V4(v) => w.bytes(&[4]).bytes(&v.octets()),
            IpAddr::V6(v) => w.bytes(&[6]).bytes(&v.octets()),
        };
        w.bytes(&[r.prefix]);
    }
}

/// Reads a rail list written by [`encode`].
pub fn decode(r: &mut Reader<'_>) -> Result<Vec<IfAddr>> {
    let n = r.bytes(1)?[0] as usize;
    if n > MAX_RAILS {
        return Err(Error::remote(format!("malformed rail list: {n} rails (at most {MAX_RAILS})")));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str(64)?;
        let addr = match r.bytes(1)?[0] {
            4 => IpAddr::from(<[u8; 4]>::try_from(r.bytes(4)?).expect("4 bytes")),
            6 => IpAddr::from(<[u8; 16]>::try_from(r.bytes(16)?).expect("16 bytes")),
            f => return Err(Error::remote(format!("malformed rail list: address family {f}"))),
        };
        out.push(IfAddr { name, addr, prefix: r.bytes(1)?[0] });
    }
    Ok(out)
}

/// One rail of a link: this end's interface and address, and the peer's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    /// The lower rank's interface.
    pub lower: IfAddr,
    /// The higher rank's interface.
    pub higher: IfAddr,
}

/// Pairs the lower rank's rails with the higher rank's (both ends compute the same list): first
/// the bootstrap connection's addresses `conn` (lower, higher), then, in the lower rank's order,
/// each further lower rail with the first unused higher rail on its subnet. An address that both
/// hosts have (a container bridge's default, say) reaches each host itself, so it pairs with
/// nothing. Returns the pairs and the lower and higher rails left without a partner.
pub fn pair(lower: &[IfAddr], higher: &[IfAddr], conn: (IpAddr, IpAddr)) -> (Vec<Pair>, Vec<IfAddr>) {
    let shared = |a: IpAddr| lower.iter().any(|l| l.addr == a) && higher.iter().any(|h| h.addr == a);
    let find = |list: &[IfAddr], ip: IpAddr| {
        list.iter().find(|r| r.addr == ip).cloned().unwrap_or(IfAddr { name: "?".into(), addr: ip, prefix: 0 })
    };
    let first = Pair { lower: find(lower, conn.0), higher: find(higher, conn.1) };
    let (first_lower, first_higher) = (first.lower.name.clone(), first.higher.name.clone());
    let mut used_higher: Vec<IpAddr> = vec![conn.1];
    let (mut pairs, mut alone) = (vec![first], Vec::new());
    for l in lower.iter().filter(|l| l.addr != conn.0 && l.name != first_lower) {
        let partner = higher
            .iter()
            .filter(|h| !used_higher.contains(&h.addr) && h.name != first_higher && !shared(h.addr))
            .find(|h| !shared(l.addr) && l.same_subnet(h.addr) && h.same_subnet(l.addr));
        match partner {
            Some(h) => {
                used_higher.push(h.addr);
                pairs.push(Pair { lower: l.clone(), higher: h.clone() });
            }
            None => alone.push(l.clone()),
        }
    }
    alone.extend(higher.iter().filter(|h| !used_higher.contains(&h.addr) && h.name != first_higher).cloned());
    (pairs, alone)
}

/// Connects from local address `from` (so the connection leaves through that rail's interface)
/// to `to`, which is already listening, within `deadline`.
pub fn connect_from(from: IpAddr, to: SocketAddr, deadline: Instant) -> Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let fail = |what: &str, e: std::io::Error| Error::system(format!("rail {from} -> {to}: {what}: {e}"));
    let s = Socket::new(Domain::for_address(to), Type::STREAM, None).map_err(|e| fail("socket", e))?;
    s.bind(&SocketAddr::new(from, 0).into()).map_err(|e| fail("bind", e))?;
    let left = deadline.saturating_duration_since(Instant::now()).min(Duration::from_secs(10));
    s.connect_timeout(&to.into(), left.max(Duration::from_millis(1))).map_err(|e| fail("connect", e))?;
    let s: TcpStream = s.into();
    s.set_nodelay(true).map_err(|e| Error::from_io("TCP_NODELAY", e))?;
    Ok(s)
}

/// How a link's rails read in its INFO line: `rail0 10.0.0.1 -> rail0 10.0.0.2 34%, ...` from
/// this end, with each rail's share of the stripes (`shares`, per cent; none when empty).
pub fn describe(pairs: &[Pair], me_lower: bool, shares: &[usize]) -> String {
    pairs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (mine, theirs) = if me_lower { (&p.lower, &p.higher) } else { (&p.higher, &p.lower) };
            let share = shares.get(i).map(|s| format!(" {s}%")).unwrap_or_default();
            format!("{} {} -> {} {}{share}", mine.name, mine.addr, theirs.name, theirs.addr)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Bytes each end sends on each rail when a link is made, to measure the rails' rates.
pub const PROBE: usize = 16 << 20;

/// Measures the rails of a new link: sends `bytes` on each of `socks` (one socket per rail)
/// while the peer does the same, reading the peer's `bytes` from each; returns each rail's
/// arrival rate (bytes per second), timed from the end of the first quarter (slow start and
/// shaper bursts) to the last byte. Leaves the sockets blocking, with nothing unread.
pub fn probe(socks: &[&TcpStream], bytes: usize, deadline: Instant) -> Result<Vec<f64>> {
    use std::io::{ErrorKind, Read, Write};
    use std::os::fd::AsRawFd;
    let n = socks.len();
    let (out, mut inb) = (vec![0x5au8; 256 << 10], vec![0u8; 256 << 10]);
    let (mut sent, mut got) = (vec![0usize; n], vec![0usize; n]);
    let (mut start, mut end) = (vec![None::<Instant>; n], vec![None::<Instant>; n]);
    let nb = |on: bool| -> Result<()> {
        socks.iter().try_for_each(|s| s.set_nonblocking(on).map_err(|e| Error::from_io("set_nonblocking", e)))
    };
    nb(true)?;
    let r = (|| -> Result<()> {
        while sent.iter().chain(&got).any(|&x| x < bytes) {
            if Instant::now() >= deadline {
                return Err(Error::timeout(format!("measuring the rails: {got:?} of {bytes} bytes each arrived")));
            }
            let mut fds: Vec<libc::pollfd> = (0..n)
                .map(|i| {
                    let ev =
                        if got[i] < bytes { libc::POLLIN } else { 0 } | if sent[i] < bytes { libc::POLLOUT } else { 0 };
                    libc::pollfd { fd: socks[i].as_raw_fd(), events: ev, revents: 0 }
                })
                .collect();
            // SAFETY: `fds` is a valid array of `n` pollfds for the duration of the call.
            unsafe { libc::poll(fds.as_mut_ptr(), n as libc::nfds_t, 100) };
            for i in 0..n {
                let io = |r: std::io::Result<usize>| match r {
                    Ok(0) => Err(Error::remote("the peer closed a rail while it was measured")),
                    Ok(k) => Ok(k),
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(0),
                    Err(e) => Err(Error::remote(format!("measuring a rail: {e}"))),
                };
                if sent[i] < bytes {
                    let k = (bytes - sent[i]).min(out.len());
                    sent[i] += io((&mut &*socks[i]).write(&out[..k]))?;
                }
                if got[i] < bytes {
                    let k = (bytes - got[i]).min(inb.len());
                    got[i] += io((&mut &*socks[i]).read(&mut inb[..k]))?;
                    let now = Instant::now();
                    if got[i] >= bytes / 4 && start[i].is_none() {
                        start[i] = Some(now);
                    }
                    if got[i] == bytes && end[i].is_none() {
                        end[i] = Some(now);
                    }
                }
            }
        }
        Ok(())
    })();
    nb(false)?;
    r?;
    Ok((0..n)
        .map(|i| {
            let t = end[i].zip(start[i]).map_or(0.0, |(e, s)| e.duration_since(s).as_secs_f64());
            (bytes - bytes / 4) as f64 / t.max(1e-6)
        })
        .collect())
}

/// The stripe cycle of a link with `weights.len()` rails of `per_rail` sockets each (socket `s`
/// on rail `s mod rails`): every socket appears, each rail gets a share of the stripes in
/// proportion to its weight, spread evenly (smooth weighted round robin) and over its sockets in
/// turn. Equal weights give round robin over the sockets.
pub fn cycle(per_rail: usize, weights: &[f64]) -> Vec<u8> {
    let rails = weights.len().max(1);
    let n = rails * per_rail.max(1);
    let len = (super::tcp::MAX_SOCKS / n).max(1) * n;
    let total: f64 = weights.iter().map(|w| w.max(0.0)).sum();
    let mut counts: Vec<usize> = weights
        .iter()
        .map(|w| if total > 0.0 { (w.max(0.0) / total * len as f64).round() as usize } else { len / rails })
        .map(|c| c.max(per_rail))
        .collect();
    let biggest = |c: &[usize]| (0..c.len()).max_by_key(|&r| (c[r], std::cmp::Reverse(r))).unwrap_or(0);
    while counts.iter().sum::<usize>() > len {
        let r = biggest(&counts);
        counts[r] -= 1;
    }
    while counts.iter().sum::<usize>() < len {
        let r = biggest(&counts);
        counts[r] += 1;
    }
    let (mut cur, mut picks, mut out) = (vec![0i64; rails], vec![0usize; rails], Vec::with_capacity(len));
    for _ in 0..len {
        for r in 0..rails {
            cur[r] += counts[r] as i64;
        }
        let r = (0..rails).max_by_key(|&r| (cur[r], std::cmp::Reverse(r))).unwrap_or(0);
        cur[r] -= len as i64;
        out.push((r + rails * (picks[r] % per_rail.max(1))) as u8);
        picks[r] += 1;
    }
    out
}

/// Each rail's share of `cycle` in per cent (rails `s mod rails`).
pub fn shares(cycle: &[u8], rails: usize) -> Vec<usize> {
    (0..rails).map(|r| 100 * cycle.iter().filter(|&&s| s as usize % rails == r).count() / cycle.len().max(1)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rail(name: &str, addr: &str, prefix: u8) -> IfAddr {
        IfAddr { name: name.into(), addr: addr.parse().unwrap(), prefix }
    }

    #[test]
    fn rails_pair_by_subnet_after_the_bootstrap_pair() {
        let lower = [rail("rail0", "10.1.0.1", 24), rail("rail1", "10.1.1.1", 24), rail("eth9", "10.9.0.1", 24)];
        let higher = [rail("rail1", "10.1.1.2", 24), rail("rail0", "10.1.0.2", 24), rail("rail2", "10.1.2.2", 24)];
        let conn = ("10.1.0.1".parse().unwrap(), "10.1.0.2".parse().unwrap());
        let (pairs, alone) = pair(&lower, &higher, conn);
        let names: Vec<(&str, &str)> = pairs.iter().map(|p| (p.lower.name.as_str(), p.higher.name.as_str())).collect();
        assert_eq!(names, [("rail0", "rail0"), ("rail1", "rail1")]);
        let alone: Vec<&str> = alone.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(alone, ["eth9", "rail2"], "no partner on their subnets");
        assert_eq!(
            describe(&pairs, false, &[40, 60]),
            "rail0 10.1.0.2 -> rail0 10.1.0.1 40%, rail1 10.1.1.2 -> rail1 10.1.1.1 60%"
        );
    }

    #[test]
    fn an_address_both_hosts_have_pairs_with_nothing() {
        let lower = [rail("eth0", "10.0.0.1", 24), rail("docker0", "172.17.0.1", 16), rail("eth1", "10.0.1.1", 24)];
        let higher = [rail("eth0", "10.0.0.2", 24), rail("docker0", "172.17.0.1", 16), rail("eth1", "10.0.1.2", 24)];
        let conn = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let (pairs, alone) = pair(&lower, &higher, conn);
        let names: Vec<&str> = pairs.iter().map(|p| p.lower.name.as_str()).collect();
        assert_eq!(names, ["eth0", "eth1"]);
        assert!(alone.iter().all(|a| a.name == "docker0") && alone.len() == 2, "{alone:?}");
    }

    #[test]
    fn no_rail_lists_is_the_bootstrap_pair_alone() {
        let conn = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let (pairs, alone) = pair(&[], &[], conn);
        assert_eq!(pairs.len(), 1);
        assert_eq!((pairs[0].lower.addr, pairs[0].higher.addr), conn);
        assert!(alone.is_empty());
    }

    #[test]
    fn a_partner_is_used_once() {
        let lower = [rail("a", "10.0.0.1", 16), rail("b", "10.0.1.1", 16), rail("c", "10.0.2.1", 16)];
        let higher = [rail("a", "10.0.0.2", 16), rail("b", "10.0.1.2", 16)];
        let conn = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let (pairs, alone) = pair(&lower, &higher, conn);
        assert_eq!(pairs.len(), 2, "{pairs:?}");
        assert_eq!(alone.len(), 1);
    }

    #[test]
    fn rail_lists_survive_the_wire_and_bad_ones_are_refused() {
        let rails = vec![rail("rail0", "10.1.0.1", 24), rail("v6", "fd00::5", 64)];
        let mut w = Writer::default();
        encode(&rails, &mut w);
        let mut r = Reader::new(&w.0);
        assert_eq!(decode(&mut r).unwrap(), rails);
        r.finish().unwrap();
        let mut bad = w.0.clone();
        bad[0] = MAX_RAILS as u8 + 1;
        assert!(decode(&mut Reader::new(&bad)).is_err());
        assert!(decode(&mut Reader::new(&w.0[..w.0.len() - 1])).is_err(), "truncated");
    }

    #[test]
    fn cycles_give_rails_their_weight_and_every_socket_a_turn() {
        // Equal weights: round robin over the sockets.
        let c = cycle(2, &[5.0, 5.0]);
        assert_eq!(c.len(), 64);
        assert!(c.iter().enumerate().all(|(k, &s)| s as usize == k % 4), "{c:?}");
        // 1:2: a third and two thirds, the slow rail's stripes spread out.
        let c = cycle(1, &[1.0e8, 2.0e8]);
        assert_eq!(shares(&c, 2), [32, 67]);
        assert!(c.windows(3).all(|w| w.contains(&1)), "{c:?}");
        // A rail measured at almost nothing keeps one stripe per socket of its own.
        let c = cycle(3, &[0.0, 1.0]);
        assert_eq!(c.len(), 60);
        for s in 0..6u8 {
            assert!(c.contains(&s), "socket {s} missing: {c:?}");
        }
        assert_eq!(c.iter().filter(|&&s| s % 2 == 0).count(), 3);
        // Sockets of one rail take turns.
        let c = cycle(2, &[1.0, 3.0]);
        let rail1: Vec<u8> = c.iter().copied().filter(|s| s % 2 == 1).take(4).collect();
        assert_eq!(rail1, [1, 3, 1, 3]);
    }

    #[test]
    fn a_probe_measures_both_directions_and_leaves_nothing_unread() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(l.local_addr().unwrap()).unwrap()).collect();
        let b: Vec<TcpStream> = (0..2).map(|_| l.accept().unwrap().0).collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        let (ra, rb) = std::thread::scope(|s| {
            let t = s.spawn(|| probe(&b.iter().collect::<Vec<_>>(), 1 << 20, deadline).unwrap());
            (probe(&a.iter().collect::<Vec<_>>(), 1 << 20, deadline).unwrap(), t.join().unwrap())
        });
        assert!(ra.iter().chain(&rb).all(|&r| r > 0.0), "{ra:?} {rb:?}");
        // The streams carry on in order after the probe.
        use std::io::{Read, Write};
        (&a[1]).write_all(b"after").unwrap();
        let mut got = [0u8; 5];
        (&b[1]).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"after");
    }

    #[test]
    fn one_address_per_interface_ipv4_first() {
        let got = one_per_interface(
            [rail("a", "fd00::1", 64), rail("a", "10.0.0.1", 24), rail("b", "10.0.1.1", 24), rail("a", "10.0.0.9", 24)]
                .into_iter(),
        );
        assert_eq!(got, [rail("a", "10.0.0.1", 24), rail("b", "10.0.1.1", 24)]);
    }
}
