//! Shared helpers for multi-process tests: ranks are copies of the test binary itself,
//! started with an environment that makes one named test act as a rank.
#![allow(dead_code)]

pub mod allreduce;
pub mod cprog;
pub mod netns;
pub mod planless;
pub mod standin;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Prints `SKIPPED: {test}: {what}` where the test run's output shows it even when the test
/// passes: libtest captures `eprintln!` of passing tests, but not writes to the process's stderr.
/// `{test}` is the running test's name (libtest names each test's thread after it);
/// scripts/test-summary.py counts a test that printed this line as skipped, not passed.
pub fn skipped(what: &str) {
    use std::io::Write;
    let line = match std::thread::current().name() {
        Some(test) if test != "main" => format!("SKIPPED: {test}: {what}\n"),
        _ => format!("SKIPPED: {what}\n"),
    };
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Environment variable that turns a test process into a rank.
pub const CHILD_ENV: &str = "OXCCL_TEST_CHILD";

/// When this process is a rank started by [`spawn_ranks`], returns (rank, nranks, id hex).
pub fn child_role() -> Option<(usize, usize, String)> {
    std::env::var(CHILD_ENV).ok()?;
    let rank = std::env::var("OXCCL_RANK").ok()?.parse().ok()?;
    let n = std::env::var("OXCCL_NRANKS").ok()?.parse().ok()?;
    let id = std::env::var("OXCCL_UNIQUE_ID").ok()?;
    Some((rank, n, id))
}

/// Starts `n` copies of this test binary running test `entry` as ranks of one communicator
/// (whose root runs in this process), waits for all (killing them after `limit`), and returns
/// each rank's (success, stderr).
pub fn run_ranks(entry: &str, n: usize, extra_env: &[(&str, String)], limit: Duration) -> Vec<(bool, String)> {
    wait_all(spawn_ranks(entry, n, extra_env), limit)
}

/// Starts `n` copies of this test binary running test `entry` as ranks of one communicator
/// (whose root runs in this process), stderr piped; the caller waits for them.
pub fn spawn_ranks(entry: &str, n: usize, extra_env: &[(&str, String)]) -> Vec<Child> {
    // Ranks of these tests all live on this machine: rendezvous over loopback only.
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    spawn_ranks_with_id(&oxccl::UniqueId::new().expect("unique id"), entry, n, extra_env)
}

/// As [`spawn_ranks`], for a unique id the caller made.
pub fn spawn_ranks_with_id(id: &oxccl::UniqueId, entry: &str, n: usize, extra_env: &[(&str, String)]) -> Vec<Child> {
    let exe = std::env::current_exe().expect("current exe");
    (0..n)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args([entry, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, "1")
                .env("OXCCL_RANK", r.to_string())
                .env("OXCCL_NRANKS", n.to_string())
                .env("OXCCL_UNIQUE_ID", id.to_hex())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            for (k, v) in extra_env {
                c.env(k, v);
            }
            c.spawn().expect("spawn rank")
        })
        .collect()
}

/// The unique id (hex) that rank 0, the only child in `children` so far, writes into `file`
/// once it has made it; removes the file. Panics with rank 0's output when none comes within
/// 30 s.
pub fn unique_id_from(file: &std::path::Path, children: &mut Vec<Child>) -> String {
    let t = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(file) {
            let _ = std::fs::remove_file(file);
            return s;
        }
        if t.elapsed() > Duration::from_secs(30) {
            let outs = wait_all(std::mem::take(children), Duration::ZERO);
            panic!("rank 0 made no unique id within 30 s:\n{}", outs[0].1);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for children, killing all of them once `limit` passes; returns (success, stderr).
pub fn wait_all(mut children: Vec<Child>, limit: Duration) -> Vec<(bool, String)> {
    let start = Instant::now();
    let mut status = vec![None; children.len()];
    while status.iter().any(Option::is_none) {
        for (i, c) in children.iter_mut().enumerate() {
            if status[i].is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    status[i] = Some(s.success());
                }
            }
        }
        if start.elapsed() > limit {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .zip(status)
        .map(|(c, s)| {
            let out = c.wait_with_output().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).unwrap_or_default();
            (s.unwrap_or(false), out)
        })
        .collect()
}

/// Asserts that every rank succeeded, showing the failures' stderr.
pub fn assert_all_ok(results: &[(bool, String)]) {
    let bad: Vec<String> =
        results.iter().enumerate().filter(|(_, r)| !r.0).map(|(i, r)| format!("--- rank {i} ---\n{}", r.1)).collect();
    assert!(bad.is_empty(), "ranks failed:\n{}", bad.join("\n"));
}

/// Deterministic test input of `rank` at index `i`: small integers, valid for every type
/// (non-negative for unsigned types; only -1, 1, 2 for products, so nothing overflows).
pub fn input(rank: usize, i: usize, seed: usize, unsigned: bool, for_prod: bool) -> f64 {
    let h = (i.wrapping_mul(2654435761) ^ rank.wrapping_mul(40503) ^ seed.wrapping_mul(97)) % 17;
    if for_prod {
        // At most 4 ranks contribute a 2, so products stay within every type's range.
        let mag = if rank < 4 && h % 4 == 2 { 2.0 } else { 1.0 };
        return mag * if unsigned || h % 3 != 0 { 1.0 } else { -1.0 };
    }
    if unsigned {
        h as f64
    } else {
        h as f64 - 8.0
    }
}

/// Relative precision of each type (unit roundoff, doubled for safety on narrow types); 0 for
/// integer types.
pub fn eps(t: oxccl::DataType) -> f64 {
    use oxccl::DataType;
    match t {
        DataType::Float8e4m3 => 0.125,
        DataType::Float8e5m2 => 0.25,
        DataType::Float16 => 2f64.powi(-10),
        DataType::Bfloat16 => 2f64.powi(-7),
        DataType::Float32 => 2f64.powi(-23),
        DataType::Float64 => 2f64.powi(-52),
        _ => 0.0,
    }
}

/// The TCP ports `pid` listens on at 127.0.0.1 (its descriptors' socket inodes in /proc).
pub fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (a, port) = f.get(1)?.split_once(':')?;
            (a == "0100007F" && *f.get(3)? == "0A" && inodes.contains(*f.get(9)?))
                .then(|| u16::from_str_radix(port, 16).ok())?
        })
        .collect()
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Resident set size of this process in KiB (`VmRSS`).
pub fn rss_kb() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
