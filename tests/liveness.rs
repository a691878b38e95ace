//! Liveness through the control channel, with real rank processes (copies of this test
//! binary, see tests/common) and `OXCCL_TIMEOUT_MS=600000`, so that only the control channel
//! can end a wait in time: a SIGSTOPped rank is reported by every other rank within 12 s
//! (`OXCCL_LIVENESS_TIMEOUT_MS=5000`, shared memory and TCP); a rank busy in user code for
//! longer than the liveness timeout only delays the others, who then complete correctly (and
//! a rank that exits without destroying its communicator is no death); a rank killed inside
//! `ncclCommSplit` fails every survivor within 2 s.

mod common;

use oxccl::{Collectives, Communicator, ReduceOp, UniqueId};
use std::process::Child;
use std::time::{Duration, Instant};

const ELEMS: usize = 1 << 18;

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

/// Whether all-reduce results are the sum over `n` ranks of `(i % 7) + r`.
fn sum_ok(recv: &[f32], n: usize) -> bool {
    recv.iter().enumerate().step_by(997).all(|(i, &v)| v == (n * (i % 7) + n * (n - 1) / 2) as f32)
}

/// One rank. `LIVE_MODE`:
/// - `stop`: all-reduces of `LIVE_ELEMS` floats (default 1 MiB) in a loop; rank `LIVE_VICTIM` stops itself (SIGSTOP) before
///   its 6th call. Survivors print `RESULT kind=<k> ms=<since last success> msg=<text>`.
/// - `busy`: 10 all-reduces; rank `LIVE_VICTIM` sleeps `LIVE_SLEEP_MS` before its 6th and
///   afterwards exits without destroying its communicator. Others print `WAITED ms=<6th
///   call>`, then `QUIET` when, 1.5 s after the last call, their communicator still has no
///   error.
/// - `split`: 2 all-reduces, then `ncclCommSplit` (one color); rank `LIVE_VICTIM` instead
///   takes part in the split's two exchanges by hand and kills itself (SIGKILL) before it
///   joins the child. Survivors print `RESULT kind=<k> ms=<split duration> msg=<text>`.
/// - `split-rendezvous`: as `split`, but the victim first completes the child's rendezvous
///   (with the id rank 0, the child's rank 0, published), so it dies while the survivors open
///   the child's connections.
#[test]
fn live_child() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let mode = var("LIVE_MODE");
    let victim: usize = var("LIVE_VICTIM").parse().unwrap_or(usize::MAX);
    let comm = Communicator::init_rank(n, &UniqueId::from_hex(&id).expect("id"), rank).expect("init");
    let elems = var("LIVE_ELEMS").parse().unwrap_or(ELEMS);
    let send: Vec<f32> = (0..elems).map(|i| (i % 7) as f32 + rank as f32).collect();
    let mut recv = vec![0f32; elems];
    let mut last_ok = Instant::now();
    let iters = match mode.as_str() {
        "busy" => 10,
        "split" | "split-rendezvous" => 2,
        _ => usize::MAX,
    };
    let start = Instant::now();
    for it in 0..iters {
        assert!(start.elapsed() < Duration::from_secs(60), "rank {rank}: still running after 60 s");
        let t = Instant::now();
        if rank == victim && it == 5 {
            if mode == "stop" {
                // SAFETY: raise(3) with a valid signal number.
                unsafe { libc::raise(libc::SIGSTOP) };
            } else {
                std::thread::sleep(Duration::from_millis(var("LIVE_SLEEP_MS").parse().unwrap()));
            }
        }
        match comm.all_reduce(&send, &mut recv, ReduceOp::Sum) {
            Ok(()) => {
                assert!(sum_ok(&recv, n), "rank {rank}: wrong all-reduce result in call {it}");
                last_ok = Instant::now();
                if it == 5 && rank != victim {
                    eprintln!("WAITED ms={}", t.elapsed().as_millis());
                }
            }
            Err(e) => {
                eprintln!("RESULT kind={} ms={} msg={}", e.code(), last_ok.elapsed().as_millis(), e.message());
                return;
            }
        }
    }
    match mode.as_str() {
        "busy" if rank == victim => std::mem::forget(comm),
        "busy" => {
            std::thread::sleep(Duration::from_millis(1500));
            match comm.async_error() {
                None => eprintln!("QUIET"),
                Some(e) => eprintln!("NOISY {}", e.message()),
            }
        }
        "split" | "split-rendezvous" if rank == victim => {
            // The split's two exchanges (color 0, key = rank, no id), then death.
            let mut rec = 0i64.to_le_bytes().to_vec();
            rec.extend_from_slice(&(rank as i64).to_le_bytes());
            rec.extend_from_slice(&[0u8; 128]);
            let mut all = vec![0u8; rec.len() * n];
            comm.all_gather(&rec[..], &mut all[..]).expect("first exchange");
            comm.all_gather(&rec[..], &mut all[..]).expect("second exchange");
            if mode == "split-rendezvous" {
                // Rank 0 leads the child (key = rank): its record holds the child's id.
                let mut bytes = [0u8; 128];
                bytes.copy_from_slice(&all[16..rec.len()]);
                let deadline = Instant::now() + Duration::from_secs(30);
                let _boot = oxccl::bootstrap::rendezvous(&UniqueId { bytes }, n, rank, deadline, false)
                    .expect("the child's rendezvous");
            }
            // SAFETY: kill(2) on our own pid; no memory is involved.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        "split" | "split-rendezvous" => {
            let t = Instant::now();
            match comm.split(Some(0), rank as i32) {
                Ok(_) => eprintln!("RESULT kind=0 ms={} msg=split succeeded", t.elapsed().as_millis()),
                Err(e) => eprintln!("RESULT kind={} ms={} msg={}", e.code(), t.elapsed().as_millis(), e.message()),
            }
        }
        _ => {}
    }
}

