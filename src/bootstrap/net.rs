//! Host facts used by the bootstrap: interfaces (`OXCCL_SOCKET_IFNAME`), host identity,
//! randomness.

use crate::error::{Error, Result};
use crate::net::hostname;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A network interface address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfAddr {
    /// Interface name (`eth0`, `lo`, ...).
    pub name: String,
    /// One of its addresses.
    pub addr: IpAddr,
    /// The length of its network prefix (from the netmask; the full length when none is set).
    pub prefix: u8,
}

impl IfAddr {
    /// Whether `other` is on this address's subnet.
    pub fn same_subnet(&self, other: IpAddr) -> bool {
        let bits = |a: IpAddr| match a {
            IpAddr::V4(v) => (u128::from(u32::from(v)) << 96, 32u32),
            IpAddr::V6(v) => (u128::from(v), 128u32),
        };
        let ((a, la), (b, lb)) = (bits(self.addr), bits(other));
        let keep = u32::from(self.prefix).min(la);
        la == lb && (keep == 0 || (a ^ b) >> (128 - keep) == 0)
    }
}

/// Lists the IPv4/IPv6 addresses of interfaces that are up (link-local IPv6 excluded).
pub fn interfaces() -> Result<Vec<IfAddr>> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::from_io("getifaddrs", std::io::Error::last_os_error()));
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list returned by getifaddrs, valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated C string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: ifa_addr is non-null and points to a sockaddr whose family says its real type.
        let Some(addr) = (unsafe { ip_of(ifa.ifa_addr) }) else { continue };
        // SAFETY: ifa_netmask is null or a sockaddr of the address's family.
        let mask = unsafe { ip_of(ifa.ifa_netmask) };
        let full = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = mask.map_or(full, |m| match m {
            IpAddr::V4(v) => u32::from(v).count_ones() as u8,
            IpAddr::V6(v) => u128::from(v).count_ones() as u8,
        });
        if let IpAddr::V6(v6) = addr {
            if v6.segments()[0] & 0xffc0 == 0xfe80 {
                continue;
            }
        }
        out.push(IfAddr { name, addr, prefix });
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The address in `sa` when it is IPv4 or IPv6.
///
/// # Safety
/// `sa` is null or points to a valid sockaddr whose family says its real type.
unsafe fn ip_of(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: per this function's contract, the family field tells the struct behind `sa`.
    unsafe {
        match (*sa).sa_family as i32 {
            libc::AF_INET => {
                let sa = &*(sa as *const libc::sockaddr_in);
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr))))
            }
            libc::AF_INET6 => {
                let sa = &*(sa as *const libc::sockaddr_in6);
                Some(IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr)))
            }
            _ => None,
        }
    }
}

/// Whether interface `name` passes an `OXCCL_SOCKET_IFNAME`-style filter: a comma-separated
/// list of prefixes, `^` in front to exclude the list, `=` in front for exact names.
/// ([`crate::config::IfFilter`]); a filter without entries lets every name pass.
pub fn ifname_matches(filter: &str, name: &str) -> bool {
    crate::config::IfFilter::parse(filter).is_none_or(|f| f.matches(name))
}

/// Picks the address this host advertises for bootstrap: the first interface passing
/// `OXCCL_SOCKET_IFNAME` (IPv4 before IPv6); without a filter, the first non-loopback,
/// non-docker interface, and loopback only when it is all there is.
pub fn pick_address() -> Result<IfAddr> {
    let all = interfaces()?;
    let filter = crate::config::BootstrapSettings::from_env().socket_ifname;
    let ok = |i: &&IfAddr| match &filter {
        Some(f) => ifname_matches(f, &i.name),
        None => !i.addr.is_loopback() && !i.name.starts_with("docker") && !i.name.starts_with("lo"),
    };
    let pick = all
        .iter()
        .filter(ok)
        .min_by_key(|i| i.addr.is_ipv6())
        .or_else(|| {
            if filter.is_none() {
                all.iter().filter(|i| i.addr.is_loopback()).min_by_key(|i| i.addr.is_ipv6())
            } else {
                None
            }
        })
        .cloned();
    if let Some(p) = &pick {
        crate::info!(
            "bootstrap interface {} address {} ({}={})",
            p.name,
            p.addr,
            crate::log::var_name("SOCKET_IFNAME"),
            filter.as_deref().unwrap_or("unset")
        );
    }
    pick.ok_or_else(|| {
        Error::system(format!(
            "no network interface matches {}={} (interfaces: {})",
            crate::log::var_name("SOCKET_IFNAME"),
            filter.unwrap_or_default(),
            all.iter().map(|i| format!("{}={}", i.name, i.addr)).collect::<Vec<_>>().join(", ")
        ))
    })
}

/// Identity of this host for grouping ranks: `OXCCL_HOSTID` if set, else hostname + boot id +
/// network namespace.
///
/// The network namespace (the inode in the `/proc/self/ns/net` link, e.g. `net:[4026531833]`)
/// makes processes in different namespaces of one machine count as different hosts: they
/// reach each other only through the network (tests and benchmarks use namespaces joined by
/// veth pairs as stand-in hosts), so they get TCP, and ranks sharing a namespace get shared
/// memory. Containers of one machine have their own namespaces too, and are kept apart alike.
pub fn host_id() -> String {
    if let Some(h) = crate::config::BootstrapSettings::from_env().host_id {
        return h;
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}:{}:{}", hostname(), boot.trim(), net_namespace())
}

/// The network namespace of this process (`net:[inode]`), or empty when /proc does not say.
pub fn net_namespace() -> String {
    std::fs::read_link("/proc/self/ns/net").map(|p| p.to_string_lossy().into_owned()).unwrap_or_default()
}

pub use crate::net::random_bytes;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ifname_filters_like_nccl() {
        assert!(ifname_matches("eth", "eth0"));
        assert!(!ifname_matches("eth", "ib0"));
        assert!(ifname_matches("ib,eth", "eth1"));
        assert!(!ifname_matches("^eth", "eth1"));
        assert!(ifname_matches("^eth", "lo"));
        assert!(ifname_matches("=lo", "lo"));
        assert!(!ifname_matches("=eth", "eth0"));
        assert!(!ifname_matches("^=lo", "lo"));
    }

    #[test]
    fn subnets_compare_the_prefix_bits() {
        let a = IfAddr { name: "rail0".into(), addr: "10.1.0.1".parse().unwrap(), prefix: 24 };
        assert!(a.same_subnet("10.1.0.200".parse().unwrap()));
        assert!(!a.same_subnet("10.1.1.2".parse().unwrap()));
        assert!(!a.same_subnet("fd00::1".parse().unwrap()));
        let b = IfAddr { name: "v6".into(), addr: "fd00:1:2:3::1".parse().unwrap(), prefix: 64 };
        assert!(b.same_subnet("fd00:1:2:3::9".parse().unwrap()) && !b.same_subnet("fd00:1:2:4::1".parse().unwrap()));
        let any = IfAddr { prefix: 0, ..a };
        assert!(any.same_subnet("192.168.0.1".parse().unwrap()));
    }

    #[test]
    fn host_id_names_the_network_namespace() {
        let ns = net_namespace();
        assert!(ns.starts_with("net:["), "{ns}");
        if crate::config::BootstrapSettings::from_env().host_id.is_none() {
            assert!(host_id().ends_with(&ns), "{}", host_id());
        }
    }

    #[test]
    fn loopback_is_listed() {
        assert!(interfaces().unwrap().iter().any(|i| i.addr.is_loopback()));
    }
}
