//! Every collective × algorithm with ranks as threads over in-memory links: 1..9 ranks with
//! every type × op at small counts, 16, 64 and 256 ranks with a thinner matrix; counts 0, 1,
//! nranks-1, primes and a large one; roots 0, last and middle; in place and out of place; small
//! forced chunks so pipelines have many stages. Every element is checked against an f64
//! reference computed independently of the library (see tests/harness).

#[path = "../src/bin/oxccl-perf/colls.rs"]
#[allow(dead_code)]
mod colls;
#[path = "../src/bin/oxccl-perf/data.rs"]
#[allow(dead_code)]
mod data;
mod harness;

use harness::{matrix, run_in_memory, Level};

fn check(ranks: &[usize], level: Level, colls: &[&str]) {
    for &n in ranks {
        let cases = matrix(n, level, colls);
        let t = std::time::Instant::now();
        let failures = run_in_memory(n, &cases);
        eprintln!("{colls:?} on {n} ranks: {} cases in {:.2?}", cases.len(), t.elapsed());
        assert!(
            failures.is_empty(),
            "{} failures on {n} ranks:\n{}",
            failures.len(),
            failures.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
        );
    }
}

const SMALL: [usize; 9] = [1, 2, 3, 4, 5, 6, 7, 8, 9];
const LARGE: [usize; 3] = [16, 64, 256];

#[test]
fn all_reduce_1_to_9_ranks() {
    check(&SMALL, Level::Full, &["all_reduce"]);
}

#[test]
fn broadcast_and_reduce_1_to_9_ranks() {
    check(&SMALL, Level::Full, &["broadcast", "reduce"]);
}

#[test]
fn all_gather_and_reduce_scatter_1_to_9_ranks() {
    check(&SMALL, Level::Full, &["all_gather", "reduce_scatter"]);
}

#[test]
fn alltoall_gather_scatter_sendrecv_1_to_9_ranks() {
    check(&SMALL, Level::Full, &["alltoall", "gather", "scatter", "sendrecv"]);
}

#[test]
fn every_collective_16_64_256_ranks() {
    check(&LARGE, Level::Thin, &[]);
}
