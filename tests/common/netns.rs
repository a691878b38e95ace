//! Hosts for multi-host tests: network namespaces made by scripts/netns-hosts.sh under a prefix
//! of this test process, each with its own address on one bridge; removed on drop, also when
//! the test fails.

use std::process::{Command, Stdio};

/// The namespaces of one test.
pub struct Hosts {
    prefix: String,
    /// IPv4 `a.b.c` of the hosts' /24, or `None` for IPv6-only hosts.
    net: Option<String>,
    /// IPv6 /64 prefix (`fd00:x:y:0`) when the hosts have IPv6 addresses.
    net6: Option<String>,
}

impl Hosts {
    /// `n` hosts named `<short><pid><tag><i>`, with IPv4 addresses only, or IPv6 addresses only
    /// (`v6`); `None` (after a SKIP line naming `what`) when namespaces cannot be made here.
    pub fn up(what: &str, short: &str, tag: &str, subnet: u8, n: usize, v6: bool) -> Option<Hosts> {
        let pid = std::process::id();
        let h = Hosts {
            prefix: format!("{short}{}{tag}", pid % 100_000),
            net: (!v6).then(|| format!("10.{subnet}.{}", pid % 250)),
            net6: v6.then(|| format!("fd00:{subnet:x}:{:x}:0", pid % 65_536)),
        };
        if !h.script(&["up", &n.to_string()]) {
            super::skipped(&format!("{what} {tag}: cannot create network namespaces (needs root, iproute2, bridge)"));
            return None;
        }
        Some(h)
    }

    fn script(&self, args: &[&str]) -> bool {
        Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-hosts.sh"))
            .args(args)
            .env("OXH_PREFIX", &self.prefix)
            .env("OXH_NET", self.net.as_deref().unwrap_or("none"))
            .env("OXH_NET6", self.net6.as_deref().unwrap_or(""))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// The namespace of host `host`.
    pub fn ns(&self, host: usize) -> String {
        format!("{}{host}", self.prefix)
    }

    /// Host `host`'s address (as `MASTER_ADDR` takes it: IPv6 without brackets).
    pub fn addr(&self, host: usize) -> String {
        match (&self.net, &self.net6) {
            (Some(net), _) => format!("{net}.{}", host + 1),
            (None, Some(net6)) => format!("{net6}::{}", host + 1),
            (None, None) => unreachable!("hosts have IPv4 or IPv6 addresses"),
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.script(&["down"]);
    }
}