fn vars(mode: &str, victim: usize, liveness_ms: u64, transport: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LIVE_MODE", mode.to_string()),
        ("LIVE_VICTIM", victim.to_string()),
        ("OXCCL_TIMEOUT_MS", "600000".to_string()),
        ("OXCCL_LIVENESS_TIMEOUT_MS", liveness_ms.to_string()),
        ("OXCCL_TRANSPORT", transport.to_string()),
    ]
}

/// Waits for every child but `victim` (at most `limit`), then resumes and kills them all;
/// every child's stderr.
fn wait_survivors(mut children: Vec<Child>, victim: usize, limit: Duration) -> Vec<String> {
    let start = Instant::now();
    let mut done = vec![false; children.len()];
    done[victim] = true;
    while done.iter().any(|d| !d) && start.elapsed() < limit {
        for (i, c) in children.iter_mut().enumerate() {
            if !done[i] && c.try_wait().ok().flatten().is_some() {
                done[i] = true;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in children.iter_mut() {
        // SAFETY: kill(2) of our own child's pid; a stopped child must run to take SIGKILL's exit.
        unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGCONT) };
        let _ = c.kill();
    }
    children
        .into_iter()
        .map(|c| c.wait_with_output().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).unwrap_or_default())
        .collect()
}

/// A survivor's `RESULT` line: (ncclResult_t, ms, message).
fn report(stderr: &str) -> Option<(i32, u128, String)> {
    let line = stderr.lines().find(|l| l.starts_with("RESULT "))?;
    let kind = line.split("kind=").nth(1)?.split(' ').next()?.parse().ok()?;
    let ms = line.split("ms=").nth(1)?.split(' ').next()?.parse().ok()?;
    Some((kind, ms, line.split("msg=").nth(1)?.to_string()))
}

/// SIGSTOP of rank 1 of `n` over `transport` with a 10-minute timeout: every survivor fails
/// with ncclRemoteError within 12 s of its last success, naming the stopped rank.
fn sigstop_reported(transport: &str, n: usize, elems: usize) {
    let victim = 1;
    let mut v = vars("stop", victim, 5000, transport);
    v.push(("LIVE_ELEMS", elems.to_string()));
    let outs = wait_survivors(common::spawn_ranks("live_child", n, &v), victim, Duration::from_secs(40));
    for (r, out) in outs.iter().enumerate().filter(|(r, _)| *r != victim) {
        let (kind, ms, msg) = report(out).unwrap_or_else(|| panic!("{transport}: rank {r} reported no error:\n{out}"));
        println!("{transport}: rank {r}: {ms} ms: {msg}");
        assert_eq!(kind, 6, "{transport}: rank {r}: expected ncclRemoteError, got {kind}: {msg}");
        assert!(ms < 12_000, "{transport}: rank {r} took {ms} ms to fail: {msg}");
        assert!(ms >= 3_500, "{transport}: rank {r} failed after {ms} ms, before the 5 s liveness timeout: {msg}");
        assert!(
            msg.contains(&format!("rank {r}:")) && msg.contains("rank 1 (") && msg.contains("heartbeats"),
            "{transport}: rank {r}'s error must name itself and the silent rank 1: {msg}"
        );
    }
}

