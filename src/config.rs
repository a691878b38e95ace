//! Settings (logging itself is in [`crate::log`]).
//!
//! Every environment variable the library reads (`OXCCL_X`, falling back to its `NCCL_X` twin)
//! is read here, into the typed [`Config`]: once when a communicator is made, then passed
//! down (planning code in [`crate::algo`] reads nothing). A bad value is ignored and named,
//! with the spelling the user actually set, in [`Config::warnings`]; the communicator logs
//! those once at WARN ([`crate::log::config_warnings`]), so this module uses no other module
//! of the crate.
//!
//! What runs before any communicator exists (the bootstrap's interface, host id, launcher and
//! rendezvous variables, the CUDA driver probe, the log level) goes through [`env()`] or
//! [`process`] here too, or through the raw reader [`environ`], so no other module touches
//! `std::env`.

use std::sync::OnceLock;
use std::time::Duration;

pub mod environ;
mod ifname;
mod settings;
pub use ifname::IfFilter;
pub use settings::{
    BootstrapSettings, CmaSetting, Config, NetMode, TransportMode, CMA_DEFAULT_MIN, MAX_SOCKS, MAX_THREADS, MIN_STRIPE,
};

/// Reads `OXCCL_<name>`, falling back to `NCCL_<name>`; empty values count as unset.
pub fn env(name: &str) -> Option<String> {
    environ::twin(name)
}

/// `OXCCL_<name>` or `NCCL_<name>` looked up through `get`: the spelling found first with a
/// non-empty value, and the value.
fn lookup(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<(String, String)> {
    [format!("OXCCL_{name}"), format!("NCCL_{name}")]
        .into_iter()
        .find_map(|k| get(&k).filter(|v| !v.trim().is_empty()).map(|v| (k, v)))
}

/// The settings of this process, read from the environment on first use.
///
/// For what has no communicator at hand (the CUDA driver probe, socket tuning of a bare
/// stream, the old reader functions). A communicator reads its own [`Config`] when it is made
/// ([`Config::from_env`]), so a variable changed in between applies to later communicators.
pub fn process() -> &'static Config {
    static P: OnceLock<Config> = OnceLock::new();
    P.get_or_init(Config::from_env)
}

/// Parses `123`, `64K`, `4M`, `1G` (binary multiples) into a number.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1u64 << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

/// Default bound on a collective or connection step that makes no progress.
pub const DEFAULT_TIMEOUT_MS: u64 = 300_000;

/// `OXCCL_TIMEOUT_MS` of this process ([`process`]): how long any blocking wait may go without
/// progress (default 5 minutes). A communicator's own bound is its [`Config::timeout`].
pub fn timeout() -> Duration {
    process().timeout
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_parse() {
        assert_eq!(super::parse_size("8"), Some(8));
        assert_eq!(super::parse_size("64K"), Some(65536));
        assert_eq!(super::parse_size("128M"), Some(128 << 20));
        assert_eq!(super::parse_size("1g"), Some(1 << 30));
        assert_eq!(super::parse_size("x"), None);
        assert_eq!(super::parse_size(""), None);
    }
}
