//! The typed [`Config`]: every setting of a communicator, read once from the environment.

use super::{lookup, parse_size, DEFAULT_TIMEOUT_MS};

/// Default of `OXCCL_LIVENESS_TIMEOUT_MS`.
pub const DEFAULT_LIVENESS_MS: u64 = 20_000;
use crate::algo::tuning::AlgoSet;
use std::time::Duration;

/// Most sockets per TCP link.
pub const MAX_SOCKS: usize = 64;
/// Smallest stripe of a multi-socket TCP link (NCCL's minimum task size for socket striping).
pub const MIN_STRIPE: usize = 64 << 10;
/// Most helper threads per TCP link.
pub const MAX_THREADS: usize = 16;

/// What `OXCCL_TRANSPORT` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportMode {
    /// Shared memory with peers on this host, TCP with the others (default).
    Auto,
    /// TCP with everyone.
    Tcp,
    /// Shared memory with everyone; a peer on another host is an error.
    Shm,
}

/// What `OXCCL_NET` (`NCCL_NET`) asks for: the transport between hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetMode {
    /// libfabric where it offers a provider of a real fabric (verbs, efa, cxi, psm3), sockets
    /// otherwise (default).
    Auto,
    /// libfabric (`crate::transport::ofi`); an error where it cannot be used.
    Ofi,
    /// TCP sockets.
    Socket,
}

/// Default smallest send that goes by single copy (`OXCCL_CMA`, bytes); below it the ring's
/// two copies cost less than the system call and the hand-shake.
pub const CMA_DEFAULT_MIN: usize = 64 << 10;

/// What `OXCCL_CMA` asks for, when single copy is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmaSetting {
    /// Smallest send that goes by single copy.
    pub min: usize,
    /// Use it wherever the kernel permits it, without timing it first.
    pub forced: bool,
}

/// The settings of the rendezvous and of what this process advertises, needed before any
/// communicator exists. Read at each use ([`BootstrapSettings::from_env`]): a process makes
/// several ids and communicators, and may change these variables between them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BootstrapSettings {
    /// `OXCCL_COMM_ID`: `host:port` of the rendezvous root, which rank 0 starts when it joins
    /// (no root is started by `ncclGetUniqueId` then).
    pub comm_id: Option<String>,
    /// `OXCCL_COMM_ID_BIND_ANY` (`1`, `true`, `yes`): a rank 0 that cannot bind the
    /// `comm_id` address listens on every interface instead (default no).
    pub comm_id_bind_any: bool,
    /// `OXCCL_SECRET`: the key (32 hex digits) or passphrase of ids built from an address.
    pub secret: Option<String>,
    /// `OXCCL_SOCKET_IFNAME`: the interfaces the bootstrap may advertise (NCCL's syntax).
    pub socket_ifname: Option<String>,
    /// `OXCCL_HOSTID`: this process's host id, instead of the one derived from the machine.
    pub host_id: Option<String>,
}

impl BootstrapSettings {
    /// Reads them from the process environment.
    pub fn from_env() -> BootstrapSettings {
        BootstrapSettings::from_lookup(&env_get)
    }

    /// Reads them through `get` (a variable's value by its full name).
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> BootstrapSettings {
        let v = |name: &str| lookup(get, name).map(|(_, val)| val);
        BootstrapSettings {
            comm_id: v("COMM_ID"),
            comm_id_bind_any: v("COMM_ID_BIND_ANY").is_some_and(|b| matches!(b.trim(), "1" | "true" | "yes")),
            secret: v("SECRET"),
            socket_ifname: v("SOCKET_IFNAME"),
            host_id: v("HOSTID"),
        }
    }
}

