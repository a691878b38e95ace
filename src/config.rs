//! Environment knobs (`OXCCL_*`, each falling back to its `NCCL_*` twin); logging is in [`crate::log`].

use std::time::Duration;

/// Reads `OXCCL_<name>`, falling back to `NCCL_<name>`; empty values count as unset.
pub fn env(name: &str) -> Option<String> {
    [format!("OXCCL_{name}"), format!("NCCL_{name}")]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .find(|v| !v.trim().is_empty())
}

/// Reads a numeric knob; an unparsable value is reported once at WARN and ignored.
pub fn env_u64(name: &str) -> Option<u64> {
    let v = env(name)?;
    match parse_size(&v) {
        Some(n) => Some(n),
        None => {
            crate::warn!("ignoring {}={v}: not a number", crate::log::var_name(name));
            None
        }
    }
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

/// `OXCCL_TIMEOUT_MS`: how long any blocking wait may go without progress (default 5 minutes).
pub fn timeout() -> Duration {
    Duration::from_millis(env_u64("TIMEOUT_MS").filter(|&v| v > 0).unwrap_or(DEFAULT_TIMEOUT_MS))
}

// Logging lives in src/log.rs; these names stay for existing callers.
pub use crate::log::{level, log, Level};

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
