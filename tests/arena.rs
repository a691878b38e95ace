//! Multi-process tests of the arena all-reduce (`engine::arena`): every rank copies its input
//! into one shared host arena, reduces its slice from every rank's copy, and copies the other
//! slices out. `OXCCL_ARENA=1` takes the path whatever the machine's CPU count.
//!
//! * the path is taken (its INFO line) on 3 and 5 ranks, and every type × operator, in place
//!   and out of place, at sizes from one element to several pieces, matches an f64 reference
//!   computed from every rank's inputs;
//! * every rank's result is bit-identical to every other's, floating-point max/min of signed
//!   zeros and NaNs included (each slice is reduced once, in rank order);
//! * with `OXCCL_SPIN_US=0` every barrier sleeps on the arena's futex: results stay correct;
//! * calls whose counts differ fail every rank with `ncclInvalidUsage` naming both calls;
//! * a rank killed with SIGKILL in a loop of arena all-reduces: the survivors fail with
//!   `ncclRemoteError` within 2 s (the timeout is 20 s).

mod common;

use common::allreduce::check_case;
use oxccl::{Collectives, Communicator, DataType, ReduceOp};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn env(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("OXCCL_SOCKET_IFNAME", "lo".to_string()),
        ("OXCCL_TIMEOUT_MS", "20000".to_string()),
        ("OXCCL_TRANSPORT", "shm".to_string()),
        ("OXCCL_ARENA", "1".to_string()),
    ];
    v.extend(pairs.iter().map(|&(k, val)| (k, val.to_string())));
    v
}

fn join() -> Option<Communicator> {
    let (rank, n, id) = common::child_role()?;
    Some(Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).expect("init"))
}