/// Every setting a communicator reads from the environment, read once when it is made.
///
/// Build one with [`Config::from_env`] (what `ncclCommInitRank` and friends do), change fields
/// for a test or a special communicator, and hand it to
/// [`crate::Communicator::init_rank_with_config`] or
/// [`crate::Communicator::in_memory_with_config`]. Every rank of a communicator must use the
/// same values for the settings that shape plans (`algos`, `chunk`, `oneshot_bytes`,
/// `check_mismatch`).
#[derive(Clone, Debug)]
pub struct Config {
    /// `OXCCL_TIMEOUT_MS`: longest a blocking wait may go without progress (default 5 minutes).
    pub timeout: Duration,
    /// `OXCCL_LIVENESS_TIMEOUT_MS`: how long a peer's control channel may stay silent (no
    /// heartbeat) before the peer is declared dead (default 20 s); `None` (`0`): silence
    /// declares no death (the control channels still carry failures, and a channel that ends
    /// without a closing frame is still a death).
    pub liveness: Option<Duration>,
    /// `OXCCL_ALGO`: the algorithms allowed (NCCL's `ring,tree` or `^tree` syntax); `None` when
    /// unset, which also lets all-reduce take its special paths (one-shot, hierarchical).
    pub algos: Option<AlgoSet>,
    /// `OXCCL_CHUNK_SIZE`: fixed pipeline chunk in bytes (at least 64); `None`: the cost model.
    pub chunk: Option<usize>,
    /// `OXCCL_ONESHOT_BYTES`: largest 2-rank all-reduce that takes the one-shot exchange
    /// (default 256 KiB).
    pub oneshot_bytes: usize,
    /// `OXCCL_SPIN_US`: how long the engine spins before sleeping; `None`: by CPU count.
    pub spin_us: Option<u64>,
    /// `OXCCL_ARENA`: whether all-reduces on one host go through the host arena
    /// (`crate::engine::arena`): `Some(false)` never, `Some(true)` whenever at least 2 ranks
    /// share the host over shared memory, `None` (unset) when they outnumber its CPUs.
    pub arena: Option<bool>,
    /// `OXCCL_LOCAL_REGISTER` (`NCCL_LOCAL_REGISTER`): whether the host arena reads buffers
    /// that lie in `ncclMemAlloc`'s shareable host memory where they lie, instead of copying
    /// them through the arena (default on; `0` turns it off).
    pub local_register: bool,
    /// `OXCCL_DETERMINISTIC`: every reduction (all-reduce, reduce, reduce-scatter, on host and
    /// device buffers) runs a fixed-order schedule ([`crate::algo::det`]), so that its result is
    /// the left fold of the ranks' inputs in rank order whatever the algorithm settings, chunk
    /// size, message size, links or placement (docs/DETERMINISM.md). Default off.
    pub deterministic: bool,
    /// `OXCCL_COMPRESS`: the wire encoding of the inter-host stage of `f32` sum/avg
    /// all-reduces, reduce-scatters and reduces (`off`, `bf16`, `fp8`,
    /// `int8`; default `off`): [`crate::algo::compress`],
    /// docs/COMPRESSION.md. An unknown value warns and stays `off`.
    pub compress: crate::reduce::codec::Encoding,
    /// `OXCCL_CHECK_MISMATCH`: exchange call signatures to catch mismatched calls (default on).
    pub check_mismatch: bool,
    /// `OXCCL_WIRE_INTEGRITY` (`NCCL_WIRE_INTEGRITY`): TCP data links carry every chunk with a
    /// MAC under a key of the link ([`crate::transport::sealed`]), so bytes changed on the way
    /// fail the link as tampered with. Default off; not offered over libfabric links.
    pub wire_integrity: bool,
    /// `OXCCL_TRANSPORT`: `tcp`, `shm` or `auto`; an unknown value is kept as the error text
    /// that building links reports.
    pub transport: std::result::Result<TransportMode, String>,
    /// `OXCCL_NET` (`NCCL_NET`): `auto`, `ofi` or `socket` between hosts; an unknown value is
    /// kept as the error text that building links reports.
    pub net: std::result::Result<NetMode, String>,
    /// `OXCCL_OFI_PROVIDER`, else libfabric's own `FI_PROVIDER`: the libfabric provider to use
    /// (e.g. `tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`); `None`: libfabric's first.
    pub ofi_provider: Option<String>,
    /// `OXCCL_OFI_CHUNK`: largest message of an ofi link, 4 KiB..64 MiB (default 1 MiB).
    pub ofi_chunk: usize,
    /// `OXCCL_OFI_DEPTH`: sends (and pre-posted receives) in flight per ofi link, 1..=64
    /// (default 4).
    pub ofi_depth: usize,
    /// `OXCCL_NSOCKS`, else `NCCL_NSOCKS_PERTHREAD` × `NCCL_SOCKET_NTHREADS`: sockets per TCP
    /// link, 1..=[`MAX_SOCKS`] (default 1).
    pub nsocks: usize,
    /// `OXCCL_NTHREADS`, else `NCCL_SOCKET_NTHREADS`: helper threads per TCP link, at most
    /// [`MAX_THREADS`] (default 0: the engine's thread drives the sockets; a link with several
    /// rails then gets one per rail).
    pub nthreads: usize,
    /// `OXCCL_SOCKET_STRIPE`: stripe of multi-socket TCP links, at least [`MIN_STRIPE`]
    /// (default 512 KiB).
    pub socket_stripe: usize,
    /// `OXCCL_SOCKET_IFNAME`, parsed: the interfaces a TCP link to another host uses, one
    /// rail each (`None`: unset, one interface as the bootstrap picks it).
    pub socket_ifname: Option<super::IfFilter>,
    /// `OXCCL_SOCKET_BUF`: socket buffer size to request (default 4 MiB; 0: the kernel's).
    pub socket_buf: usize,
    /// `OXCCL_RAIL_TIMEOUT_MS`: how long a rail of a TCP link with several may hold sent bytes
    /// without any being acknowledged before the link drops it and moves its sockets to the
    /// other rails (default 2 s; `0` keeps the default; docs/RELIABILITY.md, "Rail failover");
    /// for an ofi link with several, how long a rail may make no progress (docs/RDMA.md, "Rail
    /// failover").
    pub rail_timeout: Duration,
    /// `OXCCL_SHM_RING`: bytes per shared-memory ring direction, a power of two in 4 KiB..1 GiB;
    /// `None`: chosen by the ranks' placement ([`crate::transport::shm::default_ring`]).
    pub shm_ring: Option<usize>,
    /// `OXCCL_CUDA`: `0` turns device support off.
    pub cuda: bool,
    /// `OXCCL_CUDA_IPC`: `0` sends device collectives through pinned host staging.
    pub cuda_ipc: bool,
    /// `OXCCL_CUDA_IPC=require`: a communicator that cannot use CUDA IPC fails its first
    /// device call instead of falling back to pinned host staging.
    pub cuda_ipc_required: bool,
    /// `OXCCL_CUDA_DIRECT`: `0` keeps this rank's buffers out of the peers' reach: its CUDA
    /// IPC all-reduces stage them through its regions instead of letting the peers read and
    /// write them where they lie (`crate::device::window`, `direct.rs`).
    pub cuda_direct: bool,
    /// `OXCCL_SMALL_KERNEL`: `1`: CUDA IPC all-reduces of at most 8 KiB between ranks with a
    /// GPU each take one kernel launch (the LL flow, `device::small`) instead of five stream
    /// operations; `2`: also between ranks of one process sharing a GPU (each rank's calls on
    /// streams of their own hardware queue: the caller's guarantee); `0` (default): off.
    pub small_kernel: u8,
    /// `OXCCL_KERNEL_CACHE`: the directory of compiled device kernels kept between processes;
    /// `0` turns the cache off (`None`). Default `$XDG_CACHE_HOME/oxccl`, else
    /// `$HOME/.cache/oxccl` (`None` when neither is set).
    pub kernel_cache: Option<std::path::PathBuf>,
    /// `OXCCL_CUDA_IPC_BUFFER`: bytes of each half of a rank's IPC region (at least 4 KiB);
    /// `None`: the device module's default.
    pub cuda_ipc_buffer: Option<usize>,
    /// `OXCCL_CMA`: single copy between the processes of a host (`process_vm_readv`), `None`
    /// when off (`0`); unset or `auto`: on where permitted and the kernel's copy is fast
    /// enough, from [`CMA_DEFAULT_MIN`]; `1`: on wherever permitted; a size (e.g. `16K`): on
    /// wherever permitted, from that size. Shared-memory links read the process's value
    /// ([`crate::config::process`]).
    pub cma: Option<CmaSetting>,
    /// `OXCCL_DUMP`: the directory where the flight record is written on a failure (none by
    /// default); the process's value is used ([`crate::config::process`]).
    pub dump: Option<String>,
    /// `OXCCL_DUMP_SIGNAL=1`: SIGUSR1 dumps every live flight record (the process's value).
    pub dump_signal: bool,
    /// The problems found while reading, naming the variable as the user spelled it; a
    /// communicator made with this config logs each once at WARN
    /// ([`crate::log::config_warnings`]).
    pub warnings: Vec<String>,
}

