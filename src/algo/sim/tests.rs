//! The simulator's proofs: every collective and algorithm under seeded random schedules.

use super::*;
use crate::algo::{build_on, hier, oneshot, ring, Algo, Node};

/// Every collective × algorithm at 1..=64 ranks (every size to 12, then a spread), a few
/// counts, in and out of place, several random schedules and pipe sizes each.
#[test]
fn every_collective_and_algorithm_at_1_to_64_ranks_under_random_schedules() {
    let sizes: Vec<usize> = (1..=12).chain([16, 17, 31, 32, 33, 48, 63, 64]).collect();
    let mut runs = 0;
    for &n in &sizes {
        let scrambled = hier::ring_order(&(0..n).map(|r| (r * 7 + 3) % 3).collect::<Vec<_>>());
        for coll in collectives(n) {
            for &algo in coll.algorithms() {
                let big = n <= 12;
                let counts: &[usize] = if big { &[0, 1, 7, 97] } else { &[5] };
                for &count in counts {
                    for in_place in [false, true] {
                        let seed = (n * 1_000_003 + count * 101 + usize::from(in_place)) as u64 ^ algo as u64;
                        let order = if seed % 2 == 0 { ring::identity(n) } else { scrambled.clone() };
                        let chunk = [8, 24, 64, 1 << 20][(seed % 4) as usize];
                        let capacity = [1, 7, 64, 4096][((seed >> 2) % 4) as usize];
                        let op = if seed % 3 == 0 { ReduceOp::Max } else { ReduceOp::Sum };
                        let build =
                            |r, ip| build_on(coll, algo, &order, r, count, 8, chunk, ip).expect("a supported pair");
                        check(coll, n, count, in_place, op, capacity, seed, &build).unwrap_or_else(|e| {
                            panic!("{coll:?} {algo:?} n={n} count={count} in_place={in_place} chunk={chunk} pipe={capacity} seed={seed}: {e}")
                        });
                        runs += 1;
                    }
                }
            }
        }
    }
    assert!(runs > 1000, "{runs} runs");
}

#[test]
fn one_shot_and_hierarchical_all_reduce_under_random_schedules() {
    for seed in 0..20u64 {
        for count in [0, 1, 33] {
            let build = |r, _| oneshot::all_reduce(r, count, 8, 16);
            check(Collective::AllReduce, 2, count, seed % 2 == 0, ReduceOp::Sum, 1 + seed as usize, seed, &build)
                .unwrap_or_else(|e| panic!("one-shot count={count} seed={seed}: {e}"));
        }
    }
    for groups in [vec![0, 0, 1, 1], vec![0, 1, 0, 1, 2], vec![0, 0, 0, 1], vec![0, 1, 1, 2, 2, 2, 0, 3]] {
        for seed in 0..8u64 {
            let n = groups.len();
            let build = |r, _| hier::all_reduce(r, &groups, 41, 8, 24);
            check(Collective::AllReduce, n, 41, seed % 2 == 1, ReduceOp::Sum, 5 + seed as usize, seed, &build)
                .unwrap_or_else(|e| panic!("hierarchical {groups:?} seed={seed}: {e}"));
        }
    }
}

/// The ring all-reduce in every chunk order (no lookahead, a few chunks, step by step), with
/// pipes as small as one byte: each order's send and receive streams still pair up, nothing
/// deadlocks, and every rank ends with the reduction.
#[test]
fn ring_all_reduce_in_every_chunk_order_under_random_schedules() {
    for n in [2, 3, 4, 5] {
        for ahead in [0, 1, 3, usize::MAX] {
            for (seed, count) in [0, 1, 7, 97, 1000].into_iter().enumerate() {
                let seed = (seed * 31 + n * 7 + ahead.min(9)) as u64;
                let chunk = [8, 24, 64][(seed % 3) as usize];
                let capacity = [1, 7, 64, 4096][((seed >> 2) % 4) as usize];
                let build = |r, _| ring::all_reduce_ahead(r, n, count, 8, chunk, ahead);
                check(Collective::AllReduce, n, count, seed % 2 == 0, ReduceOp::Sum, capacity, seed, &build)
                    .unwrap_or_else(|e| panic!("n={n} ahead={ahead} count={count} chunk={chunk}: {e}"));
            }
        }
    }
}

#[test]
fn ring_and_tree_at_1024_ranks() {
    let n = 1024;
    for (coll, algo) in [
        (Collective::AllReduce, Algo::Ring),
        (Collective::AllReduce, Algo::Tree),
        (Collective::Broadcast { root: 700 }, Algo::Tree),
        (Collective::Reduce { root: 3 }, Algo::Tree),
        (Collective::AllGather, Algo::Ring),
    ] {
        let count = if coll == Collective::AllReduce { 2 * n + 5 } else { 3 };
        let build = |r, _| crate::algo::build(coll, algo, r, n, count, 8, 64, false).expect("supported");
        check(coll, n, count, false, ReduceOp::Sum, 256, 42, &build)
            .unwrap_or_else(|e| panic!("{coll:?} {algo:?} at {n} ranks: {e}"));
    }
}

#[test]
fn a_deadlock_fails_at_once_naming_the_stuck_ranks() {
    // Both ranks receive before they send: nobody can move.
    let plan = |peer| Plan {
        nodes: vec![
            Node { step: Step::Recv { peer, dst: Region::recv(0, 8), action: Action::Store }, deps: vec![] },
            Node { step: Step::Send { peer, src: Region::send(0, 8) }, deps: vec![0] },
        ],
        scratch: vec![],
    };
    let build = |r: usize, _| plan(1 - r);
    let e = check(Collective::AllReduce, 2, 1, false, ReduceOp::Sum, 64, 1, &build).unwrap_err();
    assert!(e.starts_with("deadlock after 1 rounds"), "{e}");
    assert!(e.contains("stuck ranks [0, 1]") && e.contains("rank 1 at step 0 (Recv"), "{e}");
}

#[test]
fn a_missing_dependency_gives_a_wrong_result_under_some_schedule() {
    // Rank 0 forwards its receive buffer without waiting for the receive that fills it.
    let racy = |r: usize, _| {
        let mut p = Plan::default();
        if r == 0 {
            p.push(Step::Recv { peer: 1, dst: Region::recv(0, 8), action: Action::Store }, vec![]);
            p.push(Step::Send { peer: 1, src: Region::recv(0, 8) }, vec![]);
        } else {
            p.push(Step::Send { peer: 0, src: Region::send(0, 8) }, vec![]);
            p.push(Step::Recv { peer: 0, dst: Region::recv(0, 8), action: Action::Store }, vec![]);
        }
        p
    };
    let wrong = (0..32u64)
        .filter(|&s| check(Collective::Broadcast { root: 1 }, 2, 1, false, ReduceOp::Sum, 8, s, &racy).is_err())
        .count();
    assert!(wrong > 0, "no schedule caught the race");
}
