//! `ncclCommShrink` after ranks died: 4 rank processes all-reduce in a loop, the ranks to be
//! excluded kill themselves with SIGKILL in the middle of a call, the survivors get an error,
//! shrink the failed parent (`NCCL_SHRINK_ABORT`, or the default flag) and all-reduce on the
//! child, checked against an f64 reference. Also: a survivor that is itself dead (the child's
//! root, or another member; dead before the shrink or while the others wait in it) makes the
//! others fail within 2 s with `ncclRemoteError` naming it, found by the failed parent's
//! control channels, however long `OXCCL_TIMEOUT_MS` is; a survivor that is alive but late is
//! waited for. Ranks are copies of this test binary (see tests/common).

mod common;

use oxccl::{Communicator, ReduceOp, UniqueId};
use std::time::{Duration, Instant};

const ELEMS: usize = 1 << 18;

fn ranks_of(var: &str) -> Vec<usize> {
    std::env::var(var).unwrap_or_default().split(',').filter_map(|s| s.trim().parse().ok()).collect()
}

/// Input of parent rank `r` at index `i` (small integers: every sum is exact in f32).
fn input(r: usize, i: usize) -> f32 {
    ((i * 7 + r * 13) % 31) as f32 - 15.0
}

/// One rank. `SHRINK_KILL`: ranks that SIGKILL themselves 1 ms into their 4th all-reduce;
/// `SHRINK_EXCLUDE`: the exclude list; `SHRINK_FLAG`: `abort` or `default`; `SHRINK_LATE`:
/// ranks that wait `SHRINK_LATE_MS` after the parent's failure before they shrink;
/// `SHRINK_DIE`: ranks that wait as long and then SIGKILL themselves instead of shrinking.
/// Survivors print `FAILED kind=<ncclResult_t>` for the parent's error, then
/// `CHILD rank=<r> size=<n> ms=<shrink duration>` after a checked child all-reduce, or
/// `SHRINK_ERR kind=<k> ms=<ms> msg=<text>`; they exit 0.
#[test]
fn shrink_child() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let kill = ranks_of("SHRINK_KILL");
    let exclude = ranks_of("SHRINK_EXCLUDE");
    let late_ms = std::env::var("SHRINK_LATE_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let abort = std::env::var("SHRINK_FLAG").as_deref() == Ok("abort");
    let comm = Communicator::init_rank(n, &UniqueId::from_hex(&id).expect("id"), rank).expect("init");
    let send: Vec<f32> = (0..ELEMS).map(|i| input(rank, i)).collect();
    let mut recv = vec![0f32; ELEMS];
    let start = Instant::now();
    let mut it = 0;
    loop {
        assert!(start.elapsed() < Duration::from_secs(30), "rank {rank}: no failure after 30 s");
        if kill.contains(&rank) && it == 3 {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(1));
                // SAFETY: kill(2) on our own pid; no memory is involved.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            });
        }
        it += 1;
        match comm.all_reduce(&send, &mut recv, ReduceOp::Sum) {
            Ok(()) => {
                let want = |i: usize| (0..n).map(|r| f64::from(input(r, i))).sum::<f64>();
                assert!(
                    recv.iter().enumerate().step_by(101).all(|(i, &v)| f64::from(v) == want(i)),
                    "wrong parent all-reduce"
                );
            }
            Err(e) => {
                eprintln!("FAILED kind={}", e.code());
                break;
            }
        }
    }
    if ranks_of("SHRINK_LATE").contains(&rank) {
        std::thread::sleep(Duration::from_millis(late_ms));
    }
    if ranks_of("SHRINK_DIE").contains(&rank) {
        std::thread::sleep(Duration::from_millis(late_ms));
        // SAFETY: kill(2) on our own pid; no memory is involved.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let t = Instant::now();
    let child = match comm.shrink_with(&exclude, abort) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("SHRINK_ERR kind={} ms={} msg={}", e.code(), t.elapsed().as_millis(), e.message());
            return;
        }
    };
    let shrink_ms = t.elapsed().as_millis();
    let members: Vec<usize> = (0..n).filter(|r| !exclude.contains(r)).collect();
    assert_eq!(child.size(), members.len());
    assert_eq!(members[child.rank()], rank, "child ranks follow parent order");
    // A large sum (ring) and a small average in f64 on the child, against f64 references.
    child.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("child all-reduce");
    for (i, &v) in recv.iter().enumerate() {
        let want: f64 = members.iter().map(|&r| f64::from(input(r, i))).sum();
        assert_eq!(f64::from(v), want, "child sum at {i}");
    }
    let small: Vec<f64> = (0..37).map(|i| (rank * 37 + i) as f64 / 3.0).collect();
    let mut out = vec![0f64; 37];
    child.all_reduce(&small, &mut out, ReduceOp::Avg).expect("child avg");
    for (i, &v) in out.iter().enumerate() {
        let want = members.iter().map(|&r| (r * 37 + i) as f64 / 3.0).sum::<f64>() / members.len() as f64;
        assert!((v - want).abs() <= 1e-12 * want.abs().max(1.0), "child avg at {i}: {v} vs {want}");
    }
    eprintln!("CHILD rank={} size={} ms={shrink_ms}", child.rank(), child.size());
}

