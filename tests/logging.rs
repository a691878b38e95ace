//! Logging as NCCL users expect (src/log.rs): 4 ranks at INFO sharing one stderr (and one
//! `DEBUG_FILE`) never tear a line; `%h`/`%p` in `NCCL_DEBUG_FILE`; the version and the
//! environment are printed once; messages name the variable spelling the user set.

mod common;

use oxccl::{Communicator, ReduceOp};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Lines each logging thread of a rank writes, and threads per rank.
const LINES: usize = 300;
const THREADS: usize = 3;

/// A rank: joins, all-reduces (checked against the exact sum), then logs `LINES` numbered
/// lines from each of `THREADS` threads, each line carrying a payload whose length it states.
#[test]
fn child_logs() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let comm = Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).expect("init");
    let send: Vec<f64> = (0..1000).map(|i| (i * (rank + 1)) as f64).collect();
    let mut recv = vec![0.0; 1000];
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("all_reduce");
    let ranks_sum = (n * (n + 1) / 2) as f64;
    assert!(recv.iter().enumerate().all(|(i, &v)| v == i as f64 * ranks_sum));
    std::thread::scope(|s| {
        for t in 0..THREADS {
            s.spawn(move || {
                for i in 0..LINES {
                    let len = 50 + (i * 37 + t * 11 + rank * 7) % 400;
                    let payload = "x".repeat(len);
                    oxccl::log::log_from(
                        oxccl::log::Level::Info,
                        "oxccl::coll",
                        &format!("stress rank {rank} thread {t} line {i} len {len} {payload}"),
                    );
                }
            });
        }
    });
}

/// Starts `n` ranks of `child_logs` whose stderr all go to `err` (one shared open file).
fn spawn_sharing_stderr(n: usize, err: &File, env: &[(&str, String)]) -> Vec<std::process::Child> {
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = oxccl::UniqueId::new().expect("unique id");
    let exe = std::env::current_exe().expect("current exe");
    (0..n)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args(["child_logs", "--exact", "--nocapture", "--test-threads=1"])
                .env(common::CHILD_ENV, "1")
                .env("OXCCL_RANK", r.to_string())
                .env("OXCCL_NRANKS", n.to_string())
                .env("OXCCL_UNIQUE_ID", id.to_hex())
                .env_remove("OXCCL_DEBUG_FILE")
                .env_remove("NCCL_DEBUG_FILE")
                .env_remove("OXCCL_DEBUG")
                .env_remove("NCCL_DEBUG")
                .stdout(Stdio::null())
                .stderr(err.try_clone().expect("dup stderr file"));
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn().expect("spawn rank")
        })
        .collect()
}

/// Waits for every child (killing all after `limit`) and asserts they succeeded.
fn wait_ok(children: Vec<std::process::Child>, limit: Duration, log: &Path) {
    let res = common::wait_all(children, limit);
    let text = std::fs::read_to_string(log).unwrap_or_default();
    assert!(res.iter().all(|r| r.0), "a rank failed; its output:\n{text}");
}

