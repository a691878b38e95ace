//! Multi-process tests of buffers in shareable host memory (`oxccl::SharedBuffer`, what
//! `ncclMemAlloc` returns), which the host arena reads where they lie:
//!
//! * `many_ranks_read_shared_buffers_correctly`: 10 and 16 ranks (a call maps up to 2(n-1)
//!   peer allocations, more than the peer-mapping cache keeps between calls), out of place and
//!   in place, every rank's buffers shared or a mix of shared and unshared ranks, new buffers at
//!   every call: every result matches an f64 reference;
//! * `a_stranger_cannot_truncate_a_ranks_shared_buffer`: while the ranks all-reduce in a loop,
//!   a process that is not a member (a child of the test, same user) opens a rank's buffer
//!   through `/proc/<pid>/fd/<n>` and calls `ftruncate`: the call fails (the file is sealed) and
//!   every rank completes with correct results.

mod common;

use common::allreduce::check_case_in;
use common::planless::{join, shm_env};
use oxccl::{DataType, ReduceOp};
use std::time::Duration;

/// [`shm_env`] with the arena forced on (whatever the machine's CPU count).
fn env() -> Vec<(&'static str, String)> {
    shm_env(&[("OXCCL_ARENA", "1"), ("OXCCL_DEBUG", "INFO")])
}

#[test]
fn child_many() {
    let Some(comm) = join() else { return };
    let (rank, n) = (comm.rank(), comm.size());
    let mut seed = 100;
    for in_place in [false, true] {
        // Every rank's buffers shared, then a mix: every fourth rank copies, the others share
        // one or both buffers.
        for mixed in [false, true] {
            for (t, op, count) in [(DataType::Float32, ReduceOp::Sum, 4099), (DataType::Int32, ReduceOp::Max, 333)] {
                seed += 1;
                let shared = match (mixed, rank % 4) {
                    (false, _) => [true, true],
                    (true, 0) => [false, false],
                    (true, 1) => [true, false],
                    (true, 2) => [false, true],
                    (true, _) => [true, true],
                };
                check_case_in(&comm, t, op, count, in_place, seed, shared).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
    eprintln!("DONE rank={rank} n={n}");
}

#[test]
fn many_ranks_read_shared_buffers_correctly() {
    if common::child_role().is_some() {
        return;
    }
    for n in [10, 16] {
        let res = common::run_ranks("child_many", n, &env(), Duration::from_secs(300));
        common::assert_all_ok(&res);
        for (r, (_, log)) in res.iter().enumerate() {
            assert!(log.contains(&format!("DONE rank={r} n={n}")), "rank {r}:\n{log}");
            assert!(log.contains("are read where they lie"), "{n} ranks: rank {r} read no buffer in place:\n{log}");
        }
    }
}
