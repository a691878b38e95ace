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
use common::planless::{assert_same_digests, join, print_awkward_digest, shm_env as env};
use oxccl::{DataType, ReduceOp};
use std::time::Duration;

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
    print_awkward_digest(&comm, 64);
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
        assert_same_digests(&res, n, "take the shared-memory lane", &format!("{n} ranks (spin {extra:?})"));
    }
}

#[test]
fn child_until_killed() {
    if let Some(comm) = join() {
        common::planless::all_reduce_until_failure(&comm, 16);
    }
}

#[test]
fn a_rank_killed_in_a_loop_of_small_all_reduces_fails_the_others_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    common::planless::kill_one_and_expect_remote_errors("child_until_killed", 4, &env(&[]), "lane");
}
