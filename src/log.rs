//! Debug logging as NCCL users expect it.
//!
//! - `OXCCL_DEBUG` / `NCCL_DEBUG`: `NONE`, `VERSION` (only the version line), `WARN` (the
//!   default), `INFO`, `TRACE`.
//! - `OXCCL_DEBUG_SUBSYS` / `NCCL_DEBUG_SUBSYS`: comma-separated subsystems shown at INFO and
//!   TRACE (`INIT`, `COLL`, `P2P`, `SHM`, `NET`, `BOOTSTRAP`, `TUNING`, `ENV`, `ALLOC`, `PROXY`,
//!   `ALL`); a leading `^` shows all but those. Unset: all (NCCL's default shows only INIT, ENV
//!   and BOOTSTRAP; oxccl's INFO lines are few, so it shows them all). WARN lines always show.
//! - `OXCCL_DEBUG_FILE` / `NCCL_DEBUG_FILE`: write to this file instead of stderr; `%h` becomes
//!   the host name, `%p` the process id, `%%` a percent sign. The file is appended to, so ranks
//!   that share one file lose nothing.
//!
//! Each line is `host:pid:tid OXCCL LEVEL message`, written with one `write(2)`, so lines of
//! ranks (or threads) that share a file or terminal never interleave mid-line.
//!
//! The first communicator of a process logs, at INFO, the version and every `OXCCL_*` /
//! `NCCL_*` variable set in the environment (secrets shown as `***`).
//!
//! This module reads only its own variables; messages about other settings take the spelling the
//! user actually set from [`var_name`].

use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::sync::{Mutex, Once, OnceLock};

/// Log levels of `OXCCL_DEBUG`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Nothing is printed (`NONE`, and `VERSION` apart from its version line).
    None = 0,
    /// Warnings (the default).
    Warn = 1,
    /// Information about choices made (transport, algorithm, interface).
    Info = 2,
    /// Per-operation tracing.
    Trace = 3,
}

/// The log level whose lines hold the details of an error of `code` (`None`: no hint).
pub fn detail_level(code: i32) -> Option<Level> {
    match code {
        1 | 2 => Some(Level::Info),
        4 | 5 => Some(Level::Warn),
        _ => None,
    }
}

/// The spelling of setting `name` the user set: `OXCCL_<name>` when set (non-empty), else
/// `NCCL_<name>` when set, else `OXCCL_<name>`. Messages use it so that a user who set
/// `NCCL_ALGO` reads `NCCL_ALGO`.
pub fn var_name(name: &str) -> String {
    crate::config::environ::spelling(name)
}

/// Reads `OXCCL_<name>`, else `NCCL_<name>` (empty counts as unset).
fn var(name: &str) -> Option<String> {
    crate::config::environ::twin(name)
}

/// What `OXCCL_DEBUG` asked for: (level, whether the version line is wanted).
fn debug_setting() -> (Level, bool) {
    static SETTING: OnceLock<(Level, bool)> = OnceLock::new();
    *SETTING.get_or_init(|| match var("DEBUG").map(|s| s.trim().to_ascii_uppercase()).as_deref() {
        Some("NONE") => (Level::None, false),
        Some("VERSION") => (Level::None, true),
        Some("INFO") => (Level::Info, true),
        Some("TRACE") => (Level::Trace, true),
        Some("WARN") | None => (Level::Warn, false),
        Some(other) => {
            // Said once, at WARN (the level used instead).
            let name = var_name("DEBUG");
            write_line(&format!(
                "{}OXCCL WARN {name}={other} is not NONE, VERSION, WARN, INFO or TRACE; using WARN",
                prefix()
            ));
            (Level::Warn, false)
        }
    })
}

/// The level set by `OXCCL_DEBUG` (`WARN` when unset).
pub fn level() -> Level {
    debug_setting().0
}

/// NCCL's subsystem names, each with the module paths (under `oxccl::`) it covers.
const SUBSYSTEMS: &[(&str, &[&str])] = &[
    ("BOOTSTRAP", &["bootstrap"]),
    ("NET", &["transport::tcp", "transport::tcp_threads"]),
    ("SHM", &["transport::shm"]),
    ("P2P", &["transport::mem", "device::ipc"]),
    ("PROXY", &["device::proxy"]),
    ("ALLOC", &["device::pinned", "device::state"]),
    ("TUNING", &["algo::tuning"]),
    ("COLL", &["coll", "algo", "engine", "group", "reduce", "api", "mismatch", "device::ops", "device::kernels"]),
    ("ENV", &["config", "log"]),
    ("INIT", &[""]),
];

