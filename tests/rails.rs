//! TCP links over several NICs (rails): two stand-in hosts made by scripts/netns-rails.sh (two
//! network namespaces joined by two veth pairs, rail0 and rail1, on two subnets, each with a
//! private /dev/shm), one rank each, `OXCCL_SOCKET_IFNAME` naming both rails. Every rank checks
//! all-reduces (out of place and in place, sizes from one element to several stripes per
//! socket) against the f64 sum of every rank's input, and the parent checks in the INFO logs
//! that the link to the other host runs on both rails.
//!
//! Without root or iproute2 the tests print `SKIPPED: ...` and pass.

mod common;

use oxccl::{Communicator, ReduceOp};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Variable that makes this binary a rank.
const CHILD: &str = "RAILS_CHILD";

/// The namespaces of one test, removed on drop.
struct Rails {
    prefix: String,
}

impl Rails {
    /// Two hosts with two unshaped rails; `None` after a SKIP line when they cannot be made.
    fn up(tag: &str) -> Option<Rails> {
        let r = Rails { prefix: format!("oxr{}{tag}", std::process::id() % 100_000) };
        if !r.script(&["up", "none", "none"]) {
            common::skipped(&format!("rails {tag}: cannot create network namespaces (needs root and iproute2)"));
            return None;
        }
        Some(r)
    }

    fn script(&self, args: &[&str]) -> bool {
        Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"))
            .args(args)
            .env("OXR_PREFIX", &self.prefix)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Runs ranks 0 and 1 (host 0 and 1) with `env`; returns each one's (success, stderr).
    fn run(&self, env: &[(&str, &str)]) -> Vec<(bool, String)> {
        common::wait_all(self.spawn(env), Duration::from_secs(180))
    }

    /// Starts ranks 0 and 1 (host 0 and 1) with `env`.
    fn spawn(&self, env: &[(&str, &str)]) -> Vec<std::process::Child> {
        let entry = match () {
            _ if env.iter().any(|(k, _)| *k == CUTS) => "child_cuts_in_turn",
            _ if env.iter().any(|(k, _)| *k == CUT) => "child_failover",
            _ => "child_rails",
        };
        (0..2)
            .map(|rank| {
                let mut c = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"));
                c.args(["run", &rank.to_string()])
                    .arg(std::env::current_exe().unwrap())
                    .args([entry, "--exact", "--nocapture", "--test-threads=1"])
                    .env("OXR_PREFIX", &self.prefix)
                    .env(CHILD, "1")
                    .env("OXCCL_RANK", rank.to_string())
                    .env("OXCCL_NRANKS", "2")
                    .env("MASTER_ADDR", "10.231.0.1")
                    .env("MASTER_PORT", "29571")
                    .env("OXCCL_TIMEOUT_MS", "60000")
                    .env("OXCCL_DEBUG", "INFO")
                    .env_remove("OXCCL_HOSTID")
                    .env_remove("OXCCL_TRANSPORT")
                    .env_remove("OXCCL_NET")
                    .env_remove("OXCCL_SOCKET_IFNAME")
                    .env_remove("NCCL_SOCKET_IFNAME")
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped());
                for (k, v) in env {
                    c.env(k, v);
                }
                c.spawn().expect("spawn a rank in its namespace")
            })
            .collect()
    }

    /// Runs ranks with `env` and the failover child's calls; once both have made their first
    /// calls, takes `links` of host 0 down and lets them go on. Returns (success, stderr).
    fn run_and_cut(&self, env: &[(&str, &str)], links: &[&str]) -> Vec<(bool, String)> {
        let sync = std::env::temp_dir().join(format!("{}-sync", self.prefix));
        let _ = std::fs::remove_dir_all(&sync);
        std::fs::create_dir_all(&sync).unwrap();
        let sync_s = sync.to_str().unwrap();
        let mut env = env.to_vec();
        env.push((SYNC, sync_s));
        let children = self.spawn(&env);
        let cut: Vec<String> = links.iter().map(|l| format!("ip -n {}0 link set {l} down", self.prefix)).collect();
        cut_when_ready(children, &sync, Duration::from_secs(120), &cut.join(" && "), Duration::from_secs(180))
    }
}

impl Drop for Rails {
    fn drop(&mut self) {
        self.script(&["down"]);
    }
}