/// Checks that every line of `text` is a whole log line, and that the stress lines of `n`
/// ranks all arrived intact. Returns the log lines that are not stress lines.
fn check_lines(text: &str, n: usize) -> Vec<String> {
    let mut seen = vec![vec![vec![false; LINES]; THREADS]; n];
    let mut other = Vec::new();
    for line in text.lines() {
        // host:pid:tid OXCCL LEVEL message
        let (head, rest) = line.split_once(' ').unwrap_or_else(|| panic!("torn or foreign line: {line:?}"));
        let parts: Vec<&str> = head.split(':').collect();
        assert!(
            parts.len() == 3 && parts[1].parse::<u32>().is_ok() && parts[2].parse::<u64>().is_ok(),
            "line without host:pid:tid prefix (torn?): {line:?}"
        );
        let msg = ["OXCCL INFO ", "OXCCL WARN ", "OXCCL TRACE "]
            .iter()
            .find_map(|t| rest.strip_prefix(t))
            .unwrap_or_else(|| panic!("line without OXCCL LEVEL: {line:?}"));
        let Some(stress) = msg.strip_prefix("stress ") else {
            other.push(msg.to_string());
            continue;
        };
        let w: Vec<&str> = stress.split(' ').collect();
        assert_eq!(w.len(), 9, "stress line in pieces: {line:?}");
        let (r, t, i, len): (usize, usize, usize, usize) =
            (w[1].parse().unwrap(), w[3].parse().unwrap(), w[5].parse().unwrap(), w[7].parse().unwrap());
        assert!(w[8].len() == len && w[8].bytes().all(|b| b == b'x'), "stress payload torn: {line:?}");
        assert!(!seen[r][t][i], "stress line twice: {line:?}");
        seen[r][t][i] = true;
    }
    let missing = seen.iter().flatten().flatten().filter(|s| !**s).count();
    assert_eq!(missing, 0, "{missing} stress lines missing");
    other
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxccl-logging-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// 4 ranks at INFO writing to one shared stderr: no torn lines, nothing lost, the version line
/// and the environment printed once per rank, no Rust Debug formatting in the lines.
#[test]
fn four_ranks_at_info_share_stderr_without_torn_lines() {
    if common::child_role().is_some() {
        return;
    }
    let dir = temp_dir("stderr");
    let path = dir.join("stderr.log");
    let err = OpenOptions::new().create(true).append(true).open(&path).unwrap();
    let env = [("OXCCL_DEBUG", "INFO".to_string()), ("NCCL_SOCKET_BUF", "1M".to_string())];
    let kids = spawn_sharing_stderr(4, &err, &env);
    wait_ok(kids, Duration::from_secs(120), &path);
    let text = std::fs::read_to_string(&path).unwrap();
    let other = check_lines(&text, 4);
    let count = |s: &str| other.iter().filter(|l| l.contains(s)).count();
    assert_eq!(count("oxccl version "), 4, "one version line per rank:\n{}", other.join("\n"));
    assert_eq!(count("OXCCL_DEBUG set by environment to INFO"), 4, "{}", other.join("\n"));
    assert_eq!(count("NCCL_SOCKET_BUF set by environment to 1M"), 4, "{}", other.join("\n"));
    assert_eq!(count("OXCCL_UNIQUE_ID set by environment to ***"), 4, "the id is not printed");
    assert!(count("joined; data listener 127.0.0.1:") == 4, "{}", other.join("\n"));
    for l in &other {
        assert!(!l.contains("Some(") && !l.contains("None"), "Debug formatting leaked: {l}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `NCCL_DEBUG_FILE` with `%h` and `%p`: one file per rank named by host and pid, nothing at
/// INFO on stderr; a shared file (no `%p`) also keeps every line whole. The user set the
/// `NCCL_*` spellings, and messages name them.
#[test]
fn nccl_debug_file_per_process_and_shared() {
    if common::child_role().is_some() {
        return;
    }
    let dir = temp_dir("file");
    let host = oxccl::bootstrap::hostname();
    // One file per process.
    let err_path = dir.join("stderr.log");
    let err = OpenOptions::new().create(true).append(true).open(&err_path).unwrap();
    let pattern = dir.join("nccl.%h.%p.log").to_string_lossy().into_owned();
    let env =
        [("NCCL_DEBUG", "INFO".to_string()), ("NCCL_DEBUG_FILE", pattern), ("NCCL_ALGO", "ring,bogus".to_string())];
    let kids = spawn_sharing_stderr(2, &err, &env);
    let pids: Vec<u32> = kids.iter().map(|c| c.id()).collect();
    wait_ok(kids, Duration::from_secs(120), &err_path);
    let stderr = std::fs::read_to_string(&err_path).unwrap();
    assert!(!stderr.contains("OXCCL INFO"), "INFO went to stderr despite NCCL_DEBUG_FILE:\n{stderr}");
    for pid in pids {
        let f = dir.join(format!("nccl.{host}.{pid}.log"));
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(text.lines().all(|l| l.starts_with(&format!("{host}:{pid}:"))), "foreign line in {}", f.display());
        assert!(text.contains("NCCL_DEBUG set by environment to INFO"), "{text}");
        assert!(text.contains("NCCL_ALGO=ring,bogus: ignoring unknown algorithm(s) bogus"), "{text}");
        assert!(!text.contains("OXCCL_ALGO"), "named a variable the user did not set:\n{text}");
    }
    // One file shared by 4 ranks.
    let shared = dir.join("shared.log");
    let env = [("NCCL_DEBUG", "INFO".to_string()), ("NCCL_DEBUG_FILE", shared.to_string_lossy().into_owned())];
    let kids = spawn_sharing_stderr(4, &err, &env);
    wait_ok(kids, Duration::from_secs(120), &err_path);
    check_lines(&std::fs::read_to_string(&shared).unwrap(), 4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `NCCL_DEBUG=VERSION` prints the version line only; `NCCL_DEBUG_SUBSYS=^INIT,ENV` hides
/// those subsystems' INFO lines but not the others (COLL).
#[test]
fn version_level_and_subsystem_filter() {
    if common::child_role().is_some() {
        return;
    }
    let dir = temp_dir("subsys");
    let path = dir.join("stderr.log");
    let err = OpenOptions::new().create(true).append(true).open(&path).unwrap();
    wait_ok(spawn_sharing_stderr(2, &err, &[("NCCL_DEBUG", "VERSION".to_string())]), Duration::from_secs(120), &path);
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "VERSION: one line per rank:\n{text}");
    assert!(lines.iter().all(|l| l.contains("OXCCL INFO oxccl version ")), "{text}");

    let path = dir.join("stderr2.log");
    let err = OpenOptions::new().create(true).append(true).open(&path).unwrap();
    let env = [("NCCL_DEBUG", "INFO".to_string()), ("NCCL_DEBUG_SUBSYS", "^INIT,ENV".to_string())];
    wait_ok(spawn_sharing_stderr(2, &err, &env), Duration::from_secs(120), &path);
    let text = std::fs::read_to_string(&path).unwrap();
    let other = check_lines(&text, 2);
    assert!(!other.iter().any(|l| l.contains("joined; data listener")), "INIT line shown:\n{text}");
    assert!(!other.iter().any(|l| l.contains("set by environment")), "ENV line shown:\n{text}");
    assert!(other.iter().any(|l| l.contains("all_reduce of 8000 B")), "COLL line hidden:\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