/// The subsystem of a module path such as `oxccl::transport::tcp` (the first match in
/// `SUBSYSTEMS`; `INIT` for the rest).
pub fn subsystem(module: &str) -> &'static str {
    let m = module.strip_prefix("oxccl::").unwrap_or(if module == "oxccl" { "" } else { module });
    for (name, prefixes) in SUBSYSTEMS {
        for p in *prefixes {
            if p.is_empty() || m == *p || m.strip_prefix(p).is_some_and(|rest| rest.starts_with("::")) {
                return name;
            }
        }
    }
    "INIT"
}

/// Whether subsystem `sub` is shown at INFO/TRACE under `OXCCL_DEBUG_SUBSYS` = `spec`.
pub fn subsys_enabled(spec: Option<&str>, sub: &str) -> bool {
    let Some(spec) = spec.map(str::trim).filter(|s| !s.is_empty()) else { return true };
    let (invert, list) = match spec.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, spec),
    };
    let listed = list.split(',').map(str::trim).any(|s| s.eq_ignore_ascii_case(sub) || s.eq_ignore_ascii_case("ALL"));
    listed != invert
}

/// `OXCCL_DEBUG_SUBSYS` as set (read once).
fn subsys_spec() -> Option<&'static str> {
    static SPEC: OnceLock<Option<String>> = OnceLock::new();
    SPEC.get_or_init(|| var("DEBUG_SUBSYS")).as_deref()
}

/// Whether a line at `lvl` from module `module` is written.
pub fn enabled(lvl: Level, module: &str) -> bool {
    lvl != Level::None && lvl <= level() && (lvl == Level::Warn || subsys_enabled(subsys_spec(), subsystem(module)))
}

/// Expands `%h` (host name), `%p` (process id) and `%%` in a `DEBUG_FILE` pattern.
pub fn expand_file_name(pattern: &str, host: &str, pid: u32) -> String {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('h') => out.push_str(host),
            Some('p') => out.push_str(&pid.to_string()),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// The log file of `OXCCL_DEBUG_FILE`, or None for stderr (also when the file cannot be
/// opened, which is said once on stderr).
fn sink() -> Option<&'static File> {
    static FILE: OnceLock<Option<File>> = OnceLock::new();
    FILE.get_or_init(|| {
        let pattern = var("DEBUG_FILE")?;
        let path = expand_file_name(pattern.trim(), &crate::net::hostname(), std::process::id());
        // This user's file only: mode 0600 when created, and a symlink planted at the name is
        // refused, not followed.
        use std::os::unix::fs::OpenOptionsExt;
        let mut o = std::fs::OpenOptions::new();
        o.create(true).append(true).mode(0o600).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
        match o.open(&path) {
            Ok(f) => Some(f),
            Err(e) => {
                let name = var_name("DEBUG_FILE");
                let line = format!("{}OXCCL WARN {name}: cannot open {path} ({e}); logging to stderr\n", prefix());
                let _ = std::io::stderr().lock().write_all(line.as_bytes());
                None
            }
        }
    })
    .as_ref()
}

/// `host:pid:tid ` (NCCL's line prefix).
fn prefix() -> String {
    static HOST: OnceLock<String> = OnceLock::new();
    let host = HOST.get_or_init(crate::net::hostname);
    // SAFETY: gettid takes no arguments and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    format!("{host}:{}:{tid} ", std::process::id())
}

/// Writes `line` (a newline is added) with one `write(2)` to the log file or stderr.
fn write_line(line: &str) {
    let mut buf = String::with_capacity(line.len() + 1);
    buf.push_str(line);
    buf.push('\n');
    // `write_all` on an unbuffered file issues one write for the whole line; it loops only
    // if the kernel took part of it (a full pipe), which never splits lines of whole writes
    // up to PIPE_BUF and is rare beyond.
    let _ = match sink() {
        Some(mut f) => f.write_all(buf.as_bytes()),
        None => std::io::stderr().lock().write_all(buf.as_bytes()),
    };
}

/// Logs `msg` at `lvl` for module `module` (its subsystem decides whether INFO/TRACE shows).
pub fn log_from(lvl: Level, module: &str, msg: &str) {
    if !enabled(lvl, module) {
        return;
    }
    let tag = match lvl {
        Level::Warn => "WARN",
        Level::Info => "INFO",
        _ => "TRACE",
    };
    write_line(&format!("{}OXCCL {tag} {msg}", prefix()));
}

/// Logs `msg` at `lvl` (subsystem INIT).
pub fn log(lvl: Level, msg: &str) {
    log_from(lvl, "oxccl", msg);
}

/// Logs `msg` at WARN unless the same text was logged before in this process (a setting read
/// again for every communicator warns once).
pub fn warn_once(msg: &str) {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let fresh = crate::sync::lock(SEEN.get_or_init(Default::default)).insert(msg.to_string());
    if fresh {
        log(Level::Warn, msg);
    }
}

/// At communicator creation: logs once at WARN each problem found reading `config` and the
/// process-wide settings ([`crate::config::process`]), which the config module only collects.
pub fn config_warnings(config: &crate::config::Config) {
    for w in config.warnings.iter().chain(&crate::config::process().warnings) {
        warn_once(w);
    }
}