/// Once every child has written `ready.<rank>` into `sync` (or one has exited, or `ready`
/// has passed), runs the shell command `cut` (which must succeed), writes `down` there for
/// the children to go on, and waits up to `total` for them; removes `sync`. (success, stderr)
/// per child.
fn cut_when_ready(
    mut children: Vec<std::process::Child>,
    sync: &std::path::Path,
    ready: Duration,
    cut: &str,
    total: Duration,
) -> Vec<(bool, String)> {
    let n = children.len();
    let deadline = std::time::Instant::now() + ready;
    while !(0..n).all(|r| sync.join(format!("ready.{r}")).exists()) {
        if std::time::Instant::now() > deadline || children.iter_mut().any(|c| c.try_wait().ok().flatten().is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let ok = Command::new("sh").args(["-c", cut]).status().is_ok_and(|s| s.success());
    assert!(ok, "{cut} failed");
    std::fs::write(sync.join("down"), b"").unwrap();
    let outs = common::wait_all(children, total);
    let _ = std::fs::remove_dir_all(sync);
    outs
}

/// A rank: all-reduces of several sizes, checked against the f64 sum of both ranks' inputs.
#[test]
fn child_rails() {
    if std::env::var(CHILD).is_err() {
        return;
    }
    let comm = Communicator::from_env().expect("init from the launcher environment");
    let (rank, n) = (comm.rank(), comm.size());
    for (k, count) in [1usize, 4_099, 300_007, (3 << 20) + 5].into_iter().enumerate() {
        let seed = 7 + k;
        let mine: Vec<f32> = (0..count).map(|i| common::input(rank, i, seed, false, false) as f32).collect();
        let want: Vec<f64> =
            (0..count).map(|i| (0..n).map(|r| common::input(r, i, seed, false, false)).sum()).collect();
        let mut out = vec![0f32; count];
        comm.all_reduce(&mine, &mut out, ReduceOp::Sum).expect("all-reduce");
        let mut inplace = mine.clone();
        comm.all_reduce_in_place(&mut inplace, ReduceOp::Sum).expect("in-place all-reduce");
        for (name, got) in [("out of place", &out), ("in place", &inplace)] {
            let bad = (0..count).filter(|&i| f64::from(got[i]) != want[i]).count();
            assert_eq!(bad, 0, "rank {rank}: {count} elements {name}: {bad} wrong");
        }
    }
}

/// Variables of the failover child: the folder where the ranks and the parent meet, what the
/// parent takes down (`rail1`, `rail0` or `both`), and how long the calls after the cut go on
/// at least (milliseconds; 0 unless set).
const SYNC: &str = "RAILS_SYNC";
const CUT: &str = "RAILS_CUT";
const HOLD: &str = "RAILS_HOLD_MS";

/// Checked 16 MiB all-reduces (each against the f64 sum of both ranks' inputs) before and
/// after the parent takes rails down: with `RAILS_CUT=rail1` or `rail0` every call must be
/// exact, four of them and as many more as `RAILS_HOLD_MS` after the cut takes; with `both`
/// the first call after the cut must fail, naming the peer, and the rank exits 0.
#[test]
fn child_failover() {
    let (Ok(sync), Ok(cut)) = (std::env::var(SYNC), std::env::var(CUT)) else { return };
    let sync = std::path::PathBuf::from(sync);
    let comm = Communicator::from_env().expect("init from the launcher environment");
    let (rank, n) = (comm.rank(), comm.size());
    let count = 4 << 20;
    let call = |k: usize| -> oxccl::Result<()> {
        let seed = 40 + k;
        let mine: Vec<f32> = (0..count).map(|i| common::input(rank, i, seed, false, false) as f32).collect();
        let mut out = vec![0f32; count];
        comm.all_reduce(&mine, &mut out, ReduceOp::Sum)?;
        let bad = (0..count)
            .filter(|&i| f64::from(out[i]) != (0..n).map(|r| common::input(r, i, seed, false, false)).sum::<f64>())
            .count();
        assert_eq!(bad, 0, "rank {rank}: call {k}: {bad} of {count} elements wrong");
        Ok(())
    };
    for k in 0..2 {
        call(k).expect("all-reduce before the cut");
    }
    std::fs::write(sync.join(format!("ready.{rank}")), b"").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !sync.join("down").exists() {
        assert!(std::time::Instant::now() < deadline, "rank {rank}: the parent never took the rails down");
        std::thread::sleep(Duration::from_millis(10));
    }
    let start = std::time::Instant::now();
    let hold = Duration::from_millis(std::env::var(HOLD).map_or(0, |v| v.parse().expect("RAILS_HOLD_MS")));
    // Whether to go on past the first 4 calls after the cut: rank 0's clock decides for both
    // (a 1-element max all-reduce), so that both ranks make the same number of calls.
    let more = |k: usize| -> oxccl::Result<bool> {
        if k < 6 {
            return Ok(true);
        }
        let mine = [if rank == 0 && start.elapsed() < hold { 1f32 } else { 0f32 }];
        let mut out = [0f32];
        comm.all_reduce(&mine, &mut out, ReduceOp::Max)?;
        Ok(out[0] > 0.0)
    };
    let mut k = 2;
    loop {
        let next = match more(k) {
            Ok(false) => break,
            Ok(true) => {
                k += 1;
                call(k - 1)
            }
            Err(e) => Err(e),
        };
        match (next, cut.as_str()) {
            (Ok(()), "rail1" | "rail0") => {}
            (Err(e), "both") => {
                eprintln!("FAILED AS EXPECTED after {} ms: {e}", start.elapsed().as_millis());
                return;
            }
            (r, _) => panic!("rank {rank}: call {k} after cutting {cut}: {r:?}"),
        }
    }
    assert_ne!(cut, "both", "rank {rank}: every call went through with both rails down");
    eprintln!("rank {rank}: {} calls after the cut, {} ms", k - 2, start.elapsed().as_millis());
}

/// Asserts both ranks succeeded and that each one's INFO line for its link to the other says
/// `head` (after "via TCP, "), names every rail pair of `rails` (this end's first) with a
/// share, and counts `socks` sockets.
fn check(outs: &[(bool, String)], head: &str, rails: &[[&str; 2]], socks: usize) {
    common::assert_all_ok(outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let start = format!("rank {r}: rank {} via TCP, {head}", 1 - r);
        let line = out.lines().find(|l| l.contains(&start));
        let line = line.unwrap_or_else(|| panic!("rank {r}: no line with {start:?}:\n{out}"));
        for pair in rails {
            let (mine, theirs) = if r == 0 { (pair[0], pair[1]) } else { (pair[1], pair[0]) };
            let want = format!("{mine} -> {theirs} ");
            assert!(line.contains(&want), "rank {r}: no rail {want:?}: {line}");
        }
        assert!(line.contains("shares by measured rate"), "rank {r}: {line}");
        assert!(line.contains(&format!(", {socks} socket(s)")), "rank {r}: want {socks} sockets: {line}");
    }
}

/// rail0 and rail1 of host 0 and host 1.
const RAILS: [[&str; 2]; 2] = [["rail0 10.231.0.1", "rail0 10.231.0.2"], ["rail1 10.231.1.1", "rail1 10.231.1.2"]];

#[test]
fn two_rails_carry_checked_all_reduces() {
    let Some(h) = Rails::up("a") else { return };
    let outs = h.run(&[("OXCCL_SOCKET_IFNAME", "rail0,rail1")]);
    check(&outs, "2 rails (", &RAILS, 2);
}

#[test]
fn two_rails_two_sockets_each_by_prefix() {
    let Some(h) = Rails::up("b") else { return };
    let outs = h.run(&[("OXCCL_SOCKET_IFNAME", "rail"), ("OXCCL_NSOCKS", "2")]);
    check(&outs, "2 rails (", &RAILS, 4);
}

#[test]
fn one_named_rail_is_a_plain_link() {
    let Some(h) = Rails::up("c") else { return };
    let outs = h.run(&[("OXCCL_SOCKET_IFNAME", "=rail0")]);
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let want = format!("rank {r}: rank {} via TCP, 1 socket(s)", 1 - r);
        assert!(out.contains(&want), "rank {r}: no line with {want:?}:\n{out}");
    }
}

#[test]
fn without_a_filter_one_line_names_the_other_nics() {
    let Some(h) = Rails::up("d") else { return };
    let outs = h.run(&[]);
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let want = format!(
            "TCP links use rail0 only; other usable interfaces: rail1 (10.231.1.{}); OXCCL_SOCKET_IFNAME=\"=rail0,rail1\"",
            r + 1
        );
        assert_eq!(out.matches(&want).count(), 1, "rank {r}: want one line {want:?}:\n{out}");
        assert!(out.contains(&format!("rank {r}: rank {} via TCP, 1 socket(s)", 1 - r)), "rank {r}:\n{out}");
    }
}

/// The same two hosts over libfabric (`OXCCL_NET=ofi`, `tcp;ofi_rxm`): each link stripes its
/// messages over an endpoint on each rail, in shares by measured rate; the checked all-reduces
/// pass and both ends' INFO line names both rails with their shares.
#[test]
fn two_rails_over_ofi_carry_checked_all_reduces() {
    match oxccl::transport::ofi::providers(Some("tcp;ofi_rxm")) {
        Ok(p) if p.iter().any(|p| p == "tcp;ofi_rxm") => {}
        Ok(p) => return common::skipped(&format!("rails over ofi: no tcp;ofi_rxm provider (only {p:?})")),
        Err(why) => return common::skipped(&format!("rails over ofi: {why}")),
    }
    let Some(h) = Rails::up("o") else { return };
    let outs = h.run(&[
        ("OXCCL_SOCKET_IFNAME", "rail0,rail1"),
        ("OXCCL_NET", "ofi"),
        ("OXCCL_OFI_PROVIDER", "tcp;ofi_rxm"),
        ("OXCCL_OFI_CHUNK", "64K"),
    ]);
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let start = format!("rank {r}: rank {} via OFI (tcp;ofi_rxm) at ", 1 - r);
        let line = out.lines().find(|l| l.contains(&start));
        let line = line.unwrap_or_else(|| panic!("rank {r}: no line with {start:?}:\n{out}"));
        assert!(line.contains(", 2 rails (") && line.contains("; shares by measured rate)"), "rank {r}: {line}");
        for pair in RAILS {
            let (mine, theirs) = if r == 0 { (pair[0], pair[1]) } else { (pair[1], pair[0]) };
            let want = format!("{mine} -> {theirs} ");
            let at = line.find(&want).unwrap_or_else(|| panic!("rank {r}: no rail {want:?}: {line}"));
            let share = &line[at + want.len()..];
            let pct: String = share.chars().take_while(char::is_ascii_digit).collect();
            assert!(
                !pct.is_empty() && share[pct.len()..].starts_with('%'),
                "rank {r}: no share after {want:?}: {line}"
            );
        }
    }
}

