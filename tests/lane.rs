//! Multi-process tests of the small all-reduce path (`engine::lane`): recursive doubling over
//! the shared-memory links' lanes, for all-reduces of at most 1000 bytes on 2 and 4 ranks.
//!
//! * the path is taken (its INFO line) and every type × operator, in place and out of place,
//!   matches an f64 reference computed from every rank's inputs;
//! * every rank's result is bit-identical to every other's, floating-point max/min of signed
//!   zeros and NaNs included (each rank evaluates the same expression tree);
//! * calls alternating across the path's limit (1000 B on the lane, 1004 B on the ring) on the
//!   same links stay correct;
//! * with `OXCCL_SPIN_US=0` every wait sleeps on the lane's futex: results stay correct;
//! * a rank killed with SIGKILL in a loop of small all-reduces: the survivors fail with
//!   `ncclRemoteError` within 2 s (the timeout is 20 s).

mod common;

use common::allreduce::check_case;
use oxccl::{Communicator, DataType, ReduceOp};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn env(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("OXCCL_SOCKET_IFNAME", "lo".to_string()),
        ("OXCCL_TIMEOUT_MS", "20000".to_string()),
        ("OXCCL_TRANSPORT", "shm".to_string()),
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
    let mut seed = 1000;
    // Every type × op, both placements, at 1 element, a few, and the lane's largest size.
    for t in DataType::ALL {
        for op in ReduceOp::ALL {
            for in_place in [false, true] {
                for count in [1, 5, 1000 / t.size()] {
                    seed += 1;
                    check_case(&comm, t, op, count, in_place, seed).unwrap_or_else(|e| panic!("{e}"));
                }
            }
        }
    }
    // Bit-identical results across ranks with awkward float inputs: a digest per rank.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for t in DataType::ALL.into_iter().filter(|t| t.is_float()) {
        for op in ReduceOp::ALL {
            let count = 64;
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
    // Across the path's limit on the same links: 250 f32 (1000 B, lane), 251 (1004 B, ring).
    for k in 0..200 {
        let count = 250 + k % 2;
        check_case(&comm, DataType::Float32, ReduceOp::Sum, count, k % 3 == 0, 5000 + k)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    eprintln!("DONE rank={rank} n={n}");
}

#[test]
fn small_all_reduces_take_the_lane_match_the_reference_and_agree_bit_for_bit() {
    if common::child_role().is_some() {
        return;
    }
    for (n, extra) in [(2, None), (4, None), (2, Some("0"))] {
        let mut e = env(&[("OXCCL_DEBUG", "INFO")]);
        if let Some(s) = extra {
            e.push(("OXCCL_SPIN_US", s.to_string()));
        }
        let res = common::run_ranks("child_matrix", n, &e, Duration::from_secs(300));
        common::assert_all_ok(&res);
        let mut digests = Vec::new();
        for (r, (_, log)) in res.iter().enumerate() {
            assert!(
                log.contains("take the shared-memory lane"),
                "{n} ranks (spin {extra:?}): rank {r} did not take the lane:\n{log}"
            );
            assert!(log.contains(&format!("DONE rank={r} n={n}")), "rank {r}:\n{log}");
            let d = log.lines().find_map(|l| l.strip_prefix("DIGEST ")).expect("digest").to_string();
            digests.push(d);
        }
        assert!(digests.iter().all(|d| *d == digests[0]), "{n} ranks: results differ between ranks: {digests:?}");
    }
}

#[test]
fn child_until_killed() {
    let Some(comm) = join() else { return };
    let rank = comm.rank();
    let send = vec![rank as f32; 16];
    let mut recv = vec![0f32; 16];
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
fn a_rank_killed_in_a_loop_of_small_all_reduces_fails_the_others_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("lane-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = env(&[("OXCCL_TEST_READY", dir.to_str().unwrap())]);
    let mut ranks = common::spawn_ranks("child_until_killed", 4, &e);
    let start = Instant::now();
    while (0..4).any(|r| !dir.join(format!("ready-{r}")).exists()) {
        if start.elapsed() > Duration::from_secs(60) || ranks.iter_mut().any(|c| c.try_wait().unwrap().is_some()) {
            for c in &mut ranks {
                let _ = c.kill();
            }
            panic!("ranks did not all start: {:?}", common::wait_all(ranks, Duration::from_secs(5)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    ranks[3].kill().unwrap();
    let killed = Instant::now();
    let res = common::wait_all(ranks, Duration::from_secs(30));
    let took = killed.elapsed();
    for (r, (ok, log)) in res.iter().enumerate().take(3) {
        assert!(!ok, "rank {r} should have failed:\n{log}");
        assert!(log.contains("RESULT kind=Remote"), "rank {r} should fail with a remote error:\n{log}");
    }
    assert!(took < Duration::from_secs(2), "survivors took {took:?} to fail (timeout 20 s)");
    let _ = std::fs::remove_dir_all(&dir);
}