impl Default for Config {
    /// The defaults, as if no variable were set.
    fn default() -> Config {
        Config::from_lookup(&|_| None)
    }
}

impl Config {
    /// Reads every setting from the process environment.
    pub fn from_env() -> Config {
        Config::read(&Vars::env())
    }

    /// Reads every setting through `get` (a variable's value by its full name), e.g. from a
    /// map in a test. Problems are collected in [`Config::warnings`] likewise.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Config {
        Config::read(&Vars { get, warnings: Default::default() })
    }

    fn read(v: &Vars<'_>) -> Config {
        let ofi_provider = ["OXCCL_OFI_PROVIDER", "FI_PROVIDER"]
            .iter()
            .find_map(|k| (v.get)(k).map(|p| p.trim().to_string()).filter(|p| !p.is_empty()));
        let compress = v.get("COMPRESS").map_or(Default::default(), |(key, val)| {
            crate::reduce::codec::Encoding::parse(&val).unwrap_or_else(|| {
                v.warn(format!("ignoring {key}={val}: not one of off, bf16, fp8, int8"));
                Default::default()
            })
        });
        Config {
            compress,
            timeout: Duration::from_millis(v.u64("TIMEOUT_MS").filter(|&t| t > 0).unwrap_or(DEFAULT_TIMEOUT_MS)),
            liveness: match v.u64("LIVENESS_TIMEOUT_MS").unwrap_or(DEFAULT_LIVENESS_MS) {
                0 => None,
                ms => Some(Duration::from_millis(ms)),
            },
            algos: v.algos(),
            chunk: v.u64("CHUNK_SIZE").filter(|&c| c >= 64).map(|c| c as usize),
            oneshot_bytes: v.u64("ONESHOT_BYTES").unwrap_or(256 << 10) as usize,
            spin_us: v.u64("SPIN_US"),
            arena: v.u64("ARENA").map(|a| a != 0),
            check_mismatch: v.u64("CHECK_MISMATCH") != Some(0),
            deterministic: v.u64("DETERMINISTIC").is_some_and(|d| d != 0),
            wire_integrity: v.u64("WIRE_INTEGRITY").is_some_and(|d| d != 0),
            local_register: v.u64("LOCAL_REGISTER") != Some(0),
            transport: v.transport(),
            net: v.net(),
            ofi_provider,
            ofi_chunk: (v.u64("OFI_CHUNK").unwrap_or(1 << 20) as usize).clamp(4096, 64 << 20),
            ofi_depth: (v.u64("OFI_DEPTH").unwrap_or(4) as usize).clamp(1, 64),
            nsocks: v.nsocks(),
            nthreads: v.nthreads(),
            socket_stripe: (v.u64("SOCKET_STRIPE").unwrap_or(512 << 10) as usize).max(MIN_STRIPE),
            socket_ifname: v.get("SOCKET_IFNAME").and_then(|(_, val)| super::IfFilter::parse(&val)),
            socket_buf: v.u64("SOCKET_BUF").unwrap_or(4 << 20) as usize,
            rail_timeout: Duration::from_millis(v.u64("RAIL_TIMEOUT_MS").filter(|&t| t > 0).unwrap_or(2000)),
            shm_ring: v.u64("SHM_RING").map(|r| (r as usize).clamp(4096, 1 << 30).next_power_of_two()),
            cuda: !v.off("CUDA"),
            cuda_ipc: !v.off("CUDA_IPC"),
            cuda_direct: !v.off("CUDA_DIRECT"),
            cuda_ipc_required: v.get("CUDA_IPC").is_some_and(|(_, x)| x.trim().eq_ignore_ascii_case("require")),
            small_kernel: v.u64("SMALL_KERNEL").map_or(0, |d| d.min(2) as u8),
            kernel_cache: v.kernel_cache(),
            cuda_ipc_buffer: v.u64("CUDA_IPC_BUFFER").map(|b| (b as usize).max(4096)),
            cma: v.cma(),
            dump: v.get("DUMP").map(|(_, d)| d),
            dump_signal: v.get("DUMP_SIGNAL").is_some_and(|(_, s)| s.trim() == "1"),
            warnings: v.warnings.take(),
        }
    }
}

