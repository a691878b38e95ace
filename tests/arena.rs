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
//! * a count whose byte length overflows is refused with `ncclInvalidArgument` before it reaches
//!   the arena; calls whose counts differ fail every rank with `ncclInvalidUsage` naming both;
//! * buffers in shareable host memory (`oxccl::SharedBuffer`, `ncclMemAlloc`'s), read by the
//!   other ranks where they lie: on 2, 3 and 4 ranks, every type × operator, in place and out of
//!   place, some ranks' buffers shared and others' not, at sizes up to several pieces, match the
//!   reference; the buffers are new at every call (so peers' mappings are replaced and evicted);
//! * a rank killed with SIGKILL in a loop of arena all-reduces: the survivors fail with
//!   `ncclRemoteError` within 2 s (the timeout is 20 s); the same with shared buffers, which
//!   the survivors were reading in place.

mod common;

use common::allreduce::{check_case, check_case_in};
use common::planless::{assert_same_digests, join, print_awkward_digest, shm_env};
use oxccl::{Collectives, DataType, ReduceOp};
use std::time::{Duration, Instant};

/// [`shm_env`] with the arena forced on (whatever the machine's CPU count), then `pairs`.
fn env(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    let mut v = shm_env(&[("OXCCL_ARENA", "1")]);
    v.extend(pairs.iter().map(|&(k, val)| (k, val.to_string())));
    v
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
    print_awkward_digest(&comm, 3000);
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
        assert_same_digests(&res, n, "take the host arena", &format!("{n} ranks (spin {spin:?})"));
    }
}

#[test]
fn child_shared() {
    let Some(comm) = join() else { return };
    let (rank, n) = (comm.rank(), comm.size());
    let mut case = 0usize;
    for t in DataType::ALL {
        for op in ReduceOp::ALL {
            for in_place in [false, true] {
                for count in [1, 67, 4099] {
                    case += 1;
                    // Which of this rank's buffers are shared differs by rank and case: every
                    // mix of shared and copied inputs and results meets in some call.
                    let k = (case + rank) % 4;
                    let shared = [k & 1 == 1, k & 2 == 2];
                    check_case_in(&comm, t, op, count, in_place, 5000 + case, shared).unwrap_or_else(|e| panic!("{e}"));
                }
            }
        }
    }
    for (k, t) in [DataType::Float32, DataType::Int8, DataType::Float64].into_iter().enumerate() {
        let count = (oxccl::engine::arena::SLOT / t.size()) * 2 + 77;
        for in_place in [false, true] {
            let shared = [true, rank % 2 == 0 || k == 0];
            check_case_in(&comm, t, ReduceOp::Sum, count, in_place, 9500 + k, shared).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    print_awkward_digest(&comm, 3000);
    eprintln!("DONE rank={rank} n={n}");
}

#[test]
fn shared_buffers_are_read_in_place_and_match_the_reference() {
    if common::child_role().is_some() {
        return;
    }
    for n in [2, 3, 4] {
        let res = common::run_ranks("child_shared", n, &env(&[("OXCCL_DEBUG", "INFO")]), Duration::from_secs(600));
        assert_same_digests(&res, n, "are read where they lie", &format!("{n} ranks, shared buffers"));
    }
}

#[test]
fn child_probe() {
    let Some(comm) = join() else { return };
    let (rank, n) = (comm.rank(), comm.size());
    // Two ranks, the arena not forced: calls from `PROBE_MIN` bytes ask at one barrier whether
    // every buffer is shared. Shared and unshared calls interleave, so probes find both
    // answers, skip calls after an unshared one, and resume.
    let count = oxccl::engine::arena::PROBE_MIN / 4 + 33;
    for k in 0..60usize {
        let all = k % 7 < 3 || k >= 50;
        let shared = if all { [true, true] } else { [k % 2 == 0, rank == 0] };
        let (t, op) = if k % 3 == 0 { (DataType::Float32, ReduceOp::Sum) } else { (DataType::Int32, ReduceOp::Max) };
        check_case_in(&comm, t, op, count + k, k % 4 == 1, 600 + k, shared).unwrap_or_else(|e| panic!("call {k}: {e}"));
    }
    eprintln!("DONE rank={rank} n={n}");
}

#[test]
fn two_ranks_take_the_arena_when_every_buffer_is_shared_and_their_plan_otherwise() {
    if common::child_role().is_some() {
        return;
    }
    let res = common::run_ranks("child_probe", 2, &shm_env(&[("OXCCL_DEBUG", "INFO")]), Duration::from_secs(300));
    common::assert_all_ok(&res);
    for (r, (_, log)) in res.iter().enumerate() {
        assert!(log.contains(&format!("DONE rank={r} n=2")), "rank {r}:\n{log}");
        assert!(log.contains("are read where they lie"), "rank {r} never read shared buffers in place:\n{log}");
    }
}

#[test]
fn child_shared_until_killed() {
    let Some(comm) = join() else { return };
    common::planless::all_reduce_until_failure_in(&comm, oxccl::engine::arena::PROBE_MIN / 4, true);
}

#[test]
fn a_rank_killed_while_the_others_read_its_shared_buffers_fails_them_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    // The arena forced (2 and 3 ranks), and 2 ranks on their own (the probe finds every
    // buffer shared). The survivors' mappings of the dead rank's memory stay valid.
    for (n, forced) in [(2, true), (3, true), (2, false)] {
        let e = if forced { env(&[]) } else { shm_env(&[]) };
        common::planless::kill_one_and_expect_remote_errors("child_shared_until_killed", n, &e, "arena-shared");
    }
}

#[test]
fn child_counts_differ() {
    let Some(comm) = join() else { return };
    let rank = comm.rank();
    let send = vec![1f32; 4096];
    let mut recv = vec![0f32; 4096];
    comm.all_reduce(&send[..2048], &mut recv[..2048], ReduceOp::Sum).expect("matched");
    // A count whose byte length wraps to 8 bytes is refused before it reaches the arena (it
    // used to read far past the buffers), and the communicator stays usable.
    let wraps = (1usize << 61) + 1;
    // SAFETY: the call must refuse the count before touching either buffer (8 valid bytes each).
    let e = unsafe {
        comm.all_reduce_raw(send.as_ptr().cast(), recv.as_mut_ptr().cast(), wraps, DataType::Float64, ReduceOp::Sum)
    }
    .expect_err("a count that overflows the address space");
    assert!(e.code() == 4 && e.message().contains("overflows"), "rank {rank}: {} {}", e.code(), e.message());
    comm.all_reduce(&send[..2048], &mut recv[..2048], ReduceOp::Sum).expect("usable after a refused count");
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
    if let Some(comm) = join() {
        common::planless::all_reduce_until_failure(&comm, 50_000);
    }
}

#[test]
fn a_rank_killed_in_a_loop_of_arena_all_reduces_fails_the_others_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    common::planless::kill_one_and_expect_remote_errors("child_until_killed", 3, &env(&[]), "arena");
}