/// Failover environment: short rail timeout and liveness bound, so the test costs seconds.
const FAILOVER_ENV: [(&str, &str); 3] =
    [("OXCCL_SOCKET_IFNAME", "rail0,rail1"), ("OXCCL_RAIL_TIMEOUT_MS", "1000"), ("OXCCL_LIVENESS_TIMEOUT_MS", "5000")];

#[test]
fn a_dead_rail_fails_over_and_every_call_is_exact() {
    let Some(h) = Rails::up("e") else { return };
    let mut env = FAILOVER_ENV.to_vec();
    env.push((CUT, "rail1"));
    let outs = h.run_and_cut(&env, &["rail1"]);
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let warns: Vec<&str> = out.lines().filter(|l| l.contains(" WARN ")).collect();
        let want = format!("rank {r}: rail rail1 to rank {} (", 1 - r);
        assert_eq!(warns.len(), 1, "rank {r}: want exactly one WARN:\n{out}");
        assert!(warns[0].contains(&want) && warns[0].contains("moved to rail0"), "rank {r}: {}", warns[0]);
        eprintln!("{}", warns[0]);
    }
}

#[test]
fn losing_both_rails_fails_both_ranks_naming_the_peer() {
    let Some(h) = Rails::up("f") else { return };
    let mut env = FAILOVER_ENV.to_vec();
    env.push((CUT, "both"));
    let outs = h.run_and_cut(&env, &["rail0", "rail1"]);
    both_failed_naming_the_peer(&outs);
}

/// Both ranks exited 0 after the first call past the cut of both rails failed, within the
/// liveness bound and its slack, naming the peer.
fn both_failed_naming_the_peer(outs: &[(bool, String)]) {
    common::assert_all_ok(outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let line = out.lines().find(|l| l.contains("FAILED AS EXPECTED"));
        let line = line.unwrap_or_else(|| panic!("rank {r}: no failure reported:\n{out}"));
        assert!(line.contains(&format!("rank {}", 1 - r)), "rank {r}: the error does not name the peer: {line}");
        let ms: u64 =
            line.split("after ").nth(1).and_then(|t| t.split(' ').next()).and_then(|t| t.parse().ok()).unwrap();
        assert!(ms < 15_000, "rank {r}: failed after {ms} ms, past the 5 s liveness bound and its slack");
        eprintln!("rank {r}: {line}");
    }
}

/// The bootstrap's rail (rail0: the control channel's first connection and the data link's
/// first socket) dies under checked all-reduces that go on for 2.5 liveness timeouts: the data
/// moves to rail1 and the control channel lives on its rail1 connection, so every call is
/// exact and no rank is taken for dead; each rank notes its silent rail0 control connection.
#[test]
fn losing_the_bootstrap_rail_fails_over_and_no_peer_is_taken_for_dead() {
    let Some(h) = Rails::up("ctl") else { return };
    let env = [
        ("OXCCL_SOCKET_IFNAME", "rail0,rail1"),
        ("OXCCL_RAIL_TIMEOUT_MS", "1000"),
        ("OXCCL_LIVENESS_TIMEOUT_MS", "2000"),
        (HOLD, "5000"),
        (CUT, "rail0"),
    ];
    let outs = h.run_and_cut(&env, &["rail0"]);
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let peer = format!("peer rank {} (", 1 - r);
        for bad in ["stopped answering heartbeats", "without closing", "failed:"] {
            assert!(!out.contains(bad), "rank {r}: {bad:?}:\n{out}");
        }
        let warns: Vec<&str> = out.lines().filter(|l| l.contains(" WARN ")).collect();
        let data = format!("rank {r}: rail rail0 to rank {} (", 1 - r);
        let moved = |l: &str| l.contains(&data) && l.contains("moved to rail1");
        assert_eq!(warns.iter().filter(|l| moved(l)).count(), 1, "rank {r}: want one data-rail WARN:\n{out}");
        // Any other WARN is the rail0 control connection's end (a send failed): no death.
        let control = format!("rank {r}: the control connection to {peer}");
        for w in warns.iter().filter(|l| !moved(l)) {
            assert!(w.contains(&control) && w.contains("over rail rail0 ended"), "rank {r}: {w}");
        }
        let noted = out.lines().find(|l| {
            l.contains(&control) && (l.contains("over rail rail0 is silent") || l.contains("over rail rail0 ended"))
        });
        let noted = noted.unwrap_or_else(|| panic!("rank {r}: the rail0 control connection is not noted:\n{out}"));
        let calls = out.lines().find(|l| l.contains("calls after the cut")).unwrap_or("?");
        eprintln!("{calls}\n{noted}");
    }
}

// Failover of libfabric rails, and `oxccl-iperf --rails`.

/// Whether libfabric offers `tcp;ofi_rxm` (else a SKIPPED line for `what`).
fn has_ofi_rxm(what: &str) -> bool {
    match oxccl::transport::ofi::providers(Some("tcp;ofi_rxm")) {
        Ok(p) if p.iter().any(|p| p == "tcp;ofi_rxm") => true,
        Ok(p) => {
            common::skipped(&format!("{what}: no tcp;ofi_rxm provider (only {p:?})"));
            false
        }
        Err(why) => {
            common::skipped(&format!("{what}: {why}"));
            false
        }
    }
}

/// The ofi failover tests' environment: [`FAILOVER_ENV`] over libfabric (`tcp;ofi_rxm`,
/// 64 KiB messages), the parent taking `cut` down ([`child_failover`]).
fn ofi_failover_env(cut: &'static str) -> Vec<(&'static str, &'static str)> {
    let mut env = FAILOVER_ENV.to_vec();
    env.extend([("OXCCL_NET", "ofi"), ("OXCCL_OFI_PROVIDER", "tcp;ofi_rxm"), ("OXCCL_OFI_CHUNK", "64K"), (CUT, cut)]);
    env
}