/// FNV-1a of `bytes` folded into `h`.
fn fold(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Float inputs that make operand order visible: signed zeros, NaNs, infinities.
fn awkward(rank: usize, i: usize) -> f64 {
    match (rank + i) % 6 {
        0 => 0.0,
        1 => -0.0,
        2 => f64::NAN,
        3 => f64::INFINITY,
        4 => -1.5,
        _ => (rank * 7 + i) as f64,
    }
}

#[test]
fn child_matrix() {
    let Some(comm) = join() else { return };
    let (rank, n) = (comm.rank(), comm.size());
    let mut seed = 2000;
    for t in DataType::ALL {
        for op in ReduceOp::ALL {
            for in_place in [false, true] {
                // One element (one rank holds the whole slice), fewer elements than ranks, an
                // uneven split, and past the lane's limit.
                for count in [1, 2, 67, 4099] {
                    seed += 1;
                    check_case(&comm, t, op, count, in_place, seed).unwrap_or_else(|e| panic!("{e}"));
                }
            }
        }
    }
    // Several pieces (`SLOT` bytes per rank each) with a ragged last one, both placements.
    for (k, t) in [DataType::Float32, DataType::Float64, DataType::Int8].into_iter().enumerate() {
        let count = (oxccl::engine::arena::SLOT / t.size()) * 2 + 77;
        check_case(&comm, t, ReduceOp::Sum, count, k % 2 == 1, 9000 + k).unwrap_or_else(|e| panic!("{e}"));
        check_case(&comm, t, ReduceOp::Avg, count, k % 2 == 0, 9100 + k).unwrap_or_else(|e| panic!("{e}"));
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for t in DataType::ALL.into_iter().filter(|t| t.is_float()) {
        for op in ReduceOp::ALL {
            let count = 3000;
            let vals: Vec<f64> = (0..count).map(|i| awkward(rank, i)).collect();
            let mut send = vec![0u8; count * t.size()];
            oxccl::reduce::from_f64(t, &vals, &mut send);
            let mut recv = vec![0u8; send.len()];
            // SAFETY: both buffers hold `count` elements and do not overlap.
            unsafe { comm.all_reduce_raw(send.as_ptr(), recv.as_mut_ptr(), count, t, op) }.expect("awkward");
            h = fold(h, &recv);
        }
    }
    eprintln!("DIGEST {h:016x}");
    // Other collectives between arena calls on the same links.
    for k in 0..20 {
        check_case(&comm, DataType::Float32, ReduceOp::Sum, 300 + k, false, 7000 + k).unwrap_or_else(|e| panic!("{e}"));
        let mut b = vec![rank as f32; 100];
        comm.broadcast_in_place(&mut b, k % n).expect("broadcast");
        assert!(b.iter().all(|&v| v == (k % n) as f32), "broadcast between arena calls");
    }
    eprintln!("DONE rank={rank} n={n}");
}

#[test]
fn arena_all_reduces_match_the_reference_and_agree_bit_for_bit() {
    if common::child_role().is_some() {
        return;
    }
    for (n, spin) in [(3, None), (5, None), (3, Some("0"))] {
        let mut e = env(&[("OXCCL_DEBUG", "INFO")]);
        if let Some(s) = spin {
            e.push(("OXCCL_SPIN_US", s.to_string()));
        }
        let res = common::run_ranks("child_matrix", n, &e, Duration::from_secs(600));
        common::assert_all_ok(&res);
        let mut digests = Vec::new();
        for (r, (_, log)) in res.iter().enumerate() {
            assert!(log.contains("take the host arena"), "{n} ranks: rank {r} did not take the arena:\n{log}");
            assert!(log.contains(&format!("DONE rank={r} n={n}")), "rank {r}:\n{log}");
            digests.push(log.lines().find_map(|l| l.strip_prefix("DIGEST ")).expect("digest").to_string());
        }
        assert!(digests.iter().all(|d| *d == digests[0]), "{n} ranks: results differ between ranks: {digests:?}");
    }
}

#[test]
fn child_counts_differ() {
    let Some(comm) = join() else { return };
    let rank = comm.rank();
    let send = vec![1f32; 4096];
    let mut recv = vec![0f32; 4096];
    comm.all_reduce(&send[..2048], &mut recv[..2048], ReduceOp::Sum).expect("matched");
    let count = if rank == 1 { 4096 } else { 2048 };
    let start = Instant::now();
    match comm.all_reduce(&send[..count], &mut recv[..count], ReduceOp::Sum) {
        Ok(()) => eprintln!("RESULT kind=0 ms={}", start.elapsed().as_millis()),
        Err(e) => eprintln!("RESULT kind={} ms={} msg={}", e.code(), start.elapsed().as_millis(), e.message()),
    }
}

#[test]
fn arena_calls_with_different_counts_fail_every_rank_naming_both() {
    if common::child_role().is_some() {
        return;
    }
    let res = common::run_ranks("child_counts_differ", 3, &env(&[]), Duration::from_secs(60));
    for (r, (_, log)) in res.iter().enumerate() {
        let line = log.lines().find(|l| l.starts_with("RESULT ")).unwrap_or_else(|| panic!("rank {r}:\n{log}"));
        assert!(line.contains("kind=5"), "rank {r} must see ncclInvalidUsage: {line}");
        assert!(line.contains("collective mismatch"), "rank {r}: {line}");
        assert!(line.contains("count=4096") && line.contains("count=2048"), "rank {r} must name both calls: {line}");
        let ms: u128 = line.split("ms=").nth(1).and_then(|s| s.split(' ').next()).unwrap().parse().unwrap();
        assert!(ms < 2000, "rank {r} took {ms} ms (timeout 20 s)");
    }
}

#[test]
fn child_until_killed() {
    let Some(comm) = join() else { return };
    let rank = comm.rank();
    let send = vec![rank as f32; 50_000];
    let mut recv = vec![0f32; 50_000];
    if let Ok(d) = std::env::var("OXCCL_TEST_READY") {
        std::fs::write(PathBuf::from(d).join(format!("ready-{rank}")), b"").unwrap();
    }
    let start = Instant::now();
    loop {
        if let Err(e) = comm.all_reduce(&send, &mut recv, ReduceOp::Sum) {
            eprintln!("RESULT kind={:?} ms={}", e.kind(), start.elapsed().as_millis());
            std::process::exit(1);
        }
        assert!(start.elapsed() < Duration::from_secs(60), "rank {rank}: never failed");
    }
}

#[test]
fn a_rank_killed_in_a_loop_of_arena_all_reduces_fails_the_others_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("arena-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = env(&[("OXCCL_TEST_READY", dir.to_str().unwrap())]);
    let n = 3;
    let mut ranks = common::spawn_ranks("child_until_killed", n, &e);
    let start = Instant::now();
    while (0..n).any(|r| !dir.join(format!("ready-{r}")).exists()) {
        if start.elapsed() > Duration::from_secs(60) || ranks.iter_mut().any(|c| c.try_wait().unwrap().is_some()) {
            for c in &mut ranks {
                let _ = c.kill();
            }
            panic!("ranks did not all start: {:?}", common::wait_all(ranks, Duration::from_secs(5)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    ranks[n - 1].kill().unwrap();
    let killed = Instant::now();
    let res = common::wait_all(ranks, Duration::from_secs(30));
    let took = killed.elapsed();
    for (r, (ok, log)) in res.iter().enumerate().take(n - 1) {
        assert!(!ok, "rank {r} should have failed:\n{log}");
        assert!(log.contains("RESULT kind=Remote"), "rank {r} should fail with a remote error:\n{log}");
    }
    assert!(took < Duration::from_secs(2), "survivors took {took:?} to fail (timeout 20 s)");
    let _ = std::fs::remove_dir_all(&dir);
}