/// Runs 4 ranks with the given kill set, exclude list and flag; returns each survivor's stderr
/// (indexed by parent rank; killed ranks give `None`).
fn run(kill: &str, exclude: &str, flag: &str, timeout_ms: u64) -> Vec<Option<String>> {
    run_with(kill, exclude, flag, timeout_ms, &[])
}

/// [`run`] with more variables (`SHRINK_LATE`, `SHRINK_DIE`, `SHRINK_LATE_MS`); the ranks of
/// `SHRINK_DIE` count as killed.
fn run_with(kill: &str, exclude: &str, flag: &str, timeout_ms: u64, more: &[(&str, &str)]) -> Vec<Option<String>> {
    let mut env = vec![
        ("SHRINK_KILL", kill.to_string()),
        ("SHRINK_EXCLUDE", exclude.to_string()),
        ("SHRINK_FLAG", flag.to_string()),
        ("OXCCL_TIMEOUT_MS", timeout_ms.to_string()),
    ];
    env.extend(more.iter().map(|&(k, v)| (k, v.to_string())));
    let die = more.iter().find(|(k, _)| *k == "SHRINK_DIE").map_or("", |(_, v)| *v);
    let killed: Vec<usize> = kill.split(',').chain(die.split(',')).filter_map(|s| s.parse().ok()).collect();
    let out = common::run_ranks("shrink_child", 4, &env, Duration::from_secs(50));
    out.into_iter()
        .enumerate()
        .map(|(r, (ok, err))| {
            if killed.contains(&r) {
                return None;
            }
            assert!(ok, "survivor {r} failed:\n{err}");
            assert!(err.contains("FAILED kind="), "survivor {r} saw no parent failure:\n{err}");
            Some(err)
        })
        .collect()
}

fn child_line(err: &str) -> Option<(usize, usize)> {
    let l = err.lines().find(|l| l.starts_with("CHILD "))?;
    let rank = l.split("rank=").nth(1)?.split(' ').next()?.parse().ok()?;
    let size = l.split("size=").nth(1)?.split(' ').next()?.parse().ok()?;
    Some((rank, size))
}

/// How long the survivor's shrink took, from its `CHILD` line.
fn child_ms(err: &str) -> Option<u128> {
    let l = err.lines().find(|l| l.starts_with("CHILD "))?;
    l.split("ms=").nth(1)?.trim().parse().ok()
}

#[test]
fn survivors_shrink_after_a_rank_is_killed_mid_all_reduce() {
    let out = run("2", "2", "abort", 10_000);
    let got: Vec<Option<(usize, usize)>> = out.iter().map(|e| e.as_deref().and_then(child_line)).collect();
    assert_eq!(got, vec![Some((0, 3)), Some((1, 3)), None, Some((2, 3))], "{out:#?}");
}

#[test]
fn survivors_shrink_after_two_ranks_are_killed_with_the_default_flag() {
    // Ranks 0 and 3 die: the child's root is parent rank 1, whose parent has failed, and the
    // default flag on a failed parent recovers as NCCL_SHRINK_ABORT does.
    let out = run("0,3", "0,3", "default", 10_000);
    let got: Vec<Option<(usize, usize)>> = out.iter().map(|e| e.as_deref().and_then(child_line)).collect();
    assert_eq!(got, vec![None, Some((0, 2)), Some((1, 2)), None], "{out:#?}");
}