/// rail1 of host 0 goes down between checked 16 MiB all-reduces over libfabric
/// (`tcp;ofi_rxm`, 64 KiB messages striped over both rails, `OXCCL_RAIL_TIMEOUT_MS=1000`):
/// every call is exact, each rank logs one WARN naming rail1 (both addresses) and the peer,
/// its messages moved to rail0, and both exit 0.
#[test]
fn a_dead_ofi_rail_fails_over_and_every_call_is_exact() {
    if !has_ofi_rxm("ofi rail failover") {
        return;
    }
    let Some(h) = Rails::up("p") else { return };
    let outs = h.run_and_cut(&ofi_failover_env("rail1"), &["rail1"]);
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let warns: Vec<&str> = out.lines().filter(|l| l.contains(" WARN ")).collect();
        assert_eq!(warns.len(), 1, "rank {r}: want exactly one WARN:\n{out}");
        let (mine, theirs) = (r + 1, 2 - r);
        let rail = format!("rank {r}: OFI rail rail1 10.231.1.{mine} -> rail1 10.231.1.{theirs} to rank {} (", 1 - r);
        let to = format!("moved to rail0 10.231.0.{mine} -> rail0 10.231.0.{theirs}");
        assert!(warns[0].contains(&rail) && warns[0].contains(&to), "rank {r}: {}", warns[0]);
        eprintln!("{}", warns[0]);
    }
}

/// `oxccl-iperf --rails` on the two hosts (TCP, 1 MiB, one timed call): rank 0 prints a row
/// for each rail pair and one for the striped link, each with a time and a busbw above 0.
#[test]
fn iperf_rails_reports_each_rail_and_the_striped_total() {
    let Some(h) = Rails::up("q") else { return };
    let children: Vec<std::process::Child> = (0..2)
        .map(|rank| {
            let mut c = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"));
            // The table (stdout) goes to stderr, which `wait_all` collects.
            c.args(["run", &rank.to_string(), "sh", "-c", "exec \"$0\" \"$@\" 1>&2"])
                .arg(env!("CARGO_BIN_EXE_oxccl-iperf"))
                .args(["--rails", "--size", "1M", "--iters", "1", "--warmup", "0"])
                .env("OXR_PREFIX", &h.prefix)
                .env("OXCCL_RANK", rank.to_string())
                .env("OXCCL_NRANKS", "2")
                .env("MASTER_ADDR", "10.231.0.1")
                .env("MASTER_PORT", "29571")
                .env("OXCCL_TIMEOUT_MS", "60000")
                .env("OXCCL_SOCKET_IFNAME", "rail0,rail1")
                .env_remove("OXCCL_HOSTID")
                .env_remove("OXCCL_TRANSPORT")
                .env_remove("OXCCL_NET")
                .env_remove("OXCCL_DEBUG")
                .env_remove("NCCL_SOCKET_IFNAME")
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            c.spawn().expect("spawn oxccl-iperf in its namespace")
        })
        .collect();
    let outs = common::wait_all(children, Duration::from_secs(120));
    common::assert_all_ok(&outs);
    let out = &outs[0].1;
    for row in ["rail0 10.231.0.1 -> rail0 10.231.0.2", "rail1 10.231.1.1 -> rail1 10.231.1.2", "striped (all rails)"] {
        let line = out.lines().find(|l| l.starts_with(row)).unwrap_or_else(|| panic!("no row {row:?}:\n{out}"));
        let nums: Vec<f64> = line[row.len()..].split_whitespace().filter_map(|t| t.parse().ok()).collect();
        assert!(nums.len() == 2 && nums.iter().all(|v| *v > 0.0), "row {row:?} lacks a time and a busbw: {line}");
    }
    assert!(out.contains("# oxccl-iperf --rails (socket)"), "{out}");
}

/// Both rails of host 0 go down between checked all-reduces over libfabric: the first call
/// after the cut fails on both ranks within the bound, naming the peer, and both exit 0.
#[test]
fn losing_both_ofi_rails_fails_both_ranks_naming_the_peer() {
    if !has_ofi_rxm("ofi rail failover") {
        return;
    }
    let Some(h) = Rails::up("r") else { return };
    let outs = h.run_and_cut(&ofi_failover_env("both"), &["rail0", "rail1"]);
    both_failed_naming_the_peer(&outs);
}

/// rail0 of host 0 (the bootstrap's rail: the pair's connection, the ofi link's first credit
/// connection) goes down between checked 16 MiB all-reduces over libfabric (`tcp;ofi_rxm`,
/// 64 KiB messages striped over both rails) that go on for 2.5 liveness timeouts: the credits
/// and failover words move to rail1's credit connection, so every call is exact, each rank logs
/// one WARN for the ofi link's rail0 (its messages moved to rail1) and no rank is taken for
/// dead (the control channel hears the peer over its rail1 connection); both exit 0.
#[test]
fn losing_the_bootstrap_rail_over_ofi_fails_over_and_every_call_is_exact() {
    if !has_ofi_rxm("ofi bootstrap-rail failover") {
        return;
    }
    let Some(h) = Rails::up("oficr") else { return };
    let env = [
        ("OXCCL_SOCKET_IFNAME", "rail0,rail1"),
        ("OXCCL_RAIL_TIMEOUT_MS", "1000"),
        ("OXCCL_LIVENESS_TIMEOUT_MS", "2000"),
        ("OXCCL_NET", "ofi"),
        ("OXCCL_OFI_PROVIDER", "tcp;ofi_rxm"),
        ("OXCCL_OFI_CHUNK", "64K"),
        (HOLD, "5000"),
        (CUT, "rail0"),
    ];
    let outs = h.run_and_cut(&env, &["rail0"]);
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        for bad in ["stopped answering heartbeats", "without closing", "failed:", "unreachable"] {
            assert!(!out.contains(bad), "rank {r}: {bad:?}:\n{out}");
        }
        let warns: Vec<&str> = out.lines().filter(|l| l.contains(" WARN ")).collect();
        let (mine, theirs) = (r + 1, 2 - r);
        let rail = format!("rank {r}: OFI rail rail0 10.231.0.{mine} -> rail0 10.231.0.{theirs} to rank {} (", 1 - r);
        let to = format!("moved to rail1 10.231.1.{mine} -> rail1 10.231.1.{theirs}");
        let moved = |l: &str| l.contains(&rail) && l.contains(&to);
        assert_eq!(warns.iter().filter(|l| moved(l)).count(), 1, "rank {r}: want one ofi rail0 WARN:\n{out}");
        // Any other WARN is the rail0 control connection's end (a send failed): no death.
        let control = format!("rank {r}: the control connection to peer rank {} (", 1 - r);
        for w in warns.iter().filter(|l| !moved(l)) {
            assert!(w.contains(&control) && w.contains("over rail rail0 ended"), "rank {r}: {w}");
        }
        let calls = out.lines().find(|l| l.contains("calls after the cut")).unwrap_or("?");
        eprintln!("{calls}\n{}", warns.iter().find(|l| moved(l)).unwrap_or(&"?"));
    }
}

// A link over three rails loses two of them, one after the other.

/// Variable of [`child_cuts_in_turn`]: the rails rank 0 takes down, in turn (`rail1,rail2`;
/// `rail1+rail2` takes both down at once).
const CUTS: &str = "RAILS_CUTS";