/// A lookup of variables that collects what it could not use.
pub(super) struct Vars<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
    warnings: std::cell::RefCell<Vec<String>>,
}

impl Vars<'static> {
    /// The process environment.
    pub(super) fn env() -> Vars<'static> {
        Vars { get: &env_get, warnings: Default::default() }
    }
}

impl Vars<'_> {
    fn warn(&self, msg: String) {
        self.warnings.borrow_mut().push(msg);
    }

    /// `OXCCL_<name>`, else `NCCL_<name>` (non-empty): the spelling found and its value.
    fn get(&self, name: &str) -> Option<(String, String)> {
        lookup(self.get, name)
    }

    /// A size (`123`, `64K`, `4M`, `1G`) from `OXCCL_<name>` / `NCCL_<name>`.
    pub(super) fn u64(&self, name: &str) -> Option<u64> {
        let (key, val) = self.get(name)?;
        let n = parse_size(&val);
        if n.is_none() {
            self.warn(format!("ignoring {key}={val}: not a number"));
        }
        n
    }

    /// A plain count from the variable `key` exactly (no twin): unparsable counts as unset.
    fn count(&self, key: &str) -> Option<usize> {
        let val = (self.get)(key)?;
        let n = val.trim().parse::<usize>().ok();
        if n.is_none() && !val.trim().is_empty() {
            self.warn(format!("ignoring {key}={val}: not a number"));
        }
        n
    }

    /// `OXCCL_NSOCKS`, else NCCL's `NCCL_NSOCKS_PERTHREAD` x `NCCL_SOCKET_NTHREADS` ([`Config::nsocks`]).
    fn nsocks(&self) -> usize {
        match self.count("OXCCL_NSOCKS") {
            Some(n) => n,
            None => self
                .count("NCCL_NSOCKS_PERTHREAD")
                .unwrap_or(1)
                .saturating_mul(self.count("NCCL_SOCKET_NTHREADS").unwrap_or(1)),
        }
        .clamp(1, MAX_SOCKS)
    }

    /// `OXCCL_NTHREADS`, else `NCCL_SOCKET_NTHREADS` ([`Config::nthreads`]).
    fn nthreads(&self) -> usize {
        self.count("OXCCL_NTHREADS").or_else(|| self.count("NCCL_SOCKET_NTHREADS")).unwrap_or(0).min(MAX_THREADS)
    }

    /// `OXCCL_ALGO` ([`Config::algos`]), naming the unknown algorithms in a warning.
    fn algos(&self) -> Option<AlgoSet> {
        self.get("ALGO").map(|(key, val)| {
            let (set, unknown) = AlgoSet::parse(&val);
            if !unknown.is_empty() {
                self.warn(format!(
                    "{key}={val}: ignoring unknown algorithm(s) {} (known: ring, tree, rd, direct)",
                    unknown.join(", ")
                ));
            }
            set
        })
    }

    /// `OXCCL_TRANSPORT` ([`Config::transport`]).
    fn transport(&self) -> std::result::Result<TransportMode, String> {
        let Some((key, val)) = self.get("TRANSPORT") else { return Ok(TransportMode::Auto) };
        match val.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportMode::Auto),
            "tcp" | "socket" => Ok(TransportMode::Tcp),
            "shm" => Ok(TransportMode::Shm),
            other => Err(format!("{key}={other} is not one of tcp, shm, auto")),
        }
    }

    /// `OXCCL_NET` ([`Config::net`]).
    fn net(&self) -> std::result::Result<NetMode, String> {
        let Some((key, val)) = self.get("NET") else { return Ok(NetMode::Auto) };
        match val.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(NetMode::Auto),
            "ofi" | "libfabric" | "aws libfabric" => Ok(NetMode::Ofi),
            "socket" | "tcp" => Ok(NetMode::Socket),
            other => Err(format!("{key}={other} is not one of auto, ofi, socket")),
        }
    }

    /// `OXCCL_KERNEL_CACHE` ([`Config::kernel_cache`]).
    fn kernel_cache(&self) -> Option<std::path::PathBuf> {
        let dir = |name: &str| (self.get)(name).filter(|x| !x.trim().is_empty()).map(std::path::PathBuf::from);
        match self.get("KERNEL_CACHE") {
            Some((_, d)) if d.trim() == "0" => None,
            Some((_, d)) => Some(std::path::PathBuf::from(d.trim())),
            None => {
                dir("XDG_CACHE_HOME").map(|x| x.join("oxccl")).or_else(|| dir("HOME").map(|h| h.join(".cache/oxccl")))
            }
        }
    }

    /// `OXCCL_CMA` / `NCCL_CMA` (see [`Config::cma`]); a value that is not `0`, `1`, `auto` or a
    /// size keeps the default.
    fn cma(&self) -> Option<CmaSetting> {
        let auto = CmaSetting { min: CMA_DEFAULT_MIN, forced: false };
        let Some((key, val)) = self.get("CMA") else { return Some(auto) };
        match val.trim() {
            "auto" => Some(auto),
            "1" => Some(CmaSetting { min: CMA_DEFAULT_MIN, forced: true }),
            "0" => None,
            s => match parse_size(s) {
                Some(n) => Some(CmaSetting { min: (n as usize).max(1), forced: true }),
                None => {
                    self.warn(format!("{key}={s} is not 0, 1, auto or a size; single copy keeps its default (auto)"));
                    Some(auto)
                }
            },
        }
    }

    /// Whether `OXCCL_<name>` / `NCCL_<name>` is `0`.
    fn off(&self, name: &str) -> bool {
        self.get(name).is_some_and(|(_, v)| v.trim() == "0")
    }
}