/// Variables whose values are not printed.
fn is_secret(key: &str) -> bool {
    key.ends_with("_SECRET") || key.ends_with("_UNIQUE_ID") || key.contains("PASSWORD") || key.contains("TOKEN")
}

/// Once per process, at communicator creation: the version line (at `VERSION`, `INFO` and
/// `TRACE`) and, at INFO, every `OXCCL_*` / `NCCL_*` variable set in the environment.
pub fn banner() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let (lvl, version) = debug_setting();
        if version {
            write_line(&format!(
                "{}OXCCL INFO oxccl version {} (NCCL API {}.{}.{})",
                prefix(),
                env!("CARGO_PKG_VERSION"),
                crate::NCCL_MAJOR,
                crate::NCCL_MINOR,
                crate::NCCL_PATCH
            ));
        }
        if lvl >= Level::Info && subsys_enabled(subsys_spec(), "ENV") {
            let vars = crate::config::environ::settings().into_iter().filter(|(k, _)| k != "OXCCL_TEST_CHILD");
            for (k, v) in vars {
                let v = if is_secret(&k) { "***".to_string() } else { v };
                write_line(&format!("{}OXCCL INFO {k} set by environment to {v}", prefix()));
            }
        }
    });
}

/// A hint for an error string: where the details of an error logged at `needed` are.
/// `" (details in the WARN line logged before)"` when that level is on, else
/// `" (run with NCCL_DEBUG=WARN for details)"` naming the spelling the user set.
pub fn detail_hint(needed: Level) -> String {
    let tag = if needed >= Level::Info { "INFO" } else { "WARN" };
    if level() >= needed {
        format!(" (details in the {tag} lines logged before)")
    } else {
        format!(" (run with {}={tag} for details)", var_name("DEBUG"))
    }
}

/// Logs at INFO (formatted lazily), under the subsystem of the calling module.
#[macro_export]
macro_rules! info {
    ($($t:tt)*) => { if $crate::log::enabled($crate::log::Level::Info, module_path!()) { $crate::log::log_from($crate::log::Level::Info, module_path!(), &format!($($t)*)) } };
}

/// Logs at WARN.
#[macro_export]
macro_rules! warn {
    ($($t:tt)*) => { if $crate::log::enabled($crate::log::Level::Warn, module_path!()) { $crate::log::log_from($crate::log::Level::Warn, module_path!(), &format!($($t)*)) } };
}

/// Logs at TRACE (formatted lazily), under the subsystem of the calling module.
#[macro_export]
macro_rules! trace {
    ($($t:tt)*) => { if $crate::log::enabled($crate::log::Level::Trace, module_path!()) { $crate::log::log_from($crate::log::Level::Trace, module_path!(), &format!($($t)*)) } };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_expand() {
        assert_eq!(expand_file_name("/tmp/nccl.%h.%p.log", "node1", 42), "/tmp/nccl.node1.42.log");
        assert_eq!(expand_file_name("a%%b%q%", "h", 1), "a%b%q%");
    }

    #[test]
    fn subsystems_follow_modules() {
        assert_eq!(subsystem("oxccl::bootstrap::root"), "BOOTSTRAP");
        assert_eq!(subsystem("oxccl::transport::tcp"), "NET");
        assert_eq!(subsystem("oxccl::transport::tcp_threads"), "NET");
        assert_eq!(subsystem("oxccl::transport::shm"), "SHM");
        assert_eq!(subsystem("oxccl::transport::select"), "INIT");
        assert_eq!(subsystem("oxccl::algo::tuning"), "TUNING");
        assert_eq!(subsystem("oxccl::algo::ring"), "COLL");
        assert_eq!(subsystem("oxccl::coll"), "COLL");
        assert_eq!(subsystem("oxccl::comm"), "INIT");
        assert_eq!(subsystem("oxccl::collx"), "INIT");
        assert_eq!(subsystem("oxccl"), "INIT");
    }

    #[test]
    fn subsys_lists_select_and_invert() {
        assert!(subsys_enabled(None, "NET"));
        assert!(subsys_enabled(Some("INIT,NET"), "NET"));
        assert!(!subsys_enabled(Some("INIT,NET"), "COLL"));
        assert!(subsys_enabled(Some("all"), "COLL"));
        assert!(!subsys_enabled(Some("^NET"), "NET"));
        assert!(subsys_enabled(Some("^NET"), "INIT"));
        assert!(subsys_enabled(Some(" init , coll "), "COLL"));
    }

    #[test]
    fn secrets_are_hidden() {
        assert!(is_secret("OXCCL_SECRET"));
        assert!(is_secret("NCCL_SECRET"));
        assert!(is_secret("OXCCL_UNIQUE_ID"));
        assert!(!is_secret("NCCL_SOCKET_IFNAME"));
    }
}