/// Two hosts with three unshaped rails (rail2 on 10.243.2.0/24), namespaces `spare<pid>t0/1`;
/// `None` after a SKIP line when they cannot be made.
fn three_rails() -> Option<Rails> {
    let r = Rails { prefix: format!("spare{}t", std::process::id() % 100_000) };
    let ok = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"))
        .args(["up", "none", "none", "none"])
        .env("OXR_PREFIX", &r.prefix)
        .env("OXR_NET", "10.243")
        .env("RAILS", "3")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        common::skipped("three rails: cannot create network namespaces (needs root and iproute2)");
        return None;
    }
    Some(r)
}

/// A rank of a link over three rails: steps of a checked 16 MiB broadcast from rank 0 (its
/// input) and a checked 16 MiB all-reduce (against the f64 sum of both ranks' inputs), 2 steps
/// before and 4 after each cut; rank 0 (root in host 0's namespace) takes each rail of
/// `RAILS_CUTS` down itself, in turn, after its steps. Every call must be exact. The broadcast
/// right after a cut has rank 0 alone sending: its bytes on the dead rail cannot leave (no
/// route), none are in flight, and only its unanswered window probes tell the rail is dead.
#[test]
fn child_cuts_in_turn() {
    let Ok(cuts) = std::env::var(CUTS) else { return };
    let comm = Communicator::from_env().expect("init from the launcher environment");
    let (rank, n) = (comm.rank(), comm.size());
    let count = 4 << 20;
    let mut k = 0;
    let mut calls = |how_many: usize, after: &str| {
        for _ in 0..how_many {
            let seed = 60 + k;
            let input = |r: usize, i: usize| common::input(r, i, seed, false, false);
            let mine: Vec<f32> = (0..count).map(|i| input(rank, i) as f32).collect();
            let mut out = vec![0f32; count];
            let r = oxccl::Collectives::broadcast(&comm, &mine, &mut out, 0);
            assert!(r.is_ok(), "rank {rank}: broadcast {k} {after}: {r:?}");
            let bad = (0..count).filter(|&i| f64::from(out[i]) != input(0, i)).count();
            assert_eq!(bad, 0, "rank {rank}: broadcast {k} {after}: {bad} of {count} elements wrong");
            let r = comm.all_reduce(&mine, &mut out, ReduceOp::Sum);
            assert!(r.is_ok(), "rank {rank}: all-reduce {k} {after}: {r:?}");
            let bad = (0..count).filter(|&i| f64::from(out[i]) != (0..n).map(|r| input(r, i)).sum::<f64>()).count();
            assert_eq!(bad, 0, "rank {rank}: all-reduce {k} {after}: {bad} of {count} elements wrong");
            k += 1;
        }
    };
    calls(2, "before the cuts");
    for rail in cuts.split(',') {
        if rank == 0 {
            // `rail1+rail2`: both by one command, at the same moment.
            let cmd: String = rail.split('+').map(|r| format!("ip link set {r} down & ")).collect();
            let ok = Command::new("sh").args(["-c", &format!("{cmd}wait")]).status().is_ok_and(|s| s.success());
            assert!(ok, "rank 0: ip link set {rail} down failed");
        }
        calls(4, &format!("after cutting {rail}"));
    }
    eprintln!("rank {rank}: {k} steps exact");
}

/// rail1, then rail2 of a link over three rails go down under checked broadcasts and
/// all-reduces ([`child_cuts_in_turn`]): every call is exact, each rank logs one WARN per lost rail naming it and the peer (rail1's sockets
/// move to rail2 or rail0, then rail2's to rail0), and both exit 0.
#[test]
fn losing_two_of_three_rails_in_turn_fails_over_twice() {
    let Some(h) = three_rails() else { return };
    let env = [
        ("OXCCL_SOCKET_IFNAME", "rail0,rail1,rail2"),
        ("OXCCL_RAIL_TIMEOUT_MS", "1000"),
        ("OXCCL_LIVENESS_TIMEOUT_MS", "5000"),
        // A stall fails in 20 s, not 60.
        ("OXCCL_TIMEOUT_MS", "20000"),
        ("MASTER_ADDR", "10.243.0.1"),
        ("MASTER_PORT", "29591"),
        (CUTS, "rail1,rail2"),
    ];
    let outs = h.run(&env);
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        assert!(out.contains(&format!("rank {r}: 10 steps exact")), "rank {r}:\n{out}");
        assert!(out.contains(&format!("rank {r}: rank {} via TCP, 3 rails (", 1 - r)), "rank {r}:\n{out}");
        let warns: Vec<&str> = out.lines().filter(|l| l.contains(" WARN ")).collect();
        assert_eq!(warns.len(), 2, "rank {r}: want one WARN per lost rail:\n{out}");
        for (w, (rail, to)) in warns.iter().zip([("rail1", "moved to rail2"), ("rail2", "moved to rail0")]) {
            let want = format!("rank {r}: rail {rail} to rank {} (", 1 - r);
            assert!(w.contains(&want) && w.contains(to), "rank {r}: {w}");
            eprintln!("{w}");
        }
    }
}

// The control channel on every rail for every peer, from creation: ranks on four hosts
// (scripts/netns-rails.sh `hosts`), some pairs of which never make a data link.

/// Variables of the quiet-pairs child: the folder where the ranks and the parent meet,
/// whether the pairs exchange checked messages after the cut ("1") or only stay alive, and
/// whether every rank also makes a child communicator (a split of all four) before the cut.
const QUIET: &str = "RAILS_QUIET";
const QUIET_CALLS: &str = "RAILS_QUIET_CALLS";
const QUIET_SPLIT: &str = "RAILS_QUIET_SPLIT";

/// Four hosts on two rails, one rank each, under namespaces `ctlr<pid><tag>`, removed on drop.
struct Quad {
    prefix: String,
}

impl Quad {
    /// The four hosts; `None` after a SKIP line when they cannot be made.
    fn up(tag: &str) -> Option<Quad> {
        let q = Quad { prefix: format!("ctlr{}{tag}", std::process::id() % 100_000) };
        if !q.script(&["hosts", "4"]) {
            common::skipped(&format!("rails {tag}: cannot create network namespaces (needs root, iproute2, bridge)"));
            return None;
        }
        Some(q)
    }

    fn script(&self, args: &[&str]) -> bool {
        Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"))
            .args(args)
            .env("OXR_PREFIX", &self.prefix)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Runs the quiet-pairs child on the four hosts with `env`; once every rank made its
    /// first calls, takes rail0's bridge down (rail0 dies for every host) and lets them go on.
    /// (success, stderr).
    fn run_and_cut_rail0(&self, env: &[(&str, &str)]) -> Vec<(bool, String)> {
        let sync = std::env::temp_dir().join(format!("{}-sync", self.prefix));
        let _ = std::fs::remove_dir_all(&sync);
        std::fs::create_dir_all(&sync).unwrap();
        let children: Vec<std::process::Child> = (0..4)
            .map(|rank| {
                let mut c = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"));
                c.args(["run", &rank.to_string()])
                    .arg(std::env::current_exe().unwrap())
                    .args(["child_quiet_pairs", "--exact", "--nocapture", "--test-threads=1"])
                    .env("OXR_PREFIX", &self.prefix)
                    .env(QUIET, &sync)
                    .env("OXCCL_RANK", rank.to_string())
                    .env("OXCCL_NRANKS", "4")
                    .env("MASTER_ADDR", "10.231.0.1")
                    .env("MASTER_PORT", "29571")
                    .env("OXCCL_TIMEOUT_MS", "60000")
                    .env("OXCCL_DEBUG", "INFO")
                    .env("OXCCL_SOCKET_IFNAME", "rail0,rail1")
                    .env_remove("OXCCL_HOSTID")
                    .env_remove("OXCCL_TRANSPORT")
                    .env_remove("OXCCL_NET")
                    .env_remove("NCCL_SOCKET_IFNAME")
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped());
                for (k, v) in env {
                    c.env(k, v);
                }
                c.spawn().expect("spawn a rank in its namespace")
            })
            .collect();
        // The rail's switch dies: every host's rail0 stays up, and what it sends is lost.
        let cut = format!("ip -n {}sw link set br0 down", self.prefix);
        cut_when_ready(children, &sync, Duration::from_secs(120), &cut, Duration::from_secs(180))
    }
}

