//! Every collective and algorithm over TCP (loopback), one process per rank: 1 to 5 ranks.
//! Each rank joins once and runs the whole case list of tests/harness (every type × op at a
//! small count; counts 0, 1, 13, 1031 and about a million elements; roots 0, middle and last;
//! in place and out of place), checking every element against the independent f64 reference.

#[path = "../src/bin/oxccl-perf/colls.rs"]
#[allow(dead_code)]
mod colls;
mod common;
#[path = "../src/bin/oxccl-perf/data.rs"]
#[allow(dead_code)]
mod data;
mod harness;

use harness::{matrix, Level};
use oxccl::Communicator;
use std::time::Duration;

/// Collectives run on every rank count; the others only on 3 and 5 ranks.
const ALWAYS: [&str; 2] = ["all_reduce", "sendrecv"];

fn cases(n: usize) -> Vec<harness::Case> {
    let only: &[&str] = if n == 3 || n == 5 { &[] } else { &ALWAYS };
    matrix(n, Level::Process, only)
}

#[test]
fn child_collectives() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let comm = Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).expect("init");
    let cases = cases(n);
    harness::run_all_or_panic(&comm, &cases);
}

#[test]
fn tcp_collectives_1_to_5_ranks() {
    if common::child_role().is_some() {
        return;
    }
    let env = [("OXCCL_SOCKET_IFNAME", "lo".to_string()), ("OXCCL_TIMEOUT_MS", "60000".to_string())];
    for n in 1..=5 {
        let t = std::time::Instant::now();
        let res = common::run_ranks("child_collectives", n, &env, Duration::from_secs(300));
        eprintln!("{n} ranks: {:.2?}", t.elapsed());
        common::assert_all_ok(&res);
    }
}

/// The same over TCP links driven by helper threads (`OXCCL_NTHREADS`): 3 ranks (every
/// collective), 3 sockets per peer over 2 helpers, the smallest stripe, so that the large cases
/// rotate over every socket and elements straddle stripe boundaries.
#[test]
fn tcp_collectives_over_helper_threads() {
    if common::child_role().is_some() {
        return;
    }
    let env = [
        ("OXCCL_SOCKET_IFNAME", "lo".to_string()),
        ("OXCCL_TIMEOUT_MS", "60000".to_string()),
        ("OXCCL_TRANSPORT", "tcp".to_string()),
        ("OXCCL_NSOCKS", "3".to_string()),
        ("OXCCL_NTHREADS", "2".to_string()),
        ("OXCCL_SOCKET_STRIPE", "65536".to_string()),
        ("OXCCL_DEBUG", "INFO".to_string()),
    ];
    let res = common::run_ranks("child_collectives", 3, &env, Duration::from_secs(300));
    common::assert_all_ok(&res);
    for (r, (_, out)) in res.iter().enumerate() {
        assert!(
            out.contains("via TCP, 3 socket(s), 2 helper thread(s)"),
            "rank {r} did not use helper threads:\n{out}"
        );
    }
}