fn shrink_err(err: &str) -> (i32, u128, String) {
    let l = err.lines().find(|l| l.starts_with("SHRINK_ERR ")).unwrap_or_else(|| panic!("no shrink error:\n{err}"));
    let kind = l.split("kind=").nth(1).and_then(|s| s.split(' ').next()).and_then(|s| s.parse().ok()).unwrap();
    let ms = l.split("ms=").nth(1).and_then(|s| s.split(' ').next()).and_then(|s| s.parse().ok()).unwrap();
    (kind, ms, l.split("msg=").nth(1).unwrap_or("").to_string())
}

/// A survivor's shrink error: an `ncclRemoteError` within 2 s of `from_ms` (a shrink
/// duration) that names `dead` as a dead member, found by the parent's channels.
fn assert_dead_member_named(out: &[Option<String>], r: usize, dead: usize, from_ms: u128) -> u128 {
    let (kind, ms, msg) = shrink_err(out[r].as_deref().unwrap());
    println!("rank {r}: shrink failed after {ms} ms: {msg}");
    assert_eq!(kind, 6, "rank {r}: ncclRemoteError expected after {ms} ms: {msg}");
    assert!(ms < from_ms + 2000, "rank {r}: took {ms} ms: {msg}");
    assert!(msg.contains("shrink"), "rank {r}: message names the shrink: {msg}");
    assert!(
        msg.contains(&format!("(parent rank {dead}) died, found by the parent communicator")),
        "rank {r}: message names parent rank {dead}: {msg}"
    );
    ms
}

#[test]
fn a_dead_survivor_fails_the_shrink_within_2s_whatever_the_timeout() {
    // The timeout is far away: only the failed parent's control channels can end the waits.
    const TIMEOUT_MS: u64 = 60_000;
    // Rank 3 dies but is not excluded: the child's root (rank 0) and rank 1 wait for it.
    let out = run("2,3", "2", "abort", TIMEOUT_MS);
    for r in [0, 1] {
        assert_dead_member_named(&out, r, 3, 0);
    }
    // The child's root itself (rank 0) dies: the others cannot reach it.
    let out = run("0,2", "2", "default", TIMEOUT_MS);
    for r in [1, 3] {
        assert_dead_member_named(&out, r, 0, 0);
    }
}

#[test]
fn a_survivor_dying_while_the_others_wait_in_the_shrink_fails_them_within_2s() {
    // Rank 2 dies mid all-reduce and is excluded; rank 3 lives 1 s more, then dies without
    // shrinking: ranks 0 and 1 are waiting for it in the child's rendezvous by then.
    let more = [("SHRINK_DIE", "3"), ("SHRINK_LATE_MS", "1000")];
    let out = run_with("2", "2", "abort", 60_000, &more);
    for r in [0, 1] {
        let ms = assert_dead_member_named(&out, r, 3, 1000);
        assert!(ms >= 500, "rank {r} failed after {ms} ms, before rank 3 died");
    }
}

#[test]
fn a_late_but_live_survivor_is_waited_for() {
    // Rank 3 starts its shrink 3 s after the others, alive all along (its parent's channels
    // keep beating): the others wait and the child works.
    let more = [("SHRINK_LATE", "3"), ("SHRINK_LATE_MS", "3000")];
    let out = run_with("2", "2", "abort", 60_000, &more);
    let got: Vec<Option<(usize, usize)>> = out.iter().map(|e| e.as_deref().and_then(child_line)).collect();
    assert_eq!(got, vec![Some((0, 3)), Some((1, 3)), None, Some((2, 3))], "{out:#?}");
    for r in [0, 1] {
        let ms = out[r].as_deref().and_then(child_ms).expect("shrink duration");
        println!("rank {r}: shrink took {ms} ms");
        assert!(ms >= 2500, "rank {r}: its shrink took {ms} ms, so it did not wait for rank 3");
    }
}