impl Drop for Quad {
    fn drop(&mut self) {
        self.script(&["down"]);
    }
}

/// A rank of four (ring order 0 1 2 3: creation links each rank to its ring neighbours, so
/// ranks 0 and 2, and 1 and 3, never make a data link): ranks 0 and 1, and 2 and 3, exchange
/// a message (checked against the partner's input) before the cut; after it, with
/// `RAILS_QUIET_CALLS=1`, they go on exchanging checked messages for `RAILS_HOLD_MS` (the
/// lower rank's clock decides for both), else they only stay alive as long. With
/// `RAILS_QUIET_SPLIT=1` every rank first splits the four into a child in reverse order (idle
/// after its creation: its control channel is opened by its own creation). Then each rank
/// checks that its communicator (and child) has no failure (no peer taken for dead, no abort
/// frame), and waits until every rank has checked before it exits.
#[test]
fn child_quiet_pairs() {
    use oxccl::Collectives;
    let Ok(sync) = std::env::var(QUIET) else { return };
    let sync = std::path::PathBuf::from(sync);
    let calls = std::env::var(QUIET_CALLS).is_ok_and(|v| v == "1");
    let hold = Duration::from_millis(std::env::var(HOLD).map_or(0, |v| v.parse().expect("RAILS_HOLD_MS")));
    let comm = Communicator::from_env().expect("init from the launcher environment");
    let (rank, n) = (comm.rank(), comm.size());
    let partner = rank ^ 1;
    let count = 65_536;
    let start = std::time::Instant::now();
    // One checked exchange with the partner; whether the lower rank wants another (element 0).
    let exchange = |k: usize, more: bool| -> oxccl::Result<bool> {
        let seed = 60 + k;
        let mut mine: Vec<f32> = (0..count).map(|i| common::input(rank, i, seed, false, false) as f32).collect();
        mine[0] = f32::from(u8::from(more));
        let mut got = vec![0f32; count];
        comm.group(|g| {
            g.send(&mine, partner)?;
            g.recv(&mut got, partner)
        })?;
        let bad = (1..count).filter(|&i| f64::from(got[i]) != common::input(partner, i, seed, false, false)).count();
        assert_eq!(bad, 0, "rank {rank}: exchange {k} with rank {partner}: {bad} of {} elements wrong", count - 1);
        Ok(if rank < partner { more } else { got[0] > 0.0 })
    };
    exchange(0, true).expect("exchange before the cut");
    let child = std::env::var(QUIET_SPLIT)
        .is_ok_and(|v| v == "1")
        .then(|| comm.split(Some(0), -(rank as i32)).expect("split").expect("every rank is a member"));
    std::fs::write(sync.join(format!("ready.{rank}")), b"").unwrap();
    let wait_for = |what: &dyn Fn() -> bool, why: &str| {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !what() {
            assert!(std::time::Instant::now() < deadline, "rank {rank}: {why}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_for(&|| sync.join("down").exists(), "the parent never took rail0 down");
    let cut = std::time::Instant::now();
    let mut k = 1;
    if calls {
        while exchange(k, cut.elapsed() < hold).unwrap_or_else(|e| panic!("rank {rank}: exchange {k}: {e}")) {
            k += 1;
        }
    } else {
        std::thread::sleep(hold);
    }
    assert!(comm.async_error().is_none(), "rank {rank}: {:?}", comm.async_error());
    if let Some(c) = &child {
        assert!(c.async_error().is_none(), "rank {rank}'s child: {:?}", c.async_error());
    }
    drop(child);
    std::fs::write(sync.join(format!("done.{rank}")), b"").unwrap();
    wait_for(&|| (0..n).all(|r| sync.join(format!("done.{r}")).exists()), "not every rank checked");
    eprintln!(
        "rank {rank}: {} exchanges after the cut, {} ms; no failure ({} ms since the first exchange)",
        k - 1,
        cut.elapsed().as_millis(),
        start.elapsed().as_millis()
    );
}

/// Asserts that every rank exited 0 without a death found or an abort frame, never made a
/// data link to rank ^ 2, and noted its rail0 control connection to it as silent or ended:
/// the channel lived on rail1. With `child` (the split in reverse order: rank `r` is child
/// rank `3 - r`), the same for the child's channel.
fn no_death_over_rail1(outs: &[(bool, String)], child: bool) {
    common::assert_all_ok(outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let link = format!("rank {r}: rank {} via", r ^ 2);
        assert!(!out.contains(&link), "rank {r}: a data link to rank {}:\n{out}", r ^ 2);
        for bad in ["stopped answering heartbeats", "without closing", "failed:"] {
            assert!(!out.contains(bad), "rank {r}: {bad:?}:\n{out}");
        }
        let summary = out.lines().find(|l| l.contains("exchanges after the cut")).unwrap_or("?");
        eprintln!("{summary}");
        let ranks = if child { vec![r, 3 - r] } else { vec![r] };
        for c in ranks {
            let control = format!("rank {c}: the control connection to peer rank {} (", c ^ 2);
            let noted = out.lines().find(|l| {
                l.contains(&control) && (l.contains("over rail rail0 is silent") || l.contains("over rail rail0 ended"))
            });
            let noted = noted.unwrap_or_else(|| panic!("rank {r}: {control:?} over rail0 is not noted:\n{out}"));
            eprintln!("{noted}");
        }
    }
}

/// Rail0 (the bootstrap's) dies on all four hosts while pairs 0-1 and 2-3 exchange checked
/// messages for 2.5 liveness timeouts: ranks 0 and 2 (and 1 and 3), which never made a data
/// link, keep hearing each other on their control channel's rail1 connection (opened at
/// creation), so no rank is taken for dead and every exchange is exact; so does the idle child
/// each rank split off before the cut (its channel's rails come with its own creation).
#[test]
fn losing_rail0_takes_no_peer_for_dead_even_without_a_data_link() {
    let Some(q) = Quad::up("a") else { return };
    let env = [
        ("OXCCL_RAIL_TIMEOUT_MS", "1000"),
        ("OXCCL_LIVENESS_TIMEOUT_MS", "2000"),
        (HOLD, "5000"),
        (QUIET_CALLS, "1"),
        (QUIET_SPLIT, "1"),
    ];
    no_death_over_rail1(&q.run_and_cut_rail0(&env), true);
}

/// The same cut with libfabric links (`tcp;ofi_rxm`) and no call after it: what the control
/// channel owns. Every rank stays alive for 2.5 liveness timeouts and none is taken for dead,
/// whatever transport its links use (the control channel's further rails are its own).
#[test]
fn losing_rail0_takes_no_peer_for_dead_over_ofi_links() {
    if !has_ofi_rxm("ofi quiet pairs") {
        return;
    }
    let Some(q) = Quad::up("b") else { return };
    let env = [
        ("OXCCL_NET", "ofi"),
        ("OXCCL_OFI_PROVIDER", "tcp;ofi_rxm"),
        ("OXCCL_RAIL_TIMEOUT_MS", "1000"),
        ("OXCCL_LIVENESS_TIMEOUT_MS", "2000"),
        (HOLD, "5000"),
    ];
    let outs = q.run_and_cut_rail0(&env);
    for (r, (_, out)) in outs.iter().enumerate() {
        assert!(out.contains(&format!("rank {r}: rank {} via OFI", r ^ 1)), "rank {r}: no OFI link:\n{out}");
    }
    no_death_over_rail1(&outs, false);
}

// A rail cut on every host's interface (`ip link set rail0 down` on both ends): neither end has
// a route on that rail any more, so no byte of it leaves either host and none is in flight;
// only the unanswered window probes of each end's stuck bytes tell that the rail is dead.

/// Two hosts with two unshaped rails on 10.247.0.0/24 and 10.247.1.0/24, namespaces
/// `cut<pid>x0/1`; `None` after a SKIP line when they cannot be made.
fn cut_hosts() -> Option<Rails> {
    let r = Rails { prefix: format!("cut{}x", std::process::id() % 100_000) };
    let ok = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"))
        .args(["up", "none", "none"])
        .env("OXR_PREFIX", &r.prefix)
        .env("OXR_NET", "10.247")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        common::skipped("cut hosts: cannot create network namespaces (needs root and iproute2)");
        return None;
    }
    Some(r)
}

impl Rails {
    /// Runs the failover child ([`child_failover`]) with `env`, meeting on 10.247.0.1; once
    /// both ranks made their first calls and wait (nothing in flight), takes `link` down on
    /// both hosts with one command and lets them go on. Returns (success, stderr).
    fn run_and_cut_everywhere(&self, env: &[(&str, &str)], link: &str) -> Vec<(bool, String)> {
        let sync = std::env::temp_dir().join(format!("{}-sync", self.prefix));
        let _ = std::fs::remove_dir_all(&sync);
        std::fs::create_dir_all(&sync).unwrap();
        let mut env = env.to_vec();
        env.extend([(SYNC, sync.to_str().unwrap()), ("MASTER_ADDR", "10.247.0.1"), ("MASTER_PORT", "29611")]);
        let children = self.spawn(&env);
        let both = format!("ip -n {p}0 link set {link} down & ip -n {p}1 link set {link} down & wait", p = self.prefix);
        cut_when_ready(children, &sync, Duration::from_secs(120), &both, Duration::from_secs(180))
    }
}

/// rail0 (the bootstrap's rail) goes down on both hosts' interfaces while the ranks wait
/// between checked 16 MiB all-reduces; the next calls find no route on rail0 at either end.
/// Every call after the cut is exact, each rank logs one WARN for its data link's rail0 (its
/// socket moved to rail1) and no rank is taken for dead; both exit 0.
#[test]
fn rail0_down_on_every_host_fails_over_with_nothing_in_flight() {
    let Some(h) = cut_hosts() else { return };
    let mut env = FAILOVER_ENV.to_vec();
    env.extend([(CUT, "rail0"), ("OXCCL_TIMEOUT_MS", "20000")]);
    let outs = h.run_and_cut_everywhere(&env, "rail0");
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        for bad in ["stopped answering heartbeats", "without closing", "failed:"] {
            assert!(!out.contains(bad), "rank {r}: {bad:?}:\n{out}");
        }
        let warns: Vec<&str> = out.lines().filter(|l| l.contains(" WARN ")).collect();
        let data = format!("rank {r}: rail rail0 to rank {} (", 1 - r);
        let moved = |l: &str| l.contains(&data) && l.contains("moved to rail1");
        assert_eq!(warns.iter().filter(|l| moved(l)).count(), 1, "rank {r}: want one data-rail WARN:\n{out}");
        // Any other WARN is the rail0 control connection's end (a send failed): no death.
        let control = format!("rank {r}: the control connection to peer rank {} (", 1 - r);
        for w in warns.iter().filter(|l| !moved(l)) {
            assert!(w.contains(&control) && w.contains("over rail rail0 ended"), "rank {r}: {w}");
        }
        let calls = out.lines().find(|l| l.contains("calls after the cut")).unwrap_or("?");
        eprintln!("{calls}\n{}", warns.iter().find(|l| moved(l)).unwrap_or(&"?"));
    }
}

/// rail1 and rail2 of a link over three rails go down at the same moment (one command) under
/// checked broadcasts and all-reduces ([`child_cuts_in_turn`], namespaces `cut<pid>y0/1`):
/// every call is exact, and each rank logs one WARN per lost rail naming it and the peer, all
/// their sockets moved to rail0 (when rail1 is recovered first, its socket's first spare, on
/// rail2, is dead too, and the recovery goes on to its spare on rail0); both exit 0.
#[test]
fn losing_two_of_three_rails_at_once_fails_over_to_the_third() {
    let r = Rails { prefix: format!("cut{}y", std::process::id() % 100_000) };
    let ok = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"))
        .args(["up", "none", "none", "none"])
        .env("OXR_PREFIX", &r.prefix)
        .env("OXR_NET", "10.247")
        .env("RAILS", "3")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        common::skipped("three rails at once: cannot create network namespaces (needs root and iproute2)");
        return;
    }
    let env = [
        ("OXCCL_SOCKET_IFNAME", "rail0,rail1,rail2"),
        ("OXCCL_RAIL_TIMEOUT_MS", "1000"),
        ("OXCCL_LIVENESS_TIMEOUT_MS", "5000"),
        ("OXCCL_TIMEOUT_MS", "20000"),
        ("MASTER_ADDR", "10.247.0.1"),
        ("MASTER_PORT", "29611"),
        (CUTS, "rail1+rail2"),
    ];
    let outs = r.run(&env);
    common::assert_all_ok(&outs);
    for (rank, (_, out)) in outs.iter().enumerate() {
        assert!(out.contains(&format!("rank {rank}: 6 steps exact")), "rank {rank}:\n{out}");
        let mut warns: Vec<&str> = out.lines().filter(|l| l.contains(" WARN ")).collect();
        assert_eq!(warns.len(), 2, "rank {rank}: want one WARN per lost rail:\n{out}");
        warns.sort_by_key(|w| !w.contains("rail rail1 to"));
        for (w, rail) in warns.iter().zip(["rail1", "rail2"]) {
            let want = format!("rank {rank}: rail {rail} to rank {} (", 1 - rank);
            assert!(w.contains(&want) && w.contains("moved to rail0"), "rank {rank}: {w}");
            eprintln!("{w}");
        }
    }
}