fn env_get(key: &str) -> Option<String> {
    super::environ::raw(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::tuning::Algo;

    fn with(vars: &[(&str, &str)]) -> Config {
        let map: std::collections::HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(&move |k| map.get(k).cloned())
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let c = with(&[]);
        assert_eq!(c.timeout, Duration::from_millis(DEFAULT_TIMEOUT_MS));
        assert_eq!((c.algos, c.chunk, c.spin_us), (None, None, None));
        assert_eq!((c.oneshot_bytes, c.nsocks, c.nthreads), (256 << 10, 1, 0));
        assert_eq!((c.socket_stripe, c.socket_buf, c.shm_ring), (512 << 10, 4 << 20, None));
        assert!(c.check_mismatch && c.cuda && c.cuda_ipc);
        assert_eq!(c.transport, Ok(TransportMode::Auto));
        assert!(c.warnings.is_empty());
        assert_eq!(c.liveness, Some(Duration::from_millis(DEFAULT_LIVENESS_MS)));
        assert_eq!(c.rail_timeout, Duration::from_secs(2));
    }

    #[test]
    fn rail_timeout_is_read_and_zero_keeps_the_default() {
        assert_eq!(with(&[("OXCCL_RAIL_TIMEOUT_MS", "500")]).rail_timeout, Duration::from_millis(500));
        assert_eq!(with(&[("OXCCL_RAIL_TIMEOUT_MS", "0")]).rail_timeout, Duration::from_secs(2));
    }

    #[test]
    fn liveness_timeout_zero_turns_death_by_silence_off() {
        assert_eq!(with(&[("OXCCL_LIVENESS_TIMEOUT_MS", "0")]).liveness, None);
        assert_eq!(with(&[("OXCCL_LIVENESS_TIMEOUT_MS", "5000")]).liveness, Some(Duration::from_millis(5000)));
    }

    #[test]
    fn oxccl_spelling_wins_over_nccl_and_empty_counts_as_unset() {
        let c = with(&[("OXCCL_TIMEOUT_MS", "1500"), ("NCCL_TIMEOUT_MS", "9"), ("OXCCL_CHUNK_SIZE", " ")]);
        assert_eq!(c.timeout, Duration::from_millis(1500));
        let c = with(&[("OXCCL_CHUNK_SIZE", ""), ("NCCL_CHUNK_SIZE", "128K"), ("NCCL_ALGO", "^tree")]);
        assert_eq!(c.chunk, Some(128 << 10));
        let algos = c.algos.expect("NCCL_ALGO is read");
        assert!(!algos.contains(Algo::Tree) && algos.contains(Algo::Ring));
        assert_eq!(with(&[("OXCCL_CHUNK_SIZE", "32")]).chunk, None, "below 64 bytes is ignored");
    }

    #[test]
    fn a_bad_value_warns_once_naming_the_spelling_that_was_set() {
        let c = with(&[("NCCL_SHM_RING", "lots"), ("OXCCL_ALGO", "ring,nvls"), ("OXCCL_TRANSPORT", "ib")]);
        assert_eq!(c.shm_ring, None, "the default stays");
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        assert!(c.warnings.iter().any(|w| w.contains("NCCL_SHM_RING=lots")), "{:?}", c.warnings);
        assert!(c.warnings.iter().any(|w| w.contains("OXCCL_ALGO=ring,nvls") && w.contains("nvls")));
        assert_eq!(c.algos, Some(AlgoSet::only(Algo::Ring)));
        let e = c.transport.expect_err("unknown transport");
        assert!(e.contains("OXCCL_TRANSPORT=ib"), "{e}");
        let c = with(&[("OXCCL_TRANSPORT", "Socket"), ("OXCCL_CHECK_MISMATCH", "0"), ("NCCL_CUDA", "0")]);
        assert_eq!(c.transport, Ok(TransportMode::Tcp));
        assert!(!c.check_mismatch && !c.cuda && c.cuda_ipc);
    }

    #[test]
    fn the_network_transport_and_its_provider() {
        let c = with(&[]);
        assert_eq!((c.net, c.ofi_provider, c.ofi_chunk, c.ofi_depth), (Ok(NetMode::Auto), None, 1 << 20, 4));
        assert_eq!(with(&[("NCCL_NET", "Socket")]).net, Ok(NetMode::Socket));
        assert_eq!(with(&[("OXCCL_NET", "OFI"), ("NCCL_NET", "socket")]).net, Ok(NetMode::Ofi));
        let e = with(&[("OXCCL_NET", "ib")]).net.expect_err("unknown");
        assert!(e.contains("OXCCL_NET=ib") && e.contains("auto, ofi, socket"), "{e}");
        let c = with(&[("FI_PROVIDER", "tcp"), ("OXCCL_OFI_PROVIDER", "verbs;ofi_rxm")]);
        assert_eq!(c.ofi_provider.as_deref(), Some("verbs;ofi_rxm"), "OXCCL_OFI_PROVIDER wins");
        assert_eq!(with(&[("FI_PROVIDER", "efa")]).ofi_provider.as_deref(), Some("efa"));
        let c = with(&[("OXCCL_OFI_CHUNK", "1"), ("OXCCL_OFI_DEPTH", "1000")]);
        assert_eq!((c.ofi_chunk, c.ofi_depth), (4096, 64), "clamped");
    }

    #[test]
    fn cma_parses_off_on_and_sizes() {
        let auto = Some(CmaSetting { min: CMA_DEFAULT_MIN, forced: false });
        assert_eq!(with(&[]).cma, auto);
        assert_eq!(with(&[("OXCCL_CMA", "auto")]).cma, auto);
        assert_eq!(with(&[("NCCL_CMA", "1")]).cma, Some(CmaSetting { min: CMA_DEFAULT_MIN, forced: true }));
        assert_eq!(with(&[("OXCCL_CMA", "0")]).cma, None);
        assert_eq!(with(&[("OXCCL_CMA", "16K")]).cma, Some(CmaSetting { min: 16 << 10, forced: true }));
        let bogus = with(&[("OXCCL_CMA", "bogus")]);
        assert_eq!(bogus.cma, auto);
        assert!(bogus.warnings.iter().any(|w| w.contains("OXCCL_CMA=bogus")), "{:?}", bogus.warnings);
    }

    #[test]
    fn dump_settings_and_bootstrap_settings_read_both_spellings() {
        let c = with(&[("OXCCL_DUMP", "/tmp/d"), ("NCCL_DUMP_SIGNAL", "1")]);
        assert_eq!((c.dump.as_deref(), c.dump_signal), (Some("/tmp/d"), true));
        let c = with(&[("OXCCL_DUMP", "  "), ("OXCCL_DUMP_SIGNAL", "2")]);
        assert_eq!((c.dump, c.dump_signal), (None, false));
        let vars: std::collections::HashMap<&str, &str> = [
            ("NCCL_COMM_ID", "10.0.0.1:5000"),
            ("OXCCL_COMM_ID_BIND_ANY", "yes"),
            ("OXCCL_SECRET", "pass"),
            ("NCCL_SOCKET_IFNAME", "=eth0"),
            ("OXCCL_HOSTID", "h1"),
        ]
        .into_iter()
        .collect();
        let b = BootstrapSettings::from_lookup(&|k| vars.get(k).map(|v| v.to_string()));
        assert_eq!(b.comm_id.as_deref(), Some("10.0.0.1:5000"));
        assert!(b.comm_id_bind_any);
        assert_eq!(
            (b.secret.as_deref(), b.socket_ifname.as_deref(), b.host_id.as_deref()),
            (Some("pass"), Some("=eth0"), Some("h1"))
        );
        assert_eq!(BootstrapSettings::from_lookup(&|_| None), BootstrapSettings::default());
    }

    #[test]
    fn wire_integrity_is_off_unless_set_to_non_zero_in_either_spelling() {
        assert!(!with(&[]).wire_integrity && !with(&[("OXCCL_WIRE_INTEGRITY", "0")]).wire_integrity);
        assert!(with(&[("OXCCL_WIRE_INTEGRITY", "1")]).wire_integrity);
        assert!(with(&[("NCCL_WIRE_INTEGRITY", "1")]).wire_integrity);
        assert!(!with(&[("OXCCL_WIRE_INTEGRITY", "0"), ("NCCL_WIRE_INTEGRITY", "1")]).wire_integrity);
    }

    #[test]
    fn compress_is_off_unless_set_to_a_known_encoding() {
        use crate::reduce::codec::Encoding;
        assert_eq!(with(&[]).compress, Encoding::Exact);
        assert_eq!(with(&[("OXCCL_COMPRESS", "bf16")]).compress, Encoding::Bf16);
        assert_eq!(with(&[("OXCCL_COMPRESS", "INT8")]).compress, Encoding::Int8);
        assert_eq!(with(&[("OXCCL_COMPRESS", "fp8")]).compress, Encoding::Fp8);
        let c = with(&[("OXCCL_COMPRESS", "zip")]);
        assert!(c.compress == Encoding::Exact && c.warnings.iter().any(|w| w.contains("OXCCL_COMPRESS=zip")));
    }

    #[test]
    fn deterministic_is_off_unless_set_to_non_zero() {
        assert!(!with(&[]).deterministic && !with(&[("OXCCL_DETERMINISTIC", "0")]).deterministic);
        assert!(with(&[("OXCCL_DETERMINISTIC", "1")]).deterministic);
        let c = with(&[("OXCCL_DETERMINISTIC", "yes")]);
        assert!(!c.deterministic && c.warnings.iter().any(|w| w.contains("OXCCL_DETERMINISTIC=yes")));
    }

    #[test]
    fn socket_counts_follow_nccl_rules_and_limits() {
        assert_eq!(with(&[("OXCCL_NSOCKS", "4"), ("NCCL_NSOCKS_PERTHREAD", "8")]).nsocks, 4, "OXCCL_NSOCKS wins");
        let f = with(&[("NCCL_SOCKET_IFNAME", "=rail0,rail1")]).socket_ifname.expect("parsed");
        assert!(f.exact && f.matches("rail1") && !f.matches("rail10"));
        assert_eq!(with(&[("OXCCL_SOCKET_IFNAME", "^")]).socket_ifname, None, "no entry: no filter");
        assert_eq!(with(&[("NCCL_NSOCKS_PERTHREAD", "2"), ("NCCL_SOCKET_NTHREADS", "3")]).nsocks, 6);
        assert_eq!(with(&[("NCCL_SOCKET_NTHREADS", "2")]).nsocks, 2);
        assert_eq!(with(&[("OXCCL_NSOCKS", "0")]).nsocks, 1, "at least one");
        assert_eq!(with(&[("OXCCL_NSOCKS", "1000")]).nsocks, MAX_SOCKS);
        let c = with(&[("OXCCL_NSOCKS", "many"), ("NCCL_NSOCKS_PERTHREAD", "2")]);
        assert_eq!(c.nsocks, 2, "unparsable counts as unset");
        assert!(c.warnings.iter().any(|w| w.contains("OXCCL_NSOCKS=many")), "{:?}", c.warnings);
        assert_eq!(with(&[("OXCCL_NTHREADS", "2"), ("NCCL_SOCKET_NTHREADS", "4")]).nthreads, 2);
        assert_eq!(with(&[("NCCL_SOCKET_NTHREADS", "4")]).nthreads, 4);
        assert_eq!(with(&[("OXCCL_NTHREADS", "x"), ("NCCL_SOCKET_NTHREADS", "3")]).nthreads, 3);
        assert_eq!(with(&[("OXCCL_NTHREADS", "999")]).nthreads, MAX_THREADS);
        assert_eq!(with(&[("OXCCL_SOCKET_STRIPE", "1K")]).socket_stripe, MIN_STRIPE);
        assert_eq!(with(&[("OXCCL_SHM_RING", "5000")]).shm_ring, Some(8192));
    }
}