#[test]
fn sigstopped_rank_is_reported_by_every_rank_within_12s_over_shared_memory() {
    if common::child_role().is_some() {
        return;
    }
    sigstop_reported("shm", 3, ELEMS);
}

/// As above with 2 ranks and 8-byte all-reduces (the small-message lane's waits).
#[test]
fn sigstopped_rank_is_reported_within_12s_on_the_small_message_path() {
    if common::child_role().is_some() {
        return;
    }
    sigstop_reported("shm", 2, 2);
}

#[test]
fn sigstopped_rank_is_reported_by_every_rank_within_12s_over_tcp() {
    if common::child_role().is_some() {
        return;
    }
    sigstop_reported("tcp", 3, ELEMS);
}

/// Rank 1 of 3 sleeps 8 s between calls, with a 3 s liveness timeout: its liveness thread
/// keeps beating, so the others wait for it and complete every call correctly; its exit
/// without destroying its communicator is not taken for a death either.
#[test]
fn a_rank_busy_longer_than_the_liveness_timeout_only_delays_the_others() {
    if common::child_role().is_some() {
        return;
    }
    let (n, victim) = (3, 1);
    let mut v = vars("busy", victim, 3000, "auto");
    v.push(("LIVE_SLEEP_MS", "8000".to_string()));
    let results = common::run_ranks("live_child", n, &v, Duration::from_secs(60));
    common::assert_all_ok(&results);
    for (r, (_, out)) in results.iter().enumerate().filter(|(r, _)| *r != victim) {
        let waited: u128 = out
            .lines()
            .find_map(|l| l.strip_prefix("WAITED ms="))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("rank {r} did not complete its 6th call:\n{out}"));
        assert!(waited >= 7_000, "rank {r} waited only {waited} ms for the busy rank");
        assert!(out.lines().any(|l| l == "QUIET"), "rank {r}: the busy rank's exit was taken for a failure:\n{out}");
    }
}

/// Rank 2 of 3 dies (SIGKILL) after the split's exchanges, before it joins the child: the
/// survivors, waiting in the child's rendezvous, fail within 2 s naming it.
#[test]
fn a_rank_killed_inside_split_fails_every_survivor_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    let (n, victim) = (3, 2);
    let outs = wait_survivors(
        common::spawn_ranks("live_child", n, &vars("split", victim, 20_000, "auto")),
        victim,
        Duration::from_secs(30),
    );
    for (r, out) in outs.iter().enumerate().filter(|(r, _)| *r != victim) {
        let (kind, ms, msg) = report(out).unwrap_or_else(|| panic!("rank {r} reported nothing:\n{out}"));
        println!("split: rank {r}: {ms} ms: {msg}");
        assert_eq!(kind, 6, "rank {r}: expected ncclRemoteError, got {kind}: {msg}");
        assert!(ms < 2_000, "rank {r} took {ms} ms to fail: {msg}");
        assert!(msg.contains("ncclCommSplit") && msg.contains("rank 2 ("), "rank {r}: {msg}");
    }
}

/// Rank 2 of 3 completes the child's rendezvous of `ncclCommSplit`, then dies (SIGKILL) while
/// the survivors open the child's control channels and links to it: every survivor fails
/// within 2 s naming it (not after `OXCCL_TIMEOUT_MS`, 10 minutes here).
#[test]
fn a_rank_killed_in_the_childs_rendezvous_fails_every_survivor_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    let (n, victim) = (3, 2);
    let outs = wait_survivors(
        common::spawn_ranks("live_child", n, &vars("split-rendezvous", victim, 20_000, "auto")),
        victim,
        Duration::from_secs(30),
    );
    for (r, out) in outs.iter().enumerate().filter(|(r, _)| *r != victim) {
        let (kind, ms, msg) = report(out).unwrap_or_else(|| panic!("rank {r} reported nothing:\n{out}"));
        println!("split-rendezvous: rank {r}: {ms} ms: {msg}");
        assert_eq!(kind, 6, "rank {r}: expected ncclRemoteError, got {kind}: {msg}");
        assert!(ms < 2_000, "rank {r} took {ms} ms to fail: {msg}");
        assert!(msg.contains("ncclCommSplit") && msg.contains("rank 2 ("), "rank {r}: {msg}");
    }
}