// A data link first needed after rail0 died: four hosts (namespaces `lis<pid>x0..3` and
// `lis<pid>xsw`, rails on 10.249.0.0/24 and 10.249.1.0/24), rail0 taken down on every host's
// interface once each rank made its ring links, then ranks 0 and 2 (and 1 and 3), which had
// no data link, exchange checked messages: the dialling rank finds no route to the peer's
// bootstrap address and dials its data listener on rail1 (the peer's rail1 address, learnt
// from the control channel's rails at creation).

/// Variable that makes this binary a rank of [`a_data_link_first_needed_after_rail0_died_goes_over_rail1`]
/// (the sync folder).
const NEW_LINK: &str = "RAILS_NEW_LINK";

/// A rank of four: waits until rail0 is down, then exchanges 4096 elements with rank ^ 2
/// (checked against the partner's input), checks that its communicator has no failure, and
/// waits until every rank has checked before it exits.
#[test]
fn child_new_link_after_rail0() {
    use oxccl::Collectives;
    let Ok(sync) = std::env::var(NEW_LINK) else { return };
    let sync = std::path::PathBuf::from(sync);
    let comm = Communicator::from_env().expect("init from the launcher environment");
    let (rank, n) = (comm.rank(), comm.size());
    let partner = rank ^ 2;
    std::fs::write(sync.join(format!("ready.{rank}")), b"").unwrap();
    let wait_for = |what: &dyn Fn() -> bool, why: &str| {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !what() {
            assert!(std::time::Instant::now() < deadline, "rank {rank}: {why}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_for(&|| sync.join("down").exists(), "the parent never took rail0 down");
    let count = 4096;
    let mine: Vec<f32> = (0..count).map(|i| common::input(rank, i, 71, false, false) as f32).collect();
    let mut got = vec![0f32; count];
    comm.group(|g| {
        g.send(&mine, partner)?;
        g.recv(&mut got, partner)
    })
    .unwrap_or_else(|e| panic!("rank {rank}: exchange with rank {partner} after the cut: {e}"));
    let bad = (0..count).filter(|&i| f64::from(got[i]) != common::input(partner, i, 71, false, false)).count();
    assert_eq!(bad, 0, "rank {rank}: exchange with rank {partner}: {bad} of {count} elements wrong");
    assert!(comm.async_error().is_none(), "rank {rank}: {:?}", comm.async_error());
    eprintln!("rank {rank}: exchange with rank {partner} after the cut exact");
    std::fs::write(sync.join(format!("done.{rank}")), b"").unwrap();
    wait_for(&|| (0..n).all(|r| sync.join(format!("done.{r}")).exists()), "not every rank checked");
}

/// Rail0 goes down on all four hosts' interfaces after creation (no route on it any more);
/// ranks 0 and 2, and 1 and 3, then make their first data link: the lower rank logs one WARN
/// naming rail1 and the peer's rail1 address, the exchange is exact and every rank exits 0.
#[test]
fn a_data_link_first_needed_after_rail0_died_goes_over_rail1() {
    new_link_after_rail0('x', false);
}

/// The same with rail0's bridge down (every host's rail0 stays up, and what it sends is lost):
/// the dial of the peer's bootstrap address goes unanswered for its bound (2 s) before rail1's
/// is dialled, and both ends keep the link on rail1 alone (rail0 still looks usable).
#[test]
fn a_data_link_first_needed_after_rail0_switch_died_goes_over_rail1() {
    new_link_after_rail0('y', true);
}

/// Four hosts (namespaces `lis<pid><tag>*`), rail0 cut at its bridge (`bridge`) or on every
/// host's interface once each rank is created, then [`child_new_link_after_rail0`]; checks.
fn new_link_after_rail0(tag: char, bridge: bool) {
    let prefix = format!("lis{}{tag}", std::process::id() % 100_000);
    let script = |args: &[&str]| {
        Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"))
            .args(args)
            .env("OXR_PREFIX", &prefix)
            .env("OXR_NET", "10.249")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !script(&["hosts", "4"]) {
        common::skipped("new link after rail0: cannot create network namespaces (needs root, iproute2, bridge)");
        return;
    }
    struct Down<'a>(&'a dyn Fn(&[&str]) -> bool);
    impl Drop for Down<'_> {
        fn drop(&mut self) {
            (self.0)(&["down"]);
        }
    }
    let _down = Down(&script);
    let sync = std::env::temp_dir().join(format!("{prefix}-sync"));
    let _ = std::fs::remove_dir_all(&sync);
    std::fs::create_dir_all(&sync).unwrap();
    let children: Vec<std::process::Child> = (0..4)
        .map(|rank| {
            Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns-rails.sh"))
                .args(["run", &rank.to_string()])
                .arg(std::env::current_exe().unwrap())
                .args(["child_new_link_after_rail0", "--exact", "--nocapture", "--test-threads=1"])
                .env("OXR_PREFIX", &prefix)
                .env(NEW_LINK, &sync)
                .env("OXCCL_RANK", rank.to_string())
                .env("OXCCL_NRANKS", "4")
                .env("MASTER_ADDR", "10.249.0.1")
                .env("MASTER_PORT", "29621")
                .env("OXCCL_TIMEOUT_MS", "20000")
                .env("OXCCL_DEBUG", "INFO")
                .env("OXCCL_SOCKET_IFNAME", "rail0,rail1")
                .env_remove("OXCCL_HOSTID")
                .env_remove("OXCCL_TRANSPORT")
                .env_remove("OXCCL_NET")
                .env_remove("NCCL_SOCKET_IFNAME")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank in its namespace")
        })
        .collect();
    let all = if bridge {
        format!("ip -n {prefix}sw link set br0 down")
    } else {
        (0..4).map(|h| format!("ip -n {prefix}{h} link set rail0 down &")).collect::<String>() + " wait"
    };
    let outs = cut_when_ready(children, &sync, Duration::from_secs(60), &all, Duration::from_secs(60));
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        let p = r ^ 2;
        assert!(out.contains(&format!("rank {r}: exchange with rank {p} after the cut exact")), "rank {r}:\n{out}");
        for bad in ["stopped answering heartbeats", "without closing", "failed:"] {
            assert!(!out.contains(bad), "rank {r}: {bad:?}:\n{out}");
        }
        if r < p {
            let want = format!("rank {r}: rank {p}'s data listener 10.249.0.{}:", p + 1);
            let warn = out.lines().find(|l| l.contains(" WARN ") && l.contains(&want));
            let warn = warn.unwrap_or_else(|| panic!("rank {r}: no WARN for the link to rank {p}:\n{out}"));
            let via = format!("data link through rail rail1, its address 10.249.1.{}:", p + 1);
            assert!(warn.contains(&via), "rank {r}: {warn}");
            eprintln!("{warn}");
        }
        let alone = format!("rank {r}: rank {p}: link made on rail rail1 (the bootstrap's rail did not answer)");
        assert_eq!(out.contains(&alone), bridge, "rank {r}: the link to rank {p}:\n{out}");
        assert!(out.contains(&format!("rank {r}: rank {p} via TCP, 1 socket(s)")), "rank {r}:\n{out}");
    }
}
